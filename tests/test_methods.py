"""Preconditioning methods as objects (`tfkfac.Method`, tfkfac/methods.py).

A method written here, outside tfkfac and touching no block, trains every block kind of
tests/every_block_net.py: `DiagonalKronecker` preconditions a Kronecker pair by the
diagonal of A ⊗ G, P[i, j] = ∇[i, j] / (a_i g_j + λ) with a, g the factors' diagonals
(an Embedding's A is one already), and a normalization layer's diagonal F as
∇ / (F + ρλ). It keeps no decomposition. With a float64 model and state and an inner
SGD(lr, momentum=0), every managed layer's update over 3 steps is -lr·P of numpy on the
factors `KFAC.factors` reports and the raw gradients, to 1e-9.

The built-in methods as objects train exactly as their names do (`Eigen()` as "eigen",
`EigenAdam(β2, ε)` as "eigen_adam" with those `adam_beta_2`, `adam_epsilon`); a
method object survives `get_config`/`from_config` and a .keras file when Keras knows
its class, and `model.save` refuses it, naming the fix, when Keras does not; a value
that is neither a name nor a Method is refused naming `method`, and so are
`adam_beta_2`/`adam_epsilon` where nothing would read them (beside an EigenAdam object or
another method, without grafting='adam').
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import every_block_net as net  # noqa: E402
import tfkfac  # noqa: E402

LR = 2.0 ** -7
DAMPING, RHO = 0.25, 2.0
BATCH, STEPS = 16, 3
FLOAT64_RTOL = 1e-9


def diagonal(factor):
    """A factor's diagonal: a vector as it is, a (batch of) matrix's diagonal."""
    return factor if factor.ndim == 1 else np.diagonal(factor, axis1=-2, axis2=-1)


@keras.saving.register_keras_serializable(package="test_methods")
class DiagonalKronecker(tfkfac.Method):
    """(diag(A) ⊗ diag(G) + λI)⁻¹ vec(∇) for a pair; ∇ / (F + ρλ) for a lone diagonal."""

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        if not piece.pair:
            (fisher,) = factors
            return matrix / (fisher + piece.damping_multiplier * damping), []
        a, g = [f if is_diagonal else tf.linalg.diag_part(f)
                for f, is_diagonal in zip(factors, piece.diagonal)]
        return matrix / (a[..., :, None] * g[..., None, :] + damping), []


class Unregistered(DiagonalKronecker):
    """The same method, unknown to Keras's serialization."""


def expected_update(optimizer, model, grads):
    """{layer: P per piece} of `DiagonalKronecker` in numpy, from the factors the
    optimizer reports and `grads`; other layers' raw gradients."""
    managed = {m["layer"] for m in optimizer.summary()["managed"]}
    expected = {}
    for layer in net.trainable_layers(model):
        layer_grads = grads[layer.name]
        if layer.name not in managed:
            expected[layer.name] = layer_grads
            continue
        pieces = []
        for part, grad in zip(net.factor_parts(optimizer.factors(layer)),
                              net.block_matrices(layer, layer_grads)):
            if len(part) == 1:
                pieces.append(grad / (part[0] + RHO * DAMPING))
            else:
                a, g = (diagonal(f.astype(np.float64)) for f in part)
                pieces.append(grad / (a[..., :, None] * g[..., None, :] + DAMPING))
        expected[layer.name] = pieces
    return expected


def trained_weights(steps=2, **settings):
    """every_block_net's weights after `steps` steps of KFAC(**settings)."""
    model = net.every_block_net()
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                            damping=DAMPING, factor_update_freq=1,
                            decomposition_update_freq=1, xla=False,
                            **settings).attach(model)
    for x, y in net.batches(steps, BATCH):
        net.step_update(model, optimizer, x, y)
    return [v.numpy() for v in model.variables]


class MethodObjectTest(absltest.TestCase):

    def test_a_method_outside_tfkfac_trains_every_block_kind(self):
        model = net.every_block_net(dtype="float64")
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR),
                                method=DiagonalKronecker(), damping=DAMPING,
                                diagonal_damping_multiplier=RHO, kl_clip=None,
                                state_dtype="float64", factor_update_freq=1,
                                decomposition_update_freq=1, xla=False).attach(model)
        self.assertEqual({m["layer"]: m["kind"] for m in optimizer.summary()["managed"]},
                         net.MANAGED_KINDS)
        for step, (x, y) in enumerate(net.batches(STEPS, BATCH, dtype=np.float64)):
            grads = net.gradients(model, x, y)
            update = net.step_update(model, optimizer, x, y)
            observed = net.Reference(model, None).observed(optimizer, update, LR)
            net.assert_updates_close(expected_update(optimizer, model, grads), observed,
                                     FLOAT64_RTOL, FLOAT64_RTOL, msg=f"step {step}")
        self.assertEqual(optimizer.counters()["steps"], STEPS)

    def test_built_in_objects_train_as_their_names(self):
        for name, method, settings in [
                ("eigen", tfkfac.Eigen(), {}),
                ("inverse", tfkfac.Inverse(), {}),
                ("eigen_adam", tfkfac.EigenAdam(beta_2=0.99, epsilon=1e-6),
                 dict(adam_beta_2=0.99, adam_epsilon=1e-6))]:
            by_name = trained_weights(method=name, **settings)
            by_object = trained_weights(method=method)
            for k, (want, got) in enumerate(zip(by_name, by_object)):
                np.testing.assert_array_equal(got, want, err_msg=f"{name} weight {k}")

    def test_config_round_trip(self):
        for method in ("eigen_adam", tfkfac.EigenAdam(beta_2=0.9, epsilon=1e-5),
                       DiagonalKronecker()):
            config = tfkfac.KFAC(method=method).get_config()
            restored = tfkfac.KFAC.from_config(config).config.method
            self.assertIs(type(restored), type(method))
            self.assertEqual(repr(restored), repr(method))
        self.assertEqual(tfkfac.KFAC(method="eigen").get_config()["method"], "eigen")

    def test_a_keras_file_keeps_a_registered_method_and_refuses_an_unregistered_one(self):
        directory = self.create_tempdir().full_path
        for method in (DiagonalKronecker(), Unregistered()):
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(optimizer=tfkfac.KFAC(method=method).attach(model), loss="mse")
            model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
            path = os.path.join(directory, f"{type(method).__name__}.keras")
            if isinstance(method, Unregistered):
                with self.assertRaisesRegex(ValueError, r"`method` Unregistered\(\) cannot "
                                                        r"be saved.*register_keras_serializable"):
                    model.save(path)
            else:
                model.save(path)
                loaded = keras.models.load_model(path).optimizer.config.method
                self.assertIs(type(loaded), DiagonalKronecker)

    def test_bad_values_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, r"^`method` must be one of eigen, inverse, "
                                                r"eigen_adam or a tfkfac.Method; received"):
            tfkfac.KFAC(method=DiagonalKronecker)  # the class, not an object
        with self.assertRaisesRegex(ValueError, r"^`beta_2` must be a finite number in "
                                                r"\[0, 1\); received 1.0"):
            tfkfac.EigenAdam(beta_2=1.0)

    def test_adam_settings_nothing_would_read_are_refused(self):
        """`adam_beta_2`/`adam_epsilon` beside an EigenAdam object (which keeps its own)
        or another method, without grafting='adam', would be ignored: an error naming
        both and the fix."""
        for method, settings, fix in [
                (tfkfac.EigenAdam(beta_2=0.99), dict(adam_beta_2=0.9),
                 r"pass them to it, EigenAdam\(beta_2=\.\.\., epsilon=\.\.\.\)"),
                (tfkfac.EigenAdam(), dict(adam_epsilon=1e-3), "pass them to it"),
                ("eigen", dict(adam_beta_2=0.99, adam_epsilon=1e-3), "leave them at their"),
                ("inverse", dict(adam_epsilon=1e-3, grafting="sgd"), "leave them at their")]:
            with self.assertRaisesRegex(ValueError, r"^`adam_beta_2` and `adam_epsilon` set "
                                                    r"β2 and ε of grafting='adam' and of "
                                                    r"method='eigen_adam' \(by name\) only; "
                                                    r"received .*" + fix):
                tfkfac.KFAC(method=method, **settings)
        # Read: by the method named eigen_adam, or by Adam grafting beside any method.
        for method, grafting in [("eigen_adam", None), (tfkfac.EigenAdam(), "adam"),
                                 ("eigen", "adam")]:
            config = tfkfac.KFACConfig(method=method, grafting=grafting, adam_beta_2=0.99,
                                       adam_epsilon=1e-3)
            self.assertEqual((config.adam_beta_2, config.adam_epsilon), (0.99, 1e-3))


if __name__ == "__main__":
    absltest.main()
