"""The installable package: imports, one consistent source tree, version, no Horovod needed."""

import importlib
import importlib.metadata
import os
import subprocess
import sys

from absl.testing import absltest

import pipelines
import tfkfac
import trainers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tfkfac", "tfkfac.blocks", "tfkfac.distributed", "pipelines", "trainers")


def package_root(module):
    """The directory holding a top-level package (symlinks resolved)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(module.__file__)))


class PackageTest(absltest.TestCase):

    def test_all_packages_import_from_one_source_tree(self):
        # Under Bazel the runfiles tree and the editable install must not mix.
        root = package_root(tfkfac)
        for name in PACKAGES:
            module = importlib.import_module(name)
            self.assertTrue(os.path.realpath(module.__file__).startswith(root + os.sep),
                            msg=f"{name} imported from {module.__file__}, not under {root}")
        self.assertEqual(package_root(pipelines), root)
        self.assertEqual(package_root(trainers), root)

    def test_version_is_pep440_and_matches_setup_py_and_installed_metadata(self):
        self.assertRegex(tfkfac.__version__, r"^\d+\.\d+\.\d+([ab]|rc|\.dev)?\d*$")
        setup_py = os.path.join(REPO_ROOT, "setup.py")
        result = subprocess.run([sys.executable, setup_py, "--version"], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.realpath(setup_py)),
                                timeout=60, check=True)
        self.assertEqual(result.stdout.strip().splitlines()[-1], tfkfac.__version__)
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

    def test_setup_py_metadata_lists_packages_and_requirements(self):
        setup_py = os.path.realpath(os.path.join(REPO_ROOT, "setup.py"))
        egg_base = self.create_tempdir().full_path
        subprocess.run([sys.executable, setup_py, "-q", "egg_info", "--egg-base", egg_base],
                       capture_output=True, text=True, cwd=os.path.dirname(setup_py),
                       timeout=60, check=True)
        egg_info = os.path.join(egg_base, "tfkfac.egg-info")
        with open(os.path.join(egg_info, "SOURCES.txt"), encoding="utf-8") as f:
            sources = f.read().split()
        for name in PACKAGES:
            self.assertIn(name.replace(".", "/") + "/__init__.py", sources)
        with open(os.path.join(egg_info, "requires.txt"), encoding="utf-8") as f:
            requires = f.read()
        self.assertRegex(requires, r"tensorflow-cpu(<2\.22,>=2\.16|>=2\.16,<2\.22)")
        self.assertRegex(requires, r"keras>=3")
        self.assertIn("[horovod]\nhorovod==0.28.1", requires)
        with open(os.path.join(egg_info, "PKG-INFO"), encoding="utf-8") as f:
            self.assertIn("Requires-Python: >=3.10", f.read())

if __name__ == "__main__":
    absltest.main()
