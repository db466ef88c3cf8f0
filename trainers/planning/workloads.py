"""What one worker computes in a step, from the real model: what the library's blocks and
methods say their work costs (tfkfac/costs.py), grouped by phase.

A model is one of the trainer's models, a `keras.applications` name or a saved `.keras`
file. Its geometry is recorded once at a small batch (the recorder holds every managed
layer's activations) and scaled to the worker's batch (`floor_model.at_batch`); the
blocks are `tfkfac.blocks.discover`'s, so the factor shapes, packing and owners below
are the optimizer's own.
"""

import dataclasses
import functools
import math
import os
import zipfile
from typing import Optional

import keras

from trainers.planning import floor_model
from pipelines import idx_dataset
from tfkfac import KFACConfig, blocks as blocks_lib, keras_integration
from tfkfac import methods as methods_lib
from tfkfac.attachment import running_statistics
from trainers import models

WEIGHT_SHARING = blocks_lib.WEIGHT_SHARING
PRECISIONS = {"float32": 4, "mixed": 2}  # itemsize of the forward/backward's activations
# The trainer's default dataset (Fashion-MNIST) for its models; ImageNet for applications.
TRAINER_INPUT, TRAINER_CLASSES = (idx_dataset.IMAGE_SIZE, idx_dataset.IMAGE_SIZE, 1), 10
APPLICATION_INPUT, APPLICATION_CLASSES = (224, 224, 3), 1000
RECORDING_BATCH = 1


def application_names():
    """{lowercase name: constructor} of the `keras.applications` models."""
    return {name.lower(): builder for name, builder in vars(keras.applications).items()
            if callable(builder) and name[:1].isupper()}


def model_names():
    return sorted(models.MODEL_NAMES) + sorted(application_names())


def load_model(name, input_shape=None, classes=None):
    """The Keras model `name`: a trainer model, a `keras.applications` name (untrained)
    or the path of a saved `.keras` file. Raises ValueError naming the allowed values."""
    if name.endswith(".keras"):
        _check_keras_file(name)
        try:
            return keras.saving.load_model(name, compile=False)
        except (TypeError, ValueError, KeyError, OSError) as error:  # e.g. a custom layer
            raise ValueError(f"--model: cannot load {name}: {error}") from None
    if name in models.MODEL_NAMES:
        return models.build_model(name, input_shape or TRAINER_INPUT, classes or TRAINER_CLASSES)
    applications = application_names()
    if name.lower() in applications:
        return applications[name.lower()](weights=None,
                                          input_shape=input_shape or APPLICATION_INPUT,
                                          classes=classes or APPLICATION_CLASSES)
    raise ValueError(f"--model must be a path ending in .keras or one of "
                     f"{', '.join(model_names())}; got {name!r}")


def _check_keras_file(path):
    """Refuses `path` unless it is a zip archive holding config.json (what a `.keras`
    file is), naming it: Keras says "File not found" for a damaged one."""
    if not os.path.isfile(path):
        raise ValueError(f"--model: no saved model at {path}")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(f"--model: {path} is not a .keras file (not a zip archive: "
                         f"{error})") from None
    if "config.json" not in names:
        raise ValueError(f"--model: {path} is not a .keras file (no config.json in the "
                         "archive)")


@dataclasses.dataclass
class Workload:
    """One worker's step of `name` at `batch` examples.

    geometries[rule]: {block path: its `Block.cost`} under weight-sharing `rule`;
    blocks[rule]: the library's blocks in the same order; attention: MultiHeadAttention's
    weightless products; skipped: layers on the plain gradient (their forward products are
    not counted); uncounted_products: those of them with a weight matrix (a weight with
    two or more dimensions above 1: an LSTM's kernels), whose products the forward/backward
    would miss, unlike elementwise weights (a scale, a bias); running_statistics: elements
    averaged with the gradients by K-FAC; activation_elements: per example, the elements
    of the tensors the forward pass makes and the backward pass reads (`activations`), or
    None for a model without a functional graph.
    """

    name: str
    batch: int
    geometries: dict
    blocks: dict
    attention: list
    trainable_parameters: int
    running_statistics: int
    skipped: list
    uncounted_products: list
    activation_elements: Optional[int] = None

    def at_batch(self, batch):
        """This workload at `batch` examples per worker (a multiple of this one's)."""
        if batch % self.batch:
            raise ValueError(f"batch {batch} is not a multiple of {self.batch}")
        scaled = {rule: floor_model.at_batch(g, self.attention, batch // self.batch)
                  for rule, g in self.geometries.items()}
        return dataclasses.replace(
            self, batch=batch, geometries={rule: g for rule, (g, _) in scaled.items()},
            attention=scaled["expand"][1])

    def forward_backward(self, precision):
        itemsize = PRECISIONS[precision]
        kernels = [k for g in self.geometries["expand"].values()
                   for k in g.forward_kernels(itemsize)]
        return kernels + [floor_model.Kernel(k.kind, k.flops, k.bytes * itemsize / 4)
                          for k in self.attention]

    def update(self):
        return floor_model.update_kernels(self.trainable_parameters)

    def activation_bytes(self, precision):
        """Bytes of one worker's activations at this batch in `precision` (0 if unknown)."""
        return self.batch * (self.activation_elements or 0) * PRECISIONS[precision]

    def statistics(self, rule, fraction=1.0):
        """Per block, its factor statistics' kernels under weight-sharing `rule`, read
        from `fraction` of the batch's examples (`factor_batch_fraction`)."""
        return [g.statistics_kernels(fraction) for g in self.geometries[rule].values()]

    def decompositions(self, method):
        """Per block, the kernels of `method`'s decompositions of its full factors (in
        `symmetric_factors()` order)."""
        return [[k for ks in floor_model.decomposition_kernels(g, method) for k in ks]
                for g in self.geometries["expand"].values()]

    def decomposition_elements(self, method):
        """Per block, the elements of `method`'s stored decomposition of each full factor."""
        return [floor_model.decomposition_elements(g, method)
                for g in self.geometries["expand"].values()]

    def preconditioning(self, method):
        """Per block, `method`'s preconditioning kernels."""
        return [floor_model.precondition_kernels(g, method)
                for g in self.geometries["expand"].values()]

    def method_state(self, method):
        """Per block, the elements of `method`'s state for it (under "owner" gathered
        with its preconditioned gradients)."""
        method = floor_model.as_method(method)
        return [sum(math.prod(shape) for shape in methods_lib.state_shapes(method, g))
                for g in self.geometries["expand"].values()]

    def managed_parameters(self):
        """Per block, the parameters it preconditions."""
        return [g.parameters for g in self.geometries["expand"].values()]

    def factor_shapes(self):
        return [s for g in self.geometries["expand"].values() for s in g.factor_shapes()]


def named(name, input_shape=None, classes=None):
    """The `Workload` of model `name` (as `load_model` builds it) at one example, once per
    process: the planner and the GPU profiles' ResNet-50 reference share it (one cache
    key however it is called; `named("resnet50")` and `named("resnet50", None, None)`
    built it twice)."""
    return _named(name, input_shape, classes)


@functools.lru_cache(maxsize=None)
def _named(name, input_shape, classes):
    return workload(load_model(name, input_shape, classes), RECORDING_BATCH, name)


def workload(model, batch, name):
    """The `Workload` of `model` at `batch` examples per worker."""
    layers = keras_integration.leaf_layers(model)
    try:
        recorded = floor_model.record_geometries_by_rule(model, RECORDING_BATCH,
                                                         WEIGHT_SHARING)
    except NotImplementedError as error:
        raise ValueError(f"--model {name}: a block cannot be priced: {error}") from None
    geometries = {rule: g for rule, (g, _, _) in recorded.items()}
    _, attention, skipped = recorded[WEIGHT_SHARING[-1]]
    blocks = {rule: blocks_lib.discover(layers, KFACConfig(weight_sharing=rule))[0]
              for rule in WEIGHT_SHARING}
    unit = Workload(
        name=name, batch=RECORDING_BATCH, geometries=geometries, blocks=blocks,
        attention=attention,
        trainable_parameters=sum(math.prod(v.shape) for v in model.trainable_variables),
        running_statistics=sum(math.prod(v.shape) for v in running_statistics(layers.values())),
        skipped=skipped,
        uncounted_products=[s["layer"] for s in skipped
                            if _has_weight_matrix(layers[s["layer"]])],
        activation_elements=activations(model))
    return unit.at_batch(batch)


def activations(model):
    """Elements per example of every tensor `model`'s forward pass makes (the input and
    each layer's output at each of its calls), which the backward pass reads: a lower
    bound of what training keeps per example. None when the model has no functional
    graph to read them from (a subclassed model)."""
    total, counted = 0, False
    for layer in model._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
        if list(layer._flatten_layers(include_self=False, recursive=False)):  # pylint: disable=protected-access
            continue  # a model or block of layers: its layers' outputs are counted
        for node in getattr(layer, "_inbound_nodes", []):
            for tensor in node.output_tensors:
                counted = True
                if all(dimension is not None for dimension in tensor.shape[1:]):
                    total += math.prod(tensor.shape[1:])
    return total if counted else None


def _has_weight_matrix(layer):
    return any(sum(int(d) > 1 for d in weight.shape) >= 2 for weight in layer.trainable_weights)
