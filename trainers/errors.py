"""The one kind of error the trainer reports as a single line instead of a traceback.

Checks before a run raise plain ValueErrors. What can only be found while running (a
damaged checkpoint or run file, a write that fails on a full or failing disk, ranks
launched with different settings) raises a `RunError`; `trainers.train` prints its
message as its last line and exits with code 1, on every rank that raised it.
"""


class RunError(ValueError):
    """A predictable failure of a run; the message names what and where, in one line."""
