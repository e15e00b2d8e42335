"""Evaluate several checkpoints on one text and tabulate perplexity deltas against the first."""

from __future__ import annotations

from typing import Optional

from quantkit.calibration.data import load_text, tokenize
from quantkit.eval.ppl import perplexity
from quantkit.registry import ARCHITECTURES


def evaluate_one(model_spec: str, text: str, seq_len: int, max_windows: Optional[int], progress: bool,
                 kv_cache_dtype: Optional[str] = None, dtype: str = "float32") -> dict:
    """dtype: float32 (the protocol) or another compute dtype / "auto" (`quantkit.compute`)."""
    from quantkit.runtime.loader import load, load_tokenizer

    model = load(model_spec, dtype=dtype)
    tokenizer = load_tokenizer(model_spec)
    model_type = model.config.model_type
    needs_bos = model_type in ARCHITECTURES and ARCHITECTURES.get(model_type).needs_bos
    bos = tokenizer.bos_token_id if needs_bos else None
    res = perplexity(model, tokenize(tokenizer, text), seq_len, max_windows, bos, progress, kv_cache_dtype)
    return {"model": model_spec, "ppl": res.ppl, "nll": res.nll, "tokens": res.tokens,
            "windows": res.windows, "bos": bos is not None, "seconds": round(res.seconds, 2),
            "dtype": model.quantkit_compute.name, "compute": model.quantkit_compute.describe()}


def evaluate_many(models: list[str], dataset: str, text_column: str, seq_len: int,
                  max_windows: Optional[int], progress: bool = True, kv_cache_dtype: Optional[str] = None,
                  dtype: str = "float32") -> list[dict]:
    """One row per model; rows after the first carry deltas against the first (the baseline)."""
    text = load_text(dataset, text_column)
    rows = [evaluate_one(m, text, seq_len, max_windows, progress, kv_cache_dtype, dtype) for m in models]
    base = rows[0]["ppl"]
    for row in rows:
        row["delta"] = row["ppl"] - base
        row["delta_pct"] = 100.0 * (row["ppl"] / base - 1.0)
    return rows


def format_table(rows: list[dict]) -> str:
    width = max(len("model"), *(len(r["model"]) for r in rows))
    lines = [f"{'model':<{width}}  {'ppl':>9}  {'delta':>9}  {'delta %':>8}  {'tokens':>7}  {'seconds':>7}"]
    for i, r in enumerate(rows):
        delta = "(baseline)" if i == 0 else f"{r['delta']:+9.3f}"
        pct = "" if i == 0 else f"{r['delta_pct']:+7.2f}%"
        lines.append(f"{r['model']:<{width}}  {r['ppl']:9.3f}  {delta:>9}  {pct:>8}  {r['tokens']:7d}  {r['seconds']:7.1f}")
    return "\n".join(lines)
