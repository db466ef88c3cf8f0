"""`factor_examples="fresh"`: K-FAC's factors count each source example once under echoing.

The reference is plain K-FAC fed the fresh examples alone (docs/design.md §7):
- one echoed batch (repeats mixed in, in any order): every factor of a model with every
  block kind (tests/modern_net.py), for both weight-sharing rules, equals the factor of
  the batch's fresh examples alone; the loss and gradients still use every example;
- a stream through `model.fit` from `pipelines.build(..., fresh_flags=True)`, example
  echoing and fractional batch echoing: the running factors equal those of a plain
  K-FAC that sees, at every step, the same weights and only that step's fresh examples;
  steps without a fresh example update no factor, and due work (decompositions too)
  waits for the next step with fresh examples;
- without echoing the option changes nothing;
- the trainer's `--factor_examples=fresh` reaches the optimizer and the data: a short
  batch-echo run updates factors on its fresh batches only;
- bad settings and missing flags name what is expected.
The 2-rank version (a rank without fresh examples, N_fresh combined over ranks) is
scenario echo_aware of tests/test_distributed_kfac.py.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402

import pipelines  # noqa: E402
import tfkfac  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
from tfkfac import example_weights  # noqa: E402
from modern_net import modern_net  # noqa: E402
from trainer_testing import SMALL_FLAGS, config_from_argv  # noqa: E402
from trainers import runner  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RNG = np.random.default_rng(0)
# float32 forward passes over batches of different sizes round differently (measured
# 2e-7 x max|factor| for modern_net, where ignoring the flags is 0.34 x max off); the
# statistics themselves are accumulated in float64.
RTOL = 1e-5


def small_cnn(seed):
    """Conv2D, LayerNormalization and Dense layers on 8x8x1 images."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, name="logits"),
    ])


def kfac(model, **kwargs):
    settings = dict(learning_rate=0.05, damping=1e-2, xla=False, state_dtype="float64")
    return sgd_kfac(**dict(settings, **kwargs)).attach(model)


def custom_step(optimizer, model, x, y, **fresh):
    with optimizer.record() as tape:
        loss = LOSS(y, model(x, training=True))
    optimizer.minimize(loss, tape=tape, **fresh)


def all_factors(optimizer, model):
    return {f"{managed['layer']}/{name}": value.numpy()
            for managed in optimizer.summary()["managed"]
            for name, value in optimizer.factors(managed["layer"]).items()}


def assert_factors_equal(test, got, expected):
    """Each factor to RTOL, entries near zero to 1e-5 of its largest; a factor at float32
    rounding noise (below 1e-12 of the largest entry of all: the keys' G of the mean-pooled
    attention, ~1e-17, whose softmax gradients cancel and whose value follows the CPU
    kernels' summation order) to that floor."""
    test.assertEqual(set(got), set(expected))
    floor = 1e-12 * max(float(np.max(np.abs(value))) for value in expected.values())
    for key, value in expected.items():
        atol = max(1e-5 * float(np.max(np.abs(value))), floor)
        np.testing.assert_allclose(np.asarray(got[key], np.float64),
                                   np.asarray(value, np.float64), rtol=RTOL, atol=atol,
                                   err_msg=key)


def echoed(count, repeats):
    """Indices of `count` fresh examples with `repeats` extra copies, shuffled, and the
    fresh flags (1 on the first copy of each)."""
    order = RNG.permutation(np.concatenate([np.arange(count),
                                            RNG.integers(0, count, repeats)]))
    flags = np.zeros(len(order), np.int32)
    flags[[np.flatnonzero(order == i)[0] for i in range(count)]] = 1
    return order, flags


class EchoedBatchTest(absltest.TestCase):

    def test_every_block_kind_counts_each_example_once(self):
        x = RNG.normal(size=(6, 28, 28, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 6)
        order, flags = echoed(6, 5)
        for weight_sharing in ("expand", "reduce"):
            with self.subTest(weight_sharing=weight_sharing):
                reference = modern_net(seed=3)
                plain = kfac(reference, weight_sharing=weight_sharing)
                custom_step(plain, reference, x, y)
                model = modern_net(seed=3)
                fresh_only = kfac(model, weight_sharing=weight_sharing,
                                  factor_examples="fresh")
                custom_step(fresh_only, model, x[order], y[order], fresh=flags)
                assert_factors_equal(self, all_factors(fresh_only, model),
                                     all_factors(plain, reference))
                # The update used every copy: the weights moved differently.
                self.assertFalse(np.allclose(model.get_weights()[0],
                                             reference.get_weights()[0]))

    def test_without_repeats_nothing_changes(self):
        x = RNG.normal(size=(8, 8, 8, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 8)
        models = [small_cnn(seed=1) for _ in range(2)]
        optimizers = [kfac(models[0]), kfac(models[1], factor_examples="fresh")]
        custom_step(optimizers[0], models[0], x, y)
        custom_step(optimizers[1], models[1], x, y, fresh=np.ones(8, np.int32))
        got, expected = (all_factors(o, m) for o, m in zip(optimizers, models))
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        for a, b in zip(models[0].get_weights(), models[1].get_weights()):
            np.testing.assert_array_equal(a, b)


class EchoedStreamTest(absltest.TestCase):
    """`model.fit` on a real echo pipeline against a lockstep plain-K-FAC reference."""

    STEPS, BATCH = 12, 8
    FREQ = dict(factor_update_freq=1, decomposition_update_freq=3)

    def stream(self, **echo):
        source = tf.data.Dataset.from_tensor_slices({
            "image": RNG.integers(0, 256, (64, 8, 8, 1)).astype(np.uint8),
            "label": RNG.integers(0, 10, 64)})
        dataset, _ = pipelines.build(source, batch_size=self.BATCH, seed=5, num_epochs=None,
                                     shuffle_buffer=16, fresh_flags=True, **echo)
        batches = []
        for image, label, slot in dataset.take(self.STEPS):
            # The flags come in `tfkfac.fresh_flags`'s structure, never as a plain tensor
            # (which would be a sample weight).
            self.assertEqual(set(slot), {example_weights.FRESH_KEY})
            batches.append((image.numpy(), label.numpy(),
                            slot[example_weights.FRESH_KEY].numpy()))
        return batches

    def check(self, batches):
        model = small_cnn(seed=2)
        optimizer = kfac(model, factor_examples="fresh", **self.FREQ)
        model.compile(optimizer=optimizer, loss=LOSS)
        reference_model = small_cnn(seed=2)
        reference = kfac(reference_model, **self.FREQ)

        def reference_step(step, logs=None):  # same weights, this step's fresh examples
            x, y, flags = batches[step]
            reference_model.set_weights(model.get_weights())
            if flags.any():
                custom_step(reference, reference_model, x[flags == 1], y[flags == 1])

        dataset = tf.data.Dataset.from_generator(
            lambda: ((x, y, tfkfac.fresh_flags(flags)) for x, y, flags in batches),
            output_signature=tuple(tf.TensorSpec(t.shape, t.dtype) for t in batches[0][:2])
            + (tfkfac.fresh_flags(tf.TensorSpec(batches[0][2].shape, batches[0][2].dtype)),))
        lockstep = keras.callbacks.LambdaCallback(on_train_batch_begin=reference_step)
        model.fit(dataset, epochs=1, steps_per_epoch=len(batches), verbose=0, shuffle=False,
                  callbacks=[lockstep])
        assert_factors_equal(self, all_factors(optimizer, model),
                             all_factors(reference, reference_model))
        # Due work waits for a step with fresh examples: decompositions every 3 steps.
        fresh_steps = [s for s, (_, _, flags) in enumerate(batches) if flags.any()]
        decompositions, due = 0, 0
        for step in fresh_steps:
            if step >= due:
                decompositions, due = decompositions + 1, step + 3
        counters = optimizer.summary()["counters"]
        self.assertEqual(counters["factor_updates"], len(fresh_steps))
        self.assertEqual(counters["decomposition_updates"], decompositions)
        self.assertEqual(counters["steps"], self.STEPS)
        return fresh_steps, decompositions

    def test_example_echoing(self):
        batches = self.stream(echo_mode="example_after_augment", echo_factor=2)
        fresh = sum(int(flags.sum()) for _, _, flags in batches)
        self.assertBetween(fresh, 0.3 * self.STEPS * self.BATCH, 0.7 * self.STEPS * self.BATCH)
        fresh_steps, _ = self.check(batches)
        self.assertLen(fresh_steps, self.STEPS)  # repeats mixed into every batch

    def test_batch_echoing_repeats_are_stale_steps(self):
        batches = self.stream(echo_mode="batch", echo_factor=2.5)
        fresh_steps, decompositions = self.check(batches)
        self.assertBetween(len(fresh_steps), 3, 7)
        # Due decompositions fell on repeated batches and waited (not every 3rd step).
        self.assertNotEqual(decompositions, len(range(0, self.STEPS, 3)))


class TrainerTest(absltest.TestCase):

    def test_batch_echo_run_updates_factors_on_fresh_batches_only(self):
        # Batch echoing with e = 2: steps 0 and 2 are fresh, 1 and 3 their repeats.
        argv = ["--model=mlp", "--steps=4", "--echo_mode=batch", "--echo_factor=2",
                "--factor_update_freq=1", "--decomposition_update_freq=2", *SMALL_FLAGS]
        with tempfile.TemporaryDirectory() as directory:
            for factor_examples, factor_updates in (("fresh", 2), ("all", 4)):
                config, given = config_from_argv(
                    *argv, f"--factor_examples={factor_examples}",
                    f"--model_dir={directory}/{factor_examples}")
                counters = runner.run(config, given)["kfac"]["counters"]
                self.assertEqual(counters["factor_updates"], factor_updates, factor_examples)
                self.assertEqual(counters["decomposition_updates"], 2, factor_examples)

    def test_bad_flags(self):
        with self.assertRaisesRegex(flags.IllegalFlagValueError, "all|fresh"):
            config_from_argv("--factor_examples=first")
        config, given = config_from_argv("--optimizer=sgd", "--factor_examples=fresh")
        with self.assertRaisesRegex(ValueError, "factor_examples only applies to "
                                                "optimizer=kfac"):
            runner.check(config, given)


class BadSettingsTest(absltest.TestCase):

    def test_unknown_choice_names_allowed_values(self):
        with self.assertRaisesRegex(ValueError, r"`factor_examples` must be one of "
                                                r"all, fresh; received 'unique'"):
            tfkfac.KFAC(factor_examples="unique")
        with self.assertRaisesRegex(ValueError, "`fresh_flags` must be True or False"):
            pipelines.build(tf.data.Dataset.range(1), batch_size=1, fresh_flags="yes")

    def test_flags_must_match_the_setting(self):
        x = RNG.normal(size=(4, 8, 8, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 4)
        model = small_cnn(seed=1)
        optimizer = kfac(model, factor_examples="fresh")
        model.compile(optimizer=optimizer, loss=LOSS)
        with self.assertRaisesRegex(ValueError, r"third element of every training batch, "
                                                r"made by `tfkfac.fresh_flags\(flags\)`.*"
                                                "this batch has no third element"):
            model.fit(x, y, batch_size=4, verbose=0)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "one flag per example"):
            custom_step(optimizer, model, x, y, fresh=np.ones(3, np.int32))
        plain_model = small_cnn(seed=1)
        plain = kfac(plain_model)
        with self.assertRaisesRegex(ValueError, "only with KFAC\\(factor_examples='fresh'\\)"):
            custom_step(plain, plain_model, x, y, fresh=np.ones(4, np.int32))
        self.assertEqual(tfkfac.KFAC.from_config(optimizer.get_config()).factor_examples,
                         "fresh")


if __name__ == "__main__":
    absltest.main()
