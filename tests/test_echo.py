"""The echo stage: exact repeat counts, the fractional factor's distribution and
determinism, fresh flags on repeats, and shuffling after echo (Choi et al.)."""

import math
from unittest import mock

from absl.testing import absltest
import numpy as np
import tensorflow as tf

import pipelines
from pipelines import counters, echoing, seeds


def ids_dataset(num):
    return tf.data.Dataset.range(num)


def echoed_ids(dataset, *args, **kwargs):
    """The echoed stream as one array (read in big batches: per-element eager reads are slow)."""
    echoed = dataset.apply(pipelines.echo(*args, **kwargs)).batch(4096)
    return np.concatenate([batch.numpy() for batch in echoed])


def adjacent_duplicate_fraction(ids):
    return float(np.mean(ids[1:] == ids[:-1]))


class IntegerFactorTest(absltest.TestCase):

    def test_each_example_appears_exactly_e_times_in_order(self):
        for factor in (1, 2, 3):
            ids = echoed_ids(ids_dataset(50), factor)
            np.testing.assert_array_equal(ids, np.repeat(np.arange(50), factor))

    def test_each_batch_appears_exactly_e_times(self):
        batches = tf.data.Dataset.range(23).batch(5)
        echoed = [b.numpy() for b in batches.apply(pipelines.echo(3))]
        expected = [b.numpy() for b in batches for _ in range(3)]
        self.assertEqual(len(echoed), 3 * 5)
        for got, want in zip(echoed, expected):
            np.testing.assert_array_equal(got, want)

    def test_large_elements_are_echoed_one_at_a_time_with_the_same_result(self):
        # 1 MiB per element takes the copy-free one-at-a-time path.
        big = tf.data.Dataset.range(4).map(lambda i: tf.fill([512, 512], tf.cast(i, tf.float32)))
        firsts = [float(x[0, 0]) for x in big.apply(pipelines.echo(2))]
        self.assertEqual(firsts, [0, 0, 1, 1, 2, 2, 3, 3])

    def test_tuple_and_dict_structures_are_kept(self):
        pairs = tf.data.Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 10))
        got = [(int(a), int(b)) for a, b in pairs.apply(pipelines.echo(2))]
        self.assertEqual(got, [(0, 0), (0, 0), (1, 10), (1, 10), (2, 20), (2, 20)])


class FractionalFactorTest(absltest.TestCase):

    def test_counts_are_floor_or_ceil_and_mean_is_e(self):
        num = 20_000
        for factor in (1.3, 2.5):
            ids = echoed_ids(ids_dataset(num), factor, seed=7)
            counts = np.bincount(ids, minlength=num)
            self.assertTrue(set(np.unique(counts)) <= {np.floor(factor), np.ceil(factor)})
            # Bernoulli(frac) per example: std of the mean <= 0.5/sqrt(num) = 0.0035.
            self.assertAlmostEqual(counts.mean(), factor, delta=0.02)
            # Repeats stay adjacent and in source order without a shuffle.
            np.testing.assert_array_equal(ids, np.repeat(np.arange(num), counts))

    def test_same_seed_same_counts_other_seed_other_counts(self):
        first = echoed_ids(ids_dataset(2000), 1.5, seed=3)
        again = echoed_ids(ids_dataset(2000), 1.5, seed=3)
        other = echoed_ids(ids_dataset(2000), 1.5, seed=4)
        np.testing.assert_array_equal(first, again)
        self.assertFalse(len(first) == len(other) and np.array_equal(first, other))

    def test_bad_factor_and_buffer_are_rejected(self):
        for factor in (0.5, 0, -1, float("nan"), float("inf"), "two", 101, 1e9):
            with self.assertRaisesRegex(ValueError,
                                        r"`echo_factor` must be a finite number in \[1, 100\]"):
                pipelines.echo(factor)
        with self.assertRaisesRegex(ValueError, "shuffle_buffer"):
            pipelines.echo(2, shuffle_buffer=-1)


class FreshFlagTest(absltest.TestCase):

    def test_only_first_copy_keeps_fresh_flag(self):
        examples = tf.data.Dataset.from_tensor_slices({"id": np.arange(500)}).map(counters.mark_fresh)
        echoed = list(examples.apply(pipelines.echo(2.4, seed=1)).as_numpy_iterator())
        ids = np.array([e["id"] for e in echoed])
        flags = np.array([e[counters.FRESH_KEY] for e in echoed])
        first_copy = np.concatenate([[True], ids[1:] != ids[:-1]])
        np.testing.assert_array_equal(flags, first_copy.astype(np.int32))
        self.assertEqual(flags.sum(), 500)

    def test_batch_echo_zeroes_the_flags_of_repeated_batches(self):
        # Static batch size (chunked path) and unknown batch size (one at a time).
        for drop_remainder in (True, False):
            batches = (tf.data.Dataset.from_tensor_slices({"id": np.arange(12)})
                       .map(counters.mark_fresh).batch(4, drop_remainder=drop_remainder))
            flags = [e[counters.FRESH_KEY].tolist()
                     for e in batches.apply(pipelines.echo(3)).as_numpy_iterator()]
            self.assertEqual(flags, [[1] * 4, [0] * 4, [0] * 4] * 3)

    def test_large_batches_with_fractional_factor(self):
        # Batches of 64 KiB+ (the one-at-a-time path): counts and flags as for examples.
        batches = (tf.data.Dataset.from_tensor_slices(
            {"image": np.zeros((400, 64, 64), np.float32), "id": np.arange(400)})
            .map(counters.mark_fresh).batch(8))
        echoed = list(batches.apply(pipelines.echo(1.5, seed=2)).as_numpy_iterator())
        firsts = np.array([e["id"][0] for e in echoed])
        counts = np.bincount(firsts // 8)
        self.assertTrue(set(counts) <= {1, 2})
        self.assertAlmostEqual(counts.mean(), 1.5, delta=0.25)  # 50 Bernoulli(0.5) draws
        flags = np.array([e[counters.FRESH_KEY] for e in echoed])
        first_copy = np.concatenate([[True], firsts[1:] != firsts[:-1]])
        np.testing.assert_array_equal(flags, np.repeat(first_copy[:, None], 8, axis=1).astype(np.int32))


def reference_counts(factor, seed, num):
    """The documented per-element rule, computed without the echo stage: floor(e)
    copies, one more where the element's uniform draw is below e - floor(e). The draws
    come in blocks of 64 consecutive elements, each block keyed by its first position
    (the stream of every earlier version of the stage)."""
    whole = math.floor(factor)
    if factor == whole:
        return np.full(num, whole)
    count_key = seeds.derive(seeds.derive(seed), 0)
    draws = np.concatenate([
        tf.random.stateless_uniform([64], seeds.derive(count_key, start)).numpy()
        for start in range(0, num, 64)])[:num]
    return whole + (draws < factor - whole).astype(int)


class ChunkedPathMatchesReferenceTest(absltest.TestCase):
    """Small elements are echoed a chunk at a time; the result must be the per-element
    rule whatever the chunk size, across chunk and draw-block boundaries (700 and 275
    elements: several chunks, neither a multiple of 64)."""

    def test_examples_match_the_per_element_rule(self):
        num = 700
        ids = np.arange(num)
        examples = tf.data.Dataset.from_tensor_slices(
            {"image": np.tile(ids.astype(np.float32)[:, None, None], (1, 7, 7)), "id": ids}
        ).map(counters.mark_fresh)
        for factor in (1, 2, 3, 1.5, 2.7):
            counts = reference_counts(factor, 9, num)
            if factor % 1:
                self.assertEqual(set(counts), {math.floor(factor), math.ceil(factor)})
            want_ids = np.repeat(ids, counts)
            want_flags = np.concatenate([[1] + [0] * (c - 1) for c in counts])
            for max_chunk in (64, 256):
                with self.subTest(factor=factor, max_chunk=max_chunk), \
                        mock.patch.object(echoing, "_MAX_CHUNK", max_chunk):
                    echoed = examples.apply(pipelines.echo(factor, seed=9))
                    self.assertEqual(echoed.element_spec, examples.element_spec)
                    got = [b for b in echoed.batch(4096).as_numpy_iterator()]
                    got = {k: np.concatenate([b[k] for b in got]) for k in got[0]}
                    np.testing.assert_array_equal(got["id"], want_ids)
                    np.testing.assert_array_equal(
                        got["image"], np.tile(want_ids.astype(np.float32)[:, None, None], (1, 7, 7)))
                    np.testing.assert_array_equal(got[counters.FRESH_KEY], want_flags)

    def test_small_batches_match_the_per_element_rule(self):
        # Batch echo of small static-size batches (chunked; flags of shape (4,)).
        batches = (tf.data.Dataset.from_tensor_slices({"id": np.arange(1100)})
                   .map(counters.mark_fresh).batch(4, drop_remainder=True))
        for factor in (2, 1.4):
            counts = reference_counts(factor, 4, 275)
            echoed = list(batches.apply(pipelines.echo(factor, seed=4)).as_numpy_iterator())
            want_firsts = np.repeat(np.arange(275) * 4, counts)
            np.testing.assert_array_equal([e["id"][0] for e in echoed], want_firsts)
            want_flags = np.concatenate([[1] + [0] * (c - 1) for c in counts])
            np.testing.assert_array_equal([e[counters.FRESH_KEY] for e in echoed],
                                          np.repeat(want_flags[:, None], 4, axis=1))


class ShuffleAfterEchoTest(absltest.TestCase):

    def test_shuffle_lowers_adjacent_duplicates(self):
        plain = echoed_ids(ids_dataset(5000), 2)
        shuffled = echoed_ids(ids_dataset(5000), 2, shuffle_buffer=1000, seed=5)
        # Without a shuffle every other neighbour pair is a repeat.
        self.assertAlmostEqual(adjacent_duplicate_fraction(plain), 0.5, delta=1e-3)
        # A 1000-element buffer puts a repeat next to its twin with chance ~1/1000.
        self.assertLess(adjacent_duplicate_fraction(shuffled), 0.01)
        # Same multiset: shuffling moves repeats, it does not drop or add any.
        np.testing.assert_array_equal(np.sort(shuffled), plain)


if __name__ == "__main__":
    absltest.main()
