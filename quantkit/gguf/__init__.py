"""GGUF, llama.cpp's format: calibrated weights out without a second rounding (`export`), GGUF in (`importer`).

`blocks` holds ggml's block layouts (pure bytes), `grids` the exact maps between quantkit's int
weights and ggml's blocks, `mixture` llama.cpp's per-tensor type choice, `metadata` the key/values,
tensor names and tokenizer as llama.cpp's own converter writes them.
"""
