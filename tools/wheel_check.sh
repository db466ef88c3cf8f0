#!/usr/bin/env bash
# `make wheel-check`: the wheel, not the checkout, works for a user.
#   1. `python -m build` makes the sdist and, from it, the wheel (from a copy of the
#      tracked and new files, so nothing of the checkout's build state leaks in); both hold
#      tfkfac only (no tests/, pipelines/, trainers/) and the license, and the wheel has
#      no unconditional TensorFlow requirement.
#   2. Oldest end of the declared range: a fresh venv, `tfkfac[cpu]` with the oldest
#      tensorflow-cpu and Keras; before that, pip's plan for the bare wheel in the empty
#      venv must contain no TensorFlow distribution at all.
#   3. Newest end, as a user who already has TensorFlow: a fresh venv with tensorflow-cpu
#      (standing in for the user's own build), then the wheel with no extras; every
#      TensorFlow distribution must be exactly as before (same versions, none added).
#   In 2 and 3, tools/wheel_smoke.py imports tfkfac from site-packages and trains a tiny
#   model a few K-FAC steps with finite loss, and tests/test_keras_seam.py checks the
#   private Keras and TensorFlow names tfkfac uses (docs/design.md §15) against that
#   venv's versions (a few seconds). pip's cache is used as usual.
# Needs .venv (for `build`; `make wheel-check` bootstraps first) and PyPI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
# The ends of pyproject.toml's ranges (tfkfac/_compat.py holds the same ones).
OLDEST=("tensorflow-cpu==2.16.1" "keras==3.14.0")
NEWEST=("tensorflow-cpu==2.21.0")   # with the newest Keras pip picks for it
export TF_CPP_MIN_LOG_LEVEL=2 PIP_DISABLE_PIP_VERSION_CHECK=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
step() { printf '[wheel-check %3d s] %s\n' "$((SECONDS - started))" "$*"; }
# pip without this machine's notes about its extra (absent) local package indexes.
pip_in() {
  local venv="$1"; shift
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
# The TensorFlow distributions installed in a venv, "name==version" per line.
tensorflow_distributions() {
  "$1/bin/python" -m pip list --format=freeze 2>/dev/null |
    grep -i -E '^(tensorflow|tf-nightly|tf_nightly|intel-tensorflow)[a-z_-]*==' || true
}
# The smoke run's JSON line, then the seam test's verdict (its script's folder, not the
# checkout, is first on sys.path: tfkfac comes from the venv); the output only if either
# fails.
smoke() {
  (cd "$work" && "$1/bin/python" "$work/wheel_smoke.py" 2>"$1.stderr") ||
    { cat "$1.stderr"; exit 1; }
  (cd "$work" && "$1/bin/python" "$ROOT/tests/test_keras_seam.py" >"$1.seam" 2>&1) ||
    { cat "$1.seam"; exit 1; }
  echo "  tests/test_keras_seam.py: $(grep -E '^Ran ' "$1.seam")"
}

# 1. Build.
step "building sdist and wheel"
mkdir "$work/src" "$work/dist"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
  tar -C "$ROOT" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$work/src" -xf -
"$PY" -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 ||
  { cat "$work/build.log"; exit 1; }
wheels=("$work"/dist/tfkfac-*.whl)
sdists=("$work"/dist/tfkfac-*.tar.gz)
wheel="${wheels[0]}"
[ -f "$wheel" ] && [ -f "${sdists[0]}" ] || { step "build made no wheel or no sdist"; exit 1; }
"$PY" - "$wheel" "${sdists[0]}" <<'PYEOF'
import email, sys, tarfile, zipfile
sdist = [n.split("/", 1)[-1] for n in tarfile.open(sys.argv[2]).getnames()]
problems = [f"sdist lacks {n}" for n in ("LICENSE", "README.md", "pyproject.toml",
            "tfkfac/__init__.py") if n not in sdist]
problems += [f"sdist ships {n}" for n in sdist if n.split("/")[0] in ("pipelines", "trainers", "tests")]
names = zipfile.ZipFile(sys.argv[1]).namelist()
info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
meta = email.message_from_bytes(zipfile.ZipFile(sys.argv[1]).read(f"{info}/METADATA"))
problems += [f"missing {n}" for n in ("tfkfac/__init__.py", "tfkfac/_compat.py",
            "tfkfac/blocks/__init__.py", "tfkfac/distributed/__init__.py",
            f"{info}/licenses/LICENSE") if n not in names]
problems += [f"ships {n}" for n in names if n.split("/")[0] in ("pipelines", "trainers", "tests")]
requires = meta.get_all("Requires-Dist") or []
problems += [f"unconditional {r}" for r in requires
             if r.lower().startswith("tensorflow") and "extra ==" not in r]
if meta["License-Expression"] != "Apache-2.0":
    problems.append(f"License-Expression {meta['License-Expression']!r}")
if problems:
    sys.exit("wheel contents: " + "; ".join(problems))
print(f"  {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files; requires {'; '.join(requires)}")
PYEOF
cp "$ROOT/tools/wheel_smoke.py" "$work/wheel_smoke.py"
step "built $(cd "$work/dist" && echo *)"

# 2. Oldest supported TensorFlow and Keras, through the [cpu] extra.
phase=$SECONDS
python3 -m venv "$work/oldest"
pip_in "$work/oldest" install -q --dry-run --report "$work/plan.json" "$wheel"
"$work/oldest/bin/python" - "$work/plan.json" <<'PYEOF'
import json, sys
names = [item["metadata"]["name"] for item in json.load(open(sys.argv[1]))["install"]]
tensorflow = [n for n in names if n.lower().replace("_", "-").startswith(("tensorflow", "tf-"))]
if tensorflow:
    sys.exit(f"pip would install {tensorflow} with the bare wheel")
print(f"  the bare wheel's install plan has no TensorFlow: {', '.join(sorted(names))}")
PYEOF
pip_in "$work/oldest" install -q "$wheel[cpu]" "${OLDEST[@]}"
step "oldest: installed tfkfac[cpu] ${OLDEST[*]}"
smoke "$work/oldest"
step "oldest: passed in $((SECONDS - phase)) s"

# 3. Newest, into an environment that already has its TensorFlow.
phase=$SECONDS
python3 -m venv "$work/newest"
pip_in "$work/newest" install -q "${NEWEST[@]}"
before="$(tensorflow_distributions "$work/newest")"
pip_in "$work/newest" install "$wheel" >"$work/newest-install.log" ||
  { cat "$work/newest-install.log"; exit 1; }
grep -E "^Successfully installed" "$work/newest-install.log" || true
after="$(tensorflow_distributions "$work/newest")"
if [ "$before" != "$after" ]; then
  step "newest: installing the wheel changed TensorFlow: before [$before], after [$after]"
  exit 1
fi
step "newest: TensorFlow untouched by the wheel: $(echo $after)"
smoke "$work/newest"
step "newest: passed in $((SECONDS - phase)) s"
step "wheel check passed"
