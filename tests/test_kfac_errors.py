"""tfkfac.KFAC: bad input, unattached use, unsupported / skipped / shared layers.

- Every bad hyperparameter raises a ValueError worded "`name` must be ...; received X",
  from `KFAC(...)` and from `tfkfac.KFACConfig(...)` alike (NaN and inf never pass).
  An unknown argument is a TypeError as Python words it; an inner optimizer together
  with KFAC-level learning_rate / momentum / weight_decay, a Keras-level option
  (clipnorm, ...) on KFAC, or `config` together with settings are ValueErrors that say
  what to do instead. Renamed arguments still work with a DeprecationWarning.
- A KFAC compiled on a model it was not attached to fails on fit with the attach hint.
- Layers without a K-FAC block (PReLU, SimpleRNN) are listed in
  summary()["skipped"] with a reason, one warning names them at attach, and they get the
  plain momentum-SGD update (m ← μ m - η g; w ← w + m) with the raw gradient from an
  independent tf.GradientTape — not KL-clipped, not preconditioned.
- skip_layers matches names by regex (full match); skipped layers get the plain update
  and the managed head still gets -lr (A ⊗ G + λI)⁻¹ vec(∇) (np.kron reference).
- A Dense layer shared by two calls follows the documented rule (tfkfac/blocks/
  kronecker.py): statistics over all uses, T counts positions over calls, i.e.
  A = (1/N) Σ_i Σ_c ā_ic ā_icᵀ, G = (1/(N T)) Σ_i Σ_c g_ic g_icᵀ, T = 2, g = N dL/ds,
  ∇ = Σ_c [dL/dW; dL/db]_c — checked against a float64 numpy forward/backward.

Tolerances: rtol 1e-4 with an absolute floor of 1e-5 * max|ref| (float32 vs float64).
"""

import os
import re
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, LR, N, assert_close, kron_precondition,  # noqa: E402
                            loop_step)


def np_weights(layer):
    return layer.kernel.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)


def raw_gradients(model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return [tf.convert_to_tensor(g).numpy().astype(np.float64)
            for g in tape.gradient(loss, model.trainable_variables)]


def kfac_warnings(caught):
    return [w for w in caught if "KFAC" in str(w.message)]


CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MSE = keras.losses.MeanSquaredError()


class BadInputTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("lr_zero", "learning_rate", 0.0),
        ("lr_negative", "learning_rate", -0.1),
        ("damping_zero", "damping", 0.0),
        ("damping_negative", "damping", -1e-3),
        ("decay_negative", "factor_decay", -0.1),
        ("decay_one", "factor_decay", 1.0),
        ("decay_above_one", "factor_decay", 1.5),
        ("factor_freq_zero", "factor_update_freq", 0),
        ("factor_freq_negative", "factor_update_freq", -2),
        ("factor_freq_float", "factor_update_freq", 1.5),
        ("factor_freq_bool", "factor_update_freq", True),
        ("factor_freq_above_int64", "factor_update_freq", 10**19),
        ("decomposition_freq_above_int64", "decomposition_update_freq", 2**63),
        ("decomposition_freq_zero", "decomposition_update_freq", 0),
        ("decomposition_freq_float", "decomposition_update_freq", 10.0),
        ("decomposition_freq_string", "decomposition_update_freq", "10"),
        ("diagonal_damping_zero", "diagonal_damping_multiplier", 0.0),
        ("diagonal_damping_nan", "diagonal_damping_multiplier", float("nan")),
        ("method", "method", "cholesky"),
        ("kl_clip_zero", "kl_clip", 0.0),
        ("kl_clip_negative", "kl_clip", -1e-3),
        ("kl_clip_inf", "kl_clip", float("inf")),
        ("lr_nan", "learning_rate", float("nan")),
        ("lr_inf", "learning_rate", float("inf")),
        ("damping_nan", "damping", float("nan")),
        ("damping_inf", "damping", float("inf")),
        ("momentum_nan", "momentum", float("nan")),
        ("decay_nan", "factor_decay", float("nan")),
        ("weight_sharing", "weight_sharing", "mean"),
        ("placement", "placement", "sharded"),
        ("wire_dtype", "decomposition_wire_dtype", "float8"),
        ("xla", "xla", "yes"),
        ("momentum_one", "momentum", 1.0),
        ("weight_decay_negative", "weight_decay", -1e-4),
        ("weight_decay_inf", "weight_decay", float("inf")),
        ("inner_optimizer", "inner_optimizer", "sgd"),
        ("factor_batch_fraction_zero", "factor_batch_fraction", 0.0),
        ("product_dtype", "product_dtype", "float16"),
        ("phase_clocks", "phase_clocks", 1),
        ("skip_layers_string", "skip_layers", "dense"),
        ("momentum_string", "momentum", "0.9"),
        ("weight_decay_string", "weight_decay", "1e-4"),
        ("skip_layers_int", "skip_layers", 5),
        ("skip_layers_none", "skip_layers", None),
        ("wire_dtype_as_dtype", "factor_wire_dtype", tf.float16),
        ("communicator_string", "communicator", "horovod"),
    )
    def test_value_error_names_argument(self, argument, value):
        with self.assertRaisesRegex(ValueError, f"^`{argument}` must be .*; received "):
            tfkfac.KFAC(**{argument: value})

    @parameterized.named_parameters(
        ("config_damping_nan", "damping", float("nan")),
        ("config_damping_inf", "damping", float("inf")),
        ("config_decay_nan", "factor_decay", float("nan")),
        ("config_kl_clip_inf", "kl_clip", float("inf")),
        ("config_kl_clip_nan", "kl_clip", float("nan")),
        ("config_fraction_nan", "factor_batch_fraction", float("nan")),
        ("config_fraction_above_one", "factor_batch_fraction", 1.5),
        ("config_diagonal_inf", "diagonal_damping_multiplier", float("inf")),
        ("config_method", "method", "svd"),
        ("config_placement", "placement", "sharded"),
        ("config_state_dtype", "state_dtype", "float16"),
        ("config_factor_examples", "factor_examples", "echoed"),
        ("config_wire_dtype", "factor_wire_dtype", "int8"),
        ("config_xla_string", "xla", "true"),
        ("config_factor_freq_inf", "factor_update_freq", float("inf")),
        ("config_decay_string", "factor_decay", "0.95"),
        ("config_diagonal_none", "diagonal_damping_multiplier", None),
        ("config_fraction_string", "factor_batch_fraction", "half"),
    )
    def test_config_rejects_bad_values_naming_the_setting(self, setting, value):
        with self.assertRaisesRegex(ValueError, f"^`{setting}` must be .*; received "
                                                f"{re.escape(repr(value))}"):
            tfkfac.KFACConfig(**{setting: value})

    def test_allowed_ranges_in_messages(self):
        with self.assertRaisesRegex(ValueError, r"factor_decay.*\[0, 1\)"):
            tfkfac.KFAC(factor_decay=1.0)
        with self.assertRaisesRegex(ValueError, r"learning_rate.*> 0"):
            tfkfac.KFAC(learning_rate=0.0)
        with self.assertRaisesRegex(ValueError, r"method.*eigen.*inverse"):
            tfkfac.KFAC(method="svd")
        with self.assertRaisesRegex(ValueError, r"kl_clip.*> 0.*None disables it"):
            tfkfac.KFACConfig(kl_clip=0.0)

    @parameterized.named_parameters(
        ("decomposition_interval", "inv_update_freq", "decomposition_update_freq", 20),
        ("diagonal_damping", "bn_damping_multiplier", "diagonal_damping_multiplier", 3.0),
        ("wire_dtype", "eigen_wire_dtype", "decomposition_wire_dtype", "float16"),
    )
    def test_renamed_argument_still_works_with_a_deprecation_warning(self, old, new, value):
        with self.assertWarnsRegex(DeprecationWarning, f"`{old}` is deprecated, use `{new}`"):
            opt = tfkfac.KFAC(**{old: value})
        self.assertEqual(getattr(opt, new), value)
        self.assertEqual(opt.config, tfkfac.KFACConfig(**{new: value}))
        self.assertEqual(opt.get_config()[new], value)
        self.assertNotIn(old, opt.get_config())

    def test_old_and_new_names_at_different_values_are_refused(self):
        with self.assertRaisesRegex(ValueError, r"^KFAC: `eigen_wire_dtype` is the deprecated "
                                    r"name of `decomposition_wire_dtype`; received "
                                    r"eigen_wire_dtype='float16' and "
                                    r"decomposition_wire_dtype='float32': give "
                                    r"`decomposition_wire_dtype` only$"):
            tfkfac.KFAC(decomposition_wire_dtype="float32", eigen_wire_dtype="float16")
        with self.assertWarnsRegex(DeprecationWarning, "`inv_update_freq` is deprecated"):
            opt = tfkfac.KFAC(inv_update_freq=20, decomposition_update_freq=20)
        self.assertEqual(opt.decomposition_update_freq, 20)

    def test_decomposition_freq_must_be_multiple_of_factor_freq(self):
        with self.assertRaisesRegex(ValueError,
                                    "decomposition_update_freq.*factor_update_freq"):
            tfkfac.KFAC(factor_update_freq=2, decomposition_update_freq=3)
        tfkfac.KFAC(factor_update_freq=2, decomposition_update_freq=6)  # a multiple is fine

    def test_valid_defaults_construct(self):
        opt = tfkfac.KFAC()
        self.assertEqual((opt.method, opt.damping, opt.kl_clip), ("inverse", 0.03, None))
        self.assertEqual(opt.factor_decay, 0.95)
        self.assertEqual((opt.factor_update_freq, opt.decomposition_update_freq), (10, 100))
        self.assertEqual(opt.config, tfkfac.KFACConfig())
        # The default update rule (tests/test_default.py): ScheduleFreeAdamW at KFAC's
        # learning rate, its β1 KFAC's momentum.
        self.assertIsInstance(opt.inner_optimizer, tfkfac.ScheduleFreeAdamW)
        self.assertEqual(opt.inner_optimizer.beta_1, 0.9)
        np.testing.assert_allclose(float(opt.learning_rate), 0.01, rtol=1e-7)
        np.testing.assert_allclose(float(opt.inner_optimizer.learning_rate), 0.01, rtol=1e-7)

    def test_settings_come_from_keywords_or_a_config_not_both(self):
        config = tfkfac.KFACConfig(damping=0.1, method="inverse")
        self.assertEqual(tfkfac.KFAC(config=config).config, config)
        self.assertEqual(tfkfac.KFAC(damping=0.1, method="inverse").damping, 0.1)
        with self.assertRaisesRegex(ValueError, r"either `config` or .*\['damping'\]"):
            tfkfac.KFAC(config=config, damping=0.2)
        with self.assertRaisesRegex(ValueError, "`config` must be a tfkfac.KFACConfig"):
            tfkfac.KFAC(config={"damping": 0.1})

    def test_unknown_argument_is_a_type_error(self):
        with self.assertRaisesRegex(TypeError,
                                    r"KFAC\(\) got an unexpected keyword argument 'dampnig'"):
            tfkfac.KFAC(dampnig=1e-3)

    @parameterized.parameters("learning_rate", "momentum", "weight_decay")
    def test_inner_optimizer_with_a_kfac_level_update_argument_is_an_error(self, argument):
        inner = keras.optimizers.AdamW(1e-3)
        value = {"learning_rate": 0.5, "momentum": 0.5, "weight_decay": 1e-4}[argument]
        with self.assertRaisesRegex(ValueError, f"inner_optimizer.*{argument}"):
            tfkfac.KFAC(inner_optimizer=inner, **{argument: value})

    @parameterized.parameters("clipnorm", "clipvalue", "global_clipnorm", "use_ema")
    def test_keras_update_options_belong_on_the_inner_optimizer(self, argument):
        with self.assertRaisesRegex(ValueError, f"`{argument}`.*set it on the "
                                                "`inner_optimizer`"):
            tfkfac.KFAC(**{argument: 1.0 if argument != "use_ema" else True})

    def test_attach_needs_a_built_model(self):
        model = keras.Sequential([keras.layers.Dense(2)])
        with self.assertRaisesRegex(ValueError, "built"):
            tfkfac.KFAC().attach(model)


class AttachTest(absltest.TestCase):

    def test_compiled_unbuilt_without_attach_raises_the_hint_on_fit(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Dense(2)])  # no Input: unbuilt at compile
        model.compile(optimizer=tfkfac.KFAC(xla=False), loss=MSE)
        x = np.zeros((4, 3), np.float32)
        y = np.zeros((4, 2), np.float32)
        with self.assertRaisesRegex(Exception, r"attach\(model\)"):
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)


class UnsupportedLayerTest(absltest.TestCase):

    def test_prelu_and_recurrent_layer_get_plain_momentum_sgd(self):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras.layers.PReLU(name="prelu", alpha_initializer="random_normal")(inputs)
        h = keras.layers.Reshape((3, 1))(h)
        h = keras.layers.SimpleRNN(4, name="rnn")(h)  # weights in its cell
        outputs = keras.layers.Dense(2, name="head")(h)
        model = keras.Model(inputs, outputs)
        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR, momentum=0.9), damping=DAMPING,
                          kl_clip=1e-3, xla=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.attach(model)
        messages = kfac_warnings(caught)
        self.assertLen(messages, 1, [str(w.message) for w in caught])
        self.assertIn("prelu", str(messages[0].message))
        self.assertIn("simple_rnn_cell", str(messages[0].message))

        summary = opt.summary()
        self.assertEqual([m["layer"] for m in summary["managed"]], ["head"])
        skipped = {s["layer"]: s["reason"] for s in summary["skipped"]}
        self.assertEqual(set(skipped), {"prelu", "rnn/simple_rnn_cell"})
        for reason in skipped.values():
            self.assertTrue(reason)

        rng = np.random.default_rng(4)
        unmanaged = [i for i, v in enumerate(model.trainable_variables)
                     if not v.path.startswith("head")]
        self.assertLen(unmanaged, 4)  # alpha; kernel, recurrent kernel, bias
        momentum = None
        for step in range(2):
            x = rng.normal(size=(N, 3)).astype(np.float32)
            y = rng.integers(0, 2, size=N)
            grads = raw_gradients(model, CE, x, y)
            deltas = loop_step(model, opt, CE, x, y)
            expected = [-LR * grads[i] if momentum is None else
                        0.9 * momentum[k] - LR * grads[i]
                        for k, i in enumerate(unmanaged)]
            for k, i in enumerate(unmanaged):
                assert_close(deltas[i], expected[k], msg=f"step {step} "
                             f"{model.trainable_variables[i].path}")
            momentum = [deltas[i] for i in unmanaged]


class SkipLayersTest(absltest.TestCase):

    def test_regex_skip_gets_plain_update_and_head_stays_kfac(self):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", name="dense_a"),
            keras.layers.Dense(4, activation="tanh", name="dense_b"),
            keras.layers.Dense(3, name="head", bias_initializer="random_normal"),
        ])
        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                          method="eigen", skip_layers=["dense_.*"], xla=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.attach(model)
        self.assertEmpty(kfac_warnings(caught))  # skipping on request is not a surprise
        summary = opt.summary()
        self.assertEqual([m["layer"] for m in summary["managed"]], ["head"])
        self.assertEqual({s["layer"] for s in summary["skipped"]}, {"dense_a", "dense_b"})
        for s in summary["skipped"]:
            self.assertIn("skip_layers", s["reason"])

        rng = np.random.default_rng(6)
        x = rng.normal(size=(N, 5)).astype(np.float32)
        y = rng.normal(size=(N, 3)).astype(np.float32)
        # numpy forward/backward of the whole net; the head's K-FAC reference
        (w1, b1), (w2, b2), (w3, b3) = [np_weights(l) for l in model.layers]
        h1 = np.tanh(x @ w1 + b1)
        h2 = np.tanh(h1 @ w2 + b2)
        s = h2 @ w3 + b3
        ds = 2.0 * (s - y) / s.size
        a_bar = np.concatenate([h2, np.ones((N, 1))], 1)
        A, G = a_bar.T @ a_bar / N, (N * ds).T @ (N * ds) / N
        p = kron_precondition(A, G, a_bar.T @ ds, DAMPING)

        grads = raw_gradients(model, MSE, x, y)
        deltas = loop_step(model, opt, MSE, x, y)
        for i in range(4):  # dense_a, dense_b kernels and biases: plain SGD
            assert_close(deltas[i], -LR * grads[i], msg=model.trainable_variables[i].path)
        assert_close(deltas[4], -LR * p[:-1], msg="head kernel")
        assert_close(deltas[5], -LR * p[-1], msg="head bias")
        self.assertGreater(np.max(np.abs(deltas[4] + LR * grads[4])), 1e-3)

    def test_skip_by_class_name(self):
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        opt = tfkfac.KFAC(skip_layers=["BatchNormalization"], xla=False)
        opt.attach(model)
        kinds = [m["kind"] for m in opt.summary()["managed"]]
        self.assertEqual(kinds, ["dense", "dense"])
        self.assertLen(opt.summary()["skipped"], 1)


class SharedLayerTest(absltest.TestCase):

    def test_shared_dense_statistics_over_all_uses(self):
        keras.utils.set_random_seed(9)
        in1, in2 = keras.Input((5,)), keras.Input((5,))
        shared = keras.layers.Dense(3, activation="tanh", name="shared",
                                    bias_initializer="random_normal")
        head = keras.layers.Dense(2, name="head")
        outputs = head(keras.layers.Concatenate()([shared(in1), shared(in2)]))
        model = keras.Model([in1, in2], outputs)
        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                          method="eigen", xla=False)
        opt.attach(model)
        self.assertEqual([m["layer"] for m in opt.summary()["managed"]],
                         ["shared", "head"])

        rng = np.random.default_rng(10)
        x1 = rng.normal(size=(N, 5)).astype(np.float32)
        x2 = rng.normal(size=(N, 5)).astype(np.float32)
        y = rng.normal(size=(N, 2)).astype(np.float32)
        w, b = np_weights(shared)
        w2, b2 = np_weights(head)
        s1, s2 = x1 @ w + b, x2 @ w + b
        out = np.concatenate([np.tanh(s1), np.tanh(s2)], 1) @ w2 + b2
        d_out = 2.0 * (out - y) / out.size
        d_hidden = d_out @ w2.T
        ds1 = d_hidden[:, :3] * (1 - np.tanh(s1) ** 2)
        ds2 = d_hidden[:, 3:] * (1 - np.tanh(s2) ** 2)
        a1 = np.concatenate([x1, np.ones((N, 1))], 1)
        a2 = np.concatenate([x2, np.ones((N, 1))], 1)
        calls = 2  # T: one position per call, two calls
        A = (a1.T @ a1 + a2.T @ a2) / N
        G = ((N * ds1).T @ (N * ds1) + (N * ds2).T @ (N * ds2)) / (N * calls)
        grad = a1.T @ ds1 + a2.T @ ds2
        p = kron_precondition(A, G, grad, DAMPING)

        deltas = loop_step(model, opt, MSE, [x1, x2], y)
        factors = opt.factors("shared")
        stored_a, stored_g = factors["A"].numpy(), factors["G"].numpy()
        assert_close(stored_a, A, msg="shared A")
        assert_close(stored_g, G, msg="shared G")
        assert_close(deltas[0], -LR * p[:-1], msg="shared kernel")
        assert_close(deltas[1], -LR * p[-1], msg="shared bias")


if __name__ == "__main__":
    absltest.main()
