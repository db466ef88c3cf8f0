"""tf.data input pipelines: TFDS and offline IDX sources, per-rank sharding, data
echoing, augmentation, precision policy."""

from pipelines.augment import (mixup, normalize, random_crop, random_erasing, random_flip,
                               running_mixup)
from pipelines.builder import ECHO_MODES, Augmentation, build, check_arguments
from pipelines.counters import EchoCounters, EchoCountersCallback
from pipelines.echoing import echo
from pipelines.precision import PRECISIONS, set_precision
from pipelines.sources import load, shard, simulate_read_latency
