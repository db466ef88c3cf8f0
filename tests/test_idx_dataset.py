"""The offline IDX TFDS builder: real Fashion-MNIST against its raw files, and small made-up
IDX files for the plain-file, concurrent-preparation and error paths."""

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys

from absl.testing import absltest
import numpy as np
import tensorflow_datasets as tfds

from idx_testing import write_idx, write_small_idx_dir
from pipelines import idx_dataset

tfds.disable_progress_bar()

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_raw_idx(path):
    """Independent IDX reader: gzip + numpy, header from the file's own dimensions."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data[4 + 4 * ndim:], dtype=np.uint8).reshape(shape)


def dataset_arrays(dataset):
    """(images, labels) of a whole dataset as numpy arrays."""
    batches = list(tfds.as_numpy(dataset.batch(20_000)))
    return (np.concatenate([b["image"] for b in batches]),
            np.concatenate([b["label"] for b in batches]))


class RealFashionMnistTest(absltest.TestCase):
    """Real Fashion-MNIST from Debian's dataset-fashion-mnist, prepared in the default dir."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.idx_dir = idx_dataset.FashionMnistIdx.default_idx_dir()
        cls.raw = {}
        for split, (images_name, labels_name) in idx_dataset.SPLIT_FILES.items():
            cls.raw[split] = (read_raw_idx(os.path.join(cls.idx_dir, images_name + ".gz")),
                              read_raw_idx(os.path.join(cls.idx_dir, labels_name + ".gz")))
        cls.train = dataset_arrays(idx_dataset.load_idx("fashion_mnist", "train"))

    def test_example_counts(self):
        self.assertLen(self.train[1], 60_000)
        test_labels = [example["label"] for example in tfds.as_numpy(
            idx_dataset.load_idx("fashion_mnist", "test"))]
        self.assertLen(test_labels, 10_000)
        np.testing.assert_array_equal(test_labels, self.raw["test"][1])

    def test_train_label_histogram_is_6000_per_class(self):
        np.testing.assert_array_equal(np.bincount(self.train[1], minlength=10), [6000] * 10)

    def test_labels_equal_raw_idx_labels(self):
        np.testing.assert_array_equal(self.train[1], self.raw["train"][1])

    def test_first_and_last_image_bytes_equal_raw_idx_bytes(self):
        raw_images = self.raw["train"][0]
        self.assertEqual(self.train[0][0].tobytes(), raw_images[0].tobytes())
        self.assertEqual(self.train[0][-1].tobytes(), raw_images[-1].tobytes())

    def test_dtype_shape_and_class_names(self):
        dataset = idx_dataset.load_idx("fashion_mnist", "test")
        spec = dataset.element_spec
        self.assertEqual(spec["image"].dtype, np.uint8)
        self.assertEqual(tuple(spec["image"].shape), (28, 28, 1))
        self.assertEqual(spec["label"].dtype, np.int64)
        self.assertEqual(tuple(spec["label"].shape), ())
        builder = idx_dataset.prepare_idx("fashion_mnist")
        self.assertEqual(builder.info.features["label"].names[0], "T-shirt/top")
        self.assertEqual(builder.info.features["label"].num_classes, 10)

    def test_tfds_load_by_name_after_preparation(self):
        dataset = tfds.load("fashion_mnist_idx", split="test[:3]",
                            data_dir=idx_dataset.default_data_dir(), download=False)
        images = np.stack([example["image"] for example in tfds.as_numpy(dataset)])
        np.testing.assert_array_equal(images[..., 0], self.raw["test"][0][:3])


class SmallIdxFilesTest(absltest.TestCase):
    """Made-up IDX files: plain (not gzipped) files, concurrent preparation, errors."""

    def setUp(self):
        super().setUp()
        self.tmp = self.create_tempdir().full_path

    def test_plain_idx_files_round_trip(self):
        idx_dir = os.path.join(self.tmp, "idx")
        os.makedirs(idx_dir)
        arrays = write_small_idx_dir(idx_dir, num_train=30, num_test=12, gzipped=False)
        data_dir = os.path.join(self.tmp, "tfds")
        for split, (images, labels) in arrays.items():
            got_images, got_labels = dataset_arrays(
                idx_dataset.load_idx("mnist", split, data_dir=data_dir, idx_dir=idx_dir))
            np.testing.assert_array_equal(got_images[..., 0], images)
            np.testing.assert_array_equal(got_labels, labels)

    def test_two_processes_preparing_at_once_both_succeed(self):
        idx_dir = os.path.join(self.tmp, "idx")
        os.makedirs(idx_dir)
        arrays = write_small_idx_dir(idx_dir, num_train=40, num_test=10, gzipped=True, seed=1)
        data_dir = os.path.join(self.tmp, "tfds")
        script = ("import sys\nfrom pipelines import idx_dataset\n"
                  "b = idx_dataset.prepare_idx('mnist', data_dir=sys.argv[1], idx_dir=sys.argv[2])\n"
                  "print(b.info.splits['train'].num_examples)\n")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join([REPO_ROOT] + sys.path))
        workers = [subprocess.Popen([sys.executable, "-c", script, data_dir, idx_dir],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for _ in range(2)]
        for worker in workers:
            out, err = worker.communicate(timeout=90)
            self.assertEqual(worker.returncode, 0, msg=err[-3000:])
            self.assertEqual(out.split()[-1], "40")
        _, labels = dataset_arrays(
            idx_dataset.load_idx("mnist", "train", data_dir=data_dir, idx_dir=idx_dir))
        np.testing.assert_array_equal(labels, arrays["train"][1])

    def test_missing_directory_raises_clear_error(self):
        missing = os.path.join(self.tmp, "no_such_dir")
        with self.assertRaises(idx_dataset.IdxFilesNotFoundError) as caught:
            idx_dataset.load_idx("fashion_mnist", "train", data_dir=self.tmp, idx_dir=missing)
        self.assertIsInstance(caught.exception, FileNotFoundError)
        self.assertIn(missing, str(caught.exception))
        self.assertIn("apt-get install dataset-fashion-mnist", str(caught.exception))

    def test_missing_file_names_the_paths_looked_for(self):
        idx_dir = os.path.join(self.tmp, "idx")
        os.makedirs(idx_dir)
        write_small_idx_dir(idx_dir, num_train=5, num_test=5, gzipped=True)
        os.remove(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"))
        with self.assertRaises(FileNotFoundError) as caught:
            idx_dataset.prepare_idx("fashion_mnist", data_dir=self.tmp, idx_dir=idx_dir)
        message = str(caught.exception)
        self.assertIn(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"), message)
        self.assertIn(os.path.join(idx_dir, "t10k-labels-idx1-ubyte"), message)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "fashion_mnist_idx")))

    def test_corrupt_header_is_rejected(self):
        idx_dir = os.path.join(self.tmp, "idx")
        os.makedirs(idx_dir)
        write_small_idx_dir(idx_dir, num_train=5, num_test=5, gzipped=False)
        labels_path = os.path.join(idx_dir, "train-labels-idx1-ubyte")
        write_idx(labels_path, np.zeros((5, 2), np.uint8))  # 2-D "labels": wrong magic
        with self.assertRaisesRegex(Exception, "magic number"):
            idx_dataset.prepare_idx("mnist", data_dir=os.path.join(self.tmp, "tfds"),
                                    idx_dir=idx_dir)

    def test_damaged_files_name_the_file_and_the_fault(self):
        idx_dir = os.path.join(self.tmp, "idx")
        os.makedirs(idx_dir)
        write_small_idx_dir(idx_dir, num_train=5, num_test=5, gzipped=True)
        truncated = os.path.join(idx_dir, "t10k-images-idx3-ubyte.gz")
        os.truncate(truncated, os.path.getsize(truncated) // 2)
        with self.assertRaises(idx_dataset.IdxFileError) as caught:
            idx_dataset.prepare_idx("mnist", data_dir=os.path.join(self.tmp, "a"),
                                    idx_dir=idx_dir)
        self.assertEqual(str(caught.exception), f"IDX file {truncated} is damaged: its gzip "
                                                "stream ends early (truncated file?)")
        with open(truncated, "wb") as f:
            f.write(b"not gzip at all")
        with self.assertRaisesRegex(idx_dataset.IdxFileError,
                                    f"IDX file {truncated} is damaged: not a valid gzip file"):
            idx_dataset.prepare_idx("mnist", data_dir=os.path.join(self.tmp, "b"),
                                    idx_dir=idx_dir)

    def test_prepared_dataset_records_its_files_and_refuses_others(self):
        first, second = os.path.join(self.tmp, "first"), os.path.join(self.tmp, "second")
        for seed, directory in enumerate((first, second)):
            os.makedirs(directory)
            write_small_idx_dir(directory, num_train=6, num_test=4, gzipped=False, seed=seed)
        data_dir = os.path.join(self.tmp, "tfds")
        builder = idx_dataset.prepare_idx("mnist", data_dir=data_dir, idx_dir=first)
        with open(os.path.join(builder.data_dir, idx_dataset.SOURCES_FILE)) as f:
            recorded = json.load(f)
        labels = os.path.join(first, "train-labels-idx1-ubyte")
        with open(labels, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        self.assertEqual(recorded["files"]["train-labels-idx1-ubyte"],
                         {"size": os.path.getsize(labels), "sha256": digest})
        idx_dataset.prepare_idx("mnist", data_dir=data_dir, idx_dir=first)  # same files
        idx_dataset.prepare_idx("mnist", data_dir=data_dir)  # no idx_dir: nothing to check
        with self.assertRaisesRegex(idx_dataset.IdxSourceMismatchError,
                                    f"than those in idx_dir {second}: t10k-images-idx3-ubyte "):
            idx_dataset.prepare_idx("mnist", data_dir=data_dir, idx_dir=second)

    def test_prepare_data_tool_reports_missing_files_in_one_line(self):
        missing = os.path.join(self.tmp, "no_such_dir")
        result = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "tools", "prepare_data.py"), "mnist",
             f"--idx_dir={missing}", f"--data_dir={self.tmp}"],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        self.assertEqual(result.returncode, 1)
        self.assertNotIn("Traceback", result.stderr)
        self.assertTrue(result.stderr.strip().splitlines()[-1].startswith(
            f"prepare_data.py: error: IDX directory {missing} does not exist"), result.stderr)

    def test_no_default_files_raises_naming_the_default_locations(self):
        known_dirs = idx_dataset.MnistIdx.KNOWN_DIRS
        if any(os.path.isdir(directory) for directory in known_dirs):
            self.skipTest(f"this machine has MNIST in {known_dirs}")
        with self.assertRaises(idx_dataset.IdxFilesNotFoundError) as caught:
            idx_dataset.load_idx("mnist", "train", data_dir=self.tmp)
        for directory in known_dirs:
            self.assertIn(directory, str(caught.exception))
        self.assertIn("idx_dir", str(caught.exception))

    def test_unknown_name_raises_value_error(self):
        with self.assertRaisesRegex(ValueError, "name must be one of.*fashion_mnist"):
            idx_dataset.load_idx("cifar10", "train")


if __name__ == "__main__":
    absltest.main()
