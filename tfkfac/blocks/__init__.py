"""K-FAC blocks, one per supported layer kind, and the rule that picks them."""

import keras

from tfkfac.blocks.base import Block
from tfkfac.blocks.batchnorm import BatchNormBlock
from tfkfac.blocks.kronecker import Conv2DBlock, DenseBlock, KroneckerBlock

__all__ = ["Block", "BatchNormBlock", "Conv2DBlock", "DenseBlock", "KroneckerBlock",
           "block_for"]


def _unsupported_reason(layer):
    """Why a layer with weights cannot get a block, or None when it can."""
    if getattr(layer, "lora_enabled", False):
        return "LoRA-enabled layers are not supported"
    if getattr(layer, "quantization_mode", None):
        return "quantized layers are not supported"
    if isinstance(layer, keras.layers.Conv2D):
        if layer.data_format != "channels_last":
            return "Conv2D with data_format='channels_first' is not supported"
        if layer.groups != 1:
            return "grouped Conv2D (groups > 1) is not supported"
        return None
    if isinstance(layer, keras.layers.BatchNormalization):
        return "BatchNormalization(renorm=True) is not supported" if layer.renorm else None
    if isinstance(layer, keras.layers.Dense):
        return None
    return f"no K-FAC block for {type(layer).__name__}"


def block_for(layer, bn_damping_multiplier):
    """(block, None) for a supported layer, or (None, reason) when it is not."""
    reason = _unsupported_reason(layer)
    if reason is not None:
        return None, reason
    if isinstance(layer, keras.layers.Conv2D):
        return Conv2DBlock(layer), None
    if isinstance(layer, keras.layers.BatchNormalization):
        return BatchNormBlock(layer, bn_damping_multiplier), None
    return DenseBlock(layer), None
