"""The planner binary as a user meets it (trainers/plan.py): one-line errors for every bad
value, case-insensitive names, the GPU profiles and their estimates, no configuration the
library refuses, the memory warning (activations at the batch included) and GPU-hours.
Fast: one process, small models."""

import json
import os
import re
import subprocess
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from plan_testing import run_plan, temporary_path  # noqa: E402
from process_output import assert_error, own_lines  # noqa: E402
from trainers import plan  # noqa: E402
from trainers.planning import (floor_model, hardware, memory, recommend,  # noqa: E402
                               workloads)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class OneLineErrorsTest(parameterized.TestCase):
    """Every bad value ends the binary as a usage error (trainers/cli.py): the usage hint,
    then one line naming the flag (exit code 2)."""

    def assert_one_line_error(self, args, *expected):
        code, _, err = run_plan("--workers=1", f"--output_dir={temporary_path('plan')}",
                                *args)
        assert_error(self, plan.CLI, code, err, "")
        self.assertLen(err.splitlines(), 2, err)
        for text in expected:
            self.assertIn(text, err.splitlines()[-1])

    def test_the_binary_prints_one_line_and_no_help(self):
        result = subprocess.run(
            [sys.executable, "-m", "trainers.plan", "--model=mlp", "--device=tpu"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
            env=dict(os.environ, PYTHONPATH=REPO_ROOT))
        self.assertEqual(result.returncode, 2)
        self.assertEqual(own_lines(result.stderr),  # TensorFlow's start-up lines aside
                         [plan.CLI.usage_hint,
                          "trainers.plan: error: --device must be one of a100-40gb, "
                          "a100-80gb, h100, h200, v100, local; got 'tpu'"])

    @parameterized.named_parameters(
        ("device", ["--model=mlp", "--device=tpu"], "--device", "h200"),
        ("network", ["--model=mlp", "--network=ib"], "--network", "ib-ndr"),
        ("batch", ["--model=mlp", "--batch=0"], "--batch=0", "positive integer"),
        ("precision", ["--model=mlp", "--precision=fp8"], "--precision", "float32|mixed"),
        ("classes", ["--model=mlp", "--classes=0"], "--classes=0", "positive integer"),
        ("links", ["--model=mlp", "--links_per_node=-1"], "--links_per_node",
         "positive integer"),
        ("workers", ["--model=mlp", "--workers=0,8"], "--workers", "from 1 to 1024"),
        ("methods", ["--model=mlp", "--methods=cholesky"], "--methods", "eigen, inverse"),
        ("collective", ["--model=mlp", "--collective=ring"], "--collective",
         "allreduce|reduce_scatter_v|kfac_pytorch"),
        ("steps_alone", ["--model=mlp", "--sgd_steps=10"], "--sgd_steps and --kfac_steps"),
        ("steps_count", ["--model=mlp", "--workers=1,2", "--sgd_steps=1,2,3",
                         "--kfac_steps=3"], "--sgd_steps", "one per worker count"),
        ("model", ["--model=resnet5"], "--model", "resnet50"),
        ("unknown_flag", ["--model=mlp", "--nope=1"], "nope"),
        ("local_ranks", ["--model=mlp", "--device=local", "--workers=1,4"], "--workers",
         "at most 2 ranks"))
    def test_bad_value(self, args, *expected):
        self.assert_one_line_error(args, *expected)

    @parameterized.parameters("nan", "-1", "0", "inf")
    def test_forward_backward_ms_must_be_a_positive_finite_time(self, value):
        self.assert_one_line_error(["--model=mlp", f"--forward_backward_ms={value}"],
                                   "--forward_backward_ms", "finite number of milliseconds > 0")

    def test_unwritable_output_dir(self):
        a_file = temporary_path("a_file")
        open(a_file, "w").close()
        for output_dir, why in ((os.path.join(a_file, "plan"), "cannot create"),
                                (a_file, "is not a directory")):
            code, _, err = run_plan("--model=mlp", "--workers=1", f"--output_dir={output_dir}")
            assert_error(self, plan.CLI, code, err, re.escape(
                f"--output_dir: {output_dir}" if why == "is not a directory"
                else f"--output_dir: cannot create {output_dir}"))
            self.assertLen(err.splitlines(), 2, err)

    def test_damaged_keras_files_are_named(self):
        garbage = temporary_path("garbage.keras")
        with open(garbage, "w") as f:
            f.write("not a zip")
        no_config = temporary_path("no_config.keras")
        with zipfile.ZipFile(no_config, "w") as archive:
            archive.writestr("metadata.json", "{}")
        for path, why in ((garbage, "not a zip archive"), (no_config, "no config.json")):
            self.assert_one_line_error([f"--model={path}"], f"--model: {path}", why)


class NamesTest(absltest.TestCase):

    def test_device_network_and_choices_in_any_case(self):
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=mlp", "--workers=1,2", "--device=H100",
                                  "--network=IB-EDR", "--precision=MIXED",
                                  "--placements=Owner", "--methods=Inverse",
                                  "--collective=Reduce_Scatter_V",
                                  f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        with open(os.path.join(output_dir, "plan.json")) as f:
            setting = json.load(f)["setting"]
        self.assertEqual((setting["device"], setting["network"], setting["precision"],
                          setting["collective"]),
                         ("h100", "ib-edr", "mixed", "reduce_scatter_v"))
        self.assertIn("tfkfac runs allreduce, so these K-FAC times are the papers' system's",
                      out)
        # H100's forward/backward comes from A100 40 GB's measured fraction: an estimate,
        # printed as one.
        self.assertRegex(out, r"Estimated \(no published figure\): forward/backward on h100: "
                              r"a100-40gb's achieved fraction")


class ProfilesTest(absltest.TestCase):

    def test_every_datasheet_profile(self):
        """A100 40/80 GB, H100 and H200 from their datasheets, each with its memory."""
        memory = {name: hardware.device(name).memory for name in hardware.GPUS}
        self.assertEqual(memory, {"v100": 16e9, "a100-40gb": 40e9, "a100-80gb": 80e9,
                                  "h100": 80e9, "h200": 141e9})
        for name in hardware.GPUS:
            self.assertIn("datasheet", hardware.device(name).sources[0])

    def test_h100_forward_backward_is_its_own(self):
        """H100 takes A100 40 GB's achieved fraction of the floor, not its time: its
        ResNet-50 forward/backward is its own floor over that fraction."""
        work = workloads.named("resnet50").at_batch(32)
        kernels = work.forward_backward("mixed")
        a100, h100 = hardware.device("a100-40gb"), hardware.device("h100")
        fraction = a100.fractions["forward_backward"]["mixed"]
        self.assertEqual(h100.fractions["forward_backward"]["mixed"], fraction)
        h100_floor = floor_model.floor_seconds(
            kernels, {"matmul": hardware.H100.fp16, "bandwidth": hardware.H100.bandwidth})
        self.assertAlmostEqual(h100.seconds(kernels, "forward_backward", "mixed"),
                               h100_floor / fraction)
        self.assertLess(h100.seconds(kernels, "forward_backward", "mixed"),
                        a100.seconds(kernels, "forward_backward", "mixed") / 2)

    def test_estimates_are_marked_with_the_range_assumed(self):
        self.assertEqual(hardware.device("v100").estimates, ())
        decompositions, overlap = hardware.device("a100-40gb").estimates
        self.assertIn("V100's per-call latencies kept", decompositions)
        self.assertIn("range assumed: from V100's rates (1x)", decompositions)
        self.assertIn("NCCL's 4 channels", overlap)
        self.assertIn("range assumed: 2-16 channels", overlap)
        for name in ("a100-80gb", "h100", "h200"):
            forward_backward, decompositions, _ = hardware.device(name).estimates
            self.assertIn(f"forward/backward on {name}: a100-40gb's", forward_backward)
            self.assertIn("range assumed: the measured GPUs' fractions", forward_backward)
            self.assertIn(f"decompositions on {name}", decompositions)


class LibraryRefusalsTest(absltest.TestCase):

    def test_refused_configurations_are_never_compared(self):
        """The library requires the decomposition interval to be a multiple of the
        factor interval: f=10 d=1 is left out, never ranked or recommended."""
        configs, refused = recommend.grid(["owner"], ["float32"], ["float32"], [1, 10],
                                          [1, 100], ["expand"], ["inverse"])
        self.assertEqual([(c.factor_interval, c.decomposition_interval) for c in configs],
                         [(1, 1), (1, 100), (10, 100)])
        ((config, why),) = refused
        self.assertEqual((config.factor_interval, config.decomposition_interval), (10, 1))
        self.assertIn("must be a multiple of `factor_update_freq`", why)
        output_dir = temporary_path("plan")
        # One refused (f=10 d=1) per combination of the other settings: 2 x 3 x 2 x 2 here
        # (wires, rules and methods pinned, so that a new default does not change it).
        code, out, err = run_plan("--model=mlp", "--workers=1,2", "--placements=owner",
                                  "--factor_wires=float32,bfloat16",
                                  "--decomposition_wires=float32,float16,bfloat16",
                                  "--weight_sharing=expand,reduce",
                                  "--methods=eigen,inverse",
                                  "--factor_intervals=1,10", "--decomposition_intervals=1,100",
                                  f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        self.assertIn("Left out 24 configuration(s) tfkfac refuses", out)
        with open(os.path.join(output_dir, "plan.json")) as f:
            document = json.load(f)
        for entry in document["results"]:
            self.assertNotIn("f=10 d=1 ", " ".join(entry["kfac_ms"]) + entry["best"])

    def test_only_refused_configurations_is_an_error(self):
        code, _, err = run_plan("--model=mlp", "--workers=1", "--factor_intervals=10",
                                "--decomposition_intervals=1",
                                f"--output_dir={temporary_path('plan')}")
        self.assertEqual(code, 2)
        self.assertIn("tfkfac refuses every configuration compared", err)


class UncountableModelTest(absltest.TestCase):

    def test_lstm_needs_a_measured_forward_backward(self):
        """An LSTM's weight products have no K-FAC block and no count: without
        --forward_backward_ms the planner refuses (it printed 0.00 ms and 564x SGD)."""
        path = temporary_path("lstm.keras")
        keras.Sequential([keras.Input((20, 8)), keras.layers.LSTM(64, name="lstm"),
                          keras.layers.Dense(10)]).save(path)
        code, _, err = run_plan(f"--model={path}", "--workers=1",
                                f"--output_dir={temporary_path('plan')}")
        self.assertEqual(code, 2)
        self.assertIn("--forward_backward_ms is required", err)
        self.assertIn("lstm", err)
        output_dir = temporary_path("plan")
        code, out, err = run_plan(f"--model={path}", "--workers=1,2",
                                  "--forward_backward_ms=3", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        self.assertIn("forward/backward: measured (--forward_backward_ms)", out)
        with open(os.path.join(output_dir, "plan.json")) as f:
            one = json.load(f)["results"][0]
        self.assertEqual(one["sgd_phases"]["forward_backward"]["ms_per_step"], 3.0)

    def test_elementwise_weights_without_a_block_are_not_refused(self):
        """A per-channel scale (as ConvNeXt's layer scale) has weights but no product:
        its forward/backward is counted without it, as before."""
        model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(8, 3),
                                  ChannelScale(name="scale"), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        work = workloads.workload(model, 1, "scaled")
        self.assertEqual([s["layer"] for s in work.skipped], ["scale"])
        self.assertEqual(work.uncounted_products, [])


class ChannelScale(keras.layers.Layer):
    """x · γ, one γ per channel: a weight without a K-FAC block and without a product."""

    def build(self, input_shape):
        self.gamma = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.gamma


class MemoryAndCostTest(absltest.TestCase):

    def test_memory_warning_when_the_state_exceeds_the_device(self):
        """A 50 000-input Dense layer: its A factor alone is 10 GB, its decomposition as
        much; with the weights this exceeds a V100's 16 GB on every worker."""
        path = temporary_path("wide.keras")
        keras.Sequential([keras.Input((50_000,)), keras.layers.Dense(10)]).save(path)
        output_dir = temporary_path("plan")
        code, out, err = run_plan(f"--model={path}", "--workers=1,2", "--device=v100",
                                  "--methods=inverse", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        self.assertIn("Memory per worker, GB", out)
        self.assertRegex(out, r"WARNING: more than v100's memory per worker \(16 GB\): "
                              r"replicated eigen at 1 worker\(s\) \(20\.0 GB\)")
        self.assertRegex(out, r"1 workers: .* inverse: .*WARNING: needs 20\.0 GB per worker")
        with open(os.path.join(output_dir, "plan.json")) as f:
            rows = json.load(f)["memory"]["per_worker_bytes"]
        self.assertTrue(all(row["exceeds_device"] for row in rows))

    def test_activations_are_every_layer_output_at_the_batch(self):
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(4),
                                  keras.layers.ReLU(), keras.layers.Dense(3)])
        work = workloads.workload(model, 8, "small")
        self.assertEqual(work.activation_elements, 10 + 4 + 4 + 3)  # input, 3 outputs
        self.assertEqual(work.activation_bytes("float32"), 8 * 21 * 4)
        self.assertEqual(work.activation_bytes("mixed"), 8 * 21 * 2)
        self.assertEqual(memory.worker_bytes(work, "replicated", "eigen", 1,
                                             "mixed")["activations"], 8 * 21 * 2)

    def test_a_batch_whose_activations_exceed_the_device_is_warned(self):
        """--model=cnn at 10^8 examples a worker: its activations alone are terabytes; the
        plan says no configuration fits a V100, SGD included, on every line concerned."""
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=cnn", "--batch=100000000", "--workers=1,8",
                                  "--device=v100", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        work = workloads.named("cnn").at_batch(100_000_000)
        need = work.activation_bytes("mixed") / 1e9
        self.assertGreater(need, 1000)
        self.assertIn(f"activations {need:.2f} (every layer's output at the batch", out)
        self.assertIn("WARNING: SGD alone (weights, gradients, momentum and activations) needs "
                      "more than v100's memory per worker (16 GB) at 1 worker(s) "
                      f"({need:.1f} GB), 8 worker(s) ({need:.1f} GB): no optimizer fits there; "
                      "lower --batch", out)
        self.assertIn("WARNING: no configuration compared fits in v100's memory per worker at "
                      "any worker count", out)
        recommended = [line for line in out.splitlines() if " workers: " in line]
        self.assertLen(recommended, 2)
        self.assertTrue(all("WARNING: needs" in line for line in recommended), recommended)
        with open(os.path.join(output_dir, "plan.json")) as f:
            rows = json.load(f)["memory"]["per_worker_bytes"]
        self.assertTrue(all(row["exceeds_device"] and row["activations"] > 1e12
                            for row in rows))

    def test_gpu_hours_to_target(self):
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=mlp", "--workers=1,8", "--sgd_steps=1000",
                                  "--kfac_steps=600,500", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        with open(os.path.join(output_dir, "plan.json")) as f:
            results = json.load(f)["results"]
        for entry, kfac_steps in zip(results, (600, 500)):
            self.assertAlmostEqual(entry["sgd_gpu_hours"],
                                   1000 * entry["sgd_ms"] / 1e3 * entry["workers"] / 3600)
            self.assertAlmostEqual(
                entry["kfac_gpu_hours"],
                kfac_steps * entry["kfac_ms"][entry["best"]] / 1e3 * entry["workers"] / 3600)
        self.assertIn("GPU-hours; K-FAC fastest", out)
        self.assertRegex(out, r"cheapest to target: (SGD|K-FAC) on \d+ workers, [\d.e-]+ "
                              r"GPU-hours \(steps x step time x workers\)")


if __name__ == "__main__":
    absltest.main()
