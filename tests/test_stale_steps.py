"""Stale steps under `model.fit` (tfkfac/stale_steps.py): a train function of their own.

- Which function runs: with factors every 3 steps and decompositions every 6, the factor
  train function runs at steps 0, 3, 6 and the stale one at every other step; with
  decompositions due apart from factors (a callable interval), at those steps too. Seen
  by wrapping the two real train functions `StaleSteps.choosing` is handed.
- A stale step records no layer call (run eagerly, where every step runs the Python).
- Each of the two train functions traces K-FAC's step once: the optimizer and metrics
  are built before the first trace; the inner optimizer's update is traced once for
  both (one tf.function they call).
- Results: weights, every optimizer variable (factors, decompositions, eigenbasis
  moments), the decompositions an owner holds and the counters after 8 steps are
  bit-identical to `steps_per_execution=2`, where every step is the factor step: the
  stale step computes the same gradients with the same ops (Keras's layer calls instead
  of the recorded ones, the tape asked for the weights only).
- An owner restored from a checkpoint before a stale step runs that step as a factor
  step (it rebuilds its decompositions there) and ends as the uninterrupted run.
- `jit_compile=True` in one process: the stale step compiles with XLA, the factor step
  does not, no warning; the weights differ from `jit_compile=False` by XLA's float32
  rounding only (fused and reordered sums in the convolution and BatchNorm; measured
  5e-6 x max|w| after 8 steps of the eigen method; bound 1e-4). Where the stale step
  cannot compile (phase clocks, steps_per_execution > 1) a warning says why and
  jit_compile is off.
- A stale step with a non-finite gradient is skipped as a factor step is, and its
  warning is printed (outside the graph, which XLA compiles).
"""

import contextlib
import io
import os
import sys
import tempfile
from unittest import mock
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402
from stale_steps_worker import LOSS, chosen_functions, conv_net, state  # noqa: E402
from tfkfac import stale_steps  # noqa: E402

STEPS, BATCH = 8, 8
SETTINGS = dict(learning_rate=0.05, damping=1e-2, factor_update_freq=3,
                decomposition_update_freq=6, xla=False)
# Factors due at 0, 3, 6; every other step stale.
FACTOR_STEPS = (0, 3, 6)
XLA_RTOL = 1e-4


def examples(steps=STEPS):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(steps * BATCH, 8, 8, 1)).astype("float32"),
            rng.integers(0, 5, steps * BATCH))


def compiled(steps_per_execution=1, jit_compile=False, **settings):
    model = conv_net()
    optimizer = sgd_kfac(**dict(SETTINGS, **settings)).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile)
    return model, optimizer


def fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def expected(factor_steps, steps=STEPS):
    return ["factor" if step in factor_steps else "stale" for step in range(steps)]


_DEFAULT_FIT = {}


def default_fit():
    """One fit of SETTINGS (with a metric), made once for the tests that only watch it:
    {"ran": `chosen_functions`, "kfac_built": whether the optimizer was built at each
    trace of K-FAC's step, "inner_eager": whether each of the inner update's calls ran
    eagerly (False: traced), "optimizer"}."""
    if not _DEFAULT_FIT:
        model = conv_net()
        optimizer = sgd_kfac(**SETTINGS).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
        kfac_built, inner_eager = [], []
        apply, inner_apply = tfkfac.KFAC.apply, type(optimizer.inner_optimizer).apply

        def counting_apply(self, *args, **kwargs):
            kfac_built.append(self.built)
            return apply(self, *args, **kwargs)

        def counting_inner_apply(self, *args, **kwargs):
            inner_eager.append(tf.executing_eagerly())
            return inner_apply(self, *args, **kwargs)

        with chosen_functions() as ran, \
                mock.patch.object(tfkfac.KFAC, "apply", counting_apply), \
                mock.patch.object(type(optimizer.inner_optimizer), "apply",
                                  counting_inner_apply):
            fit(model, *examples())
        _DEFAULT_FIT.update(ran=ran, kfac_built=kfac_built, inner_eager=inner_eager,
                            optimizer=optimizer)
    return _DEFAULT_FIT


class ChoiceTest(absltest.TestCase):

    def test_stale_steps_run_the_stale_function_and_due_steps_the_factor_function(self):
        run = default_fit()
        self.assertEqual(run["ran"], expected(FACTOR_STEPS))
        self.assertEqual(run["optimizer"].counters()["factor_updates"], len(FACTOR_STEPS))

    def test_decompositions_due_without_factors_run_the_factor_function(self):
        # Factors at 0 and 4, decompositions every 3 steps (a callable: not a multiple).
        x, y = examples()
        with chosen_functions() as ran:
            model, optimizer = compiled(factor_update_freq=4,
                                        decomposition_update_freq=lambda step: 3)
            fit(model, x, y)
        self.assertEqual(ran, expected((0, 3, 4, 6)))
        self.assertEqual(optimizer.counters()["decomposition_updates"], 3)

    def test_a_new_fit_reads_the_schedule_again(self):
        x, y = examples()
        with chosen_functions() as ran:
            model, _ = compiled()
            fit(model, x[:2 * BATCH], y[:2 * BATCH])  # steps 0, 1
            fit(model, x[2 * BATCH:], y[2 * BATCH:])  # steps 2 ... 7
        self.assertEqual(ran, expected(FACTOR_STEPS))

    def test_where_no_choice_can_be_made_every_step_is_the_factor_step(self):
        x, y = examples()
        for settings in (dict(steps_per_execution=2), dict(factor_examples="fresh")):
            with self.subTest(**settings), chosen_functions() as ran:
                model, optimizer = compiled(**settings)
                if "factor_examples" in settings:  # fresh flags where sample weights go
                    flags = tfkfac.fresh_flags(np.ones(len(y), "float32"))
                    model.fit(x, y, sample_weight=flags, batch_size=BATCH, epochs=1,
                              shuffle=False, verbose=0)
                else:
                    fit(model, x, y)
                self.assertEqual(ran, [])  # the factor function alone, not the choice
                self.assertEqual(optimizer.counters()["factor_updates"], len(FACTOR_STEPS))

    def test_a_stale_step_records_no_layer_call(self):
        x, y = examples()
        model, optimizer = compiled()
        model.run_eagerly = True  # every step runs the Python of its train step
        recorded = []
        for block in optimizer.curvature.blocks:  # the blocks' recording hook
            record = block.pre_activation_call

            def counted(*args, record=record):
                recorded[-1] += 1
                return record(*args)

            block.pre_activation_call = counted

        class PerStep(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                recorded.append(0)

        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[PerStep()])
        blocks = len(optimizer.curvature.blocks)
        self.assertEqual(recorded, [blocks if step in FACTOR_STEPS else 0
                                    for step in range(STEPS)])


class TracingTest(absltest.TestCase):

    def test_each_train_function_traces_the_step_once(self):
        # The metrics' and optimizer's variables are made before the first trace, so
        # TensorFlow does not trace K-FAC's step a second time without them. (The fit
        # has a metric.)
        run = default_fit()
        self.assertEqual(run["kfac_built"], [True, True])  # the factor and the stale one

    def test_the_inner_update_is_traced_once_for_both_train_functions(self):
        run = default_fit()
        self.assertEqual(run["ran"], expected(FACTOR_STEPS))
        self.assertEqual(run["inner_eager"], [False])

    def test_a_metric_without_a_static_shape_is_built_in_the_first_trace(self):
        class Unshaped(keras.metrics.SparseCategoricalAccuracy):
            def result(self):
                value = super().result()
                return tf.numpy_function(lambda v: v, [value], value.dtype, stateful=False)

        model, optimizer = compiled()
        model.compile(optimizer=optimizer, loss=LOSS, metrics=[Unshaped(name="unshaped")])
        history = model.fit(*examples(), batch_size=BATCH, epochs=1, verbose=0)
        self.assertLen(history.history["unshaped"], 1)
        self.assertEqual(optimizer.counters()["steps"], STEPS)


class ResultsTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("eigen", dict(method="eigen")), ("inverse", dict(method="inverse")),
        ("eigen_adam", dict(method="eigen_adam", kl_clip=None)),
        ("eigen_grafted_adam_owner", dict(method="eigen", grafting="adam",
                                          placement="owner")))
    def test_equal_bit_for_bit_to_the_factor_step_alone(self, settings):
        x, y = examples()
        runs = {}
        for steps_per_execution in (1, 2):
            with chosen_functions() as ran:
                model, optimizer = compiled(steps_per_execution, **settings)
                fit(model, x, y)
            self.assertEqual(ran, expected(FACTOR_STEPS) if steps_per_execution == 1 else [])
            runs[steps_per_execution] = state(model, optimizer)
        self.assertEqual(sorted(runs[1]), sorted(runs[2]))
        for key, value in runs[2].items():
            np.testing.assert_array_equal(runs[1][key], value, err_msg=key)

    def test_owner_restored_before_a_stale_step_rebuilds_there_and_resumes_exactly(self):
        x, y = examples()
        settings = dict(placement="owner", method="eigen", factor_update_freq=2,
                        decomposition_update_freq=4)
        model, optimizer = compiled(**settings)
        fit(model, x, y)
        uninterrupted = state(model, optimizer)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "checkpoint")
            model, optimizer = compiled(**settings)
            rows = 5 * BATCH  # steps 0 ... 4; step 5 is stale
            fit(model, x[:rows], y[:rows])
            tf.train.Checkpoint(model=model, optimizer=optimizer).write(path)
            with chosen_functions() as ran:
                model, optimizer = compiled(**settings)
                optimizer.build(model.trainable_variables)
                tf.train.Checkpoint(model=model, optimizer=optimizer).read(path)
                fit(model, x[rows:], y[rows:])
        self.assertEqual(ran, ["factor", "factor", "stale"])  # steps 5 (rebuild), 6, 7
        resumed = state(model, optimizer)
        for key, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=key)


class JitCompileTest(absltest.TestCase):

    def test_the_stale_step_compiles_with_xla_and_matches(self):
        x, y = examples()
        runs = {}
        for jit_compile in (False, True):
            with chosen_functions() as ran, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, optimizer = compiled(jit_compile=jit_compile, method="eigen")
                fit(model, x, y)
            self.assertEqual([str(w.message) for w in caught if "KFAC" in str(w.message)], [])
            self.assertEqual(ran, expected(FACTOR_STEPS))
            self.assertEqual(model.jit_compile, jit_compile)
            runs[jit_compile] = [v.numpy() for v in model.trainable_variables]
        scale = max(np.max(np.abs(w)) for w in runs[False])
        differences = [np.max(np.abs(a - b)) for a, b in zip(runs[True], runs[False])]
        # XLA ran (its rounding differs from TensorFlow's kernels) and agrees.
        self.assertGreater(max(differences), 0.0)
        self.assertLessEqual(max(differences), XLA_RTOL * scale)

    def test_where_the_stale_step_cannot_compile_a_warning_says_why(self):
        x, y = examples()
        for settings, reason in ((dict(phase_clocks=True), "phase_clocks=True"),
                                 (dict(steps_per_execution=2), "steps_per_execution=2")):
            with self.subTest(reason=reason), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, _ = compiled(jit_compile=True, **settings)
                fit(model, x, y)
                said = [str(w.message) for w in caught if "KFAC" in str(w.message)]
                self.assertLen(said, 1)
                self.assertIn(reason, said[0])
                self.assertFalse(model.jit_compile)


class SkippedStaleStepTest(parameterized.TestCase):

    @parameterized.named_parameters(("traced", False), ("xla", True))
    def test_a_non_finite_stale_step_is_skipped_with_a_warning(self, jit_compile):
        x, y = examples(3)
        x[BATCH:2 * BATCH] = np.nan  # step 1, stale
        model, optimizer = compiled(jit_compile=jit_compile)
        fit(model, x[:BATCH], y[:BATCH])
        before = [v.numpy() for v in model.trainable_variables]
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            fit(model, x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
        self.assertIn(stale_steps.SKIPPED_WARNING, printed.getvalue())
        for old, new in zip(before, model.trainable_variables):
            np.testing.assert_array_equal(new.numpy(), old)
        self.assertEqual(optimizer.counters()["skipped_steps"], 1)
        self.assertEqual(optimizer.counters()["steps"], 1)
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            fit(model, x[2 * BATCH:], y[2 * BATCH:])  # a finite stale step: no warning
        self.assertNotIn(stale_steps.SKIPPED_WARNING, printed.getvalue())
        self.assertEqual(optimizer.counters()["steps"], 2)


if __name__ == "__main__":
    absltest.main()
