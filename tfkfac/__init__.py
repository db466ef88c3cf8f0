"""tfkfac: K-FAC second-order optimization for TensorFlow 2 / Keras 3.

    optimizer = tfkfac.KFAC()        # the default: K-FAC's directions into ScheduleFreeAdamW
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=5, validation_data=val,
              callbacks=[tfkfac.AveragedWeights(optimizer)])  # evaluated at the average

The default (`tfkfac.KFACConfig`; docs/guide.md §3):
the inverse method, damping 0.03, no KL clip, factors every 10 steps and decompositions
every 100, handed to `tfkfac.ScheduleFreeAdamW` at learning rate 0.01. The learning rate
is the one number to tune: start at 0.01, about 1-2x the rate ScheduleFreeAdamW alone
would take. Any Keras optimizer can apply the update instead:
`tfkfac.KFAC(inner_optimizer=keras.optimizers.AdamW(1e-3))`.
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
from tfkfac.schedule_free import AveragedWeights, ScheduleFreeAdamW  # noqa: E402
from tfkfac.schedules import OsawaInterval, WarmupDamping  # noqa: E402
from tfkfac.transform import Transform  # noqa: E402

__all__ = ["KFAC", "KFACConfig", "AveragedWeights", "Eigen", "EigenAdam",
           "GradientNoiseScale", "Inverse", "Method", "OsawaInterval", "ScheduleFreeAdamW",
           "Transform", "WarmupDamping", "fresh_flags", "__version__"]
