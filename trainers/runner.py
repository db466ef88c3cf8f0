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
from trainers import checkpoints, config as config_lib, data as data_lib, lr_schedules
from trainers import models, reporting

SUMMARY_FILE = "summary.json"


def check(config, explicitly_set=()):
    """Raises ValueError for bad settings or a `model_dir` that does not fit them.

    `explicitly_set` names the config fields the user set (see `TrainConfig.validate`).
    """
    config.validate(explicitly_set)
    _check_model_dir(config.resolved_model_dir(), config)


def run(config, explicitly_set=()):
    """Trains as `config` says and returns the run summary (also in `summary.json`).

    Under horovodrun every rank calls this; only rank 0 writes files and prints logs.
    """
    check(config, explicitly_set)
    communicator = getattr(distributed, "get_communicator", distributed.base.SingleProcess)()
    chief = communicator.rank == 0
    model_dir = config.resolved_model_dir()

    input_dtype = pipelines.set_precision(config.precision)
    data = data_lib.TrainingData(config, communicator.rank, communicator.size, input_dtype)
    total_steps = config.steps or config.epochs * data.steps_per_epoch
    num_epochs = math.ceil(total_steps / data.steps_per_epoch)

    model = models.build_model(config.model, data.input_shape, data.num_classes, config.seed)
    optimizer = _build_optimizer(config, data.steps_per_epoch, total_steps, communicator)
    if config.optimizer == "kfac":
        optimizer.attach(model)
    model.compile(optimizer=optimizer, jit_compile=config.xla, **_loss_and_metrics(config))
    # Create every optimizer variable now: the checkpoint and the broadcast need them.
    model.optimizer.build(model.trainable_variables)

    store = checkpoints.CheckpointStore(model_dir, model, model.optimizer)
    state = store.restore() if config.resume else None
    counters = reporting.RunCounters.from_dict(state["counters"]) if state else (
        reporting.RunCounters())
    # Every rank starts from rank 0's initial (or restored) variables.
    communicator.broadcast_variables(model.variables + model.optimizer.variables)
    if chief:
        os.makedirs(model_dir, exist_ok=True)
        reporting.write_json(os.path.join(model_dir, checkpoints.CONFIG_FILE), config.to_dict())

    recorder = reporting.EpochRecorder(
        counters, communicator,
        scalars_fn=lambda: _optimizer_scalars(config, optimizer),
        fresh_examples_fn=data.fresh_examples,
        phase_fn=_phase_fn(config),
        target_accuracy=config.target_accuracy,
        stop_at_target=config.stop_at_target)
    callbacks = [recorder] + ([reporting.EpochWriter(model_dir, recorder)] if chief else [])
    eval_data = data.evaluation()
    for epoch in range(counters.epochs, num_epochs):
        if config.stop_at_target and recorder.target_reached:
            break
        model.fit(data.train(epoch), epochs=epoch + 1, initial_epoch=epoch,
                  steps_per_epoch=min(data.steps_per_epoch, total_steps - counters.steps),
                  validation_data=eval_data, callbacks=callbacks, shuffle=False,
                  verbose=config.verbose if chief else 0)
        if chief:
            store.save(epoch + 1, {"counters": counters.to_dict()})

    summary = _summary(config, model_dir, communicator.size, counters)
    if chief:
        reporting.write_json(os.path.join(model_dir, SUMMARY_FILE), summary)
        _print_summary(summary)
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


def _build_optimizer(config, steps_per_epoch, total_steps, communicator):
    learning_rate = lr_schedules.build_learning_rate(config, steps_per_epoch, total_steps)
    if config.optimizer == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=config.momentum)
    if config.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate)
    return tfkfac.KFAC(
        learning_rate=learning_rate, damping=config.damping, momentum=config.momentum,
        kl_clip=config.kl_clip, factor_update_freq=config.factor_update_freq,
        inv_update_freq=config.inv_update_freq, method=config.kfac_method,
        communicator=communicator)


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


def _phase_fn(config):
    """Names the K-FAC work a step does, so step times can be reported per phase."""
    if config.optimizer != "kfac":
        return lambda step: "step"

    def phase(step):
        if step % config.inv_update_freq == 0:
            return "factors_and_inverses"
        if step % config.factor_update_freq == 0:
            return "factors"
        return "stale"

    return phase


def _summary(config, model_dir, num_ranks, counters):
    final = counters.history[-1] if counters.history else {}
    return {
        "model_dir": model_dir,
        "config": config.to_dict(),
        "num_ranks": num_ranks,
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
    }


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
