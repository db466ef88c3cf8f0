"""An independent numpy reference for the self-tuning tests (tests/test_self_tuning.py,
tests/test_self_tuning_distributed.py): a tiny MLP z = tanh(x W1 + b1) W2 + b2, its
explicit Jacobian in float64, the Hessian of each loss in z by central differences of the
loss written in numpy (no closed form shared with tfkfac/ggn.py), and the exact GGN
F = (1/N) Σ_i J_iᵀ H_i J_i as a P×P matrix.
"""

import keras
import numpy as np

N, D_IN, HIDDEN, D_OUT = 6, 5, 4, 3
PARAMS = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT


def mlp(dtype="float32", activation=None, seed=1):
    """The tiny MLP in Keras; `activation` of the output layer (None: z itself)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((D_IN,), dtype=dtype),
        keras.layers.Dense(HIDDEN, activation="tanh", name="hidden", dtype=dtype,
                           bias_initializer="random_normal"),
        keras.layers.Dense(D_OUT, activation=activation, name="head", dtype=dtype,
                           bias_initializer="random_normal"),
    ])


def data(seed=0, n=N):
    """(x, sparse labels, one-hot labels, binary targets, real targets), float64."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D_IN))
    labels = rng.integers(0, D_OUT, n)
    return (x, labels, np.eye(D_OUT)[labels], rng.integers(0, 2, (n, D_OUT)).astype(float),
            rng.normal(size=(n, D_OUT)))


def weights(model):
    """[W1, b1, W2, b2] of the Keras MLP in float64."""
    return [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]


def flat(vector):
    return np.concatenate([np.ravel(np.asarray(t, np.float64)) for t in vector])


def unflat(values, like):
    out, start = [], 0
    for t in like:
        size = int(np.prod(np.shape(t)))
        out.append(values[start:start + size].reshape(np.shape(t)))
        start += size
    return out


def logits(params, x):
    w1, b1, w2, b2 = params
    return np.tanh(x @ w1 + b1) @ w2 + b2


def jacobians(params, x):
    """(N, D_OUT, PARAMS): dz_i/dθ, θ flattened as [W1, b1, W2, b2] row-major."""
    w1, b1, w2, _ = params
    h = np.tanh(x @ w1 + b1)
    slope = 1.0 - h ** 2  # (N, HIDDEN)
    out = []
    for i in range(len(x)):
        back = w2.T * slope[i]  # (D_OUT, HIDDEN): dz_k/d(pre-activation j)
        d_w1 = np.einsum("a,kj->kaj", x[i], back).reshape(D_OUT, -1)
        d_w2 = np.einsum("j,kl->kjl", h[i], np.eye(D_OUT)).reshape(D_OUT, -1)
        out.append(np.concatenate([d_w1, back, d_w2, np.eye(D_OUT)], axis=1))
    return np.stack(out)


# Per-example losses of the logits z (a vector), as Keras defines them.
def cross_entropy(z, label):
    return np.log(np.sum(np.exp(z - z.max()))) + z.max() - z[label]


def binary_cross_entropy(z, target):
    return np.mean(np.logaddexp(0.0, z) - target * z)


def squared_error(z, target):
    return np.mean((target - z) ** 2)


def hessian(loss, z, step=1e-3):
    """∇²loss at z by central differences at steps h and 2h, Richardson-extrapolated
    (error O(h⁴) + rounding/h², about 1e-10 here; float64)."""
    return (4.0 * _central_hessian(loss, z, step) - _central_hessian(loss, z, 2 * step)) / 3.0


def _central_hessian(loss, z, step):
    d = len(z)
    out = np.zeros((d, d))
    for a in range(d):
        for b in range(d):
            ea, eb = np.eye(d)[a] * step, np.eye(d)[b] * step
            out[a, b] = (loss(z + ea + eb) - loss(z + ea - eb) - loss(z - ea + eb)
                         + loss(z - ea - eb)) / (4 * step * step)
    return 0.5 * (out + out.T)


def ggn(params, x, per_example_loss, targets, sample_weight=None):
    """The exact GGN of L = (1/N) Σ_i w_i l(z_i, t_i) in z: (1/N) Σ w_i J_iᵀ H_i J_i."""
    z = logits(params, x)
    jac = jacobians(params, x)
    weight = np.ones(len(x)) if sample_weight is None else sample_weight
    total = np.zeros((PARAMS, PARAMS))
    for i in range(len(x)):
        h = hessian(lambda zi: per_example_loss(zi, targets[i]), z[i])
        total += weight[i] * jac[i].T @ h @ jac[i]
    return total / len(x)


def loss_value(params, x, per_example_loss, targets):
    z = logits(params, x)
    return np.mean([per_example_loss(z[i], targets[i]) for i in range(len(x))])


def gradient(params, x, per_example_loss, targets, step=1e-6):
    """dL/dθ from the explicit Jacobian and the loss's gradient in z by central
    differences."""
    z = logits(params, x)
    jac = jacobians(params, x)
    total = np.zeros(PARAMS)
    for i in range(len(x)):
        grad_z = np.array([(per_example_loss(z[i] + e, targets[i])
                            - per_example_loss(z[i] - e, targets[i])) / (2 * step)
                           for e in np.eye(D_OUT) * step])
        total += jac[i].T @ grad_z
    return total / len(x)
