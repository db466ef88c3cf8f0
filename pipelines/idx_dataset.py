"""Offline TFDS builders for IDX image datasets (Fashion-MNIST, MNIST) read from local files.

TFDS's own `fashion_mnist`/`mnist` builders download from the internet, which this project
cannot rely on (no network: `tfds.load` retries ~200 s, then fails). These builders read
the four IDX files (gzipped or plain) from a local directory -- by default where Debian's
`dataset-fashion-mnist` package installs them -- and prepare an ordinary TFDS dataset once
per data dir. Afterwards `tfds.load("fashion_mnist_idx", data_dir=..., download=False)`
works like any other TFDS dataset (after importing this module).
"""

import contextlib
import fcntl
import functools
import gzip
import hashlib
import json
import os
import subprocess
import zlib

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

IMAGE_SIZE = 28
# IDX magic numbers: unsigned bytes with 3 (images) or 1 (labels) dimensions.
_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801
SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# Written beside a prepared dataset: size and SHA-256 of each IDX file it was made from.
SOURCES_FILE = "idx_sources.json"


class IdxFilesNotFoundError(FileNotFoundError):
    """The IDX directory or one of its four files is missing (says where it looked)."""


class IdxFileError(ValueError):
    """An IDX file is damaged (says which file and what is wrong with it)."""


class IdxSourceMismatchError(ValueError):
    """A prepared dataset was made from other IDX files than the `idx_dir` given."""


def default_data_dir():
    """Where prepared TFDS datasets live: `$TFDS_DATA_DIR`, else `~/tensorflow_datasets`."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), "tensorflow_datasets")


def _read_idx(path, magic):
    """Parses one IDX file (gzipped if it ends in .gz) into a uint8 array.

    Raises `IdxFileError` naming the file and what is wrong: a damaged or truncated gzip
    stream, a wrong magic number, a header that does not match the data.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except EOFError:
        raise IdxFileError(f"IDX file {path} is damaged: its gzip stream ends early "
                           "(truncated file?)") from None
    except (gzip.BadGzipFile, zlib.error) as error:
        raise IdxFileError(f"IDX file {path} is damaged: not a valid gzip file ({error})"
                           ) from None
    except OSError as error:
        raise IdxFileError(f"IDX file {path} cannot be read: {error}") from None
    ndim = magic & 0xFF
    offset = 4 + 4 * ndim
    if len(data) < offset:
        raise IdxFileError(f"IDX file {path} is damaged: {len(data)} bytes, shorter than "
                           f"its {offset}-byte header")
    header = np.frombuffer(data, dtype=">u4", count=1)[0]
    if header != magic:
        raise IdxFileError(f"IDX file {path} is damaged or of another kind: magic number "
                           f"{header:#010x}, expected {magic:#010x}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    if len(data) - offset != int(np.prod(shape)):
        raise IdxFileError(f"IDX file {path} is damaged: its header says shape {shape} "
                           f"({int(np.prod(shape))} bytes) but it holds {len(data) - offset} "
                           "bytes of data")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


class _IdxImageBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared builder for 28x28 grayscale IDX datasets; subclasses name the dataset."""

    VERSION = tfds.core.Version("1.0.0")
    CLASS_NAMES = ()
    DESCRIPTION = ""
    HOMEPAGE = ""
    # Where the four IDX files are looked for when no directory is given.
    DEBIAN_PACKAGE = None
    KNOWN_DIRS = ()
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte; each may end in .gz) in one "
        "directory and pass it as manual_dir / idx_dir.")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 1)),
                "label": tfds.features.ClassLabel(names=list(self.CLASS_NAMES)),
            }),
            supervised_keys=("image", "label"),
            homepage=self.HOMEPAGE,
            # Keep the IDX files' order: example i is record i of the files.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        files = find_idx_files(str(dl_manager.manual_dir), self.install_hint())
        return {split: self._generate_examples(*files[split]) for split in SPLIT_FILES}

    def _generate_examples(self, images_path, labels_path):
        images = _read_idx(images_path, _IMAGES_MAGIC)
        labels = _read_idx(labels_path, _LABELS_MAGIC)
        if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or len(images) != len(labels):
            raise ValueError(f"{images_path} holds images of shape {images.shape} for "
                             f"{len(labels)} labels in {labels_path}; expected "
                             f"(N, {IMAGE_SIZE}, {IMAGE_SIZE}) with one label each")
        for index, (image, label) in enumerate(zip(images, labels)):
            yield index, {"image": image[..., np.newaxis], "label": int(label)}

    @classmethod
    def default_idx_dir(cls):
        """The first default location holding the files: the Debian package's, then known dirs."""
        candidates = list(dict.fromkeys(_debian_package_dirs(cls.DEBIAN_PACKAGE)
                                        + list(cls.KNOWN_DIRS)))
        for directory in candidates:
            if _idx_file_candidates(directory, SPLIT_FILES["train"][0]):
                return directory
        raise IdxFilesNotFoundError(
            f"no IDX files for {cls.name} in the default locations "
            f"{candidates or '(none known)'}. {cls.install_hint()}")

    @classmethod
    def install_hint(cls):
        if cls.DEBIAN_PACKAGE:
            return (f"Install them with `apt-get install {cls.DEBIAN_PACKAGE}` or pass the "
                    "directory holding them as idx_dir.")
        return cls.MANUAL_DOWNLOAD_INSTRUCTIONS


class FashionMnistIdx(_IdxImageBuilder):
    """Fashion-MNIST (Xiao et al. 2017): 60,000 train / 10,000 test 28x28 clothing images."""

    CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot")
    DESCRIPTION = "Fashion-MNIST read from local IDX files (Zalando Research)."
    HOMEPAGE = "https://github.com/zalandoresearch/fashion-mnist"
    DEBIAN_PACKAGE = "dataset-fashion-mnist"
    KNOWN_DIRS = ("/usr/share/datasets/fashion-mnist",)


class MnistIdx(_IdxImageBuilder):
    """MNIST (LeCun et al. 1998): 60,000 train / 10,000 test 28x28 handwritten digits."""

    CLASS_NAMES = tuple(str(digit) for digit in range(10))
    DESCRIPTION = "MNIST handwritten digits read from local IDX files."
    HOMEPAGE = "http://yann.lecun.com/exdb/mnist/"
    KNOWN_DIRS = ("/usr/share/datasets/mnist",)


# Dataset name (as the trainers' --dataset flag spells it) -> offline builder.
IDX_DATASETS = {
    "fashion_mnist": FashionMnistIdx,
    "mnist": MnistIdx,
}


def _debian_package_dirs(package):
    """Directories holding a `train-images` file among the files a Debian package installed."""
    if not package:
        return []
    try:
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted({os.path.dirname(path) for path in listing.splitlines()
                   if os.path.basename(path).startswith(SPLIT_FILES["train"][0])})


def _looked_for(idx_dir, name):
    return [os.path.join(idx_dir, name + ".gz"), os.path.join(idx_dir, name)]


def _idx_file_candidates(idx_dir, name):
    """Existing files for IDX file `name` in `idx_dir`, gzipped first."""
    return [path for path in _looked_for(idx_dir, name) if os.path.isfile(path)]


def find_idx_files(idx_dir, hint=""):
    """Returns {split: (images_path, labels_path)}, preferring `<name>.gz` over `<name>`."""
    if not os.path.isdir(idx_dir):
        raise IdxFilesNotFoundError(f"IDX directory {idx_dir} does not exist. {hint}".strip())
    files = {}
    for split, names in SPLIT_FILES.items():
        paths = []
        for name in names:
            found = _idx_file_candidates(idx_dir, name)
            if not found:
                raise IdxFilesNotFoundError(
                    f"IDX file missing: looked for {' and '.join(_looked_for(idx_dir, name))}. "
                    f"{hint}".strip())
            paths.append(found[0])
        files[split] = tuple(paths)
    return files


@contextlib.contextmanager
def _exclusive_lock(path):
    """Holds an exclusive flock on `path`, so concurrent processes prepare one at a time."""
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _builder_class(name):
    if name not in IDX_DATASETS:
        raise ValueError(f"name must be one of {sorted(IDX_DATASETS)}, got {name!r}")
    return IDX_DATASETS[name]


@functools.lru_cache(maxsize=64)
def _file_fingerprint(path, size, mtime_ns):  # size and mtime key the cache
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": size, "sha256": digest.hexdigest()}


def source_fingerprints(files):
    """{file name: {"size", "sha256"}} of the IDX files from `find_idx_files`."""
    fingerprints = {}
    for paths in files.values():
        for path in paths:
            stat = os.stat(path)
            fingerprints[os.path.basename(path)] = _file_fingerprint(
                path, stat.st_size, stat.st_mtime_ns)
    return fingerprints


def _read_sources(builder):
    path = os.path.join(builder.data_dir, SOURCES_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_sources(builder, idx_dir, fingerprints):
    path = os.path.join(builder.data_dir, SOURCES_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"idx_dir": os.path.abspath(idx_dir), "files": fingerprints}, f, indent=2,
                  sort_keys=True)
    os.replace(path + ".tmp", path)


def _check_same_sources(builder, idx_dir, files, lock_path):
    """Raises `IdxSourceMismatchError` if `builder`'s prepared data came from other files
    than those in `idx_dir` (sizes and SHA-256 of the four files). `lock_path`: the
    preparation lock to wait for when the record is missing (None: already held)."""
    recorded = _read_sources(builder)
    if recorded is None and lock_path:  # perhaps being written now: the preparer holds the lock
        with _exclusive_lock(lock_path):
            recorded = _read_sources(builder)
    if recorded is None:
        logging.warning("%s in %s was prepared without a record of its IDX files; cannot "
                        "check that it matches idx_dir %s", builder.name, builder.data_dir,
                        idx_dir)
        return
    given = source_fingerprints(files)
    differences = []
    for file_name, fingerprint in sorted(given.items()):
        before = recorded["files"].get(file_name)
        if before != fingerprint:
            was = ("not among them" if before is None else
                   f"{before['size']} bytes, sha256 {before['sha256'][:12]}")
            differences.append(f"{file_name} ({fingerprint['size']} bytes, sha256 "
                               f"{fingerprint['sha256'][:12]}; prepared from: {was})")
    if differences:
        raise IdxSourceMismatchError(
            f"{builder.name} in {builder.data_dir} was prepared from other IDX files "
            f"(from {recorded['idx_dir']}) than those in idx_dir {idx_dir}: "
            f"{'; '.join(differences)}. Use another data_dir for these files, or delete "
            f"{builder.data_dir} to prepare it again from them")


def _ensure_data_dir(data_dir):
    """Creates `data_dir` if missing, but only when its parent exists (a mistyped path
    is an error, not a new directory tree), and says so in the log."""
    if os.path.isdir(data_dir):
        return
    if os.path.exists(data_dir):
        raise ValueError(f"data_dir {data_dir} is a file, not a directory")
    parent = os.path.dirname(os.path.abspath(data_dir))
    if not os.path.isdir(parent):
        raise ValueError(f"data_dir {data_dir} does not exist and neither does its parent "
                         f"{parent}; create it first or fix the path")
    os.makedirs(data_dir, exist_ok=True)
    logging.warning("data_dir %s did not exist; created it to prepare the dataset in",
                    data_dir)


def prepare_idx(name, data_dir=None, idx_dir=None):
    """Prepares the TFDS dataset for `name` once and returns its builder.

    The prepared dataset records the size and SHA-256 of the IDX files it was made from
    (`SOURCES_FILE`); an explicit `idx_dir` whose files differ from them is an error,
    never silently ignored.

    Args:
      name: one of `IDX_DATASETS` ("fashion_mnist", "mnist").
      data_dir: TFDS data dir; default `default_data_dir()`. Created if missing when its
        parent exists.
      idx_dir: directory holding the four IDX files; default the builder's
        `default_idx_dir()` (Debian's dataset-fashion-mnist for Fashion-MNIST).

    Raises:
      ValueError: unknown `name`, or a `data_dir` that cannot be used.
      IdxFilesNotFoundError: the IDX directory or a file is missing (an explicit
        `idx_dir` is always checked; the default only when preparation is needed).
      IdxFileError: an IDX file is damaged.
      IdxSourceMismatchError: the dataset was prepared from other files than `idx_dir`'s.
    """
    builder_cls = _builder_class(name)
    data_dir = data_dir or default_data_dir()
    lock_path = os.path.join(data_dir, f".{builder_cls.name}.lock")
    explicit_files = (find_idx_files(idx_dir, builder_cls.install_hint())
                      if idx_dir is not None else None)
    builder = builder_cls(data_dir=data_dir)
    if builder.is_prepared():
        if explicit_files is not None:
            _check_same_sources(builder, idx_dir, explicit_files, lock_path)
        return builder
    idx_dir = idx_dir or builder_cls.default_idx_dir()
    files = find_idx_files(idx_dir, builder_cls.install_hint())
    _ensure_data_dir(data_dir)
    with _exclusive_lock(lock_path):
        # Another process may have prepared it while this one waited for the lock.
        builder = builder_cls(data_dir=data_dir)
        if not builder.is_prepared():
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
                manual_dir=idx_dir, try_download_gcs=False))
            _write_sources(builder, idx_dir, source_fingerprints(files))
        elif explicit_files is not None:
            _check_same_sources(builder, idx_dir, explicit_files, lock_path=None)
    return builder


def load_idx(name, split, data_dir=None, idx_dir=None, shuffle_files=False, read_config=None):
    """Returns a `tf.data.Dataset` of {"image": uint8 (28, 28, 1), "label": int64}.

    Prepares the dataset first if needed (see `prepare_idx`); never downloads.
    `split` is a TFDS split string ("train", "test", "train[:10%]", ...);
    `shuffle_files` and `read_config` (e.g. per-rank sharding) go to `as_dataset`.
    """
    builder = prepare_idx(name, data_dir=data_dir, idx_dir=idx_dir)
    return builder.as_dataset(split=split, shuffle_files=shuffle_files, read_config=read_config)
