# quantkit: `make demo` runs the main job end to end on the demo model; `make test` runs the tests.
# Both install everything first (a .venv with the CPU build of torch, then quantkit with its extras).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_OUT := out/demo-smollm2-awq-w4a16

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

# torch==2.13.0 first: that exact version is the CPU build on this machine's disk; an unpinned
# torch (asked for by us or by a dependency) would pull a multi-GB CUDA build. After it, the
# package's `torch>=2.4` is already satisfied.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[gguf,triton,serve,dev,eval]'
	touch $(STAMP)

# The demo calibrates on 16 x 256 tokens with a coarser AWQ search (about a minute on 2 cores); the full-size run
# (64 x 512 tokens, the recipe's own search) is the command printed beside it.
DEMO_SMALL := --set calibration.num_samples=16 --set calibration.seq_len=256 --set stages.awq.args.n_grid=10 \
	--set stages.awq.args.clip_n_grid=10 --set stages.awq.args.search_samples=8

demo: install
	$(BIN)/quantkit models fetch smollm2-135m
	@echo "== quantize SmolLM2-135M to 4 bits with AWQ (demo size: 16 x 256 calibration tokens, a coarser search;"
	@echo "   full size: quantkit quantize smollm2-135m --recipe awq-w4a16 --set stages.rtn.scheme.group_size=64)"
	$(BIN)/quantkit quantize smollm2-135m --recipe awq-w4a16 --set stages.rtn.scheme.group_size=64 $(DEMO_SMALL) \
		-o $(DEMO_OUT) --overwrite --no-progress
	@echo "== perplexity on emma, the original against the 4-bit model (4 windows of 512 tokens)"
	$(BIN)/quantkit eval ppl smollm2-135m $(DEMO_OUT) --seq-len 512 --max-windows 4 --no-progress
	@echo "== the 4-bit model answers"
	$(BIN)/quantkit generate $(DEMO_OUT) "Who was Jane Austen?" --chat --max-new-tokens 48

# One pytest-xdist worker per core, at most 4 (each loads the real model; 24 GiB machines), each with its
# share of the threads (tests/conftest.py). loadgroup hands out one test at a time, the slow real-model ones
# first (conftest orders them), except that a module marked xdist_group runs whole on one worker (its
# module-scoped fixtures are then made once).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

bench: install
	$(BIN)/python bench/kernel_speed.py --device cpu --m 1,16,64,256
	$(BIN)/python bench/decode.py smollm2-135m $(DEMO_OUT)

clean:
	rm -rf $(VENV) out build *.egg-info
