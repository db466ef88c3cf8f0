"""Pins Bazel's Python toolchain to the repository's own .venv interpreter.

The interpreter path is found at fetch time from the workspace root, so a clone in any
directory uses its own .venv (made by tools/bootstrap.sh) with no machine path in the repo.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "venv_py3",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "venv_runtime_pair",
    py3_runtime = ":venv_py3",
)

toolchain(
    name = "toolchain",
    toolchain = ":venv_runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _venv_python_impl(repository_ctx):
    root = repository_ctx.path(Label("//:WORKSPACE")).dirname
    python = "%s/.venv/bin/python3" % root
    if not repository_ctx.path(python).exists:
        fail("%s does not exist: run `make bootstrap` (tools/bootstrap.sh) first." % python)
    repository_ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % repository_ctx.name)
    repository_ctx.file("BUILD", _BUILD.format(python = python))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    # Re-evaluated on every Bazel server start, so a venv made after the first build is seen.
    local = True,
    doc = "Generates a py_runtime toolchain whose interpreter is <workspace>/.venv/bin/python3.",
)
