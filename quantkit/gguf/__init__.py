"""GGUF, llama.cpp's format: calibrated weights out without a second rounding (`export`), GGUF in (`importer`).

`quantkit.quant.ggml_blocks` holds ggml's block layouts (pure bytes) and `quantkit.quant.ggml` the K-quant
grids GPTQ solves on; here `grids` holds the exact maps between quantkit's int
weights and ggml's blocks, `mixture` llama.cpp's per-tensor type choice, `metadata` the key/values,
tensor names and tokenizer as llama.cpp's own converter writes them.
"""
