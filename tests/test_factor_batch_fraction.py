"""`factor_batch_fraction`: factor statistics from a random part of each batch.

The reference is plain K-FAC fed the kept examples alone (docs/design.md §8):
- the Kronecker factors of a model with every block kind (tests/modern_net.py), for both
  weight-sharing rules, equal plain K-FAC's on the sub-batch of the examples
  `kept_examples` draws; the normalization blocks keep the whole batch (also a
  BatchNorm's);
- with `factor_examples="fresh"` the kept examples keep their whole-batch weights: the
  factors are the fresh-only factors of the sub-batch times n_fresh(kept) N / (n N_fresh);
- at fraction 1 nothing changes, bit for bit;
- the draw: ceil(fraction N) distinct sorted indices, the same for the same (step, rank),
  every example equally likely over steps;
- the trainer's `--factor_batch_fraction` reaches the optimizer; bad values name the
  argument and the allowed range.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import assert_close  # noqa: E402
from modern_net import modern_net  # noqa: E402
from test_kfac_fresh_examples import (  # noqa: E402
    RTOL, all_factors, custom_step, kfac)
from tfkfac.curvature import kept_examples  # noqa: E402
from trainer_testing import SMALL_FLAGS, config_from_argv  # noqa: E402
from trainers import runner  # noqa: E402

RNG = np.random.default_rng(1)


def split_by_kind(factors):
    """(Kronecker-block factors, diagonal-block factors) of `all_factors`: a diagonal
    block's one factor is named "F" (`KFAC.factors`)."""
    diagonal = {k: v for k, v in factors.items() if k.rsplit("/", 1)[1] == "F"}
    return {k: v for k, v in factors.items() if k not in diagonal}, diagonal


def assert_all_close(test, got, expected, scale=1.0):
    test.assertEqual(set(got), set(expected))
    for key in expected:
        assert_close(got[key], scale * expected[key], rtol=RTOL, msg=key)


def one_step(model, x, y, flags=None, **settings):
    optimizer = kfac(model, **settings)
    custom_step(optimizer, model, x, y, **({} if flags is None else {"fresh": flags}))
    return optimizer, all_factors(optimizer, model)


class SubBatchTest(absltest.TestCase):
    N, FRACTION = 8, 0.5

    def setUp(self):
        self.x = RNG.normal(size=(self.N, 28, 28, 1)).astype(np.float32)
        self.y = RNG.integers(0, 10, self.N)
        # The first factor step is step 0, on rank 0.
        self.keep = kept_examples(self.N, self.FRACTION, 0, 0).numpy()

    def test_kronecker_factors_are_the_sub_batch_ones(self):
        for weight_sharing in ("expand", "reduce"):
            with self.subTest(weight_sharing=weight_sharing):
                model = modern_net(seed=4)
                optimizer, got = one_step(model, self.x, self.y, weight_sharing=weight_sharing,
                                          factor_batch_fraction=self.FRACTION)
                _, sub_batch = one_step(modern_net(seed=4), self.x[self.keep],
                                        self.y[self.keep], weight_sharing=weight_sharing)
                _, whole_batch = one_step(modern_net(seed=4), self.x, self.y,
                                          weight_sharing=weight_sharing)
                got_kronecker, got_diagonal = split_by_kind(got)
                expected_kronecker, _ = split_by_kind(sub_batch)
                _, expected_diagonal = split_by_kind(whole_batch)
                self.assertLen(got_diagonal, 2)  # layer_norm, group_norm
                assert_all_close(self, got_kronecker, expected_kronecker)
                assert_all_close(self, got_diagonal, expected_diagonal)
                self.assertFalse(np.allclose(got["logits/A"], whole_batch["logits/A"]))

    def test_batch_norm_keeps_the_whole_batch(self):
        def model():
            keras.utils.set_random_seed(6)
            return keras.Sequential([
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(4, 3, strides=2, name="conv"),
                keras.layers.BatchNormalization(name="bn"),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10, name="logits")])

        optimizer, got = one_step(model(), self.x, self.y, factor_batch_fraction=self.FRACTION)
        _, whole_batch = one_step(model(), self.x, self.y)
        self.assertEqual(split_by_kind(got)[1].keys(), {"bn/F"})
        assert_close(got["bn/F"], whole_batch["bn/F"], rtol=RTOL)
        self.assertFalse(np.allclose(got["conv/A"], whole_batch["conv/A"]))

    def test_fresh_weights_stay_whole_batch_weights(self):
        flags = np.array([1, 0, 1, 1, 0, 1, 0, 1], np.int32)
        kept_flags = flags[self.keep]
        self.assertGreater(kept_flags.sum(), 0)
        model = modern_net(seed=5)
        optimizer, got = one_step(model, self.x, self.y, flags, factor_examples="fresh",
                                  factor_batch_fraction=self.FRACTION)
        _, sub_batch = one_step(modern_net(seed=5), self.x[self.keep], self.y[self.keep],
                                kept_flags, factor_examples="fresh")
        _, whole_batch = one_step(modern_net(seed=5), self.x, self.y, flags,
                                  factor_examples="fresh")
        got_kronecker, got_diagonal = split_by_kind(got)
        # Kept example i weighs flags_i N / N_fresh in the mean over the n kept examples;
        # the sub-batch run gives it flags_i n / n_fresh(kept).
        scale = kept_flags.sum() * self.N / (len(self.keep) * flags.sum())
        assert_all_close(self, got_kronecker, split_by_kind(sub_batch)[0], scale)
        assert_all_close(self, got_diagonal, split_by_kind(whole_batch)[1])

    def test_fraction_one_changes_nothing(self):
        _, default = one_step(modern_net(seed=7), self.x, self.y)
        _, whole = one_step(modern_net(seed=7), self.x, self.y, factor_batch_fraction=1.0)
        for key in default:
            np.testing.assert_array_equal(whole[key], default[key], err_msg=key)


class KeptExamplesTest(absltest.TestCase):

    def test_count_order_and_determinism(self):
        for batch, fraction in ((10, 0.3), (128, 0.25), (7, 0.01), (5, 1.0), (9, 0.5)):
            keep = kept_examples(batch, fraction, 3, 0).numpy()
            self.assertLen(keep, max(1, math.ceil(fraction * batch)))
            self.assertTrue(np.all(np.diff(keep) > 0))
            self.assertTrue(np.all((keep >= 0) & (keep < batch)))
            np.testing.assert_array_equal(keep, kept_examples(batch, fraction, 3, 0).numpy())
        draws = {tuple(kept_examples(64, 0.25, step, rank).numpy())
                 for step in range(3) for rank in range(2)}
        self.assertLen(draws, 6)

    def test_every_example_equally_likely(self):
        batch, fraction, steps = 8, 0.5, 2000
        counts = np.zeros(batch)
        for step in range(steps):
            counts[kept_examples(batch, fraction, step, 1).numpy()] += 1
        # Each example is kept with probability 1/2: 1000 ± 22 (one standard deviation).
        np.testing.assert_allclose(counts / steps, fraction, atol=0.05)


class SettingsTest(absltest.TestCase):

    def test_bad_values_name_the_argument(self):
        for value in (0, 0.0, -0.5, 1.5, float("nan"), float("inf"), "half", True):
            with self.subTest(value=value), self.assertRaisesRegex(
                    ValueError, r"`factor_batch_fraction` must be a finite number in \(0, 1\]; "
                                r"received "):
                tfkfac.KFAC(factor_batch_fraction=value)

    def test_config_round_trip(self):
        optimizer = tfkfac.KFAC(factor_batch_fraction=0.25)
        restored = tfkfac.KFAC.from_config(optimizer.get_config())
        self.assertEqual(restored.factor_batch_fraction, 0.25)

    def test_trainer_flag_reaches_the_optimizer(self):
        config, given = config_from_argv("--model=mlp", "--factor_batch_fraction=0.25",
                                         *SMALL_FLAGS)
        self.assertEqual(config.factor_batch_fraction, 0.25)
        config.validate(given)
        self.assertEqual(runner.Trainer(config).optimizer.factor_batch_fraction, 0.25)
        bad, given = config_from_argv("--model=mlp", "--factor_batch_fraction=2")
        with self.assertRaisesRegex(ValueError, "factor_batch_fraction"):
            bad.validate(given)
        sgd, given = config_from_argv("--optimizer=sgd", "--factor_batch_fraction=0.5")
        with self.assertRaisesRegex(ValueError, "only applies to optimizer=kfac"):
            sgd.validate(given)


if __name__ == "__main__":
    absltest.main()
