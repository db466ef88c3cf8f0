"""The precision helper: Keras global policy and input dtype for each name, and a clear
error for anything else."""

from absl.testing import absltest
import keras
import tensorflow as tf

import pipelines


class SetPrecisionTest(absltest.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_each_policy_sets_keras_and_returns_the_compute_dtype(self):
        expected = {"float32": ("float32", tf.float32),
                    "mixed_float16": ("float16", tf.float16),
                    "mixed_bfloat16": ("bfloat16", tf.bfloat16)}
        self.assertEqual(set(pipelines.PRECISIONS), set(expected))
        for name, (compute, input_dtype) in expected.items():
            self.assertEqual(pipelines.set_precision(name), input_dtype)
            policy = keras.mixed_precision.global_policy()
            self.assertEqual(policy.name, name)
            self.assertEqual(policy.compute_dtype, compute)
            self.assertEqual(policy.variable_dtype, "float32")
            # A layer built now computes in that dtype and keeps float32 weights.
            layer = keras.layers.Dense(2)
            out = layer(tf.ones([1, 3], input_dtype))
            self.assertEqual(out.dtype, input_dtype)
            self.assertEqual(layer.kernel.dtype, "float32")

    def test_unknown_name_lists_the_allowed_ones_and_keeps_the_policy(self):
        pipelines.set_precision("mixed_bfloat16")
        for bad in ("float16", "fp32", "", None):
            with self.assertRaisesRegex(
                    ValueError, "precision must be one of float32, mixed_float16, mixed_bfloat16"):
                pipelines.set_precision(bad)
        self.assertEqual(keras.mixed_precision.global_policy().name, "mixed_bfloat16")

    def test_build_delivers_images_in_the_input_dtype(self):
        dtype = pipelines.set_precision("mixed_float16")
        source = tf.data.Dataset.from_tensor_slices(
            {"image": tf.fill([8, 4, 4, 1], tf.constant(255, tf.uint8)), "label": tf.range(8, dtype=tf.int64)})
        dataset, _ = pipelines.build(source, batch_size=4, shuffle_buffer=0, dtype=dtype)
        images, labels = next(iter(dataset))
        self.assertEqual(images.dtype, tf.float16)
        self.assertEqual(labels.dtype, tf.int64)
        self.assertTrue(bool(tf.reduce_all(images == 1.0)))


if __name__ == "__main__":
    absltest.main()
