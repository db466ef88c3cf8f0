"""Assembles the input pipeline of a training (or evaluation) run:

source -> shard -> [read latency] -> decode/normalize -> [cache]
  -> per epoch: [example echo before augment] -> shuffle -> augment
                -> [example echo after augment] -> batch -> mixup -> [batch echo]
  -> cast -> prefetch -> count

For example echoing the shuffle moves after the echo stage with the same buffer size
(Choi et al. §3), so memory stays as in the baseline; batch echoing keeps the
baseline's shuffle and repeats batches in place.
"""

import dataclasses
import inspect
import types

import tensorflow as tf

from pipelines import augment, counters, echoing, seeds, sources
from pipelines.limits import MAX_ECHO_FACTOR, MAX_READ_LATENCY, MAX_SEED, MAX_SHUFFLE_BUFFER
from tfkfac import validation

ECHO_MODES = ("none", "example_before_augment", "example_after_augment", "batch")
_SHUFFLE_SALT, _ECHO_SALT, _AUGMENT_SALT, _MIXUP_SALT = range(4)
# Graph-level seed of the per-epoch function. `Dataset.shuffle` pairs its op seed (here
# a tensor of seed and epoch) with the graph seed; fixing the latter makes the order
# independent of the caller's `tf.random.set_seed`, and a nonzero value keeps TF's
# seed check from testing the op-seed tensor as a Python bool (it fails when the
# global seed is 0).
_GRAPH_SEED = 0x5EED


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """Which augmentations `build` applies; all off by default.

    Attributes:
      crop_padding: pad each side by this many pixels, then crop back at random.
      flip: random horizontal flips.
      erasing_probability: random erasing with zero value (Osawa et al.: 0.5).
      mixup_alpha: > 0 turns on mixup with lambda ~ Beta(alpha, alpha) (Osawa: 0.4).
      running_mixup: mix with the previous virtual batch (Osawa eq. 9-10) instead of a
        permutation of the current one; needs mixup_alpha > 0.
    """

    crop_padding: int = 0
    flip: bool = False
    erasing_probability: float = 0.0
    mixup_alpha: float = 0.0
    running_mixup: bool = False

    def __post_init__(self):
        validation.integer("crop_padding", self.crop_padding, low=0)
        validation.boolean("flip", self.flip)
        validation.finite_number("erasing_probability", self.erasing_probability, 0, 1)
        validation.finite_number("mixup_alpha", self.mixup_alpha, low=0)
        validation.boolean("running_mixup", self.running_mixup)
        if self.running_mixup and not self.mixup_alpha > 0:
            raise ValueError("running_mixup needs mixup_alpha > 0, "
                             f"got mixup_alpha={self.mixup_alpha!r}")

    @property
    def per_example(self):
        return bool(self.crop_padding or self.flip or self.erasing_probability)


def build(source, *, batch_size, split="train", data_dir=None, echo_mode="none",
          echo_factor=1.0, shuffle_buffer=10_000, augmentation=Augmentation(),
          num_classes=None, mean=None, stddev=None, seed=0, epoch=0, num_epochs=1,
          num_shards=1, shard_index=0, dtype=tf.float32, cache=False, read_latency=0.0,
          drop_remainder=True, skip_batches=0, idx_dir=None, fresh_flags=False):
    """Returns `(dataset, counters)`: batched, prefetched `(image, label)` pairs for
    `model.fit`, and the `EchoCounters` of fresh and trained examples.

    Images are floats in [0, 1] (then `(x - mean) / stddev` per channel when given) of
    `dtype`; labels are int64 class ids, or one-hot float32 when `num_classes` is given
    (mixup needs it). Every random choice is a function of `(seed, epoch, position)`, so
    building with `epoch=k` yields exactly the k-th epoch of an uninterrupted run.

    Args:
      source: dataset name or `tf.data.Dataset` (see `pipelines.sources.load`).
      batch_size: examples per batch (per rank when sharded).
      echo_mode: one of `ECHO_MODES`.
      echo_factor: echo factor e in [1, 100], fractional allowed (see `pipelines.echo`).
      shuffle_buffer: examples in the one shuffle buffer, up to 10^7; 0 turns
        shuffling off.
      augmentation: an `Augmentation`; its crop padding at most the images' shorter
        side.
      seed, epoch, num_epochs: the data of epochs `epoch .. epoch + num_epochs - 1`
        (None: endless, for `fit(steps_per_epoch=...)`); seed in [0, 2^32 - 1].
      num_shards, shard_index: this rank's shard (`hvd.size()`, `hvd.rank()`).
      dtype: image dtype, e.g. from `pipelines.set_precision`.
      cache: keep decoded examples in memory after the first pass.
      read_latency: seconds of simulated storage latency per example (benchmarks),
        at most 1.
      drop_remainder: drop a last short batch (running mixup needs it).
      skip_batches: start this many batches into the stream (every random choice is
        still made for them, so the rest is exactly what an unskipped stream yields
        there); they are not counted as fresh or trained. A resumed run uses it to
        continue mid-epoch.
      idx_dir: directory of the IDX files of "fashion_mnist"/"mnist" (see
        `pipelines.idx_dataset.prepare_idx`); only for those sources.
      fresh_flags: yield `(image, label, tfkfac.fresh_flags(fresh))`: each example's
        fresh flag (1 on the first copy of a source example, 0 on echoed repeats) where
        Keras has sample weights, in the structure `tfkfac.KFAC(factor_examples="fresh")`
        reads (a plain tensor there is a sample weight).

    Example:
      >>> dataset, counters = build("fashion_mnist", batch_size=128,
      ...                           echo_mode="example_before_augment", echo_factor=2,
      ...                           augmentation=Augmentation(crop_padding=2, flip=True),
      ...                           seed=1, epoch=0)
      >>> model.fit(dataset, callbacks=[EchoCountersCallback(counters)])
      >>> counters.result()  # trained: 937 batches x 128 = 119936; fresh: about 60000
    """
    check_arguments(**{name: value for name, value in locals().items() if name != "source"})
    examples = sources.load(source, split, data_dir, num_shards=num_shards,
                            shard_index=shard_index, idx_dir=idx_dir)
    check_fits_images(examples.element_spec["image"].shape, augmentation.crop_padding, mean,
                      stddev)
    examples = (examples.apply(sources.simulate_read_latency(read_latency))
                .map(_decoder(num_classes, mean, stddev), num_parallel_calls=tf.data.AUTOTUNE))
    if cache:
        examples = examples.cache()

    def one_epoch(epoch_index):
        tf.random.set_seed(_GRAPH_SEED)  # traced in a function graph: sets its seed only
        key = seeds.derive(seed, epoch_index)
        example_echo = echoing.echo(echo_factor, shuffle_buffer, seed=seeds.derive(key, _ECHO_SALT))
        stream = examples
        if echo_mode == "example_before_augment":
            stream = stream.apply(example_echo)
        elif echo_mode != "example_after_augment" and shuffle_buffer:
            stream = stream.shuffle(shuffle_buffer, seed=seeds.op_seed(seeds.derive(key, _SHUFFLE_SALT)))
        if augmentation.per_example:
            stream = _augment_examples(stream, augmentation, seeds.derive(key, _AUGMENT_SALT))
        if echo_mode == "example_after_augment":
            stream = stream.apply(example_echo)
        stream = stream.batch(batch_size, drop_remainder=drop_remainder,
                              num_parallel_calls=tf.data.AUTOTUNE)
        if augmentation.mixup_alpha > 0:
            stream = _mix_batches(stream, augmentation, seeds.derive(key, _MIXUP_SALT))
        if echo_mode == "batch":
            stream = stream.apply(echoing.echo(echo_factor, seed=seeds.derive(key, _ECHO_SALT)))
        return stream

    epochs = (tf.data.Dataset.counter(epoch) if num_epochs is None
              else tf.data.Dataset.range(epoch, epoch + num_epochs))
    batches = (epochs.flat_map(one_epoch)
               .map(lambda batch: {**batch, "image": tf.cast(batch["image"], dtype)}))
    if skip_batches:
        batches = batches.skip(skip_batches)  # before counting: skipped ones were trained
    batches = batches.prefetch(tf.data.AUTOTUNE)
    echo_counters = counters.EchoCounters()
    return echo_counters.count(batches, fresh_flags), echo_counters


def check_arguments(image_shape=None, **arguments):
    """Raises ValueError naming the first of `build`'s keyword `arguments` (its defaults
    stand for those not given) of a wrong type, out of its range or inconsistent with
    another, before anything is built. `image_shape` (H, W, C), when known, also bounds
    the crop padding.

    The trainer calls it with its flags' values, so a bad flag is refused with the
    same words before any model is built.
    """
    bound = inspect.signature(build).bind_partial(None, **arguments)
    bound.apply_defaults()
    args = types.SimpleNamespace(**bound.arguments)
    validation.positive_integer("batch_size", args.batch_size)
    if not isinstance(args.split, str) or not args.split:
        raise ValueError(f"`split` must be a split name such as 'train' or 'train[:10%]'; "
                         f"received {args.split!r}")
    validation.optional(validation.path, "reads TFDS's default data directory")(
        "data_dir", args.data_dir)
    validation.optional(validation.path, "reads the default IDX files")("idx_dir", args.idx_dir)
    validation.one_of(ECHO_MODES)("echo_mode", args.echo_mode)
    validation.finite_number("echo_factor", args.echo_factor, 1, MAX_ECHO_FACTOR)
    if args.echo_mode == "none" and args.echo_factor != 1:
        raise ValueError(f"echo_factor={args.echo_factor!r} needs an echo_mode other than "
                         "'none'")
    validation.integer("shuffle_buffer", args.shuffle_buffer, 0, MAX_SHUFFLE_BUFFER)
    augmentation = args.augmentation
    if not isinstance(augmentation, Augmentation):
        raise ValueError(f"`augmentation` must be a pipelines.Augmentation; received "
                         f"{augmentation!r}")
    validation.optional(validation.positive_integer, "keeps integer labels")(
        "num_classes", args.num_classes)
    if augmentation.mixup_alpha > 0 and not args.num_classes:
        raise ValueError("mixup needs num_classes (labels become one-hot)")
    _check_moments(args.mean, args.stddev)
    validation.integer("seed", args.seed, 0, MAX_SEED)
    validation.integer("epoch", args.epoch, low=0)
    validation.optional(validation.positive_integer, "repeats without end")(
        "num_epochs", args.num_epochs)
    validation.positive_integer("num_shards", args.num_shards)
    validation.integer("shard_index", args.shard_index, 0, args.num_shards - 1)
    try:
        floating = tf.as_dtype(args.dtype).is_floating
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"`dtype` must be a floating dtype such as tf.float32; received "
                         f"{args.dtype!r}")
    validation.boolean("cache", args.cache)
    validation.finite_number("read_latency", args.read_latency, 0, MAX_READ_LATENCY)
    validation.boolean("drop_remainder", args.drop_remainder)
    if augmentation.running_mixup and not args.drop_remainder:
        raise ValueError("running_mixup needs drop_remainder=True (batches of one size)")
    validation.integer("skip_batches", args.skip_batches, low=0)
    validation.boolean("fresh_flags", args.fresh_flags)
    if image_shape is not None:
        check_fits_images(image_shape, augmentation.crop_padding, args.mean, args.stddev)


def check_fits_images(image_shape, crop_padding, mean=None, stddev=None):
    """What must fit the (H, W, C) images: the crop padding, at most their shorter side
    (padding beyond it only adds crops that are all padding, and a padded copy of every
    image: 100000 pixels a side would not fit in memory), and `mean`/`stddev`, one
    number or a list of one per channel."""
    shape = list(image_shape)
    images = f"the {'x'.join(str(s) for s in shape)} images"
    sides = [side for side in shape[:2] if side is not None]
    if sides and crop_padding > min(sides):
        raise ValueError(f"`crop_padding` must be an integer in [0, {min(sides)}] (the shorter "
                         f"side of {images}); received {crop_padding!r}")
    channels = shape[-1] if len(shape) == 3 else None
    for name, value in (("mean", mean), ("stddev", stddev)):
        if channels is not None and isinstance(value, (list, tuple)) and len(value) not in (
                1, channels):
            counts = "1" if channels == 1 else f"1 or {channels}"
            raise ValueError(f"`{name}` must be a number or a list of {counts} (one per "
                             f"channel of {images}); received {value!r}")


def _check_moments(mean, stddev):
    """`mean` (any finite numbers) and `stddev` (finite, > 0), scalars or per channel."""
    for name, value, low in (("mean", mean, None), ("stddev", stddev, 0)):
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            validation.finite_number(name, item, low=low, low_open=True)


def _decoder(num_classes, mean, stddev):
    """Returns the map from a source dict to a float image in [0, 1] (normalized when
    mean/stddev are given), its label (one-hot with num_classes) and the fresh flag."""

    def decode(example):
        image = example["image"]
        scale = float(image.dtype.max) if image.dtype.is_integer else 1.0
        image = tf.cast(image, tf.float32) / scale
        if mean is not None or stddev is not None:
            image = augment.normalize(image, 0.0 if mean is None else mean,
                                      1.0 if stddev is None else stddev)
        label = tf.cast(example["label"], tf.int64)
        if num_classes:
            label = tf.one_hot(label, num_classes, dtype=tf.float32)
        return counters.mark_fresh({"image": image, "label": label})

    return decode


def _augment_examples(stream, augmentation, key):
    def augment_one(index, example):
        crop_key, flip_key, erase_key = tf.unstack(seeds.split(seeds.derive(key, index), 3))
        image = example["image"]
        if augmentation.crop_padding:
            image = augment.random_crop(image, augmentation.crop_padding, crop_key)
        if augmentation.flip:
            image = augment.random_flip(image, flip_key)
        if augmentation.erasing_probability:
            image = augment.random_erasing(image, erase_key, augmentation.erasing_probability)
        return {**example, "image": image}

    return stream.enumerate().map(augment_one, num_parallel_calls=tf.data.AUTOTUNE)


def _mix_batches(stream, augmentation, key):
    if augmentation.running_mixup:
        return stream.apply(augment.running_mixup(augmentation.mixup_alpha, key))

    def mix(index, batch):
        images, labels = augment.mixup(batch["image"], batch["label"],
                                       augmentation.mixup_alpha, seeds.derive(key, index))
        return {**batch, "image": images, "label": labels}

    return stream.enumerate().map(mix, num_parallel_calls=tf.data.AUTOTUNE)
