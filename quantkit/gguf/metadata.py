"""What llama.cpp's `convert_hf_to_gguf.py` writes besides the weights, for the architectures quantkit
exports: hyperparameter keys, tensor names (gguf-py's own name map), the tensor transforms (llama's
q/k row order for ggml's RoPE, Gemma's norm + 1, Gemma's embedding rows cut to the real vocabulary)
and the tokenizer (BPE as "gpt2": tokens, token types, merges, special ids, chat template).

llama.cpp picks a BPE pre-tokenizer by name; its converter finds the name by hashing a tokenization.
Here the name comes from a fingerprint of tokenizer.json's normalizer and pre_tokenizer (`PRE_NAMES`,
each entry measured against llama.cpp's converter on this machine), or from the user (`--tokenizer-pre`);
an unknown tokenizer gets "default" and a warning, since llama.cpp may then split text differently.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from quantkit.errors import CheckpointError

log = logging.getLogger(__name__)

ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3_text": "GEMMA3"}  # model_type -> MODEL_ARCH

# sha256 of {"normalizer", "pre_tokenizer"} of tokenizer.json -> llama.cpp's pre-tokenizer name
PRE_NAMES = {
    "11032a73bb79f61a7aa18b0d862909452f989d72cd0fff483463f7aac8ae7b2c": "smollm",  # SmolLM2
    # Gemma 3 from its GGUF through transformers (tokenizer.json, no tokenizer.model): llama.cpp's converter
    # hashes it to this name
    "ce116cc681eb3125efb9aff186f4f4123e9839dc5f1005080a824d1588454df3": "granite-embed-multi-311m",
}


def gguf_arch(model_type: str):
    import gguf

    if model_type not in ARCHES:
        raise CheckpointError(f"GGUF export supports model types {', '.join(ARCHES)}; this checkpoint is "
                              f"{model_type!r}")
    return getattr(gguf.MODEL_ARCH, ARCHES[model_type])


def arch_key(model_type: str) -> str:
    import gguf

    return gguf.MODEL_ARCH_NAMES[gguf_arch(model_type)]


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def write_hparams(writer, config: dict, file_type: int, name: str) -> None:
    """The hyperparameter keys llama.cpp's converter writes for these architectures."""
    mt = config["model_type"]
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 131072 if mt == "gemma3_text" else 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    rope = config.get("rope_parameters") or {}
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    theta = full.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(theta)
    if mt == "gemma3_text":
        local = (rope.get("sliding_attention") or {}).get("rope_theta", config.get("rope_local_base_freq"))
        if local is not None:
            writer.add_rope_freq_base_swa(local)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    if config.get("head_dim") is not None or mt == "gemma3_text":
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_file_type(file_type)
    if mt == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim(config))
    if mt == "gemma3_text":
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1 and config.get("sliding_window") is not None:
            writer.add_sliding_window(config["sliding_window"])
    writer.add_quantization_version(2)


def tensor_namer(model_type: str, n_layers: int) -> Callable[[str], Optional[str]]:
    """HF name -> GGUF name (None: not a tensor llama.cpp has, e.g. rotary caches)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf_arch(model_type), n_layers)

    def name(hf: str) -> Optional[str]:
        return names.get_name(hf, try_suffixes=(".weight", ".bias"))

    return name


def row_order(hf_name: str, config: dict, rows: int) -> Optional[np.ndarray]:
    """llama's q_proj / k_proj rows reordered for ggml's RoPE (the converter's `permute`), else None.
    Rows are whole output channels, so quantized rows (codes and their scales) move with them."""
    if config["model_type"] != "llama" or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    heads = config["num_attention_heads"]
    if hf_name.endswith("k_proj.weight"):
        heads = config.get("num_key_value_heads", heads)
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def float_transform(hf_name: str, config: dict, tensor, source: Path):
    """Gemma 3: its RMSNorm multiplies by (1 + w), llama.cpp's by w; its embedding rows stop at the real
    vocabulary (tokens + added tokens of tokenizer.json)."""
    if config["model_type"] != "gemma3_text":
        return tensor
    if hf_name.endswith("norm.weight"):
        return tensor.float() + 1.0
    if hf_name.endswith("embed_tokens.weight"):
        return tensor[: real_vocab(source)]
    return tensor


def real_vocab(source: Path) -> int:
    tok = json.loads((Path(source) / "tokenizer.json").read_text(encoding="utf-8"))
    return len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))


def pre_fingerprint(source: Path) -> str:
    tok = json.loads((Path(source) / "tokenizer.json").read_text(encoding="utf-8"))
    key = json.dumps({"normalizer": tok.get("normalizer"), "pre_tokenizer": tok.get("pre_tokenizer")}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def write_tokenizer(writer, source: Path, config: dict, pre: Optional[str] = None,
                    notify: Callable[[str], None] = log.warning) -> str:
    """A BPE tokenizer as llama.cpp's converter writes it ("gpt2" model); returns the pre-tokenizer name."""
    import gguf
    from transformers import AutoTokenizer

    source = Path(source)
    if not (source / "tokenizer.json").is_file():
        raise CheckpointError(f"{source}: GGUF export needs tokenizer.json (a fast BPE tokenizer)")
    model = json.loads((source / "tokenizer.json").read_text(encoding="utf-8")).get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"{source}: tokenizer model {model.get('type')!r}; GGUF export writes BPE tokenizers")
    tokenizer = AutoTokenizer.from_pretrained(source)
    vocab_size = config.get("vocab_size", len(tokenizer.vocab))
    if pre is None:
        pre = PRE_NAMES.get(pre_fingerprint(source))
        if pre is None:
            pre = "default"
            notify(f"{source}: a tokenizer llama.cpp's pre-tokenizer table was not matched against here: writing "
                   "pre-tokenizer 'default' (llama.cpp may split text differently); give --tokenizer-pre NAME "
                   "with the name llama.cpp's convert_hf_to_gguf.py picks for it")
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(source, load_merges=True)
    if special.add_special_token.get("bos") is None and tokenizer.bos_token_id is not None:
        # newer converters read it from the post-processor: whether encoding puts BOS first
        special.add_special_token["bos"] = tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
    special.add_to_gguf(writer, quiet=True)
    return pre


def _looks_special(token: str) -> bool:
    """Added tokens not marked special that llama.cpp's converter still writes as control tokens."""
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>")) \
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>")) \
        or (token.startswith("<unused") and token.endswith(">"))
