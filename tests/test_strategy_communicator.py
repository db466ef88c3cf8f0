"""The tf.distribute communicator carries the dtypes the Horovod one does
(`distributed.base.COPY_DTYPES`, `MEAN_DTYPES`) where TensorFlow's collective ops take
fewer: a gather no bool or small integers (the trainer's agreement gathers its settings
as uint8 bytes), a broadcast no small integers, a mean no int8 or uint8. Each arrives
exactly, in its own dtype, on 2 replicas (MirroredStrategy over 2 logical CPUs of this
process: the collective ops MultiWorkerMirroredStrategy's workers run). A dtype no
communicator sends is refused by name.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

# Two logical CPU devices, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

from tfkfac import distributed  # noqa: E402

RANKS = 2
# The dtypes the communicator carries that TensorFlow's ops refuse (TF 2.21).
GATHER_WIDENED = (tf.bool, tf.int8, tf.uint8, tf.int16, tf.uint16)
BROADCAST_WIDENED = (tf.int8, tf.uint8, tf.int16, tf.uint16)
MEAN_WIDENED = (tf.int8, tf.uint8)


def rank_values(rank, count, dtype):
    """`count` values of `dtype` that differ between ranks, the ends of its range among
    them (which a narrowing on the wire would change)."""
    if dtype == tf.bool:
        return np.resize([rank == 0, True, False], count)
    return np.resize(np.array([dtype.min, dtype.max, rank, dtype.max - rank],
                              dtype.as_numpy_dtype), count)


class StrategyCommunicatorDtypeTest(parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with cls.strategy.scope():
            cls.comm = distributed.StrategyCommunicator()

    def per_replica(self, collective):
        """`collective(rank)` run by each replica; its results as numpy, by rank."""
        results = tf.function(lambda: self.strategy.run(
            lambda: collective(self.comm.rank)))()
        return [tf.nest.map_structure(lambda t: t.numpy(), value)
                for value in self.strategy.experimental_local_results(results)]

    @parameterized.named_parameters((dtype.name, dtype) for dtype in GATHER_WIDENED)
    def test_allgather_keeps_every_rank_exactly(self, dtype):
        # Rank r sends r + 1 rows of 2: the sizes differ, so the gather pads on the wire.
        def gather(rank):
            rows = tf.constant(rank_values(rank, 2 * (rank + 1), dtype), dtype)
            return self.comm.allgather(tf.reshape(rows, [rank + 1, 2]))

        want = np.concatenate([rank_values(rank, 2 * (rank + 1), dtype).reshape(rank + 1, 2)
                               for rank in range(RANKS)])
        for got in self.per_replica(gather):
            self.assertEqual(got.dtype, dtype.as_numpy_dtype)
            np.testing.assert_array_equal(got, want)

    @parameterized.named_parameters((dtype.name, dtype) for dtype in BROADCAST_WIDENED)
    def test_broadcast_gives_every_rank_the_root_value(self, dtype):
        def broadcast(rank):
            return self.comm.broadcast([tf.constant(rank_values(rank, 4, dtype), dtype)],
                                       root_rank=1)[0]

        for got in self.per_replica(broadcast):
            self.assertEqual(got.dtype, dtype.as_numpy_dtype)
            np.testing.assert_array_equal(got, rank_values(1, 4, dtype))

    @parameterized.named_parameters((dtype.name, dtype) for dtype in MEAN_WIDENED)
    def test_mean_of_small_integers_does_not_wrap(self, dtype):
        # 100 and 120 on 2 ranks: their sum (220) leaves int8; the mean (110) does not.
        def mean(rank):
            value = tf.constant([100 + 20 * rank] * 3, dtype)
            return self.comm.grouped_allreduce_mean([value], category="metrics")[0]

        for got in self.per_replica(mean):
            self.assertEqual(got.dtype, dtype.as_numpy_dtype)
            np.testing.assert_array_equal(got, [110] * 3)

    def test_dtype_no_communicator_sends_is_named(self):
        with self.assertRaisesRegex(ValueError, r"do not send uint32 tensors.*int16"):
            self.comm.allgather(tf.constant([1], tf.uint32))
        with self.assertRaisesRegex(ValueError, r"do not send bool tensors.*it takes int8"):
            self.comm.grouped_allreduce_mean([tf.constant([True])], category="metrics")


class CommunicationOptionsTest(absltest.TestCase):
    """Every collective op K-FAC issues carries the strategy's own CommunicationOptions
    (implementation as its hint, timeout), and the results stay exact."""

    def test_collective_ops_take_the_strategys_options(self):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        # What MultiWorkerMirroredStrategy(communication_options=...) stores; a
        # MirroredStrategy holds the default (AUTO, no timeout) and takes none.
        strategy.extended._communication_options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING,
            timeout_seconds=30.0)
        with strategy.scope():
            comm = distributed.StrategyCommunicator()

        def step():
            rank = comm.rank
            value = tf.fill([3], tf.cast(rank, tf.float32))
            return (comm.grouped_allreduce_mean([value])[0],
                    comm.allgather(tf.reshape(value, [1, 3])),
                    comm.broadcast([value], root_rank=1)[0])

        function = tf.function(lambda: strategy.run(step))
        graph = function.get_concrete_function().graph.as_graph_def()
        ops = [node for node in list(graph.node) + [n for f in graph.library.function
                                                    for n in f.node_def]
               if node.op.startswith("Collective")]
        self.assertGreaterEqual(len({node.op for node in ops}), 4, [n.op for n in ops])
        for node in ops:
            self.assertEqual(node.attr["communication_hint"].s, b"ring", node.op)
            self.assertEqual(node.attr["timeout_seconds"].f, 30.0, node.op)
        for mean, gathered, broadcast in zip(*(strategy.experimental_local_results(r)
                                               for r in function())):
            np.testing.assert_array_equal(mean.numpy(), [0.5] * 3)
            np.testing.assert_array_equal(gathered.numpy(), [[0.0] * 3, [1.0] * 3])
            np.testing.assert_array_equal(broadcast.numpy(), [1.0] * 3)

    def test_without_a_strategy_the_ops_keep_their_defaults(self):
        self.assertEqual(distributed.strategy_comm.collective_options(
            tf.distribute.get_strategy()), {})


if __name__ == "__main__":
    absltest.main()
