"""The gradient noise scale of linear regression, in numpy, for tests/test_noise_scale.py
and its 2-rank job (tests/noise_scale_worker.py).

Model: s = x·w (Keras `Dense(1, use_bias=False)`), loss the mean over the batch of
(s − y)², x ~ N(0, I_d), y = x·w* + σε. At fixed weights w (learning rate 0) with
Δ = w − w*, the per-example gradient is g = 2x(x·Δ − σε), so the true values are
G = E g = 2Δ and Σ = Cov g = 4(|Δ|² + σ²) I + 4ΔΔᵀ (Isserlis: E[xxᵀ(x·Δ)²] = |Δ|² I + 2ΔΔᵀ).
"""

import keras
import numpy as np

DIM, SIGMA = 4, 0.5
W_TRUE = np.array([1.0, -2.0, 0.5, 3.0])
W_START = np.array([1.5, -1.0, 0.0, 2.5])
DELTA = W_START - W_TRUE


def true_values():
    """(|G|², tr(Σ)) of the population."""
    norm = float(DELTA @ DELTA)
    return 4.0 * norm, 4.0 * (DIM * (norm + SIGMA ** 2) + norm)


def data(steps, batch, seed):
    """(x, y) of `steps` batches of `batch` examples, float32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, DIM))
    y = x @ W_TRUE + SIGMA * rng.normal(size=steps * batch)
    return x.astype("float32"), y.astype("float32")[:, None]


def model():
    """The linear model at W_START."""
    net = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(1, use_bias=False)])
    net.layers[0].kernel.assign(W_START[:, None])
    return net


def per_example_gradients(x, y):
    """(examples, DIM) gradients of (x·w − y)² at W_START, in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)[:, 0]
    return 2.0 * x * (x @ W_START - y)[:, None]


def step_estimates(gradients, batch, transform=None):
    """(steps, 2) estimates [|G|², tr(Σ)] of each batch of `batch` per-example
    `gradients`, from its two halves (first batch//2 examples, then the rest) and their
    mean: b_small = batch/2, b_big = batch, the formulas of docs/design.md §13, every norm
    taken after the linear `transform` (a matrix; None: the identity)."""
    transform = np.eye(gradients.shape[1]) if transform is None else transform
    rows = []
    for start in range(0, len(gradients), batch):
        g = gradients[start:start + batch] @ transform.T
        half = len(g) // 2
        small = (np.sum(g[:half].mean(0) ** 2) + np.sum(g[half:].mean(0) ** 2)) / 2
        big = np.sum(g.mean(0) ** 2)
        b_small, b_big = len(g) / 2, len(g)
        rows.append(((b_big * big - b_small * small) / (b_big - b_small),
                     (small - big) / (1 / b_small - 1 / b_big)))
    return np.array(rows)


def noise_scale(estimates):
    """B_simple: the mean tr(Σ) estimate over the mean |G|² estimate."""
    return estimates[:, 1].mean() / estimates[:, 0].mean()


def kfac_preconditioner(x, y, damping):
    """The matrix P of K-FAC's eigen method for this Dense layer (docs/design.md §2) with
    the factors of the batch (x, y): A = xᵀx/N, G = mean of (N dL/ds)² = mean 4(s − y)²,
    P = (G·A + λI)⁻¹ (G is 1×1)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)[:, 0]
    a = x.T @ x / len(x)
    g = np.mean((2.0 * (x @ W_START - y)) ** 2)
    return np.linalg.inv(g * a + damping * np.eye(len(a)))
