"""`quantkit plan`: what a quantize run will need, from the model's config.json alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click


@click.command("plan")
@click.argument("model", required=False)
@click.option("-r", "--recipe", "recipe_name", required=True, help="Recipe name (see `quantkit recipes`) or YAML file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field (repeatable).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
              help="Where the layers would be quantized.")
@click.option("--nproc", default=1, show_default=True, type=click.IntRange(min=1), help="Data-parallel processes (quantize --nproc): host memory for all of them, time shared.")
@click.option("--activation-budget", type=click.FloatRange(min=0), metavar="GB",
              help="As for quantize [default: half the memory available now].")
@click.option("--kv-cache-gb", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="The serving KV budget (`quantkit serve --kv-cache-gb`) whose size in tokens to report.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the plan as JSON (bytes).")
def command(model, recipe_name, overrides, device, nproc, activation_budget, kv_cache_gb, json_path):
    """Parameters, checkpoint size, peak memory, disk, KV cache and time of quantizing MODEL with a recipe.

    Reads only config.json (a directory holding just it will do), so it answers for models far larger
    than this machine. Memory is the onloaded job's accounting; the time is an estimate from throughput
    measured here (about 0.2 s of probes).

    \b
    Examples:
      quantkit plan ./llama-3-70b-config --recipe gptq-w4a16
      quantkit plan smollm2-135m --recipe awq-w4a16 --json plan.json
    """
    from quantkit.flow.job import plan
    from quantkit.flow.recipe import load_recipe

    recipe = load_recipe(recipe_name, list(overrides))
    budget = None if activation_budget is None else int(activation_budget * 1e9)
    result = dataclasses.replace(plan(model, recipe, device=device, activation_budget_bytes=budget, nproc=nproc),
                                 kv_pool_bytes=int(kv_cache_gb * (1 << 30)))
    click.echo(result.format())
    if json_path:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        click.echo(f"Wrote {json_path}")
