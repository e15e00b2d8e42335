"""`quantkit report`: a markdown and HTML report with plots about checkpoints of one model."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("report")
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--original", help="The unquantized model [default: the source in the first checkpoint's quantkit.json].")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("report"), show_default=True,
              help="Directory for report.md, report.html, report.json and the PNGs.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier report in --output.")
@click.option("--eval-json", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Use the results of `quantkit eval ... --json FILE` (same models) instead of evaluating again.")
@click.option("--dataset", "datasets", multiple=True, default=["eval-v1"], show_default=True,
              help="Texts to evaluate on: eval-v1 (one per language and domain), a part of it, a shipped text or a "
                   "file (repeat or comma-separate); ignored with --eval-json.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2), help="Tokens per window.")
@click.option("--max-windows", type=click.IntRange(min=0),
              help="Windows per text (0 = all) [default: 16 for a text, 4 for each part of eval-v1].")
@click.option("--max-tokens", type=click.IntRange(min=1), help="At most this many tokens of each text.")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1), help="Windows per forward.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Compute dtype for the evaluation and the generations.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where the models run; auto takes CUDA when present (and says so).")
@click.option("--prompt", "prompts", multiple=True, help="Prompts for the side-by-side greedy generations "
              "[default: three built in]; --prompt '' for none.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens generated per prompt.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def command(checkpoints, original, output, overwrite, eval_json, datasets, seq_len, max_windows, max_tokens, batch_size,
            dtype, device, prompts, max_new_tokens, no_progress):
    """A report on CHECKPOINTS against their original: the evaluation table and protocol, size and bits per
    weight, recipes, per-layer error and size-vs-quality plots, and greedy generations side by side.

    \b
    Examples:
      quantkit report ./smollm2-rtn ./smollm2-gptq ./smollm2-awq -o report
      quantkit eval ./a ./b --dataset emma,persuasion --json eval.json && quantkit report ./a ./b --eval-json eval.json
    """
    from quantkit.checkpoints.atomic import check_output_free
    from quantkit.eval.compare import evaluate, find_original
    from quantkit.eval.report import DEFAULT_PROMPTS, gather, write

    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"the report's plots need matplotlib ({exc}); install it with: "
                                   "pip install 'quantkit[eval]' (or pip install matplotlib)") from exc
    check_output_free(output, overwrite)  # before minutes of evaluation
    original, rest, how = find_original(list(checkpoints), original)
    click.echo(f"original: {original} ({how})", err=True)
    if eval_json:
        try:
            evaluation = json.loads(eval_json.read_text())
            evaluation["protocol"], evaluation["models"], evaluation["results"]
        except (ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"{str(eval_json)!r} is not the JSON of `quantkit eval --json` ({exc})",
                                     param_hint="--eval-json") from exc
    else:
        names = [n.strip() for d in datasets for n in d.split(",") if n.strip()]
        windows = "auto" if max_windows is None else (max_windows or None)
        result = evaluate(original, rest, names, seq_len, windows, max_tokens, batch_size, dtype, device,
                          progress=not no_progress)
        evaluation = result.to_json()
    chosen = DEFAULT_PROMPTS if not prompts else tuple(p for p in prompts if p)
    data = gather(original, rest, evaluation, chosen, max_new_tokens, dtype, device)
    files = write(output, data, overwrite)
    for f in files:
        click.echo(f"Wrote {f}")
