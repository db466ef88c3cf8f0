"""One rank of the 2-rank trainer job launched by tests/test_trainer_horovod.py.

Trains exactly as `python -m trainers.train` does (`runner.Trainer(...).train()`), once
with K-FAC and once with SGD, each into `$TRAINER_WORKER_OUT/<optimizer>/`, then saves
this rank's final variables beside it as `<optimizer>.rank<r>.npz` (test instrumentation,
outside the model_dir the trainer writes), so the test can check that the ranks agree.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers import config as config_lib, runner  # noqa: E402

OUT_VARIABLE = "TRAINER_WORKER_OUT"
OPTIMIZERS = ("kfac", "sgd")
STEPS, BATCH = 12, 32
# 1280 examples: 640 per rank, 20 steps per epoch, so 12 steps stay in one epoch.
SETTINGS = dict(train_split="train[:1280]", eval_split="test[:512]", batch_size=BATCH,
                steps=STEPS, factor_update_freq=5, decomposition_update_freq=10, verbose=2)


def main():
    out_dir = os.environ[OUT_VARIABLE]
    for optimizer in OPTIMIZERS:
        settings = dict(SETTINGS)
        if optimizer != "kfac":
            for name in config_lib.KFAC_ONLY_FIELDS:
                settings.pop(name, None)
        trainer = runner.Trainer(config_lib.TrainConfig(
            optimizer=optimizer, model_dir=os.path.join(out_dir, optimizer), **settings))
        trainer.train()
        rank = trainer.communicator.rank
        np.savez(os.path.join(out_dir, f"{optimizer}.rank{rank}.npz"),
                 *[v.numpy() for v in trainer.model.variables + trainer.optimizer.variables])


if __name__ == "__main__":
    main()
