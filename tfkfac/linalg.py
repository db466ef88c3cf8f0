"""Damped Kronecker preconditioning: pure functions of tensors.

For a block with gradient matrix `grad` (d_a, d_g) and Kronecker factors A (d_a, d_a),
G (d_g, d_g), these compute the preconditioned gradient of docs/design.md. Every function
also takes a batch of such blocks (leading axes, e.g. one pair per group of a grouped
convolution), so a layer of many small pairs costs one batched call. The
preconditioning functions are XLA-compilable. The decompositions are not: on CPU they
call LAPACK through scipy, because TensorFlow's CPU kernels (Eigen, one thread) measured
5.5x slower for eigh (n=1601: 1.15 s vs 0.21 s with LAPACK's divide and conquer) and 3.9x
slower for the damped inverse (LU 220 ms vs Cholesky 57 ms) on this project's machine
(`bench/linalg_benchmark.py`). OpenBLAS runs on one thread while they do
(`_OneBlasThread`). With a GPU visible they stay in TensorFlow (cuSOLVER).
"""

import ctypes
import functools
import os
import threading

import numpy as np
import scipy.linalg
import tensorflow as tf

BACKENDS = ("auto", "lapack", "tensorflow")


def _uses_lapack(backend):
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}; received {backend!r}")
    if backend == "auto":
        return not tf.config.list_physical_devices("GPU")
    return backend == "lapack"


@functools.cache
def _openblas_thread_setters():
    """`openblas_set_num_threads_local` (OpenBLAS >= 0.3.27) of every OpenBLAS this process
    has loaded (numpy's and scipy's wheels each bundle one), found in /proc/self/maps
    (Linux); none elsewhere or in another BLAS. Despite its name, in the pthreads builds
    the wheels bundle it sets the process's count (and returns the one it replaces)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return ()
    setters = []
    for path in sorted(p for p in paths if "openblas" in os.path.basename(p).lower()):
        setter = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
        if setter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
            setters.append(setter)
    return tuple(setters)


class _OneBlasThread:
    """OpenBLAS on one thread while any decomposition runs; the process's counts back when
    the last one ends.

    The decompositions are many independent matrices, which TensorFlow runs beside each
    other and beside its own ops on all cores. OpenBLAS's default, a thread per core in
    every call, then oversubscribes the cores and its threads spin waiting for work: a
    1601x1601 Cholesky inverse took 0.25-3.4 s of CPU (first call the most) against
    0.08 s on one thread, at load 3-6 on this project's 2 cores. OpenBLAS's count is one
    per process, so concurrent decompositions share one setting, counted: were each to
    restore its own, one call's restore would let another run on several threads, and
    LAPACK's rounding would then depend on timing (a resumed run drifted 2.5e-6 from the
    uninterrupted one under load)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._saved = ()

    def __enter__(self):
        with self._lock:
            if not self._running:
                self._saved = tuple(setter(1) for setter in _openblas_thread_setters())
            self._running += 1

    def __exit__(self, *unused_exc_info):
        with self._lock:
            self._running -= 1
            if not self._running:
                for setter, count in zip(_openblas_thread_setters(), self._saved):
                    setter(count)


_ONE_BLAS_THREAD = _OneBlasThread()


def _one_blas_thread(function):
    """`function` run inside `_ONE_BLAS_THREAD`."""
    @functools.wraps(function)
    def single_threaded(*args):
        with _ONE_BLAS_THREAD:
            return function(*args)

    return single_threaded


def _lapack(function, inputs, out_shapes, dtype):
    """Runs the numpy `function` in the graph (`_one_blas_thread`); its outputs keep
    static shapes."""
    outputs = tf.nest.flatten(tf.numpy_function(
        _one_blas_thread(function), inputs, [dtype] * len(out_shapes), stateful=False))
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return outputs


def _finite_or_nan(decompose, matrix):
    """`decompose(matrix)`, all NaN if `matrix` is not finite.

    TensorFlow's kernels raise on such input (eigh) or return finite garbage (inv);
    they get the identity instead and their outputs are marked.
    """
    finite = tf.reduce_all(tf.math.is_finite(matrix))
    eye = tf.eye(tf.shape(matrix)[-1], batch_shape=tf.shape(matrix)[:-2], dtype=matrix.dtype)
    nan = tf.constant(np.nan, matrix.dtype)
    return [tf.where(finite, t, nan) for t in decompose(tf.where(finite, matrix, eye))]


def _nan_like(*arrays):
    return tuple(np.full_like(a, np.nan) for a in arrays)


def _lapack_eigh(matrix):
    """(values, vectors) by LAPACK's divide and conquer; NaN if it cannot finish."""
    values = np.zeros(matrix.shape[:-1], matrix.dtype)
    if not np.all(np.isfinite(matrix)):
        return _nan_like(values, matrix)
    try:
        if matrix.ndim == 2:
            values, vectors = scipy.linalg.eigh(matrix, driver="evd", check_finite=False)
        else:  # numpy's batched eigh calls the same LAPACK driver (syevd) per matrix
            values, vectors = np.linalg.eigh(matrix)
    except np.linalg.LinAlgError:
        return _nan_like(values, matrix)
    return values.astype(matrix.dtype), vectors.astype(matrix.dtype)


def _lapack_spd_inverse(matrix):
    """Inverse of a symmetric positive definite matrix by Cholesky (potrf, potri)."""
    if not np.all(np.isfinite(matrix)):
        return _nan_like(matrix)
    if matrix.ndim > 2:
        inverses = [_lapack_spd_inverse(m)[0] for m in matrix.reshape((-1,) + matrix.shape[-2:])]
        return (np.stack(inverses).reshape(matrix.shape),)
    potrf, potri = scipy.linalg.get_lapack_funcs(("potrf", "potri"), (matrix,))
    factor, info = potrf(matrix, lower=False, overwrite_a=False, clean=True)
    if info != 0:
        return _nan_like(matrix)
    upper, info = potri(factor, lower=False, overwrite_c=True)
    if info != 0:
        return _nan_like(matrix)
    inverse = np.triu(upper) + np.triu(upper, 1).T
    return (inverse.astype(matrix.dtype),)


def symmetric_eigh(matrix, backend="auto"):
    """Eigen-decomposition of a symmetric PSD matrix; eigenvalues clipped at 0.

    Factors are PSD by construction; float32 round-off can give tiny negative
    eigenvalues, which would otherwise shrink the damped denominator. Non-finite
    input gives non-finite output (never an exception), so callers can keep an
    earlier decomposition.
    """
    symmetric = 0.5 * (matrix + tf.linalg.matrix_transpose(matrix))
    if _uses_lapack(backend):
        values, vectors = _lapack(_lapack_eigh, [symmetric],
                                  [symmetric.shape[:-1], symmetric.shape], symmetric.dtype)
    else:
        values, vectors = _finite_or_nan(tf.linalg.eigh, symmetric)
    return tf.maximum(values, 0.0), vectors


def matmul(a, b, product_dtype=None, **kwargs):
    """`tf.linalg.matmul(a, b, **kwargs)` with both operands cast to `product_dtype`
    (None: as they are) and the product returned in the wider operand's dtype (an
    operand stored in `product_dtype`, a decomposition, is not cast).

    With "bfloat16" the CPU kernel accumulates in float32 (oneDNN with AVX-512 BF16) or
    partly in bfloat16 (AVX2) and rounds the product to bfloat16 (TensorFlow has no CPU
    kernel with a float32 result); docs/design.md §9.
    """
    if product_dtype is None:
        return tf.linalg.matmul(a, b, **kwargs)
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    product = tf.linalg.matmul(tf.cast(a, product_dtype), tf.cast(b, product_dtype), **kwargs)
    return tf.cast(product, max(a.dtype, b.dtype, key=lambda dtype: dtype.size))


def to_eigenbasis(grad, q_a, q_g, product_dtype=None):
    """`Q_Aᵀ ∇ Q_G`: the gradient in the factors' eigenbases. A basis None is the
    identity (a diagonal factor's): its product is skipped."""
    rotated = grad if q_a is None else matmul(q_a, grad, product_dtype, transpose_a=True)
    return rotated if q_g is None else matmul(rotated, q_g, product_dtype)


def from_eigenbasis(rotated, q_a, q_g, product_dtype=None):
    """`Q_A X Q_Gᵀ`, the inverse of `to_eigenbasis`."""
    grad = rotated if q_a is None else matmul(q_a, rotated, product_dtype)
    return grad if q_g is None else matmul(grad, q_g, product_dtype, transpose_b=True)


def eigen_precondition(grad, q_a, v_a, q_g, v_g, damping, product_dtype=None):
    """`Q_A [(Q_Aᵀ ∇ Q_G) / (v_A v_Gᵀ + λ)] Q_Gᵀ`, i.e. `(A ⊗ G + λI)⁻¹ vec(∇)`; a
    diagonal factor has basis None and its diagonal as eigenvalues."""
    rotated = to_eigenbasis(grad, q_a, q_g, product_dtype)
    scaled = rotated / (v_a[..., :, None] * v_g[..., None, :] + damping)
    return from_eigenbasis(scaled, q_a, q_g, product_dtype)


def adam_scale(value, moment, beta_2, epsilon, step):
    """(value / (√ŝ + ε), s): Adam's second-moment scaling of `value`, elementwise, with
    s = β2·`moment` + (1-β2)·value², ŝ = s / (1 - β2^step), `step` counted from 1."""
    moment = beta_2 * moment + (1.0 - beta_2) * tf.square(value)
    # convert_to_tensor, not tf.cast: a Python float cast goes through float32 (β2 = 0.999
    # off by 1.3e-8, ŝ by 1.3e-5 relative at step 1 in a float64 state).
    correction = 1.0 - tf.pow(tf.convert_to_tensor(beta_2, value.dtype),
                              tf.cast(step, value.dtype))
    return value / (tf.sqrt(moment / correction) + epsilon), moment


def pi_correction(a, g):
    """π of Martens & Grosse (2015): sqrt of the ratio of the factors' mean traces."""
    return pi_from_mean_traces(mean_trace(a), mean_trace(g))


def pi_from_mean_traces(mean_trace_a, mean_trace_g):
    """π from tr(A)/dim A and tr(G)/dim G (a diagonal A gives its mean directly)."""
    return tf.sqrt(_positive(mean_trace_a) / _positive(mean_trace_g))


def mean_trace(matrix):
    """tr(M) / dim M, per matrix of a batch (dim M from the static shape where known: a
    factor's mean trace is traced for every decomposition)."""
    size = matrix.shape[-1]
    if size is None:
        size = tf.cast(tf.shape(matrix)[-1], matrix.dtype)
    return tf.linalg.trace(matrix) / size


def _positive(value):
    return tf.maximum(value, tf.constant(1e-30, value.dtype))


def damped_inverse(matrix, shift, backend="auto"):
    """`(M + shift I)⁻¹` of a PSD `M`, shift > 0.

    With π-corrected shifts this is factored Tikhonov damping. A damped matrix that is
    not numerically positive definite, or not finite, gives non-finite output.
    """
    # The shift added to the diagonal alone (no identity matrix made and multiplied):
    # the same sums, in a few ops where `M + shift I` took eighteen.
    shift = tf.convert_to_tensor(shift, matrix.dtype)
    if shift.shape.rank:
        shift = shift[..., None]
    damped = tf.linalg.set_diag(matrix, tf.linalg.diag_part(matrix) + shift)
    if _uses_lapack(backend):
        (inverse,) = _lapack(_lapack_spd_inverse, [damped], [damped.shape], damped.dtype)
        return inverse
    (inverse,) = _finite_or_nan(lambda m: [tf.linalg.inv(m)], damped)
    return inverse


def kl_clip_scale(preconditioned, grads, learning_rate, kl_clip):
    """ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|))) of Pauloski et al. (eq. 18).

    `preconditioned` and `grads` hold one list of tensors per layer; the inner product
    of a layer runs over all its variables before the absolute value is taken.
    """
    vg_sum = tf.add_n([
        tf.abs(tf.add_n([tf.reduce_sum(p * g) for p, g in zip(layer_p, layer_g)]))
        for layer_p, layer_g in zip(preconditioned, grads)])
    lr = tf.cast(learning_rate, vg_sum.dtype)
    # sqrt(κ / Σ) / η rather than sqrt(κ / (η² Σ)): η² overflows float32 from η ≈ 1.8e19.
    root = tf.sqrt(kl_clip / tf.maximum(vg_sum, tf.cast(1e-30, vg_sum.dtype)))
    return tf.minimum(tf.math.divide_no_nan(root, lr) + tf.cast(lr <= 0, root.dtype), 1.0)
