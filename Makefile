# Two-command quick start: `make train` and `make test` (both bootstrap on first use).
PYTHON := .venv/bin/python
export TF_CPP_MIN_LOG_LEVEL := 2
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: bootstrap train test data wheel-check

bootstrap:
	bash tools/bootstrap.sh

# The default job: small CNN on real Fashion-MNIST with K-FAC, trainer's defaults.
train: bootstrap
	$(PYTHON) -m trainers.train

# Prepares the offline Fashion-MNIST TFDS dataset once, so tests do not each pay for it.
data: bootstrap
	$(PYTHON) tools/prepare_data.py fashion_mnist

test: data
	bash tools/bazel_test.sh //...

# The built wheel in fresh venvs with the oldest and the newest supported TensorFlow/Keras,
# and into an env that already has its TensorFlow (tools/wheel_check.sh; needs PyPI).
wheel-check: bootstrap
	bash tools/wheel_check.sh
