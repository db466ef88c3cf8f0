"""`import tfkfac` with a missing or unsupported TensorFlow/Keras fails with one clear message.

The message names the versions found, the supported range and an install command that
keeps the user's TensorFlow flavour. Fake versions: fake `tensorflow` packages on
PYTHONPATH for the real import path (subprocesses), a fake `keras` module in sys.modules
for Keras, and the message function itself for the cases in between.
"""

import importlib.machinery
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from unittest import mock

from absl.testing import absltest

import tfkfac
from tfkfac import _compat

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_RANGE = ">=2.16,<2.22"
KERAS_RANGE = ">=3.14,<3.16"


def import_tfkfac_in_subprocess(test, setup_code="", fake_tensorflow_version=None):
    """Runs `import tfkfac` in a fresh interpreter; returns (exit code, stderr)."""
    path = [REPO_ROOT] + sys.path
    if fake_tensorflow_version is not None:
        fake_root = test.create_tempdir().full_path
        os.makedirs(os.path.join(fake_root, "tensorflow"))
        with open(os.path.join(fake_root, "tensorflow", "__init__.py"), "w",
                  encoding="utf-8") as f:
            f.write(f"__version__ = {fake_tensorflow_version!r}\n")
        path.insert(0, fake_root)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(path))
    env.pop(_compat.SKIP_VARIABLE, None)
    script = textwrap.dedent(setup_code) + "import tfkfac\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300, cwd=test.create_tempdir().full_path)
    return result.returncode, result.stderr


class ImportCheckTest(absltest.TestCase):

    def assert_one_import_error(self, returncode, stderr, *expected):
        self.assertNotEqual(returncode, 0)
        last_line = stderr.strip().splitlines()[-1]
        self.assertTrue(last_line.startswith("ImportError: tfkfac "), msg=stderr[-3000:])
        self.assertNotIn("AttributeError", stderr)
        for text in expected:
            self.assertIn(text, last_line)

    def test_missing_tensorflow(self):
        # A finder that refuses `tensorflow` stands for an environment without it.
        returncode, stderr = import_tfkfac_in_subprocess(self, setup_code="""
            import sys
            class NoTensorFlow:
                def find_spec(self, name, path=None, target=None):
                    if name == "tensorflow" or name.startswith("tensorflow."):
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            sys.meta_path.insert(0, NoTensorFlow())
            """)
        self.assert_one_import_error(
            returncode, stderr, f"needs TensorFlow {TF_RANGE} and Keras 3 ({KERAS_RANGE})",
            "found TensorFlow not installed", 'pip install "tfkfac[cpu]"', '"tfkfac[gpu]"')

    def test_too_old_tensorflow_fails_before_keras_is_touched(self):
        returncode, stderr = import_tfkfac_in_subprocess(self, fake_tensorflow_version="2.15.1")
        self.assert_one_import_error(
            returncode, stderr, "found TensorFlow 2.15.1, Keras 3.",
            f"needs TensorFlow {TF_RANGE}", f'"keras{KERAS_RANGE}"')
        self.assertNotIn(_compat.SKIP_VARIABLE, stderr)

    def test_too_new_tensorflow_names_the_override(self):
        returncode, stderr = import_tfkfac_in_subprocess(
            self, fake_tensorflow_version="2.22.0-dev20260101")
        self.assert_one_import_error(returncode, stderr, "found TensorFlow 2.22.0-dev20260101",
                                     f"{_compat.SKIP_VARIABLE}=1")

    def test_old_keras_with_the_real_tensorflow(self):
        fake_keras = types.ModuleType("keras")
        fake_keras.__version__ = "3.13.0"
        fake_keras.__spec__ = importlib.machinery.ModuleSpec("keras", None)
        with mock.patch.dict(sys.modules, {"keras": fake_keras}):
            with self.assertRaises(ImportError) as raised:
                _compat.require_supported("9.9.9")
        message = str(raised.exception)
        self.assertIn("tfkfac 9.9.9 needs", message)
        self.assertIn("Keras 3.13.0", message)
        # Only Keras is wrong: the command must not reinstall TensorFlow.
        self.assertIn(f'Install a supported pair with: pip install "keras{KERAS_RANGE}".',
                      message)

    def test_supported_versions_pass(self):
        for tensorflow_version, keras_version in [("2.16.1", "3.14.0"), ("2.21.0", "3.15.1"),
                                                  ("2.16.0rc0", "3.15.0rc1")]:
            self.assertIsNone(_compat.problem(tensorflow_version, None, keras_version, "0"),
                              msg=(tensorflow_version, keras_version))
        # The running environment is supported, or tfkfac would not have imported.
        _compat.require_supported(tfkfac.__version__)

    def test_keras_above_the_tested_minor_version_names_the_override(self):
        # Keras is capped at the newest minor version tested (tfkfac installs a train step).
        message = _compat.problem("2.21.0", None, "3.16.0", "0")
        self.assertIn("found TensorFlow 2.21.0, Keras 3.16.0", message)
        self.assertIn(f'Install a supported pair with: pip install "keras{KERAS_RANGE}".',
                      message)
        self.assertIn(f"{_compat.SKIP_VARIABLE}=1", message)
        self.assertIsNone(_compat.problem("2.21.0", None, "3.16.0", "0", skip=True))

    def test_command_upgrades_the_users_own_tensorflow_flavour(self):
        # A user with the GPU `tensorflow` distribution must not be told to add tensorflow-cpu.
        with mock.patch.object(_compat, "_tensorflow_distribution", return_value="tensorflow"):
            message = _compat.problem("2.15.0", None, "2.15.0", "0.1.0")
        self.assertIn("found TensorFlow 2.15.0, Keras 2.15.0", message)
        self.assertIn(f'pip install "tensorflow{TF_RANGE}" "keras{KERAS_RANGE}"', message)
        self.assertNotIn("tensorflow-cpu", message)

    def test_override_lets_newer_versions_through_but_not_older(self):
        self.assertIsNone(_compat.problem("2.23.0", None, "4.0.0", "0", skip=True))
        self.assertIn("found TensorFlow 2.15.1",
                      _compat.problem("2.15.1", None, "3.15.1", "0", skip=True))
        self.assertIn("Keras 2.15.0", _compat.problem("2.21.0", None, "2.15.0", "0", skip=True))
        self.assertIn("Keras not installed", _compat.problem("2.21.0", None, None, "0"))

    def test_ranges_match_the_package_requirements(self):
        with open(os.path.realpath(os.path.join(REPO_ROOT, "pyproject.toml")), "rb") as f:
            project = tomllib.load(f)["project"]
        self.assertEqual((_compat.TENSORFLOW_REQUIREMENT, _compat.KERAS_REQUIREMENT),
                         (TF_RANGE, KERAS_RANGE))
        self.assertIn(f"keras{KERAS_RANGE}", project["dependencies"])
        self.assertFalse([d for d in project["dependencies"] if d.startswith("tensorflow")])
        extras = project["optional-dependencies"]
        self.assertEqual(extras["cpu"], [f"tensorflow-cpu{TF_RANGE}"])
        self.assertEqual(extras["gpu"], [f"tensorflow[and-cuda]{TF_RANGE}"])


if __name__ == "__main__":
    absltest.main()
