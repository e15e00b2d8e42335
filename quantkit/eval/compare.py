"""`quantkit eval`: checkpoints against their original on one or more texts, in one pass over the data.

Every model (the original first) is loaded once; each window batch runs through all of them, and
their next-token distributions are compared chunk by chunk of positions as they are computed, so
no model's logits are ever held beyond one chunk (`LOGIT_ELEMENTS` floats: 128 positions of Gemma's
262k vocabulary). Per model and dataset: perplexity, KL(original || model) mean / 99th percentile /
max, and top-1 agreement (`eval.divergence`). The protocol (token-level windows, BOS, compute
dtype, each text's sha256 and token count) is returned with the rows so tables and JSON state it.

All cheap checks run before any weights are read: models, their context limits, that every
checkpoint tokenizes each text exactly as the original does (KLD needs one vocabulary), the number
of scored tokens, and a memory estimate for holding all models at once.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.calibration import mix
from quantkit.calibration.data import load_text, tokenize
from quantkit.errors import CalibrationDataError, CheckpointError, QuantkitError
from quantkit.eval.divergence import Tally, kl_divergence, log_probs, token_nll, top1_same
from quantkit.eval.ppl import windows
from quantkit.eval.ppl_table import MIN_SCORED_TOKENS
from quantkit.platform.transformers_compat import cache_kwargs

LOGIT_ELEMENTS = 1 << 25  # floats of one logits chunk (128 MB): positions per chunk = this // vocab (Gemma: 128;
# fewer rows make the LM-head matmul markedly less efficient on CPU, 64 rows ~20% slower)
MEMORY_SHARE = 0.9  # refuse when the models would take more than this share of the available memory


AUTO_WINDOWS = {"text": 16, "part": 4}  # windows per text for max_windows="auto": a text alone, a part of a set


@dataclass
class Text:
    """One evaluation text: its name, sha256 of its UTF-8 bytes and its token ids; for a part of a shipped set,
    the set, language and domain."""

    name: str
    sha256: str
    ids: torch.Tensor  # [n]
    windows: torch.Tensor  # [n_windows, seq_len]
    facts: dict = field(default_factory=dict)  # {"collection", "language", "domain"} of a part of a set


@dataclass
class Subject:
    """A model taking part: the original (index 0) or a checkpoint."""

    spec: str
    path: Path
    vocab: int
    file_bytes: int


@dataclass
class Evaluation:
    protocol: dict
    models: list[dict]
    rows: list[dict]  # one per (dataset, model), original first within each dataset
    seconds: float
    tokens_per_second: float  # scored tokens x models / wall time of the scoring
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """What `--json` writes (and `quantkit report --eval-json` reads back)."""
        return {"protocol": self.protocol, "models": self.models, "results": self.rows,
                "seconds": round(self.seconds, 2), "tokens_per_second": round(self.tokens_per_second, 1)}


def recorded_source(spec: str) -> Optional[str]:
    """The source model a quantkit checkpoint records in its quantkit.json, when it still exists."""
    import json

    from quantkit.checkpoints.resolve import resolve_model

    try:
        meta = json.loads((resolve_model(spec) / "quantkit.json").read_text())
    except (OSError, ValueError, QuantkitError):  # not a quantkit checkpoint (or missing: said later)
        return None
    source = meta.get("source") if isinstance(meta, dict) else None
    return source if isinstance(source, str) and Path(source).is_dir() else None


def find_original(models: list[str], original: Optional[str] = None) -> tuple[str, list[str], str]:
    """(original, checkpoints, how it was found): --original when given, else the source recorded in
    the first checkpoint's quantkit.json, else the first model."""
    if original:
        return original, [m for m in models if m != original], "--original"
    source = recorded_source(models[0])
    if source:
        rest = [m for m in models if Path(m).expanduser().resolve() != Path(source).resolve()]
        return source, rest, f"the source recorded in {models[0]}/quantkit.json"
    if len(models) < 2:
        raise CheckpointError(f"{models[0]} records no source model (no quantkit.json with one); give the "
                              "unquantized model with --original MODEL, or as the first MODEL")
    return models[0], models[1:], "the first model"


def _vocab_size(raw: dict) -> Optional[int]:
    return raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")


def _subject(spec: str, seq_len: int) -> tuple[Subject, dict]:
    from quantkit.formats import model_config
    from quantkit.formats.checkpoint import read_config, weight_files
    from quantkit.checkpoints.resolve import resolve_model

    path = resolve_model(spec)
    raw = read_config(path)
    model_config.check_length(seq_len, raw, spec, "--seq-len", "use --seq-len {limit} or less")
    size = sum(f.stat().st_size for f in weight_files(path))
    return Subject(spec, path, _vocab_size(raw) or 0, size), raw


def _file_sha(path: Path) -> Optional[str]:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def expand_datasets(names: list[str]) -> list[tuple[str, Optional[mix.Part], Optional[str]]]:
    """Dataset names with each shipped set (eval-v1) expanded into its parts: (name, part or None, set name)."""
    out = []
    for name in names:
        head, _, tail = name.partition("/")
        if mix.is_collection(name):
            coll = mix.load_collection(name)
            out += [(p.name, p, coll.name) for p in coll.parts]
        elif tail and mix.is_collection(head) and not Path(name).exists():
            out.append((tail, mix.load_collection(head).part(tail), head))
        else:
            out.append((name, None, None))
    return out


def window_count(seq_len: int, max_windows, max_tokens: Optional[int], part: bool = False) -> Optional[int]:
    """Windows to score: at most max_windows ("auto": 16 for a text alone, 4 per part of a shipped set; None or
    0: all), and no more than max_tokens tokens of text in all."""
    if max_windows == "auto":
        max_windows = AUTO_WINDOWS["part" if part else "text"]
    counts = [c for c in (max_windows, max_tokens and max(max_tokens // seq_len, 0)) if c]
    if max_tokens and max_tokens < seq_len:
        raise CalibrationDataError(f"--max-tokens {max_tokens} is less than one window of {seq_len} tokens; "
                                   f"raise it or lower --seq-len")
    return min(counts) if counts else None


def prepare(original: str, checkpoints: list[str], datasets: list[str], seq_len: int, max_windows: Optional[int],
            max_tokens: Optional[int] = None, text_column: str = "text", encoding: str = "utf-8",
            dtype: str = "auto") -> tuple[list[Subject], list[Text], Optional[int]]:
    """Check everything that needs no weights; returns the subjects, the tokenized texts and the BOS id."""
    from quantkit.plugins.catalog import needs_bos as family_needs_bos
    from quantkit.checkpoints.loader import load_tokenizer

    if not datasets:
        raise CalibrationDataError("no dataset to evaluate on; pass --dataset NAME (emma, persuasion or a file)")
    expanded = expand_datasets(datasets)
    names = [name for name, _, _ in expanded]
    if len(set(names)) != len(names):
        raise CalibrationDataError(f"--dataset lists the same text twice: {', '.join(names)}")
    specs = [original] + list(checkpoints)
    seen = {}
    subjects, raws = [], []
    for spec in specs:
        s, raw = _subject(spec, seq_len)
        if s.path in seen:
            raise CheckpointError(f"{spec} and {seen[s.path]} are the same model ({s.path}); give each once")
        seen[s.path] = spec
        subjects.append(s)
        raws.append(raw)
    ref = subjects[0]
    for s in subjects[1:]:
        if s.vocab != ref.vocab:
            raise CheckpointError(f"{s.spec} has a vocabulary of {s.vocab} tokens and the original {ref.spec} "
                                  f"{ref.vocab}: KL divergence needs the same vocabulary; compare checkpoints of "
                                  f"{ref.spec} only")
    model_type = raws[0].get("model_type", "?")
    needs_bos = family_needs_bos(model_type)
    tokenizers = [load_tokenizer(s.path) for s in subjects]
    bos = tokenizers[0].bos_token_id if needs_bos else None
    ref_tokenizer = _file_sha(ref.path / "tokenizer.json")
    # the same tokenizer.json needs no second tokenization; anything else is tokenized and compared
    same_files = [ref_tokenizer is not None and _file_sha(s.path / "tokenizer.json") == ref_tokenizer
                  for s in subjects]
    texts = []
    for name, part, coll in expanded:
        facts = {"collection": coll, "language": part.language, "domain": part.domain} if part else {}
        text = mix.part_text(part, tokenizers[0])[0] if part else load_text(name, text_column, encoding)
        ids = tokenize(tokenizers[0], text)
        for s, tok, same in zip(subjects[1:], tokenizers[1:], same_files[1:]):
            if not same and not torch.equal(tokenize(tok, text), ids):
                raise CheckpointError(f"{s.spec} tokenizes {name} differently from the original {ref.spec}: "
                                      "the comparison needs the original's tokenizer; copy it into the checkpoint")
        n = window_count(seq_len, max_windows, max_tokens, part is not None)
        wins = windows(ids, seq_len, n, bos)
        scored = wins.shape[0] * (seq_len - 1)
        if scored < MIN_SCORED_TOKENS:
            raise CalibrationDataError(f"only {scored} tokens of {name} would be scored; a measurement over fewer "
                                       f"than {MIN_SCORED_TOKENS} is noise. Use a longer text, a larger --seq-len "
                                       "or more windows")
        texts.append(Text(name, hashlib.sha256(text.encode("utf-8")).hexdigest(), ids, wins, facts))
    _check_memory(subjects, dtype)
    return subjects, texts, bos


def _check_memory(subjects: list[Subject], dtype: str) -> None:
    """All models are held at once: refuse early when their files (doubled for a float32 compute of a
    16-bit checkpoint: an upper bound) would not fit."""
    from quantkit.platform.memory import available_memory

    available = available_memory()
    if not available:
        return
    factor = 2 if dtype in ("float32", "fp32") else 1
    need = sum(s.file_bytes for s in subjects) * factor
    if need > MEMORY_SHARE * available:
        raise CheckpointError(
            f"the {len(subjects)} models take about {need / 1e9:.2f} GB together in memory and "
            f"{available / 1e9:.2f} GB is available: evaluate fewer checkpoints per run (each against the "
            "same original gives the same numbers), or use --dtype auto")


def _hidden(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    if cache is None:
        return model.model(input_ids=ids, use_cache=False).last_hidden_state
    return model.model(input_ids=ids, **cache_kwargs(model.model, cache), use_cache=True).last_hidden_state


def score(models: list[nn.Module], texts: list[Text], batch_size: int = 1, kv_cache_dtype: Optional[str] = None,
          progress: Optional[Callable[[int, int], None]] = None, stride: int = 1) -> tuple[list[list[Tally]], list[float]]:
    """Tallies [text][model] and each model's seconds; models[0] is the reference for KLD and top-1.

    stride > 1 scores every stride-th predicted position of each window (the last of each stride): the models run
    on every token as always, but the head, log-softmax and divergences (most of the time at a large vocabulary)
    see 1 / stride of the positions. `quantkit eval` scores all; the quantize run's domain check a sample.

    kv_cache_dtype applies to the checkpoints (models[1:]); the reference keeps its own 16-bit cache, so
    an FP8 KV cache's loss shows as divergence from the unquantized model instead of being in both.
    progress(windows_done, windows_total) is called after each batch."""
    from quantkit.runtime.kv_cache import cache_factory

    caches = [cache_factory(m, kv_cache_dtype if i else None) for i, m in enumerate(models)]
    heads = [m.get_output_embeddings() for m in models]
    softcaps = [getattr(m.config, "final_logit_softcapping", None) for m in models]
    device = models[0].get_input_embeddings().weight.device
    vocab = heads[0].weight.shape[0]
    chunk = max(1, LOGIT_ELEMENTS // vocab)
    seconds = [0.0] * len(models)
    total = sum(t.windows.shape[0] for t in texts)
    done = 0
    out = []
    with torch.no_grad():
        for text in texts:
            tallies = [Tally() for _ in models]
            for batch in text.windows.split(batch_size):
                batch = batch.to(device)
                targets = batch[:, 1:][:, stride - 1 :: stride].reshape(-1)
                hidden = []
                for i, m in enumerate(models):
                    t0 = time.perf_counter()
                    h = _hidden(m, batch, caches[i]())
                    hidden.append(h[:, :-1][:, stride - 1 :: stride].reshape(-1, h.shape[-1]))
                    seconds[i] += time.perf_counter() - t0
                for start in range(0, targets.numel(), chunk):
                    tgt = targets[start : start + chunk]
                    t0 = time.perf_counter()
                    ref = log_probs(heads[0](hidden[0][start : start + chunk]), softcaps[0])
                    tallies[0].add(token_nll(ref, tgt))
                    seconds[0] += time.perf_counter() - t0
                    for i in range(1, len(models)):
                        t0 = time.perf_counter()
                        logp = log_probs(heads[i](hidden[i][start : start + chunk]), softcaps[i])
                        tallies[i].add(token_nll(logp, tgt), kl_divergence(ref, logp), top1_same(ref, logp))
                        seconds[i] += time.perf_counter() - t0
                        del logp
                    del ref
                done += batch.shape[0]
                if progress:
                    progress(done, total)
            out.append(tallies)
    return out, seconds


def evaluate(original: str, checkpoints: list[str], datasets: list[str], seq_len: int = 2048,
             max_windows="auto", max_tokens: Optional[int] = None, batch_size: int = 1,
             dtype: str = "auto", device: str = "cpu", offload: str = "none", kv_cache_dtype: Optional[str] = None,
             text_column: str = "text", encoding: str = "utf-8", progress: bool = False) -> Evaluation:
    """Compare `checkpoints` with `original` on `datasets`; see the module docstring."""
    from tqdm.auto import tqdm

    from quantkit.platform.devices import resolve
    from quantkit.checkpoints.loader import load
    from quantkit.runtime.offload import choose

    resolve(device)  # a missing device or a bad mode fails before any text is read
    choose(offload, 0, available=1)
    subjects, texts, bos = prepare(original, checkpoints, datasets, seq_len, max_windows, max_tokens, text_column,
                                   encoding, dtype)
    models = [load(s.path, dtype=dtype, device=device, offload=offload) for s in subjects]
    total = sum(t.windows.shape[0] for t in texts)
    bar = tqdm(total=total, desc=f"eval {len(models)} models", unit="window", disable=not progress)
    start = time.perf_counter()
    tallies, seconds = score(models, texts, batch_size, kv_cache_dtype,
                             lambda done, _: (bar.update(done - bar.n), bar.set_postfix(
                                 tok_s=f"{done * (seq_len - 1) * len(models) / (time.perf_counter() - start):.0f}")))
    bar.close()
    wall = time.perf_counter() - start
    scored = sum(t.windows.shape[0] * (seq_len - 1) for t in texts) * len(models)
    rows = []
    for text, per_model in zip(texts, tallies):
        base = per_model[0].summary()
        for i, (s, tally) in enumerate(zip(subjects, per_model)):
            row = {"dataset": text.name, "model": s.spec, "role": "original" if i == 0 else "checkpoint",
                   **tally.summary()}
            if i == 0:
                row.update(kld_mean=0.0, kld_p99=0.0, kld_max=0.0, top1_pct=100.0)
            finite = math.isfinite(row["nll"]) and math.isfinite(base["nll"])
            row["delta_ppl"] = row["ppl"] - base["ppl"] if finite else None
            row["delta_pct"] = 100.0 * (row["ppl"] / base["ppl"] - 1.0) if finite else None
            if not finite:
                row.update(ppl=None, nll=None, error="non-finite log-likelihood: the model's logits hold NaN/Inf")
            rows.append(row)
    model_info = [{"model": s.spec, "path": str(s.path), "role": "original" if i == 0 else "checkpoint",
                   "file_bytes": s.file_bytes, "compute": m.quantkit_compute.describe(),
                   "dtype": m.quantkit_compute.name, "device": str(m.quantkit_device.device),
                   "offload": m.quantkit_offload.mode, "seconds": round(sec, 2)}
                  for i, (s, m, sec) in enumerate(zip(subjects, models, seconds))]
    protocol = {
        "score": "token-level: every position after the first of a window predicts the next token",
        "seq_len": seq_len, "overlap": 0, "bos": bos is not None, "bos_id": bos,
        "kld": "KL(original || model), nats per token",
        "compute": sorted({m["compute"] for m in model_info}),
        "kv_cache_dtype": f"{kv_cache_dtype} (the checkpoints; the original as loaded)" if kv_cache_dtype else "auto",
        "batch_size": batch_size,
        "datasets": [{"name": t.name, "sha256": t.sha256, "text_tokens": t.ids.numel(),
                      "windows": t.windows.shape[0], "scored_tokens": t.windows.shape[0] * (seq_len - 1), **t.facts}
                     for t in texts],
    }
    notes = list(dict.fromkeys(m["compute"] for m in model_info))
    notes += [m.quantkit_offload.describe() for m in models if m.quantkit_offload.offloaded]
    return Evaluation(protocol, model_info, rows, wall, scored / wall if wall else float("nan"), notes)


def format_protocol(protocol: dict) -> str:
    lines = [f"protocol: token-level, windows of {protocol['seq_len']} tokens without overlap, "
             f"BOS {'prepended' if protocol['bos'] else 'not prepended'}; KLD = {protocol['kld']}; "
             f"{'; '.join(protocol['compute'])}"]
    for d in protocol["datasets"]:
        lines.append(f"  {d['name']}: sha256 {d['sha256'][:16]}, {d['text_tokens']} tokens, {d['windows']} windows, "
                     f"{d['scored_tokens']} scored")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """One block per dataset: ppl, its delta, KLD mean / p99 and top-1 agreement of each model."""
    width = max(len("model"), *(len(r["model"]) for r in rows))
    head = (f"{'model':<{width}}  {'ppl':>9}  {'delta':>8}  {'delta %':>8}  {'KLD mean':>8}  {'KLD p99':>8}  "
            f"{'top-1 %':>7}")
    lines = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        lines += [f"[{name}]", head]
        for r in (r for r in rows if r["dataset"] == name):
            if r["ppl"] is None:
                lines.append(f"{r['model']:<{width}}  {'ERROR':>9}  {r['error']}")
            elif r["role"] == "original":
                lines.append(f"{r['model']:<{width}}  {r['ppl']:9.3f}  {'(original)':>18}")
            else:
                lines.append(f"{r['model']:<{width}}  {r['ppl']:9.3f}  {r['delta_ppl']:+8.3f}  {r['delta_pct']:+7.2f}%  "
                             f"{r['kld_mean']:8.4f}  {r['kld_p99']:8.4f}  {r['top1_pct']:7.2f}")
    return "\n".join(lines)


def worst_rows(rows: list[dict]) -> list[dict]:
    """Per checkpoint, its row with the largest mean KLD (the language or domain it serves worst)."""
    out = {}
    for r in rows:
        if r["role"] == "checkpoint" and r.get("kld_mean") is not None and math.isfinite(r["kld_mean"]):
            if r["model"] not in out or r["kld_mean"] > out[r["model"]]["kld_mean"]:
                out[r["model"]] = r
    return list(out.values())


def format_domains(rows: list[dict], protocol: dict) -> str:
    """With several texts: one line per text (its language and domain) with each checkpoint's mean KLD and ppl
    delta, the worst text of each checkpoint marked, then one line per checkpoint naming it."""
    facts = {d["name"]: d for d in protocol["datasets"]}
    if len(facts) < 2:
        return ""
    models = list(dict.fromkeys(r["model"] for r in rows if r["role"] == "checkpoint"))
    worst = {r["model"]: r["dataset"] for r in worst_rows(rows)}
    width = max(len(n) for n in facts)
    lines = ["per language and domain: mean KLD (ppl delta %), * the worst of each checkpoint",
             f"{'text':<{width}}  {'lang':<5} {'domain':<9}  " + "  ".join(f"{(Path(m).name or m)[-22:]:>22}" for m in models)]
    for name, d in facts.items():
        cells = []
        for m in models:
            r = next((r for r in rows if r["dataset"] == name and r["model"] == m), None)
            if r is None or r.get("kld_mean") is None or r.get("delta_pct") is None:
                cells.append(f"{'ERROR':>22}")
                continue
            mark = "*" if worst.get(m) == name else " "
            cells.append(f"{r['kld_mean']:.4f}{mark} ({r['delta_pct']:+6.2f}%)".rjust(22))
        lines.append(f"{name:<{width}}  {d.get('language', '-'):<5} {d.get('domain', '-'):<9}  " + "  ".join(cells))
    for m in models:
        if m in worst:
            r = next(r for r in rows if r["model"] == m and r["dataset"] == worst[m])
            lines.append(f"worst for {m}: {worst[m]} (KLD {r['kld_mean']:.4f}, ppl {r['delta_pct']:+.2f}%, top-1 "
                         f"{r['top1_pct']:.1f}%)")
    return "\n".join(lines)
