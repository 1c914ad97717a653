# The commands the README and docs/ show. `make demo` and `make test` create the virtual
# environment themselves, so each is one command on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
CTSEG  := $(VENV)/bin/ctseg
STAMP  := $(VENV)/.installed-stamp

.PHONY: install test demo bench bench-predict512 bench-augment bench-windows gpu-check gpu-wheels lint clean experiment-resolution experiment-geometry experiment-robustness experiment-quality experiment-realct targets-table

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# ctseg, then Debian's Chromium and its driver for the browser tests (tests/review), where
# they are missing (apt-get, as root or through sudo; elsewhere those tests are skipped).
install: $(STAMP)
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q chromium chromium-driver; \
	else echo "note: no apt-get: install Chromium and chromedriver for tests/review"; fi

# Two workers, one test file each at a time (module fixtures are built once): most of
# the suite is single-threaded compiling, so the two cores of CI both work.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

demo: $(STAMP)
	bash scripts/demo.sh

bench: $(STAMP)
	$(CTSEG) bench --config configs/demo.toml --partitions 1,2,4,8,16 --partitioner halo,gspmd --peak --json bench/bench.json

# One 512×512 scan through `ctseg predict` with the lits512 model on ONNX Runtime, on
# the CPU: wall time and peak memory of the whole scan and of its liver's region
# (`--roi`, automatic tiles and tiles of 128), and MONAI's sliding window over the same
# grid in PyTorch (the `bench` extra, installed here). About 25 minutes on 2 cores. The
# run's network is untrained but for a few weights that make it predict the phantom's
# liver, so post-processing and writing cost what a real prediction's do. The host's
# figures alone, in a few minutes (the network's width shrunk, the lits512 grid kept):
# `python scripts/bench_predict512.py WORK --device cpu --backend onnx --host-figures-only
# --scans 2` (docs/experiments/gpu.md). On a GPU, see docs/guides/gpu-tpu.md.
bench-predict512: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) scripts/bench_predict512.py bench/predict512 --device cpu --backend onnx --cold-only \
		--roi --roi-tile -1 --roi-tile 128 --anchor

# What nnU-Net's augmentations on the devices cost the demo's training: steps per second
# and input wait with and without them, and the host's time per sample against SciPy's
# affine_transform (about 8 minutes on 2 cores; needs `make demo`'s store).
bench-augment: $(STAMP)
	$(PY) scripts/bench_augment.py bench/augment

# Prediction's programs per box shape: the whole volume, level-wise tiles and fixed windows
# (compiled once per model), compile and run seconds for three box shapes through one
# backend (the demo's config, untrained, on the CPU: about 2 minutes; on a GPU add
# DEVICE=gpu CONFIG=configs/lits512_16way.toml CORE=128 and larger BOXES).
DEVICE ?= cpu
CONFIG ?= configs/demo.toml
CORE   ?= 32
BOXES  ?= [[80,80,80],[96,96,64],[64,80,112]]
bench-windows: $(STAMP)
	$(PY) scripts/bench_windows.py --device $(DEVICE) --config $(CONFIG) --core $(CORE) \
		--boxes '$(BOXES)' --json bench/windows.json

# On a machine with one GPU (install the cuda12 or cuda13 extra first): every GPU figure
# and target of docs/experiments/gpu.md in about 8 minutes, a table last, one JSON file.
gpu-check: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) scripts/gpu_check.py bench/gpu-check --device gpu

# For a GPU machine without network access whose Python 3.12 has JAX and PyTorch but not
# the rest: ctseg's own wheel and those it lacks, into .whl/ (about 60 MB; then, there:
# pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site).
gpu-wheels: $(STAMP)
	rm -rf .whl && $(PY) -m pip wheel -q --no-deps -w .whl .
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl connected-components-3d nibabel SimpleITK monai

experiment-resolution: $(STAMP)
	bash scripts/experiment_resolution.sh

# The cube against the spacing grid on phantoms of LiTS-like extents (about 20 minutes).
experiment-geometry: $(STAMP)
	bash scripts/experiment_geometry.sh

# The demo's model, trained with and without nnU-Net's augmentations, on held-out phantoms
# as acquired differently (rotated, larger, smaller, noisy, soft, thick, contrasted).
experiment-robustness: $(STAMP)
	bash scripts/experiment_robustness.sh

# Does the prediction quality find the wrong predictions? The demo's model (make demo
# first) on 176 phantoms of 11 sets; chooses the thresholds (about 5 minutes).
experiment-quality: $(STAMP)
	bash scripts/experiment_quality.sh

# The demo's model (make demo first) on a real CT: TotalSegmentator's example (scripts/realct/),
# liver Dice, volumes and verdict, HU per tissue, slices as PNG (a minute; RUN=… another run).
experiment-realct: $(STAMP)
	bash scripts/experiment_realct.sh

# Every shipped config compiled for the main GPUs and a TPU slice, without them
# (docs/reference/targets.md; cells already compiled are kept; XLA for TPUs is slow).
targets-table: $(STAMP)
	$(PY) scripts/targets_table.py

lint: $(STAMP)
	$(VENV)/bin/ruff check ctseg cli data_prep tests scripts

clean:
	rm -rf $(VENV) demo bench experiment
