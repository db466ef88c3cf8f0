"""K-FAC blocks, one per supported layer kind, and the rule that picks them."""

import re
import warnings

import keras

from tfkfac.config import KFACConfig, PRODUCT_DTYPES, WEIGHT_SHARING
from tfkfac.blocks.base import Block, Unsupported
from tfkfac.blocks.normalization import (BatchNormBlock, GroupNormBlock, LayerNormBlock,
                                         RMSNormBlock)
from tfkfac.blocks.conv import ConvBlock, ConvTransposeBlock, SeparableConvBlock
from tfkfac.blocks.einsum import EinsumDenseBlock
from tfkfac.blocks.embedding import EmbeddingBlock
from tfkfac.blocks.kronecker import DenseBlock, KroneckerBlock

__all__ = ["Block", "BatchNormBlock", "ConvBlock", "ConvTransposeBlock", "DenseBlock",
           "EinsumDenseBlock", "EmbeddingBlock", "GroupNormBlock", "KroneckerBlock",
           "LayerNormBlock", "RMSNormBlock", "SeparableConvBlock", "Unsupported",
           "PRODUCT_DTYPES", "WEIGHT_SHARING", "block_for", "discover", "warn_unsupported"]

SKIPPED_BY_REQUEST = "skipped by skip_layers"
CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
              keras.layers.Conv3DTranspose)


def _conv(block_class, **kwargs):
    """The builder of a convolution block (which raises `Unsupported` for its layouts)."""
    return lambda layer, config: block_class(layer, config.weight_sharing, **kwargs)


def _diagonal(block_class):
    """The builder of a normalization block, damped with ρ (docs/design.md §3)."""
    return lambda layer, config: block_class(layer, config.diagonal_damping_multiplier)


# (layer class, block builder), most specific class first. A builder returns the block
# or raises `Unsupported` naming what about this layer has no block.
_BUILDERS = [
    (CONVOLUTIONS, _conv(ConvBlock)),
    (DEPTHWISE, _conv(ConvBlock, depthwise=True)),
    (SEPARABLE, _conv(SeparableConvBlock)),
    (TRANSPOSED, _conv(ConvTransposeBlock)),
    (keras.layers.Embedding, lambda layer, config: EmbeddingBlock(layer)),
    (keras.layers.BatchNormalization, _diagonal(BatchNormBlock)),
    (keras.layers.LayerNormalization, _diagonal(LayerNormBlock)),
    (keras.layers.GroupNormalization, _diagonal(GroupNormBlock)),
    (keras.layers.RMSNormalization, _diagonal(RMSNormBlock)),
    (keras.layers.Dense, lambda layer, config: DenseBlock(layer, config.weight_sharing)),
    (keras.layers.EinsumDense,
     lambda layer, config: EinsumDenseBlock(layer, config.weight_sharing)),
]


def block_for(layer, config=KFACConfig()):
    """(block, None) for a supported layer, or (None, reason) when it is not.

    The block takes its options from `config` (a `tfkfac.KFACConfig`, default the
    defaults): the weight-sharing rule, ρ of the diagonal blocks, the product dtype.
    """
    if getattr(layer, "lora_enabled", False):
        return None, "LoRA-enabled layers are not supported"
    if getattr(layer, "quantization_mode", None):
        return None, "quantized layers are not supported"
    for layer_class, build in _BUILDERS:
        if isinstance(layer, layer_class):
            try:
                block = build(layer, config)
            except Unsupported as error:
                return None, str(error)
            block.use_product_dtype(config.product_dtype)
            return block, None
    return None, f"no K-FAC block for {type(layer).__name__}"


def discover(layers, config):
    """(blocks, skipped) for the layers with trainable weights among `layers`, {path: layer}.

    `skipped` lists {"layer": path, "reason"} for each layer that gets the plain gradient;
    `config.skip_layers` are regular expressions matched in full against the layer's
    name, path or class name.
    """
    blocks, skipped = [], []
    patterns = [re.compile(p) for p in config.skip_layers]
    for path, layer in layers.items():
        if not layer.trainable_weights:
            continue
        names = (layer.name, path, type(layer).__name__)
        if any(p.fullmatch(n) for p in patterns for n in names):
            skipped.append({"layer": path, "reason": SKIPPED_BY_REQUEST})
            continue
        block, reason = block_for(layer, config)
        if block is None:
            skipped.append({"layer": path, "reason": reason})
        else:
            block.path = path
            blocks.append(block)
    return blocks, skipped


def warn_unsupported(skipped):
    """One warning naming every layer that has no block (and why), if there is any."""
    unsupported = [f"{s['layer']} ({s['reason']})" for s in skipped
                   if s["reason"] != SKIPPED_BY_REQUEST]
    if unsupported:
        warnings.warn("KFAC: these layers have no K-FAC block and get the plain gradient: "
                      + ", ".join(unsupported), stacklevel=3)
