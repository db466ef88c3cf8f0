"""Runs one training job from a `TrainConfig`: the trainer binary and the benchmarks call
`run`, so both train exactly the same way.

Each epoch is one `model.fit` call over that epoch's data, built from (seed, epoch):
the data order of epoch e never depends on how many epochs this process ran before, so
a resumed run sees the same batches as an uninterrupted one.
"""

import math
import os

import keras

import pipelines
import tfkfac
from tfkfac import distributed
from trainers import checkpoints, config as config_lib, data as data_lib, data_parallel
from trainers import lr_schedules, models, reporting

SUMMARY_FILE = "summary.json"


def check(config, explicitly_set=()):
    """Raises ValueError for bad settings or a `model_dir` that does not fit them.

    `explicitly_set` names the config fields the user set (see `TrainConfig.validate`).
    """
    config.validate(explicitly_set)
    data_lib.split_sizes(config)
    _check_model_dir(config.resolved_model_dir(), config)


def run(config, explicitly_set=()):
    """Trains as `config` says and returns the run summary (also in `summary.json`).

    Under horovodrun every rank calls this; only rank 0 writes files and prints logs.
    """
    return Trainer(config, explicitly_set).train()


class Trainer:
    """One run's assembled pieces: data, model, optimizer, checkpoints, counters.

    Building it restores the last checkpoint when `config.resume` is set and gives every
    rank rank 0's variables; `train()` then runs the remaining epochs. Benchmarks use the
    pieces (`model`, `data`, ...) to time steps without a second training loop.
    """

    def __init__(self, config, explicitly_set=()):
        check(config, explicitly_set)
        self.config = config
        self.communicator = distributed.get_communicator()
        self.chief = self.communicator.rank == 0
        self.model_dir = config.resolved_model_dir()

        input_dtype = pipelines.set_precision(config.precision)
        self.data = data_lib.TrainingData(config, self.communicator.rank,
                                          self.communicator.size, input_dtype)
        self.total_steps = config.steps or config.epochs * self.data.steps_per_epoch
        self.num_epochs = math.ceil(self.total_steps / self.data.steps_per_epoch)

        self.model = models.build_model(config.model, self.data.input_shape,
                                        self.data.num_classes, config.seed)
        self.optimizer = _build_optimizer(config, self.data.steps_per_epoch, self.total_steps,
                                          self.communicator)
        if config.optimizer == "kfac":
            self.optimizer.attach(self.model)
        self.model.compile(optimizer=self.optimizer, jit_compile=config.xla,
                           **_loss_and_metrics(config))
        # Create every optimizer variable now: the checkpoint and the broadcast need them.
        self.model.optimizer.build(self.model.trainable_variables)

        self._store = checkpoints.CheckpointStore(self.model_dir, self.model,
                                                  self.model.optimizer)
        state = self._store.restore() if config.resume else None
        self.counters = (reporting.RunCounters.from_dict(state["counters"]) if state
                         else reporting.RunCounters())
        # Every rank starts from rank 0's initial (or restored) variables.
        self.communicator.broadcast_variables(self.model.variables +
                                              self.model.optimizer.variables)

    def train(self):
        """Runs the epochs left, checkpointing after each; returns the run summary."""
        config = self.config
        if self.chief:
            os.makedirs(self.model_dir, exist_ok=True)
            reporting.write_json(os.path.join(self.model_dir, checkpoints.CONFIG_FILE),
                                 config.to_dict())
        eval_data = self.data.evaluation()
        recorder = reporting.EpochRecorder(
            self.counters, self.communicator,
            scalars_fn=lambda: _optimizer_scalars(config, self.optimizer),
            fresh_examples_fn=self.data.fresh_examples,
            phase_fn=phase_fn(self.optimizer),
            evaluate_fn=lambda: self._evaluate_mid_epoch(eval_data),
            eval_every_steps=config.eval_every_steps,
            target_accuracy=config.target_accuracy,
            stop_at_target=config.stop_at_target)
        callbacks = [recorder]
        if self.chief:
            callbacks.append(reporting.EpochWriter(self.model_dir, recorder))
            if config.verbose:  # last, so it shows the logs the recorder completed
                callbacks.append(reporting.RunProgressBar(self.num_epochs))
        for epoch in range(self.counters.epochs, self.num_epochs):
            if config.stop_at_target and recorder.target_reached:
                break
            self.model.fit(
                self.data.train(epoch), epochs=epoch + 1, initial_epoch=epoch,
                steps_per_epoch=min(self.data.steps_per_epoch,
                                    self.total_steps - self.counters.steps),
                validation_data=eval_data, callbacks=callbacks, shuffle=False,
                verbose=config.verbose if self.chief else 0)
            if self.chief:
                self._store.save(epoch + 1, {"counters": self.counters.to_dict()})

        summary = self.summary()
        if self.chief:
            reporting.write_json(os.path.join(self.model_dir, SUMMARY_FILE), summary)
            _print_summary(summary)
        return summary

    def _evaluate_mid_epoch(self, eval_data):
        """Eval metrics ("val_" names, like fit's), leaving the running training metrics
        of the epoch as they were (`evaluate` resets the metrics it shares with fit)."""
        metric_variables = self.model.metrics_variables
        saved = [variable.numpy() for variable in metric_variables]
        results = self.model.evaluate(eval_data, verbose=0, return_dict=True)
        for variable, value in zip(metric_variables, saved):
            variable.assign(value)
        return {f"val_{name}": value for name, value in results.items()}

    def summary(self):
        """The run so far: final metrics, totals, time to target, step times, history."""
        config, counters = self.config, self.counters
        final = counters.history[-1] if counters.history else {}
        summary = {
            "model_dir": self.model_dir,
            "config": config.to_dict(),
            "num_ranks": self.communicator.size,
            "eval_split": config.eval_split,
            "final_eval_accuracy": final.get(reporting.EVAL_ACCURACY_KEY),
            "final_metrics": final,
            "epochs": counters.epochs,
            "steps": counters.steps,
            "train_time_s": counters.train_time_s,
            "fresh_examples": counters.fresh_examples,
            "target_accuracy": config.target_accuracy,
            "to_target": counters.to_target,
            "mean_step_time_s": counters.mean_step_time_s(),
            "history": counters.history,
            "evaluations": counters.evaluations,
        }
        if config.optimizer == "kfac":
            summary["kfac"] = self.optimizer.summary()
        return summary


def _check_model_dir(model_dir, config):
    """Refuses to mix two runs in one directory, and to resume a different run."""
    has_checkpoint = checkpoints.read_state(model_dir) is not None
    if has_checkpoint and not config.resume:
        raise ValueError(f"model_dir {model_dir} already holds a checkpoint; pass --resume to "
                         "continue that run or choose another --model_dir")
    saved = checkpoints.read_config(model_dir) if config.resume else None
    if saved is not None:
        changed = [f"{name} ({saved.get(name)!r} -> {getattr(config, name)!r})"
                   for name in config_lib.RESUME_INVARIANT_FIELDS
                   if saved.get(name) != _jsonable(getattr(config, name))]
        if changed:
            raise ValueError(f"resume must keep the settings of the run in {model_dir}; "
                             f"changed: {', '.join(changed)}")


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


# The plain optimizers of config.OPTIMIZERS (all but kfac).
_KERAS_OPTIMIZERS = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam,
                     "adamw": keras.optimizers.AdamW}


def _build_optimizer(config, steps_per_epoch, total_steps, communicator):
    learning_rate = lr_schedules.build_learning_rate(config, steps_per_epoch, total_steps)
    # Unset, each optimizer keeps its own default weight decay.
    options = {} if config.weight_decay is None else {"weight_decay": config.weight_decay}
    if config.optimizer == "kfac":
        # K-FAC averages gradients (and factors) over ranks itself.
        return tfkfac.KFAC(
            learning_rate=learning_rate, damping=config.damping, momentum=config.momentum,
            kl_clip=config.kl_clip, factor_update_freq=config.factor_update_freq,
            inv_update_freq=config.inv_update_freq, method=config.kfac_method,
            xla=config.xla, placement=config.kfac_placement,
            factor_wire_dtype=config.factor_wire_dtype,
            decomposition_wire_dtype=config.decomposition_wire_dtype,
            weight_sharing=config.weight_sharing, communicator=communicator, **options)
    if config.optimizer == "sgd":
        options["momentum"] = config.momentum
    return data_parallel.averaging(_KERAS_OPTIMIZERS[config.optimizer], communicator)(
        learning_rate, **options)


def _loss_and_metrics(config):
    if models.is_autoencoder(config.model):
        # Martens & Grosse report the squared error summed over pixels, averaged over images.
        squared_error = keras.metrics.MeanMetricWrapper(
            lambda target, output: keras.ops.sum(keras.ops.square(target - output), axis=-1),
            name="squared_error")
        return {"loss": keras.losses.BinaryCrossentropy(), "metrics": [squared_error]}
    if config.mixup_alpha > 0:  # mixup makes the labels one-hot mixtures
        return {"loss": keras.losses.CategoricalCrossentropy(from_logits=True),
                "metrics": [keras.metrics.CategoricalAccuracy(name="accuracy")]}
    return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]}


def _optimizer_scalars(config, optimizer):
    """The learning rate (and K-FAC damping) in force after the epoch's last step."""
    scalars = {"learning_rate": float(optimizer.learning_rate)}
    if config.optimizer == "kfac":
        scalars["damping"] = optimizer.current_damping()
    return scalars


def phase_fn(optimizer):
    """Names the work each step does, so step times can be reported per phase: K-FAC's
    own schedule (`KFAC.step_phase`), one "step" kind for the other optimizers."""
    return getattr(optimizer, "step_phase", lambda step: "step")


def _print_summary(summary):
    final = summary["final_metrics"]
    metric = ("accuracy", final.get("val_accuracy")) if "val_accuracy" in final else (
        "squared error", final.get("val_squared_error"))
    print(f"{summary['eval_split']} {metric[0]}: {metric[1]:.4f} after {summary['epochs']} "
          f"epochs, {summary['steps']} steps, {summary['train_time_s']:.1f} s of training")
    if summary["target_accuracy"] is not None:
        reached = summary["to_target"]
        print(f"target accuracy {summary['target_accuracy']}: " + (
            f"reached after {reached['time_s']:.1f} s, {reached['steps']} steps, "
            f"{reached['fresh_examples']} fresh examples" if reached else "not reached"))
    print(f"logs: {summary['model_dir']} (metrics.csv, tensorboard/, {SUMMARY_FILE}, "
          f"{checkpoints.CHECKPOINT_SUBDIR}/)")
