"""What every benchmark shares: the interleaved timer, the common flags, the report as
JSON and its figure as PNG, stamped with where and on what code they were measured, and
the `main` around each script's own.

The timer: this machine's cores are shared, so its load drifts during a run, and a
comparison is fair only when every configuration sees the same drift. `interleave` runs
one block of each configuration per repeat, the order reversed every other repeat
(A B C, C B A, A B C, ...), and a configuration's figure is its median over the blocks
(its minimum where the question is what the machine can do at best), with the range
beside it (`spread`).
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from absl import app, flags, logging

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
# The code a measurement depends on; commits that touch only docs or bench/ do not
# change what was measured.
MEASURED_CODE = ("tfkfac", "trainers", "pipelines")

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", RESULTS_DIR,
                    "Where the benchmark writes its <name>.json and <name>.png.")

_load_at_start = []  # the load average when `run` started the script's main


def define_repeats(default, block):
    """The common `--repeats` flag: interleaved blocks per configuration, each `block`."""
    flags.DEFINE_integer("repeats", default, f"Interleaved blocks of every configuration, "
                         f"each {block}.", lower_bound=1)


def check_among(name, values, allowed):
    """Raises ValueError naming flag `name` unless every one of `values` is in `allowed`."""
    unknown = [value for value in values if value not in allowed]
    if unknown:
        raise ValueError(f"{name} must be among {', '.join(allowed)}; got {unknown}")


def refuse_unread(module, read):
    """Raises ValueError if a flag that `module` (imported for its code) defines is set
    but is not one of `read`: the script would ignore it."""
    unread = [flag.name for flag in FLAGS.flags_by_module_dict().get(module, ())
              if flag.present and flag.name not in read]
    if unread:
        raise ValueError(f"{os.path.basename(sys.argv[0])} does not read "
                         f"{', '.join('--' + name for name in unread)} (bench/{module}.py's)")


# ---------------------------------------------------------------------------- timing
def seconds(function, *args, clock=time.perf_counter):
    """`clock`'s seconds over one call `function(*args)` (wall time by default;
    `time.process_time` for the CPU time of all this process's threads)."""
    start = clock()
    function(*args)
    return clock() - start


def interleave(blocks, repeats, warm_up=0):
    """Runs every block of `blocks` (configuration name -> callable returning the block's
    figure, or a dict of figures) `warm_up` times untimed, then `repeats` times
    interleaved: one block of each configuration per repeat, in reverse order every
    other repeat, so that drift in the machine's load hits them all alike. Returns
    configuration name -> what its timed blocks returned, in order."""
    for block in blocks.values():
        for _ in range(warm_up):
            block()
    samples = {name: [] for name in blocks}
    names = list(blocks)
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            samples[name].append(blocks[name]())
    return samples


def spread(values):
    """A configuration's figure over its blocks: min, median and max."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def by_figure(samples):
    """Blocks that return dicts of figures, as figure -> values over the blocks that
    measured it, in order."""
    figures = {}
    for sample in samples:
        for name, value in sample.items():
            figures.setdefault(name, []).append(value)
    return figures


# ---------------------------------------------------------------------------- output
def machine():
    """Where the measurement runs, with the load average when the script started."""
    import tensorflow as tf  # here, so that the distributed benchmark's launcher stays TF-free

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "tensorflow": tf.__version__,
            "load_average_at_start": (_load_at_start or [os.getloadavg()])[0]}


def library_commit():
    """The last commit that changed the measured code ("+dirty" with uncommitted changes)."""
    def git(*args):
        return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True,
                              text=True, check=False).stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", *MEASURED_CODE) or "unknown"
    dirty = git("status", "--porcelain", "--", *MEASURED_CODE)
    return commit + ("+dirty" if dirty else "")


def stamp(report):
    """Adds to `report` its provenance: the machine (with its load now, at the end), the
    library commit and the date (UTC), each unless the report has it already."""
    report.setdefault("machine", machine())["load_average_at_end"] = os.getloadavg()
    report.setdefault("library_commit", library_commit())
    report.setdefault("date", datetime.datetime.now(datetime.timezone.utc)
                      .isoformat(timespec="seconds"))
    return report


def subplots(*args, **kwargs):
    """`pyplot.subplots` drawing to files (Agg); matplotlib is imported only to plot."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot.subplots(*args, **kwargs)


def write(report, name, draw):
    """Writes `name`.json (the stamped report) and `name`.png (`save_plot`) to
    `--output_dir`."""
    stamp(report)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    json_path = os.path.join(FLAGS.output_dir, f"{name}.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    save_plot(report, name, draw)
    print(f"wrote {json_path} and {name}.png", flush=True)


def save_plot(report, name, draw):
    """Writes `name`.png to `--output_dir`: the figure `draw(report)` returns, drawn with
    `subplots`."""
    figure = draw(report)
    from matplotlib import pyplot  # imported by `subplots`

    figure.tight_layout()
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    figure.savefig(os.path.join(FLAGS.output_dir, f"{name}.png"), dpi=120)
    pyplot.close(figure)


def run(main):
    """Runs `main()` as the script's program: positional arguments are refused (nothing
    would read them), INFO logs are off (TFDS logs every dataset it opens), and the load
    average at the start is kept for the report's machine. The flags defined here are
    the script's own in its --helpshort."""
    for name in ("output_dir", "repeats"):
        if name in FLAGS:
            FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])

    def program(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}; this script takes "
                                 "flags only (--helpfull lists them)")
        logging.set_verbosity(logging.WARNING)
        _load_at_start.append(os.getloadavg())
        main()

    app.run(program)
