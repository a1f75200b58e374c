# Two entry points, each working from nothing: `make demo` (install everything, pull the default model, build a
# datastore, then generate one prompt with plain decoding and with Graft: both speeds, the speed-up, and whether
# the texts are identical) and `make test` (install with the test extras and run the suite).
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
GRAFT := $(VENV)/bin/graft
# The CPU build of torch (pip would otherwise pull a multi-GB CUDA build) and faiss-cpu; machines with CUDA get the
# normal torch and faiss-gpu-cu12 (the `cuda` extra: never both FAISS wheels, they install the same module).
TORCH_CPU ?= torch==2.13.0
DEMO_PROMPT ?= Write a Python function that reads a JSON file and returns its contents.
STDLIB := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q torch && $(PIP) install -q -e '.[dev,cuda]'; \
	else $(PIP) install -q $(TORCH_CPU) && $(PIP) install -q -e '.[dev,cpu]'; fi
	touch $@

install: $(VENV)/.installed

demo: install
	$(GRAFT) models pull smollm2-135m-instruct
	$(GRAFT) index build $(STDLIB)/json $(STDLIB)/email $(STDLIB)/asyncio --model smollm2-135m-instruct \
		--kind suffix-array --name stdlib-demo --force
	$(VENV)/bin/python -m benchmarks.demo --datastore stdlib-demo --max-new-tokens 128 \
		--prompt "$(DEMO_PROMPT)"

# specforge: the reference EAGLE-3 class tests/test_heads.py checks the head format against; without its own
# dependencies, which pin another torch and sglang (its model class needs only torch and transformers).
# Then the cache and end-to-end tests again under the oldest transformers pyproject.toml allows (5.17, whose
# forwards take the cache as past_key_values where newer ones take cache), installed into OLDEST, first on the path.
OLDEST := .venv-oldest
test: install
	$(PIP) install -q --no-deps specforge==0.2.0
	$(VENV)/bin/python -m pytest -q
	$(PIP) install -q --upgrade --no-deps --target $(OLDEST) transformers==5.17.0
	$(PIP) install -q --upgrade --target $(OLDEST) huggingface-hub==1.33.0 httpx
	PYTHONPATH=$(OLDEST) $(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_gpu_check.py

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info
