"""`KFACConfig`: every K-FAC setting declared once — name, default, allowed values, doc.

The optimizer's arguments and `get_config`, their checks, the trainer's flags and the
argument table of docs/arguments.md are all derived from the fields below, so a new
setting is one field here plus the code that uses it (docs/design.md §10).
"""

import dataclasses
import inspect
import math
import typing
import warnings

import keras

from tfkfac import grafting, methods, schedules, self_tuning, transform, validation
from tfkfac.distributed.packing import WIRE_DTYPES
from tfkfac.fisher import FISHERS
from tfkfac.placement import PLACEMENTS

GRAFTING = (None,) + grafting.KINDS
WEIGHT_SHARING = ("expand", "reduce")
PRODUCT_DTYPES = (None, "bfloat16")
STATE_DTYPES = ("float32", "float64")
FACTOR_EXAMPLES = ("all", "fresh")
XLA_CHOICES = (True, False, "auto")

# Renamed arguments, old name -> new name: saves of earlier versions hold the old ones.
RENAMED = {"inv_update_freq": "decomposition_update_freq",
           "bn_damping_multiplier": "diagonal_damping_multiplier",
           "eigen_wire_dtype": "decomposition_wire_dtype"}


def _setting(default, check, doc, flag=True, saved=True, changes_work=True):
    """A field of `KFACConfig`. `flag`: whether the trainer exposes it as an absl flag
    (True: under the setting's name; a string: under that name; False: not a flag).
    `saved`: whether `to_config` (the optimizer's saved config) holds it; False for how
    one job's ranks communicate, which another job that loads the save chooses anew.
    `changes_work`: whether its value can change what a step computes or moves, so that
    the planner (trainers/planning/) prices it or names it as not priced."""
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc,
                                                        "flag": flag, "saved": saved,
                                                        "changes_work": changes_work})


@dataclasses.dataclass(frozen=True)
class KFACConfig:
    """K-FAC's settings, checked when made: a bad value is a ValueError naming it.

    The defaults, with KFAC's default inner optimizer, are the configuration the
    benchmarks' protocol judges (docs/benchmarks.md, "Protocol", with what it was chosen
    from): K-FAC's directions by the inverse method, damping 0.03, no KL clip (the step
    length is the inner rule's), factors every 10 steps (decay 0.95) and decompositions
    every 100, handed to `tfkfac.ScheduleFreeAdamW` at learning rate 0.01. The learning
    rate is the one number to tune: start at 0.01, about 1-2x the rate you would give
    ScheduleFreeAdamW alone; evaluate and export at its averaged weights
    (`tfkfac.AveragedWeights`; docs/guide.md, "The default"). Every other method, inner
    optimizer and option stays available.
    """

    damping: typing.Any = _setting(
        0.03, validation.positive_or_schedule,
        "Tikhonov damping λ: a number > 0 or a callable of the step "
        "(`tfkfac.WarmupDamping` is Osawa et al.'s warm-up).", changes_work=False)
    factor_decay: float = _setting(
        0.95, validation.fraction, "ξ of the factors' running average, in [0, 1).",
        changes_work=False)
    kl_clip: typing.Optional[float] = _setting(
        None, validation.optional(validation.positive, "disables it"),
        "κ of the KL clip (Pauloski et al. eq. 18) scaling every step; None disables it "
        "(the inner optimizer's step length; 1e-3 suits an inner momentum SGD).")
    factor_update_freq: typing.Any = _setting(
        10, validation.interval,
        "Steps between factor updates: an int >= 1 or a callable of the step "
        "(`tfkfac.OsawaInterval`).")
    decomposition_update_freq: typing.Any = _setting(
        100, validation.interval,
        "Steps between decompositions (eigenbases or inverses): an int, a multiple of "
        "factor_update_freq, or a callable of the step.")
    stale_threshold: typing.Optional[float] = _setting(
        None, validation.optional(validation.positive, "turns it off"),
        "Adaptive stale statistics (docs/design.md §12): each layer's factor interval "
        "doubles while its factors change by less than this relative amount between "
        "refreshes and halves when they change more; None: every layer on "
        "factor_update_freq.")
    max_factor_interval: typing.Optional[int] = _setting(
        None, validation.optional(validation.positive_integer, "means no cap"),
        "With stale_threshold: the largest factor interval of a layer, an int >= "
        "factor_update_freq; None: no cap.")
    method: typing.Any = _setting(
        "inverse", methods.check,
        "eigen: exact (A⊗G + λI)⁻¹ by eigendecompositions; inverse: π-corrected "
        "factored Tikhonov damping; eigen_adam: Adam's second moments in the factors' "
        "eigenbases (no damping; docs/design.md §11); or a `tfkfac.Method` object "
        "(docs/guide.md §3).", flag="kfac_method")
    grafting: typing.Optional[str] = _setting(
        None, validation.one_of(GRAFTING),
        "Each layer's step length from another optimizer, its direction from K-FAC: sgd "
        "(the gradient's norm) or adam (Adam's step's norm); None: K-FAC's own. The KL "
        "clip has no effect under grafting and is not applied (docs/design.md §11).")
    adam_beta_2: float = _setting(
        0.999, validation.fraction,
        "β2 of the second moments of grafting='adam' and method='eigen_adam', in [0, 1).",
        changes_work=False)
    adam_epsilon: float = _setting(
        1e-7, validation.positive,
        "ε of grafting='adam' and method='eigen_adam': ∇ / (√v̂ + ε).", changes_work=False)
    diagonal_damping_multiplier: float = _setting(
        1.0, validation.positive,
        "ρ of the diagonal blocks (BatchNorm, LayerNorm, GroupNorm, RMSNorm), "
        "preconditioned by 1/(F + ρλ).", changes_work=False)
    weight_sharing: str = _setting(
        "expand", validation.one_of(WEIGHT_SHARING),
        "Layers applied at several positions per example: expand (each position counts "
        "like an example) or reduce (summed per example first; cheaper).")
    skip_layers: tuple = _setting(
        (), validation.patterns,
        "Regular expressions (full match) of layer names, paths or class names that get "
        "the plain gradient.", flag=False)
    xla: typing.Any = _setting(
        "auto", validation.one_of(XLA_CHOICES),
        "Compile factor statistics and preconditioning with XLA: True, False, or auto "
        "(when a GPU is visible).", flag=False)
    placement: str = _setting(
        "replicated", validation.one_of(PLACEMENTS),
        "Across ranks: replicated (every rank preconditions every layer; stale steps send "
        "only gradients) or owner (each layer's owner preconditions it, results gathered "
        "every step).", flag="kfac_placement")
    factor_wire_dtype: str = _setting(
        "float32", validation.one_of(tuple(WIRE_DTYPES)),
        "dtype of the packed factors on the wire (accumulated and stored in float32); "
        "float21 packs three 21-bit floats in a 64-bit word (docs/design.md §6).")
    decomposition_wire_dtype: str = _setting(
        "float32", validation.one_of(tuple(WIRE_DTYPES)),
        "dtype of decompositions and preconditioned gradients on the wire (float21 as for "
        "factors; eigen_adam's moments travel bit-exact on any wire).")
    overlap_reduction: bool = _setting(
        False, validation.boolean,
        "At a factor step without decompositions, precondition the layers whose "
        "preconditioning reads no factors while the factor reduction is in flight "
        "(same numbers; docs/design.md §6). Needs several ranks; not saved.", saved=False)
    hierarchical_reduction: bool = _setting(
        False, validation.boolean,
        "Every mean in two levels, within each node then across nodes (docs/design.md "
        "§6): Horovod, or MultiWorkerMirroredStrategy over several hosts, with the same "
        "number (> 1) of ranks per node; not with a float21 factor wire. Not saved.",
        saved=False)
    state_dtype: str = _setting(
        "float32", validation.one_of(STATE_DTYPES),
        "dtype of factors, decompositions and preconditioning (float64 for checks "
        "against a float64 reference).", flag=False)
    factor_examples: str = _setting(
        "all", validation.one_of(FACTOR_EXAMPLES),
        "all, or fresh: with data echoing, factors count each source example once "
        "(batches carry fresh flags).")
    factor_batch_fraction: float = _setting(
        1.0, validation.share,
        "Share of each batch, in (0, 1], the factor statistics are taken from (a random "
        "subset per factor step).")
    fisher: str = _setting(
        "empirical", validation.one_of(FISHERS),
        "empirical: G and the diagonal blocks from the loss's gradients at the observed "
        "labels; sampled: at labels drawn from the model's predictive distribution, one "
        "per example (softmax or binary cross-entropy, mean squared error; "
        "docs/design.md §2).")
    fisher_seed: int = _setting(
        0, lambda name, value: validation.integer(name, value, 0, validation.INT64_MAX),
        "With fisher='sampled': the seed of the draws (stateless, keyed by the step and "
        "the rank).", changes_work=False)
    product_dtype: typing.Optional[str] = _setting(
        None, validation.one_of(PRODUCT_DTYPES),
        "bfloat16: Gram and preconditioning products with bfloat16 operands (native "
        "bfloat16 CPUs); None: the state dtype, exact.")
    weight_rescaling: bool = _setting(
        False, validation.boolean,
        "Osawa et al.'s weight rescaling: after each update every managed Dense and "
        "Conv1D/2D/3D kernel W becomes √(2·d_out)·W/(‖W‖_F + 1e-9) (docs/design.md §5).")
    couple_momentum_to_lr: bool = _setting(
        False, validation.boolean,
        "Osawa et al.'s momentum coupled to the learning rate: the inner SGD's momentum "
        "m(t) = m(0)·η(t)/η_max, η_max the largest rate so far (docs/design.md §5).",
        changes_work=False)
    self_tuning: bool = _setting(
        False, validation.boolean,
        "Martens & Grosse's self-tuning (docs/design.md §14): each step's learning "
        "rate and momentum from the quadratic model of the exact Fisher/GGN, λ by the "
        "Levenberg-Marquardt rule every 5 steps from `damping`, the factors' damping tied "
        "to λ; plain SGD applies the step (no learning_rate, momentum or schedule). Two "
        "forward-mode passes a step, a forward pass every 5; `model.fit` only.", flag=False)
    transforms: tuple = _setting(
        (), transform.check,
        "`tfkfac.Transform` objects applied to the update in order after the KL clip or "
        "grafting, before the inner optimizer; each saves its state under its name "
        "(docs/design.md §1).", flag=False)
    phase_clocks: bool = _setting(
        False, validation.boolean,
        "Time each phase into summary()['phase_seconds']; costs 0.2-0.6 ms a step.")

    def __post_init__(self):
        for name in ("skip_layers", "transforms"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for field in dataclasses.fields(self):
            field.metadata["check"](field.name, getattr(self, field.name))
        if self.fisher_seed and self.fisher != "sampled":
            raise ValueError(f"`fisher_seed` seeds the draws of fisher='sampled'; received "
                             f"fisher_seed={self.fisher_seed} with fisher={self.fisher!r}, "
                             "which draws nothing: leave fisher_seed=0 or set fisher='sampled'")
        factor_freq, decomposition_freq = self.factor_update_freq, self.decomposition_update_freq
        if not callable(factor_freq) and not callable(decomposition_freq) and (
                decomposition_freq % factor_freq):
            raise ValueError(
                "`decomposition_update_freq` must be a multiple of `factor_update_freq` so "
                "that decompositions use freshly updated factors; received "
                f"decomposition_update_freq={decomposition_freq}, "
                f"factor_update_freq={factor_freq}")
        self._refuse_ignored_staleness_cap()
        self._refuse_unmet_reduction_options()
        self._refuse_ignored_adam_settings()
        if self.self_tuning:
            self_tuning.refuse_unmet(self)

    def _refuse_ignored_staleness_cap(self):
        """`max_factor_interval` caps adaptive stale statistics' intervals: without
        `stale_threshold` it would be ignored, and below `factor_update_freq` no interval
        could keep it."""
        cap = self.max_factor_interval
        if cap is None:
            return
        if self.stale_threshold is None:
            raise ValueError(
                "`max_factor_interval` caps the intervals of adaptive stale statistics, which "
                "`stale_threshold` turns on; received max_factor_interval="
                f"{cap} with stale_threshold=None: give a `stale_threshold` or leave "
                "max_factor_interval=None")
        if not callable(self.factor_update_freq) and cap < self.factor_update_freq:
            raise ValueError(
                "`max_factor_interval` must be an integer >= factor_update_freq (the "
                f"smallest interval); received max_factor_interval={cap} with "
                f"factor_update_freq={self.factor_update_freq}")

    def _refuse_unmet_reduction_options(self):
        """Overlap cannot survive phase clocks, which time the phases one after another;
        the float21 mean is a reduce-scatter and an allgather over all ranks, which has
        no two-level form here."""
        if self.overlap_reduction and self.phase_clocks:
            raise ValueError(
                "`overlap_reduction` lets preconditioning run while the factor reduction is "
                "in flight, and `phase_clocks` makes each phase wait for the previous one "
                "to time it: received overlap_reduction=True with phase_clocks=True; turn "
                "one off")
        if self.hierarchical_reduction and self.factor_wire_dtype == "float21":
            raise ValueError(
                "`hierarchical_reduction` sums within nodes then across them, and the "
                "float21 factor mean is an all-to-all and an allgather over every rank: "
                "received hierarchical_reduction=True with factor_wire_dtype='float21'; use "
                "float32, float16 or float64 on the wire, or hierarchical_reduction=False")

    def _refuse_ignored_adam_settings(self):
        """`adam_beta_2` and `adam_epsilon` act on grafting "adam" and the method named
        "eigen_adam" only (a method object keeps its own): changed from their defaults
        with neither, they would be ignored."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        changed = [f"{name}={getattr(self, name)!r}" for name in ("adam_beta_2", "adam_epsilon")
                   if getattr(self, name) != defaults[name]]
        if not changed or self.grafting == "adam" or (
                isinstance(self.method, str) and self.method == methods.EigenAdam.name):
            return
        if isinstance(self.method, methods.EigenAdam):
            advice = ("the object keeps its own: pass them to it, EigenAdam(beta_2=..., "
                      "epsilon=...)")
        else:
            advice = "leave them at their defaults"
        raise ValueError(
            "`adam_beta_2` and `adam_epsilon` set β2 and ε of grafting='adam' and of "
            f"method='eigen_adam' (by name) only; received {', '.join(changed)} with "
            f"method={self.method!r} and grafting={self.grafting!r}, which would ignore "
            f"them: {advice}")

    @classmethod
    def from_arguments(cls, caller="KFAC", **arguments):
        """A config from keyword arguments, renamed ones accepted with a DeprecationWarning
        and anything else a TypeError, as Python reports an unexpected argument. A renamed
        argument given beside its new name at another value is a ValueError: one would
        be ignored."""
        names = {field.name for field in dataclasses.fields(cls)}
        settings = {}
        for name, value in arguments.items():
            if name in RENAMED:
                new = RENAMED[name]
                if new in arguments and arguments[new] != value:
                    raise ValueError(
                        f"{caller}: `{name}` is the deprecated name of `{new}`; received "
                        f"{name}={value!r} and {new}={arguments[new]!r}: give `{new}` only")
                warnings.warn(f"{caller}: `{name}` is deprecated, use `{RENAMED[name]}`",
                              DeprecationWarning, stacklevel=3)
                name = RENAMED[name]
            if name not in names:
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; its "
                                f"settings are {sorted(names)}")
            settings[name] = value
        return cls(**settings)

    def to_config(self):
        """The settings as Keras config entries (schedules Keras-serialized)."""
        config = {field.name: schedules.serialize(getattr(self, field.name))
                  for field in dataclasses.fields(self) if field.metadata["saved"]}
        config["skip_layers"] = list(self.skip_layers)
        config["method"] = methods.serialize(self.method)
        config["transforms"] = transform.serialize(self.transforms)
        return config

    def preconditioning_method(self):
        """The `tfkfac.Method` that `method` names (`eigen_adam` with `adam_beta_2` and
        `adam_epsilon`) or is."""
        return methods.resolve(self.method, self.adam_beta_2, self.adam_epsilon)

    @classmethod
    def from_config(cls, config):
        """The inverse of `to_config` (a Keras-serialized method or schedule is
        deserialized); a save's renamed keys are read silently."""
        config = {RENAMED.get(name, name): value for name, value in config.items()}
        config["transforms"] = [keras.saving.deserialize_keras_object(t)
                                for t in config.get("transforms", [])]
        return cls(**{name: schedules.deserialize(value) for name, value in config.items()})


def settings():
    """The fields of `KFACConfig`, in declaration order."""
    return dataclasses.fields(KFACConfig)


def flag_name(field):
    """The trainer's flag for `field`, or None when the trainer does not expose it."""
    flag = field.metadata["flag"]
    return None if flag is False else (field.name if flag is True else flag)


def markdown_table():
    """docs/arguments.md's table of every setting (tests check the file matches)."""
    rows = ["| argument | default | trainer flag | what it is |", "|---|---|---|---|"]
    for field in settings():
        flag = flag_name(field)
        default = field.default
        shown = repr(default) if not (isinstance(default, float) and math.isfinite(default)) \
            else f"{default:g}"
        rows.append(f"| `{field.name}` | `{shown}` | {f'`--{flag}`' if flag else '—'} | "
                    f"{field.metadata['doc']} |")
    return "\n".join(rows) + "\n"


def signature_with_settings(function):
    """`function`'s signature with its `**settings` spelled out as the settings, so that
    `help()` and editors show every argument and its default."""
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                     default=field.default) for field in settings()]
    return signature.replace(parameters=parameters)
