"""Training binaries and the models they train."""
