"""The engine a training run is distributed over (`--distribution`): its tf.distribute
strategy, its communicator, and this process's part of the data.

- none: one process.
- horovod: one rank per process under horovodrun (tfkfac's Horovod communicator).
- mirrored: `tf.distribute.MirroredStrategy` over this machine's GPUs (one replica on a
  machine without one).
- multi_worker: `tf.distribute.MultiWorkerMirroredStrategy`, one process per worker, each
  with its `TF_CONFIG` (`python -m trainers.launch --engine=multi_worker` writes them on
  one host).
- auto: horovod when launched by horovodrun or mpirun, multi_worker when `TF_CONFIG` is
  set, else none.
A rank is one replica; a process feeds its replicas from its own shard of the data,
`replicas_per_process` batches per step, as a Horovod rank feeds itself.

Multi-worker start-up has a deadline (`--startup_timeout_seconds`). Workers meet in
TensorFlow's coordination service, hosted by the chief (else worker 0); it is configured
here as MultiWorkerMirroredStrategy would configure it, but with every task registering
through a barrier that times out: then each waiting worker gets TensorFlow's
DeadlineExceededError, which names the tasks missing (or the host of the service that
did not answer). A worker that stops after joining is found by the service's heartbeats
(seconds), which abort the collectives of the others. Each of these, and a port another
process holds, ends the worker with a `StartupError` naming the worker(s) with their
addresses from `TF_CONFIG`. Nothing is armed once the workers have met: a slow healthy
run is never cut.
"""

import atexit
import contextlib
import dataclasses
import json
import os
import re
import socket
import sys

import tensorflow as tf
from tensorflow.python.eager import context as eager_context

from tfkfac import distributed, validation
from trainers import errors

DISTRIBUTIONS = ("auto", "none", "horovod", "mirrored", "multi_worker")
_COMMUNICATORS = {"none": "single", "horovod": "horovod", "mirrored": "strategy",
                  "multi_worker": "strategy"}
# Seconds every worker named in TF_CONFIG has to join (`--startup_timeout_seconds`).
DEFAULT_STARTUP_TIMEOUT_SECONDS = 300.0
MAX_STARTUP_TIMEOUT_SECONDS = 7 * 24 * 3600.0
# The task types MultiWorkerMirroredStrategy trains with, in TensorFlow's order.
_WORKER_JOBS = ("chief", "worker")
_CLUSTER_EXAMPLE = '{"worker": ["host0:port", "host1:port"]}'
_TASK_EXAMPLE = '{"type": "worker", "index": 0}'
# A task in TensorFlow's messages: /job:worker/replica:0/task:1 or /job:worker/task:1.
_TASK_NAME = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")


class StartupError(errors.RunError):
    """The workers of a multi-worker run did not all come up, or one stopped early."""


def _startup_error(message):
    """A `StartupError` of `message` ("multi-worker start-up: " first). TensorFlow's
    distributed runtime, once failed, logs the failure again as the process exits, after
    the line the trainer prints last: this process's stderr (file descriptor 2, where
    TensorFlow's native log goes) is muted at exit."""
    atexit.register(_mute_stderr)
    return StartupError(f"multi-worker start-up: {message}")


def _mute_stderr():
    sys.stderr.flush()
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 2)


def resolve(distribution):
    """The engine `distribution` names here ("auto" resolved from the environment)."""
    if distribution != "auto":
        return distribution
    if distributed.launched_world_size() > 1:
        return "horovod"
    return "multi_worker" if os.environ.get("TF_CONFIG") else "none"


def check(config, explicitly_set=()):
    """ValueError for engine settings of `config` (a TrainConfig) that cannot train: a
    plain optimizer under multi_worker, a bad TF_CONFIG, a start-up deadline out of range
    or given where there is no multi-worker start-up."""
    name = resolve(config.distribution)
    if name == "multi_worker" and config.optimizer != "kfac":
        raise ValueError(
            f"distribution=multi_worker trains optimizer=kfac only: Keras 3's own fit fails "
            f"under MultiWorkerMirroredStrategy (keras-team/keras#20585), which K-FAC's "
            f"train step works around; for optimizer={config.optimizer} use "
            "distribution=horovod, or a custom training loop")
    validation.finite_number("startup_timeout_seconds", config.startup_timeout_seconds, 0,
                             MAX_STARTUP_TIMEOUT_SECONDS, low_open=True)
    if _joins_workers(name):
        Cluster.from_environment()
    elif "startup_timeout_seconds" in explicitly_set:
        raise ValueError(
            "startup_timeout_seconds applies to the start-up of distribution=multi_worker "
            f"with TF_CONFIG naming the workers, not distribution={name}"
            + (" without TF_CONFIG (one local worker)" if name == "multi_worker" else ""))


def _joins_workers(name):
    """Whether engine `name` starts by joining the workers TF_CONFIG names (without it,
    MultiWorkerMirroredStrategy is one local worker)."""
    return name == "multi_worker" and bool(os.environ.get("TF_CONFIG"))


@dataclasses.dataclass(frozen=True)
class Cluster:
    """TF_CONFIG, checked: the workers' addresses by task type, and this process's task."""

    jobs: dict  # task type -> addresses ("host:port"), in index order
    task_type: str
    task_index: int

    @classmethod
    def from_environment(cls):
        """The cluster `TF_CONFIG` describes; ValueError naming TF_CONFIG and what is wrong."""
        try:
            config = json.loads(os.environ.get("TF_CONFIG", ""))
        except json.JSONDecodeError as error:
            raise ValueError(f"TF_CONFIG is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f'TF_CONFIG must be a JSON object with "cluster" and "task", '
                             f"got {json.dumps(config)[:100]}")
        for key, example in (("cluster", _CLUSTER_EXAMPLE), ("task", _TASK_EXAMPLE)):
            if key not in config:
                raise ValueError(f'TF_CONFIG has no "{key}" (e.g. "{key}": {example})')
        return cls(_checked_jobs(config["cluster"]), *_checked_task(config["task"],
                                                                    config["cluster"]))

    @property
    def tasks(self):
        """Every (task type, index) of the cluster."""
        return [(job, index) for job in _WORKER_JOBS
                for index in range(len(self.jobs.get(job, ())))]

    @property
    def task(self):
        """This process's (task type, index)."""
        return self.task_type, self.task_index

    @property
    def leader(self):
        """The task hosting the coordination service: the chief, else worker 0."""
        return self.tasks[0]

    def describe(self, tasks):
        """"worker 1 (host:port)" for each (type, index) of `tasks`, joined."""
        return ", ".join(f"{job} {index} ({self.jobs[job][index]})" for job, index in tasks)

    def named_in(self, message):
        """The tasks of this cluster, other than this process's, that a TensorFlow error
        `message` names, in order."""
        found = []
        for job, index in _TASK_NAME.findall(message):
            task = (job, int(index))
            if task in self.tasks and task != self.task and task not in found:
                found.append(task)
        return found


def _checked_jobs(cluster):
    """TF_CONFIG's "cluster" as {task type: [address]}; ValueError unless it names chief and
    worker tasks only, each at a "host:port" address."""
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(f'TF_CONFIG\'s "cluster" must map task types to addresses, e.g. '
                         f"{_CLUSTER_EXAMPLE}; got {json.dumps(cluster)[:100]}")
    for job, addresses in cluster.items():
        if job not in _WORKER_JOBS:
            raise ValueError(f'TF_CONFIG\'s "cluster" has task type "{job}": the trainer\'s '
                             f"MultiWorkerMirroredStrategy runs {' and '.join(_WORKER_JOBS)} "
                             "tasks only")
        if not (isinstance(addresses, list) and addresses and all(
                isinstance(address, str) and _port(address) for address in addresses)):
            raise ValueError(f'TF_CONFIG\'s "cluster" must list each task type\'s "host:port" '
                             f"addresses, e.g. {_CLUSTER_EXAMPLE}; got \"{job}\": "
                             f"{json.dumps(addresses)[:100]}")
    if len(cluster.get("chief", ())) > 1:
        raise ValueError(f'TF_CONFIG\'s "cluster" names {len(cluster["chief"])} chiefs; there '
                         "is at most one (the others are workers)")
    return {job: list(addresses) for job, addresses in cluster.items()}


def _checked_task(task, cluster):
    """TF_CONFIG's "task" as (type, index); ValueError unless it is a task of `cluster`."""
    if not isinstance(task, dict) or not {"type", "index"} <= set(task):
        raise ValueError(f'TF_CONFIG\'s "task" must be this process\'s task, e.g. '
                         f"{_TASK_EXAMPLE}; got {json.dumps(task)[:100]}")
    job, index = task["type"], task["index"]
    if job not in cluster:
        raise ValueError(f'TF_CONFIG\'s "task" has type {json.dumps(job)}, which its "cluster" '
                         f"does not list (it lists {', '.join(cluster)})")
    if not isinstance(index, int) or isinstance(index, bool) \
            or not 0 <= index < len(cluster[job]):
        raise ValueError(f'TF_CONFIG\'s "task" has index {json.dumps(index)}; its "cluster" '
                         f"lists {len(cluster[job])} {job} task(s), index 0 to "
                         f"{len(cluster[job]) - 1}")
    return job, index


def _port(address):
    """The port of "host:port", or None if `address` has none."""
    host, _, port = address.rpartition(":")
    return int(port) if host and port.isdigit() and 0 < int(port) < 65536 else None


def _join_workers(timeout_seconds):
    """This worker's MultiWorkerMirroredStrategy once every worker of TF_CONFIG has joined;
    `StartupError` when one has not within `timeout_seconds`, or this worker's port is
    held by another process."""
    cluster = Cluster.from_environment()
    me = cluster.describe([cluster.task])
    _configure_coordination(cluster, timeout_seconds)
    try:
        return tf.distribute.MultiWorkerMirroredStrategy()
    except tf.errors.DeadlineExceededError as error:
        message = str(error)
        # The service names the tasks its barrier waited for; a worker whose registration
        # got no answer names the service's host.
        stragglers = re.search(r"timed out task names:((?:\s*/job:\S+)+)", message)
        missing = cluster.named_in(stragglers.group(1) if stragglers else message)
        missing = missing or [task for task in cluster.tasks if task != cluster.task]
        raise _startup_error(
            f"{cluster.describe(missing)} did not join within {timeout_seconds:g} s "
            f"(--startup_timeout_seconds): not started, stopped before joining (see its "
            f"output), or not reachable at that address; this is {me}") from None
    except tf.errors.UnknownError as error:
        port = _port(cluster.jobs[cluster.task_type][cluster.task_index])
        if _port_taken(port):
            raise _startup_error(
                f"port {port} of this worker, {me}, is held by another process: free it, or "
                f"give this worker another address in every worker's TF_CONFIG") from None
        raise _startup_error(f"{me} could not start: {str(error).splitlines()[0]}") from None


def _configure_coordination(cluster, timeout_seconds):
    """TensorFlow's coordination service as MultiWorkerMirroredStrategy sets it up, but every
    task registers through a barrier that times out after `timeout_seconds` (without one, a
    task waits for a missing one forever)."""
    leader_job, leader_index = cluster.leader
    eager_context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader_job}/replica:0/task:{leader_index}",
        cluster_register_timeout_in_ms=int(timeout_seconds * 1000))
    config = eager_context.context().coordination_service
    config.cluster_register_with_barrier = True
    for job, addresses in cluster.jobs.items():
        config.coordinated_job_list.add(name=job, num_tasks=len(addresses))


def _port_taken(port):
    """Whether another process holds `port` (TensorFlow's server listens on every address)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


@contextlib.contextmanager
def reporting_lost_workers(when):
    """Inside, under TF_CONFIG, a worker that stopped (the heartbeats of TensorFlow's
    coordination service abort the others' collectives: UnavailableError) ends this
    worker with a `StartupError` naming it, `when` saying at what point."""
    try:
        yield
    except tf.errors.UnavailableError as error:
        if not os.environ.get("TF_CONFIG"):
            raise
        cluster = Cluster.from_environment()
        lost = cluster.named_in(str(error))
        raise _startup_error(
            f"{cluster.describe(lost) if lost else 'a worker'} stopped {when}: see its output "
            f"for why; this is {cluster.describe([cluster.task])}") from None


_STRATEGIES = {}  # engine name -> its strategy, one per process (see `_strategy`)


def _strategy(name, startup_timeout_seconds):
    """The strategy of engine `name`, made once per process (MultiWorkerMirroredStrategy may
    be created only once: later calls get the first one, whatever their deadline)."""
    if name not in _STRATEGIES:
        _STRATEGIES[name] = (
            _join_workers(startup_timeout_seconds) if _joins_workers(name) else
            tf.distribute.MultiWorkerMirroredStrategy() if name == "multi_worker" else
            tf.distribute.MirroredStrategy() if name == "mirrored" else
            tf.distribute.get_strategy())
    return _STRATEGIES[name]


class Engine:
    """The run's strategy (the default one for none/horovod) and communicator; build the
    model and optimizer inside `strategy.scope()`. Under multi_worker, making the first
    Engine of a process waits (up to `startup_timeout_seconds`) for every worker.
    `hierarchical`: the communicator takes means within nodes, then across them
    (`--hierarchical_reduction`; a ValueError where the job has one level)."""

    def __init__(self, distribution, startup_timeout_seconds=DEFAULT_STARTUP_TIMEOUT_SECONDS,
                 hierarchical=False):
        validation.one_of(DISTRIBUTIONS)("distribution", distribution)
        self.name = resolve(distribution)
        self.strategy = _strategy(self.name, startup_timeout_seconds)
        # The communicator's variables are the first collective every worker answers.
        with self.strategy.scope(), reporting_lost_workers("after joining, during start-up"):
            self.communicator = distributed.get_communicator(_COMMUNICATORS[self.name],
                                                             hierarchical)
        local = len(self.communicator.local_ranks)
        self.replicas_per_process = local
        self.process_index = self.communicator.local_ranks[0] // local
        self.processes = self.communicator.size // local

    def distribute(self, dataset, per_replica_batch):
        """`dataset` (this process's batches, `replicas_per_process` x `per_replica_batch`
        examples each) as `fit` takes it: each replica gets its part of every batch."""
        if self.name in ("none", "horovod"):
            return dataset
        # Batches stay on the host until a step takes them: fetched ahead to the devices,
        # they would be counted as trained (pipelines.counters) before they are.
        return self.strategy.distribute_datasets_from_function(
            lambda context: dataset.rebatch(per_replica_batch)
            if self.replicas_per_process > 1 else dataset,
            options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
