"""Augmentations against numpy: crop windows, flips, normalization, random erasing's
region and probability (Osawa et al.'s parameters), mixup and running mixup (eq. 9-10)
as convex combinations recovered from the labels."""

from absl.testing import absltest
import numpy as np
import tensorflow as tf

import pipelines
from pipelines import augment, seeds

HEIGHT = WIDTH = 28


def keyed_map(fn, num, seed=0):
    """Applies fn(key) for `num` keys derived from seed; stacked numpy results."""
    keys = tf.data.Dataset.range(num).map(lambda i: seeds.derive(seed, i))
    return np.concatenate([b.numpy() for b in keys.map(fn).batch(512)])


def bounding_box(mask):
    rows, cols = np.nonzero(mask)
    return rows.min(), rows.max() + 1, cols.min(), cols.max() + 1


class PerExampleTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.image = np.random.default_rng(0).random((HEIGHT, WIDTH, 3)).astype(np.float32)

    def test_normalize_matches_numpy_per_channel(self):
        mean, stddev = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
        got = augment.normalize(tf.constant(self.image), mean, stddev).numpy()
        np.testing.assert_allclose(got, (self.image - np.array(mean)) / np.array(stddev), atol=1e-6)
        with self.assertRaisesRegex(ValueError, "mean needs 1 or 3 values"):
            augment.normalize(tf.constant(self.image), (0.1, 0.2), 1.0)

    def test_random_crop_is_a_window_of_the_zero_padded_image(self):
        padding = 4
        padded = np.pad(self.image, [(padding, padding), (padding, padding), (0, 0)])
        crops = keyed_map(lambda k: augment.random_crop(tf.constant(self.image), padding, k), 60)
        offsets = set()
        for crop in crops:
            matches = [(r, c) for r in range(2 * padding + 1) for c in range(2 * padding + 1)
                       if np.array_equal(crop, padded[r:r + HEIGHT, c:c + WIDTH])]
            self.assertLen(matches, 1)
            offsets.add(matches[0])
        self.assertGreater(len(offsets), 20)  # 81 possible offsets, 60 draws

    def test_random_flip_is_identity_or_mirror_about_half_the_time(self):
        flips = keyed_map(lambda k: augment.random_flip(tf.constant(self.image), k), 400)
        mirrored = [np.array_equal(f, self.image[:, ::-1]) for f in flips]
        same = [np.array_equal(f, self.image) for f in flips]
        self.assertTrue(all(m or s for m, s in zip(mirrored, same)))
        self.assertAlmostEqual(np.mean(mirrored), 0.5, delta=0.1)  # binomial std 0.025


class RandomErasingTest(absltest.TestCase):

    def erase(self, num, **kwargs):
        ones = tf.ones([HEIGHT, WIDTH, 1])
        return keyed_map(lambda k: augment.random_erasing(ones, k, **kwargs), num, seed=11)[..., 0]

    def test_defaults_are_osawas_and_regions_follow_them(self):
        erased = self.erase(2000)
        self.assertTrue(np.all((erased == 0) | (erased == 1)))
        hit = (erased == 0).any(axis=(1, 2))
        # Probability 0.5: binomial std over 2000 draws is 0.011.
        self.assertAlmostEqual(hit.mean(), 0.5, delta=0.04)
        areas, tall = [], []
        for mask in erased[hit] == 0:
            top, bottom, left, right = bounding_box(mask)
            h, w = bottom - top, right - left
            self.assertEqual(mask.sum(), h * w)  # one solid rectangle
            # h, w are sides a, b rounded: a*b in [0.02, 0.25]*H*W and min/max in
            # [0.3, 1] must be reachable from [h-0.5, h+0.5] x [w-0.5, w+0.5].
            self.assertLessEqual((h - 0.5) * (w - 0.5), 0.25 * HEIGHT * WIDTH)
            self.assertGreaterEqual((h + 0.5) * (w + 0.5), 0.02 * HEIGHT * WIDTH)
            self.assertGreaterEqual((min(h, w) + 0.5) / (max(h, w) - 0.5), 0.3)
            areas.append(h * w / (HEIGHT * WIDTH))
            tall.append(h > w)
        self.assertLess(min(areas), 0.04)
        self.assertGreater(max(areas), 0.2)
        # Sides swapped half of the time: tall and wide regions equally often.
        self.assertAlmostEqual(np.mean(tall), 0.5, delta=0.08)

    def test_probability_is_as_configured(self):
        for probability in (0.0, 0.2, 1.0):
            hit = (self.erase(1000, probability=probability) == 0).any(axis=(1, 2))
            self.assertAlmostEqual(hit.mean(), probability, delta=0.04)

    def test_region_bounds_are_as_configured(self):
        erased = self.erase(300, probability=1.0, area=(0.1, 0.1), aspect=(1.0, 1.0))
        sides = {bounding_box(mask == 0)[1] - bounding_box(mask == 0)[0] for mask in erased}
        self.assertEqual(sides, {round(np.sqrt(0.1 * HEIGHT * WIDTH))})

    def test_bad_parameters_are_rejected(self):
        image = tf.ones([4, 4, 1])
        key = seeds.derive(0)
        with self.assertRaisesRegex(ValueError, "probability"):
            augment.random_erasing(image, key, probability=1.5)
        with self.assertRaisesRegex(ValueError, "area"):
            augment.random_erasing(image, key, area=(0.3, 0.2))
        with self.assertRaisesRegex(ValueError, "aspect"):
            augment.random_erasing(image, key, aspect=(0.0, 1.0))


class MixupTest(absltest.TestCase):

    def test_mixup_is_a_convex_pair_with_beta_weights(self):
        rng = np.random.default_rng(1)
        batch, alpha = 10, 0.4
        weights = []
        for step in range(200):
            images = rng.random((batch, 4, 4, 1)).astype(np.float32)
            labels = np.eye(batch, dtype=np.float32)  # example i has class i
            mixed_images, mixed_labels = (t.numpy() for t in augment.mixup(
                tf.constant(images), tf.constant(labels), alpha, seeds.derive(3, step)))
            np.testing.assert_allclose(mixed_labels.sum(axis=1), 1.0, rtol=1e-6)
            self.assertTrue(np.all(mixed_labels >= 0))
            partners = []
            for i in range(batch):
                self.assertLessEqual(np.count_nonzero(mixed_labels[i]), 2)
                others = np.delete(np.arange(batch), i)
                j = others[np.argmax(mixed_labels[i, others])]
                if mixed_labels[i, j] == 0:
                    # Its own partner, or a weight below float32 resolution.
                    np.testing.assert_allclose(mixed_images[i], images[i], atol=1e-5)
                    continue
                lam = mixed_labels[i, i]
                np.testing.assert_allclose(mixed_images[i], lam * images[i] + (1 - lam) * images[j],
                                           atol=1e-5)
                partners.append(j)
                weights.append(lam)
            self.assertEqual(len(set(partners)), len(partners))  # a permutation's rows
        # Beta(0.4, 0.4): mean 1/2, variance 1/(4 (2 alpha + 1)) = 0.139.
        self.assertAlmostEqual(np.mean(weights), 0.5, delta=0.03)
        self.assertAlmostEqual(np.var(weights), 1 / (4 * (2 * alpha + 1)), delta=0.015)

    def test_bad_alpha_is_rejected(self):
        with self.assertRaisesRegex(ValueError, "alpha"):
            augment.mixup(tf.ones([2, 1]), tf.ones([2, 2]), 0.0, seeds.derive(0))


class RunningMixupTest(absltest.TestCase):

    def test_running_mixup_follows_eq_9_and_10(self):
        rng = np.random.default_rng(2)
        steps, batch, classes = 30, 8, 10
        images = rng.random((steps, batch, 3, 3, 1)).astype(np.float32)
        raw = rng.integers(0, classes, (steps, batch))
        labels = np.eye(classes, dtype=np.float32)[raw]
        batches = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})
        mixed = list(batches.apply(pipelines.running_mixup(0.4, seed=5)).as_numpy_iterator())
        np.testing.assert_array_equal(mixed[0]["image"], images[0])  # x~(0) = x(0)
        checked = 0
        for t in range(1, steps):
            previous, current = mixed[t - 1], mixed[t]
            np.testing.assert_allclose(current["label"].sum(axis=1), 1.0, rtol=1e-5)
            self.assertTrue(np.all(current["label"] >= 0))
            for i in range(batch):
                c = raw[t, i]
                if previous["label"][i, c] > 0.99:
                    continue
                # eq. 10 at the raw class c: y~[c] = lam + (1 - lam) y~(t-1)[c].
                lam = (current["label"][i, c] - previous["label"][i, c]) / (1 - previous["label"][i, c])
                self.assertBetween(lam, -1e-5, 1 + 1e-5)
                np.testing.assert_allclose(
                    current["label"][i], lam * labels[t, i] + (1 - lam) * previous["label"][i], atol=1e-5)
                np.testing.assert_allclose(  # eq. 9
                    current["image"][i], lam * images[t, i] + (1 - lam) * previous["image"][i], atol=1e-5)
                checked += 1
        self.assertGreater(checked, 0.8 * (steps - 1) * batch)

    def test_batches_of_unknown_size_are_rejected(self):
        batches = tf.data.Dataset.from_tensor_slices(
            {"image": np.zeros((5, 2), np.float32), "label": np.zeros((5, 3), np.float32)}).batch(2)
        with self.assertRaisesRegex(ValueError, "drop_remainder=True"):
            batches.apply(pipelines.running_mixup(0.4, seed=0))


if __name__ == "__main__":
    absltest.main()
