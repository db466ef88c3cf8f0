"""tfkfac: K-FAC second-order optimization for TensorFlow 2 / Keras 3.

    optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-3).attach(model)  # SGD inner
    # or: tfkfac.KFAC(inner_optimizer=keras.optimizers.AdamW(1e-3)).attach(model)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=5)
"""

__version__ = "0.2.0"

# A missing or unsupported TensorFlow/Keras fails here, with one message (tfkfac/_compat.py).
from tfkfac import _compat  # noqa: E402

_compat.require_supported(__version__)

from tfkfac.config import KFACConfig  # noqa: E402
from tfkfac.example_weights import fresh_flags  # noqa: E402
from tfkfac.methods import Eigen, EigenAdam, Inverse, Method  # noqa: E402
from tfkfac.noise_scale import GradientNoiseScale  # noqa: E402
from tfkfac.optimizer import KFAC  # noqa: E402
from tfkfac.schedules import OsawaInterval, WarmupDamping  # noqa: E402

__all__ = ["KFAC", "KFACConfig", "Eigen", "EigenAdam", "GradientNoiseScale", "Inverse",
           "Method", "OsawaInterval", "WarmupDamping", "fresh_flags", "__version__"]
