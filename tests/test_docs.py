"""The user docs stay true to the code: the generated argument table, links, the README's
size and commands; no doc names an issue number or a commit hash."""

import glob
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

USER_DOCS = ["README.md"] + [os.path.join("docs", name) for name in
                             ("usage.md", "arguments.md", "trainer.md", "development.md",
                              "design.md", "distributed.md")]

# Users never see the issue tracker, and commit hashes mean nothing to them: a doc says
# what a thing is, and a result's provenance is the `library_commit` its JSON records.
# A hash is a token of 7-40 lowercase hex digits with at least one digit and one letter,
# so that words ("deadbeef", "facade") and plain numbers ("1281167") pass.
ISSUE_OR_COMMIT = re.compile(r"(?i:\bissues? ?[-#]?\d+\b)"
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

    def test_readme_fits_one_screen_of_text_and_names_no_issue_or_commit(self):
        readme = read("README.md")
        self.assertLessEqual(len(readme.encode()), 12 * 1024)
        self.assertNotRegex(readme, r"(?i)\bissue \d+|\b[0-9a-f]{7,40}\b")

    def test_user_docs_name_no_issue_or_commit(self):
        for text in ("issue 16's options", "Issue 16", "issue-16 target", "(issue #27)",
                     "library 3662da5", "4ba605f+dirty", "git show e9fc3d3:bench/x.py",
                     "01afd20a77b5804e0ecf1042509dd9d20ebf9e93"):
            self.assertRegex(text, ISSUE_OR_COMMIT)
        for text in ("deadbeef", "facade", "1281167 images", "1.06e-3", "0.8473",
                     "4609² factors", "keras-team/keras#20585", "reissue 3 runs"):
            self.assertNotRegex(text, ISSUE_OR_COMMIT)
        paths = ["README.md"] + sorted(
            os.path.relpath(path, REPO_ROOT)
            for path in glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))
        self.assertIn(os.path.join("docs", "benchmarks.md"), paths)
        for path in paths:
            for number, line in enumerate(read(path).splitlines(), 1):
                self.assertNotRegex(line, ISSUE_OR_COMMIT, msg=f"{path}:{number}")

    def test_readme_commands_are_the_makefile_targets_ci_runs(self):
        readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
        for target in ("train", "test"):
            self.assertIn(f"make {target} ", readme)
            self.assertRegex(makefile, rf"(?m)^{target}:")
        self.assertRegex(ci, r"(?m)^make test$")

    def test_relative_links_resolve(self):
        for path in USER_DOCS:
            for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", read(path)):
                resolved = os.path.normpath(os.path.join(CHECKOUT, os.path.dirname(path),
                                                         target))
                self.assertTrue(os.path.exists(resolved), msg=f"{path} links to {target}")


if __name__ == "__main__":
    absltest.main()
