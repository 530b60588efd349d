# Entry points (see README.md): `make demo` and `make test`. Needs python3, make and git.
#
# .venv holds the tools (tox, ruff) and, for the demo, actcore installed editable. torch
# is not installed into it: tools/torch_site.py links it to the one shared torch that
# the tox envs use too (see docs/GUIDE.md, "Development").

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# `make test TOX_ENVS=actcore,lint` runs only those envs; TOX_ARGS go to tox as they are.
TOX_ENVS ?=
TOX_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help demo test lint format clean distclean gpu-check

help:
	@echo "make demo       set up .venv and run the demo (memory saved, accuracy kept)"
	@echo "make test       set up .venv and run every tox env: each package's tests, integration, lint"
	@echo "make gpu-check  (CUDA machine) install from the checkout, build the kernels, run the GPU check into OUT"
	@echo "make lint       ruff check + ruff format --check"
	@echo "make format     ruff format + ruff check --fix"
	@echo "make clean      remove .tox and build/test caches (keeps .venv)"
	@echo "make distclean  clean, and remove .venv too"

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Stamps make a second run skip the set-up; they live in .venv and go with it.
$(VENV)/.act-tools.stamp: tools/requirements-dev.txt tools/requirements-lint.txt | $(VPY)
	$(VPY) -m pip install -r tools/requirements-dev.txt
	touch $@

$(VENV)/.act-demo.stamp: tools/torch_site.py packages/actcore/pyproject.toml | $(VPY)
	$(VPY) tools/torch_site.py link
	$(VPY) -m pip install -e 'packages/actcore[bench]'
	touch $@

demo: $(VENV)/.act-demo.stamp
	$(VENV)/bin/actcore demo

# The envs act-mm-openmmlab and act-pyg-ext install native packages that ship no wheel for
# today's torch; tools/source_wheels.py compiles them once per machine into a cache (about
# 20 min on 2 cores). `make test` starts those builds in the background at the lowest CPU
# priority, so they use the core that the earlier envs' mostly single-threaded tests leave
# idle; each of those two envs then takes its wheels from the cache, waiting for a build
# still running (the cache's lock). Log: .tox/source-wheels.log.
SOURCE_WHEELS := $(strip \
	$(if $(or $(if $(TOX_ENVS),,all),$(findstring act-mm-openmmlab,$(TOX_ENVS))),mmcv) \
	$(if $(or $(if $(TOX_ENVS),,all),$(findstring act-pyg-ext,$(TOX_ENVS))),torch-scatter torch-sparse))

test: $(VENV)/.act-tools.stamp
ifneq ($(SOURCE_WHEELS),)
	@mkdir -p .tox
	nice -n 19 $(VPY) tools/source_wheels.py ensure $(SOURCE_WHEELS) > .tox/source-wheels.log 2>&1 &
endif
	$(VENV)/bin/tox $(if $(TOX_ENVS),-e $(TOX_ENVS)) $(TOX_ARGS)

# The GPU check runs with the machine's own python (torch with CUDA), fetching nothing:
# `make gpu-check OUT=dir` writes dir/gpu-check.json and dir/gpu-check.txt.
OUT ?= gpu-check-out
gpu-check:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e packages/actcore -e packages/act-hf
	$(PYTHON) benchmarks/gpu_check.py --out $(OUT)

lint: $(VENV)/.act-tools.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.act-tools.stamp
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf .tox build dist .pytest_cache .ruff_cache packages/*/build packages/*/dist
	find . \( -path ./$(VENV) -o -path ./.git \) -prune -o -type d \
		\( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache \) -prune \
		-exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
