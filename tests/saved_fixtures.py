"""The .keras files of tests/testdata, written by older tfkfac versions, loaded."""

import json
import zipfile

import keras


def release(version):
    """"3.15.1" -> (3, 15, 1)."""
    return tuple(int(part) for part in version.split(".")[:3])


def load(test, path):
    """`keras.models.load_model(path)`, or `test` skipped under a Keras older than the one
    that wrote the file: an older Keras refuses a newer one's layer configs (3.14 refuses
    the initializers' `input_axes` of 3.15), a limit of Keras's format, not of the
    optimizer state tfkfac saved in it."""
    with zipfile.ZipFile(path) as archive:
        written = json.loads(archive.read("metadata.json"))["keras_version"]
    if release(keras.__version__) < release(written):
        test.skipTest(f"{path} was written by Keras {written}, newer than this Keras "
                      f"{keras.__version__}, which cannot read its layer configs")
    return keras.models.load_model(path)
