# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, run the embedded demo study end to end -> reports/demo/report.pdf
#   make test   - create .venv, install, run the test suite
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
CORES ?= 2
DEMO := workflow/studies/demo/params.yaml
MIRROR := workflow/studies/mirror/params.yaml
GPU_STUDY := workflow/studies/gpu/params.yaml
CPU_STUDY := workflow/studies/cpu/params.yaml
CNNDM_STUDY := workflow/studies/cnndm/params.yaml

.PHONY: install system-deps demo mirror cpu-study cnndm-study gpu-predict gpu-plan gpu-report full slurm cluster-test test test-avx2 bench bundle dvc-yaml exp-show lint clean

# PIP_FLAGS: more options for the pip install of torch (CI: --no-compile, .ci/run).
PIP_FLAGS ?=
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# The pinned packages through uv, which installs them in parallel: ~7-13 s on 2 cores instead
	@# of ~40 s with pip, the same versions. Torch stays pip's: pip's configuration on the machine (a
	@# local wheel folder, an index) is what finds the CPU wheel. uv reads no pip configuration:
	@# where it cannot install (no uv for the platform, PyPI reachable only through pip's settings)
	@# pip does it all, as before. uv compiles no bytecode: each module is compiled when first imported.
	$(BIN)/pip install -q --upgrade pip uv || echo "(no uv: pip installs everything)"
	$(BIN)/pip install -q $(PIP_FLAGS) torch==2.13.0        # the CPU wheel; an unpinned torch pulls CUDA builds
	$(BIN)/uv pip install -q --python $(BIN)/python -r requirements.lock \
	  || { echo "(uv could not install requirements.lock: pip installs it)"; $(BIN)/pip install -q $(PIP_FLAGS) -r requirements.lock; }
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed system-deps

# LaTeX for the PDF report and poppler for page previews (Debian packages).
system-deps:
	@if ! command -v latexmk >/dev/null || ! command -v pdftoppm >/dev/null; then \
	  echo "installing TeX Live + poppler (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended poppler-utils >/dev/null; \
	fi

# Under the start-up server (pipeline_src/runtime/preload.py) each job forks from a process that has torch
# loaded instead of importing it: a third of the demo's CPU time. PRELOAD= runs every job the normal way.
PRELOAD ?= python -m pipeline_src preload

demo: install
	$(PRELOAD) snakemake --cores $(CORES) --config params=$(DEMO) --quiet rules
	@echo "report: $(CURDIR)/reports/demo/report.pdf"

# Small real-data study on the offline mirror in ../shared/datasets, driven by DVC.
mirror: install
	$(PRELOAD) dvc repro workflow/studies/mirror/dvc.yaml
	@echo "report: $(CURDIR)/reports/mirror/report.pdf"

# The reference CPU study: Multi30k and PTB in full, two one-thread jobs at a time (189 min on 2 cores);
# the same command continues a stopped run. Products -> reports/reference/cpu/.
cpu-study: install
	bash workflow/studies/cpu/run.sh

# The reference CPU summarisation study: CNN/DailyMail in See et al.'s processing from the offline
# mirror (147 min as last run, on a shared machine; the same command continues a stopped run).
# Products -> reports/reference/cnndm/.
cnndm-study: install
	bash workflow/studies/cnndm/run.sh

# The GPU study in parts for short GPU job slots (docs/gpu-nodes.md): its parts
# and predicted minutes; then, from the archives its parts brought back (ARCHIVES: a folder or files),
# its report on this machine, and with REFERENCE=reports/reference/h100 the reference copy too.
gpu-predict: install
	python -m pipeline_src parts predict --params $(GPU_STUDY)
gpu-plan: gpu-predict   # the former name of gpu-predict

ARCHIVES ?= archives
gpu-report: install
	python -m pipeline_src parts build $(ARCHIVES) --params $(GPU_STUDY) $(if $(REFERENCE),--reference $(REFERENCE))

# The real study (params.yaml): needs the Hub or PIPELINE_DATA_MIRROR, and a GPU to finish in days not months.
full: install
	snakemake --cores 8 --resources gpu=1

# A study on a SLURM cluster, from a login node (workflow/profiles/slurm; docs/slurm.md).
PARAMS ?= params.yaml
slurm: install
	@python -c "import snakemake_executor_plugin_slurm" 2>/dev/null || { echo "error: snakemake-executor-plugin-slurm is not installed in $(VENV) (it is in requirements.lock: make install)"; exit 1; }
	snakemake --profile workflow/profiles/slurm --config params=$(PARAMS)

# CI's cluster checks (root, Debian): start a real single-node SLURM, run a tiny study through
# the profile, then the DVC push / fresh clone / pull round trip; the daemons are stopped at the end.
cluster-test: install
	eval "$$(tests/cluster/slurm_up.sh)" && trap tests/cluster/slurm_down.sh EXIT && \
	  tests/cluster/check_slurm.sh && tests/cluster/check_dvc_remote.sh

# Two test processes share the cores (pytest-xdist, one file per worker so module fixtures are built
# once; the longest files first, tests/conftest.py), their studies' jobs started by the start-up
# server; tests marked serial (kill or signal runs at random moments, or time them) run afterwards
# on their own, every job in a process of its own (pytest then collects only the files that mark
# tests serial: collecting every file imports what all of them import, ~5 s).
SERIAL_TEST_FILES = $(shell grep -l "mark\.serial" tests/test_*.py)
test: install
	PIPELINE_QUIET=1 $(PRELOAD) pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=15 tests
	PIPELINE_QUIET=1 pytest -q -m serial --durations=5 $(or $(SERIAL_TEST_FILES),tests)

# The same tests computing with AVX2 kernels, as on a CPU without AVX-512 (torch's ATen, oneDNN and
# MKL forced down; on such a CPU this is `make test`). CI runs its tests this way.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(MAKE) test

# What a GPU node without internet needs, packed for it (docs/gpu-nodes.md).
bundle: install
	bash workflow/node/bundle.sh

bench: install
	@for b in bench/bench_*.py; do echo "== $$b"; python $$b || exit 1; done

dvc-yaml: install
	python -m pipeline_src dvc-yaml --params params.yaml
	python -m pipeline_src dvc-yaml --params $(DEMO)
	python -m pipeline_src dvc-yaml --params $(MIRROR)
	python -m pipeline_src dvc-yaml --params $(GPU_STUDY)
	python -m pipeline_src dvc-yaml --params $(CPU_STUDY)
	python -m pipeline_src dvc-yaml --params $(CNNDM_STUDY)

# DVC's experiments table for one study (PARAMS, default params.yaml), cut to what compares its
# cells: each cell's headline metric and the cell settings that differ (pipeline_src/report/exp_show.py).
# More options for dvc exp show in EXP (e.g. EXP="-A --md").
exp-show: install
	@python -m pipeline_src exp-show --params $(PARAMS) $(EXP)

lint: install
	snakemake --lint

clean:
	rm -rf data reports/*/ logs .snakemake
	git checkout -q -- reports   # what git keeps there: the reference copies, what DVC shows of each study
