"""ResNet-20's convolution factor statistics: A from the im2col Gram vs from input
correlations (tfkfac/blocks/conv_correlation.py), side by side.

The model as the trainer builds it (fashion_mnist's 28x28x1, --batch_size), one forward
pass recorded; the recorded inputs and pre-activation shapes are filled with normal
noise. Timed, each inside a `tf.function` as in training, the two paths interleaved
(bench/harness.py) over --repeats calls, after a warm-up call that traces:
- per distinct stride-1 3x3 convolution shape, that block's `batch_statistics` (A and G)
  with `correlation_statistics` off (the im2col Gram) and on;
- every block of the model together (all of a factor step's statistics), the
  convolutions' A either way.
Both wall and CPU time (`time.process_time`, all of this process's threads): the
machine may be shared, and CPU time is not lengthened by waiting for a core.

Run (~3 min on 2 idle cores):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/conv_statistics.py
Writes bench/results/conv_statistics.json and conv_statistics.png and prints the table.
"""

import time

from absl import flags
import numpy as np
import tensorflow as tf

import harness
from tfkfac import KFACConfig, blocks as blocks_lib, keras_integration
from tfkfac.capture import Recorder
from trainers import models

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 128, "Examples per batch.")
PATHS = ("im2col", "correlation")


def recorded_calls(batch_size):
    """ResNet-20's blocks and, per block, its calls [(inputs, dL/ds)] as noise."""
    model = models.build_model("resnet20", (28, 28, 1), 10, 0)
    blocks, _ = blocks_lib.discover(keras_integration.leaf_layers(model), KFACConfig())
    recorder = Recorder(blocks)
    with recorder.recording():
        model(np.zeros((batch_size, 28, 28, 1), np.float32), training=True)
    noise = lambda t: tf.random.normal(tf.shape(t))
    return blocks, [[tf.nest.map_structure(noise, call) for call in block_calls]
                    for block_calls in recorder.take()]


def statistics(blocks, calls, path, batch_size):
    """A traced function computing `blocks`' statistics with the convolutions' A by `path`."""
    def compute():
        for block in blocks:
            if isinstance(block, blocks_lib.ConvBlock):
                block.correlation_statistics = path == "correlation"
        return [block.batch_statistics(block_calls, batch_size)
                for block, block_calls in zip(blocks, calls)]

    traced = tf.function(compute)

    def timed():
        wall, cpu = time.perf_counter(), time.process_time()
        tf.nest.map_structure(lambda t: t.numpy(), traced())
        return {"wall_ms": 1e3 * (time.perf_counter() - wall),
                "cpu_ms": 1e3 * (time.process_time() - cpu)}
    return timed


def compare(name, blocks, calls):
    """Both paths' wall and CPU ms (min, median, max over the interleaved calls)."""
    samples = harness.interleave(
        {path: statistics(blocks, calls, path, FLAGS.batch_size) for path in PATHS},
        FLAGS.repeats, warm_up=1)
    result = {"name": name}
    for path in PATHS:
        result[path] = {figure: harness.spread(values)
                        for figure, values in harness.by_figure(samples[path]).items()}
    line = f"{name:34s}"
    for figure in ("wall_ms", "cpu_ms"):
        old, new = (result[path][figure] for path in PATHS)
        line += (f" {figure[:-3]} {old['median']:7.1f} [{old['min']:.1f}-{old['max']:.1f}] -> "
                 f"{new['median']:7.1f} [{new['min']:.1f}-{new['max']:.1f}] ms"
                 f" (x{old['median'] / new['median']:.2f})")
    print(line, flush=True)
    return result


def plot(report):
    results = report["results"]
    figure, axes = harness.subplots(1, 2, figsize=(12, 4))
    positions = np.arange(len(results))
    for axis, figure_name in zip(axes, ("wall_ms", "cpu_ms")):
        for offset, path in ((-0.2, "im2col"), (0.2, "correlation")):
            axis.barh(positions + offset, [r[path][figure_name]["median"] for r in results],
                      0.4, label=path)
        axis.set_yticks(positions, [r["name"] for r in results], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel(f"median {figure_name[:-3]} ms")
        axis.legend()
    figure.suptitle(f"ResNet-20 factor statistics, batch {report['batch_size']}: "
                    "convolution A by im2col vs input correlations")
    return figure


def main():
    blocks, calls = recorded_calls(FLAGS.batch_size)
    report = {"batch_size": FLAGS.batch_size, "repeats": FLAGS.repeats, "results": []}
    seen = set()
    for block, block_calls in zip(blocks, calls):
        if not (isinstance(block, blocks_lib.ConvBlock) and block.correlation_statistics):
            continue
        shape = (tuple(block_calls[0][0].shape[1:]), block.out_dim)
        if shape in seen:
            continue
        seen.add(shape)
        report["results"].append(compare(f"conv {'x'.join(map(str, shape[0]))} -> {shape[1]}",
                                         [block], [block_calls]))
    report["results"].append(compare("all ResNet-20 blocks", blocks, calls))
    harness.write(report, "conv_statistics", plot)


if __name__ == "__main__":
    harness.define_repeats(11, "one call of each path")
    harness.run(main)
