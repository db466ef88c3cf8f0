"""Trains a model with K-FAC or one of Keras's optimizers (SGD, Adam, AdamW, Muon,
ScheduleFreeAdamW, Lamb): `python -m trainers.train [--flags]`.

With no flags it is the `make train` job: the small CNN on real Fashion-MNIST with the
declared default K-FAC (`tfkfac.KFAC()`'s: inverse method, damping 0.03, no KL clip, into
ScheduleFreeAdamW at learning rate 0.01 warmed up over 5% of the run, evaluated at its
averaged weights), printing the test accuracy and where the logs went. Under
`horovodrun -np N python -m trainers.train ...` or
`python -m trainers.launch --engine=multi_worker --workers=N -- ...` (`--distribution`)
each rank trains on its shard and rank 0 writes the logs and checkpoints.
"""

import dataclasses

from absl import app, flags, logging

from trainers import checkpoints, cli, config as config_lib, distribution, errors
from trainers import models, runner

CLI = cli.Program("trainers.train")

_DEFAULTS = config_lib.TrainConfig()

flags.DEFINE_enum("model", _DEFAULTS.model, models.MODEL_NAMES, "Model to train.")
flags.DEFINE_string("dataset", _DEFAULTS.dataset,
                    "fashion_mnist or mnist (read offline from IDX files), or any prepared "
                    "TFDS image classification dataset name.")
flags.DEFINE_string("data_dir", None, "TFDS data directory (default: $TFDS_DATA_DIR or "
                    "~/tensorflow_datasets).")
flags.DEFINE_string("idx_dir", None,
                    "fashion_mnist/mnist: directory of the four IDX files to prepare the "
                    "dataset from (default: Debian's dataset-fashion-mnist files). If the "
                    "dataset is prepared in --data_dir from other files, that is an error.")
flags.DEFINE_string("train_split", _DEFAULTS.train_split,
                    "TFDS split to train on, e.g. train or train[:54000].")
flags.DEFINE_string("eval_split", _DEFAULTS.eval_split,
                    "TFDS split evaluated after every epoch, e.g. test or train[54000:].")
flags.DEFINE_enum("optimizer", _DEFAULTS.optimizer, config_lib.OPTIMIZERS,
                  "kfac: K-FAC in front of --kfac_inner_optimizer (default "
                  "schedule_free_adamw); sgd: "
                  "SGD with --momentum; adam: Adam; adamw: Adam with decoupled weight decay "
                  "(--weight_decay); muon: Keras's Muon (orthogonalized momentum for Dense "
                  "kernels, AdamW's step for the output layer and other weights, on AdamW's "
                  "learning-rate scale); schedule_free_adamw: Keras's ScheduleFreeAdamW "
                  "(its averaging step corrected to the published one), with its own "
                  "warm-up (--warmup_epochs) and no schedule, evaluated at its averaged "
                  "weights; lamb: Keras's Lamb (layer-wise trust ratio).")
flags.DEFINE_float("learning_rate", None,
                   "Base learning rate, the one number to tune. Default by the update rule "
                   "(--optimizer, or under kfac --kfac_inner_optimizer): " + ", ".join(
                       f"{rule} {rate:g}" for rule, rate in
                       config_lib.DEFAULT_LEARNING_RATES.items()) + ". Under K-FAC's "
                   "default schedule_free_adamw start at 0.01, about 1-2x the rate "
                   "schedule_free_adamw alone takes.")
flags.DEFINE_float("momentum", _DEFAULTS.momentum,
                   "Momentum of SGD (also as K-FAC's inner optimizer); the other optimizers "
                   "keep their own.")
flags.DEFINE_bool("nesterov", _DEFAULTS.nesterov,
                  "Nesterov momentum for SGD (also as K-FAC's inner optimizer).")
flags.DEFINE_float("weight_decay", _DEFAULTS.weight_decay,
                   "Decoupled weight decay of any optimizer: each step also subtracts "
                   "learning_rate x weight_decay x w. Unset: AdamW's and Muon's default "
                   "0.004, no decay for the others.")
flags.DEFINE_enum("lr_schedule", _DEFAULTS.lr_schedule, config_lib.LR_SCHEDULES,
                  "constant; warmup (linear over --warmup_epochs, then constant); step "
                  "(x --lr_decay_factor at each of --lr_decay_epochs); polynomial (to 0 at "
                  "the last step with power --lr_decay_power); cosine (after the warmup, "
                  "half a cosine to 0 at the last step). schedule_free_adamw takes "
                  "constant or warmup only.")
flags.DEFINE_float("warmup_epochs", None,
                   "Linear learning-rate warmup length in epochs, for any schedule "
                   "(schedule_free_adamw: its own warmup_steps). Not given: 5% of the "
                   "run's steps for schedule_free_adamw (alone or inside kfac), none for "
                   "the other rules.")
flags.DEFINE_list("lr_decay_epochs", [], "Epochs at which lr_schedule=step decays, e.g. 10,20.")
flags.DEFINE_float("lr_decay_factor", _DEFAULTS.lr_decay_factor,
                   "Factor of each lr_schedule=step decay.")
flags.DEFINE_float("lr_decay_power", _DEFAULTS.lr_decay_power,
                   "Power of lr_schedule=polynomial.")
flags.DEFINE_enum("kfac_inner_optimizer", _DEFAULTS.kfac_inner_optimizer,
                  config_lib.FIRST_ORDER_OPTIMIZERS,
                  "K-FAC: the update rule it preconditions for (schedule_free_adamw, the "
                  "default, with its own warm-up; sgd with --momentum, where --kl_clip=1e-3 "
                  "bounds the step; adam, adamw or lamb; any with --weight_decay), at "
                  "--learning_rate and --lr_schedule; muon is refused (its orthogonalization "
                  "discards K-FAC's scaling).")


def _define_kfac_flag(flag, field, doc):
    """The flag `flag` of the `tfkfac.KFACConfig` field `field`, of its type."""
    default = getattr(_DEFAULTS, config_lib.RENAMED_FIELDS.get(flag, flag))
    choices = getattr(field.metadata["check"], "choices", None)
    if choices is not None:
        flags.DEFINE_enum(flag, default, [c for c in choices if c is not None], doc)
    elif isinstance(field.default, bool):
        flags.DEFINE_bool(flag, default, doc)
    elif isinstance(field.default, int) or int in getattr(field.type, "__args__", ()):
        flags.DEFINE_integer(flag, default, doc)  # an int, or an int or None
    else:
        flags.DEFINE_float(flag, default, doc + (" 0 turns it off." if field.name == "kl_clip"
                                                 else ""))


def _define_kfac_flags():
    """One flag per K-FAC setting the trainer exposes, from `tfkfac.KFACConfig`, and one
    per name a setting had before 0.2 (a flag of its own, not an alias, so that both names
    given with different values are found: `config_from_flags`)."""
    for flag, field in config_lib.KFAC_FLAGS.items():
        _define_kfac_flag(flag, field, "K-FAC: " + field.metadata["doc"])
    for old, new in config_lib.RENAMED_FIELDS.items():
        _define_kfac_flag(old, config_lib.KFAC_FLAGS[new], f"Deprecated: --{new}'s name "
                          "before 0.2.")


_define_kfac_flags()
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Examples per step on each rank.")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Epochs to train (ignored with --steps).")
flags.DEFINE_integer("steps", None, "If set, train exactly this many steps (overrides "
                     "--epochs; the last epoch may be partial).")
flags.DEFINE_enum("echo_mode", _DEFAULTS.echo_mode, config_lib.ECHO_MODES,
                  "Data echoing variant (Choi et al.).")
flags.DEFINE_float("echo_factor", _DEFAULTS.echo_factor,
                   "Data echoing factor e >= 1 (fractional allowed); needs --echo_mode.")
flags.DEFINE_integer("shuffle_buffer", _DEFAULTS.shuffle_buffer,
                     "Examples in the shuffle buffer; 0 disables shuffling.")
flags.DEFINE_integer("crop_padding", _DEFAULTS.crop_padding,
                     "Random crop after padding each side by this many pixels; 0 disables.")
flags.DEFINE_bool("flip", _DEFAULTS.flip, "Random horizontal flips.")
flags.DEFINE_float("erasing_probability", _DEFAULTS.erasing_probability,
                   "Random erasing probability (Osawa et al. use 0.5); 0 disables.")
flags.DEFINE_float("mixup_alpha", _DEFAULTS.mixup_alpha, "Mixup Beta(alpha, alpha); 0 disables.")
flags.DEFINE_bool("running_mixup", _DEFAULTS.running_mixup,
                  "Osawa et al.'s running mixup (needs --mixup_alpha).")
flags.DEFINE_float("read_latency", _DEFAULTS.read_latency,
                   "Simulated storage latency per example in seconds (slow input demo).")
flags.DEFINE_enum("precision", _DEFAULTS.precision, config_lib.PRECISIONS,
                  "Keras dtype policy; mixed policies keep float32 variables and K-FAC state.")
flags.DEFINE_integer("eval_every_steps", _DEFAULTS.eval_every_steps,
                     "Also evaluate every this many steps (finer time-to-target and "
                     "accuracy-vs-time curves); 0 evaluates at epoch ends only.")
flags.DEFINE_float("eval_spacing", _DEFAULTS.eval_spacing,
                   "Also evaluate whenever the steps since the last evaluation reach this "
                   "share of the steps done (at least 5 apart; with --eval_every_steps, at "
                   "most that many apart): dense early, sparse later, so a time to a target "
                   "is known to within this share of itself. 0: off.")
flags.DEFINE_bool("noise_scale", _DEFAULTS.noise_scale,
                  "Log the gradient noise scale B_simple per epoch (noise_scale, and under "
                  "kfac preconditioned_noise_scale); see docs/design.md §13.")
flags.DEFINE_integer("noise_scale_interval", _DEFAULTS.noise_scale_interval,
                     "With --noise_scale, measure every this many steps (on one process each "
                     "measured step takes one more backward pass).")
flags.DEFINE_float("target_accuracy", None,
                   "Eval accuracy whose first crossing is reported (time, steps, epochs, "
                   "fresh examples).")
flags.DEFINE_bool("stop_at_target", _DEFAULTS.stop_at_target,
                  "Stop after the epoch that reaches --target_accuracy.")
flags.DEFINE_integer("give_up_steps", None,
                     "With --give_up_accuracy: stop at the first evaluation after this many "
                     "steps unless one at or before them reached --give_up_accuracy (a "
                     "tuning trial that can no longer win).")
flags.DEFINE_float("give_up_accuracy", None,
                   "The eval accuracy --give_up_steps asks for.")
flags.DEFINE_string("model_dir", None, "Where logs and checkpoints go (default: a new "
                    "runs/<model>-<optimizer>-<time> directory).")
flags.DEFINE_bool("resume", _DEFAULTS.resume,
                  "Continue the run in --model_dir from its newest loadable checkpoint, to "
                  "exactly --steps/--epochs; an error if there is no run there. Flags not "
                  "given are the run's own; only the budget, evaluation and target flags "
                  "and paths may differ.")
flags.DEFINE_bool("auto_resume", _DEFAULTS.auto_resume,
                  "Like --resume when --model_dir holds a run, else start a new run there "
                  "(for job schedulers that restart the same command).")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of initialization and data order.")
flags.DEFINE_float("preemption_grace_seconds", _DEFAULTS.preemption_grace_seconds,
                   "After SIGTERM or SIGINT, seconds to finish the step and write its "
                   "checkpoint (then exit code 75) before exiting without it (code 128 + "
                   "signal); set it below the job scheduler's grace period.")
flags.DEFINE_bool("xla", _DEFAULTS.xla,
                  "Compile with XLA: the whole train step for first-order optimizers; for "
                  "kfac its stale steps whole in one process, and its local stages (factor "
                  "statistics, preconditioning) where a GPU is visible.")
flags.DEFINE_enum("distribution", _DEFAULTS.distribution, distribution.DISTRIBUTIONS,
                  "none: one process; horovod: a rank per process under horovodrun; "
                  "mirrored: tf.distribute.MirroredStrategy over this machine's GPUs; "
                  "multi_worker: MultiWorkerMirroredStrategy, a process per worker with its "
                  "TF_CONFIG (trainers.launch on one host); auto: horovod under horovodrun, "
                  "multi_worker with TF_CONFIG, else none. See docs/guide.md §5.")
flags.DEFINE_float("startup_timeout_seconds", _DEFAULTS.startup_timeout_seconds,
                   "multi_worker: seconds every worker named in TF_CONFIG has to join; past "
                   "them each waiting worker ends naming the ones that did not.")
flags.DEFINE_enum("verbose", str(_DEFAULTS.verbose), ["0", "1", "2"],
                  "Keras fit verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")

FLAGS = flags.FLAGS


def config_from_flags(flag_values):
    """Returns `(TrainConfig, names of the fields given on the command line)`. A setting
    given under its name before 0.2 (with a deprecation warning) and its name now, with
    different values, is a ValueError naming both."""
    renamed = _renamed_given(flag_values)
    values = {}
    for field in dataclasses.fields(config_lib.TrainConfig):
        value = flag_values[renamed.get(field.name, field.name)].value
        if field.name == "lr_decay_epochs":
            try:
                value = tuple(float(epoch) for epoch in value)
            except ValueError as error:
                raise ValueError(f"lr_decay_epochs must be numbers of epochs, e.g. 10,20; "
                                 f"got {','.join(value)}") from error
        elif field.name == "verbose":
            value = int(value)
        elif field.name == "kl_clip" and value == 0:
            value = None
        values[field.name] = value
    explicitly_set = {name for name in values if flag_values[name].present or name in renamed}
    return config_lib.TrainConfig(**values), explicitly_set


def _renamed_given(flag_values):
    """{setting: its old flag name} of the settings given under their name before 0.2."""
    given = {}
    for old, new in config_lib.RENAMED_FIELDS.items():
        if not flag_values[old].present:
            continue
        logging.warning("--%s is deprecated; use --%s", old, new)
        old_value, new_value = flag_values[old].value, flag_values[new].value
        if flag_values[new].present and old_value != new_value:
            raise ValueError(f"--{old} is the deprecated name of --{new}, and both were given, "
                             f"with different values (--{old}={old_value}, --{new}={new_value}): "
                             f"pass --{new} alone")
        given[new] = old
    return given


def main(_):
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # TFDS logs every dataset it opens at INFO
    # Every mistake a user can make is found here, before a model is built.
    try:
        checked = runner.prepare(*config_from_flags(FLAGS))
    except errors.RunError as error:  # e.g. a damaged run file in model_dir
        CLI.failure(str(error))
    except ValueError as error:
        CLI.usage_error(str(error))
    try:
        runner.run(checked)
    except errors.RunError as error:  # e.g. a full disk, ranks that disagree
        CLI.failure(str(error))


if __name__ == "__main__":
    app.run(main, flags_parser=CLI.parse_flags)
