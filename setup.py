"""Shim for tools that still run `python setup.py ...`: the project is declared in
pyproject.toml (metadata, dependencies, version from `tfkfac.__version__`), which
`pip install .` and `python -m build` read; this file adds nothing to it."""

from setuptools import setup

setup()
