"""Small made-up IDX files for the data tests (random 28x28 images and labels)."""

import gzip
import os
import struct

import numpy as np

from pipelines import idx_dataset


def write_idx(path, array):
    """Writes a uint8 array as an IDX file (gzipped when the path ends in .gz)."""
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(">" + "I" * array.ndim,
                                                                   *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_small_idx_dir(directory, num_train, num_test, gzipped, seed=0):
    """Four IDX files of random 28x28 images; returns {split: (images, labels)}."""
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gzipped else ""
    arrays = {}
    for split, count in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(count,), dtype=np.uint8)
        images_name, labels_name = idx_dataset.SPLIT_FILES[split]
        write_idx(os.path.join(directory, images_name + suffix), images)
        write_idx(os.path.join(directory, labels_name + suffix), labels)
        arrays[split] = (images, labels)
    return arrays
