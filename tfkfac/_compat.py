"""The TensorFlow and Keras tfkfac supports, checked once when `tfkfac` is imported.

The wheel requires no TensorFlow (the user's own build, CPU or GPU, stays untouched), so
this is where an unsupported or missing one is caught: one ImportError naming the
versions found, the supported range and the command that installs a supported pair,
instead of an AttributeError from deep inside Keras. The ranges are the ones
`tools/wheel_check.sh` installs and trains with at both ends, and must match the
requirements in pyproject.toml (tests/test_compat.py compares them).

`TFKFAC_SKIP_VERSION_CHECK=1` lets a newer (e.g. nightly) TensorFlow or Keras through,
untested; a missing or older one still fails.
"""

import importlib.metadata
import importlib.util
import os
import re

TENSORFLOW_REQUIREMENT = ">=2.16,<2.22"
KERAS_REQUIREMENT = ">=3.14,<3.16"
SKIP_VARIABLE = "TFKFAC_SKIP_VERSION_CHECK"


def _release(version):
    """The leading numbers of a version string: "2.16.0rc1" -> (2, 16, 0); None if none."""
    match = re.match(r"\d+(\.\d+)*", version or "")
    return tuple(int(part) for part in match.group(0).split(".")) if match else None


def _bounds(requirement):
    """">=2.16,<2.22" -> ((2, 16), (2, 22))."""
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", requirement).groups()
    return _release(low), _release(high)


def in_range(version, requirement):
    """True if `version` satisfies `requirement` (">=a.b,<c.d"), pre-release tags ignored."""
    release = _release(version)
    low, high = _bounds(requirement)
    return release is not None and low <= release < high


def _tensorflow_version():
    """(version or None, why it is unusable or None); imports TensorFlow (tfkfac does anyway)."""
    try:
        import tensorflow  # pylint: disable=import-outside-toplevel
    except Exception as error:  # pylint: disable=broad-except  # reported in the message
        if isinstance(error, ModuleNotFoundError) and error.name == "tensorflow":
            return None, "not installed"
        return None, f"installed but fails to import ({type(error).__name__}: {error})"
    return getattr(tensorflow, "__version__", None), None


def _keras_version(import_it):
    """Keras's version, imported only when TensorFlow is supported (Keras 3 imports it), else
    read from its metadata."""
    if importlib.util.find_spec("keras") is None:
        return None
    if import_it:
        try:
            import keras  # pylint: disable=import-outside-toplevel
            return getattr(keras, "__version__", None)
        except Exception:  # pylint: disable=broad-except  # falls back to the metadata
            pass
    try:
        return importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:
        return None


def _tensorflow_distribution():
    """The name pip knows the installed TensorFlow by (tensorflow, tensorflow-cpu, ...)."""
    names = importlib.metadata.packages_distributions().get("tensorflow") or []
    return re.sub(r"[-_.]+", "-", names[0]).lower() if names else None


def _supported(version, requirement, skip):
    """`version` is in `requirement`; with `skip`, its lower bound is enough."""
    release = _release(version)
    return in_range(version, requirement) or (
        skip and release is not None and release >= _bounds(requirement)[0])


def _too_new(version, requirement):
    release = _release(version)
    return release is not None and release >= _bounds(requirement)[1]


def problem(tensorflow_version, tensorflow_error, keras_version, tfkfac_version, skip=False):
    """The ImportError message for these versions, or None if they are supported."""
    tensorflow_ok = _supported(tensorflow_version, TENSORFLOW_REQUIREMENT, skip)
    keras_ok = _supported(keras_version, KERAS_REQUIREMENT, skip)
    if tensorflow_ok and keras_ok:
        return None
    if tensorflow_version is None:
        command = ('pip install "tfkfac[cpu]"   (or "tfkfac[gpu]" for NVIDIA GPUs: '
                   'installs tensorflow[and-cuda])')
    else:
        # Upgrade the user's own TensorFlow distribution, never add a second flavour.
        packages = [] if tensorflow_ok else [
            f'"{_tensorflow_distribution() or "tensorflow"}{TENSORFLOW_REQUIREMENT}"']
        command = "pip install " + " ".join(packages + [f'"keras{KERAS_REQUIREMENT}"'])
    message = (f"tfkfac {tfkfac_version} needs TensorFlow {TENSORFLOW_REQUIREMENT} and Keras 3 "
               f"({KERAS_REQUIREMENT}); found TensorFlow {tensorflow_version or tensorflow_error}, "
               f"Keras {keras_version or 'not installed'}. "
               f"Install a supported pair with: {command}.")
    if _too_new(tensorflow_version, TENSORFLOW_REQUIREMENT) or _too_new(keras_version,
                                                                         KERAS_REQUIREMENT):
        message += f" Or set {SKIP_VARIABLE}=1 to try this newer, untested version."
    return message


def require_supported(tfkfac_version):
    """Raises ImportError unless a supported TensorFlow and Keras 3 are importable."""
    skip = os.environ.get(SKIP_VARIABLE) == "1"
    tensorflow_version, tensorflow_error = _tensorflow_version()
    keras_version = _keras_version(
        import_it=_supported(tensorflow_version, TENSORFLOW_REQUIREMENT, skip))
    message = problem(tensorflow_version, tensorflow_error or "of unknown version",
                      keras_version, tfkfac_version, skip)
    if message is not None:
        raise ImportError(message)
