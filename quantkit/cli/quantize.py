"""`quantkit quantize`: run a recipe on a model and write a compressed-tensors checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click


@click.command("quantize")
@click.argument("model", required=False)
@click.option("-r", "--recipe", "recipe_name", required=True, help="Recipe name (see `quantkit recipes`) or YAML file.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output directory [default: ./<model>-<recipe>].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field, e.g. stages.0.scheme.group_size=64 (repeatable).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--no-progress", is_flag=True, help="Hide the per-layer progress bar.")
@click.option("--zero-nonfinite", is_flag=True, help="Replace NaN/Inf in the source weights with 0 (said loudly) instead of refusing.")
@click.option("--load", "load_mode", type=click.Choice(["layers", "whole"]), default="layers", show_default=True,
              help="layers: read each decoder layer from disk just before its turn and write it out right after "
                   "(memory: about one layer); whole: load the model into memory first. Same files either way.")
@click.option("--max-shard-size", default=2.0, show_default=True, type=click.FloatRange(min=0.001),
              help="GB per output safetensors shard (an index json lists them).")
@click.option("--trust-remote-code", is_flag=True,
              help="Keep the source config's auto_map and copy its .py files (quantkit itself never runs them).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where each layer is calibrated and quantized; auto takes CUDA when present (and says so). "
                   "Only the layer at work and its activations go there; a device asked for and missing is an error.")
@click.option("--activation-budget", type=click.FloatRange(min=0), metavar="GB",
              help="Calibration activations kept in memory at most; batches beyond it wait on disk next to the "
                   "output [default: half the memory available when calibration starts].")
@click.option("--no-memory-check", is_flag=True,
              help="Start even when the plan says the run needs more memory than is available.")
@click.option("--resume", is_flag=True, help="Continue a stopped run of this output at its first unfinished layer "
              "(refused, with what differs, if the source, recipe or settings changed).")
@click.option("--restart", is_flag=True, help="Discard a stopped run of this output and start over.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes calibrating data-parallel on this machine (launched with torch's torchrun; gloo on "
                   "CPU, one GPU each with nccl). Same as `torchrun --nproc-per-node N -m quantkit quantize ...`.")
@click.option("--dist-timeout", type=click.FloatRange(min=1), default=600, show_default=True, metavar="SECONDS",
              help="Distributed runs: how long a rank waits for the others before failing (a rank that died or hangs).")
@click.option("--model-free", is_flag=True,
              help="Quantize tensor by tensor from the safetensors files, building no model (data-free recipes: rtn-*, "
                   "nvfp4a16, mxfp8, fp8-dynamic, or rtn with --set stages.0.scheme=MXFP4 / FP8_BLOCK ...); any "
                   "architecture, memory of one block of rows.")
def command(model, recipe_name, output, overrides, overwrite, no_progress, zero_nonfinite, load_mode, max_shard_size,
            trust_remote_code, device, activation_budget, no_memory_check, resume, restart, nproc, dist_timeout,
            model_free):
    """Quantize MODEL (local directory, demo name or hub id; default smollm2-135m).

    \b
    Examples:
      quantkit quantize --recipe rtn-w4a16 --set stages.0.scheme.group_size=64
      quantkit quantize ./my-llama --recipe rtn-w8a16 -o ./my-llama-w8
      quantkit quantize gemma3-270m --recipe my-recipe.yaml --overwrite
      quantkit quantize ./any-model --recipe fp8-dynamic --model-free

    --overwrite replaces only an earlier quantkit output (or an empty directory), never the current
    or home directory, the source model, or a directory holding files quantkit did not write.
    """
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    recipe = load_recipe(recipe_name, list(overrides))  # a bad recipe fails here, before any process starts
    if model_free:
        return _model_free(model, recipe, output, overwrite)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        raise SystemExit(_launch(nproc))
    if nproc > 1 and int(os.environ["WORLD_SIZE"]) != nproc:
        raise click.BadParameter(f"--nproc {nproc} inside a torchrun world of {os.environ['WORLD_SIZE']} processes",
                                 param_hint="--nproc")
    report = quantize(model, recipe, output, overwrite=overwrite, progress=not no_progress,
                      notify=lambda line: click.echo(line, err=True), zero_nonfinite=zero_nonfinite,
                      trust_remote_code=trust_remote_code, load_mode=load_mode,
                      max_shard_bytes=int(max_shard_size * 1e9), device=device,
                      activation_budget_bytes=None if activation_budget is None else int(activation_budget * 1e9),
                      memory_check=not no_memory_check, resume=resume, restart=restart, dist_timeout_s=dist_timeout)
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 reports for a distributed run
    _print_summary(report, recipe)


def _model_free(model, recipe, output, overwrite: bool) -> None:
    """--model-free: the recipe tensor by tensor over the shards (`flow.model_free`)."""
    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.flow.job import default_output
    from quantkit.flow.model_free import quantize_model_free

    source = resolve_model(model)
    out = quantize_model_free(source, recipe, Path(output) if output else default_output(source, recipe),
                              overwrite, notify=click.echo)
    click.echo(f"Wrote {out}")


def _print_summary(report, recipe) -> None:
    """What a quantize run did: layers, SQNR, the calibrated stages' error ratios, fallbacks, where it wrote."""
    layers = report.result.layers
    click.echo(f"Quantized {len(layers)} linear layers of {report.source} with recipe {recipe.name} "
               f"in {report.seconds:.1f} s")
    if layers:
        worst = sorted(layers, key=lambda r: r["sqnr_db"])[:3]
        mean = sum(r["sqnr_db"] for r in layers) / len(layers)
        click.echo(f"Weight SQNR: mean {mean:.2f} dB; lowest: " +
                   ", ".join(f"{r['name']} {r['sqnr_db']:.2f} dB" for r in worst))
    ratios = [r["hessian_error_vs_rtn"] for r in layers if r.get("hessian_error_vs_rtn") is not None]
    if ratios:
        click.echo(f"Hessian-weighted error relative to RTN: mean {sum(ratios) / len(ratios):.3f}, "
                   f"worst {max(ratios):.3f} (below 1 = better than round-to-nearest)")
    awq = [r["awq_error_vs_unscaled"] for r in layers if r.get("awq_error_vs_unscaled") is not None]
    if awq:
        clip = [r["awq_clip_mean"] for r in layers if "awq_clip_mean" in r]
        click.echo(f"AWQ block-output error relative to unscaled quantization: mean {sum(awq) / len(awq):.3f}, "
                   f"worst {max(awq):.3f}" + (f"; mean clip factor {sum(clip) / len(clip):.3f}" if clip else ""))
    fallbacks = [r["name"] for r in layers if r.get("fallback")]
    if fallbacks:
        click.echo(f"WARNING: {len(fallbacks)} layer(s) fell back to RTN: {', '.join(fallbacks)}", err=True)
    click.echo(report.closing_line())
    click.echo(f"Wrote {report.output}")
    if report.domain_warning:
        click.echo(report.domain_warning, err=True)


def _launch(nproc: int) -> int:
    """Run this same command under torch's launcher with `nproc` processes (standalone: one machine);
    its exit status, naming a failed rank (the launcher stops the others when one fails)."""
    argv = sys.argv[1:]
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            args.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "quantkit", *args]
    click.echo(f"launching {nproc} processes: {' '.join(cmd[1:])}", err=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode
