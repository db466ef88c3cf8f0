"""`KFACConfig(overlap_reduction=...)` and `KFACConfig(hierarchical_reduction=...)`
(docs/design.md §6): the combinations refused; the overlapped step's graph, where the
preconditioning of the blocks that read no factors has no path to the factor reduction;
and the jobs of tests/reduction_options_worker.py — overlap on 2 Horovod ranks and on 2
MultiWorkerMirroredStrategy workers bit for bit the run without it, and the two-level mean
on 4 ranks as 2 nodes of 2 (Horovod, and MultiWorkerMirroredStrategy): its exchange the
numpy sum within nodes then across them bit for bit, a fit the flat one within float32
rounding, the bytes and calls counted unchanged. Each job's processes are Horovod ranks
and MultiWorkerMirroredStrategy workers at once: one start-up serves both engines' runs.
"""

import functools
import os
import shutil
import sys
import tempfile
import time
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402
from absl.testing import absltest  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

# Two logical CPU devices (two MirroredStrategy replicas), before TensorFlow starts.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import plan_worker  # noqa: E402
import reduction_options_worker as worker  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402
from tfkfac.noise_scale import NoiseScaleProbe  # noqa: E402
from trainers.launch import free_ports, run_horovod_job  # noqa: E402

# Each engine's 6 short fits on 2 ranks, or 2 on 4 ranks, on 2 loaded cores.
JOB_TIMEOUT_SECONDS = 600
# 4 ranks vs 4 ranks, sums in another order: the 2-rank suites' bound (distributed_checks).
ROUNDING_RTOL = 1e-4
REDUCTIONS = {"CollectiveReduceV2", "HorovodAllreduce", "HorovodGroupedAllreduce"}


def strategy_model(strategy, **settings):
    """plan_worker's model with a KFAC on `strategy`'s replicas, compiled."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = plan_worker.build_model()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                                damping=0.1, kl_clip=1e-3, factor_update_freq=1,
                                decomposition_update_freq=worker.DECOMPOSITION_INTERVAL,
                                communicator=distributed.StrategyCommunicator(strategy),
                                **settings).attach(model)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, optimizer


class FactorReadingEigen(tfkfac.Eigen):
    """`Eigen` as a method that does not say which pieces it reads the factors of."""

    def reads_factors(self, piece):
        return True


class RefusedTest(absltest.TestCase):
    """Each setting where an option would change nothing, or could not be honoured."""

    def test_overlap_refused_with_phase_clocks(self):
        with self.assertRaisesRegex(ValueError, "overlap_reduction.*phase_clocks"):
            tfkfac.KFACConfig(overlap_reduction=True, phase_clocks=True)

    def test_hierarchical_refused_with_a_float21_factor_wire(self):
        with self.assertRaisesRegex(ValueError, "hierarchical_reduction.*float21"):
            tfkfac.KFACConfig(hierarchical_reduction=True, factor_wire_dtype="float21")

    def test_overlap_refused_in_one_process(self):
        model = plan_worker.build_model()
        with self.assertRaisesRegex(ValueError, r"^`overlap_reduction` .* needs several "
                                    r"ranks; this job has one \(one process, without Horovod "
                                    r"or a tf.distribute strategy of several replicas\)"):
            tfkfac.KFAC(overlap_reduction=True).attach(model)
        # Under a strategy of one replica the error names the strategy (not "SingleProcess").
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            model = plan_worker.build_model()
            with self.assertRaisesRegex(ValueError, r"needs several ranks; this job has one "
                                        r"\(MirroredStrategy with 1 replica, on "
                                        r"[^)]*CPU:0\), where nothing is reduced"):
                model.compile(optimizer=tfkfac.KFAC(overlap_reduction=True), loss="mse")

    def test_overlap_refused_when_every_block_reads_its_factors(self):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with self.assertRaisesRegex(ValueError, "no managed layer is one"):
            strategy_model(strategy, overlap_reduction=True, method=FactorReadingEigen())

    def test_preconditioned_noise_scale_refused_with_overlap(self):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        _, optimizer = strategy_model(strategy, overlap_reduction=True)
        with self.assertRaisesRegex(ValueError, "noise scale.*overlap_reduction"):
            optimizer.measure_noise_scale(NoiseScaleProbe(1, preconditioned=True))
        self.assertTrue(optimizer.measure_noise_scale(NoiseScaleProbe(1, preconditioned=False)))

    def test_hierarchical_refused_without_several_nodes(self):
        with self.assertRaisesRegex(ValueError, "hierarchical.*one process"):
            tfkfac.KFAC(hierarchical_reduction=True)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope(), self.assertRaisesRegex(
                ValueError, r"several hosts.*MirroredStrategy has 2 replica"):
            distributed.get_communicator("strategy", hierarchical=True)

    def test_given_communicator_must_reduce_as_asked(self):
        with self.assertRaisesRegex(ValueError, "was made with hierarchical=False"):
            tfkfac.KFAC(hierarchical_reduction=True, communicator=distributed.SingleProcess())


class SavedTest(absltest.TestCase):

    def test_neither_option_is_saved(self):
        """How one job's ranks communicate: a job that loads the save chooses anew (one
        process would refuse either)."""
        config = tfkfac.KFACConfig(overlap_reduction=True, hierarchical_reduction=True,
                                   damping=0.2).to_config()
        self.assertNotIn("overlap_reduction", config)
        self.assertNotIn("hierarchical_reduction", config)
        self.assertEqual(tfkfac.KFACConfig.from_config(config), tfkfac.KFACConfig(damping=0.2))


def function_library():
    """{name: FunctionDef} of every function this process has traced."""
    runtime = context.context()
    return {name: runtime.get_function_def(name) for name in runtime.list_function_names()}


def called_functions(node):
    return [node.attr[key].func.name for key in ("f", "then_branch", "else_branch")
            if key in node.attr and node.attr[key].func.name]


class OverlapGraphTest(absltest.TestCase):
    """In the traced train step (MirroredStrategy, 2 replicas): which preconditioning
    waits for the factor reduction."""

    def preconditioning_waits(self, overlap):
        """[whether it waits for a factor reduction] of every call of the preconditioning
        in the traced step: a reduction among the ops it depends on, data or control,
        within its function (a reduction inside a conditional or a call counts)."""
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        before = set(context.context().list_function_names())
        model, _ = strategy_model(strategy, overlap_reduction=overlap)
        x, y = worker.examples(2)
        model.fit(x, y, batch_size=2 * worker.BATCH, shuffle=False, verbose=0)
        library = {name: f for name, f in function_library().items() if name not in before}
        reducing = {}

        def reduces(name):
            if name not in reducing:
                reducing[name] = False  # a recursion through it reduces nothing new
                reducing[name] = any(n.op in REDUCTIONS or any(
                    reduces(c) for c in called_functions(n) if c in library)
                    for n in library[name].node_def)
            return reducing[name]

        waits = []
        for function in library.values():
            nodes = {n.name: n for n in function.node_def}
            for node in function.node_def:
                if not any("__inference__precondition_" in c for c in called_functions(node)):
                    continue
                ancestors, stack = set(), [node.name]
                while stack:
                    for source in nodes[stack.pop()].input:
                        source = source.lstrip("^").split(":")[0]
                        if source in nodes and source not in ancestors:
                            ancestors.add(source)
                            stack.append(source)
                waits.append(any(nodes[a].op in REDUCTIONS or any(
                    reduces(c) for c in called_functions(nodes[a]) if c in library)
                    for a in ancestors))
        return waits

    def test_without_overlap_all_preconditioning_waits(self):
        waits = self.preconditioning_waits(overlap=False)
        self.assertLen(waits, 2)  # one per replica
        self.assertTrue(all(waits))

    def test_with_overlap_the_factor_free_blocks_do_not_wait(self):
        """Per replica: the step with decompositions due (all blocks after the factor
        update), and the overlapped one: the blocks that read no factors with no path
        to the reduction, BatchNorm's (its diagonal factor) after it."""
        waits = self.preconditioning_waits(overlap=True)
        self.assertLen(waits, 6)
        self.assertEqual(sorted(waits), [False] * 2 + [True] * 4)


@functools.cache
def job_results(job):
    """{engine: {run: {rank: saved}}} of the job `job` of tests/reduction_options_worker.py
    (REDUCTION_OPTIONS_JOB=`job`), run once for the test classes of both engines:
    "overlap" on 2 ranks, "hierarchical" on 4 as 2 nodes of 2."""
    ranks, names, hosts = ((2, worker.OVERLAP_RUNS, None) if job == "overlap" else
                           (4, HIERARCHICAL_SAVES, worker.HOSTS))
    os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
    out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
    start = time.time()
    with mock.patch.dict(os.environ, {worker.OUT_DIR_VARIABLE: out_dir,
                                      worker.JOB_VARIABLE: job,
                                      worker.PORTS_VARIABLE: ",".join(
                                          str(port) for port in free_ports(ranks))}):
        code, output = run_horovod_job(os.path.join(TESTS_DIR, "reduction_options_worker.py"),
                                       ranks, JOB_TIMEOUT_SECONDS, hosts=hosts)
    logging.info("%s job exited %d after %.1f s", job, code, time.time() - start)
    if code:
        raise AssertionError(f"the {job} job failed:\n{output[-6000:]}")
    saved = {engine: {name: {rank: dict(np.load(os.path.join(
        out_dir, f"{engine}_{name}.rank{rank}.npz"))) for rank in range(ranks)}
        for name in names} for engine in worker.ENGINES}
    shutil.rmtree(out_dir)
    return saved


class OverlapChecks:
    """Checks of an overlap job's `saved` ({run: {rank: saved}}), either engine."""

    saved = None

    def test_overlap_changes_no_bit(self):
        for name, (placement, method, overlap) in worker.OVERLAP_RUNS.items():
            if not overlap:
                continue
            plain = name.replace("_overlap", "_plain")
            for rank in range(2):
                got, want = self.saved[name][rank], self.saved[plain][rank]
                self.assertEqual(sorted(got), sorted(want))
                for key in want:
                    np.testing.assert_array_equal(got[key], want[key],
                                                  f"{name} rank {rank}: {key}")
                # factors at every step, decompositions at 0 and 2: step 1 overlapped
                np.testing.assert_array_equal(got["kfac_counters"], [worker.STEPS, 2])
            for key in self.saved[name][0]:
                if key.startswith(("weight", "factor")):  # held alike by every rank
                    np.testing.assert_array_equal(self.saved[name][0][key],
                                                  self.saved[name][1][key], f"{name}: {key}")


class HorovodOverlapTest(OverlapChecks, absltest.TestCase):
    """A `horovodrun --gloo -np 2` job."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results("overlap")["horovod"]


class MultiWorkerOverlapTest(OverlapChecks, absltest.TestCase):
    """2 MultiWorkerMirroredStrategy workers (gRPC between processes)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results("overlap")["multi_worker"]


HIERARCHICAL_SAVES = ["exchange", "exchange_flat", *worker.HIERARCHICAL_RUNS]


class HierarchicalChecks:
    """Checks of a hierarchical job's `saved` ({run: {rank: saved}}), either engine."""

    saved = None

    def test_mean_sums_within_nodes_then_across_them(self):
        """Ranks 0, 1 on one node, 2, 3 on the other: ((v0 + v1) + (v2 + v3)) / 4, bit
        for bit on every rank, in float32 and float64; Horovod's flat mean sums in
        another order, visible in some element."""
        for dtype in worker.EXCHANGE_DTYPES:
            v = [worker.rank_vector(rank, dtype) for rank in range(4)]
            want = ((v[0] + v[1]) + (v[2] + v[3])) / np.asarray(4, dtype)
            for rank in range(4):
                np.testing.assert_array_equal(self.saved["exchange"][rank][dtype], want,
                                              f"{dtype} rank {rank}")
            flat = self.saved["exchange_flat"][0][dtype]
            np.testing.assert_allclose(  # rounding of sums of 4 terms, cancellation too
                flat, want, rtol=0, atol=4 * np.finfo(dtype).eps * np.max(np.abs(v)))
            self.assertFalse(np.array_equal(flat, want), dtype)

    def test_mean_counts_what_the_flat_one_does(self):
        """One call, each rank's payload: 37 values of each dtype."""
        factors = distributed.CATEGORIES.index("factors")
        for rank in range(4):
            for name in ("exchange", "exchange_flat"):
                saved = self.saved[name][rank]
                self.assertEqual(saved["bytes"][factors], 37 * (4 + 8), name)
                self.assertEqual(saved["calls"][factors], 1, name)
                self.assertEqual(sum(saved["calls"]), 1, name)

    def test_fit_is_the_flat_one_within_rounding(self):
        """Same bytes and calls; every rank the same weights and factors, within float32
        rounding of the flat run's."""
        for rank in range(4):
            got, want = self.saved["hierarchical"][rank], self.saved["flat"][rank]
            for key in ("bytes", "calls", "kfac_counters"):
                np.testing.assert_array_equal(got[key], want[key], f"rank {rank}: {key}")
            for key in want:
                if not key.startswith(("weight", "factor")):
                    continue
                np.testing.assert_array_equal(got[key], self.saved["hierarchical"][0][key],
                                              f"rank {rank}: {key}")
                np.testing.assert_allclose(
                    got[key], want[key], rtol=0,
                    atol=ROUNDING_RTOL * np.max(np.abs(want[key])), err_msg=key)



class HorovodHierarchicalTest(HierarchicalChecks, absltest.TestCase):
    """A `horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2` job."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results("hierarchical")["horovod"]


class MultiWorkerHierarchicalTest(HierarchicalChecks, absltest.TestCase):
    """4 MultiWorkerMirroredStrategy workers, 2 on localhost and 2 on 127.0.0.1."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = job_results("hierarchical")["multi_worker"]


if __name__ == "__main__":
    absltest.main()
