"""What a quantize run starts from: the float checkpoint (or a model already in memory), its storage dtype,
and the calibration token ids (the recipe's mix or text, texts handed over, or token ids handed over), and the
windows held back from calibration for the per-domain check."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from quantkit.calibration import mix
from quantkit.calibration.data import load_text, make_chunks, tokenize
from quantkit.checkpoints.loader import checkpoint_dtype, load_tokenizer
from quantkit.checkpoints.resolve import resolve_model
from quantkit.errors import CalibrationDataError, QuantizationError
from quantkit.flow.recipe import Recipe
from quantkit.formats import model_config
from quantkit.formats.checkpoint import read_config

SELF = "self"  # calibration.dataset: text the model samples itself (`flow.self_calibration`)
DEFAULT_MIX = "mix-v1"


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
                        texts: Optional[Sequence[str]] = None, config: Optional[dict] = None,
                        notify: Callable[[str], None] = lambda _: None) -> list[torch.Tensor]:
    """The recipe's calibration windows, tokenized by `tokenizer` (default: the source's), in batches. A
    calibration.seq_len longer than the model's context (`config`, default the source's config.json) is refused."""
    cal = recipe.calibration
    tokenizer = _tokenizer(source, tokenizer, cal, config)
    bos = tokenizer.bos_token_id if needs_bos else None
    if texts is None and mix.is_collection(cal.dataset):
        windows = torch.cat(list(mix_windows(cal, tokenizer, bos, notify).values()))
    else:
        if cal.mix is not None:
            raise QuantizationError(f"calibration.mix sets shares of a mix's parts, but calibration.dataset "
                                    f"{cal.dataset!r} is not a mix; use dataset: mix-v1 or drop calibration.mix")
        text = "\n\n".join(texts) if texts is not None else load_text(cal.dataset, cal.text_column, cal.encoding)
        label = cal.dataset if texts is None else f"{len(texts)} text(s) given to quantize()"
        windows = make_chunks(tokenize(tokenizer, text), cal.num_samples, cal.seq_len, cal.seed, bos, label=label)
    return list(windows.split(cal.batch_size))  # [batch, seq_len] each


def _tokenizer(source: Optional[Path], tokenizer, cal, config: Optional[dict]):
    if tokenizer is None and source is None:
        raise QuantizationError("calibration needs a tokenizer: pass tokenizer= (or batches= of token ids); the model "
                                "was not loaded from a checkpoint directory whose tokenizer quantkit could use")
    raw = config if config is not None else read_config(source)
    model_config.check_length(cal.seq_len, raw, str(source or "the model"), "calibration.seq_len",
                              "use --set calibration.seq_len={limit} or less")
    return tokenizer if tokenizer is not None else load_tokenizer(source)


def mix_windows(cal, tokenizer, bos: Optional[int], notify: Callable[[str], None] = lambda _: None,
                held_back: int = 0) -> dict[str, torch.Tensor]:
    """Windows of each part of the mix `cal.dataset`: its share of `cal.num_samples` (or, with held_back > 0, that
    many windows after them in the same permutation, never calibrated on). {part name: [n, seq_len]}"""
    collection = mix.load_collection(cal.dataset)
    counts = mix.allocate(mix.weights(collection, cal.mix), cal.num_samples)
    out = {}
    for part in collection.parts:
        n = held_back or counts[part.name]  # every part is checked, also one given no share of calibration
        if n == 0:
            continue
        text, note = mix.part_text(part, tokenizer)
        if note and not held_back:
            notify(note)
        out[part.name] = make_chunks(tokenize(tokenizer, text), n, cal.seq_len, cal.seed, bos,
                                     label=f"{collection.name}/{part.name}", skip=counts[part.name] if held_back else 0)
    return out


def held_back_windows(source: Optional[Path], recipe: Recipe, needs_bos: bool, tokenizer=None,
                      config: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Per domain, `calibration.check_samples` windows that calibration did not use: {part name: [n, seq_len]}.
    From a mix, each part's windows after its calibration windows; from a single text (or `self`), that text's
    next windows (when it has them) and windows of every part of the default mix, none of which calibrated."""
    cal = recipe.calibration
    if cal.check_samples == 0:
        return {}
    tokenizer = _tokenizer(source, tokenizer, cal, config)
    bos = tokenizer.bos_token_id if needs_bos else None
    if mix.is_collection(cal.dataset):
        return mix_windows(cal, tokenizer, bos, held_back=cal.check_samples)
    out = {}
    if cal.dataset != SELF:
        try:
            text = load_text(cal.dataset, cal.text_column, cal.encoding)
            out[cal.dataset] = make_chunks(tokenize(tokenizer, text), cal.check_samples, cal.seq_len, cal.seed, bos,
                                           label=cal.dataset, skip=cal.num_samples)
        except CalibrationDataError:  # no windows to spare in that text: the mix's parts still check
            pass
    others = cal.model_copy(update={"dataset": DEFAULT_MIX, "mix": None})
    return {**out, **mix_windows(others, tokenizer, bos, held_back=cal.check_samples)}


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
