"""K-FAC learns faster per step than SGD with momentum on real Fashion-MNIST.

Same small CNN, same examples in the same order, same number of steps, and the same
tuning budget for both optimizers (three learning rates each, best final training
loss kept). Fixed seeds. Measured on this machine (2 CPU cores) when written, after
128 steps: SGD {0.01: 0.791, 0.03: 0.657, 0.1: 0.603}, K-FAC {0.01: 0.427, 0.03: 0.421,
0.1: 0.518}; best K-FAC / best SGD = 0.70. The test prints the numbers of each run.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tfkfac
from pipelines import idx_dataset

EXAMPLES = 4096
BATCH = 64
EPOCHS = 2
LEARNING_RATES = (0.01, 0.03, 0.1)
# K-FAC's best final training loss must be below this fraction of SGD's best.
EXPECTED_RATIO = 0.8


def fashion_mnist_subset():
    dataset = idx_dataset.load_idx("fashion_mnist", "train").take(EXAMPLES).batch(EXAMPLES)
    batch = next(iter(dataset))
    images = tf.cast(batch["image"], tf.float32).numpy() / 255.0
    return images, batch["label"].numpy()


def small_cnn():
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


def final_training_loss(make_optimizer, images, labels):
    model = small_cnn()
    optimizer = make_optimizer()
    if isinstance(optimizer, tfkfac.KFAC):
        optimizer.attach(model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(images, labels, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return float(model.evaluate(images, labels, batch_size=1024, verbose=0))


class LearnsTest(absltest.TestCase):

    def test_kfac_reaches_lower_training_loss_than_sgd_in_the_same_steps(self):
        images, labels = fashion_mnist_subset()
        sgd = {lr: final_training_loss(
            lambda: keras.optimizers.SGD(lr, momentum=0.9), images, labels)
            for lr in LEARNING_RATES}
        kfac = {lr: final_training_loss(
            lambda: tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(lr, momentum=0.9),
                                damping=1e-2, kl_clip=1e-3, method="eigen",
                                factor_update_freq=1, decomposition_update_freq=10),
            images, labels)
            for lr in LEARNING_RATES}
        print(f"final training loss after {EPOCHS * EXAMPLES // BATCH} steps:",
              {"sgd": sgd, "kfac": kfac})
        self.assertTrue(all(np.isfinite(list(kfac.values()))))
        self.assertLess(min(kfac.values()), EXPECTED_RATIO * min(sgd.values()))


if __name__ == "__main__":
    absltest.main()
