"""The planner's memory per worker (trainers/planning/memory.py) against a real
tfkfac.KFAC's state: the bytes it counts from the model's blocks are the bytes the
optimizer's own `summary()` reports, for every method under both placements (one process
builds both), and the weights' and momentum's bytes are the model's and the inner
optimizer's."""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from trainers.planning import memory, workloads  # noqa: E402


def conv_net():
    """Conv2D, BatchNorm (a diagonal block), a grouped Conv2D (batched factors), Dense."""
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(6, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(6, 3, groups=2, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(12, activation="relu"),
        keras.layers.Dense(5)], name="conv_net")


def token_net():
    """An Embedding (a diagonal A beside a full G) and a Dense over its positions."""
    return keras.Sequential([
        keras.Input((4,), dtype="int32"),
        keras.layers.Embedding(50, 6),
        keras.layers.Dense(3)], name="token_net")


def variable_bytes(variables):
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables if len(v.shape))


class KFACStateBytesTest(parameterized.TestCase):

    @parameterized.product(build=(conv_net, token_net), placement=("replicated", "owner"),
                           method=memory.library_methods())
    def test_state_bytes_are_the_optimizers(self, build, placement, method):
        keras.utils.set_random_seed(0)
        model = build()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                                placement=placement,
                                method=method).attach(model)
        optimizer.build(model.trainable_variables)
        needs = memory.worker_bytes(workloads.workload(model, 1, model.name), placement,
                                    method, ranks=1)
        self.assertEqual(needs["factors"] + needs["decompositions"] + needs["method_state"]
                         + needs["host"], optimizer.summary()["state_bytes"])
        self.assertEqual(needs["host"] > 0, placement == "owner")
        self.assertEqual(needs["method_state"] > 0, method == "eigen_adam")
        weights = variable_bytes(model.trainable_variables)
        self.assertEqual(variable_bytes(optimizer.inner_optimizer.variables), weights)
        self.assertEqual(needs["model"], 3 * weights)  # weights, gradients, momentum

    def test_owner_spreads_decompositions_over_workers(self):
        """Under "owner" the worker holding most keeps only its blocks' decompositions;
        under "replicated" every worker keeps all of them."""
        work = workloads.workload(conv_net(), 1, "conv_net")
        one, four = (memory.worker_bytes(work, "owner", "eigen", ranks) for ranks in (1, 4))
        self.assertLess(four["decompositions"], one["decompositions"])
        self.assertEqual({k: v for k, v in four.items() if k != "decompositions"},
                         {k: v for k, v in one.items() if k != "decompositions"})
        self.assertEqual(memory.worker_bytes(work, "replicated", "eigen", 4),
                         memory.worker_bytes(work, "replicated", "eigen", 1))


if __name__ == "__main__":
    absltest.main()
