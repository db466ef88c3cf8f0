"""The user docs stay true to the code: the generated argument table, links, the README's
size and commands."""

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
