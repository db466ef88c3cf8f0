"""Prepares offline IDX datasets (default: Fashion-MNIST) into the TFDS data dir once.

`make test` runs this before Bazel so the tests share one prepared copy instead of each
paying ~20 s; a dataset that is already prepared is left as it is.

Usage: prepare_data.py [--data_dir=DIR] [--idx_dir=DIR] NAME...
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow_datasets as tfds  # pylint: disable=wrong-import-position

from pipelines import idx_dataset  # pylint: disable=wrong-import-position


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=sorted(idx_dataset.IDX_DATASETS))
    parser.add_argument("--data_dir", default=None,
                        help="TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    parser.add_argument("--idx_dir", default=None,
                        help="directory with the four IDX files (default: the Debian package's)")
    args = parser.parse_args(argv)
    tfds.disable_progress_bar()
    for name in args.names:
        try:
            builder = idx_dataset.prepare_idx(name, data_dir=args.data_dir, idx_dir=args.idx_dir)
        except (idx_dataset.IdxFilesNotFoundError, ValueError) as error:
            parser.exit(1, f"{parser.prog}: error: {error}\n")  # says which file, and why
        counts = {split: info.num_examples for split, info in builder.info.splits.items()}
        print(f"[data] {builder.name} ready in {builder.data_dir}: {counts}")


if __name__ == "__main__":
    main()
