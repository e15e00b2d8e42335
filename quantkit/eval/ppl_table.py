"""Evaluate several checkpoints on one text and tabulate perplexity deltas against the first.

Everything that can fail cheaply is checked for every model before any is scored (the model
directories, their tokenizers, the window length against each context limit, the number of tokens
that would be scored), so a bad last argument never discards minutes of work on the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from quantkit.calibration.data import load_text, tokenize
from quantkit.errors import CalibrationDataError, CheckpointError
from quantkit.eval.ppl import perplexity, windows
from quantkit.plugins.catalog import needs_bos as family_needs_bos

MIN_SCORED_TOKENS = 100  # a perplexity over fewer tokens is noise, not a measurement


@dataclass
class Prepared:
    """A model checked and its evaluation text tokenized, before any weights are read."""

    spec: str
    path: Path
    ids: torch.Tensor  # [n] token ids of the text
    bos: Optional[int]  # prepended to every window (Gemma), or None


def prepare(model_spec: str, text: str, seq_len: int, max_windows: Optional[int],
            min_tokens: int = MIN_SCORED_TOKENS) -> Prepared:
    """Resolve `model_spec`, read its config and tokenizer, tokenize `text` and check the windows."""
    from quantkit.formats import model_config
    from quantkit.formats.checkpoint import read_config
    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.checkpoints.loader import load_tokenizer

    path = resolve_model(model_spec)
    raw = read_config(path)
    model_config.check_length(seq_len, raw, model_spec, "--seq-len", "use --seq-len {limit} or less")
    tokenizer = load_tokenizer(path)
    model_type = raw.get("model_type", "?")
    needs_bos = family_needs_bos(model_type)
    bos = tokenizer.bos_token_id if needs_bos else None
    ids = tokenize(tokenizer, text)
    scored = windows(ids, seq_len, max_windows, bos).shape[0] * (seq_len - 1)
    if scored < min_tokens:
        raise CalibrationDataError(
            f"only {scored} tokens of the text would be scored for {model_spec}; a perplexity over fewer than "
            f"{min_tokens} is noise. Use a longer text, a larger --seq-len or --max-windows")
    return Prepared(model_spec, path, ids, bos)


def evaluate_one(model_spec: str, text: str, seq_len: int, max_windows: Optional[int], progress: bool,
                 kv_cache_dtype: Optional[str] = None, dtype: str = "float32",
                 prepared: Optional[Prepared] = None, device: str = "cpu", offload: str = "none") -> dict:
    """One model's row. dtype: float32 (the protocol) or another compute dtype / "auto" (`quantkit.platform.compute`).
    A non-finite perplexity gives ppl None and an `error` saying so."""
    from quantkit.checkpoints.loader import load

    p = prepared or prepare(model_spec, text, seq_len, max_windows, min_tokens=1)
    model = load(p.path, dtype=dtype, device=device, offload=offload)
    res = perplexity(model, p.ids, seq_len, max_windows, p.bos, progress, kv_cache_dtype)
    row = {"model": model_spec, "ppl": res.ppl, "nll": res.nll, "tokens": res.tokens,
           "windows": res.windows, "bos": p.bos is not None, "seconds": round(res.seconds, 2),
           "dtype": model.quantkit_compute.name, "compute": model.quantkit_compute.describe(),
           "device": str(model.quantkit_device.device), "offload": model.quantkit_offload.mode,
           "notes": [model.quantkit_compute.describe()] + (
               [model.quantkit_offload.describe()] if model.quantkit_offload.offloaded else [])}
    if not math.isfinite(res.nll):
        row.update(ppl=None, nll=None, error=f"non-finite perplexity ({res.nll}): the model's logits hold NaN/Inf")
    return row


def evaluate_many(models: list[str], dataset: str, text_column: str, seq_len: int,
                  max_windows: Optional[int], progress: bool = True, kv_cache_dtype: Optional[str] = None,
                  dtype: str = "float32", encoding: str = "utf-8", device: str = "cpu",
                  offload: str = "none") -> list[dict]:
    """One row per model; rows after the first carry deltas against the first (the baseline).
    Every model is checked (`prepare`) before the first is scored."""
    from quantkit.platform.devices import resolve

    from quantkit.runtime.offload import choose

    resolve(device)  # a missing device or a bad offload mode fails before the text is read
    choose(offload, 0, available=1)
    text = load_text(dataset, text_column, encoding)
    prepared = [prepare(m, text, seq_len, max_windows) for m in models]
    rows = [evaluate_one(p.spec, text, seq_len, max_windows, progress, kv_cache_dtype, dtype, p, device, offload)
            for p in prepared]
    base = rows[0]["ppl"]
    for p, row in zip(prepared, rows):
        unlike = _unlike(prepared[0], p)
        ok = base is not None and row["ppl"] is not None and unlike is None
        row["delta"] = row["ppl"] - base if ok else None
        row["delta_pct"] = 100.0 * (row["ppl"] / base - 1.0) if ok else None
        if unlike:
            row["delta_note"] = unlike
    return rows


def _unlike(base: Prepared, other: Prepared) -> Optional[str]:
    """Why `other`'s perplexity cannot be compared with `base`'s (None: same tokens, same windows): a
    perplexity is per token, and two tokenizations of one text have different tokens."""
    if other is base or (torch.equal(other.ids, base.ids) and other.bos == base.bos):
        return None
    how = f"{other.ids.numel()} tokens against {base.ids.numel()}" if other.ids.numel() != base.ids.numel() \
        else "the same number of tokens, other ids" if other.bos == base.bos else "one prepends BOS, the other not"
    return (f"no delta: {other.spec} tokenizes the text differently from {base.spec} ({how}), so the two "
            "perplexities are per token of different tokens and not comparable")


def format_table(rows: list[dict]) -> str:
    width = max(len("model"), *(len(r["model"]) for r in rows))
    lines = [f"{'model':<{width}}  {'ppl':>9}  {'delta':>9}  {'delta %':>8}  {'tokens':>7}  {'seconds':>7}"]
    for i, r in enumerate(rows):
        if r["ppl"] is None:
            lines.append(f"{r['model']:<{width}}  {'ERROR':>9}  {r['error']}")
            continue
        delta = "(baseline)" if i == 0 else ("n/a *" if r.get("delta_note") else "-" if r["delta"] is None
                                             else f"{r['delta']:+9.3f}")
        pct = "" if i == 0 or r["delta_pct"] is None else f"{r['delta_pct']:+7.2f}%"
        lines.append(f"{r['model']:<{width}}  {r['ppl']:9.3f}  {delta:>9}  {pct:>8}  {r['tokens']:7d}  {r['seconds']:7.1f}")
    lines += [f"* {r['delta_note']}" for r in rows if r.get("delta_note")]
    return "\n".join(lines)
