"""One rank of the 2-rank Horovod job of tests/test_self_tuning_distributed.py.

Rank r holds half of every batch (examples r·N/2 .. (r+1)·N/2 − 1 of tests/
self_tuning_reference.py's batches of N), the tiny MLP of that reference, and saves to
`$SELF_TUNING_OUT_DIR/self_tuning.rank<r>.npz`:
- the exact curvature products F v and the Gram matrix [vᵢᵀ F vⱼ] of two fixed vectors on
  its half of batch 0, averaged over the ranks (`tfkfac.ggn`);
- after STEPS steps of `model.fit` with KFAC(self_tuning=True), one batch half a step,
  every weight and every optimizer variable (λ, γ and δ₀ among them).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS_DIR))
sys.path.insert(0, TESTS_DIR)

import self_tuning_reference as ref  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed, ggn  # noqa: E402

OUT_DIR_VARIABLE = "SELF_TUNING_OUT_DIR"
STEPS = 6  # λ adapted once, after step 4
SETTINGS = dict(self_tuning=True, method="eigen", factor_update_freq=1,
                decomposition_update_freq=1, damping=0.5, kl_clip=None, xla=False)


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches():
    """(x, labels) of STEPS batches of ref.N examples (float64), the same on every rank."""
    data = [ref.data(seed) for seed in range(STEPS)]
    return (np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data]))


def vectors(variables):
    rng = np.random.default_rng(3)
    return [ref.unflat(rng.normal(size=ref.PARAMS), variables) for _ in range(2)]


def halves(values, rank, size):
    """Rank `rank`'s part of each batch of `values` (ref.N rows a batch)."""
    per = ref.N // size
    return np.concatenate([values[s * ref.N + rank * per:s * ref.N + (rank + 1) * per]
                           for s in range(len(values) // ref.N)])


def trained(comm, x, labels, batch_size):
    """The MLP and its KFAC(self_tuning=True) after STEPS steps on (x, labels)."""
    model = ref.mlp("float32")
    optimizer = tfkfac.KFAC(communicator=comm, **SETTINGS).attach(model)
    model.compile(optimizer=optimizer, loss=loss())
    model.fit(x.astype("float32"), labels, batch_size=batch_size, shuffle=False, verbose=0)
    return model, optimizer


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    x, labels = batches()
    mine_x, mine_labels = halves(x, comm.rank, comm.size), halves(labels, comm.rank, comm.size)
    model = ref.mlp("float32")
    variables = model.trainable_variables
    first = tf.constant(mine_x[:ref.N // comm.size], tf.float32)
    predict = lambda: model(first, training=True)  # noqa: E731
    curvature = ggn.output_curvature(loss())
    arrays = {"products": np.stack([ref.flat(p) for p in ggn.products(
                  predict, variables, vectors(variables), curvature, communicator=comm)]),
              "gram": ggn.quadratic_forms(predict, variables, vectors(variables), curvature,
                                          communicator=comm).numpy()}
    model, optimizer = trained(comm, mine_x, mine_labels, ref.N // comm.size)
    arrays.update({f"weight{i}": v.numpy() for i, v in enumerate(model.variables)})
    arrays.update({f"optimizer{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
    arrays["scalars"] = np.array([optimizer._self_tuning.values()[name]
                                  for name in optimizer._self_tuning.SCALARS])
    np.savez(os.path.join(out_dir, f"self_tuning.rank{comm.rank}.npz"), **arrays)
    print(f"rank {comm.rank}: done", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
