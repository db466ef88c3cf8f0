"""The kernels behind K-FAC's cost on CPU, each timed against its alternative.

Side by side in one run, A and B interleaved (bench/harness.py) so machine drift hits both:
- decompositions (`tfkfac.linalg`): TensorFlow's CPU kernels vs LAPACK through scipy,
  for eigh and for the damped inverse, at the factor sizes of the benchmark models
  (ResNet-20 577, autoencoder 1001, CNN Dense 1601);
- im2col (`ConvBlock.input_rows`, strided slices) vs `tf.image.extract_patches`, on
  the CNN's second convolution and a ResNet-20 stage-1 convolution, batch 128;
- the per-step preconditioning product of the CNN's Dense layer (1601² x 1601x128) and
  the CNN's largest factor Gram in float32 vs bfloat16 as `KFAC(product_dtype=
  "bfloat16")` computes them (`tfkfac.linalg.matmul`: the inverse stored in bfloat16,
  the gradient and the Gram's rows cast at every call), with the bfloat16 product's
  relative error against float32 (Frobenius norm).
Every kernel runs inside a `tf.function`, as in training; reported: median ms over
`--repeats` calls.
It also measures this machine's rates (`rates()`, which bench/step_floor.py imports):
the best float32 matmul FLOP/s over square sizes, the streaming bandwidth of an
elementwise op, and the LAPACK eigh and Cholesky-inverse FLOP/s at the nominal counts
the methods declare (`Method.decomposition_kernels`, tfkfac/methods.py).

Run (~2 min on 2 idle cores):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/linalg_benchmark.py
Writes bench/results/linalg.json and linalg.png and prints the ratios.
"""

from absl import flags
import keras
import numpy as np
import tensorflow as tf

import harness
from tfkfac import linalg, methods
from tfkfac.blocks import ConvBlock

FLAGS = flags.FLAGS


FACTOR_SIZES = (577, 1001, 1601)
# (name, conv input (N, H, W, C), kernel, padding) of the models' convolutions.
CONVOLUTIONS = (("cnn conv2", (128, 13, 13, 32), 3, "valid"),
                ("resnet20 stage 1", (128, 28, 28, 16), 3, "same"))


def factor(dim):
    rows = np.random.default_rng(dim).standard_normal((4 * dim, dim)).astype(np.float32)
    return tf.constant(rows.T @ rows / (4 * dim))


def call_seconds(functions, *args, repeats):
    """name -> seconds of each of `repeats` interleaved calls of `functions[name](*args)`
    traced in a `tf.function`, after a warm-up call that traces it; a call ends when its
    outputs are on the host."""
    def timed(function):
        function = tf.function(function)
        return lambda: harness.seconds(
            lambda: tf.nest.map_structure(lambda t: t.numpy(), function(*args)))

    return harness.interleave({name: timed(f) for name, f in functions.items()}, repeats,
                              warm_up=1)


def compare(name, baseline, candidate, *args):
    """Median ms of two traced kernels, interleaved; candidate/baseline ratio."""
    times = call_seconds({"baseline": baseline, "candidate": candidate}, *args,
                         repeats=FLAGS.repeats)
    base, cand = (1e3 * harness.spread(times[kind])["median"]
                  for kind in ("baseline", "candidate"))
    print(f"{name:45s} {base:9.2f} ms -> {cand:9.2f} ms  (x{base / cand:.2f} faster)",
          flush=True)
    return {"name": name, "baseline_ms": base, "candidate_ms": cand, "speedup": base / cand}


def best_seconds(function, *args, repeats):
    """Fastest of `repeats` calls of `function(*args)` (`call_seconds`): what this machine
    can do."""
    return harness.spread(call_seconds({"kernel": function}, *args,
                                       repeats=repeats)["kernel"])["min"]


def rates(repeats, matmul_sizes=(512, 1024, 2048), stream_elements=(2 ** 20, 2 ** 24),
          decomposition_size=1024):
    """This machine's throughputs, the rates of tfkfac/costs.py's
    `Kernel.seconds`, each from the fastest of `repeats` calls.

    matmul: float32 FLOP/s (2n³ per product), the best of square sizes; bandwidth:
    bytes/s of `x * 2` (x read, the result written), the best of the working sets (the
    smaller one fits in the L3 cache here, the larger one does not); eigh and
    cholesky_inverse: FLOP/s of `tfkfac.linalg`'s LAPACK decompositions (as training
    calls them) at the nominal 9n³ and n³ the methods declare (tfkfac/methods.py).
    """
    measured = {"matmul_by_size": {}, "bandwidth_by_elements": {}}
    for n in matmul_sizes:
        a = tf.random.normal((n, n))
        seconds = best_seconds(lambda x, y: tf.linalg.matmul(x, y), a, a, repeats=repeats)
        measured["matmul_by_size"][n] = 2.0 * n ** 3 / seconds
    for elements in stream_elements:
        x = tf.random.normal((elements,))
        seconds = best_seconds(lambda t: t * 2.0, x, repeats=repeats)
        measured["bandwidth_by_elements"][elements] = 2 * 4 * elements / seconds
    a = factor(decomposition_size)
    for method, decompose in (
            (methods.Eigen(), lambda m: linalg.symmetric_eigh(m, "lapack")),
            (methods.Inverse(), lambda m: linalg.damped_inverse(m, 0.01, "lapack"))):
        seconds = best_seconds(decompose, a, repeats=repeats)
        (kernel,) = method.decomposition_kernels((decomposition_size, decomposition_size))
        measured[kernel.kind] = kernel.flops / seconds
    measured["matmul"] = max(measured["matmul_by_size"].values())
    measured["bandwidth"] = max(measured["bandwidth_by_elements"].values())
    measured["decomposition_size"] = decomposition_size
    return measured


def print_rates(measured):
    print(f"rates: matmul {measured['matmul'] / 1e9:.0f} GFLOP/s, bandwidth "
          f"{measured['bandwidth'] / 1e9:.1f} GB/s, LAPACK n={measured['decomposition_size']} "
          f"eigh {measured['eigh'] / 1e9:.1f} GFLOP/s (9n³), Cholesky inverse "
          f"{measured['cholesky_inverse'] / 1e9:.1f} GFLOP/s (n³)", flush=True)


def decompositions():
    results = []
    for dim in FACTOR_SIZES:
        a = factor(dim)
        results.append(compare(f"eigh n={dim}: TensorFlow -> LAPACK",
                               lambda m: linalg.symmetric_eigh(m, "tensorflow"),
                               lambda m: linalg.symmetric_eigh(m, "lapack"), a))
        results.append(compare(f"damped inverse n={dim}: TF LU -> LAPACK Cholesky",
                               lambda m: linalg.damped_inverse(m, 0.01, "tensorflow"),
                               lambda m: linalg.damped_inverse(m, 0.01, "lapack"), a))
    return results


def im2col():
    results = []
    for name, shape, kernel, padding in CONVOLUTIONS:
        layer = keras.layers.Conv2D(shape[-1], kernel, padding=padding)
        layer.build((None,) + shape[1:])
        block = ConvBlock(layer)
        inputs = tf.random.normal(shape)

        def extract_patches(x):
            patches = tf.image.extract_patches(x, [1, kernel, kernel, 1], [1, 1, 1, 1],
                                               [1, 1, 1, 1], padding.upper())
            return tf.reshape(patches, (-1, block.in_dim))

        results.append(compare(f"im2col {name}: extract_patches -> slices",
                               extract_patches, block.input_rows, inputs))
    return results


def reduced_precision():
    """float32 vs bfloat16 products as the `product_dtype` option runs them (the
    per-step casts included), and the relative error of the bfloat16 product."""
    inverse = tf.random.normal((1601, 1601))
    stored = {None: inverse, "bfloat16": tf.cast(inverse, tf.bfloat16)}  # as the state
    grad = tf.random.normal((1601, 128))
    rows = tf.random.normal((128 * 11 * 11, 3 * 3 * 32 + 1))
    cases = [
        ("Dense 1601 precondition product: f32 -> bf16",
         lambda dtype: lambda g: linalg.matmul(stored[dtype], g, dtype), (grad,)),
        ("cnn conv2 factor Gram (15488x289): f32 -> bf16",
         lambda dtype: lambda r: linalg.matmul(r, r, dtype, transpose_a=True), (rows,)),
    ]
    results = []
    for name, product, args in cases:
        result = compare(name, product(None), product("bfloat16"), *args)
        exact, rounded = product(None)(*args), product("bfloat16")(*args)
        result["relative_error"] = float(tf.norm(rounded - exact) / tf.norm(exact))
        print(f"{'':45s} bfloat16 relative error {result['relative_error']:.2e}", flush=True)
        results.append(result)
    return results


def plot(report):
    results = report["results"]
    figure, axis = harness.subplots(figsize=(11, 4.5))
    positions = np.arange(len(results))
    axis.barh(positions - 0.2, [r["baseline_ms"] for r in results], 0.4, label="baseline")
    axis.barh(positions + 0.2, [r["candidate_ms"] for r in results], 0.4, label="candidate")
    axis.set_yticks(positions, [r["name"] for r in results], fontsize=8)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_xlabel("median ms (log)")
    axis.set_title("K-FAC kernels on this CPU: baseline -> candidate")
    axis.legend()
    return figure


def main():
    report = {"repeats": FLAGS.repeats}
    report["results"] = decompositions() + im2col() + reduced_precision()
    report["rates"] = rates(FLAGS.repeats)
    print_rates(report["rates"])
    harness.write(report, "linalg", plot)


if __name__ == "__main__":
    # Defined only when this script runs: bench/step_floor.py imports `rates` beside
    # bench/step_time.py's --repeats.
    harness.define_repeats(7, "one call of each kernel")
    harness.run(main)
