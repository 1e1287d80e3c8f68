# Two entry points: `make demo` and `make test`. Both create .venv on first use and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# test processes (pytest-xdist; each file's tests stay in one process, each process uses one
# torch thread): 2 fills the 2-core machine the suite is sized for; 0 runs it in this process
TEST_WORKERS ?= 2

.PHONY: demo test bench docs clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,examples,hf,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/ppca_mpt_vs_elbo.py

test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: $(STAMP)
	$(PY) benchmarks/ppca_speed.py

# The documentation site (Sphinx + MyST), warnings as errors; open docs/_build/html/index.html.
docs: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg $(PY) -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info docs/_build

# Paper-figure gallery: Fig. 1-6, Table 1-2 and two figures beyond the paper, PNGs and RESULTS.md in
# docs/gallery/. Offline on CPU (about 25 minutes on 2 cores; each section's time is in RESULTS.md); each script takes --quick, --out-dir, --seed.
.PHONY: gallery
gallery: $(STAMP)
	mkdir -p docs/gallery
	MPLBACKEND=Agg $(PY) examples/gallery_convergence.py --out-dir docs/gallery
	MPLBACKEND=Agg $(PY) examples/gallery_area.py --out-dir docs/gallery
	MPLBACKEND=Agg $(PY) examples/gallery_schedules.py --out-dir docs/gallery
	MPLBACKEND=Agg $(PY) examples/gallery_training.py --out-dir docs/gallery
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg $(PY) examples/gallery_adapters.py --out-dir docs/gallery
