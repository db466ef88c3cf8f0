"""Writes docs/arguments.md from `tfkfac.KFACConfig`, where every K-FAC setting is declared.

    .venv/bin/python tools/write_arguments_doc.py      # after adding or changing a setting

tests/test_docs.py fails while the file differs from what this writes.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "arguments.md")
HEADER = """# K-FAC's settings

Generated from `tfkfac.KFACConfig` by `tools/write_arguments_doc.py`; do not edit by hand.
Each is an argument of `tfkfac.KFAC(...)` and a field of `tfkfac.KFACConfig(...)`, and the
trainer flag beside it sets it for `python -m trainers.train --optimizer=kfac`, with the
same default. The defaults, with KFAC's default inner optimizer `tfkfac.ScheduleFreeAdamW`,
are the configuration the benchmarks judge ([guide.md](guide.md#the-default));
that optimizer's `learning_rate` (the one number to tune: start at 0.01, about 1-2x the rate
ScheduleFreeAdamW alone takes), `momentum` (its β1, 0.9) and `weight_decay` (None) are
arguments of `tfkfac.KFAC` too. Evaluate and export at its averaged weights
(`tfkfac.AveragedWeights`).
"""


def contents():
    sys.path.insert(0, ROOT)
    from tfkfac import config  # noqa: E402  (after the path: runs from a checkout)
    renamed = ", ".join(f"`{old}` is `{new}`" for old, new in config.RENAMED.items())
    return (f"{HEADER}Renamed arguments still work, with a `DeprecationWarning`: {renamed}.\n\n"
            + config.markdown_table())


if __name__ == "__main__":
    with open(PATH, "w", encoding="utf-8") as out:
        out.write(contents())
    print(f"wrote {PATH}")
