"""The report's PNG plots (matplotlib, drawn off-screen): per-layer quantization error, size against quality.

Pure drawing: the callers pass plain numbers (`eval.report` gathers them from quantkit.json files
and evaluation rows), so every plot can be drawn from a test's made-up data.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


# what each algorithm records of its output error relative to plain round-to-nearest on the same
# calibration inputs (< 1: better than RTN): GPTQ's Hessian-weighted error, AWQ's scaled-vs-unscaled loss
OUTPUT_ERROR_KEYS = ("hessian_error_vs_rtn", "awq_error_vs_unscaled")


def by_layer(layers: list[dict], key: str) -> dict[int, list[float]]:
    """A quantkit.json "layers" value (e.g. sqnr_db) of each quantized linear, grouped by decoder layer
    index (from the module name); key "output_error" takes the first of OUTPUT_ERROR_KEYS recorded."""
    out: dict[int, list[float]] = defaultdict(list)
    for entry in layers:
        m = LAYER_INDEX.search(entry.get("name", ""))
        keys = OUTPUT_ERROR_KEYS if key == "output_error" else (key,)
        value = next((entry[k] for k in keys if isinstance(entry.get(k), (int, float))), None)
        if m and value is not None:
            out[int(m.group(1))].append(float(value))
    return dict(sorted(out.items()))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; PNG only
    import matplotlib.pyplot as plt

    return plt


def short_names(names: list[str]) -> dict[str, str]:
    """Names without the prefix they all share (`gemma3-270m-rtn-w4a16` -> `rtn-w4a16`), for labels."""
    if len(names) < 2:
        return {n: n for n in names}
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind("-") + 1] if "-" in prefix else ""
    return {n: (n[len(prefix):] or n) for n in names}


def colors(names: list[str]) -> dict[str, tuple]:
    """One color per checkpoint, the same in every panel and plot (in the order given)."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def per_layer_error(layers: dict[str, list[dict]], path: Path) -> Path:
    """Left: mean weight SQNR per decoder layer; right: mean output error relative to RTN per layer, for
    the checkpoints whose algorithm records one. One line per checkpoint (layers: name -> quantkit.json layers)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, (ax_w, ax_o) = plt.subplots(1, 2, figsize=(12, 5.2), sharex=True)
    short, color = short_names(list(layers)), colors(list(layers))
    drawn = False
    for name, entries in layers.items():
        sqnr, output = by_layer(entries, "sqnr_db"), by_layer(entries, "output_error")
        label = short[name]
        if not output:
            rtn = entries and all(e.get("algorithm") == "rtn" for e in entries)
            label += " (RTN: 1 on the right by definition)" if rtn else " (records no output error)"
        if sqnr:
            ax_w.plot(list(sqnr), [sum(v) / len(v) for v in sqnr.values()], marker="o", markersize=3,
                      color=color[name], label=label)
        if output:
            ax_o.plot(list(output), [sum(v) / len(v) for v in output.values()], marker="o", markersize=3,
                      color=color[name])
            drawn = True
    ax_w.set_title("weight SQNR (higher: weights closer)")
    ax_w.set_ylabel("weight SQNR, mean of the linears (dB)")
    ax_o.set_title("output error on calibration data relative to RTN (lower is better)")
    ax_o.set_ylabel("output error / RTN's, mean of the linears")
    if drawn:
        ax_o.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax_o.set_yscale("log")
    for ax in (ax_w, ax_o):
        ax.set_xlabel("decoder layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.legend(*ax_w.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Per-layer quantization error (from each checkpoint's quantkit.json). GPTQ trades weight error "
                 "for output error:\nits weight SQNR is lower than RTN's while its outputs are closer", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def size_vs_quality(points: list[dict], dataset: str, path: Path) -> Path:
    """points: {"name", "bits_per_weight", "ppl", "kld_mean"}, the original first: perplexity and KLD against
    bits per weight. Checkpoints keep the colors `per_layer_error` gives them (same order)."""
    plt = _pyplot()
    fig, (ax_ppl, ax_kld) = plt.subplots(1, 2, figsize=(12, 5.2), sharex=True)
    checkpoints = [p["name"] for p in points[1:]]
    short, color = short_names(checkpoints), colors(checkpoints)
    for p in points:
        original = p is points[0]
        c = "black" if original else color[p["name"]]
        label = p["name"] + " (original)" if original else short[p["name"]]
        if p.get("ppl") is not None:
            ax_ppl.scatter(p["bits_per_weight"], p["ppl"], marker="*" if original else "o", s=140 if original else 45,
                           color=c, label=label, zorder=3)
        if not original and p.get("kld_mean") is not None:
            ax_kld.scatter(p["bits_per_weight"], p["kld_mean"], s=45, color=c, zorder=3)
    ax_ppl.set_ylabel(f"perplexity on {dataset} (lower is better)")
    ax_kld.set_ylabel(f"mean KL divergence from the original on {dataset} (nats)")
    kld = [p["kld_mean"] for p in points if p.get("kld_mean")]
    if kld and max(kld) / min(kld) > 20:
        ax_kld.set_yscale("log")
    for ax in (ax_ppl, ax_kld):
        ax.set_xlabel("checkpoint bits per weight (file bytes x 8 / parameters)")
        ax.grid(alpha=0.3)
    fig.legend(*ax_ppl.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Size against quality")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
