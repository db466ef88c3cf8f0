"""The race's tables in docs/benchmarks.md (ratios and each entry's times) and its
headline in README.md (the ratios), written from bench/results/time_to_accuracy.json, so
that the pages quote what the JSON holds and nothing else (tests/test_race.py checks
that they agree).

  .venv/bin/python bench/race_tables.py   # after a race: rewrites the blocks in the pages
"""

import json
import math
import os
import statistics

import doc_blocks
from race import DEFAULT_ENTRY, NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "time_to_accuracy.json")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
BEGIN = ("<!-- race tables: written by bench/race_tables.py from "
         "bench/results/time_to_accuracy.json -->")
END = "<!-- end of race tables -->"
MODELS = {"cnn": "Small CNN", "resnet20": "ResNet-20", "vit": "ViT"}
NOT_RACED = "No model has been raced under this protocol yet."


def verdict(ratio):
    """"faster" / "slower" where the interval lies below / above 1, else "tie"."""
    if ratio["high"] < 1:
        return "faster"
    return "slower" if ratio["low"] > 1 else "tie"


# Under each ratio table: how a round where one entry missed the target counts.
RATIO_LEGEND = ("A round's ratio is 0 where only K-FAC reached the target and ∞ where "
                "only the other entry did; \"tie\" where the interval holds 1.")


def ratio_number(value):
    return "0" if value == 0 else "∞" if math.isinf(value) else f"{value:.2f}"


def ratio_cell(ratio):
    if ratio["median"] is None:
        return "neither reached"
    return (f"{ratio_number(ratio['median'])}x [{ratio_number(ratio['low'])}, "
            f"{ratio_number(ratio['high'])}], {verdict(ratio)}")


def time_cell(to_target, runs):
    reached = f"{to_target['reached']}/{len(runs)}"
    if to_target["median_time_s"] is None:
        return f"not reached ({reached})"
    return (f"{to_target['median_time_s']:.1f} s, {to_target['median_steps']:.0f} steps "
            f"({reached})")


def model_tables(model, result, headline=False):
    """`model`'s tables: its ratios, and unless `headline` each entry's times."""
    targets = [f"{target:.4f}" for target in result["targets"]]
    keys = [str(target) for target in result["targets"]]
    final = result["final_target"]
    loads = [load for runs in result["runs"].values() for run in runs
             for load in ((run.get("machine") or {}).get("load_average_before", [None])[:1])
             if load is not None]
    lines = [f"**{MODELS.get(model, model)}**: final target {final['accuracy']:.4f} "
             f"({NAMES.get(final['entry'], final['entry'])}'s median final accuracy)"
             + (f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f} before the runs"
                if loads else "") + ".", "",
             "| K-FAC's time against | " + " | ".join(f"to {t}" for t in targets) + " |",
             "|---" * (len(targets) + 1) + "|"]
    for baseline, by_target in result["ratios"].get(DEFAULT_ENTRY, {}).items():
        seeds = len(by_target[keys[0]]["time_s"]["seeds"])
        lines.append(f"| {NAMES.get(baseline, baseline)} ({seeds} rounds) | "
                     + " | ".join(ratio_cell(by_target[key]["time_s"]) for key in keys)
                     + " |")
    lines += ["", RATIO_LEGEND]
    if headline:
        return "\n".join(lines)
    lines += ["", "| entry | " + " | ".join(f"to {t}" for t in targets)
              + " | final accuracy |", "|---" * (len(targets) + 2) + "|"]
    for entry, runs in result["runs"].items():
        finals = statistics.median(run["final_accuracy"] for run in runs)
        lines.append(f"| {NAMES.get(entry, entry)} | "
                     + " | ".join(time_cell(result["to_target"][entry][key], runs)
                                  for key in keys)
                     + f" | {finals:.4f} |")
    return "\n".join(lines)


def tables(report, headline=False):
    """The block's markdown for `report` (the JSON's contents, None when absent): the
    README's `headline` or the benchmarks page's."""
    models = (report or {}).get("models", {})
    if not models:
        return NOT_RACED
    return "\n\n".join(model_tables(model, models[model], headline)
                       for model in sorted(models))


def read_report(path=RESULTS):
    """The JSON report at `path`, or None."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def block(page):
    """The race tables' block of `page` (ValueError when its markers are not there once
    each)."""
    return doc_blocks.block(page, BEGIN, END)


def write(page_path=PAGE, report=None, headline=False):
    doc_blocks.write(page_path, BEGIN, END,
                     tables(report if report is not None else read_report(), headline))


if __name__ == "__main__":
    write()
    write(README, headline=True)
