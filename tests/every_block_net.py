"""A small two-input model with one layer of every K-FAC block kind, and its layouts.

Shared by the tests of grafting and `method="eigen_adam"` (test_grafting.py,
test_eigen_adam.py, test_adam_moments_saved.py) and their 2-rank Horovod job
(eigen_adam_worker.py). On a (6, 6, 2) image and 9 tokens of a 12-word vocabulary:
Conv2D, grouped Conv2D, DepthwiseConv2D, BatchNormalization (optional: its batch
statistics differ between 2 ranks and one process), SeparableConv2D, Conv2DTranspose,
then the 3x3 feature map as 9 tokens, LayerNormalization, plus an Embedding of the
tokens, EinsumDense "abc,cde->abde", a per-head EinsumDense "abcd,cde->abce" (one
Kronecker pair per head), Dense, PReLU (no block: it gets the plain gradient) and a Dense
head. Activations are tanh, so no unit is dead and, with a batch of 16, every factor
has distinct eigenvalues (eigenbases defined up to sign).

`Reference` is the numpy model of docs/design.md §11 for this net: from the factors the
optimizer reports (`KFAC.factors`, eigenbases by numpy.linalg.eigh) and the raw gradients
(a plain tf.GradientTape on the step's batch), the update each layer receives.
`block_matrices` lays a layer's gradient-shaped arrays out as docs/design.md §2-§3 define
the block's gradient matrix (bias row last, one matrix per Kronecker pair, a batch for
per-group pairs; a diagonal block's flat vector), written here from the layer's
configuration alone, without tfkfac's block code.
"""

import os
import re
import tempfile

import keras
import numpy as np
import tensorflow as tf

import kfac_reference as ref
import tfkfac

IMAGE, TOKENS, VOCABULARY, WIDTH, OUTPUTS = (6, 6, 2), 9, 12, 4, 3

# Layer name -> block kind (`summary()["managed"]`), with BatchNormalization.
MANAGED_KINDS = {
    "conv": "conv2d", "grouped": "conv2d", "depthwise": "depthwise_conv",
    "batch_norm": "batch_norm", "separable": "separable_conv", "transpose": "conv_transpose",
    "embedding": "embedding", "layer_norm": "layer_norm", "einsum": "einsum_dense",
    "per_head": "einsum_dense", "hidden": "dense", "head": "dense",
}
UNMANAGED = ("prelu",)


def every_block_net(seed=0, dtype="float32", batch_norm=True, grouped=True):
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    kw = dict(dtype=dtype)
    image = keras.Input(IMAGE, dtype=dtype, name="image")
    tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
    x = layers.Conv2D(4, 3, padding="same", activation="tanh", name="conv", **kw)(image)
    if grouped:  # (eagerly, Keras's grouped convolution costs an XLA compile per call)
        x = layers.Conv2D(4, 3, padding="same", groups=2, activation="tanh",
                          name="grouped", **kw)(x)
    x = layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, activation="tanh",
                               name="depthwise", **kw)(x)                          # 6x6x8
    if batch_norm:
        x = layers.BatchNormalization(name="batch_norm", **kw)(x)
    x = layers.SeparableConv2D(4, 3, strides=2, padding="same", activation="tanh",
                               name="separable", **kw)(x)                         # 3x3x4
    x = layers.Conv2DTranspose(WIDTH, 3, padding="same", activation="tanh", name="transpose",
                               **kw)(x)
    x = layers.Reshape((TOKENS, WIDTH), **kw)(x)
    # LayerNorm before the sum: its outputs (with the bias's ones) span only an affine
    # hyperplane, and a factor with an exact null direction turns rounding into O(1)
    # changes of eigenbasis Adam's ĝ / (√ŝ + ε) there.
    x = layers.LayerNormalization(name="layer_norm", **kw)(x)
    x = layers.Add(**kw)([x, layers.Embedding(VOCABULARY, WIDTH, name="embedding",
                                              **kw)(tokens)])
    x = layers.EinsumDense("abc,cde->abde", output_shape=(TOKENS, 2, 3), bias_axes="de",
                           activation="tanh", name="einsum", **kw)(x)
    x = layers.EinsumDense("abcd,cde->abce", output_shape=(TOKENS, 2, 3), bias_axes="ce",
                           activation="tanh", name="per_head", **kw)(x)
    x = layers.Reshape((TOKENS, 6), **kw)(x)
    x = layers.GlobalAveragePooling1D(**kw)(x)
    x = layers.Dense(5, name="hidden", **kw)(x)
    x = layers.PReLU(name="prelu", alpha_initializer=keras.initializers.Constant(0.2),
                     **kw)(x)
    outputs = layers.Dense(OUTPUTS, name="head", **kw)(x)
    return keras.Model([image, tokens], outputs, name="every_block_net")


def batches(count, batch, seed=0, dtype=np.float32):
    """`count` batches of `batch` examples: ((image, tokens), regression targets)."""
    rng = np.random.default_rng(seed)
    n = count * batch
    image = rng.normal(size=(n,) + IMAGE).astype(dtype)
    tokens = rng.integers(0, VOCABULARY, size=(n, TOKENS)).astype(np.int32)
    y = rng.normal(size=(n, OUTPUTS)).astype(dtype)
    return [((image[k * batch:(k + 1) * batch], tokens[k * batch:(k + 1) * batch]),
             y[k * batch:(k + 1) * batch]) for k in range(count)]


def mse(y, prediction):
    return tf.reduce_mean(tf.square(prediction - y))


def trainable_layers(model):
    return [layer for layer in model.layers if layer.trainable_variables]


# ------------------------------------------------------------------- layouts
def _with_bias(kernel_matrix, bias):
    """[W; b] (bias row last), batched over a leading group axis when W has one."""
    if bias is None:
        return kernel_matrix
    return np.concatenate([kernel_matrix, bias[..., None, :]], axis=-2)


def _grouped(kernel, bias, groups):
    """Conv kernel (k..., c_in/q, c_out) -> (q, k·c_in/q [+1], c_out/q), group j's
    output channels j·c_out/q ... (j+1)·c_out/q - 1."""
    out = kernel.shape[-1] // groups
    rows = kernel.reshape(-1, kernel.shape[-1])
    matrices = np.stack([rows[:, j * out:(j + 1) * out] for j in range(groups)])
    return _with_bias(matrices, None if bias is None else bias.reshape(groups, out))


def _depthwise(kernel, bias):
    """Depthwise kernel (k..., c_in, m) -> (c_in, k [+1], m); output c·m + j is group c."""
    c_in, m = kernel.shape[-2:]
    matrices = np.moveaxis(kernel.reshape(-1, c_in, m), 1, 0)
    return _with_bias(matrices, None if bias is None else bias.reshape(c_in, m))


def block_matrices(layer, arrays):
    """`arrays` {variable path: array shaped like it} of `layer` as its block's matrices
    (docs/design.md §2, §3): a list, one entry per Kronecker pair (a leading axis for
    per-group pairs) or the diagonal block's flat (γ, β) vector."""
    def get(variable):
        return None if variable is None else np.asarray(arrays[variable.path])

    kind = type(layer).__name__
    if kind in ("BatchNormalization", "LayerNormalization"):
        return [np.concatenate([get(layer.gamma).ravel(), get(layer.beta).ravel()])]
    if kind == "Embedding":
        return [get(layer.embeddings)]
    if kind == "SeparableConv2D":
        pointwise = get(layer.pointwise_kernel)
        return [_depthwise(get(layer.depthwise_kernel), None),
                _with_bias(pointwise.reshape(-1, pointwise.shape[-1]), get(layer.bias))]
    if kind == "DepthwiseConv2D":
        return [_depthwise(get(layer.kernel), get(layer.bias))]
    if kind == "Conv2DTranspose":  # kernel (k..., c_out, c_in): rows (k..., c_in)
        kernel = np.swapaxes(get(layer.kernel), -1, -2)
        return [_with_bias(kernel.reshape(-1, kernel.shape[-1]), get(layer.bias))]
    if kind == "Conv2D":
        if layer.groups > 1:
            return [_grouped(get(layer.kernel), get(layer.bias), layer.groups)]
        kernel = get(layer.kernel)
        return [_with_bias(kernel.reshape(-1, kernel.shape[-1]), get(layer.bias))]
    if kind == "Dense":
        return [_with_bias(get(layer.kernel), get(layer.bias))]
    if kind == "EinsumDense":
        kernel, bias = get(layer.kernel), get(layer.bias)
        if layer.equation == "abc,cde->abde":  # rows c, columns (d, e); bias (d, e)
            return [_with_bias(kernel.reshape(kernel.shape[0], -1), bias.reshape(-1))]
        if layer.equation == "abcd,cde->abce":  # per head c: rows d, columns e; bias (c, e)
            return [_with_bias(kernel, bias)]
    raise ValueError(f"no layout for {layer.name} ({kind})")


def factor_parts(factors):
    """The factors `KFAC.factors(layer)` reports, per part of `block_matrices`: (A, G)
    (A a vector for an Embedding's diagonal A) or (F,) for a diagonal block."""
    factors = {name: np.asarray(f) for name, f in factors.items()}
    if "F" in factors:
        return [(factors["F"],)]
    if "A" in factors:
        return [(factors["A"], factors["G"])]
    return [(factors[f"A_{part}"], factors[f"G_{part}"]) for part in ("depthwise", "pointwise")]


def by_layer(model, values):
    """{layer name: {variable path: array}} of `values`, aligned with
    `model.trainable_variables`."""
    arrays = {v.path: np.asarray(tf.convert_to_tensor(value))
              for v, value in zip(model.trainable_variables, values)}
    return {layer.name: {v.path: arrays[v.path] for v in layer.trainable_variables}
            for layer in trainable_layers(model)}


def gradients(model, x, y):
    """The raw gradients of `mse` on (x, y) by a plain tf.GradientTape, {layer: {path: ∇}}."""
    with tf.GradientTape() as tape:
        loss = mse(y, model(x, training=True))
    return by_layer(model, tape.gradient(loss, model.trainable_variables))


def step_update(model, optimizer, x, y):
    """One custom-loop K-FAC step on (x, y); the change of every trainable variable,
    {layer: {path: Δw}}."""
    before = [v.numpy().copy() for v in model.trainable_variables]
    with optimizer.record() as tape:
        loss = mse(y, model(x, training=True))
    optimizer.minimize(loss, tape=tape)
    return by_layer(model, [v.numpy() - b for v, b in zip(model.trainable_variables, before)])


def is_eigenbasis_moment(name):
    """Whether an optimizer variable's name is eigenbasis Adam's s (`<block>_moment<k>`;
    not an inner optimizer's `..._momentum`)."""
    return re.search(r"_moment\d+$", name) is not None


def eigenbasis_moments(optimizer):
    """{name: numpy value} of eigenbasis Adam's moments among the optimizer's variables."""
    return {v.name: v.numpy().copy() for v in optimizer.variables
            if is_eigenbasis_moment(v.name)}


class Reference:
    """What §11 says each layer receives at each step, in numpy (float64).

    `method`: "eigen_adam" (P of the eigenbasis moments s, bases refreshed every
    `decomposition_freq` steps, s kept across refreshes) or "eigen" (P = (A ⊗ G + λI)⁻¹ ∇
    with the matrix factors of the last decomposition step and the current diagonal ones,
    an Embedding's A or a normalization layer's F, which need no decomposition);
    `grafting`: None, "sgd" or "adam" (Adam's v per variable). `step` returns the
    expected updates in the layout of `block_matrices` for managed layers, per variable
    path for the others; `history` keeps each step's r of every managed layer (grafting)
    and Σ_layers |<P, ∇>| before any graft (what the KL clip would use).
    """

    def __init__(self, model, method, grafting=None, decomposition_freq=1, damping=None,
                 beta_2=0.999, epsilon=1e-7):
        self.model, self.method, self.grafting = model, method, grafting
        self.decomposition_freq, self.damping = decomposition_freq, damping
        self.beta_2, self.epsilon = beta_2, epsilon
        self.moments, self.graft_v, self.decomposed = {}, {}, {}
        self.history = []  # per step: {"directions": {layer: r}, "kl_sum": Σ |<P, ∇>|}

    def _directions(self, grads, t):
        """r per variable path: ∇ ("sgd" or no grafting) or ∇ / (√v̂ + ε) ("adam")."""
        if self.grafting != "adam":
            return grads
        directions = {}
        for path, grad in grads.items():
            directions[path], self.graft_v[path] = ref.adam_scale(
                grad, self.graft_v.get(path, 0.0), t, self.beta_2, self.epsilon)
        return directions

    def _parts(self, optimizer, layer, step):
        current = [tuple(f.astype(np.float64) for f in part)
                   for part in factor_parts(optimizer.factors(layer))]
        if step % self.decomposition_freq == 0:
            self.decomposed[layer.name] = current
        return [tuple(now if now.ndim == 1 else then for now, then in zip(part, decomposed))
                for part, decomposed in zip(current, self.decomposed[layer.name])]

    def step(self, optimizer, grads, step):
        """Expected updates of 0-based `step`, given `grads` ({layer: {path: ∇}}) and the
        factors `optimizer` reports after that step."""
        managed = {m["layer"] for m in optimizer.summary()["managed"]}
        expected, directions_of, kl_sum = {}, {}, 0.0
        for layer in trainable_layers(self.model):
            layer_grads = {p: g.astype(np.float64) for p, g in grads[layer.name].items()}
            directions = self._directions(layer_grads, step + 1)
            if layer.name not in managed:
                expected[layer.name] = directions
                continue
            matrices, preconditioned = block_matrices(layer, layer_grads), []
            for k, (part, grad) in enumerate(zip(self._parts(optimizer, layer, step),
                                                 matrices)):
                if self.method == "eigen_adam":
                    p, self.moments[layer.name, k] = ref.eigen_adam_precondition(
                        grad, ref.eigenbases(part), self.moments.get((layer.name, k), 0.0),
                        step + 1, self.beta_2, self.epsilon)
                else:
                    p = ref.damped_precondition(part, grad, self.damping)
                preconditioned.append(p)
                kl_sum += abs(float(np.sum(p * grad)))
            if self.grafting is not None:
                directions_of[layer.name] = block_matrices(layer, directions)
                preconditioned = ref.graft(preconditioned, directions_of[layer.name])
            expected[layer.name] = preconditioned
        self.history.append({"directions": directions_of, "kl_sum": kl_sum})
        return expected

    def laid_out(self, optimizer, arrays):
        """`arrays` ({layer: {path: array}}) in the layout of `step`, as float64."""
        managed = {m["layer"] for m in optimizer.summary()["managed"]}
        laid_out = {}
        for layer in trainable_layers(self.model):
            layer_arrays = {p: np.asarray(a, np.float64) for p, a in arrays[layer.name].items()}
            laid_out[layer.name] = (block_matrices(layer, layer_arrays)
                                    if layer.name in managed else layer_arrays)
        return laid_out

    def observed(self, optimizer, update, learning_rate):
        """The update `step_update` measured under inner SGD(learning_rate, momentum 0),
        as -Δw / learning_rate in the layout of `step`."""
        return self.laid_out(optimizer, {
            name: {p: -d.astype(np.float64) / learning_rate for p, d in arrays.items()}
            for name, arrays in update.items()})


def assert_updates_close(expected, observed, rtol, atol_scale, msg=""):
    """Every layer's observed update matches the expected one (`Reference.step`)."""
    for name, want in expected.items():
        got = observed[name]
        if isinstance(want, dict):
            want, got = list(want.values()), [got[path] for path in want]
        for k, (w, g) in enumerate(zip(want, got)):
            ref.assert_close(g, w, rtol=rtol, atol_scale=atol_scale, msg=f"{msg} {name}[{k}]")


def train_checked(model, optimizer, data, learning_rate, reference=None, first_step=0,
                  before_step=None):
    """Custom-loop steps on `data` (a list of batches); with a `reference`, returns
    (step, expected, observed) per step. `before_step(step, grads)` runs before each."""
    checked = []
    for step, (x, y) in enumerate(data, start=first_step):
        grads = gradients(model, x, y) if reference or before_step else None
        if before_step is not None:
            before_step(step, grads)
        update = step_update(model, optimizer, x, y)
        if reference is not None:
            checked.append((step, reference.step(optimizer, grads, step),
                            reference.observed(optimizer, update, learning_rate)))
    return checked


def resumed_runs(settings, data, saved_after, learning_rate, reference_for=None):
    """every_block_net (float32, no grouped Conv2D) trained with
    KFAC(inner_optimizer=SGD(learning_rate), **settings) on `data`, saved after
    `saved_after` steps as a .keras file and a tf.train.Checkpoint; then the .keras file
    loaded (`load_model` + `attach`) and the checkpoint read into a fresh model (another
    seed) each take the remaining steps.

    Returns {run: trainable weights at the end} for "uninterrupted", "loaded" and
    "restored", {run: optimizer variables by name} as saved ("saved") and right after each
    restore, and the uninterrupted run's `train_checked` result against
    `reference_for(model)`, a `Reference`.
    """
    directory = tempfile.mkdtemp()

    def fresh(seed):
        model = every_block_net(seed=seed, grouped=False)
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(learning_rate),
                                **settings).attach(model)
        model.compile(optimizer=optimizer, loss="mse")
        return model, optimizer

    def state(optimizer):
        return {v.name: v.numpy().copy() for v in optimizer.variables}

    def weights(model):
        return [v.numpy() for v in model.trainable_variables]

    model, optimizer = fresh(seed=0)
    reference = reference_for(model) if reference_for else None
    checked = train_checked(model, optimizer, data[:saved_after], learning_rate, reference)
    keras_path = os.path.join(directory, "model.keras")
    model.save(keras_path)
    checkpoint_path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        os.path.join(directory, "checkpoint"))
    result = {"saved": state(optimizer)}
    checked += train_checked(model, optimizer, data[saved_after:], learning_rate, reference,
                             first_step=saved_after)
    result["uninterrupted"] = weights(model)

    loaded = keras.models.load_model(keras_path)
    loaded.optimizer.attach(loaded)
    result["loaded_state"] = state(loaded.optimizer)
    train_checked(loaded, loaded.optimizer, data[saved_after:], learning_rate)
    result["loaded"] = weights(loaded)

    restored, restored_optimizer = fresh(seed=1)
    restored_optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).read(
        checkpoint_path).assert_existing_objects_matched()
    result["restored_state"] = state(restored_optimizer)
    train_checked(restored, restored_optimizer, data[saved_after:], learning_rate)
    result["restored"] = weights(restored)
    result["checked"] = checked
    return result
