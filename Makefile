# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
# Everything installs into .venv with the development pins of constraints.txt (torch==2.13.0 CPU wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRAS := dev
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt Makefile | sha1sum | cut -c1-12)

.PHONY: setup test demo bench clean

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

# Until the demo issue lands: plan a generated EP64 workload with every policy and compare.
demo: setup
	$(VENV)/bin/ultraep plan --synthetic --ranks 64 --experts 256 --top-k 8 --tokens 8192 --imbalance 2.0 --slots 2 --compare

bench: setup
	$(PY) benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) build dist *.egg-info
