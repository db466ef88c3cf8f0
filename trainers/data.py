"""The run's input: `pipelines.build` streams for this rank, plus the facts the trainer
needs before it builds a model (image shape, class count, steps per epoch).

Each epoch's training stream is built from (seed, epoch) and is endless, and the trainer
takes the same number of steps from it on every rank; so ranks stay in lockstep even
when shards differ by an example or a fractional echo factor varies the epoch length.
"""

import os

import tensorflow as tf
import tensorflow_datasets as tfds

import pipelines
from pipelines import idx_dataset
from trainers import models


def dataset_info(name, data_dir=None, idx_dir=None):
    """TFDS metadata of `name`; the IDX datasets are prepared offline first if needed.

    Raises ValueError, saying what is wrong and how to fix it, for an unknown name, a
    `data_dir` that cannot be read or created, a TFDS dataset not prepared in `data_dir`,
    missing or damaged IDX files, or IDX files that differ from those the prepared copy
    was made from.
    """
    if data_dir is not None:
        _check_data_dir(data_dir)
    if name in idx_dataset.IDX_DATASETS:
        where = os.path.abspath(data_dir or idx_dataset.default_data_dir())
        try:
            return idx_dataset.prepare_idx(name, data_dir=data_dir, idx_dir=idx_dir).info
        except idx_dataset.IdxFilesNotFoundError as error:
            raise ValueError(str(error)) from error
        except OSError as error:  # creating data_dir, or preparing the dataset in it
            failed = os.path.abspath(error.filename or "")
            if os.path.commonpath([failed, where]) != where:
                raise
            what = ("does not exist and cannot be created" if failed == where
                    else f"cannot be used ({failed})")
            raise ValueError(f"data_dir {where} {what}: {error.strerror}; choose a directory "
                             "this user can write, or one it can create") from None
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as error:
        raise ValueError(f"dataset must be one of {', '.join(sorted(idx_dataset.IDX_DATASETS))} "
                         f"or a prepared TFDS dataset name; got {name!r}") from error
    if not builder.is_prepared():
        where = data_dir or idx_dataset.default_data_dir()
        raise ValueError(
            f"dataset {name} is not prepared in data_dir {where}: prepare it there first "
            f"(`tfds build {name} --data_dir={where}` where there is network, or copy a "
            f"prepared {name} directory into it); only {' and '.join(sorted(idx_dataset.IDX_DATASETS))} "
            "are prepared offline by the trainer itself")
    return builder.info


def _check_data_dir(data_dir):
    """ValueError naming `data_dir` if it is there but no readable directory (a file, a
    link to nothing, no permission to list it); one that does not exist yet is created
    where the dataset is prepared."""
    if os.path.islink(data_dir) and not os.path.exists(data_dir):
        raise ValueError(f"data_dir {data_dir} is a symbolic link to {os.readlink(data_dir)}, "
                         "which does not exist")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ValueError(f"data_dir {data_dir} is a file, not a directory")
    if os.path.isdir(data_dir) and not os.access(data_dir, os.R_OK | os.X_OK):
        raise ValueError(f"data_dir {data_dir} cannot be read: this user may not list it")


def split_sizes(config):
    """Returns `(info, train examples, eval examples)` of the config's dataset and splits,
    raising ValueError for an unknown dataset or a split it does not have."""
    info = dataset_info(config.dataset, config.data_dir, config.idx_dir)
    sizes = []
    for flag in ("train_split", "eval_split"):
        split = getattr(config, flag)
        try:
            size = info.splits[split].num_examples
        except (KeyError, ValueError) as error:
            raise ValueError(f"{flag} must be one of {', '.join(sorted(info.splits.keys()))} "
                             f"(or a TFDS slice of one); got {split!r}: {error}") from error
        if size <= 0:  # TFDS counts a reversed slice such as train[500:100] as negative
            raise ValueError(f"{flag} {split!r} selects no examples: it is a reversed or "
                             "empty slice ([a:b] needs a < b)")
        sizes.append(size)
    return (info, *sizes)


def check_pipeline(config, info):
    """Refuses the run's pipeline settings with the words of `pipelines.check_arguments`
    (absurd sizes: echo factor, shuffle buffer, a crop padding beyond the image, seed),
    before anything is built."""
    pipelines.check_arguments(image_shape=info.features["image"].shape,
                              **_train_arguments(config))


def _train_arguments(config):
    """`pipelines.build` arguments of a config's training stream, but rank and epoch."""
    return dict(
        split=config.train_split, batch_size=config.batch_size, seed=config.seed,
        echo_mode=config.echo_mode, echo_factor=config.echo_factor,
        shuffle_buffer=config.shuffle_buffer, read_latency=config.read_latency,
        augmentation=config.augmentation())


def steps_per_epoch(config, train_examples, num_ranks):
    """Training steps per epoch of each rank; ValueError if the batch is larger than a
    rank's share of the split."""
    examples_per_rank = train_examples // num_ranks
    steps = int(examples_per_rank * config.echo_factor) // config.batch_size
    if steps < 1:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than one rank's share "
            f"({examples_per_rank} examples x echo_factor {config.echo_factor}) of "
            f"{config.dataset} {config.train_split}")
    return steps


class TrainingData:
    """Training and evaluation streams of one rank for a `TrainConfig`."""

    def __init__(self, config, rank, num_ranks, input_dtype, sizes=None):
        """`sizes`: `split_sizes(config)` when the caller has read them (None: read here)."""
        info, self.train_examples, self.eval_examples = sizes or split_sizes(config)
        self._config = config
        self._rank = rank
        self._num_ranks = num_ranks
        self._input_dtype = input_dtype
        self._counters = None
        self.input_shape = tuple(info.features["image"].shape)
        self.num_classes = info.features["label"].num_classes
        # `Dataset.shard` gives rank r every num_ranks-th example starting at r.
        eval_examples_here = -(-(self.eval_examples - rank) // num_ranks)
        self._eval_batches = -(-eval_examples_here // config.batch_size)
        self.steps_per_epoch = steps_per_epoch(config, self.train_examples, num_ranks)
        self._autoencoder = models.is_autoencoder(config.model)
        # K-FAC's factor_examples="fresh" reads the flags from the sample-weight slot.
        self._fresh_flags = config.optimizer == "kfac" and config.factor_examples == "fresh"
        self._one_hot = config.mixup_alpha > 0  # mixup mixes one-hot labels

    def _build(self, **kwargs):
        config = self._config
        return pipelines.build(
            config.dataset, data_dir=config.data_dir, idx_dir=config.idx_dir,
            num_shards=self._num_ranks,
            shard_index=self._rank, dtype=self._input_dtype,
            num_classes=self.num_classes if self._one_hot else None, **kwargs)

    def train(self, epoch, skip_batches=0):
        """Epoch `epoch`'s training batches (then later epochs' without end), from its
        `skip_batches`-th batch on (a resumed run continuing the epoch there)."""
        dataset, self._counters = self._build(
            epoch=epoch, num_epochs=None, skip_batches=skip_batches,
            fresh_flags=self._fresh_flags, **_train_arguments(self._config))
        return self._with_targets(dataset)

    def evaluation(self):
        """The evaluation split of this rank, in order, every example once."""
        config = self._config
        dataset, _ = self._build(split=config.eval_split, batch_size=config.batch_size,
                                 shuffle_buffer=0, drop_remainder=False)
        # A known length lets Keras end evaluation without an "ran out of data" warning.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(self._eval_batches))
        return self._with_targets(dataset)

    def fresh_examples(self):
        """Fresh examples this rank's current training stream has fed to training."""
        return 0 if self._counters is None else self._counters.result()["fresh_examples"]

    def _with_targets(self, dataset):
        """Classifiers learn the labels; the autoencoder reconstructs its flattened input."""
        if not self._autoencoder:
            return dataset
        # Sequential on purpose (tf.data would parallelize this stateless map by itself):
        # a parallel map pulls batches ahead of training, and the pipeline's
        # fresh-example counters, which count batches as they are taken, with them.
        options = tf.data.Options()
        options.experimental_optimization.map_parallelization = False
        return dataset.map(
            lambda image, label, *fresh: (image, tf.reshape(tf.cast(image, tf.float32),
                                                            [tf.shape(image)[0], -1]), *fresh)
        ).with_options(options)
