"""Installs tfkfac with its input pipelines and trainers (`pip install -e .`)."""

import pathlib
import re

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent


def read_version():
    """Reads `__version__` from tfkfac/__init__.py as text, so setup never imports TF."""
    init = (ROOT / "tfkfac" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', init, re.MULTILINE)
    if match is None:
        raise RuntimeError("tfkfac/__init__.py defines no __version__ string")
    return match.group(1)


setup(
    name="tfkfac",
    version=read_version(),
    description="K-FAC second-order training for TensorFlow 2 / Keras 3, with "
    "data-echoing tf.data pipelines and Horovod data parallelism.",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8")
    if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    # tfkfac, tfkfac.blocks, tfkfac.distributed, pipelines, trainers (and any later subpackage).
    packages=find_packages(include=["tfkfac", "tfkfac.*", "pipelines", "trainers"]),
    python_requires=">=3.10",
    # Only the -cpu wheel: plain `tensorflow` pulls a ~570 MB GPU build.
    install_requires=[
        "tensorflow-cpu>=2.16,<2.22",
        "keras>=3.0",
        "tensorflow-datasets",
        "absl-py",
        "numpy",
        "scipy",
    ],
    extras_require={"horovod": ["horovod==0.28.1"]},
    license="Apache-2.0",
)
