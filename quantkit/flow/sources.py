"""What a quantize run starts from: the float checkpoint (or a model already in memory), its storage dtype,
and the calibration token ids (the recipe's text, texts handed over, or token ids handed over)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from quantkit.calibration.data import load_text, make_chunks, tokenize
from quantkit.checkpoints.loader import checkpoint_dtype, load_tokenizer
from quantkit.checkpoints.resolve import resolve_model
from quantkit.errors import QuantizationError
from quantkit.flow.recipe import Recipe
from quantkit.formats import model_config
from quantkit.formats.checkpoint import read_config


def float_source(model_spec: Optional[str]) -> tuple[Path, dict, torch.dtype]:
    """The float checkpoint to quantize: (its directory, its config.json, its storage dtype); a
    checkpoint that is already quantized is refused (quantizing it again would lose its scales)."""
    source = resolve_model(model_spec)
    raw = read_config(source)
    if raw.get("quantization_config"):
        raise QuantizationError(f"{source} is already quantized ({raw['quantization_config'].get('quant_method')}); "
                                "quantize the original float checkpoint")
    return source, raw, checkpoint_dtype(raw)


def model_source(model: nn.Module) -> tuple[Optional[Path], dict, torch.dtype]:
    """A model handed over in memory: (the checkpoint directory it came from or None, its config, the dtype it is
    stored in); a model that is already quantized is refused."""
    if getattr(getattr(model, "config", None), "quantization_config", None):
        raise QuantizationError("the model is already quantized; quantize the original float model")
    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    source = Path(name) if name and Path(name).is_dir() else None
    named = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named.removeprefix("torch."), None)
    if not (isinstance(named, torch.dtype) and named.is_floating_point):
        named = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return source, model.config.to_dict(), named


def calibration_batches(source: Optional[Path], recipe: Recipe, needs_bos: bool, tokenizer=None,
                        texts: Optional[Sequence[str]] = None, config: Optional[dict] = None) -> list[torch.Tensor]:
    """The recipe's calibration windows, tokenized by `tokenizer` (default: the source's), in batches. A
    calibration.seq_len longer than the model's context (`config`, default the source's config.json) is refused."""
    cal = recipe.calibration
    if tokenizer is None and source is None:
        raise QuantizationError("calibration needs a tokenizer: pass tokenizer= (or batches= of token ids); the model "
                                "was not loaded from a checkpoint directory whose tokenizer quantkit could use")
    raw = config if config is not None else read_config(source)
    model_config.check_length(cal.seq_len, raw, str(source or "the model"), "calibration.seq_len",
                              "use --set calibration.seq_len={limit} or less")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    text = "\n\n".join(texts) if texts is not None else load_text(cal.dataset, cal.text_column, cal.encoding)
    ids = tokenize(tokenizer, text)
    bos = tokenizer.bos_token_id if needs_bos else None
    label = cal.dataset if texts is None else f"{len(texts)} text(s) given to quantize()"
    chunks = make_chunks(ids, cal.num_samples, cal.seq_len, cal.seed, bos, label=label)
    return list(chunks.split(cal.batch_size))  # [batch, seq_len] each


def check_given_batches(batches: list[torch.Tensor], config: dict, name: str) -> None:
    """Token ids handed over for calibration fit the model's context."""
    if batches:
        model_config.check_length(max(b.shape[-1] for b in batches), config, name, "batches= of",
                                  "give batches of {limit} tokens or fewer")


def given_data(texts: Optional[Sequence[str]], batches: Optional[list[torch.Tensor]]) -> Optional[str]:
    """Calibration data handed to the run itself, in words with a digest (None: the recipe's dataset)."""
    if batches is not None:
        digest = hashlib.sha256()
        for b in batches:
            digest.update(b.detach().cpu().to(torch.int64).numpy().tobytes())
        tokens = sum(b.numel() for b in batches)
        return (f"{len(batches)} batch(es) of token ids given to quantkit.quantize() ({tokens} tokens, "
                f"sha256 {digest.hexdigest()[:16]})")
    if texts is not None:
        texts = list(texts)
        digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
        return (f"{len(texts)} text(s) given to quantkit.quantize() ({sum(len(t) for t in texts)} characters, "
                f"sha256 {digest})")
    return None


def tokenizer_file_bytes(source: Optional[Path]) -> int:
    """Size of the checkpoint's tokenizer files (what the tokenizer takes in memory scales with it)."""
    if source is None:
        return 0
    return sum((source / f).stat().st_size for f in ("tokenizer.json", "tokenizer.model") if (source / f).is_file())
