"""A Keras user's own `fit` with tfkfac.KFAC and keras.callbacks.BackupAndRestore, run
by tests/test_backup_and_restore.py as a process that a real SIGTERM can end.

`python backup_and_restore_worker.py <backup_dir> <out.npz> [--sigterm_at_epoch=E]`
trains EPOCHS epochs (resuming from `backup_dir` if it holds a backup); with
--sigterm_at_epoch the process sends itself SIGTERM when epoch E begins and dies of it
(the default action, as under a job scheduler). At the end it saves the model's and
the optimizer's variables (weights, momenta, K-FAC factors, decompositions, counters)
to `out.npz`.
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfkfac  # noqa: E402

EPOCHS = 4


class SigtermAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGTERM)


def main(backup_dir, out_path, *options):
    keras.utils.set_random_seed(1)
    examples = np.random.RandomState(0).rand(256, 8).astype("float32")
    labels = (examples.sum(axis=1) > 4).astype("int64")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                            damping=0.01, kl_clip=1e-3, factor_update_freq=2,
                            inv_update_freq=4).attach(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir)]
    for option in options:
        callbacks.append(SigtermAtEpoch(int(option.split("=", 1)[1])))
    model.fit(examples, labels, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)
    np.savez(out_path, *[v.numpy() for v in model.variables + optimizer.variables])


if __name__ == "__main__":
    main(*sys.argv[1:])
