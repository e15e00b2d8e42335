"""`quantkit report`: one readable document about checkpoints of one model, in markdown and HTML.

It holds the evaluation table (`eval.compare`: perplexity, KLD, top-1 agreement on each text) with
its protocol, each checkpoint's size on disk and bits per weight, its recipe, two plots
(`eval.plots`: per-layer weight SQNR from quantkit.json, size against quality), and the same
greedy prompts through the original and every checkpoint side by side with the first token where
each departs from the original. The document is assembled once as a list of blocks and rendered
to both formats, so they always say the same; the directory is written atomically.
"""

from __future__ import annotations

import datetime
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from quantkit.errors import CheckpointError

DEFAULT_PROMPTS = ("It is a truth universally acknowledged, that",
                   "The capital of France is",
                   "Emma Woodhouse, handsome, clever, and rich,")
REPORT_FILES = ("report.md", "report.html", "report.json", "per_layer_error.png", "size_vs_quality.png")


# ---- what the report is about -------------------------------------------------------------------

def display_name(spec: str) -> str:
    path = Path(spec)
    return path.name if path.name else spec


def parameter_count(path: Path) -> int:
    """Stored parameters of a checkpoint (tied weights once), from the safetensors headers."""
    from safetensors import safe_open

    from quantkit.formats.checkpoint import weight_files

    total = 0
    for f in weight_files(path):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def checkpoint_facts(path: Path, parameters: int) -> dict:
    """Size on disk, bits per weight against the original's parameter count, and what quantkit.json and
    recipe.yaml record (recipe, overrides, description, quantize time, compute, per-layer errors)."""
    import yaml

    from quantkit.formats.checkpoint import weight_files

    size = sum(f.stat().st_size for f in weight_files(path))
    facts = {"file_bytes": size, "bits_per_weight": 8.0 * size / parameters if parameters else None,
             "recipe": None, "overrides": [], "description": None, "quantize_seconds": None, "compute": None,
             "layers": []}
    try:
        meta = json.loads((path / "quantkit.json").read_text())
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict):
        facts.update(recipe=meta.get("recipe"), overrides=meta.get("overrides") or [],
                     quantize_seconds=meta.get("quantize_seconds"),
                     compute=(meta.get("compute") or {}).get("dtype"), layers=meta.get("layers") or [])
    try:
        facts["description"] = (yaml.safe_load((path / "recipe.yaml").read_text()) or {}).get("description")
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    return facts


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> Optional[int]:
    """Index of the first generated token that differs from the reference's (None: none differs)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def greedy_side_by_side(specs: list[str], prompts: Sequence[str], max_new_tokens: int, dtype: str,
                        device: str) -> list[dict]:
    """Per prompt: each model's greedy continuation, and where it departs from the original's (specs[0])."""
    import gc

    from quantkit.runtime.generate import generate_batch
    from quantkit.checkpoints.loader import load, load_tokenizer
    from quantkit.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    tokenizer = load_tokenizer(specs[0])
    prompt_ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    outputs = []
    for spec in specs:  # one model in memory at a time
        model = load(spec, dtype=dtype, device=device)
        outputs.append(generate_batch(model, tokenizer, prompt_ids, params))
        del model
        gc.collect()
    table = []
    for p, prompt in enumerate(prompts):
        ref = outputs[0][p].token_ids
        rows = []
        for spec, out in zip(specs, outputs):
            c = out[p]
            at = first_divergence(ref, c.token_ids)
            rows.append({"model": display_name(spec), "text": c.text, "diverges_at": at,
                         "token": None if at is None or at >= len(c.token_ids) else tokenizer.decode([c.token_ids[at]]),
                         "original_token": None if at is None or at >= len(ref) else tokenizer.decode([ref[at]])})
        table.append({"prompt": prompt, "rows": rows})
    return table


# ---- the document ---------------------------------------------------------------------------------

@dataclass
class Block:
    kind: str  # h1, h2, p, table, img, pre
    text: str = ""
    header: tuple = ()
    rows: tuple = ()


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def blocks(data: dict) -> list[Block]:
    """The report as blocks, from the gathered data (`gather`)."""
    ev, ckpts = data["eval"], data["checkpoints"]
    datasets = [d["name"] for d in ev["protocol"]["datasets"]]
    out = [Block("h1", f"quantkit report: {len(ckpts) - 1} checkpoint(s) of {display_name(ckpts[0]['model'])}"),
           Block("p", f"Written {data['created']} by quantkit {data['quantkit_version']} on {data['machine']}.")]
    summary = (_summary(ckpts, ev["results"], datasets) if len(datasets) <= 2
               else _overview(ckpts, ev["results"]) + _domains(ckpts, ev["results"], ev["protocol"]["datasets"]))
    return (out + summary + _protocol(ev["protocol"]) + _plots(datasets[0]) + _checkpoints(ckpts)
            + _generations(data))


def _row(rows: list[dict], dataset: str, model: str) -> dict:
    return next(r for r in rows if r["dataset"] == dataset and r["model"] == model)


def _overview(ckpts: list[dict], rows: list[dict]) -> list[Block]:
    """Many texts: one line per checkpoint with its mean KLD over the texts and the text it serves worst."""
    from quantkit.eval.compare import worst_rows

    worst = {r["model"]: r for r in worst_rows(rows)}
    header = ("checkpoint", "recipe", "size MB", "bits/weight", "mean KLD over texts", "worst text", "its KLD",
              "its Δ ppl %")
    table = []
    for c in ckpts[1:]:
        mine = [r["kld_mean"] for r in rows if r["model"] == c["model"] and r.get("kld_mean") is not None]
        w = worst.get(c["model"], {})
        table.append((display_name(c["model"]), c.get("recipe") or "-", _f(c["file_bytes"] / 1e6, ".1f"),
                      _f(c["bits_per_weight"], ".2f"), _f(sum(mine) / len(mine) if mine else None, ".4f"),
                      w.get("dataset", "-"), _f(w.get("kld_mean"), ".4f"), _f(w.get("delta_pct"), "+.2f")))
    return [Block("h2", "Summary"), Block("table", header=header, rows=tuple(table))]


def _domains(ckpts: list[dict], rows: list[dict], texts: list[dict]) -> list[Block]:
    """One line per text (language, domain): each checkpoint's KLD, ppl delta and top-1."""
    header = ["text", "language", "domain", "original ppl"]
    for c in ckpts[1:]:
        header += [f"{display_name(c['model'])} KLD", "Δ ppl %", "top-1 %"]
    table = []
    for d in texts:
        line = [d["name"], d.get("language", "-"), d.get("domain", "-"), _f(_row(rows, d["name"], ckpts[0]["model"])["ppl"], ".3f")]
        for c in ckpts[1:]:
            r = _row(rows, d["name"], c["model"])
            line += [_f(r.get("kld_mean"), ".4f"), _f(r.get("delta_pct"), "+.2f"), _f(r.get("top1_pct"), ".2f")]
        table.append(tuple(line))
    return [Block("h2", "Per language and domain"), Block("table", header=tuple(header), rows=tuple(table))]


def _summary(ckpts: list[dict], rows: list[dict], datasets: list[str]) -> list[Block]:
    header = ["checkpoint", "recipe", "size MB", "bits/weight"]
    for d in datasets:
        header += [f"ppl {d}", "Δ ppl %", "KLD mean", "KLD p99", "top-1 %"]
    table = []
    for c in ckpts:
        line = [display_name(c["model"]), c.get("recipe") or ("(original)" if c["role"] == "original" else "-"),
                _f(c["file_bytes"] / 1e6, ".1f"), _f(c["bits_per_weight"], ".2f")]
        for d in datasets:
            r = next(r for r in rows if r["dataset"] == d and r["model"] == c["model"])
            original = c["role"] == "original"
            line += [_f(r["ppl"], ".3f"), "" if original else _f(r["delta_pct"], "+.2f"),
                     "" if original else _f(r["kld_mean"], ".4f"), "" if original else _f(r["kld_p99"], ".4f"),
                     "" if original else _f(r["top1_pct"], ".2f")]
        table.append(line)
    return [Block("h2", "Summary"), Block("table", header=tuple(header), rows=tuple(map(tuple, table)))]


def _protocol(p: dict) -> list[Block]:
    return [Block("h2", "Protocol"),
            Block("p", f"Token-level: the text is tokenized once by the original's tokenizer and cut into windows of "
                       f"{p['seq_len']} tokens without overlap; every position after the first of a window predicts "
                       f"the next token. BOS {'is prepended to every window' if p['bos'] else 'is not prepended'}. "
                       f"KLD is {p['kld']}; top-1 is the share of positions where the checkpoint's most likely token "
                       f"is the original's. {'; '.join(p['compute'])}."),
            Block("table", header=("text", "sha256", "tokens in text", "windows", "scored tokens"),
                  rows=tuple((d["name"], d["sha256"], str(d["text_tokens"]), str(d["windows"]),
                              str(d["scored_tokens"])) for d in p["datasets"]))]


def _plots(first_dataset: str) -> list[Block]:
    return [Block("h2", "Plots"),
            Block("img", "per_layer_error.png", header=("Per-layer weight SQNR",)),
            Block("p", "Left: weight SQNR (10 log10 of weight energy over quantization-error energy) of each "
                       "quantized linear, averaged per decoder layer. Right: each layer's output error on the "
                       "calibration activations relative to round-to-nearest's (GPTQ: Hessian-weighted error; AWQ: "
                       "the loss of the scaled against the unscaled weights), for the algorithms that record it. "
                       "Both from quantkit.json."),
            Block("img", "size_vs_quality.png", header=("Size against quality",)),
            Block("p", f"Perplexity and mean KLD on {first_dataset} against bits per weight of the whole checkpoint "
                       "(file bytes x 8 / the original's parameters; embeddings and norms included).")]


def _checkpoints(ckpts: list[dict]) -> list[Block]:
    out = [Block("h2", "Checkpoints")]
    for c in ckpts[1:]:
        facts = [f"path `{c['path']}`", f"recipe {c.get('recipe') or '-'}"]
        if c.get("overrides"):
            facts.append("overrides " + ", ".join(f"`{o}`" for o in c["overrides"]))
        if c.get("quantize_seconds") is not None:
            facts.append(f"quantized in {c['quantize_seconds']:.0f} s with compute {c.get('compute') or '-'}")
        out.append(Block("p", f"**{display_name(c['model'])}**: " + "; ".join(facts) + "."))
        if c.get("description"):
            out.append(Block("p", c["description"]))
    return out


def _generations(data: dict) -> list[Block]:
    out = [Block("h2", "Greedy generations side by side"),
           Block("p", f"The same prompts through every model, greedy, {data['max_new_tokens']} new tokens each; "
                      "'departs at' is the first generated token that differs from the original's.")]
    for g in data["generations"]:
        out.append(Block("p", f"Prompt: *{g['prompt']}*"))
        out.append(Block("table", header=("model", "continuation", "departs at"), rows=tuple(
            (r["model"], r["text"],
             "(original)" if i == 0 else ("same" if r["diverges_at"] is None else
                                          f"token {r['diverges_at']}: {r['token']!r} for {r['original_token']!r}"))
            for i, r in enumerate(g["rows"]))))
    return out


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(doc: list[Block]) -> str:
    lines = []
    for b in doc:
        if b.kind == "h1":
            lines += [f"# {b.text}", ""]
        elif b.kind == "h2":
            lines += [f"## {b.text}", ""]
        elif b.kind == "p":
            lines += [b.text, ""]
        elif b.kind == "pre":
            lines += ["```", b.text, "```", ""]
        elif b.kind == "img":
            lines += [f"![{b.header[0]}]({b.text})", ""]
        elif b.kind == "table":
            lines.append("| " + " | ".join(map(_md_cell, b.header)) + " |")
            lines.append("|" + "|".join("---" for _ in b.header) + "|")
            lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in b.rows]
            lines.append("")
    return "\n".join(lines)


def _inline(text: str) -> str:
    """Escaped text with the markdown marks this report uses (**bold**, *italic*, `code`)."""
    import re

    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)
    return re.sub(r"\*([^*]+)\*", r"<em>\1</em>", t)


def to_html(doc: list[Block]) -> str:
    title = next((b.text for b in doc if b.kind == "h1"), "quantkit report")
    body = []
    for b in doc:
        if b.kind in ("h1", "h2"):
            body.append(f"<{b.kind}>{html.escape(b.text)}</{b.kind}>")
        elif b.kind == "p":
            body.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "pre":
            body.append(f"<pre>{html.escape(b.text)}</pre>")
        elif b.kind == "img":
            body.append(f'<figure><img src="{html.escape(b.text)}" alt="{html.escape(b.header[0])}">'
                        f"<figcaption>{html.escape(b.header[0])}</figcaption></figure>")
        elif b.kind == "table":
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.4}"
             "table{border-collapse:collapse;margin:1em 0;font-size:90%}th,td{border:1px solid #ccc;padding:4px 8px;"
             "text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}code{background:#f3f3f3}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


# ---- gathering and writing ----------------------------------------------------------------------

def gather(original: str, checkpoints: list[str], evaluation: dict, prompts: Sequence[str], max_new_tokens: int,
           dtype: str, device: str) -> dict:
    """Everything the document says, as JSON-able data (written as report.json)."""
    from quantkit.platform import compute
    from quantkit.version import __version__
    from quantkit.checkpoints.resolve import resolve_model

    specs = [original] + checkpoints
    if [m["model"] for m in evaluation["models"]] != specs:
        raise CheckpointError("the evaluation results are for " + ", ".join(m["model"] for m in evaluation["models"])
                              + f", not for {', '.join(specs)}: run `quantkit eval` on the same models (in that order) "
                                "or let the report evaluate them")
    params = parameter_count(resolve_model(original))
    ckpts = []
    for i, spec in enumerate(specs):
        path = resolve_model(spec).resolve()
        facts = checkpoint_facts(path, params)
        if i == 0:
            facts.update(recipe=None, layers=[])
        ckpts.append({"model": spec, "path": str(path), "role": "original" if i == 0 else "checkpoint", **facts})
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quantkit_version": __version__,
            "machine": compute.machine_summary(),
            "parameters": params, "eval": evaluation, "checkpoints": ckpts, "max_new_tokens": max_new_tokens,
            "generations": greedy_side_by_side(specs, prompts, max_new_tokens, dtype, device) if prompts else []}


def write(out: Path, data: dict, overwrite: bool = False) -> list[Path]:
    """report.md, report.html, report.json and the PNGs in `out`, all or nothing."""
    from quantkit.version import __version__
    from quantkit.checkpoints.atomic import atomic_output_dir
    from quantkit.eval import plots

    with atomic_output_dir(out, overwrite) as tmp:
        plots.per_layer_error({display_name(c["model"]): c["layers"] for c in data["checkpoints"][1:]},
                              tmp / "per_layer_error.png")
        first = data["eval"]["protocol"]["datasets"][0]["name"]
        points = []
        for c in data["checkpoints"]:
            r = next(r for r in data["eval"]["results"] if r["dataset"] == first and r["model"] == c["model"])
            points.append({"name": display_name(c["model"]), "bits_per_weight": c["bits_per_weight"], "ppl": r["ppl"],
                           "kld_mean": None if c["role"] == "original" else r["kld_mean"]})
        plots.size_vs_quality(points, first, tmp / "size_vs_quality.png")
        doc = blocks(data)
        (tmp / "report.md").write_text(to_markdown(doc), encoding="utf-8")
        (tmp / "report.html").write_text(to_html(doc), encoding="utf-8")
        (tmp / "report.json").write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        (tmp / "quantkit.json").write_text(json.dumps({"quantkit_version": __version__, "kind": "report",
                                                       "created": data["created"]}) + "\n")
    return [Path(out) / f for f in REPORT_FILES]
