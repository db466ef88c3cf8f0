"""The blocks of modern layers together: mixed precision and save/restore.

tests/modern_net.py holds one layer of every block kind added for modern architectures.
- Under mixed_float16 and mixed_bfloat16 every block kind is managed, K-FAC state stays
  float32 and finite, and after one step the factors equal the float32 run's within the
  compute dtype's rounding (float16: unscaled output gradients; bfloat16: 8 bits).
- `model.save` / `keras.models.load_model` then `attach` restores every block's state
  (per-group batches, diagonal vectors, decompositions stored in bfloat16 with
  `product_dtype`): the next steps equal an uninterrupted run's.
The per-block math is checked against numpy references in the per-family tests.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import modern_net  # noqa: E402
import tfkfac  # noqa: E402
from kfac_reference import managed_factors  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH = 8
RNG = np.random.default_rng(0)
X = RNG.uniform(size=(6 * BATCH, 28, 28, 1)).astype(np.float32)
Y = RNG.integers(0, 10, size=6 * BATCH)
# Relative error of a factor after one step against float32, by compute dtype (each
# stored factor is a mean of products of numbers rounded to the compute dtype).
FACTOR_RTOL = {"mixed_float16": 2e-2, "mixed_bfloat16": 1e-1}


def compiled(**kfac_args):
    model = modern_net.modern_net(seed=0)
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                            damping=1e-2, kl_clip=1e-3, factor_update_freq=1,
                            decomposition_update_freq=2, xla=False, **kfac_args).attach(model)
    # float16: a loss scale that does not overflow this model's first step (Keras's
    # default 2^15 does, and the step would be skipped).
    wrapped = (keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 7)
               if keras.mixed_precision.global_policy().name == "mixed_float16"
               else optimizer)
    model.compile(optimizer=wrapped, loss=LOSS)
    return model, optimizer


def fit(model, start, steps):
    part = slice(start * BATCH, (start + steps) * BATCH)
    model.fit(X[part], Y[part], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


_FLOAT32_FACTORS = []


def float32_factors():
    """The managed factors after one float32 step, computed once for both policies."""
    if not _FLOAT32_FACTORS:
        model, optimizer = compiled()
        fit(model, 0, 1)
        _FLOAT32_FACTORS.extend(managed_factors(optimizer))
    return _FLOAT32_FACTORS


def state(optimizer):
    """Every optimizer variable: the inner SGD's, the counters, every block's factors and
    decompositions (bfloat16 matrices with product_dtype)."""
    return [v.numpy().copy() for v in optimizer.variables]


class ModernLayersTest(parameterized.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_every_modern_block_is_managed(self):
        _, optimizer = compiled()
        managed = {m["layer"]: m["kind"] for m in optimizer.summary()["managed"]}
        self.assertEqual(managed, modern_net.MANAGED_KINDS)
        self.assertEmpty(optimizer.summary()["skipped"])

    @parameterized.parameters("mixed_float16", "mixed_bfloat16")
    def test_mixed_precision_keeps_float32_state_close_to_float32(self, policy):
        reference = float32_factors()
        keras.mixed_precision.set_global_policy(policy)
        model, optimizer = compiled()
        fit(model, 0, 1)
        self.assertEqual(optimizer.summary()["counters"]["factor_updates"], 1)
        for expected, got in zip(reference, managed_factors(optimizer)):
            self.assertEqual(got.dtype, np.float32)
            scale = np.max(np.abs(expected))
            np.testing.assert_allclose(got, expected, atol=FACTOR_RTOL[policy] * scale)
        fit(model, 1, 3)
        for variable in optimizer.variables:
            self.assertTrue(np.all(np.isfinite(variable.numpy())), variable.path)
        for factor in managed_factors(optimizer):
            self.assertEqual(factor.dtype, np.float32)
        self.assertTrue(all(np.all(np.isfinite(w)) for w in model.get_weights()))

    @parameterized.parameters(None, "bfloat16")
    def test_save_load_continues_like_an_uninterrupted_run(self, product_dtype):
        model, optimizer = compiled(product_dtype=product_dtype)
        fit(model, 0, 3)
        path = os.path.join(tempfile.mkdtemp(), "modern.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        self.assertLen(state(loaded.optimizer), len(state(optimizer)))
        for expected, got in zip(state(optimizer), state(loaded.optimizer)):
            self.assertEqual(got.dtype, expected.dtype)
            np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
        fit(model, 3, 2)
        fit(loaded, 3, 2)
        for expected, got in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


if __name__ == "__main__":
    absltest.main()
