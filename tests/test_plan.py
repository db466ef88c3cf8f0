"""The planner (trainers/plan.py): its bytes against a real 2-rank job's counters, its
FLOPs against trainers/planning/floor_model.py, its collectives against the α-β formulas,
its bound against an outside check (keras ResNet50's one-factor bound), and the
binary's output (its errors: tests/test_plan_cli.py)."""

import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl import logging  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)

import plan_worker as worker  # noqa: E402
from plan_testing import UNIT_DEVICE, UNIT_FABRIC  # noqa: E402
import tfkfac  # noqa: E402
from trainers.planning import floor_model  # noqa: E402
from tfkfac import distributed, placement as placement_lib  # noqa: E402
from tfkfac.distributed import packing  # noqa: E402
from trainers import models  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402
from trainers.planning import (collectives, hardware, recommend, step_model,  # noqa: E402
                               workloads)

JOB_TIMEOUT_SECONDS = 480  # 3 short fits on 2 ranks; 4 took 271 s at load 20-25
KFAC_CATEGORIES = ("gradients", "factors", "decompositions", "preconditioned")


class BytesMatchTwoRankJobTest(parameterized.TestCase):
    """Per step and rank, what the planner says each collective carries is what the
    communicator counted in a real 2-rank Horovod job."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        os.environ[worker.OUT_DIR_VARIABLE] = out_dir
        start = time.time()
        try:
            code, output = run_horovod_job(os.path.join(TESTS_DIR, "plan_worker.py"), 2,
                                           JOB_TIMEOUT_SECONDS)
        finally:
            del os.environ[worker.OUT_DIR_VARIABLE]
        logging.info("2-rank job exited %d after %.1f s", code, time.time() - start)
        if code:
            raise AssertionError(f"the 2-rank job failed:\n{output[-6000:]}")
        cls.counted = {case: [np.load(os.path.join(out_dir, f"{worker.case_name(case)}"
                                                   f".rank{r}.npz"))["after"] for r in range(2)]
                       for case in worker.CASES}
        shutil.rmtree(out_dir)
        cls.work = workloads.workload(worker.build_model(), worker.BATCH, "plan_worker")

    @parameterized.parameters(*worker.CASES)
    def test_bytes_per_step_and_rank(self, placement, factor_wire, decomposition_wire,
                                     method):
        config = step_model.Configuration(placement, factor_wire, decomposition_wire,
                                          worker.FACTOR_INTERVAL, worker.DECOMPOSITION_INTERVAL,
                                          "expand", method)
        phases = step_model.kfac_step(self.work, config, 2, UNIT_DEVICE, UNIT_FABRIC)
        columns = [distributed.CATEGORIES.index(c) for c in KFAC_CATEGORIES]
        for rank, after in enumerate(self.counted[(placement, factor_wire, decomposition_wire,
                                                   method)]):
            counted = np.diff(np.concatenate([np.zeros((1, after.shape[1]), np.int64), after]),
                              axis=0)[:, columns]
            predicted = [[sum(phase.payload[rank] for phase in phases.values()
                              if phase.category == category and step % phase.every == 0)
                          for category in KFAC_CATEGORIES] for step in range(worker.STEPS)]
            np.testing.assert_array_equal(counted, predicted, err_msg=f"rank {rank}")
        # The owners decompose different factors: the ranks' pieces differ, and sum to all.
        shared = phases["decomposition_sharing"].payload
        if placement == "replicated":
            itemsize = 4 if decomposition_wire == "float32" else 2
            self.assertEqual(sum(shared), itemsize * sum(
                sum(e) for e in self.work.decomposition_elements(method)))
            self.assertNotEqual(shared[0], shared[1])


class CountsMatchFloorModelTest(parameterized.TestCase):
    """The planner's kernels, recorded at one example and scaled, are floor_model's
    kernels recorded at the batch, phase by phase, on the trainer's models."""

    @parameterized.parameters(*models.CLASSIFIERS)
    def test_flops_and_bytes_per_phase(self, name):
        batch, method = 6, "eigen"
        model = workloads.load_model(name)
        work = workloads.workload(model, batch, name)
        geometries, attention, _ = floor_model.record_geometries(model, batch)
        floor = floor_model.model_floor(geometries, attention, work.trainable_parameters,
                                        method, 1, 1, ranks=2)
        planner = {
            "forward_backward": work.forward_backward("float32"),
            "factors": [k for ks in work.statistics("expand") for k in ks],
            "decomposition": [k for ks in work.decompositions(method) for k in ks],
            "precondition": [k for ks in work.preconditioning(method) for k in ks]
            + floor_model.kl_clip_kernels(sum(work.managed_parameters())),
            "update": work.update()}
        for phase, kernels in planner.items():
            self.assertEqual(floor_model.total(kernels),
                             floor_model.total(floor["phases"][phase]["kernels"]), phase)
        # The packed factor buffer is floor_model's too.
        phases = step_model.kfac_step(work, step_model.Configuration(), 2, UNIT_DEVICE,
                                      UNIT_FABRIC)
        self.assertEqual(phases["factor_reduction"].payload[0],
                         floor["communication"]["factor_payload_bytes_per_factor_step"])

    def test_reduce_rule_scales_like_its_recording(self):
        model = workloads.load_model("cnn")
        work = workloads.workload(model, 6, "cnn")
        geometries, _, _ = floor_model.record_geometries(model, 6, "reduce")
        self.assertEqual(list(work.geometries["reduce"].values()), list(geometries.values()))


    def test_saved_keras_file_is_the_model_it_holds(self):
        path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
                            "cnn.keras")
        workloads.load_model("cnn").save(path)
        saved, built = workloads.named(path).at_batch(4), workloads.named("cnn").at_batch(4)
        self.assertEqual(saved.trainable_parameters, built.trainable_parameters)
        self.assertEqual(list(saved.geometries["expand"].values()),
                         list(built.geometries["expand"].values()))


class CollectivesTest(absltest.TestCase):
    """α-β times against the formulas of Thakur et al. (2005), computed by hand."""

    link = collectives.Link(bandwidth=1e9, ring_step_latency=1e-5, tree_level_latency=5e-5)
    nvlink = collectives.Link(bandwidth=1e11, ring_step_latency=1e-6, tree_level_latency=2e-6)

    def test_one_node(self):
        fabric = collectives.Fabric(self.link, self.nvlink, ranks_per_node=8, base_latency=2e-6)
        n = 8e6
        self.assertAlmostEqual(collectives.ring_allreduce(n, 4, fabric),
                               2e-6 + 6 * 1e-6 + 2 * 3 / 4 * n / 1e11)
        self.assertAlmostEqual(collectives.tree_allreduce(n, 4, fabric),
                               2e-6 + 2 * 3 * 2e-6 + 2 * n / 1e11)
        self.assertAlmostEqual(collectives.allgather(n, 4, fabric),
                               2e-6 + 3 * 1e-6 + 3 / 4 * n / 1e11)
        self.assertEqual(collectives.allreduce(n, 1, fabric), 0.0)

    def test_across_nodes_ring_and_tree(self):
        fabric = collectives.Fabric(self.link, self.nvlink, ranks_per_node=4, links_per_node=2)
        ranks, n = 64, 1e8  # 16 nodes: 30 network steps of the ring's 126
        ring = 30 * 1e-5 + 96 * 1e-6 + 2 * 63 / 64 * n / 2e9
        tree = 2 * (3 * 2e-6 + 4 * 5e-5) + 2 * n / 2e9
        self.assertAlmostEqual(collectives.ring_allreduce(n, ranks, fabric), ring)
        self.assertAlmostEqual(collectives.tree_allreduce(n, ranks, fabric), tree)
        self.assertEqual(collectives.allreduce(n, ranks, fabric), min(ring, tree))
        # Latency-bound on 256 nodes: the tree's 8 network levels beat the ring's 510 steps.
        self.assertEqual(collectives.allreduce(1e3, 1024, fabric),
                         collectives.tree_allreduce(1e3, 1024, fabric))
        self.assertLess(collectives.tree_allreduce(1e3, 1024, fabric),
                        collectives.ring_allreduce(1e3, 1024, fabric))
        self.assertAlmostEqual(collectives.broadcast(n, ranks, fabric), 1e-5 + n / 2e9)

    def test_v_collectives_carry_all_pieces_but_the_smallest(self):
        """ReduceScatterV/AllGatherV: on a ring each link carries every piece but one, so
        the busiest carries all but the smallest; across nodes rank to rank (every step
        over the network, a node's links shared by its ranks), within a node the even
        formulas when the pieces are equal."""
        fabric = collectives.Fabric(self.link, self.nvlink, ranks_per_node=4, links_per_node=2)
        pieces = [1e6, 4e6, 2e6, 8e6, 3e6, 5e6, 7e6, 6e6]  # 8 ranks on 2 nodes
        expected = 7 * 1e-5 + (36e6 - 1e6) / (2e9 / 4)
        self.assertAlmostEqual(collectives.allgather_v(pieces, fabric), expected)
        self.assertAlmostEqual(collectives.reduce_scatter_v(pieces, fabric), expected)
        one_node = collectives.Fabric(self.link, self.nvlink, ranks_per_node=8)
        self.assertAlmostEqual(collectives.allgather_v([2e6] * 4, one_node),
                               collectives.allgather(8e6, 4, one_node))
        self.assertAlmostEqual(collectives.reduce_scatter_v([2e6] * 4, one_node),
                               collectives.reduce_scatter(8e6, 4, one_node))
        self.assertEqual(collectives.reduce_scatter_v([5e6], fabric), 0.0)

    def test_bfloat16_mean_is_an_allgather(self):
        fabric = collectives.Fabric(self.link, self.nvlink)
        self.assertEqual(step_model._mean(1e6, 8, fabric, "bfloat16"),
                         collectives.allgather(8e6, 8, fabric))
        self.assertEqual(step_model._mean(1e6, 8, fabric, "float16"),
                         collectives.allreduce(1e6, 8, fabric))


class PapersCollectivesTest(parameterized.TestCase):
    """`collective="reduce_scatter_v"` (Osawa et al. 2019, Ueno et al. 2020): each rank's
    piece of the factors is what the library's owners give it, from the blocks' own
    factor shapes; what is not a collective is as under allreduce."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = workloads.named("cnn").at_batch(8)
        link = collectives.Link(bandwidth=1e9, ring_step_latency=0.0, tree_level_latency=0.0)
        cls.fabric = collectives.Fabric(link, link)

    def owned_factor_bytes(self, placement, ranks):
        blocks = self.work.blocks["expand"]
        owners = placement_lib.owners(placement, blocks, ranks)
        owned = [0] * ranks
        if placement == "owner":
            for block, owner in zip(blocks, owners):
                owned[owner] += sum(packing.packed_size([s]) if len(s) >= 2 else s[0]
                                    for s in block.factor_shapes())
        else:
            for (b, j), owner in zip(placement_lib.factor_items(blocks), owners):
                owned[owner] += packing.packed_size([blocks[b].factor_shapes()[j]])
        return [4 * n for n in owned]

    @parameterized.parameters("owner", "replicated")
    def test_factors_go_to_their_owners(self, placement):
        config = step_model.Configuration(placement=placement)
        ranks = 3
        papers = step_model.kfac_step(self.work, config, ranks, UNIT_DEVICE, self.fabric,
                                      collective="reduce_scatter_v")
        library = step_model.kfac_step(self.work, config, ranks, UNIT_DEVICE, self.fabric)
        owned = self.owned_factor_bytes(placement, ranks)
        seconds = (sum(owned) - min(owned)) / 1e9
        if placement == "replicated":  # the diagonal blocks' factors every rank needs
            diagonals = 4 * sum(s[0] for block in self.work.blocks["expand"]
                                for s in block.factor_shapes() if len(s) == 1)
            seconds += collectives.allreduce(diagonals, ranks, self.fabric)
        self.assertAlmostEqual(papers["factor_reduction"].seconds, seconds)
        self.assertLess(papers["factor_reduction"].seconds,
                        library["factor_reduction"].seconds)
        for phase in ("forward_backward", "factor_statistics", "decomposition",
                      "preconditioning", "update"):
            self.assertEqual(papers[phase], library[phase], phase)
        if placement == "owner":  # gradients to their owners too: less than an allreduce
            self.assertLess(papers["gradient_reduction"].seconds,
                            library["gradient_reduction"].seconds)

    def test_one_rank_has_no_collective(self):
        config = step_model.Configuration(placement="owner")
        self.assertEqual(
            step_model.kfac_step(self.work, config, 1, UNIT_DEVICE, self.fabric,
                                 collective="reduce_scatter_v"),
            step_model.kfac_step(self.work, config, 1, UNIT_DEVICE, self.fabric))

    def test_unknown_collective(self):
        with self.assertRaisesRegex(ValueError, "allreduce, reduce_scatter_v"):
            step_model.kfac_step(self.work, step_model.Configuration(), 2, UNIT_DEVICE,
                                 self.fabric, collective="ring")


class BoundAndDefaultsTest(absltest.TestCase):

    def test_one_factor_bound_of_resnet50_is_the_outside_check(self):
        """keras ResNet50 at 224x224, 108 factors, cost n³: the slowest rank's
        decomposition work stops shrinking at a 4.63x speed-up (one 4609² factor)."""
        work = workloads.named("resnet50")
        bound = recommend.one_factor_bound(work, step_model.Configuration(), [1, 16, 1024],
                                           UNIT_DEVICE)
        self.assertLen(step_model.decomposition_units(work, step_model.Configuration()), 108)
        self.assertAlmostEqual(bound["bound"], 4.63, places=2)
        self.assertEqual([round(r["speedup"], 2) for r in bound["rows"]], [1.0, 4.63, 4.63])
        for row in bound["rows"][1:]:  # both remedies beat the bound
            self.assertLess(row["split_s"], row["slowest_rank_s"])
            self.assertLess(row["refresh_s"], row["slowest_rank_s"])

    def test_library_defaults(self):
        defaults = inspect.signature(tfkfac.KFAC).parameters
        config = step_model.LIBRARY_DEFAULTS
        self.assertEqual(
            (config.placement, config.factor_wire, config.decomposition_wire,
             config.factor_interval, config.decomposition_interval, config.weight_sharing,
             config.method),
            tuple(defaults[name].default for name in (
                "placement", "factor_wire_dtype", "decomposition_wire_dtype",
                "factor_update_freq", "decomposition_update_freq", "weight_sharing", "method")))


class BinaryTest(parameterized.TestCase):

    def run_plan(self, *args):
        return subprocess.run([sys.executable, "-m", "trainers.plan", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=REPO_ROOT))

    @parameterized.named_parameters(
        ("stated_profile", "v100", "ib-edr"),
        # This machine's: bench/results/step_floor.json's rates and fractions, the
        # collectives of bench/results/loopback.json (both committed: a clean checkout
        # plans for this machine).
        ("this_machine", "local", "loopback"))
    def test_table_json_and_plot(self, device, network):
        """A device and network profile, on the trainer's MLP: 1 process and 2 ranks."""
        output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        result = self.run_plan("--model=mlp", "--batch=64", "--workers=1,2",
                               f"--device={device}", f"--network={network}", "--sgd_steps=1000",
                               "--kfac_steps=600,700", "--methods=eigen,inverse",
                               f"--output_dir={output_dir}")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        for phase in ("forward/backward", "factor reduction", "decompositions (slowest)",
                      "decomposition sharing", "gradient reduction", "Recommendation",
                      "One-factor bound", "fastest to target"):
            self.assertIn(phase, result.stdout)
        # The bound is exact K-FAC's (eigen), whichever method the library defaults to.
        self.assertRegex(result.stdout,
                         r"One-factor bound \(\S+ float32/float32 .* expand eigen\)")
        with open(os.path.join(output_dir, "plan.json")) as f:
            plan = json.load(f)
        self.assertTrue(os.path.getsize(os.path.join(output_dir, "plan.png")) > 0)
        one, two = plan["results"]
        parameters = plan["setting"]["trainable_parameters"]
        self.assertEqual(one["sgd_phases"]["gradient_reduction"]["ms_per_step"], 0.0)
        self.assertEqual(two["sgd_phases"]["gradient_reduction"]["payload_bytes_per_rank"],
                         [4 * parameters] * 2)
        self.assertAlmostEqual(two["kfac_time_to_target_s"] / 700,
                               two["kfac_ms"][two["best"]] / 1e3)
        self.assertLen(one["kfac_ms"], 2 * 4 * 4 * 2 * 2 * 2 * 2)

    def test_gpu_profiles_achieve_less_than_their_floor(self):
        """Calibrated on NVIDIA's ResNet-50 throughput: a real step is slower than its floor."""
        for name in hardware.GPUS:
            device = hardware.device(name)
            for precision, fraction in device.fractions["forward_backward"].items():
                self.assertTrue(0.05 < fraction < 1.0, (name, precision, fraction))


if __name__ == "__main__":
    absltest.main()
