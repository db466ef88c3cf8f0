"""Sphinx configuration of the API reference (`make docs`; docs/development.md)."""

import os
import sys

# tfkfac, pipelines and trainers import from the checkout, as in the .venv.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkfac  # noqa: E402
from sphinx.util import logging  # noqa: E402

logger = logging.getLogger(__name__)

project = "tfkfac"
release = version = tfkfac.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# The docstrings are Google style, with Markdown's `code` spans: a single-backtick span is
# code, not a cross-reference (most name variables, expressions and other files).
default_role = "literal"
napoleon_numpy_docstring = False
# "a, b: ..." stays one entry for both, not a copy of its text under each name.
napoleon_use_param = False
autodoc_member_order = "bysource"
# A Keras method tfkfac overrides without a docstring of its own is not listed with
# Keras's text (which is not reStructuredText).
autodoc_inherit_docstrings = False
# Annotations (typing.Any, keras classes) would be links to other projects' docs, which a
# build that reaches no network cannot resolve; the docstrings say what each argument is.
autodoc_typehints = "none"
html_theme = "alabaster"
html_title = f"tfkfac {release} API reference"


def _settings_as_parameters(app, what, name, obj, options, lines):
    """KFACConfig's settings keep their docs in its fields' metadata (docs/arguments.md
    is generated from them too): listed here as its parameters."""
    if name == "tfkfac.KFACConfig":
        lines.append("")
        lines.extend(f":param {field.name}: {field.metadata['doc']}"
                     for field in tfkfac.config.settings())


def _skip_keras_members(app, what, name, obj, skip, options):
    """KFAC's inherited members are CurvatureAPI's, not its Keras bases' (documented by
    Keras, in its own markup)."""
    module = getattr(getattr(obj, "fget", obj), "__module__", None) or ""
    return True if module.split(".")[0] in ("keras", "tensorflow") else None


def _check_every_export_is_documented(app, env):
    """A name `tfkfac` exports that index.rst does not document is a warning (so, under
    `make docs`'s -W, an error)."""
    objects = env.get_domain("py").objects
    for name in tfkfac.__all__:
        if name != "__version__" and f"tfkfac.{name}" not in objects:
            logger.warning("tfkfac.%s is exported but not in docs/api/index.rst", name)


def setup(app):
    app.connect("autodoc-process-docstring", _settings_as_parameters)
    app.connect("autodoc-skip-member", _skip_keras_members)
    app.connect("env-check-consistency", _check_every_export_is_documented)
