# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
# Everything installs into .venv with the development pins of constraints.txt (torch==2.13.0 CPU wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRAS := dev,kernels,hf,dashboard,docs
# torchtitan's model code without its training stack (datasets, wandb, tensorboard, torchdata, ...): what its
# models, configs and parallelize functions import (docs/design.md, "torchtitan, and what the tests install")
TITAN_IMPORTS := spmd_types tyro einops
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt Makefile | sha1sum | cut -c1-12)

.PHONY: setup test docs demo dashboard bench gpu-check clean

# setuptools' notice on every editable install of a package mapped from several folders ("Editable installation
# ... folders with the same name as your package") is information, not a problem: it is filtered; every
# other build warning shows (tests/test_packaging.py builds with this filter and expects none).
QUIET_BUILD := ignore:Editable installation

# torchtitan: what its model code imports first, then torchtitan itself without its training stack (under --no-deps
# pip checks no dependencies, so it does not warn that datasets, wandb, ... are absent)
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PYTHONWARNINGS='$(QUIET_BUILD)' $(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q -c constraints.txt $(TITAN_IMPORTS)
	$(PY) -m pip install -q -c constraints.txt --no-deps torchtitan
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

# The documentation site into site/ (mkdocs.yml): warnings are errors, every link and anchor is checked; the
# reference pages are generated (tools/gen_reference.py; a test fails when they are stale).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The main job: a real MoE model balanced across local ranks, measured against no balancing, with the host memory
# settings of the runs of record (benchmarks/host_memory.py says why).
demo: setup
	$(PY) -m benchmarks.host_memory $(VENV)/bin/ultraep demo --out runs

dashboard: setup
	$(VENV)/bin/ultraep dashboard runs

bench: setup
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_simulate.py
	$(PY) benchmarks/bench_telemetry.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_dashboard.py

# Everything that needs a GPU (CUDA-only tests, Triton kernels compiled vs their references, the sync check, kernel
# timings, the critical path, NCCL runs with two GPUs) within 570 s; its rows go to benchmarks/results_committed/
# and the kernel times to kernels/kernel_times.csv, for committing. Without CUDA: one line, exit 0.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist site *.egg-info
