"""One training run's settings, checked as a whole before anything is built.

The absl flags of `trainers.train` and the benchmarks both produce a `TrainConfig`, so a
benchmark runs exactly what a user would run with the same flags.
"""

import dataclasses
import datetime
import os
from typing import Optional, Tuple

import keras

import pipelines
from pipelines import limits
from tfkfac import config as kfac_config, inner as kfac_inner, validation
from trainers import distribution, models

# Keras's own update rules the trainer offers (trainers/runner.py builds them).
FIRST_ORDER_OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "schedule_free_adamw", "lamb")
OPTIMIZERS = ("kfac",) + FIRST_ORDER_OPTIMIZERS
# The update rules K-FAC can precondition for (`--kfac_inner_optimizer`).
KFAC_INNER_OPTIMIZERS = ("sgd", "adam", "adamw", "schedule_free_adamw", "lamb")
# Update rules K-FAC refuses to precede, and why: the library's reason (tfkfac.inner).
KFAC_REFUSED_INNER_OPTIMIZERS = {
    "muon": f"{kfac_inner.refused_reason(keras.optimizers.Muon)}; use optimizer=muon, or "
            "K-FAC with kfac_inner_optimizer=adamw",
}
# Update rules whose momentum is --momentum; the others keep their own.
MOMENTUM_OPTIMIZERS = ("sgd",)
# Update rules that run without an external learning-rate schedule: --warmup_epochs is
# their own warm-up, and a decaying --lr_schedule is refused.
SCHEDULE_FREE_OPTIMIZERS = ("schedule_free_adamw",)
SCHEDULE_FREE_LR_SCHEDULES = ("constant", "warmup")
# Without --warmup_epochs a schedule-free rule warms up over this share of the run's
# steps (AlgoPerf's baselines warm up over 5% of theirs), any other rule not at all.
SCHEDULE_FREE_WARMUP_SHARE = 0.05
# --learning_rate when not given, by update rule (`update_rule`): K-FAC's default inner
# ScheduleFreeAdamW takes the library's 0.01, which suits ScheduleFreeAdamW alone too
# (its tuned rates here: 5e-3 to 2e-2); SGD the trainer's earlier 0.05; the Adam family
# (and Muon, on AdamW's scale) Keras's 1e-3.
DEFAULT_LEARNING_RATES = {"schedule_free_adamw": kfac_inner.DEFAULT_LEARNING_RATE,
                          "sgd": 0.05, "adam": 1e-3, "adamw": 1e-3, "muon": 1e-3,
                          "lamb": 1e-3}


def update_rule(optimizer, kfac_inner_optimizer):
    """The Keras optimizer that applies the update: `optimizer`, or under K-FAC
    `kfac_inner_optimizer`."""
    return kfac_inner_optimizer if optimizer == "kfac" else optimizer


# Models whose every weight Keras's Muon gives its AdamW step: Muon orthogonalizes 2-D
# kernels only (Dense), and ResNet-20's are convolutions (4-D) but the output layer, which
# Muon leaves out. That is what a Keras user gets, so the trainer runs it and says so
# (`Trainer`); tests/test_trainer_optimizers.py checks this against the models.
MODELS_WITHOUT_MUON_WEIGHTS = ("resnet20",)
LR_SCHEDULES = ("constant", "warmup", "step", "polynomial", "cosine")
ECHO_MODES = pipelines.ECHO_MODES
PRECISIONS = tuple(pipelines.PRECISIONS)
VERBOSITIES = (0, 1, 2)

# K-FAC's settings the trainer exposes: {flag: KFACConfig field}.
KFAC_FLAGS = {kfac_config.flag_name(field): field for field in kfac_config.settings()
              if kfac_config.flag_name(field)}
# Fields that only mean something to K-FAC; setting one with another optimizer is a mistake.
KFAC_ONLY_FIELDS = (*KFAC_FLAGS, "kfac_inner_optimizer")
# Fields added since the first saved configs whose default changed since: a run's saved
# settings without one were written before it existed and ran with this value.
EARLIER_DEFAULTS = {"kfac_inner_optimizer": "sgd"}
# Saved configs of earlier versions name some fields differently: old -> new.
RENAMED_FIELDS = {old: new for old, new in kfac_config.RENAMED.items() if new in KFAC_FLAGS}
# Fields a resumed run may set differently from the run that wrote the checkpoint: the
# budget (and so a schedule's end), evaluation cadence and target, where the data and
# the run live, how much is printed. Every other field must stay as it was; a resumed
# run takes the fields not given from the run's own settings.
RESUME_MAY_CHANGE_FIELDS = (
    "steps", "epochs", "eval_every_steps", "eval_spacing", "noise_scale", "noise_scale_interval",
    "target_accuracy", "stop_at_target", "give_up_steps", "give_up_accuracy",
    "data_dir", "idx_dir", "model_dir", "verbose", "resume", "auto_resume", "phase_clocks",
    "preemption_grace_seconds", "distribution", "startup_timeout_seconds",
    # How the ranks communicate, not what they compute.
    "overlap_reduction", "hierarchical_reduction",
)


@dataclasses.dataclass
class _RunConfig:
    """The settings of a run other than K-FAC's (`TrainConfig` adds those)."""

    model: str = "cnn"
    dataset: str = "fashion_mnist"
    data_dir: Optional[str] = None
    idx_dir: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "test"
    optimizer: str = "kfac"
    # None: the update rule's DEFAULT_LEARNING_RATES entry (set when the config is made).
    learning_rate: Optional[float] = None
    momentum: float = 0.9
    # SGD's Nesterov momentum (Keras's `nesterov`), the variant Shallue et al. tune.
    nesterov: bool = False
    # Decoupled (Keras semantics) for every optimizer; None keeps each one's own default:
    # AdamW's and Muon's 0.004 (Muon: on its orthogonalized and its AdamW steps alike),
    # no decay for the others.
    weight_decay: Optional[float] = None
    lr_schedule: str = "constant"
    # None: SCHEDULE_FREE_WARMUP_SHARE of the run for a schedule-free rule, else none.
    warmup_epochs: Optional[float] = None
    lr_decay_epochs: Tuple[float, ...] = ()
    lr_decay_factor: float = 0.1
    lr_decay_power: float = 2.0
    # The update rule K-FAC preconditions for: ScheduleFreeAdamW (the default, with its own
    # warm-up only), momentum SGD (with --momentum), or Adam / AdamW / Lamb, at
    # --learning_rate and its schedule, with --weight_decay.
    kfac_inner_optimizer: str = "schedule_free_adamw"
    batch_size: int = 128
    epochs: int = 2
    steps: Optional[int] = None
    echo_mode: str = "none"
    echo_factor: float = 1.0
    shuffle_buffer: int = 10_000
    read_latency: float = 0.0
    precision: str = "float32"
    eval_every_steps: int = 0
    # Evaluations also this share of the steps done apart (at least
    # reporting.MIN_EVAL_GAP steps): a time to a target is known to within this share of
    # itself. 0: off.
    eval_spacing: float = 0.0
    # The gradient noise scale in the epoch logs (tfkfac.GradientNoiseScale), measured
    # every noise_scale_interval steps.
    noise_scale: bool = False
    noise_scale_interval: int = 1
    target_accuracy: Optional[float] = None
    stop_at_target: bool = False
    # A tuning trial that can no longer win stops: past give_up_steps steps without an
    # evaluation at give_up_accuracy or above by then (reporting.EvaluationLog).
    give_up_steps: Optional[int] = None
    give_up_accuracy: Optional[float] = None
    model_dir: Optional[str] = None
    resume: bool = False
    auto_resume: bool = False
    seed: int = 0
    # Seconds after SIGTERM/SIGINT to finish the step and write its checkpoint before
    # exiting anyway (trainers/preemption.py); below the scheduler's own grace period.
    preemption_grace_seconds: float = 25.0
    xla: bool = False
    verbose: int = 1
    # multi_worker: seconds every worker named in TF_CONFIG has to join (above the field
    # `distribution`, which hides the module below it).
    startup_timeout_seconds: float = distribution.DEFAULT_STARTUP_TIMEOUT_SECONDS
    # The engine (trainers/distribution.py): auto, none, horovod, mirrored, multi_worker.
    distribution: str = "auto"

    def __post_init__(self):
        if self.learning_rate is None:  # an unknown optimizer is validate's to name
            self.learning_rate = DEFAULT_LEARNING_RATES.get(self.update_rule())

    def validate(self, explicitly_set=()):
        """Raises ValueError naming the first bad or inconsistent setting.

        `explicitly_set` names the fields the user gave (e.g. flags present on the command
        line), so K-FAC-only settings given with another optimizer are caught.
        """
        validation.one_of(models.MODEL_NAMES)("model", self.model)
        validation.one_of(OPTIMIZERS)("optimizer", self.optimizer)
        validation.one_of(LR_SCHEDULES)("lr_schedule", self.lr_schedule)
        self._refuse_kfac_inner_optimizer()
        validation.one_of(KFAC_INNER_OPTIMIZERS)("kfac_inner_optimizer",
                                                 self.kfac_inner_optimizer)
        validation.one_of(ECHO_MODES)("echo_mode", self.echo_mode)
        validation.one_of(PRECISIONS)("precision", self.precision)
        validation.one_of(VERBOSITIES)("verbose", self.verbose)
        validation.one_of(distribution.DISTRIBUTIONS)("distribution", self.distribution)
        distribution.check(self, explicitly_set)
        if not self.dataset:
            raise ValueError("`dataset` must be a dataset name, e.g. fashion_mnist")
        # The library's checks and wording, so the two never disagree.
        validation.positive("learning_rate", self.learning_rate)
        validation.fraction("momentum", self.momentum)
        if self.weight_decay is not None:
            validation.finite_number("weight_decay", self.weight_decay, low=0)
        validation.integer("seed", self.seed, 0, limits.MAX_SEED)
        validation.positive("preemption_grace_seconds", self.preemption_grace_seconds)
        validation.positive_integer("batch_size", self.batch_size)
        validation.positive_integer("epochs", self.epochs)
        if self.steps is not None:
            validation.positive_integer("steps", self.steps)
        validation.integer("eval_every_steps", self.eval_every_steps, 0, validation.INT64_MAX)
        validation.finite_number("eval_spacing", self.eval_spacing, 0, 1)
        validation.positive_integer("noise_scale_interval", self.noise_scale_interval)
        if "noise_scale_interval" in explicitly_set and not self.noise_scale:
            raise ValueError("noise_scale_interval applies to noise_scale, which is off; "
                             "pass noise_scale too")
        self._validate_schedule()
        self._validate_kfac(explicitly_set)
        self._validate_update_rule(explicitly_set)
        validation.finite_number("echo_factor", self.echo_factor, 1, limits.MAX_ECHO_FACTOR)
        if self.echo_factor > 1.0 and self.echo_mode == "none":
            raise ValueError(
                f"echo_factor={self.echo_factor} needs an echo_mode; choose one of "
                f"{', '.join(m for m in ECHO_MODES if m != 'none')}")
        self._validate_augmentation()
        if self.target_accuracy is not None:
            self._refuse_accuracy_without_classes("target_accuracy")
            validation.share("target_accuracy", self.target_accuracy)
        if self.stop_at_target and self.target_accuracy is None:
            raise ValueError("stop_at_target needs a target_accuracy")
        self._validate_give_up()
        if self.resume and not self.model_dir:
            raise ValueError("resume needs the model_dir of the run to continue")
        if self.auto_resume and not self.model_dir:
            raise ValueError("auto_resume needs a model_dir (the run to continue if it is "
                             "there, else where to start one)")
        if self.resume and self.auto_resume:
            raise ValueError("pass either resume (the run must be there) or auto_resume "
                             "(continue it if there, else start it), not both")
        if self.idx_dir is not None and self.dataset not in pipelines.idx_dataset.IDX_DATASETS:
            raise ValueError(f"idx_dir only applies to the IDX datasets "
                             f"{', '.join(sorted(pipelines.idx_dataset.IDX_DATASETS))}, "
                             f"not dataset={self.dataset}")

    def _validate_augmentation(self):
        validation.integer("shuffle_buffer", self.shuffle_buffer, 0, limits.MAX_SHUFFLE_BUFFER)
        self.augmentation()  # the image bounds crop_padding: runner
        if self.mixup_alpha > 0 and models.is_autoencoder(self.model):
            raise ValueError(f"mixup mixes class labels; model={self.model} has none")
        validation.finite_number("read_latency", self.read_latency, 0, limits.MAX_READ_LATENCY)

    def _validate_give_up(self):
        if self.give_up_steps is not None:
            validation.positive_integer("give_up_steps", self.give_up_steps)
        if self.give_up_accuracy is not None:
            validation.share("give_up_accuracy", self.give_up_accuracy)
        if (self.give_up_steps is None) != (self.give_up_accuracy is None):
            raise ValueError("give_up_steps and give_up_accuracy go together: pass both "
                             f"(received give_up_steps={self.give_up_steps}, "
                             f"give_up_accuracy={self.give_up_accuracy})")
        if self.give_up_steps is not None:
            self._refuse_accuracy_without_classes("give_up_accuracy")

    def _refuse_accuracy_without_classes(self, name):
        """An accuracy setting `name` on a model that has no classes to be accurate on."""
        if models.is_autoencoder(self.model):
            raise ValueError(f"{name} applies to classifiers "
                             f"({', '.join(models.CLASSIFIERS)}), not to model={self.model}")

    def _validate_schedule(self):
        # Every float of the schedule is checked, used by this schedule or not.
        if self.warmup_epochs is not None:
            validation.finite_number("warmup_epochs", self.warmup_epochs, low=0)
        for epoch in self.lr_decay_epochs:
            validation.positive("lr_decay_epochs", epoch)
        validation.finite_number("lr_decay_factor", self.lr_decay_factor, 0, 1, low_open=True,
                                 high_open=True)
        validation.positive("lr_decay_power", self.lr_decay_power)
        if self.lr_schedule == "warmup" and not self.warmup_epochs and (
                self.warmup_epochs == 0 or self.update_rule() not in SCHEDULE_FREE_OPTIMIZERS):
            raise ValueError("lr_schedule=warmup needs warmup_epochs > 0")
        if self.lr_schedule == "step":
            if not self.lr_decay_epochs:
                raise ValueError("lr_schedule=step needs lr_decay_epochs, e.g. 10,20")
            if list(self.lr_decay_epochs) != sorted(set(self.lr_decay_epochs)) or min(
                    self.lr_decay_epochs) <= 0:
                raise ValueError(f"lr_decay_epochs must be positive and strictly increasing, "
                                 f"got {list(self.lr_decay_epochs)}")
        elif self.lr_decay_epochs:
            raise ValueError(f"lr_decay_epochs only applies to lr_schedule=step, "
                             f"not lr_schedule={self.lr_schedule}")

    def _validate_kfac(self, explicitly_set):
        if self.optimizer != "kfac":
            stray = [name for name in KFAC_ONLY_FIELDS if name in explicitly_set]
            if stray:
                verb = "applies" if len(stray) == 1 else "apply"
                raise ValueError(f"{', '.join(stray)} only {verb} to optimizer=kfac, "
                                 f"not optimizer={self.optimizer}")
            return
        self.kfac_config()
        self._refuse_uncoupled_momentum()

    def _refuse_uncoupled_momentum(self):
        """`couple_momentum_to_lr` where the inner optimizer has no momentum it couples
        (the library's rule, tfkfac.inner.MomentumCoupling, checked before anything is
        built)."""
        if not self.couple_momentum_to_lr:
            return
        rule = f"kfac_inner_optimizer={self.kfac_inner_optimizer}"
        if self.kfac_inner_optimizer not in MOMENTUM_OPTIMIZERS:
            received = f"{rule}; pass kfac_inner_optimizer=sgd"
        elif self.momentum == 0:
            received = f"{rule} with momentum={self.momentum}"
        elif self.nesterov:
            received = f"{rule} with nesterov"
        else:
            return
        raise ValueError(
            "couple_momentum_to_lr couples the momentum of kfac_inner_optimizer=sgd with "
            "momentum > 0 and without nesterov (Osawa et al.'s heavy-ball momentum) to the "
            f"learning rate; received {received}")

    def update_rule(self):
        """The Keras optimizer that applies the update (`update_rule`)."""
        return update_rule(self.optimizer, self.kfac_inner_optimizer)

    def _refuse_kfac_inner_optimizer(self):
        if self.optimizer == "kfac" and self.kfac_inner_optimizer in KFAC_REFUSED_INNER_OPTIMIZERS:
            raise ValueError(
                f"kfac_inner_optimizer={self.kfac_inner_optimizer} is refused: "
                f"{KFAC_REFUSED_INNER_OPTIMIZERS[self.kfac_inner_optimizer]}; K-FAC's inner "
                f"optimizer is one of {', '.join(KFAC_INNER_OPTIMIZERS)}")

    def _validate_update_rule(self, explicitly_set):
        """Settings the update rule would not use, or a model it would not change."""
        rule = self.update_rule()
        running = (f"optimizer={self.optimizer}" if rule == self.optimizer
                   else f"kfac_inner_optimizer={rule}")
        if "momentum" in explicitly_set and rule not in MOMENTUM_OPTIMIZERS:
            raise ValueError(f"momentum applies to optimizer=sgd and to kfac_inner_optimizer=sgd,"
                             f" not to {running}, which keeps its own")
        if self.nesterov and rule not in MOMENTUM_OPTIMIZERS:
            raise ValueError(f"nesterov applies to optimizer=sgd and to kfac_inner_optimizer=sgd,"
                             f" not to {running}, which keeps its own momentum")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0 (with momentum 0 it changes nothing)")
        if rule in SCHEDULE_FREE_OPTIMIZERS and self.lr_schedule not in SCHEDULE_FREE_LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule={self.lr_schedule} would put a schedule on {running}, which runs "
                f"without one (its weight averaging takes the decay's place): use "
                f"lr_schedule={' or '.join(SCHEDULE_FREE_LR_SCHEDULES)}, with warmup_epochs "
                f"for its own warm-up")

    def augmentation(self):
        """The run's `pipelines.Augmentation` (checked; a bad value names its setting)."""
        return pipelines.Augmentation(**{field.name: getattr(self, field.name)
                                         for field in dataclasses.fields(pipelines.Augmentation)})

    def kfac_config(self):
        """The run's `tfkfac.KFACConfig` (checked; a bad value names its setting)."""
        settings = {field.name: getattr(self, flag) for flag, field in KFAC_FLAGS.items()}
        # `xla` compiles the train step; K-FAC's own stages keep the library's default
        # (compiled where a GPU is visible): on CPU compiling them made ResNet-20's first
        # step 7 s longer (26.5 against 19.3 s) and its factor steps no faster.
        if not self.xla:
            settings["xla"] = False
        return kfac_config.KFACConfig(**settings)

    def resolved_model_dir(self):
        """`model_dir`, or a fresh `runs/<model>-<optimizer>-<timestamp>` when unset."""
        if self.model_dir:
            return os.path.abspath(self.model_dir)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return os.path.abspath(os.path.join("runs", f"{self.model}-{self.optimizer}-{stamp}"))

    def to_dict(self):
        return dataclasses.asdict(self)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [(field.name, field.type, dataclasses.field(default=field.default))
     for field in dataclasses.fields(pipelines.Augmentation)]
    + [(flag, field.type, dataclasses.field(default=field.default))
       for flag, field in KFAC_FLAGS.items()],
    bases=(_RunConfig,))
TrainConfig.__module__ = __name__
TrainConfig.__doc__ = """Settings of one run; defaults are the `make train` job: the small CNN on
Fashion-MNIST with the declared default K-FAC (`tfkfac.KFAC()`: inverse method, damping
0.03, no KL clip, into ScheduleFreeAdamW at 0.01, warmed up over 5% of the run).
The augmentation's settings are `pipelines.Augmentation`'s, K-FAC's are
`tfkfac.KFACConfig`'s under their flag names."""
