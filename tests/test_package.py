"""The installable package: imports, one source tree, version, metadata, no Horovod needed."""

import importlib
import importlib.metadata
import os
import subprocess
import sys
import tomllib

import setuptools
from absl.testing import absltest

import pipelines
import tfkfac
import trainers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In the wheel: tfkfac and its subpackages. pipelines and trainers: repository only.
PACKAGES = ("tfkfac", "tfkfac.blocks", "tfkfac.distributed")
REPOSITORY_PACKAGES = ("pipelines", "trainers")


def read_pyproject():
    with open(os.path.realpath(os.path.join(REPO_ROOT, "pyproject.toml")), "rb") as f:
        return tomllib.load(f)


def package_root(module):
    """The directory holding a top-level package (symlinks resolved)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(module.__file__)))


class PackageTest(absltest.TestCase):

    def test_all_packages_import_from_one_source_tree(self):
        # Under Bazel the runfiles tree and the editable install must not mix.
        root = package_root(tfkfac)
        for name in PACKAGES + REPOSITORY_PACKAGES:
            module = importlib.import_module(name)
            self.assertTrue(os.path.realpath(module.__file__).startswith(root + os.sep),
                            msg=f"{name} imported from {module.__file__}, not under {root}")
        self.assertEqual(package_root(pipelines), root)
        self.assertEqual(package_root(trainers), root)

    def test_version_is_pep440_and_matches_installed_metadata(self):
        self.assertRegex(tfkfac.__version__, r"^\d+\.\d+\.\d+([ab]|rc|\.dev)?\d*$")
        project = read_pyproject()
        # The one version string is tfkfac.__version__, read by the build backend.
        self.assertEqual(project["project"]["dynamic"], ["version"])
        self.assertEqual(project["tool"]["setuptools"]["dynamic"]["version"],
                         {"attr": "tfkfac.__version__"})
        self.assertEqual(importlib.metadata.version("tfkfac"), tfkfac.__version__)

    def test_tfkfac_imports_without_horovod(self):
        # A finder that refuses `horovod` stands for an environment without it installed.
        script = (
            "import sys\n"
            "class NoHorovod:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'horovod' or name.startswith('horovod.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoHorovod())\n"
            "import tfkfac, tfkfac.distributed, pipelines\n"
            "assert not any(m == 'horovod' or m.startswith('horovod.') for m in sys.modules)\n"
            "print('ok', tfkfac.__version__)\n")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join([REPO_ROOT] + sys.path))
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env=env, timeout=120)
        self.assertEqual(result.returncode, 0, msg=result.stderr[-3000:])
        self.assertEqual(result.stdout.split(), ["ok", tfkfac.__version__])

    def test_installed_metadata_leaves_tensorflow_to_the_user(self):
        # The editable install's metadata, built from pyproject.toml by tools/bootstrap.sh.
        metadata = importlib.metadata.metadata("tfkfac")
        requires = metadata.get_all("Requires-Dist")
        unconditional = [r for r in requires if "extra ==" not in r]
        self.assertFalse([r for r in unconditional if r.lower().startswith("tensorflow")],
                         msg=requires)
        self.assertIn("keras<3.16,>=3.14", unconditional)
        self.assertIn('tensorflow-cpu<2.22,>=2.16; extra == "cpu"', requires)
        self.assertIn('tensorflow[and-cuda]<2.22,>=2.16; extra == "gpu"', requires)
        self.assertIn('horovod==0.28.1; extra == "horovod"', requires)
        self.assertEqual(sorted(metadata.get_all("Provides-Extra")), ["cpu", "gpu", "horovod"])
        self.assertEqual(metadata["Requires-Python"], ">=3.11")
        self.assertEqual(metadata["License-Expression"], "Apache-2.0")
        self.assertEqual(metadata.get_all("License-File"), ["LICENSE"])
        self.assertIn("Programming Language :: Python :: 3.11", metadata.get_all("Classifier"))

    def test_wheel_ships_every_tfkfac_subpackage_and_nothing_else(self):
        # pipelines/ and trainers/ stay in the repository (docs/development.md, "Repository layout"); a
        # tfkfac directory of modules without __init__.py would silently miss the wheel.
        find = read_pyproject()["tool"]["setuptools"]["packages"]["find"]
        root = package_root(tfkfac)
        shipped = set(setuptools.find_packages(where=root, **find))
        with_modules = {os.path.relpath(directory, root).replace(os.sep, ".")
                        for directory, _, files in os.walk(os.path.join(root, "tfkfac"))
                        if "__pycache__" not in directory and any(
                            f.endswith(".py") for f in files)}
        self.assertEqual(shipped, with_modules)
        self.assertLessEqual(set(PACKAGES), shipped)
        self.assertFalse(shipped & set(REPOSITORY_PACKAGES))


if __name__ == "__main__":
    absltest.main()
