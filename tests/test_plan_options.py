"""The planner's model of `overlap_reduction` and `hierarchical_reduction`: the two-level
collectives against their formulas worked by hand, the hidden factor reduction against
the blocks that can run beside it and the slowdown of what runs beside it, kfac_pytorch's
collectives against its code's bytes, and the configurations tfkfac refuses left out."""

import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest, parameterized  # noqa: E402

import plan_testing  # noqa: E402
from plan_testing import run_plan, temporary_path  # noqa: E402
from trainers.planning import collectives, hardware, recommend, step_model, workloads  # noqa: E402

LINK = collectives.Link(bandwidth=1e9, ring_step_latency=1e-5, tree_level_latency=5e-5)
NVLINK = collectives.Link(bandwidth=1e11, ring_step_latency=1e-6, tree_level_latency=2e-6)
# 4 ranks a node, 2 links: 8 ranks are 2 nodes.
FABRIC = collectives.Fabric(LINK, NVLINK, ranks_per_node=4, links_per_node=2)
UNIT_DEVICE = dataclasses.replace(plan_testing.UNIT_DEVICE, intra_node=NVLINK, overlap_hides=1.0)


class HierarchicalCollectivesTest(absltest.TestCase):

    def test_allreduce_in_two_levels(self):
        n = 8e6
        within = 3 * 1e-6 + 3 / 4 * n / 1e11  # reduce-scatter (or allgather) among 4
        # 4 concurrent allreduces of n/4 between the 2 nodes, each with a quarter of the
        # node's 2 links: ring 2 steps of 1e-5, 2·(1/2)·(n/4) / (2e9/4); tree 2·1·5e-5.
        share = 2e9 / 4
        ring = 2 * 1e-5 + 2 * 1 / 2 * (n / 4) / share
        tree = 2 * 5e-5 + 2 * (n / 4) / share
        self.assertAlmostEqual(collectives.hierarchical_allreduce(n, 8, FABRIC),
                               2 * within + min(ring, tree))

    def test_v_collective_in_two_levels(self):
        pieces = [1e6, 4e6, 2e6, 8e6, 3e6, 5e6, 7e6, 6e6]  # node 0: 15e6, node 1: 21e6
        total = sum(pieces)
        expected = (3 * 1e-6 + 3 / 4 * total / 1e11  # the node's sums
                    + 1e-5 + (total - 15e6) / 2e9  # the other node's pieces leave it once
                    + 3 * 1e-6 + 3 / 4 * 8e6 / 1e11)  # the largest piece to its owner
        self.assertAlmostEqual(collectives.hierarchical_v(pieces, FABRIC), expected)
        # Cheaper than rank to rank, where a node's 4 ranks share its links.
        self.assertLess(expected, collectives.reduce_scatter_v(pieces, FABRIC))

    def test_one_level_is_refused(self):
        one_per_node = collectives.Fabric(LINK, NVLINK, ranks_per_node=1)
        for ranks, fabric in ((4, FABRIC), (6, FABRIC), (8, one_per_node)):
            with self.assertRaisesRegex(ValueError, "several nodes with the same number"):
                collectives.hierarchical_allreduce(1e6, ranks, fabric)


class StepModelTest(parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = workloads.named("cnn").at_batch(32)

    def step(self, ranks=8, collective="allreduce", **settings):
        config = step_model.Configuration(**settings)
        return step_model.kfac_step(self.work, config, ranks, UNIT_DEVICE, FABRIC,
                                    collective=collective)

    def test_hierarchical_means(self):
        flat = self.step(placement="replicated")
        hierarchical = self.step(placement="replicated", hierarchical_reduction=True)
        factors = hierarchical["factor_reduction"].payload[0]
        gradients = hierarchical["gradient_reduction"].payload[0]
        self.assertAlmostEqual(hierarchical["factor_reduction"].seconds,
                               collectives.hierarchical_allreduce(factors, 8, FABRIC))
        self.assertAlmostEqual(
            hierarchical["gradient_reduction"].seconds,
            collectives.hierarchical_allreduce(gradients, 8, FABRIC)
            + collectives.hierarchical_allreduce(step_model.STATE_ITEMSIZE, 8, FABRIC))
        # The decompositions' allgather stays flat; nothing else changes.
        for phase in set(flat) - {"factor_reduction", "gradient_reduction"}:
            self.assertEqual(flat[phase], hierarchical[phase], phase)

    @parameterized.parameters("replicated", "owner")
    def test_kl_clip_costs_only_when_set(self, placement):
        """The library's default has no KL clip (kl_clip=None): no cost; a clip adds its
        inner products and scaling to the preconditioning."""
        self.assertIsNone(step_model.Configuration().kl_clip)
        plain, clipped = (self.step(placement=placement, kl_clip=clip) for clip in (None, 1e-3))
        clip_s = UNIT_DEVICE.seconds(step_model.floor_model.kl_clip_kernels(
            sum(self.work.managed_parameters())), "preconditioning")
        self.assertAlmostEqual(clipped["preconditioning"].seconds,
                               plain["preconditioning"].seconds + clip_s)
        self.assertIn(" kl_clip=0.001", step_model.Configuration(kl_clip=1e-3).label())

    @parameterized.parameters(("replicated", 10, 100), ("owner", 1, 10), ("owner", 5, 5))
    def test_tfkfac_overlap_hides_the_early_preconditioning(self, placement, f, d):
        """Every block of the CNN (convolutions and dense layers, two factors each) reads
        only its decompositions under "eigen", so all of its preconditioning may run
        beside the factor reduction, on the factor steps with no decomposition due."""
        settings = dict(placement=placement, method="eigen", factor_interval=f,
                        decomposition_interval=d)
        flat = self.step(**settings)
        overlapped = self.step(overlap_reduction=True, **settings)
        self.assertTrue(all(len(s) == 2 for s in self.work.factor_shapes()))  # no diagonal
        # The library's default has no KL clip, so preconditioning is the blocks' alone.
        hidden = min(flat["factor_reduction"].seconds, flat["preconditioning"].seconds)
        self.assertAlmostEqual(overlapped["factor_reduction"].seconds,
                               flat["factor_reduction"].seconds - hidden * (1 - f / d))
        for phase in set(flat) - {"factor_reduction"}:
            self.assertEqual(flat[phase], overlapped[phase], phase)

    def test_papers_overlap_hides_a_factors_behind_the_backward_pass(self):
        shapes = [g.factor_shapes() for g in self.work.geometries["expand"].values()]
        packed = lambda n: n * (n + 1) // 2
        a_share = (sum(packed(s[0][-1]) for s in shapes)
                   / sum(packed(f[-1]) for s in shapes for f in s))
        for forward_backward in (1e-6, 1.0):  # the backward pass hides some, or all
            flat, overlapped = (
                step_model.kfac_step(self.work, step_model.Configuration(
                    placement="owner", overlap_reduction=overlap), 8, UNIT_DEVICE, FABRIC,
                    forward_backward_s=forward_backward, collective="reduce_scatter_v")
                for overlap in (False, True))
            reduction = flat["factor_reduction"].seconds
            self.assertAlmostEqual(
                overlapped["factor_reduction"].seconds,
                reduction - min(a_share * reduction,
                                step_model.BACKWARD_SHARE * forward_backward))

    def test_overlap_hides_the_devices_share(self):
        """Overlapped computation and collective contend for one device: a profile's
        `overlap_hides` of the overlappable time is hidden, none in the GPU profiles (a
        V100's overlapped step was slower, Ueno et al. §4.1)."""
        self.assertEqual(hardware.device("v100").overlap_hides, 0.0)
        steps = {}
        for hides in (0.0, 0.5, 1.0):
            device = dataclasses.replace(UNIT_DEVICE, overlap_hides=hides)
            steps[hides] = [step_model.kfac_step(
                self.work, step_model.Configuration(placement="owner", overlap_reduction=on),
                8, device, FABRIC, forward_backward_s=1.0, collective=collective)
                ["factor_reduction"].seconds for collective in step_model.COLLECTIVES
                for on in (False, True)]
        for flat, overlapped in zip(steps[0.0][::2], steps[0.0][1::2]):
            self.assertEqual(flat, overlapped)
        for (flat, half), (_, whole) in zip(zip(steps[0.5][::2], steps[0.5][1::2]),
                                            zip(steps[1.0][::2], steps[1.0][1::2])):
            self.assertLess(whole, flat)
            self.assertAlmostEqual(flat - half, (flat - whole) / 2)

    def test_overlap_slows_the_computation_beside_it(self):
        """NCCL's channels hold streaming multiprocessors while the collective runs: a
        V100 profile's overlapped step is slower than its flat one by 4 / (80 - 4) of
        the overlappable time (Ueno et al. §4.1)."""
        v100 = hardware.device("v100")
        self.assertAlmostEqual(v100.overlap_slows, 4 / 76)
        device = dataclasses.replace(UNIT_DEVICE, overlap_hides=0.0,
                                     overlap_slows=v100.overlap_slows)
        hiding = dataclasses.replace(UNIT_DEVICE, overlap_hides=1.0)
        for collective in step_model.COLLECTIVES:
            flat, slowed, hidden = (step_model.kfac_step(
                self.work, step_model.Configuration(placement="owner", overlap_reduction=on),
                8, d, FABRIC, forward_backward_s=1.0, collective=collective)
                ["factor_reduction"].seconds for on, d in ((False, device), (True, device),
                                                            (True, hiding)))
            self.assertAlmostEqual(slowed - flat, (flat - hidden) * 4 / 76, msg=collective)

    def test_kfac_pytorch_sends_whole_factors_and_allreduces_the_decompositions(self):
        """Pauloski et al.'s code allreduces every factor whole (n², not its triangle)
        and shares the eigendecompositions by an allreduce-sum of zero-filled buffers:
        each rank hands the whole buffer to a collective of twice an allgather's bytes."""
        config = step_model.Configuration(placement="replicated", method="eigen")
        ours, theirs = (step_model.kfac_step(self.work, config, 8, UNIT_DEVICE, FABRIC,
                                             collective=c)
                        for c in ("allreduce", "kfac_pytorch"))
        matrices = [f for f in self.work.factor_shapes() if len(f) == 2]
        whole = sum(n * m for n, m in matrices) - sum(n * (n + 1) // 2 for n, _ in matrices)
        self.assertEqual(theirs["factor_reduction"].payload[0],
                         ours["factor_reduction"].payload[0] + 4 * whole)
        pieces = ours["decomposition_sharing"].payload
        self.assertEqual(theirs["decomposition_sharing"].payload, (sum(pieces),) * 8)
        self.assertAlmostEqual(theirs["decomposition_sharing"].seconds,
                               collectives.allreduce(sum(pieces), 8, FABRIC))

    def test_refusals(self):
        refusal = lambda ranks, **settings: step_model.refusal(
            self.work, step_model.Configuration(**settings), ranks, FABRIC)
        self.assertIsNone(refusal(8, overlap_reduction=True, hierarchical_reduction=True))
        self.assertIn("1 worker", refusal(1, overlap_reduction=True))
        self.assertIn("hierarchical_reduction", refusal(4, hierarchical_reduction=True))
        normalization = workloads.named("resnet20").at_batch(8)  # BatchNorm: diagonal
        self.assertIsNone(step_model.refusal(
            normalization, step_model.Configuration(overlap_reduction=True), 8, FABRIC))


class GridAndBinaryTest(absltest.TestCase):

    def test_float21_hierarchical_only_in_the_papers_system(self):
        args = (["owner"], ["float21"], ["float32"], [1], [1], ["expand"], ["inverse"],
                [False], [True])
        accepted, refused = recommend.grid(*args)
        self.assertEmpty(accepted)
        self.assertIn("hierarchical_reduction", refused[0][1])
        accepted, refused = recommend.grid(*args, collective="reduce_scatter_v")
        self.assertLen(accepted, 1)
        self.assertTrue(accepted[0].hierarchical_reduction)
        self.assertEqual(recommend.tfkfac_refusal(accepted[0]), recommend.grid(*args)[1][0][1])

    def test_recommendations_tfkfac_refuses_say_so(self):
        """Asked for the papers' system, a recommendation of settings tfkfac refuses
        (float21 summed hierarchically) says so with the library's own reason; under
        tfkfac's collectives it is never recommended, and no line says so."""
        flags_ = ("--model=mlp", "--workers=8", "--workers_per_node=4",
                  "--placements=owner", "--decomposition_wires=float32",
                  "--factor_intervals=1", "--decomposition_intervals=1",
                  "--weight_sharing=expand", "--methods=inverse")
        float21 = step_model.Configuration("owner", "float21", "float32", 1, 1, "expand",
                                           "inverse", False, True)
        why = recommend.tfkfac_refusal(float21)
        self.assertIn("factor_wire_dtype='float21'", why)
        lines = {}
        for collective, wires, hierarchical in (("reduce_scatter_v", "float21", "true"),
                                                ("reduce_scatter_v", "float32", "false"),
                                                ("allreduce", "float21,float32", "false,true")):
            output_dir = temporary_path("plan")
            code, out, err = run_plan(*flags_, f"--collective={collective}",
                                      f"--factor_wires={wires}",
                                      f"--hierarchical_reduction={hierarchical}",
                                      f"--output_dir={output_dir}")
            self.assertIsNone(code, err)
            with open(os.path.join(output_dir, "plan.json")) as f:
                (entry,) = json.load(f)["results"]
            lines[collective, wires] = (entry, next(
                l for l in out.splitlines() if l.startswith("      8 workers:")))
        entry, line = lines["reduce_scatter_v", "float21"]
        self.assertEqual(entry["best"], float21.label())
        self.assertTrue(line.endswith("; the papers' system (--collective=reduce_scatter_v), "
                                      f"which tfkfac does not run; tfkfac's KFACConfig "
                                      f"refuses it: {why}"), line)
        entry, line = lines["reduce_scatter_v", "float32"]
        self.assertTrue(line.endswith("; the papers' system (--collective=reduce_scatter_v), "
                                      "which tfkfac does not run"), line)
        entry, line = lines["allreduce", "float21,float32"]
        self.assertNotIn(float21.label(), entry["kfac_ms"])
        self.assertLen(entry["kfac_ms"], 3)
        self.assertNotIn("papers' system", line)
        self.assertNotIn("refuses", line)

    def test_refused_where_the_job_cannot_run_them(self):
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=mlp", "--workers=1,8", "--workers_per_node=4",
                                  "--overlap_reduction=false,True",
                                  "--hierarchical_reduction=false,true",
                                  "--placements=replicated", "--factor_wires=float32",
                                  "--decomposition_wires=float32", "--factor_intervals=10",
                                  "--decomposition_intervals=100", "--weight_sharing=expand",
                                  "--methods=eigen", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        self.assertIn("At 1 worker(s) left out 3 configuration(s) tfkfac refuses there", out)
        with open(os.path.join(output_dir, "plan.json")) as f:
            one, eight = json.load(f)["results"]
        self.assertEqual(list(one["kfac_ms"]), ["replicated float32/float32 f=10 d=100 "
                                                "expand eigen"])
        self.assertLen(eight["kfac_ms"], 4)
        self.assertIn("expand eigen overlap hierarchical", "".join(eight["kfac_ms"]))

    def test_one_line_errors(self):
        for args, expected in (
                (["--overlap_reduction=maybe"], "--overlap_reduction must be a list of false, "
                                                "true; got maybe"),
                (["--overlap_reduction=true"], "--workers=1: tfkfac refuses every "
                                               "configuration compared there")):
            code, _, err = run_plan("--model=mlp", "--workers=1",
                                    f"--output_dir={temporary_path('plan')}", *args)
            self.assertEqual(code, 2, err)
            self.assertLen(err.splitlines(), 2, err)  # the usage hint, the error
            self.assertIn(expected, err)


if __name__ == "__main__":
    absltest.main()
