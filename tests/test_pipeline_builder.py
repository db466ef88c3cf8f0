"""`pipelines.build`: real Fashion-MNIST through the offline IDX source, disjoint and
covering shards, echo variants before/after augmentation, exact fresh/trained counters
(also under `model.fit`), determinism per seed and resuming at an epoch."""

import hashlib
import tempfile
import time

from absl.testing import absltest
import keras
import numpy as np
import tensorflow as tf

import pipelines
from pipelines import idx_dataset

NUM = 240
FULL_AUGMENTATION = pipelines.Augmentation(crop_padding=2, flip=True, erasing_probability=1.0)


def id_source(num=NUM, size=8):
    """Random uint8 images whose label is the example's id."""
    images = np.random.default_rng(0).integers(0, 256, (num, size, size, 1), dtype=np.uint8)
    return tf.data.Dataset.from_tensor_slices({"image": images, "label": np.arange(num)})


def collect(dataset):
    """All batches as numpy (images, labels) lists."""
    batches = [(x.numpy(), y.numpy()) for x, y in dataset]
    return [b[0] for b in batches], [b[1] for b in batches]


def all_labels(dataset):
    return np.concatenate(collect(dataset)[1])


class RealDataTest(absltest.TestCase):

    def test_fashion_mnist_images_are_scaled_and_normalized_from_the_source(self):
        mean, stddev = 0.286, 0.353
        dataset, _ = pipelines.build("fashion_mnist", split="test[:300]", batch_size=100,
                                     shuffle_buffer=0, mean=mean, stddev=stddev)
        images, labels = collect(dataset)
        raw = list(idx_dataset.load_idx("fashion_mnist", "test[:300]").as_numpy_iterator())
        self.assertEqual(images[0].shape, (100, 28, 28, 1))
        self.assertEqual(images[0].dtype, np.float32)
        np.testing.assert_allclose(np.concatenate(images),
                                   (np.stack([r["image"] for r in raw]) / 255.0 - mean) / stddev,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.concatenate(labels), [r["label"] for r in raw])

    def test_shards_of_the_test_split_cover_it_once(self):
        def digests(batches):
            return [hashlib.sha1(np.round(image * 255).astype(np.uint8).tobytes()).hexdigest()
                    for batch in batches for image in batch]

        split = "test[:5000]"
        source = idx_dataset.load_idx("fashion_mnist", split).batch(1000)
        whole = sorted(digests(batch["image"] / 255 for batch in source.as_numpy_iterator()))
        self.assertLen(whole, 5000)
        for shards in (2, 3):
            parts = [digests(collect(pipelines.build(
                "fashion_mnist", split=split, batch_size=1000, shuffle_buffer=0,
                drop_remainder=False, num_shards=shards, shard_index=index)[0])[0])
                for index in range(shards)]
            self.assertEqual(sorted(sum(parts, [])), whole)


class ShardTest(absltest.TestCase):

    def test_shards_are_disjoint_and_cover_the_ids(self):
        for shards in (2, 3):
            parts = [set(all_labels(pipelines.build(
                id_source(1001), batch_size=64, num_shards=shards, shard_index=index,
                seed=index, drop_remainder=False)[0])) for index in range(shards)]
            for i in range(shards):
                for j in range(i + 1, shards):
                    self.assertEmpty(parts[i] & parts[j])
            self.assertEqual(set().union(*parts), set(range(1001)))

    def test_bad_shards_are_rejected(self):
        for shards, index in ((0, 0), (2, 2), (2, -1), (2.0, 0)):
            with self.assertRaisesRegex(ValueError, "num_shards|shard_index"):
                pipelines.build(id_source(), batch_size=8, num_shards=shards, shard_index=index)


class ReadLatencyTest(absltest.TestCase):

    def test_latency_delays_reads_and_keeps_the_examples(self):
        num, latency = 256, 1e-3
        delayed = id_source(num).apply(pipelines.simulate_read_latency(latency)).batch(num)
        start = time.perf_counter()
        labels = next(iter(delayed))["label"].numpy()
        elapsed = time.perf_counter() - start
        np.testing.assert_array_equal(labels, np.arange(num))
        self.assertGreaterEqual(elapsed, num * latency)  # 8 reads of 32 x 1 ms
        self.assertLess(elapsed, 20 * num * latency)

    def test_bad_latency_is_rejected(self):
        with self.assertRaisesRegex(ValueError, "seconds_per_example"):
            pipelines.simulate_read_latency(-1.0)
        with self.assertRaisesRegex(ValueError, "examples_per_read"):
            pipelines.simulate_read_latency(1e-3, examples_per_read=0)


class EchoVariantTest(absltest.TestCase):

    def pairs(self, echo_mode):
        # Batches of 2 with no shuffle: each batch holds the two copies of one example.
        dataset, _ = pipelines.build(id_source(), batch_size=2, echo_mode=echo_mode,
                                     echo_factor=2, shuffle_buffer=0,
                                     augmentation=FULL_AUGMENTATION, seed=3)
        return collect(dataset)

    def test_echo_before_augmentation_augments_repeats_differently(self):
        images, labels = self.pairs("example_before_augment")
        self.assertLen(labels, NUM)
        for pair, ids in zip(images, labels):
            self.assertEqual(ids[0], ids[1])
            self.assertFalse(np.array_equal(pair[0], pair[1]))

    def test_echo_after_augmentation_repeats_identical_copies(self):
        images, labels = self.pairs("example_after_augment")
        self.assertLen(labels, NUM)
        for pair, ids in zip(images, labels):
            self.assertEqual(ids[0], ids[1])
            np.testing.assert_array_equal(pair[0], pair[1])

    def test_batch_echo_repeats_whole_batches(self):
        dataset, _ = pipelines.build(id_source(), batch_size=16, echo_mode="batch",
                                     echo_factor=3, augmentation=FULL_AUGMENTATION, seed=3)
        images, labels = collect(dataset)
        self.assertLen(images, 3 * (NUM // 16))
        for start in range(0, len(images), 3):
            for repeat in (1, 2):
                np.testing.assert_array_equal(images[start], images[start + repeat])
                np.testing.assert_array_equal(labels[start], labels[start + repeat])
        self.assertEqual(sorted(np.concatenate(labels[::3])), list(range(NUM)))


class CounterTest(absltest.TestCase):

    def test_counters_are_exact_over_a_pass(self):
        for echo_mode in pipelines.ECHO_MODES:
            for factor in ((1,) if echo_mode == "none" else (2, 1.5)):
                dataset, counters = pipelines.build(
                    id_source(), batch_size=16, echo_mode=echo_mode, echo_factor=factor,
                    shuffle_buffer=50, seed=1, drop_remainder=False)
                labels = all_labels(dataset)
                if factor == 2:
                    self.assertLen(labels, 2 * NUM)
                self.assertEqual(set(labels), set(range(NUM)))
                self.assertEqual(counters.result(),
                                 {"fresh_examples": NUM, "trained_examples": len(labels)},
                                 msg=f"{echo_mode} e={factor}")

    def test_counters_follow_model_fit_step_by_step(self):
        steps, batch = 7, 16
        for echo_mode in ("example_before_augment", "batch"):
            def make():
                return pipelines.build(id_source(), batch_size=batch, echo_mode=echo_mode,
                                       echo_factor=2, shuffle_buffer=0, seed=2, num_epochs=None)

            reference = make()[0].take(steps)
            # Without a shuffle after echo the first copy comes first: fresh = ids seen.
            expected_fresh = len(set(all_labels(reference)))
            dataset, counters = make()
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(NUM)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(dataset, steps_per_epoch=steps, epochs=2, verbose=0,
                                callbacks=[pipelines.EchoCountersCallback(counters)])
            self.assertEqual(history.history["trained_examples"], [steps * batch, 2 * steps * batch])
            self.assertEqual(history.history["fresh_examples"][0], expected_fresh)
            counters.reset()
            self.assertEqual(counters.result(), {"fresh_examples": 0, "trained_examples": 0})


def build_for_determinism(**overrides):
    kwargs = dict(batch_size=16, echo_mode="example_before_augment", echo_factor=1.5,
                  shuffle_buffer=64, num_classes=10, seed=4,
                  augmentation=pipelines.Augmentation(crop_padding=2, flip=True,
                                                      erasing_probability=0.5,
                                                      mixup_alpha=0.4, running_mixup=True))
    kwargs.update(overrides)
    source = id_source().map(lambda e: {**e, "label": e["label"] % 10})
    return collect(pipelines.build(source, **kwargs)[0])


class DeterminismTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.first_epoch = build_for_determinism()
        cls.three_epochs = build_for_determinism(num_epochs=3)

    def assert_same(self, first, second):
        self.assertEqual(len(first[0]), len(second[0]))
        for a, b in zip(first[0] + first[1], second[0] + second[1]):
            np.testing.assert_array_equal(a, b)

    def test_same_seed_same_batches(self):
        self.assert_same(self.first_epoch, build_for_determinism())

    def test_tensorflow_global_seed_does_not_matter(self):
        tf.random.set_seed(0)
        self.assert_same(self.first_epoch, build_for_determinism())

    def test_resuming_at_an_epoch_gives_that_epoch_of_an_uninterrupted_run(self):
        pieces = [self.first_epoch] + [build_for_determinism(epoch=epoch) for epoch in (1, 2)]
        self.assert_same(self.three_epochs, (sum((p[0] for p in pieces), []),
                                             sum((p[1] for p in pieces), [])))
        self.assertFalse(np.array_equal(pieces[0][0][0], pieces[1][0][0]))  # new order per epoch

    def test_other_seed_other_batches(self):
        other = build_for_determinism(seed=5)
        self.assertFalse(np.array_equal(self.first_epoch[0][0], other[0][0]))

    def test_cache_changes_nothing(self):
        self.assert_same(self.three_epochs, build_for_determinism(num_epochs=3, cache=True))

    def test_mixup_labels_are_one_hot_mixtures(self):
        _, labels = build_for_determinism(augmentation=pipelines.Augmentation(mixup_alpha=0.4))
        labels = np.concatenate(labels)
        self.assertEqual(labels.shape[1], 10)
        np.testing.assert_allclose(labels.sum(axis=1), 1.0, rtol=1e-5)
        self.assertTrue(np.all(labels >= 0))


class ArgumentTest(absltest.TestCase):

    def test_bad_arguments_name_the_argument_and_the_allowed_values(self):
        cases = [
            (dict(echo_mode="examples"), "`echo_mode` must be one of none, "
                                         "example_before_augment, example_after_augment, batch"),
            (dict(echo_factor=2), "needs an echo_mode"),
            (dict(echo_mode="batch", echo_factor=0.5),
             r"`echo_factor` must be a finite number in \[1, 100\]"),
            (dict(batch_size=0), "batch_size"),
            (dict(shuffle_buffer=-1), "shuffle_buffer"),
            (dict(augmentation=pipelines.Augmentation(mixup_alpha=0.4)), "num_classes"),
            (dict(augmentation=pipelines.Augmentation(mixup_alpha=0.4, running_mixup=True),
                  num_classes=10, drop_remainder=False), "drop_remainder"),
            (dict(epoch=-1), "epoch"),
            (dict(num_epochs=0), "num_epochs"),
            (dict(dtype=tf.int32), "floating"),
        ]
        for overrides, message in cases:
            kwargs = dict(batch_size=8)
            kwargs.update(overrides)
            with self.assertRaisesRegex(ValueError, message, msg=str(overrides)):
                pipelines.build(id_source(), **kwargs)
        with self.assertRaisesRegex(ValueError, "running_mixup needs mixup_alpha"):
            pipelines.Augmentation(running_mixup=True)
        with self.assertRaisesRegex(ValueError, "^`source` must be .*; received ndarray$"):
            pipelines.build(np.zeros(3), batch_size=8)
        with self.assertRaisesRegex(ValueError, "'image' and 'label'"):
            pipelines.build(tf.data.Dataset.range(3), batch_size=8)

    def test_other_names_go_to_tfds_without_downloading(self):
        data_dir = tempfile.mkdtemp()
        with self.assertRaisesRegex(AssertionError, f"cifar10: could not find data in {data_dir}"):
            pipelines.build("cifar10", batch_size=8, data_dir=data_dir)


if __name__ == "__main__":
    absltest.main()
