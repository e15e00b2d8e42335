"""`quantkit eval`: checkpoints against their original (ppl, KLD, top-1) on several texts in one pass;
`eval ppl` (perplexity only, the float32 protocol) and `eval tasks` (lm-eval-harness)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click


class _DefaultCompare(click.Group):
    """`quantkit eval MODEL...` is `quantkit eval compare MODEL...`; subcommand names still win."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["compare", *args]
        return super().parse_args(ctx, args)


@click.group("eval", cls=_DefaultCompare)
def command():
    """Evaluate checkpoints: `quantkit eval CKPT...` compares them with their original (perplexity,
    KL divergence, top-1 agreement); `eval ppl` is perplexity alone; `eval tasks` runs lm-eval tasks."""


@command.command("compare")
@click.argument("models", nargs=-1, required=True)
@click.option("--original", help="The unquantized model [default: the source in the first checkpoint's "
              "quantkit.json, else the first MODEL].")
@click.option("--dataset", "datasets", multiple=True, default=["eval-v1"], show_default=True,
              help="eval-v1 (the shipped set: one text per language and domain), one of its parts (eval-v1/manual-zh), "
                   "a shipped text (emma, persuasion) or a .txt/.jsonl/.parquet file; repeat or comma-separate for "
                   "several, all scored in the same pass.")
@click.option("--text-column", default="text", show_default=True, help="Text column for .jsonl/.parquet files.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2), help="Tokens per window.")
@click.option("--max-windows", type=click.IntRange(min=0),
              help="Windows per dataset (0 = all) [default: 16 for a text, 4 for each part of eval-v1].")
@click.option("--max-tokens", type=click.IntRange(min=1), help="At most this many tokens of each text.")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1), help="Windows per forward.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Compute dtype; auto is the machine's fast one (docs: its difference from float32), float32 the "
                   "protocol of `eval ppl`.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where the models run; auto takes CUDA when present (and says so).")
@click.option("--offload", default="none", show_default=True, type=click.Choice(["auto", "none", "disk"]),
              help="disk: each model's decoder layers load from disk as they run (slow; for models that do not fit).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: every checkpoint attends through an FP8 KV cache with its calibrated k/v scales; the "
                   "original stays the 16-bit reference.")
@click.option("--encoding", default="utf-8", show_default=True, help="Encoding of .txt dataset files.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write protocol, models and rows as JSON.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def compare(models, original, datasets, text_column, seq_len, max_windows, max_tokens, batch_size, dtype, device,
            offload, kv_cache_dtype, encoding, json_path, no_progress):
    """Compare checkpoints with their original: perplexity, KL divergence (mean, 99th percentile) and top-1
    agreement, on every dataset, in one pass over the data.

    \b
    Examples:
      quantkit eval ./smollm2-w4 ./smollm2-awq
      quantkit eval ./smollm2-w4 --original smollm2-135m --dataset emma,persuasion --json eval.json
      quantkit eval ./gemma-w4 --max-windows 4 --dtype float32
    """
    from quantkit.eval.compare import evaluate, find_original, format_domains, format_protocol, format_table

    if json_path:
        check_json_path(json_path)
    names = [n.strip() for d in datasets for n in d.split(",") if n.strip()]
    original, checkpoints, how = find_original(list(models), original)
    click.echo(f"original: {original} ({how})", err=True)
    windows = "auto" if max_windows is None else (max_windows or None)
    result = evaluate(original, checkpoints, names, seq_len, windows, max_tokens, batch_size, dtype,
                      device, offload, None if kv_cache_dtype == "auto" else kv_cache_dtype, text_column, encoding,
                      progress=not no_progress)
    for line in result.notes:
        click.echo(line, err=True)
    click.echo(format_protocol(result.protocol))
    click.echo(format_table(result.rows))
    domains = format_domains(result.rows, result.protocol)
    if domains:
        click.echo(domains)
    click.echo(f"{result.tokens_per_second:.0f} tokens/s over {len(result.models)} models, {result.seconds:.1f} s")
    if json_path:
        json_path.write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
        click.echo(f"Wrote {json_path}")
    failed = [f"{r['model']} on {r['dataset']}" for r in result.rows if r.get("error")]
    if failed:
        raise EvalFailed(f"no valid result for {', '.join(failed)} (see the table)")


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
    from quantkit.eval.ppl_table import evaluate_many, format_table

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


class DocumentLimit(click.ParamType):
    """lm-eval's --limit: a fraction of each task's documents in (0, 1), or a whole number of them (1 or more)."""

    name = "limit"

    def convert(self, value, param, ctx):
        try:
            limit = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number: use a fraction in (0, 1) or a whole number of documents", param, ctx)
        if not (0 < limit < 1 or (limit >= 1 and limit.is_integer())):
            self.fail(f"{value!r}: use a fraction in (0, 1) or a whole number of documents (1 or more)", param, ctx)
        return limit


@command.command("tasks")
@click.argument("model")
@click.option("--tasks", "task_names", required=True,
              help="Comma-separated lm-eval tasks: shipped offline ones (austen = austen_cloze, austen_next_word, "
                   "austen_ppl) or lm-eval's own (their data comes from the hub).")
@click.option("--limit", type=DocumentLimit(), help="At most this many documents per task (or a fraction below 1).")
@click.option("--num-fewshot", type=click.IntRange(min=0), help="Few-shot examples per prompt [default: the task's].")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1), help="Requests per forward.")
@click.option("--max-length", type=click.IntRange(min=2), help="Tokens per request [default: the context, at most 2048].")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Compute dtype (auto: the machine's fast one).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where the model runs; auto takes CUDA when present (and says so).")
@click.option("--offload", default="auto", show_default=True, type=click.Choice(["auto", "none", "disk"]),
              help="disk: decoder layers load from disk as they run (for models that do not fit).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: generation attends through an FP8 KV cache with the checkpoint's scales.")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A directory of your own lm-eval YAML tasks.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for few-shot sampling and sampling.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write lm-eval's results as JSON.")
def tasks(model, task_names, limit, num_fewshot, batch_size, max_length, dtype, device, offload, kv_cache_dtype,
          include_path, seed, json_path):
    """Task accuracy of MODEL through lm-eval-harness, with quantkit's runner as the model.

    \b
    Examples:
      quantkit eval tasks ./smollm2-w4 --tasks austen
      quantkit eval tasks smollm2-135m --tasks austen_cloze --limit 50 --json tasks.json
      quantkit eval tasks ./q --tasks hellaswag,arc_easy     # where the hub is reachable
    """
    if json_path:
        check_json_path(json_path)
    try:
        from lm_eval.utils import make_table

        from quantkit.eval import tasks as tasks_mod
    except ImportError as exc:
        raise click.ClickException(f"lm-eval is not installed ({exc}); install it with: pip install 'quantkit[eval]' "
                                   "(or pip install lm-eval)") from exc
    names = [t.strip() for t in task_names.split(",") if t.strip()]
    results = tasks_mod.run(model, names, limit, batch_size, num_fewshot, dtype, device, offload, include_path,
                            max_length, seed, None if kv_cache_dtype == "auto" else kv_cache_dtype)
    click.echo(results["quantkit"]["compute"], err=True)
    click.echo(make_table(results))
    if json_path:
        keep = {k: results[k] for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples", "quantkit")
                if k in results}
        json_path.write_text(json.dumps(keep, indent=2, default=str) + "\n")
        click.echo(f"Wrote {json_path}")


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
