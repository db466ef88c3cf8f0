"""Damped Kronecker preconditioning: pure functions of tensors, XLA-compilable.

For a block with gradient matrix `grad` (d_a, d_g) and Kronecker factors A (d_a, d_a),
G (d_g, d_g), these compute the preconditioned gradient of DESIGN.md §2.
"""

import tensorflow as tf


def symmetric_eigh(matrix):
    """Eigen-decomposition of a symmetric PSD matrix; eigenvalues clipped at 0.

    Factors are PSD by construction; float32 round-off can give tiny negative
    eigenvalues, which would otherwise shrink the damped denominator.
    """
    symmetric = 0.5 * (matrix + tf.linalg.matrix_transpose(matrix))
    values, vectors = tf.linalg.eigh(symmetric)
    return tf.maximum(values, 0.0), vectors


def eigen_precondition(grad, q_a, v_a, q_g, v_g, damping):
    """`Q_A [(Q_Aᵀ ∇ Q_G) / (v_A v_Gᵀ + λ)] Q_Gᵀ`, i.e. `(A ⊗ G + λI)⁻¹ vec(∇)`."""
    rotated = tf.linalg.matmul(tf.linalg.matmul(q_a, grad, transpose_a=True), q_g)
    scaled = rotated / (v_a[:, None] * v_g[None, :] + damping)
    return tf.linalg.matmul(tf.linalg.matmul(q_a, scaled), q_g, transpose_b=True)


def pi_correction(a, g):
    """π of Martens & Grosse (2015): sqrt of the ratio of the factors' mean traces."""
    mean_trace_a = tf.linalg.trace(a) / tf.cast(tf.shape(a)[0], a.dtype)
    mean_trace_g = tf.linalg.trace(g) / tf.cast(tf.shape(g)[0], g.dtype)
    tiny = tf.constant(1e-30, a.dtype)
    return tf.sqrt(tf.maximum(mean_trace_a, tiny) / tf.maximum(mean_trace_g, tiny))


def damped_inverse(matrix, shift):
    """`(M + shift I)⁻¹`; with π-corrected shifts this is factored Tikhonov damping."""
    eye = tf.eye(tf.shape(matrix)[0], dtype=matrix.dtype)
    return tf.linalg.inv(matrix + shift * eye)


def inverse_precondition(grad, a_inv, g_inv):
    """`A_inv ∇ G_inv`."""
    return tf.linalg.matmul(tf.linalg.matmul(a_inv, grad), g_inv)


def kl_clip_scale(preconditioned, grads, learning_rate, kl_clip):
    """ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|))) of Pauloski et al. (eq. 18).

    `preconditioned` and `grads` hold one list of tensors per layer; the inner product
    of a layer runs over all its variables before the absolute value is taken.
    """
    vg_sum = tf.add_n([
        tf.abs(tf.add_n([tf.reduce_sum(p * g) for p, g in zip(layer_p, layer_g)]))
        for layer_p, layer_g in zip(preconditioned, grads)])
    lr = tf.cast(learning_rate, vg_sum.dtype)
    ratio = kl_clip / tf.maximum(lr * lr * vg_sum, 1e-30)
    return tf.minimum(1.0, tf.sqrt(ratio))
