# Two commands for everyone: `make lab` (learners) and `make test` (CI, contributors).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test install build build-check bench clean

# (Re)install whenever the dependency files change; torch comes pinned by constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[mpi,dev]"
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)
	IPP_NONINTERACTIVE=1 $(PY) -m pytest tests $(PYTEST_ARGS)

build: $(STAMP)
	$(PY) -m course_lib.build

build-check: $(STAMP)
	$(PY) -m course_lib.build --check

bench: $(STAMP)
	mkdir -p bench-results
	$(PY) -m course_lib.bench allreduce --world 2 --backends scratch,gloo,mpi --json bench-results/allreduce.json --plot bench-results/allreduce.png

clean:
	rm -rf $(VENV) .pytest_cache
