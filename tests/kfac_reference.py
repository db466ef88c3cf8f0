"""The independent numpy reference the K-FAC tests (tests/test_kfac_*.py) compare against.

Shared by the single-process K-FAC tests: the common constants (batch N, learning rate,
damping λ, tolerance), `assert_close`, the float64 numpy forward/backward of a small MLP
that yields each Dense layer's A = (1/N) Σ ā āᵀ, G = (1/N) Σ g gᵀ (g_i = N dL/ds_i at the
pre-activation) and gradient ∇ = [dL/dW; dL/db], the explicit-Kronecker solve
(A ⊗ G + λI)⁻¹ vec(∇), the π-corrected factored inverse, and the one-custom-loop-step
helper that measures an update, and `managed_factors`, which reads every managed layer's
factors through the public `KFAC.factors`. None of it uses the optimizer's own factor or
decomposition code. `sgd_kfac` is KFAC as the tests written before the declared default
knew it: over momentum SGD, damping 0.1, KL clip 1e-3.

Tolerances: float32 TF against float64 numpy on these small, well-conditioned problems
agrees to rtol 1e-4, with an absolute floor of 1e-5 * max|ref| (`assert_close`).
"""

import keras
import numpy as np

import tfkfac

N = 8
LR = 0.5
DAMPING = 1e-2
RTOL = 1e-4


def sgd_kfac(learning_rate=0.05, momentum=0.9, **settings):
    """tfkfac.KFAC over `keras.optimizers.SGD(learning_rate, momentum)`, with damping 0.1
    and the KL clip 1e-3 unless `settings` give them: tfkfac's defaults before the declared
    one (ScheduleFreeAdamW inside, docs/guide.md §3), which the tests using this check."""
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(learning_rate, momentum=momentum),
                       **{"damping": 0.1, "kl_clip": 1e-3, **settings})


def assert_close(actual, expected, rtol=RTOL, msg="", atol_scale=1e-5):
    """`actual` ≈ `expected` to `rtol`, entries near zero to `atol_scale` x max |expected|."""
    expected = np.asarray(expected, np.float64)
    atol = atol_scale * max(float(np.max(np.abs(expected))), 1e-12)
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol,
                               atol=atol, err_msg=msg)


# ----------------------------------------------------------------- numpy reference
ACTIVATIONS = {
    None: (lambda h: h, lambda h: np.ones_like(h)),
    "tanh": (np.tanh, lambda h: 1.0 - np.tanh(h) ** 2),
    "sigmoid": (lambda h: 1 / (1 + np.exp(-h)),
                lambda h: (1 / (1 + np.exp(-h))) * (1 - 1 / (1 + np.exp(-h)))),
}


def loss_and_output_grad(s, y, loss):
    """Mean loss over the batch (sum_over_batch_size) and dL/ds, in float64."""
    n, d = s.shape
    if loss == "mse":
        return np.mean(np.mean((s - y) ** 2, axis=1)), 2.0 * (s - y) / (n * d)
    if loss == "ce":  # sparse categorical cross-entropy from logits
        z = s - s.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        onehot = np.eye(d)[y.astype(int)]
        return -np.mean(np.log(p[np.arange(n), y.astype(int)])), (p - onehot) / n
    raise ValueError(loss)


def mlp_reference(layers, x, y, loss):
    """Per Dense layer: A, G, gradient matrix ∇ (bias row last), computed in numpy.

    `layers`: list of (W, b or None, activation name), e.g. from `dense_layers(model)`.
    `loss`: "mse" (y real targets) or "ce" (y integer labels, softmax from logits).
    """
    inputs, pre = [], []
    a = x.astype(np.float64)
    for w, b, act in layers:
        inputs.append(a)
        h = a @ w + (0.0 if b is None else b)
        pre.append(h)
        a = ACTIVATIONS[act][0](h)
    _, d_out = loss_and_output_grad(a, y, loss)
    per_layer = [None] * len(layers)
    for k in reversed(range(len(layers))):
        w, b, act = layers[k]
        ds = d_out * ACTIVATIONS[act][1](pre[k])      # dL/ds at the pre-activation
        a_in = inputs[k]
        a_bar = np.concatenate([a_in, np.ones((len(a_in), 1))], 1) if b is not None else a_in
        n = len(a_in)
        A = a_bar.T @ a_bar / n
        g = n * ds                                     # g_i = N dL/ds_i
        G = g.T @ g / n
        grad = a_bar.T @ ds                            # [dL/dW; dL/db]
        g_post = n * d_out                             # at the output (post-activation)
        per_layer[k] = {"A": A, "G": G, "grad": grad, "G_post": g_post.T @ g_post / n}
        d_out = ds @ w.T
    return per_layer


def dense_layers(model):
    """(W, b or None, activation name or None) in float64 per layer of a Dense stack."""
    out = []
    for layer in model.layers:
        w = layer.kernel.numpy().astype(np.float64)
        b = layer.bias.numpy().astype(np.float64) if layer.use_bias else None
        act = layer.activation.__name__ if layer.activation.__name__ != "linear" else None
        out.append((w, b, act))
    return out


def kron_precondition(A, G, grad, damping):
    """(A ⊗ G + λI)⁻¹ vec(∇) with an explicit dense Kronecker product.

    With the row-major vec of the (d_a, d_g) matrix ∇, vec(A X G) = (A ⊗ G) vec(X)
    for symmetric G, so this is the contract's P.
    """
    big = np.kron(A, G) + damping * np.eye(A.shape[0] * G.shape[0])
    return np.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)


def factored_inverses(A, G, damping, use_pi=True):
    """(A + π√λ I)⁻¹ and (G + (√λ/π) I)⁻¹, π of the mean traces (1 without `use_pi`)."""
    pi = np.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G))) if use_pi else 1.0
    root = np.sqrt(damping)
    return (np.linalg.inv(A + pi * root * np.eye(len(A))),
            np.linalg.inv(G + root / pi * np.eye(len(G))))


def factored_inverse_precondition(A, G, grad, damping):
    """The inverse method: P = (A + π√λ I)⁻¹ ∇ (G + (√λ/π) I)⁻¹."""
    a_inv, g_inv = factored_inverses(A, G, damping)
    return a_inv @ grad @ g_inv


# ------------------------------------------------------------------- one step
def managed_factors(optimizer):
    """Every managed layer's running factors as numpy arrays, in `summary()["managed"]`
    order, read through the public `KFAC.factors`."""
    return [f.numpy() for m in optimizer.summary()["managed"]
            for f in optimizer.factors(m["layer"]).values()]


def loop_step(model, opt, loss_fn, x, y):
    """One custom-loop step; returns the change of every trainable variable."""
    before = [v.numpy().copy() for v in model.trainable_variables]
    with opt.record() as tape:
        loss = loss_fn(y, model(x, training=True))
    opt.minimize(loss, tape=tape)
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


# ------------------------------------ grafting and eigenbasis Adam (docs/design.md §11)
def adam_scale(value, moment, step, beta_2, epsilon):
    """(value / (√ŝ + ε), s): s = β2·`moment` + (1-β2)·value², ŝ = s / (1 - β2^step),
    `step` counted from 1, elementwise."""
    moment = beta_2 * moment + (1.0 - beta_2) * np.square(value)
    return value / (np.sqrt(moment / (1.0 - beta_2 ** step)) + epsilon), moment


def eigenbases(part):
    """(Q_A, Q_G) of one block part's factors (A, G), numpy.linalg.eigh's eigenvectors
    (batched over a leading group axis), Q_A = None (the identity) for an Embedding's
    diagonal A; () for a diagonal block (F,), its own eigenbasis."""
    if len(part) == 1:
        return ()
    a, g = part
    return (None if a.ndim == 1 else np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])


def eigen_adam_precondition(grad, bases, moment, step, beta_2, epsilon):
    """(P, s) of method "eigen_adam" for one block part: ĝ = Q_Aᵀ ∇ Q_G,
    P = Q_A [ĝ / (√ŝ + ε)] Q_Gᵀ with the moment s updated by ĝ; `bases` from `eigenbases`."""
    if not bases:
        return adam_scale(grad, moment, step, beta_2, epsilon)
    q_a, q_g = bases
    rotated = grad @ q_g
    if q_a is not None:
        rotated = np.swapaxes(q_a, -1, -2) @ rotated
    scaled, moment = adam_scale(rotated, moment, step, beta_2, epsilon)
    back = scaled @ np.swapaxes(q_g, -1, -2)
    return (back if q_a is None else q_a @ back), moment


def damped_precondition(part, grad, damping, diagonal_multiplier=1.0):
    """The eigen method's P of one block part: (A ⊗ G + λI)⁻¹ vec(∇) per Kronecker pair
    (explicit np.kron; an Embedding's diagonal A as a diagonal matrix; batched pairs one
    by one), ∇ / (F + ρλ) for a diagonal block (F,)."""
    if len(part) == 1:
        return grad / (part[0] + diagonal_multiplier * damping)
    a, g = part
    if a.ndim == 1:
        a = np.diag(a)
    if a.ndim == 3:
        return np.stack([kron_precondition(a_j, g_j, grad_j, damping)
                         for a_j, g_j, grad_j in zip(a, g, grad)])
    return kron_precondition(a, g, grad, damping)


def graft(preconditioned, directions):
    """Layer-wise grafting of one layer's arrays taken together:
    P̃ = (‖r‖_F / ‖P‖_F) P, and r where ‖P‖_F = 0."""
    p_norm = np.sqrt(sum(np.sum(np.square(p)) for p in preconditioned))
    if p_norm == 0:
        return [np.asarray(r, np.float64) for r in directions]
    r_norm = np.sqrt(sum(np.sum(np.square(r)) for r in directions))
    return [p * (r_norm / p_norm) for p in preconditioned]
