"""The user docs (README.md and every docs/*.md) stay true to the code and short enough to
be read to the end: the generated argument table, the README's commands and examples,
links, size bounds; no doc names an issue number or a commit hash."""

import glob
import math
import os
import re
import sys

from absl.testing import absltest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Links may point at any file of the checkout (tests, results), which Bazel does not put
# in the runfiles: they are resolved in the checkout the runfiles link to.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))

import write_arguments_doc  # noqa: E402

USER_DOCS = ["README.md"] + sorted(
    os.path.relpath(path, REPO_ROOT) for path in glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))

# The docs, one of each kind: the user guide, the design notes (one numbering, §1-§14,
# which code and tests cite), development, benchmarks, and the generated settings table.
DOCS = ["docs/arguments.md", "docs/benchmarks.md", "docs/design.md", "docs/development.md",
        "docs/guide.md"]

# Bytes of UTF-8. The README is the page every user reads whole: what tfkfac is, how to
# install it, one runnable example and where to read on, about one screen of text
# (7 KiB). Every other doc is a page read to the end (32 KiB); benchmarks.md keeps each
# benchmark's headline table, command and meaning, the rest living in the results' JSONs.
SIZE_BOUNDS = {"README.md": 7 * 1024}
OTHER_DOC_BOUND = 32 * 1024
# What a newcomer reads first, the README and the guide, is read in about 30 minutes.
FIRST_READ = ["README.md", "docs/guide.md"]
FIRST_READ_BOUND = 60 * 1000
# Every hand-written page together: the docs but arguments.md, which the config writes, and
# the tables scripts write between markers ("<!-- ... -->" to "<!-- end of ... -->").
GENERATED_DOCS = ["docs/arguments.md"]
GENERATED_BLOCK = re.compile(r"<!-- (?!end of ).*?-->.*?<!-- end of .*?-->", re.S)
HAND_WRITTEN_BOUND = 107 * 1000

# Users never see the issue tracker, and commit hashes mean nothing to them: a doc says
# what a thing is, and a result's provenance is the `library_commit` its JSON records.
# An issue reference is "issue" and a number, also inside a name ("issue16_options"). A
# hash is a token of 7-40 lowercase hex digits with at least one digit and one letter, so
# that words ("deadbeef", "facade") and plain numbers ("1281167") pass.
ISSUE_OR_COMMIT = re.compile(r"(?i:\bissues?[ _-]?#?\d+)"
                             r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def read(path):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return f.read()


class DocsTest(absltest.TestCase):

    def test_arguments_doc_is_what_the_config_generates(self):
        self.assertEqual(read("docs/arguments.md"), write_arguments_doc.contents(),
                         msg="docs/arguments.md is stale: run "
                             ".venv/bin/python tools/write_arguments_doc.py")

    def test_every_setting_is_in_the_arguments_doc(self):
        import tfkfac
        table = read("docs/arguments.md")
        for field in tfkfac.config.settings():
            self.assertIn(f"| `{field.name}` |", table)

    def test_every_user_doc_stays_within_its_size_bound(self):
        for path in USER_DOCS:
            size = len(read(path).encode())
            bound = SIZE_BOUNDS.get(path, OTHER_DOC_BOUND)
            self.assertLessEqual(size, bound, msg=f"{path}: {size} bytes, bound {bound}")

    def test_the_docs_are_one_of_each_kind(self):
        self.assertEqual(USER_DOCS, ["README.md"] + DOCS)

    def test_what_a_newcomer_reads_first_stays_within_its_bound(self):
        size = sum(len(read(path).encode()) for path in FIRST_READ)
        self.assertLessEqual(size, FIRST_READ_BOUND,
                             msg=f"{' + '.join(FIRST_READ)}: {size} bytes")

    def test_the_hand_written_docs_together_stay_within_their_bound(self):
        sizes = {path: len(GENERATED_BLOCK.sub("", read(path)).encode())
                 for path in USER_DOCS if path not in GENERATED_DOCS}
        self.assertLessEqual(sum(sizes.values()), HAND_WRITTEN_BOUND, msg=str(sizes))

    def test_generated_blocks_are_told_from_hand_written_text(self):
        page = ("a\n<!-- race tables: written by x -->\n| t |\n<!-- end of race tables -->\nb\n"
                "<!-- summary: y prints it -->\n| s |\n<!-- end of summary -->\n")
        self.assertEqual(GENERATED_BLOCK.sub("", page), "a\n\nb\n\n")

    def test_issue_or_commit_pattern_tells_references_from_words(self):
        for text in ("issue 16's options", "Issue 16", "issue-16 target", "(issue #27)",
                     "bench/results/issue16_options", "library 3662da5", "4ba605f+dirty",
                     "git show e9fc3d3:bench/x.py", "01afd20a77b5804e0ecf1042509dd9d20ebf9e93"):
            self.assertRegex(text, ISSUE_OR_COMMIT)
        for text in ("deadbeef", "facade", "1281167 images", "1.06e-3", "0.8473",
                     "4609² factors", "keras-team/keras#20585", "reissue 3 runs"):
            self.assertNotRegex(text, ISSUE_OR_COMMIT)

    def test_no_user_doc_names_an_issue_or_commit(self):
        for path in USER_DOCS:
            for number, line in enumerate(read(path).splitlines(), 1):
                self.assertNotRegex(line, ISSUE_OR_COMMIT, msg=f"{path}:{number}")

    def test_readme_commands_are_the_makefile_targets_ci_runs(self):
        readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
        for target in ("train", "test"):
            self.assertIn(f"make {target} ", readme)
            self.assertRegex(makefile, rf"(?m)^{target}:")
        self.assertRegex(ci, r"(?m)^make test$")

    def test_readme_python_examples_run_in_order_and_train(self):
        """The README's Python blocks, run one after another as a reader would paste them:
        the first builds, compiles and fits its own model, the next trains it a step more."""
        blocks = re.findall(r"```python\n(.*?)```", read("README.md"), re.S)
        self.assertGreaterEqual(len(blocks), 2)
        namespace = {}
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
        history = namespace["model"].history.history
        self.assertGreater(history["val_accuracy"][-1], 0.8)
        self.assertTrue(math.isfinite(float(namespace["loss"])))

    def test_relative_links_in_every_user_doc_resolve(self):
        for path in USER_DOCS:
            for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", read(path)):
                resolved = os.path.normpath(os.path.join(CHECKOUT, os.path.dirname(path),
                                                         target))
                self.assertTrue(os.path.exists(resolved), msg=f"{path} links to {target}")


if __name__ == "__main__":
    absltest.main()
