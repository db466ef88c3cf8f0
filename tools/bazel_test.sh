#!/usr/bin/env bash
# `make test`'s runner: bazel test (extra arguments go to Bazel, default //...), then
# the per-target `N passed, M failed` line; non-zero exit if any failed or none ran.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
[ "$#" -gt 0 ] || set -- //...
bazel test --color=no --curses=no "$@" 2>&1 | tee "$log"
status="${PIPESTATUS[0]}"
python3 tools/summarize_bazel_tests.py --bazel_exit_code="$status" < "$log"
