"""The ending every benchmark shares: its report as JSON and its plot as PNG in one
directory, stamped with the machine and the library commit they were measured on, so a
figure quoted in the docs can be traced to the code and the conditions behind it."""

import json
import os
import platform
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
# The code a measurement depends on; commits that touch only docs or bench/ do not
# change what was measured.
MEASURED_CODE = ("tfkfac", "trainers", "pipelines")


def machine():
    """Where the measurement runs; call at the start (the load average is part of it)."""
    import tensorflow as tf  # here, so the distributed benchmark's launcher stays TF-free

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "tensorflow": tf.__version__,
            "load_average_at_start": os.getloadavg()}


def library_commit():
    """The last commit that changed the measured code ("+dirty" with uncommitted changes)."""
    def git(*args):
        return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True,
                              text=True, check=False).stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", *MEASURED_CODE) or "unknown"
    dirty = git("status", "--porcelain", "--", *MEASURED_CODE)
    return commit + ("+dirty" if dirty else "")


def write(report, output_dir, name, plot):
    """Writes `name`.json (the report, with the machine's load at the end) and
    `name`.png (drawn by `plot(report, path)`)."""
    report.setdefault("machine", {})["load_average_at_end"] = os.getloadavg()
    report.setdefault("library_commit", library_commit())
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, f"{name}.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(output_dir, f"{name}.png"))
    print(f"wrote {json_path} and {name}.png", flush=True)
