"""Every K-FAC setting is declared once, in `tfkfac.KFACConfig`, and everything else is
derived from it: KFAC's signature and config, the trainer's flags and fields."""

import dataclasses
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import config as kfac_config  # noqa: E402
from trainers import config as config_lib, runner, train  # noqa: E402


class SettingsTest(absltest.TestCase):

    def test_signature_lists_every_setting_with_its_default(self):
        parameters = inspect.signature(tfkfac.KFAC.__init__).parameters
        for field in kfac_config.settings():
            self.assertEqual(parameters[field.name].default, field.default)
            self.assertEqual(parameters[field.name].kind, inspect.Parameter.KEYWORD_ONLY)

    def test_get_config_round_trips_every_setting(self):
        settings = dict(damping=0.03, method="eigen_adam", grafting="adam", kl_clip=None,
                        decomposition_update_freq=20, skip_layers=("d.*",),
                        diagonal_damping_multiplier=2.0, adam_beta_2=0.99)
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.AdamW(1e-3), **settings)
        restored = tfkfac.KFAC.from_config(optimizer.get_config())
        self.assertEqual(restored.config, optimizer.config)
        self.assertIsInstance(restored.inner_optimizer, keras.optimizers.AdamW)
        for name, value in settings.items():
            self.assertEqual(getattr(restored, name), value)

    def test_trainer_has_one_flag_and_field_per_exposed_setting(self):
        fields = {f.name for f in dataclasses.fields(config_lib.TrainConfig)}
        for field in kfac_config.settings():
            flag = kfac_config.flag_name(field)
            if flag is None:
                continue
            self.assertIn(flag, fields)
            self.assertIn(field.metadata["doc"], flags.FLAGS[flag].help)
            self.assertEqual(getattr(config_lib.TrainConfig(), flag), field.default)
            self.assertIn(flag, config_lib.KFAC_ONLY_FIELDS)
        self.assertIs(train.FLAGS, flags.FLAGS)

    def test_trainer_config_gives_the_library_config(self):
        config = config_lib.TrainConfig(kfac_method="eigen_adam", grafting="sgd", damping=0.3)
        kfac = config.kfac_config()
        self.assertEqual((kfac.method, kfac.grafting, kfac.damping), ("eigen_adam", "sgd", 0.3))
        with self.assertRaisesRegex(ValueError, "`damping` must be a finite number > 0"):
            config_lib.TrainConfig(damping=float("nan")).kfac_config()

    def test_xla_compiles_kfacs_own_stages_only_where_the_library_would(self):
        self.assertEqual(config_lib.TrainConfig(xla=True).kfac_config().xla, "auto")
        self.assertIs(config_lib.TrainConfig(xla=False).kfac_config().xla, False)

    def test_trainer_builds_kfac_over_the_chosen_inner_optimizer(self):
        config = config_lib.TrainConfig(kfac_inner_optimizer="adamw", learning_rate=2e-3,
                                        weight_decay=0.05)
        optimizer = runner._build_optimizer(config, steps_per_epoch=10, total_steps=100,
                                            communicator=None)
        self.assertIsInstance(optimizer.inner_optimizer, keras.optimizers.AdamW)
        self.assertAlmostEqual(float(optimizer.learning_rate), 2e-3)
        self.assertAlmostEqual(optimizer.inner_optimizer.weight_decay, 0.05)
        self.assertEqual(optimizer.config, config.kfac_config())

    def test_renamed_arguments_warn_and_map_to_the_new_names(self):
        for old, new in kfac_config.RENAMED.items():
            value = {"inv_update_freq": 20, "bn_damping_multiplier": 3.0,
                     "eigen_wire_dtype": "float16"}[old]
            with self.assertWarnsRegex(DeprecationWarning, f"`{old}` is deprecated, use `{new}`"):
                optimizer = tfkfac.KFAC(**{old: value})
            self.assertEqual(getattr(optimizer.config, new), value)
        # A save of 0.1 names them so: read without a warning.
        config = tfkfac.KFACConfig.from_config({"inv_update_freq": 20})
        self.assertEqual(config.decomposition_update_freq, 20)


if __name__ == "__main__":
    absltest.main()
