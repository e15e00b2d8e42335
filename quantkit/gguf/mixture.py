"""Which ggml type each tensor gets, as llama.cpp's `llama-quantize` chooses for a file type (ftype):
the default type, except the output matrix (or the token embedding that doubles as it) in Q6_K, or
Q8_0 where a row is not a whole number of the default type's blocks; then llama.cpp's fallback where
a row is not a whole number of the chosen type's blocks (Q6_K -> Q8_0, a 32-weight type -> F16).
Norms, biases and other 1-D tensors stay F32. Mirrors llama.cpp's rules without an importance
matrix (with one, llama.cpp also moves the first eighth of ffn_down to Q4_1 for Q4_0). Q4_K_M: Q4_K,
with attn_v and ffn_down in Q6_K on the layers llama.cpp's `use_more_bits` picks (the first and last
eighth, and every third between)."""

from __future__ import annotations

BLOCK_SIZE = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256, "F16": 1, "F32": 1}
FILE_TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q4_K_M": "MOSTLY_Q4_K_M",
              "F16": "MOSTLY_F16"}  # ftype -> gguf.LlamaFileType
DEFAULT_TYPE = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q8_0": "Q8_0", "Q4_K_M": "Q4_K"}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's type when a row is not whole super-blocks


def use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def is_quantizable(gguf_name: str, ndim: int) -> bool:
    """llama.cpp quantizes 2-D weights only, never norms."""
    return ndim >= 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name


def tensor_type(gguf_name: str, shape: tuple[int, ...], ftype: str, tied: bool, n_layers: int = 0) -> str:
    """The ggml type of one tensor (shape in torch order: [rows, cols], cols = ggml's ne[0])."""
    if ftype not in FILE_TYPES:
        raise ValueError(f"GGUF file type {ftype!r}: use one of {', '.join(FILE_TYPES)}")
    if not is_quantizable(gguf_name, len(shape)):
        return "F32" if len(shape) < 2 or gguf_name.endswith(("_norm.weight", ".bias")) else "F16"
    if ftype == "F16":
        return "F16"
    cols = shape[-1]
    kind = DEFAULT_TYPE[ftype]
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        if cols % BLOCK_SIZE[kind]:
            kind = "Q8_0"
        elif kind != "Q8_0":
            kind = "Q6_K"
    elif ftype == "Q4_K_M" and gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        if use_more_bits(int(gguf_name.split(".")[1]), n_layers):
            kind = "Q6_K"
    if cols % BLOCK_SIZE[kind]:
        kind = FALLBACK.get(kind, kind)
        if cols % BLOCK_SIZE[kind]:
            kind = "F16"
    return kind
