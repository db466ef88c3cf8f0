"""The largest sizes the pipelines (and the trainer's flags of the same names) accept.

Beyond them a run does not train better, it only hangs or runs out of memory before its
first step:
- an echo factor of 100 already makes 99% of the stream repeats; example echoing tiles
  chunks of up to 256 examples e times, so memory grows with e;
- TensorFlow allocates a shuffle buffer's slots up front: 10^7 slots take 0.23 GB and
  0.6 s before the first element, 10^8 take 2.3 GB and 41 s (measured, TF 2.21); 10^7
  shuffles ImageNet-1k's 1.28 million training images whole;
- seeds are numpy's range (0 to 2^32 - 1), which Keras's seeding needs;
- read_latency simulates storage for benchmarks; a second per example is already slower
  than any disk.
The checks themselves, and their wording, are `tfkfac.validation`'s.
"""

MAX_ECHO_FACTOR = 100
MAX_SHUFFLE_BUFFER = 10_000_000
MAX_SEED = 2**32 - 1
MAX_READ_LATENCY = 1.0
