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
# Every side-by-side benchmark the README reports; run on an otherwise idle machine.
bench:
	$(PYTHON) course.py bench allreduce --world 2 --backends scratch,gloo,mpi --algorithms ring,tree --sizes 4KiB,1MiB,16MiB --json bench-results/allreduce-w2.json --plot bench-results/allreduce-w2.png
	$(PYTHON) course.py bench allreduce --world 4 --backends scratch,gloo,mpi --algorithms ring,tree --sizes 4KiB --json bench-results/allreduce-w4.json
	$(PYTHON) course.py bench ddp --world 2 --json bench-results/ddp.json --plot bench-results/ddp.png
	$(PYTHON) course.py bench ddp --world 2 --model mlp --json bench-results/ddp-mlp.json
	$(PYTHON) course.py bench tp --json bench-results/tp.json --plot bench-results/tp.png
	$(PYTHON) course.py bench pipeline --stages 2,4 --json bench-results/pipeline.json --plot bench-results/pipeline.png
	$(PYTHON) course.py bench zero --world 2 --json bench-results/zero-w2.json --plot bench-results/zero-w2.png
	$(PYTHON) course.py bench zero --world 4 --no-peak --json bench-results/zero-w4.json
	$(PYTHON) course.py bench checkpoint --worlds 2,4 --json bench-results/checkpoint.json --plot bench-results/checkpoint.png
