"""Recording what K-FAC needs from a Keras forward pass.

Keras 3 layers have no hooks, so while a `Recorder` is active each managed layer's
`call` is replaced, on that layer instance only, by one that computes the
pre-activation output through the block (activation applied outside), and notes the
layer input and the pre-activation. Asking the gradient tape for dL/d(pre-activation)
alongside the weight gradients then costs nothing extra: the backward pass computes
those tensors anyway.
"""

import contextlib


class Recorder:
    """Captures (inputs, pre-activations) of every call of every block's layer.

    What a call records is the block's choice (`Block.pre_activation_call`): usually the
    layer input and its pre-activation output; either may be a nest of tensors.
    """

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self._calls = []

    @contextlib.contextmanager
    def recording(self):
        """Within this context, calls of the managed layers are recorded."""
        # Per block, not per name: nested layers may share one (every MultiHeadAttention
        # has a "query").
        self._calls = [[] for _ in self.blocks]
        originals = []
        try:
            for block, calls in zip(self.blocks, self._calls):
                original = block.layer.call
                originals.append((block.layer, original))
                object.__setattr__(block.layer, "call",
                                   self._recording_call(block, original, calls))
            yield self
        finally:
            for layer, _ in originals:
                object.__delattr__(layer, "call")

    def _recording_call(self, block, original, calls):
        def call(*args, **kwargs):
            record, output = block.pre_activation_call(original, args, kwargs)
            calls.append(record)
            return output

        return call

    def take(self):
        """The recorded calls per block, as lists of (inputs, pre-activations); resets."""
        calls, self._calls = self._calls, []
        if self.blocks and not calls:
            raise RuntimeError(
                "KFAC: nothing was recorded for this step: the gradient tape must be opened "
                "by the optimizer, `with optimizer.record() as tape:`, not as a plain "
                "`tf.GradientTape()`; then `optimizer.minimize(loss, tape=tape)`.")
        missing = [block.path for block, c in zip(self.blocks, calls) if not c]
        if missing:
            raise RuntimeError(
                f"K-FAC layers {missing} were not called in the recorded forward pass; "
                "attach the optimizer to the model whose forward pass you record.")
        return calls
