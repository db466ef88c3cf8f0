"""Where examples come from: a dataset name (offline IDX builder for Fashion-MNIST and
MNIST, TFDS for anything else) or a ready `tf.data.Dataset`; the per-rank shard; and a
simulated read latency standing for slow storage, to set up upstream-bound benchmarks."""

import tensorflow as tf
import tensorflow_datasets as tfds
# `_SleepDataset` sleeps in C++ per element: unlike `tf.py_function(time.sleep)` it
# neither holds the Python GIL nor burns a core, so it models waiting on storage.
from tensorflow.python.data.experimental.ops import testing as tf_data_testing

from pipelines import idx_dataset
from pipelines.limits import MAX_READ_LATENCY
from tfkfac import validation


def load(source, split="train", data_dir=None, download=False, num_shards=1, shard_index=0,
         idx_dir=None):
    """Returns one shard of a dataset of dicts `{"image": (H, W, C), "label": int64}`.

    Stored images are decoded after sharding, so each rank decodes only its own part.

    Args:
      source: "fashion_mnist" or "mnist" (read offline from local IDX files via
        `pipelines.idx_dataset`), any other TFDS name with an `image` feature (via
        `tfds.load`), or a `tf.data.Dataset` of such dicts or of `(image, label)` pairs.
      split: TFDS split string ("train", "test", "train[:10%]", ...).
      data_dir: TFDS data dir; None uses the default.
      download: let `tfds.load` download missing data (never for the IDX datasets).
        Off by default: with no network TFDS retries for minutes before failing.
      num_shards, shard_index: see `shard`.
      idx_dir: where the IDX files of "fashion_mnist"/"mnist" are (see
        `idx_dataset.prepare_idx`); an error for any other source.
    """
    if isinstance(source, tf.data.Dataset):
        return shard(_as_dicts(source), num_shards, shard_index)
    if not isinstance(source, str):
        raise ValueError("`source` must be a dataset name (str) or a tf.data.Dataset; "
                         f"received {type(source).__name__}")
    if idx_dir is not None and source not in idx_dataset.IDX_DATASETS:
        raise ValueError(f"idx_dir only applies to the IDX datasets "
                         f"{', '.join(sorted(idx_dataset.IDX_DATASETS))}, not {source!r}")
    skip_image_decoding = {"image": tfds.decode.SkipDecoding()}
    if source in idx_dataset.IDX_DATASETS:
        builder = idx_dataset.prepare_idx(source, data_dir=data_dir, idx_dir=idx_dir)
        stored, info = builder.as_dataset(split=split, decoders=skip_image_decoding), builder.info
    else:
        stored, info = tfds.load(source, split=split, data_dir=data_dir, download=download,
                                 decoders=skip_image_decoding, with_info=True)
    image_feature = info.features["image"]
    return shard(stored, num_shards, shard_index).map(
        lambda example: {"image": image_feature.decode_example(example["image"]),
                         "label": example["label"]},
        num_parallel_calls=tf.data.AUTOTUNE)


def _as_dicts(dataset):
    spec = dataset.element_spec
    if isinstance(spec, dict) and {"image", "label"} <= spec.keys():
        return dataset.map(lambda example: {"image": example["image"], "label": example["label"]})
    if isinstance(spec, tuple) and len(spec) == 2:
        return dataset.map(lambda image, label: {"image": image, "label": label})
    raise ValueError("a source dataset must yield dicts with 'image' and 'label' or "
                     f"(image, label) pairs, got element spec {spec}")


def shard(dataset, num_shards, index):
    """Keeps every `num_shards`-th example starting at `index` (one Horovod rank's part:
    `num_shards=hvd.size(), index=hvd.rank()`); shards are disjoint and cover the data."""
    validation.positive_integer("num_shards", num_shards)
    validation.integer("shard_index", index, 0, num_shards - 1)
    return dataset if num_shards == 1 else dataset.shard(num_shards, index)


def simulate_read_latency(seconds_per_example, examples_per_read=32):
    """Returns a `tf.data.Dataset.apply` transformation that delays the stream like one
    reader on slow storage: each read of `examples_per_read` examples waits
    `examples_per_read * seconds_per_example` before they flow on. Reading in blocks
    keeps the wait, not the scheduling of many short sleeps on a busy machine, the
    cost. It is the upstream-cost knob of `bench/echo_benchmark.py`."""
    validation.finite_number("seconds_per_example", seconds_per_example, 0, MAX_READ_LATENCY)
    validation.positive_integer("examples_per_read", examples_per_read)
    microseconds = int(round(seconds_per_example * examples_per_read * 1e6))
    if microseconds == 0:
        return lambda dataset: dataset

    def apply(dataset):
        # One slot per example, released a read at a time after each read's wait.
        slots = (tf.data.Dataset.range(2**62).apply(tf_data_testing.sleep(microseconds))
                 .flat_map(lambda _: tf.data.Dataset.range(examples_per_read)))
        # The reader reads ahead into a buffer of two reads, as a storage client would,
        # so its waits overlap the work downstream.
        return (tf.data.Dataset.zip((dataset, slots)).map(lambda example, _: example)
                .prefetch(2 * examples_per_read))

    return apply
