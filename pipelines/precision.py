"""Keras precision policy and the matching input dtype, set in one place so the model
and the pipeline agree."""

import keras
import tensorflow as tf

# Policy name -> dtype the pipeline should deliver images in: the policy's compute
# dtype, so the first layer does not cast and the host moves half the bytes in mixed
# precision. Variables stay float32 under the mixed policies.
PRECISIONS = {
    "float32": tf.float32,
    "mixed_float16": tf.float16,
    "mixed_bfloat16": tf.bfloat16,
}


def set_precision(name):
    """Sets Keras's global dtype policy to `name` and returns the input dtype.

    Example:
      >>> input_dtype = set_precision("mixed_bfloat16")   # tf.bfloat16
    """
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
    keras.mixed_precision.set_global_policy(name)
    return PRECISIONS[name]
