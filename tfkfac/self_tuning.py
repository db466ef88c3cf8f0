"""Self-tuning K-FAC (Martens & Grosse 2015 §6.5-§7; docs/design.md §14): the step's
learning rate α and momentum μ from the quadratic model of the exact curvature, and the
damping λ from the Levenberg-Marquardt rule, so that none of the three is a setting.

Each step, with Δ the K-FAC direction (−P, P the preconditioned gradient at damping γ),
δ₀ the previous update, ∇h the gradient and F the exact Fisher/GGN (tfkfac/ggn.py):
C = F + (λ + η) I, (α, μ) minimise M(δ) = ½ δᵀ C δ + ∇hᵀ δ over δ = α Δ + μ δ₀ (a 2×2
system), and the update is δ. Every T₁ steps the loss after the update, on the same
batch, gives the reduction ratio ρ = (h(θ + δ) − h(θ)) / M(δ), and λ shrinks by ω₁ when
ρ > 3/4 and grows by 1/ω₁ when ρ < 1/4. The factors' damping γ is tied to λ, as kfac-jax
ties them: γ = λ + η.

The pure functions take and give float64 tensors and are what the tests check against
numpy; `SelfTuning` holds the state (λ, γ, δ₀), saved with the optimizer. Every input is
reduced over ranks before it reaches them (the Gram matrix of F by the communicator, the
gradient averaged, the losses averaged), so every rank takes the same decisions.
"""

import dataclasses
import math
import typing

import keras
import tensorflow as tf

from tfkfac import ggn, inner, state as state_lib, transform, validation

# Martens & Grosse §6.5: λ adapted every T₁ = 5 steps by ω₁ = (19/20)^T₁.
ADAPTATION_INTERVAL = 5
DECAY = (19.0 / 20.0) ** ADAPTATION_INTERVAL
# λ shrinks above UPPER and grows below LOWER (§6.5).
LOWER, UPPER = 0.25, 0.75
# λ's bounds: kfac-jax's lower one; an upper one so that a run of failed steps (ρ NaN)
# cannot take λ to infinity, where Δ vanishes and the 2×2 system with it.
MIN_DAMPING, MAX_DAMPING = 1e-8, 1e8
# Δ and δ₀ are (numerically) parallel when the squared sine of their angle is below this,
# or when the 2×2 matrix's determinant is below this share of its diagonal's product:
# the step is then taken along Δ alone.
PARALLEL_TOLERANCE = 1e-10


@dataclasses.dataclass(frozen=True)
class LevenbergMarquardt:
    """The Levenberg-Marquardt rule for λ (§6.5), checked when made: every `interval`
    steps (the steps k, 0-based, with (k + 1) a multiple of it), λ ← `decay`·λ if
    ρ > `upper`, λ ← λ / `decay` if ρ < `lower` or ρ is NaN, then clipped to
    [`min_damping`, `max_damping`]."""

    interval: int = ADAPTATION_INTERVAL
    decay: float = DECAY
    lower: float = LOWER
    upper: float = UPPER
    min_damping: float = MIN_DAMPING
    max_damping: float = MAX_DAMPING

    def __post_init__(self):
        validation.positive_integer("interval", self.interval)
        validation.finite_number("decay", self.decay, 0, 1, low_open=True, high_open=True)
        validation.finite_number("lower", self.lower)
        validation.finite_number("upper", self.upper, low=self.lower)
        validation.finite_number("min_damping", self.min_damping, low=0, low_open=True)
        validation.finite_number("max_damping", self.max_damping, low=self.min_damping)

    def due(self, step):
        """Whether λ is adapted after step `step` (0-based; a tensor or an int)."""
        return tf.equal(tf.math.floormod(tf.cast(step, tf.int64) + 1, self.interval), 0)

    def adapted(self, damping, rho):
        """λ after a step of reduction ratio `rho` (float64 tensors)."""
        damping = float64(damping)
        rho = float64(rho)
        failed = tf.logical_or(tf.math.is_nan(rho), rho < self.lower)
        new = tf.where(failed, damping / self.decay,
                       tf.where(rho > self.upper, damping * self.decay, damping))
        return tf.clip_by_value(new, self.min_damping, self.max_damping)


def check_initial_damping(name, value, rule):
    """`value` (the initial λ) is a number in the rule's bounds."""
    return validation.finite_number(name, value, rule.min_damping, rule.max_damping)


def float64(value):
    """`value` as a float64 tensor; a Python number converted directly, never through
    float32 (as `tf.cast` would)."""
    if tf.is_tensor(value) or isinstance(value, (tf.Variable, keras.Variable)):
        return tf.cast(value, tf.float64)
    return tf.constant(value, tf.float64)


def inner_products(vectors, others=None):
    """The matrix [⟨vᵢ, wⱼ⟩] (float64) of `vectors` and `others` (default: `vectors`),
    each a list of tensors (one per variable; None is zero)."""
    others = vectors if others is None else others
    return tf.stack([tf.stack([_dot(v, w) for w in others]) for v in vectors])


def _dot(v, w):
    terms = [tf.reduce_sum(tf.cast(a, tf.float64) * tf.cast(b, tf.float64))
             for a, b in zip(v, w) if a is not None and b is not None]
    return tf.add_n(terms) if terms else tf.constant(0.0, tf.float64)


def quadratic_model(curvature_gram, vector_gram, gradient_dots, damping, l2=0.0):
    """(A, b) of M(w) = ½ wᵀ A w + bᵀ w for δ = w₀ v₀ + w₁ v₁ + ...: A = [vᵢᵀ F vⱼ] +
    (λ + η) [vᵢᵀ vⱼ], b = [∇hᵀ vᵢ]; float64."""
    curvature_gram = float64(curvature_gram)
    weight = float64(damping) + float64(l2)
    return (curvature_gram + weight * float64(vector_gram),
            float64(gradient_dots))


def solve(matrix, gradient_dots):
    """(α, μ, M(δ)) minimising the quadratic model (A = `matrix` 2×2, b = `gradient_dots`)
    over δ = α Δ + μ δ₀: [α, μ]ᵀ = −A⁻¹ b and M(δ) = ½ (α b₀ + μ b₁). Without δ₀
    (A₁₁ = 0: the first step, or δ₀ = 0) or with δ₀ parallel to Δ (det A ≤
    PARALLEL_TOLERANCE · A₀₀ A₁₁), μ = 0 and α = −b₀ / A₀₀ (0 when A₀₀ = 0: Δ = 0)."""
    a = float64(matrix)
    b = float64(gradient_dots)
    a00, a01, a10, a11 = a[0, 0], a[0, 1], a[1, 0], a[1, 1]
    det = a00 * a11 - a01 * a10
    both = tf.logical_and(a11 > 0, det > PARALLEL_TOLERANCE * a00 * a11)
    safe_det = tf.where(both, det, tf.ones_like(det))
    alpha = tf.where(both, -(a11 * b[0] - a01 * b[1]) / safe_det,
                     -tf.math.divide_no_nan(b[0], a00))
    mu = tf.where(both, -(a00 * b[1] - a10 * b[0]) / safe_det, tf.zeros_like(det))
    return alpha, mu, 0.5 * (alpha * b[0] + mu * b[1])


def reduction_ratio(new_loss, old_loss, model_change):
    """ρ = (h(θ + δ) − h(θ)) / M(δ), float64 (NaN when M(δ) = 0 or a loss is not finite,
    which the rule treats as a failed step)."""
    new_loss = float64(new_loss)
    old_loss = float64(old_loss)
    model_change = float64(model_change)
    rho = (new_loss - old_loss) / model_change
    return tf.where(tf.math.is_finite(rho), rho, tf.constant(math.nan, tf.float64))


def update_rule(optimizer, learning_rate, momentum, weight_decay):
    """KFAC's inner optimizer under self_tuning=True: plain SGD at learning rate 1, which
    applies δ as it is, or `optimizer` if it is a plain SGD; a ValueError naming the
    argument that makes no sense with it (the step's rate and momentum are α and μ)."""
    for name, value in (("learning_rate", learning_rate), ("momentum", momentum),
                        ("weight_decay", weight_decay)):
        if value is not None:
            raise ValueError(
                f"KFAC(self_tuning=True) chooses each step's learning rate and momentum from "
                f"the quadratic model and has no weight decay in it; received `{name}`="
                f"{value!r}: leave learning_rate, momentum and weight_decay out")
    if optimizer is None:
        return keras.optimizers.SGD(learning_rate=1.0)
    inner.inner_optimizer(optimizer, None, None, None)  # the checks of any inner optimizer
    reason = _unfit_reason(optimizer)
    if reason:
        raise ValueError(
            f"`inner_optimizer` {type(optimizer).__name__} makes no sense with "
            "self_tuning=True, which hands the update δ to plain SGD as the gradient −δ/η: "
            f"{reason}. Leave inner_optimizer out (SGD at learning rate 1), or pass "
            "keras.optimizers.SGD(learning_rate=1.0)")
    return optimizer


def _unfit_reason(optimizer):
    """Why `optimizer` cannot apply self-tuning's δ as it is ('' when it can)."""
    if not isinstance(optimizer, keras.optimizers.SGD):
        return "its own update rule would rescale or remix δ"
    config = optimizer.get_config()
    if optimizer.momentum != 0 or optimizer.nesterov:
        return "its momentum would add the previous update again (μ is self-tuning's)"
    if optimizer.weight_decay is not None:
        return "its weight decay is not part of the quadratic model"
    if isinstance(config.get("learning_rate"), dict):
        return "its learning rate is a schedule, and the step length is α"
    clipped = [name for name in ("clipnorm", "clipvalue", "global_clipnorm")
               if config.get(name) is not None]
    if clipped:
        return f"its {clipped[0]} would change δ"
    if optimizer.gradient_accumulation_steps:
        return "it accumulates gradients over steps, and δ is each step's"
    return ""


def refuse_unmet(config):
    """A ValueError naming the setting of `config` (a `tfkfac.KFACConfig` with
    self_tuning=True) that self-tuning cannot honour."""
    rule = LevenbergMarquardt()
    if callable(config.damping):
        raise ValueError(
            "`damping` is λ's first value under self_tuning=True, which the "
            "Levenberg-Marquardt rule then adapts: give a number in "
            f"[{rule.min_damping:g}, {rule.max_damping:g}]; received the schedule "
            f"{config.damping!r}")
    check_initial_damping("damping", config.damping, rule)
    method = config.method
    if (method == "eigen_adam") if isinstance(method, str) else \
            type(method).__name__ == "EigenAdam":
        raise ValueError(
            "`method` must give K-FAC's direction −(F̆ + γI)⁻¹∇h under self_tuning=True "
            "(eigen, inverse or a damped method object); received method='eigen_adam', "
            "which has no damping")
    for name, off, why in (
            ("kl_clip", None, "the quadratic model's α sets the step length"),
            ("grafting", None, "the quadratic model's α sets the step length"),
            ("couple_momentum_to_lr", False, "μ is the quadratic model's"),
            ("weight_rescaling", False,
             "rescaled weights would make the previous update δ₀ another vector")):
        if getattr(config, name) != off:
            raise ValueError(f"`{name}` must be {off!r} under self_tuning=True: {why}; "
                             f"received {name}={getattr(config, name)!r}")


class StepBatch(typing.NamedTuple):
    """What a train step hands self-tuning of its batch (tfkfac/attachment.py):
    `forward()`, Keras's training forward pass on it, giving (scaled loss, predictions);
    `sample_weight`, the loss's; `loss_scale`, the factor the loss is scaled by (mixed
    precision's, over the tf.distribute replicas in sync)."""

    forward: typing.Callable
    sample_weight: typing.Any
    loss_scale: typing.Any


NO_BATCH = ("KFAC(self_tuning=True) takes its extra forward passes (the exact curvature's "
            "and the loss after the update) in the train step KFAC installs on the model "
            "(`model.fit`); a custom loop (`record()` and `minimize`) hands it no batch: "
            "use `model.fit`, or self_tuning=False there.")


class SelfTuning(transform.Transform):
    """The self-tuning state of one optimizer and its step; the transform after the
    preconditioning in the update chain (tfkfac/chain.py) under `KFAC(self_tuning=True)`,
    and, after the update, its `adaptation`.

    State (saved under "self_tuning:<name>"): λ ("damping"), γ ("factor_damping", the
    damping of K-FAC's direction: λ + η), δ₀ ("previous_update:<variable path>"), and
    the last step's α, μ, M(δ), h(θ) and the last ρ ("learning_rate", "momentum",
    "model_change", "loss", "rho"; NaN until known), for the logs.
    `initial_damping`: λ's first value; `l2`: η; `rule`: a `LevenbergMarquardt`.
    For `update` and `adapt` (a training step): `model`, the Keras model; `batch()`, this
    step's `StepBatch` (None in a custom loop); `communicator`, the ranks'; and
    `learning_rate()`, the inner SGD's rate η, which applies w ← w − η g: it is handed
    g = −δ / η.
    """

    name = "self_tuning"
    SCALARS = ("damping", "factor_damping", "learning_rate", "momentum", "model_change",
               "loss", "rho")

    def __init__(self, initial_damping=1.0, l2=0.0, rule=None, model=None, batch=None,
                 communicator=None, learning_rate=None):
        self.rule = LevenbergMarquardt() if rule is None else rule
        self.initial_damping = check_initial_damping("initial_damping", initial_damping,
                                                     self.rule)
        self.l2 = validation.finite_number("l2", l2, low=0)
        self._model, self._batch = model, batch
        self._comm, self._learning_rate = communicator, learning_rate
        self.scalars, self.previous, self._index, self._paths = {}, [], {}, []

    def create_state(self, context):
        """λ and γ at their first values, δ₀ = 0 per model variable (in its dtype), the
        logged scalars at NaN (`context`: a `transform.StateContext`)."""
        first = {"damping": self.initial_damping,
                 "factor_damping": self.initial_damping + self.l2}
        for name in self.SCALARS:
            self.scalars[name] = context.add_variable((), f"self_tuning_{name}", "float64")
            with tf.init_scope():  # once, where the variable is made (a restore follows)
                self.scalars[name].assign(tf.constant(first.get(name, math.nan),
                                                      tf.float64))
        model_variables = context.model_variables
        self.previous = [context.add_variable(v.shape, f"self_tuning_previous_{i}", v.dtype)
                         for i, v in enumerate(model_variables)]
        self._index = {id(v): i for i, v in enumerate(model_variables)}
        self._paths = list(context.variable_paths)

    def saved_variables(self):
        return ([(state_lib.key(self.name, name), self.scalars[name])
                 for name in self.SCALARS]
                + [(state_lib.key(self.name, "previous_update", path), variable)
                   for path, variable in zip(self._paths, self.previous)])

    def factor_damping(self):
        """γ, the damping of this step's K-FAC direction (float64)."""
        return tf.convert_to_tensor(self.scalars["factor_damping"])

    def values(self):
        """{name: float} of the logged scalars (λ, γ, α, μ, M(δ), h(θ), ρ)."""
        return {name: float(variable.numpy()) for name, variable in self.scalars.items()}

    def solve_step(self, grads, preconditioned, variables, curvature_gram):
        """(δ per variable, M(δ)) of this step; δ₀ ← δ; α and μ logged.

        `grads`: ∇h per variable (averaged over ranks; None: no gradient);
        `preconditioned`: P per variable (Δ = −P; None: zero); `curvature_gram(vectors)`:
        the 2×2 [vᵢᵀ F vⱼ] of [Δ, δ₀] (`tfkfac.ggn.quadratic_forms`, averaged over
        ranks). A step whose α or μ is not finite changes nothing (δ = 0, δ₀ kept; M(δ)
        NaN, so that the next adaptation raises λ).
        """
        previous = [self.previous[self._index[id(v)]] for v in variables]
        delta0 = [tf.convert_to_tensor(p) for p in previous]
        direction = [tf.zeros_like(v) if p is None else -tf.cast(p, v.dtype)
                     for p, v in zip(preconditioned, variables)]
        # The same span with δ₀'s share along Δ taken out: a nearly parallel pair would
        # give a near-singular system whose large opposite α Δ and μ δ₀ cancel in float32
        # (a CNN's step once came out 1e11 long); across it, δ = a Δ + b r has no such sum.
        along = tf.math.divide_no_nan(_dot(delta0, direction), _dot(direction, direction))
        across = [p - tf.cast(along, p.dtype) * d for p, d in zip(delta0, direction)]
        parallel = _dot(across, across) <= PARALLEL_TOLERANCE * _dot(delta0, delta0)
        across = [tf.where(parallel, tf.zeros_like(r), r) for r in across]
        vectors = [direction, across]
        matrix, b = quadratic_model(curvature_gram(vectors), inner_products(vectors),
                                    inner_products([grads], vectors)[0],
                                    self.scalars["damping"], self.l2)
        a, mu, change = solve(matrix, b)
        alpha = a - mu * along  # δ = α Δ + μ δ₀
        finite = tf.logical_and(tf.math.is_finite(alpha), tf.math.is_finite(mu))
        a, alpha, mu = (tf.where(finite, x, tf.zeros_like(x)) for x in (a, alpha, mu))
        change = tf.where(finite, change, tf.constant(math.nan, tf.float64))
        delta = [tf.cast(a, v.dtype) * d + tf.cast(mu, v.dtype) * r
                 for d, r, v in zip(direction, across, variables)]
        for variable, value in zip(previous, delta):
            variable.assign(tf.where(finite, value, variable))
        for name, value in (("learning_rate", alpha), ("momentum", mu),
                            ("model_change", change)):
            self.scalars[name].assign(value)
        return delta, change

    def adapt_with(self, step, new_loss, old_loss):
        """After step `step` (0-based): when due, ρ from the losses on the step's batch
        before (`old_loss`) and after (`new_loss()`) the update, averaged over ranks, and
        the logged M(δ), then λ and γ; whether it was due."""
        def adapted():
            rho = reduction_ratio(new_loss(), old_loss, self.scalars["model_change"])
            damping = self.rule.adapted(self.scalars["damping"], rho)
            with tf.control_dependencies([self.scalars["rho"].assign(rho),
                                          self.scalars["damping"].assign(damping),
                                          self.scalars["factor_damping"].assign(
                                              damping + self.l2)]):
                return tf.constant(True)

        return tf.cond(self.rule.due(step), adapted, lambda: tf.constant(False))

    # ------------------------------------------------- in a training step (KFAC.apply)
    def _step_batch(self):
        batch = self._batch() if self._batch is not None else None
        if batch is None:
            raise ValueError(NO_BATCH)
        return batch

    def _passes(self, batch, losses=None):
        """Keras's forward pass on the step's batch, restoring the model's non-trainable
        variables and metrics after each call (one function, no side effect); the
        predictions, each pass's loss (unscaled) appended to `losses`."""
        model = self._model
        restoring = ggn.Restoring(batch.forward, model.non_trainable_variables
                                  + model.metrics_variables)

        def predict():
            scaled_loss, predictions = restoring()
            if tf.nest.is_nested(predictions):
                raise ValueError("KFAC(self_tuning=True) models the loss of a model of one "
                                 "output; this model has several")
            if losses is not None:
                losses.append(float64(scaled_loss) / float64(batch.loss_scale))
            return predictions

        return predict

    def apply(self, step):
        """The inner SGD's gradients for the step's `curvature.Preconditioned` (−δ / η;
        None where the plain gradient is None): δ from the quadratic model with the exact
        curvature of the step's batch, h(θ) kept for `adapt`."""
        preconditioned = step.preconditioned
        batch = self._step_batch()
        curvature = ggn.output_curvature(self._model.loss)
        variables = preconditioned.variables
        losses = []
        predict = self._passes(batch, losses)

        def curvature_gram(vectors):
            gram = ggn.quadratic_forms(predict, variables, vectors, curvature,
                                       batch.sample_weight)
            # h(θ) rides with the Gram matrix: the first pass's loss, at θ, with the same
            # dropout masks as the loss after the update (`adapt`).
            gram, loss = self._comm.grouped_allreduce_mean([gram, losses[0]],
                                                           category="gradients")
            self.scalars["loss"].assign(loss)
            return gram

        base = preconditioned.grads()
        delta, _ = self.solve_step(preconditioned.raw, base, variables, curvature_gram)
        rate = self._learning_rate()
        grads = [None if g is None else -d / tf.cast(rate, d.dtype)
                 for g, d in zip(base, delta)]
        return dataclasses.replace(step, grads=grads)

    def adaptation(self, updates):
        """The transform after the update that adapts λ (`adapt`); `updates()`, the inner
        optimizer's count of applied updates."""
        return _Adaptation(self, updates)

    def adapt(self, updates, finite):
        """After the inner update (`updates`: its count of applied updates after it, a
        tensor that exists once the update has run; `finite`: whether the step was
        taken): when due, h(θ + δ) on the step's batch and λ, γ adapted."""
        batch = self._step_batch()

        def new_loss():
            losses = []
            self._passes(batch, losses)()
            (loss,) = self._comm.grouped_allreduce_mean(losses, category="gradients")
            return loss

        updates = tf.cast(updates, tf.int64)
        return tf.cond(finite, lambda: self.adapt_with(updates - 1, new_loss,
                                                       self.scalars["loss"]),
                       lambda: tf.constant(False))


class _Adaptation(transform.Transform):
    """`SelfTuning.adapt` after the update (λ from the loss after it)."""

    stage = transform.AFTER

    def __init__(self, tuning, updates):
        self.tuning, self.updates = tuning, updates

    def apply(self, step):
        with tf.control_dependencies([step.applied]):
            self.tuning.adapt(tf.convert_to_tensor(self.updates()), step.finite)
        return step
