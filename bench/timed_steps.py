"""A trainer's training steps, timed in blocks: the trainer built as `python -m
trainers.train` builds it, fed batches cached in memory so that the input pipeline
(identical for every configuration) is not timed. bench/step_time.py and
bench/batch_scaling.py interleave such blocks of several configurations."""

import time

from trainers import reporting, runner

# An update interval longer than any timing run: the phase runs at the first step only.
FIRST_STEP_ONLY = 1_000_000


class Timed:
    """One configuration's trainer, its cached batches and its step timer."""

    def __init__(self, config, cached_batches, block_steps):
        """`config`: a `trainers.config.TrainConfig`; `cached_batches` distinct batches of
        its training stream are cycled; a `block` runs `block_steps` steps."""
        self.config = config
        self.trainer = runner.Trainer(config)
        batches = self.trainer.data.train(epoch=0).take(cached_batches).cache()
        for _ in batches:  # fill the cache now, outside any timing
            pass
        self._batches = batches.repeat()
        self.totals = {}
        self.timer = reporting.StepTimer(runner.phase_fn(self.trainer.optimizer), self.totals)
        self.block_steps = block_steps
        self.warm_up_steps = self.warm_up_s = None
        self._kfac_start = None

    def run(self, steps):
        self.trainer.model.fit(self._batches, steps_per_epoch=steps, epochs=1, verbose=0,
                               callbacks=[self.timer])

    def block(self, steps=None):
        """Runs `steps` steps (default `block_steps`); returns their mean seconds (the
        steps the timer counts), wall time ("wall") and this process's CPU time ("cpu",
        all its threads)."""
        steps = steps or self.block_steps
        count, seconds = self._counted()
        cpu = time.process_time()
        self.run(steps)
        cpu = time.process_time() - cpu
        end_count, end_seconds = self._counted()
        return {"wall": (end_seconds - seconds) / (end_count - count), "cpu": cpu / steps}

    def _counted(self):
        return (sum(count for count, _ in self.totals.values()),
                sum(seconds for _, seconds in self.totals.values()))

    def warm_up(self):
        """Runs every kind of step once (each traces), keeping their steps and wall time
        (`warm_up_steps`, `warm_up_s`: a run's start), then starts the clocks afresh."""
        kfac = self.config.optimizer == "kfac"
        if kfac and self.config.factor_update_freq < FIRST_STEP_ONLY:
            self.warm_up_steps = self.config.factor_update_freq + 1
        else:  # the first step (factors, decompositions) and a plain one
            self.warm_up_steps = 2
        start = time.perf_counter()
        self.run(self.warm_up_steps)
        self.warm_up_s = time.perf_counter() - start
        self.totals.clear()
        self._kfac_start = self._kfac_phase_seconds()

    def _kfac_phase_seconds(self):
        if self.config.optimizer != "kfac":
            return {}
        return self.trainer.optimizer.summary()["phase_seconds"]

    def result(self):
        steps = sum(count for count, _ in self.totals.values())
        means = reporting.mean_step_times(self.totals)
        result = {"timed_steps": steps, "mean_step_s": means.pop("all"),
                  "mean_step_s_by_kind": means}
        if self.config.optimizer == "kfac":
            end = self._kfac_phase_seconds()
            result["kfac_phase_s_per_step"] = {
                phase: (end[phase] - self._kfac_start[phase]) / steps for phase in end}
        return result
