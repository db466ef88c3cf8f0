#!/usr/bin/env bash
# Idempotent environment bootstrap: Debian packages, .venv with pinned TensorFlow/TFDS,
# Horovod built from source against that TensorFlow, then the project itself (editable
# tfkfac, plus the checkout on sys.path for this repository's pipelines/ and trainers/).
# Safe to run again: finished steps are detected and skipped (a no-op run takes ~1 s).
# Non-interactive, so it runs unattended in CI (no stdin, CI=true).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
HOROVOD_VERSION="0.28.1"
# g++/make/python3-dev build Horovod; python3-venv provides ensurepip for the venv.
APT_PACKAGES=(bazel-bootstrap dataset-fashion-mnist libopenmpi-dev openmpi-bin cmake
              g++ make python3-dev python3-venv)
PIP_PACKAGES=(
  "tensorflow-cpu==2.21.0"
  "tensorflow-datasets==4.9.10"
  "importlib_resources"
  "absl-py"
  "numpy"
  "scipy"
  "matplotlib"
  "setuptools"
  "wheel"
  "build"
  # `make docs`: the newest Sphinx that supports Python 3.11.
  "sphinx==9.0.4"
)
PIP_STAMP="$VENV/.tfkfac-pip-stamp"
PROJECT_STAMP="$VENV/.tfkfac-project-stamp"
HOROVOD_STAMP="$VENV/.tfkfac-horovod-stamp"
export TF_CPP_MIN_LOG_LEVEL=2

step() { printf '[bootstrap] %s\n' "$*"; }

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# pip with the noise of this machine's extra package indexes filtered out; pip's own
# exit status is kept (pipefail).
pip_quiet() {
  "$PY" -m pip "$@" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" \
                                      -e "BuildBackendWarning" \
                                      -e "Please be careful with folders" \
                                      -e "name as your package as they may take precedence" \
                                      -e "warnings.warn(msg, InformationOnly)" \
                                      -e "with strategy, WheelFile" -e '^ *!!$' -e '^ *[*]\{20,\}$' \
                                      -e '^ *$' || true; }
}

# 1. Debian packages.
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  step "apt: installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
else
  step "apt: all of ${APT_PACKAGES[*]} present"
fi

# 2. Virtual environment with pinned Python packages.
if [ ! -x "$PY" ]; then
  step "venv: creating $VENV"
  python3 -m venv "$VENV"
fi
# `python` (not only python3) is needed by Bazel's py launcher.
[ -e "$VENV/bin/python" ] || ln -s python3 "$VENV/bin/python"
wanted="$(printf '%s\n' "${PIP_PACKAGES[@]}" | sha1sum | cut -c1-12)"
if [ "$(cat "$PIP_STAMP" 2>/dev/null)" != "$wanted" ]; then
  step "pip: installing ${PIP_PACKAGES[*]}"
  pip_quiet install -q --upgrade pip
  pip_quiet install -q "${PIP_PACKAGES[@]}"
  echo "$wanted" > "$PIP_STAMP"
else
  step "pip: pinned packages present"
fi

# 3. Horovod from source against the installed TensorFlow (Gloo + MPI, CPU ops on Gloo).
#    Verified by importing it once after the build; the stamp (Horovod version + pinned
#    packages) spares later runs the ~5 s TensorFlow import.
horovod_ok() {
  "$PY" - <<PYEOF 2>/dev/null
import horovod, horovod.tensorflow as hvd
assert horovod.__version__ == "$HOROVOD_VERSION" and hvd.gloo_built() and hvd.mpi_built()
PYEOF
}
horovod_wanted="$HOROVOD_VERSION $wanted"
horovod_libs=("$VENV"/lib/python3*/site-packages/horovod/tensorflow/mpi_lib*.so)
if [ "$(cat "$HOROVOD_STAMP" 2>/dev/null)" = "$horovod_wanted" ] && [ -f "${horovod_libs[0]}" ]; then
  step "horovod: $HOROVOD_VERSION present with Gloo and MPI"
elif horovod_ok; then
  echo "$horovod_wanted" > "$HOROVOD_STAMP"
  step "horovod: $HOROVOD_VERSION present with Gloo and MPI (verified by import)"
else
  step "horovod: building $HOROVOD_VERSION from source (~3 min on 2 cores)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  pip_quiet download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  # xla_mpi_ops.cc needs XLA headers that TF >= 2.19 wheels no longer ship; it only
  # matters for GPU builds, so compile its body only when HAVE_GPU is defined.
  xla="$src/horovod/tensorflow/xla_mpi_ops.cc"
  { echo "#if HAVE_GPU  // tfkfac bootstrap: CPU builds compile this file empty"
    cat "$xla"
    echo "#endif  // HAVE_GPU"; } > "$xla.new"
  mv "$xla.new" "$xla"
  # Debian's cmake (3.25) builds it; CMake >= 4 (e.g. PyPI's) rejects Gloo's
  # cmake_minimum_required < 3.5 unless told the policy floor.
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
    pip_quiet install -q --no-build-isolation --no-cache-dir "$src"
  horovod_ok || { step "horovod: import failed or built without Gloo/MPI"; exit 1; }
  echo "$horovod_wanted" > "$HOROVOD_STAMP"
  step "horovod: built and verified (gloo_built() and mpi_built() are True)"
fi

# 4. The project itself, editable. Re-installed when pyproject.toml, the version or the
#    checkout path changes (a venv reused from another clone would otherwise import that
#    clone). The pinned packages above are its [cpu] extra, so --no-deps. The build runs
#    isolated: pyproject.toml needs setuptools >= 77, while .venv keeps the setuptools
#    that Horovod was built with. The wheel ships tfkfac only; a .pth puts the checkout on
#    sys.path so that pipelines/ and trainers/ (and tests' helpers) import from any
#    directory, as they did when they were part of the package.
project="$({ cat "$ROOT/pyproject.toml"; grep "^__version__" "$ROOT/tfkfac/__init__.py"; } | sha1sum | cut -c1-12) $ROOT"
checkout_pth="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tfkfac-checkout.pth"
if [ "$(cat "$PROJECT_STAMP" 2>/dev/null)" != "$project" ] || [ "$(cat "$checkout_pth" 2>/dev/null)" != "$ROOT" ]; then
  step "pip: installing the project (pip install -e $ROOT[cpu]; $checkout_pth)"
  echo "$ROOT" > "$checkout_pth"
  pip_quiet install -q --no-deps -e "$ROOT[cpu]"
  echo "$project" > "$PROJECT_STAMP"
else
  step "pip: project installed (editable, $ROOT)"
fi
step "done"
