"""Image augmentations as small stateless functions: each takes an explicit shape-[2]
key (see `pipelines.seeds`), so results depend only on (seed, position) and stay
reproducible under parallel maps.

Per-example: `random_crop`, `random_flip`, `random_erasing` (Osawa et al.'s zero-value
variant), `normalize`. Per-batch: `mixup` (Zhang et al.) and `running_mixup`
(Osawa et al., eq. 9-10), which mix one-hot labels along with the images.
"""

import tensorflow as tf

from pipelines import seeds
from tfkfac import validation

# Osawa et al. (CVPR'19) §4.1: erase with probability 0.5 a rectangle of 2%-25% of the
# image with aspect ratio in [0.3, 1], its sides swapped half of the time.
ERASING_PROBABILITY = 0.5
ERASING_AREA = (0.02, 0.25)
ERASING_ASPECT = (0.3, 1.0)


def normalize(image, mean, stddev):
    """Per-channel `(image - mean) / stddev` for an (H, W, C) or (N, H, W, C) image."""
    mean = tf.constant(mean, image.dtype)
    stddev = tf.constant(stddev, image.dtype)
    channels = image.shape[-1]
    for name, value in (("mean", mean), ("stddev", stddev)):
        if channels is not None and value.shape.num_elements() not in (1, channels):
            raise ValueError(f"{name} needs 1 or {channels} values (one per channel), "
                             f"got {value.shape.num_elements()}")
    return (image - mean) / stddev


def random_crop(image, padding, key):
    """Zero-pads an (H, W, C) image by `padding` pixels on each side and crops a random
    H x W window back out."""
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding!r}")
    padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
    return tf.image.stateless_random_crop(padded, tf.shape(image), seed=key)


def random_flip(image, key):
    """Flips an (H, W, C) image left-right with probability 1/2."""
    return tf.image.stateless_random_flip_left_right(image, seed=key)


def random_erasing(image, key, probability=ERASING_PROBABILITY, area=ERASING_AREA,
                   aspect=ERASING_ASPECT):
    """Sets a random rectangle of an (H, W, C) image to zero with `probability`.

    The rectangle covers a uniform fraction in `area` of the image, has height/width
    ratio uniform in `aspect` (height <= width), with height and width swapped with
    probability 1/2, and a uniform position inside the image.
    """
    validation.finite_number("probability", probability, 0, 1)
    for name, pair in (("area", area), ("aspect", aspect)):
        for bound in pair:
            validation.positive(name, bound)
    if not 0.0 < area[0] <= area[1] <= 1.0:
        raise ValueError(f"area must be (low, high) with 0 < low <= high <= 1, got {area!r}")
    if not 0.0 < aspect[0] <= aspect[1]:
        raise ValueError(f"aspect must be (low, high) with 0 < low <= high, got {aspect!r}")
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    erase_key, area_key, aspect_key, swap_key, top_key, left_key = tf.unstack(seeds.split(key, 6))
    erase = tf.random.stateless_uniform([], erase_key) < probability
    region = tf.cast(height * width, tf.float32) * tf.random.stateless_uniform(
        [], area_key, area[0], area[1])
    ratio = tf.random.stateless_uniform([], aspect_key, aspect[0], aspect[1])
    side_a = tf.cast(tf.round(tf.sqrt(region * ratio)), tf.int32)
    side_b = tf.cast(tf.round(tf.sqrt(region / ratio)), tf.int32)
    swap = tf.random.stateless_uniform([], swap_key) < 0.5
    erase_h = tf.clip_by_value(tf.where(swap, side_b, side_a), 1, height)
    erase_w = tf.clip_by_value(tf.where(swap, side_a, side_b), 1, width)
    top = tf.random.stateless_uniform([], top_key, 0, height - erase_h + 1, dtype=tf.int32)
    left = tf.random.stateless_uniform([], left_key, 0, width - erase_w + 1, dtype=tf.int32)
    rows = tf.range(height)
    cols = tf.range(width)
    inside = ((rows[:, None] >= top) & (rows[:, None] < top + erase_h)
              & (cols[None, :] >= left) & (cols[None, :] < left + erase_w))
    return tf.where((inside & erase)[:, :, None], tf.zeros_like(image), image)


def sample_beta(shape, alpha, key):
    """Beta(alpha, alpha) draws, as G1 / (G1 + G2) of two Gamma(alpha) draws."""
    validation.positive("alpha", alpha)
    first_key, second_key = tf.unstack(seeds.split(key, 2))
    first = tf.random.stateless_gamma(shape, first_key, alpha)
    second = tf.random.stateless_gamma(shape, second_key, alpha)
    return first / (first + second)


def _mix(weights, current, previous):
    """`w * current + (1 - w) * previous` with one weight per example (leading axis)."""
    weights = tf.reshape(tf.cast(weights, current.dtype),
                         [-1] + [1] * (current.shape.rank - 1))
    return weights * current + (1.0 - weights) * previous


def mixup(images, labels, alpha, key):
    """Mixup of a batch: example i becomes `lam_i x_i + (1 - lam_i) x_j` (same for the
    one-hot labels) with j a random permutation of the batch and lam_i ~ Beta(alpha,
    alpha); returns the mixed (images, labels)."""
    weight_key, perm_key = tf.unstack(seeds.split(key, 2))
    size = tf.shape(images)[0]
    weights = sample_beta([size], alpha, weight_key)
    partner = tf.argsort(tf.random.stateless_uniform([size], perm_key))
    return (_mix(weights, images, tf.gather(images, partner)),
            _mix(weights, labels, tf.gather(labels, partner)))


def running_mixup(alpha, seed):
    """Returns a `tf.data.Dataset.apply` transformation for Osawa et al.'s running
    mixup (eq. 9-10) on a dataset of equal-size batches, dicts with `image` and one-hot
    `label`: the virtual batch of step t is `lam x(t) + (1 - lam) x~(t-1)` (labels
    alike), with lam ~ Beta(alpha, alpha) per example and x~(0) = x(0). Mixing with the
    previous *virtual* batch, not a raw one, compounds the regularization."""
    key = seeds.derive(seed)

    def apply(dataset):
        image_spec = dataset.element_spec["image"]
        label_spec = dataset.element_spec["label"]
        if not (image_spec.shape.is_fully_defined() and label_spec.shape.is_fully_defined()):
            raise ValueError("running_mixup needs batches of one static size "
                             "(batch with drop_remainder=True); got image shape "
                             f"{image_spec.shape} and label shape {label_spec.shape}")
        start = (tf.constant(0, tf.int64),
                 tf.zeros(image_spec.shape, image_spec.dtype),
                 tf.zeros(label_spec.shape, label_spec.dtype))

        def step(state, batch):
            index, previous_images, previous_labels = state
            weights = sample_beta([image_spec.shape[0]], alpha, seeds.derive(key, index))
            weights = tf.where(index > 0, weights, tf.ones_like(weights))
            images = _mix(weights, batch["image"], previous_images)
            labels = _mix(weights, batch["label"], previous_labels)
            return (index + 1, images, labels), {**batch, "image": images, "label": labels}

        return dataset.scan(start, step)

    return apply
