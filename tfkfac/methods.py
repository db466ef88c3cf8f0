"""K-FAC's preconditioning methods as objects: `Eigen`, `Inverse`, `EigenAdam`.

A block knows only its layer's geometry: its factors, and how its gradients become one
matrix per *piece* of its curvature and back (`Block.pieces`, `gradient_matrices`,
`split_matrices`). A piece is a Kronecker pair A ⊗ G (possibly a batch of pairs), each
factor a full symmetric matrix or a diagonal kept as a vector (an Embedding's A), or one
diagonal F damped with ρλ (a normalization layer). A method decomposes a piece's full
factors and preconditions its matrix, so a new method is a `Method` subclass and touches
no block. It also says what that work costs (`decomposition_kernels`,
`precondition_kernels`, in tfkfac/costs.py's kernels), which the planner prices. The math
of the built-in three is docs/design.md §2, §3 and §11.
"""

import dataclasses
import math
import typing

import keras
import tensorflow as tf

from tfkfac import costs, linalg, validation


@dataclasses.dataclass(frozen=True)
class Piece:
    """One independent part of a block's curvature.

    `factors`: indices into the block's factors, (A, G) for a Kronecker pair or (F,) for
    one diagonal; `diagonal`: per factor, whether it is a diagonal kept as a vector (the
    identity is its eigenbasis, the vector its eigenvalues); `damping_multiplier`: ρ of a
    lone diagonal, damped with ρλ.
    """

    factors: tuple
    diagonal: tuple
    damping_multiplier: float = 1.0

    @property
    def pair(self):
        return len(self.factors) == 2

    def matrix_shape(self, factor_shapes):
        """Shape of the piece's gradient matrix: (..., dim A, dim G), or F's."""
        shapes = [factor_shapes[i] for i in self.factors]
        if not self.pair:
            return tuple(shapes[0])
        a, g = shapes
        batch = a[:-1] if self.diagonal[0] else a[:-2]
        return tuple(batch) + (a[-1], g[-1])


class Part(typing.NamedTuple):
    """One tensor of a stored decomposition. A `matrix` (an eigenbasis, an inverse)
    starts as the identity and is kept in `product_dtype` (docs/design.md §9); any other
    part starts at zero in the state dtype."""

    shape: tuple
    matrix: bool


class Method:
    """How pieces are preconditioned: what a full factor's decomposition holds, how it is
    computed, and how a piece's gradient matrix is preconditioned with it.

    A method may keep state per piece (`state_shapes`), saved with the block's factors
    and handed back updated by `precondition`. A method given to `KFACConfig(method=...)`
    is saved in a .keras file by its Keras registration: decorate a subclass with
    `@keras.saving.register_keras_serializable()` and return its constructor's
    arguments from `get_config` (`KFAC.get_config` refuses an unregistered one).
    """

    # The `method` setting that names a built-in method (None: a method object only).
    name = None
    # What a state variable is called in the optimizer: "<layer>_<state_name><k>".
    state_name = "state"

    def decomposition_parts(self, shape):
        """[`Part`] of the decomposition of a full factor of `shape`, (n, n) or (q, n, n)."""
        return []

    def decompose(self, piece, factors, position, damping):
        """The decomposition of full factor `position` of `piece` (`factors`: the piece's
        factors), as the tensors `decomposition_parts` describes. Each full factor is
        decomposed on its own, so that the work spreads over ranks factor by factor."""
        return []

    def state_shapes(self, piece, matrix_shape):
        """Shapes of the state kept for `piece`, whose gradient matrix has `matrix_shape`."""
        return []

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        """(preconditioned `matrix`, updated `state`) of one piece.

        `factors`: the piece's current factors; `decompositions`: per factor its stored
        decomposition (None for a diagonal); `state`: this piece's state values; `step`:
        the 1-based step, in the state dtype; `product_dtype`: of the large products
        (`linalg.matmul`).
        """
        raise NotImplementedError

    def reads_factors(self, piece):
        """Whether `precondition` of `piece` reads its factors, not only its stored
        decompositions and state. One that does not may run while the factors are being
        reduced (`KFACConfig.overlap_reduction`); a method that does not say is taken to."""
        return True

    # --- what the work costs, for the planner (trainers/planning/), in tfkfac/costs.py's
    # kernels: a method says it here, next to its math, and is priced without an edit
    # to the planner.
    def decomposition_kernels(self, shape, itemsize=4):
        """The kernels of `decompose` of one full factor of `shape`, (n, n) or (q, n, n).
        Nothing for a method that keeps no decomposition (`decomposition_parts`)."""
        if self.decomposition_parts(shape):
            raise NotImplementedError(
                f"{type(self).__name__} keeps a decomposition (decomposition_parts) but "
                "does not say what computing it costs: define decomposition_kernels")
        return []

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        """The kernels of `precondition` of `piece`, whose gradient matrix has
        `matrix_shape`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say what its preconditioning costs: define "
            "precondition_kernels")

    def get_config(self):
        """The constructor's arguments (Keras serialization)."""
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({arguments})"


def _has_diagonal(piece):
    """Whether `piece` has a factor kept as a diagonal, which `Eigen` and `Inverse`
    precondition with the factor itself (a lone diagonal, or one side of a pair)."""
    return not piece.pair or any(piece.diagonal)


def _damped_diagonal(piece, matrix, factors, damping):
    """∇ / (F + ρλ): a lone diagonal under `Eigen` and `Inverse` alike (§3)."""
    (fisher,) = factors
    return matrix / (fisher + piece.damping_multiplier * damping)


def _damped_diagonal_kernels(matrix_shape, itemsize):
    """`_damped_diagonal`'s work: ∇ and F read, the quotient written (2 FLOPs an entry)."""
    return [costs.elementwise(math.prod(matrix_shape), 2, 2, 1, itemsize)]


def _pair_products(matrix_shape, itemsize):
    """The products of a pair's (q, a, o) gradient matrix by its A side (a, a) and by
    its G side (o, o), each batched over the q pairs."""
    *batch, a, o = matrix_shape
    q = math.prod(batch)
    return [costs.product(a, a, o, q, itemsize), costs.product(a, o, o, q, itemsize)]


def _rotation_kernels(piece, matrix_shape, itemsize):
    """Q_Aᵀ ∇ Q_G (or Q_A (.) Q_Gᵀ): a product per full factor; a diagonal's eigenbasis
    is the identity."""
    return [product for product, diagonal in zip(_pair_products(matrix_shape, itemsize),
                                                  piece.diagonal) if not diagonal]


class EigenbasisMethod(Method):
    """A method that keeps each full factor's [eigenbasis, eigenvalues] (eigenvalues
    clipped at 0); a diagonal's eigenbasis is the identity, its eigenvalues the vector."""

    def decomposition_parts(self, shape):
        return [Part(tuple(shape), True), Part(tuple(shape[:-1]), False)]

    def decompose(self, piece, factors, position, damping):
        values, vectors = linalg.symmetric_eigh(factors[position])
        return [vectors, values]

    def decomposition_kernels(self, shape, itemsize=4):
        return [costs.decomposition("eigh", costs.EIGH_FLOPS_PER_N3, shape, itemsize)]


@keras.saving.register_keras_serializable(package="tfkfac")
class Eigen(EigenbasisMethod):
    """Exact (A ⊗ G + λI)⁻¹ vec(∇) by eigendecompositions (docs/design.md §2)."""

    name = "eigen"

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        if not piece.pair:
            return _damped_diagonal(piece, matrix, factors, damping), []
        (q_a, v_a), (q_g, v_g) = [(None, f) if d is None else d
                                  for f, d in zip(factors, decompositions)]
        return linalg.eigen_precondition(matrix, q_a, v_a, q_g, v_g, damping,
                                         product_dtype), []

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        if not piece.pair:
            return _damped_diagonal_kernels(matrix_shape, itemsize)
        rotation = _rotation_kernels(piece, matrix_shape, itemsize)
        # Divided by v_A v_Gᵀ + λ, 3 FLOPs an entry, between the two rotations.
        return rotation + [costs.elementwise(math.prod(matrix_shape), 3, 1, 1,
                                             itemsize)] + rotation

    def reads_factors(self, piece):
        return _has_diagonal(piece)


@keras.saving.register_keras_serializable(package="tfkfac")
class Inverse(Method):
    """π-corrected factored Tikhonov damping, (A + π√λ I)⁻¹ ∇ (G + (√λ/π) I)⁻¹
    (Martens & Grosse 2015; docs/design.md §2); a diagonal's π term is its mean."""

    name = "inverse"

    def decomposition_parts(self, shape):
        return [Part(tuple(shape), True)]

    @staticmethod
    def _shifts(piece, factors, damping):
        """(π√λ, √λ/π) of a pair."""
        pi = linalg.pi_from_mean_traces(*[
            tf.reduce_mean(f, axis=-1) if diagonal else linalg.mean_trace(f)
            for f, diagonal in zip(factors, piece.diagonal)])
        root = tf.sqrt(damping)
        return pi * root, root / pi

    def decompose(self, piece, factors, position, damping):
        shift = self._shifts(piece, factors, damping)[position]
        return [linalg.damped_inverse(factors[position], shift)]

    def decomposition_kernels(self, shape, itemsize=4):
        return [costs.decomposition("cholesky_inverse", costs.CHOLESKY_INVERSE_FLOPS_PER_N3,
                                    shape, itemsize)]

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        if not piece.pair:
            return _damped_diagonal(piece, matrix, factors, damping), []
        (a, g), (a_inverse, g_inverse) = factors, decompositions
        if a_inverse is None or g_inverse is None:  # a diagonal is inverted here
            shift_a, shift_g = self._shifts(piece, factors, damping)
        left = (matrix / (a[..., :, None] + shift_a) if a_inverse is None
                else linalg.matmul(a_inverse[0], matrix, product_dtype))
        return (left / (g[..., None, :] + shift_g) if g_inverse is None
                else linalg.matmul(left, g_inverse[0], product_dtype)), []

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        if not piece.pair:
            return _damped_diagonal_kernels(matrix_shape, itemsize)
        # A⁻¹ ∇ G⁻¹; a diagonal side divides ∇ entrywise (1 FLOP an entry).
        divided = costs.elementwise(math.prod(matrix_shape), 1, 1, 1, itemsize)
        return [divided if diagonal else product for product, diagonal
                in zip(_pair_products(matrix_shape, itemsize), piece.diagonal)]

    def reads_factors(self, piece):
        return _has_diagonal(piece)


@keras.saving.register_keras_serializable(package="tfkfac")
class EigenAdam(EigenbasisMethod):
    """Adam's second moments in the factors' eigenbases (SOAP's rule on K-FAC's bases,
    docs/design.md §11): ĝ = Q_Aᵀ ∇ Q_G, s ← β2 s + (1-β2) ĝ²,
    P = Q_A [ĝ / (√ŝ + ε)] Q_Gᵀ; a diagonal is its own basis. Keeps s per piece; damping
    does not enter."""

    name = "eigen_adam"
    state_name = "moment"

    def __init__(self, beta_2=0.999, epsilon=1e-7):
        self.beta_2 = validation.fraction("beta_2", beta_2)
        self.epsilon = validation.positive("epsilon", epsilon)

    def get_config(self):
        return {"beta_2": self.beta_2, "epsilon": self.epsilon}

    def state_shapes(self, piece, matrix_shape):
        return [matrix_shape]

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        (moment,) = state
        if not piece.pair:
            scaled, moment = self._scale(matrix, moment, step)
            return scaled, [moment]
        q_a, q_g = [None if d is None else d[0] for d in decompositions]
        rotated = linalg.to_eigenbasis(matrix, q_a, q_g, product_dtype)
        scaled, moment = self._scale(rotated, moment, step)
        return linalg.from_eigenbasis(scaled, q_a, q_g, product_dtype), [moment]

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        # `linalg.adam_scale`: s ← β2 s + (1-β2) ĝ² (4 FLOPs an entry), ŝ = s / (1 - β2^t),
        # √ŝ + ε and the quotient (4); ĝ and s read, s and the result written.
        scale = [costs.elementwise(math.prod(matrix_shape), 8, 2, 2, itemsize)]
        if not piece.pair:
            return scale
        rotation = _rotation_kernels(piece, matrix_shape, itemsize)
        return rotation + scale + rotation

    def reads_factors(self, piece):
        return False

    def _scale(self, value, moment, step):
        return linalg.adam_scale(value, tf.cast(moment, value.dtype), self.beta_2,
                                 self.epsilon, step)


BUILT_IN = (Eigen, Inverse, EigenAdam)
NAMES = tuple(method.name for method in BUILT_IN)


def check(name, value):
    """`value` is a built-in method's name or a `Method`; the error names `name`."""
    if not isinstance(value, Method) and not (isinstance(value, str) and value in NAMES):
        raise ValueError(f"`{name}` must be one of {', '.join(NAMES)} or a tfkfac.Method; "
                         f"received {value!r}")
    return value


check.choices = NAMES  # what the trainer's flag offers


def resolve(method, adam_beta_2, adam_epsilon):
    """The `Method` of the `method` setting: an object as given; a name as its built-in,
    "eigen_adam" with the settings' β2 and ε."""
    if isinstance(method, Method):
        return method
    if method == EigenAdam.name:
        return EigenAdam(adam_beta_2, adam_epsilon)
    return {m.name: m for m in BUILT_IN}[method]()


def serialize(method):
    """A name as it is; a `Method` as a Keras-serialized object, if Keras can load it back."""
    if not isinstance(method, Method):
        return method
    registered = keras.saving.get_registered_name(type(method))
    if keras.saving.get_registered_object(registered) is not type(method):
        raise ValueError(
            f"`method` {method!r} cannot be saved: {type(method).__name__} is not "
            "registered with Keras. Decorate it with "
            "@keras.saving.register_keras_serializable() and return its arguments from "
            "get_config.")
    return keras.saving.serialize_keras_object(method)


# ---------------------------------------------------------------- over a block's pieces
def decompose_factor(method, block, j, factors, damping):
    """`method`'s decomposition of full factor `j` of `block` (`factors`: all of the
    block's)."""
    piece = next(p for p in block.pieces() if j in p.factors)
    return method.decompose(piece, [factors[i] for i in piece.factors],
                            piece.factors.index(j), damping)


def state_shapes(method, block):
    """Shapes of `method`'s state for `block` (a block, or its `costs.BlockCost`), its
    pieces' in order."""
    factor_shapes = block.factor_shapes()
    return [shape for piece in block.pieces()
            for shape in method.state_shapes(piece, piece.matrix_shape(factor_shapes))]


def full_factor_shapes(block):
    """The shapes of `block`'s full factors (a block's, or its `costs.BlockCost`'s), in
    `symmetric_factors()` order: those a method decomposes."""
    factor_shapes = block.factor_shapes()
    return [factor_shapes[j] for j in block.symmetric_factors()]


def decomposition_elements(method, shape):
    """Elements of `method`'s stored decomposition of a full factor of `shape`."""
    return sum(math.prod(part.shape) for part in method.decomposition_parts(shape))


def precondition_kernels(method, block, itemsize=4):
    """The kernels of `method`'s preconditioning of `block` (a block, or its
    `costs.BlockCost`), its pieces' in order."""
    factor_shapes = block.factor_shapes()
    return [kernel for piece in block.pieces()
            for kernel in method.precondition_kernels(piece, piece.matrix_shape(factor_shapes),
                                                      itemsize)]


def precondition_block(method, block, grads, factors, decompositions, damping, state=(),
                       step=None):
    """(preconditioned `grads`, aligned with `block.variables`; `method`'s updated state).

    `factors`: all of the block's; `decompositions`: one per full factor, in
    `block.symmetric_factors()` order; `state`: the block's state values in
    `state_shapes` order; `step`: the 1-based step in the state dtype.
    """
    held = dict(zip(block.symmetric_factors(), decompositions))
    factor_shapes, state = block.factor_shapes(), list(state)
    matrices, updated = [], []
    for piece, matrix in zip(block.pieces(), block.gradient_matrices(grads)):
        count = len(method.state_shapes(piece, piece.matrix_shape(factor_shapes)))
        piece_state, state = state[:count], state[count:]
        preconditioned, piece_state = method.precondition(
            piece, matrix, [factors[i] for i in piece.factors],
            [held.get(i) for i in piece.factors], damping, piece_state, step,
            block.product_dtype)
        matrices.append(preconditioned)
        updated += piece_state
    return block.split_matrices(matrices), updated
