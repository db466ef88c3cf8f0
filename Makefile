# Two-command quick start: `make train` and `make test` (both bootstrap on first use).
PYTHON := .venv/bin/python
export TF_CPP_MIN_LOG_LEVEL := 2
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: bootstrap train test data wheel-check docs

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

# The API reference, generated from the docstrings (Sphinx; sources in docs/api/), into
# build/docs/index.html. Every warning, an unresolved reference too, fails it; rebuilt whole
# (-E), so that a second run reports what the first did.
docs: bootstrap
	$(PYTHON) -m sphinx -b html -W --keep-going -n -q -E docs/api build/docs

# The built wheel in fresh venvs with the oldest and the newest supported TensorFlow/Keras,
# and into an env that already has its TensorFlow (tools/wheel_check.sh; needs PyPI).
wheel-check: bootstrap
	bash tools/wheel_check.sh
