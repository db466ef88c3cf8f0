"""Self-tuning across 2 Horovod ranks (Gloo), tests/self_tuning_worker.py, each rank holding
half of every batch (docs/design.md §14):

- The exact curvature products and Gram matrix, averaged over the ranks, are those of the
  whole batch: the numpy reference (tests/self_tuning_reference.py) on all its examples, to
  float32 rounding.
- After six `model.fit` steps of KFAC(self_tuning=True) every weight and optimizer variable
  (λ, γ, δ₀) is bit-identical on both ranks, and the run is one process's on the whole
  batches to float32 summation order, its λ the same (the same adaptation decision).
The job must finish within JOB_TIMEOUT_SECONDS: a hang is a failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import job_results  # noqa: E402
import self_tuning_reference as ref  # noqa: E402
import self_tuning_worker as worker  # noqa: E402
from tfkfac import distributed  # noqa: E402

# One float32 ulp relative to the largest entry is 1.2e-7 (tests/test_self_tuning.py); the
# ranks' mean adds one rounding. Two ranks against one process after six steps: float32
# summation order only (tests/distributed_checks.py measured 1e-5 .. 7e-5 after six
# K-FAC steps).
PRODUCT_RTOL, EQUIVALENCE_RTOL = 5e-7, 1e-4


class SelfTuningDistributedTest(job_results.TwoRankJob, absltest.TestCase):

    WORKER, SCENARIOS = worker, ["self_tuning"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ranks = cls.saved["self_tuning"]

    def test_products_are_the_whole_batchs(self):
        model = ref.mlp("float32")
        x, labels = worker.batches()
        reference = ref.ggn(ref.weights(model), x[:ref.N], ref.cross_entropy, labels[:ref.N])
        vectors = np.stack([ref.flat(v) for v in worker.vectors(model.trainable_variables)])
        for rank in self.ranks:
            expected = vectors @ reference
            np.testing.assert_allclose(rank["products"], expected, rtol=0,
                                       atol=PRODUCT_RTOL * np.abs(expected).max())
            gram = vectors @ reference @ vectors.T
            np.testing.assert_allclose(rank["gram"], gram, rtol=0,
                                       atol=PRODUCT_RTOL * np.abs(gram).max())

    def test_every_variable_identical_on_both_ranks(self):
        rank0, rank1 = self.ranks
        self.assertEqual(sorted(rank0), sorted(rank1))
        for key in rank0:
            if key.startswith(("weight", "optimizer", "scalars")):
                np.testing.assert_array_equal(rank0[key], rank1[key], err_msg=key)

    def test_two_ranks_train_as_one_process_on_the_whole_batches(self):
        x, labels = worker.batches()
        model, optimizer = worker.trained(distributed.SingleProcess(), x, labels, ref.N)
        rank0 = self.ranks[0]
        for i, variable in enumerate(model.variables):
            expected = variable.numpy()
            np.testing.assert_allclose(rank0[f"weight{i}"], expected, rtol=0,
                                       atol=EQUIVALENCE_RTOL * np.abs(expected).max())
        scalars = dict(zip(optimizer._self_tuning.SCALARS, rank0["scalars"]))
        one = optimizer._self_tuning.values()
        self.assertEqual(scalars["damping"], one["damping"])
        self.assertNotEqual(one["damping"], worker.SETTINGS["damping"])  # it was adapted
        for name in ("learning_rate", "momentum", "model_change", "loss", "rho"):
            self.assertAlmostEqual(scalars[name], one[name], delta=1e-3 * abs(one[name]),
                                   msg=name)


if __name__ == "__main__":
    absltest.main()
