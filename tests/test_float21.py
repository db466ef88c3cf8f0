"""The float21 wire (tfkfac/distributed/float21.py, docs/design.md "float21 on the wire"):
the format against a numpy reference written here from its definition (bit
manipulation, independent of the TensorFlow code), then the 2-rank scenarios of
tests/float21_worker.py on Horovod (a horovodrun job) and on tf.distribute
(MirroredStrategy over 2 logical CPUs of this process), each checked against the same
run on a float32 wire, the bytes its communicator counted, and the planner's
prediction; and the exchange alone on 2 MultiWorkerMirroredStrategy processes.
"""

import os
import shutil
import sys
import tempfile
import time
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402
from absl.testing import absltest  # noqa: E402

# Two logical CPU devices, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import float21_worker as worker  # noqa: E402
import plan_worker  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402
from tfkfac.distributed import float21, packing  # noqa: E402
from trainers.launch import run_horovod_job, run_multi_worker_job  # noqa: E402
from trainers.planning import hardware, step_model, workloads  # noqa: E402

JOB_TIMEOUT_SECONDS = 600  # 6 short fits on 2 ranks on a loaded 2-core machine
UNIT_ROUNDOFF = 2.0 ** -13  # 13 significant bits, decoded at the middle of the truncated range
FLOAT32_SLACK = 2.0 ** -21  # float32 rounding of the sums and products around the wire
KFAC_CATEGORIES = ("gradients", "factors", "decompositions", "preconditioned")


# ------------------------------------------------------------------ numpy reference
def reference_fields(values):
    """float21 bit patterns (uint64) of float32 `values`: the sign, exponent and first 12
    fraction bits, the other 11 dropped (truncation)."""
    bits = np.asarray(values, np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    return bits >> np.uint64(11)


def reference_values(fields):
    """The float32 value of each float21 pattern: its bits, then 10000000000 (the middle
    of the 11 dropped bits' range)."""
    bits = (np.asarray(fields, np.uint64) << np.uint64(11)) | np.uint64(1 << 10)
    return bits.astype(np.uint32).view(np.float32)


def reference_words(fields):
    """Patterns three to a 64-bit word, value 3k+i at bits 21i of word k, zeros after."""
    fields = np.concatenate([fields, np.zeros(-len(fields) % 3, np.uint64)]).reshape(-1, 3)
    return fields[:, 0] | (fields[:, 1] << np.uint64(21)) | (fields[:, 2] << np.uint64(42))


def rounded(values):
    """`values` through float21 (truncated, decoded at the midpoint), as float32 (numpy)."""
    values = np.asarray(values, np.float32)
    return reference_values(reference_fields(values)).reshape(values.shape)


def bits(values):
    return np.asarray(values, np.float32).view(np.uint32)


def from_bits(pattern):
    return np.asarray([pattern], np.uint32).view(np.float32)[0]


# (value, what the format makes of it, why).
EDGES = [
    (0.0, 2.0 ** -139, "zero: the midpoint of its range, a subnormal"),
    (-0.0, -2.0 ** -139, "negative zero: the same, negative"),
    (2.0 ** -149, 2.0 ** -139, "float32's smallest subnormal, in zero's range"),
    (2.0 ** -138 - 2.0 ** -149, 2.0 ** -139, "the top of zero's range"),
    (2.0 ** -138, 3 * 2.0 ** -139, "the next subnormal pattern"),
    (from_bits(0x007FFFFF), 2.0 ** -126 - 2.0 ** -139, "float32's largest subnormal"),
    (2.0 ** -126, 2.0 ** -126 + 2.0 ** -139, "the smallest normal"),
    (1.0, 1 + 2.0 ** -13, "the bottom of a pattern's range: error 2^-13 |x|, the bound"),
    (1 + 2.0 ** -12 - 2.0 ** -23, 1 + 2.0 ** -13, "the top of it: truncated, not rounded up"),
    (1 + 2.0 ** -12, 1 + 3 * 2.0 ** -13, "the next pattern"),
    (-(1 + 2.0 ** -12 - 2.0 ** -23), -(1 + 2.0 ** -13), "negative: toward zero, sign kept"),
    (np.finfo(np.float32).max, (2 - 2.0 ** -13) * 2.0 ** 127,
     "float32's largest stays finite: truncation does not overflow"),
    (-np.finfo(np.float32).max, -(2 - 2.0 ** -13) * 2.0 ** 127, "and its negative"),
    (np.inf, from_bits(0x7F800400), "infinity: the midpoint bit is a fraction bit, a NaN"),
    (-np.inf, from_bits(0xFF800400), "negative infinity: a negative NaN"),
]
# Quiet, negative, and two whose payload is in the dropped bits only (their patterns are
# ±inf's, which decode to NaN).
NANS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00001]


class FormatTest(absltest.TestCase):
    """float21.encode/decode against the numpy reference."""

    def test_reference_on_edge_values(self):
        values = np.asarray([value for value, _, _ in EDGES], np.float32)
        fields = reference_fields(values)
        for (value, expected, why), got in zip(EDGES, reference_values(fields)):
            self.assertEqual(bits(got), bits(np.float32(expected)), f"{why}: {value!r}")

    def test_edge_values_match_reference_bit_for_bit(self):
        values = np.concatenate([np.asarray([v for v, _, _ in EDGES], np.float32),
                                 np.asarray(NANS, np.uint32).view(np.float32)])
        packed = float21.encode(tf.constant(values)).numpy()
        fields = reference_fields(values)
        np.testing.assert_array_equal(packed.view(np.uint64), reference_words(fields))
        decoded = float21.decode(packed, len(values)).numpy()
        np.testing.assert_array_equal(bits(decoded), bits(reference_values(fields)))
        nans = decoded[-len(NANS):]
        self.assertTrue(np.all(np.isnan(nans)), "NaN stays NaN, payload-only ones too")
        np.testing.assert_array_equal(np.signbit(nans), [False, True, False, True])

    def test_every_kind_of_float32_matches_reference(self):
        patterns = np.random.default_rng(0).integers(0, 2 ** 32, 100_003, dtype=np.uint64)
        values = patterns.astype(np.uint32).view(np.float32)  # every class of float32
        packed = float21.encode(tf.constant(values)).numpy()
        np.testing.assert_array_equal(packed.view(np.uint64),
                                      reference_words(reference_fields(values)))
        np.testing.assert_array_equal(bits(float21.decode(packed, len(values)).numpy()),
                                      bits(rounded(values)))

    def test_round_trip_error_is_half_a_unit(self):
        """|x̂ - x| <= 2^-13 |x| on the whole normal range (13 significant bits; a value
        at the bottom of its pattern's range reaches it), and at most 2^-139 (half the
        subnormal spacing 2^-138) below it."""
        rng = np.random.default_rng(1)
        normal = (rng.standard_normal(50_000) * 2.0 ** rng.integers(-126, 127, 50_000)
                  ).astype(np.float32)
        # The bound reached (1.0), and the ends of the range.
        ends = np.asarray([1.0, -2.0 ** 127, np.finfo(np.float32).max], np.float32)
        normal = np.concatenate([normal, ends])
        normal = normal[np.isfinite(normal) & (np.abs(normal) >= 2.0 ** -126)]
        tiny = (rng.random(10_000) * 2.0 ** -126).astype(np.float32)
        for values, bound in ((normal, UNIT_ROUNDOFF * np.abs(normal.astype(np.float64))),
                              (tiny, 2.0 ** -139)):
            back = float21.decode(float21.encode(tf.constant(values)), len(values)).numpy()
            error = np.abs(back.astype(np.float64) - values)
            self.assertTrue(np.all(error <= bound), np.max(error / np.maximum(bound, 1e-300)))
            np.testing.assert_array_equal(bits(back), bits(rounded(values)))

    def test_xla_compiled_same_bits(self):
        values = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
        eager = float21.decode(float21.encode(values), 1000).numpy()
        compiled = tf.function(lambda v: float21.decode(float21.encode(v), 1000),
                               jit_compile=True)(tf.constant(values)).numpy()
        np.testing.assert_array_equal(bits(compiled), bits(eager))

    def test_three_values_to_a_word(self):
        for count in range(8):
            packed = float21.encode(tf.ones([count]))
            self.assertEqual(packed.dtype, tf.int64)
            self.assertEqual(int(tf.size(packed)), -(-count // 3))
            self.assertEqual(packing.wire_bytes("float21", count), 8 * -(-count // 3))
        self.assertEqual(packing.wire_bytes("float16", 5), 10)


class OneProcessTest(absltest.TestCase):

    def test_kfac_takes_float21_wires(self):
        config = tfkfac.KFACConfig(factor_wire_dtype="float21",
                                   decomposition_wire_dtype="float21")
        self.assertEqual(config.factor_wire_dtype, "float21")
        with self.assertRaisesRegex(ValueError, "float21"):
            tfkfac.KFACConfig(factor_wire_dtype="float22")

    def test_one_process_sends_nothing_and_changes_nothing(self):
        comm = distributed.SingleProcess()
        values = tf.constant([1 + 2.0 ** -20, 3.0])
        self.assertIs(comm.float21_mean(values), values)
        matrices = [tf.constant([[2.0, 1.0], [1.0, 3.0]])]
        (reduced,) = distributed.allreduce_symmetric(comm, matrices, wire_dtype="float21")
        self.assertIs(reduced, matrices[0])
        self.assertEqual(set(comm.bytes_sent().values()), {0})
        with self.assertRaisesRegex(ValueError, "do not send float64 tensors.*takes float32"):
            comm.float21_mean(tf.constant([1.0], tf.float64))


class ExchangeChecks:
    """Checks of `saved["exchange"][rank]` (tests/float21_worker.py) from any engine."""

    saved = None

    def ranks_of(self, scenario):
        return [self.saved[scenario][rank] for rank in range(worker.RANKS)]

    def test_factor_mean_is_the_reference_bit_for_bit(self):
        """Each rank's factors rounded to float21, summed in float32, halved, rounded
        again: on every rank the same bits as numpy's reference."""
        inputs = [worker.rank_factors(rank) for rank in range(worker.RANKS)]
        for i in range(len(worker.FACTOR_SHAPES)):
            total = rounded(inputs[0][i]) + rounded(inputs[1][i])
            want = rounded(total / np.float32(worker.RANKS))
            for saved in self.ranks_of("exchange"):
                np.testing.assert_array_equal(bits(saved[f"mean{i}"]), bits(want), f"factor {i}")

    def test_gather_rounds_values_and_keeps_exact_items(self):
        for i, (_, _, exact) in enumerate(worker.ITEMS):
            want = worker.item_value(i) if exact else rounded(worker.item_value(i))
            for saved in self.ranks_of("exchange"):
                np.testing.assert_array_equal(bits(saved[f"item{i}"]), bits(want), f"item {i}")

    def test_exchange_bytes_are_three_values_to_a_word(self):
        factors = "factors", distributed.CATEGORIES.index("factors")
        elements = packing.packed_size([s for s in worker.FACTOR_SHAPES if len(s) > 1]) + sum(
            s[0] for s in worker.FACTOR_SHAPES if len(s) == 1)
        calls = len(distributed.CATEGORIES)
        for rank, saved in enumerate(self.ranks_of("exchange")):
            counted = saved["mean_counters"]
            self.assertEqual(counted[factors[1]], 8 * -(-elements // 3))
            self.assertEqual(counted[calls + factors[1]], 1)
            self.assertEqual(sum(counted[:calls]), counted[factors[1]])
            mine = [(int(np.prod(shape)), exact) for shape, owner, exact in worker.ITEMS
                    if owner == rank]
            rounded_count = sum(n for n, exact in mine if not exact)
            exact_count = sum(n for n, exact in mine if exact)
            column = distributed.CATEGORIES.index("decompositions")
            # Exact float32 values: two to a word.
            self.assertEqual(saved["gather_counters"][column],
                             8 * (-(-rounded_count // 3) + -(-exact_count // 2)))


class KfacRunChecks(ExchangeChecks):
    """Checks of every scenario of tests/float21_worker.py: the exchange and K-FAC runs."""

    def keys(self, scenario, prefix):
        first = self.saved[scenario][0]
        return sorted((k for k in first if k.startswith(prefix) and k[len(prefix):].isdigit()),
                      key=lambda k: int(k[len(prefix):]))

    def test_float21_factors_within_the_bound_of_the_float32_wire(self):
        """After the first factor step (factors = the batch mean): each of the two ranks'
        statistics x_r rounded (|error| <= u|x_r|), the mean rounded again (u|mean|),
        u = 2^-13; x_r positive semi-definite, so |x0_ij| + |x1_ij| <= 2 sqrt(F_ii F_jj):
        |F21 - F32| <= u (sqrt(F_ii F_jj) + |F_ij|), plus float32 rounding. Both ranks
        hold the same bits."""
        worst = 0.0
        for key in self.keys("reference", "factor"):
            reference = self.saved["reference"][0][key].astype(np.float64)
            got = [saved[key] for saved in self.ranks_of("float21_factors")]
            np.testing.assert_array_equal(bits(got[0]), bits(got[1]), key)
            if reference.ndim == 1:  # a diagonal factor: nonnegative entries
                scale = 2 * np.abs(reference)
            else:
                diagonal = np.abs(np.diagonal(reference, axis1=-2, axis2=-1))
                scale = np.sqrt(diagonal[..., :, None] * diagonal[..., None, :]) + np.abs(
                    reference)
            error = np.abs(got[0] - reference)
            self.assertTrue(np.all(error <= (UNIT_ROUNDOFF + FLOAT32_SLACK) * scale), key)
            worst = max(worst, np.max(error / np.maximum(scale, 1e-30)))
        logging.info("float21 factors: max |F21 - F32| / (sqrt(F_ii F_jj) + |F_ij|) = %.3g "
                     "(bound 2^-13 = %.3g)", worst, UNIT_ROUNDOFF)
        self.assertGreater(worst, 0.0)  # the wire did round

    def test_float21_decompositions_are_the_float32_ones_rounded(self):
        """With the same factors (float32 factor wire), every rank holds the float32
        wire's decompositions rounded to float21 by the numpy reference, bit for bit."""
        decompositions = self.keys("reference", "decomposition")
        self.assertNotEmpty(decompositions)
        for rank, saved in enumerate(self.ranks_of("float21_decompositions")):
            reference = self.saved["reference"][rank]
            for key in self.keys("reference", "factor"):
                np.testing.assert_array_equal(bits(saved[key]), bits(reference[key]), key)
            for key in decompositions:
                np.testing.assert_array_equal(bits(saved[key]), bits(rounded(reference[key])),
                                              f"rank {rank} {key}")

    def test_eigen_adam_moments_stay_bit_exact(self):
        """Under "owner" the moments travel with the preconditioned gradients: bit-exact
        on a float21 wire, while the gradients are rounded, so each weight's first step
        is the float32 wire's within u of its size (plus one float32 rounding)."""
        moments = self.keys("adam_reference", "moment")
        self.assertNotEmpty(moments)
        for rank, saved in enumerate(self.ranks_of("adam_float21")):
            reference = self.saved["adam_reference"][rank]
            for key in moments:
                np.testing.assert_array_equal(bits(saved[key]), bits(reference[key]),
                                              f"rank {rank} {key}")
            moved = False
            for key in self.keys("adam_reference", "weight"):
                start = reference[key.replace("weight", "initial")]
                step = np.abs(reference[key].astype(np.float64) - start)
                bound = (UNIT_ROUNDOFF + FLOAT32_SLACK) * step + np.spacing(
                    np.abs(reference[key]))
                self.assertTrue(np.all(np.abs(saved[key] - reference[key]) <= bound), key)
                moved |= not np.array_equal(saved[key], reference[key])
            self.assertTrue(moved, "the preconditioned gradients were rounded")

    def test_bytes_per_step_are_the_planners(self):
        """Per step and rank, the bytes counted per category are the planner's
        (trainers/planning/step_model.py): float21 three values to a 64-bit word."""
        work = workloads.workload(plan_worker.build_model(), worker.BATCH, "plan_worker")
        device = hardware.device("v100")
        fabric = step_model.fabric(device, hardware.network("ib-edr"))
        columns = [distributed.CATEGORIES.index(c) for c in KFAC_CATEGORIES]
        for name, (placement, method, factor_wire, decomposition_wire) in worker.RUNS.items():
            config = step_model.Configuration(
                placement, factor_wire, decomposition_wire, worker.FACTOR_INTERVAL,
                worker.DECOMPOSITION_INTERVAL, "expand", method)
            phases = step_model.kfac_step(work, config, worker.RANKS, device, fabric)
            for rank, saved in enumerate(self.ranks_of(name)):
                after = saved["bytes"][:, columns]
                counted = np.diff(np.concatenate([np.zeros_like(after[:1]), after]), axis=0)
                predicted = [[sum(phase.payload[rank] for phase in phases.values()
                                  if phase.category == category and step % phase.every == 0)
                              for category in KFAC_CATEGORIES]
                             for step in range(worker.STEPS)]
                np.testing.assert_array_equal(counted, predicted, f"{name} rank {rank}")


def job_results(launch, scenarios):
    """{scenario: {rank: saved}} of a 2-process job of tests/float21_worker.py started by
    `launch(argv, processes, timeout)`, which returns (exit code, output)."""
    os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
    out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
    start = time.time()
    with mock.patch.dict(os.environ, {worker.OUT_DIR_VARIABLE: out_dir}):
        code, output = launch(os.path.join(TESTS_DIR, "float21_worker.py"), worker.RANKS,
                              JOB_TIMEOUT_SECONDS)
    logging.info("2-process job exited %d after %.1f s", code, time.time() - start)
    if code:
        raise AssertionError(f"the 2-process job failed:\n{output[-6000:]}")
    saved = {name: {rank: dict(np.load(os.path.join(out_dir, f"{name}.rank{rank}.npz")))
                    for rank in range(worker.RANKS)} for name in scenarios}
    shutil.rmtree(out_dir)
    return saved


class HorovodTest(KfacRunChecks, absltest.TestCase):
    """One `horovodrun --gloo -np 2` job of tests/float21_worker.py."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results(run_horovod_job, worker.scenarios(None))


class MultiWorkerExchangeTest(ExchangeChecks, absltest.TestCase):
    """The exchange on 2 MultiWorkerMirroredStrategy workers (gRPC between processes)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results(lambda script, workers, timeout: run_multi_worker_job(
            [script], workers, timeout), ["exchange"])


class MirroredStrategyTest(KfacRunChecks, absltest.TestCase):
    """The same scenarios on 2 MirroredStrategy replicas of this process."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        engine = worker.Strategy(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
        cls.saved = {name: run() for name, run in worker.scenarios(engine).items()}


if __name__ == "__main__":
    absltest.main()
