# Thin aliases for course.py, which does the work (and needs only Python 3.11+).
PYTHON ?= python3
.PHONY: lab test build build-check bench
lab:
	$(PYTHON) course.py lab
test:
	$(PYTHON) course.py test
build:
	$(PYTHON) course.py build
build-check:
	$(PYTHON) course.py build --check
bench:
	$(PYTHON) course.py bench allreduce --world 2 --backends scratch,gloo,mpi --json bench-results/allreduce.json --plot bench-results/allreduce.png
