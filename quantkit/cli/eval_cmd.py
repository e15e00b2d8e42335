"""`quantkit eval ppl`: perplexity of one or more checkpoints, with deltas against a baseline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click


@click.group("eval")
def command():
    """Evaluate checkpoints."""


@command.command("ppl")
@click.argument("models", nargs=-1, required=True)
@click.option("--baseline", help="Model the deltas are measured against [default: the first MODEL].")
@click.option("--dataset", default="emma", show_default=True, help="Shipped text name (emma, persuasion, ...) or a .txt/.jsonl/.parquet file.")
@click.option("--text-column", default="text", show_default=True, help="Text column for .jsonl/.parquet/hub datasets.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2), help="Tokens per window.")
@click.option("--max-windows", default=16, show_default=True, type=click.IntRange(min=0), help="Windows to score (0 = all).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the results as JSON.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: every model attends through an FP8 KV cache with its calibrated k/v scales (1.0 where absent).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Compute dtype; float32 is the protocol, auto the machine's fast dtype (faster, slightly different).")
@click.option("--encoding", default="utf-8", show_default=True, help="Encoding of a .txt dataset file.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where the models run; auto takes CUDA when present (and says so).")
@click.option("--offload", default="auto", show_default=True, type=click.Choice(["auto", "none", "disk"]),
              help="disk: keep the decoder layers on disk and load each as it runs (for models that do not fit; "
                   "slower); auto: only when a model would not fit in memory (said so).")
def ppl(models, baseline, dataset, text_column, seq_len, max_windows, json_path, no_progress, kv_cache_dtype, dtype,
        encoding, device, offload):
    """Perplexity of MODELS on a text (the protocol is in evals/PROTOCOL.md).

    \b
    Examples:
      quantkit eval ppl smollm2-135m ./smollm2-w4
      quantkit eval ppl ./q1 ./q2 --baseline smollm2-135m --max-windows 4 --json ppl.json
      quantkit eval ppl gemma3-270m --dataset persuasion --seq-len 1024
      quantkit eval ppl ./smollm2-fp8-kv --kv-cache-dtype fp8
    """
    from quantkit.eval.report import evaluate_many, format_table

    if json_path:
        check_json_path(json_path)  # before the evaluation, not after it
    names = ([baseline] if baseline else []) + [m for m in models if m != baseline]
    rows = evaluate_many(names, dataset, text_column, seq_len, max_windows or None, progress=not no_progress,
                         kv_cache_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype, dtype=dtype,
                         encoding=encoding, device=device, offload=offload)
    for line in dict.fromkeys(note for r in rows for note in r["notes"]):
        click.echo(line, err=True)
    click.echo(format_table(rows))
    if json_path:
        json_path.write_text(json.dumps({"dataset": dataset, "seq_len": seq_len, "kv_cache_dtype": kv_cache_dtype,
                                         "dtype": dtype, "results": rows}, indent=2, allow_nan=False) + "\n")
        click.echo(f"Wrote {json_path}")
    failed = [r["model"] for r in rows if r.get("error")]
    if failed:
        raise EvalFailed(f"no valid perplexity for {', '.join(failed)} (see the table)")


class EvalFailed(click.ClickException):
    exit_code = 2


def check_json_path(path: Path) -> None:
    """A --json (or report) path must be writable before minutes of evaluation are spent."""
    parent = path.expanduser().resolve().parent
    if path.is_dir():
        raise click.BadParameter(f"{str(path)!r} is a directory; give a file name", param_hint="--json")
    if not parent.is_dir():
        raise click.BadParameter(f"directory {str(parent)!r} does not exist; create it or choose another path",
                                 param_hint="--json")
    if not os.access(parent, os.W_OK):
        raise click.BadParameter(f"directory {str(parent)!r} is not writable", param_hint="--json")
