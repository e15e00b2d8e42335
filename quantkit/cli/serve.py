"""`quantkit serve`: answer OpenAI-compatible clients from any checkpoint quantkit loads."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("serve")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network (there is no authentication).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--served-model-name", help="The name clients put in `model` (default: the model directory's name).")
@click.option("--kv-cache-gb", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Memory for the paged KV cache; its size in tokens is printed at start.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per KV block.")
@click.option("--max-num-seqs", default=32, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together at most.")
@click.option("--max-batched-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Tokens per model step at most (decodes plus prefill chunks).")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests queued beyond the running ones; more are answered 503 at once.")
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse the KV blocks of shared prompt prefixes.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: e4m3 KV blocks with the checkpoint's calibrated k/v scales (1.0 where absent).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]))
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM / Ctrl-C, seconds the running requests get to finish before they are aborted.")
def command(model, host, port, served_model_name, kv_cache_gb, block_size, max_num_seqs, max_batched_tokens,
            max_waiting, no_prefix_caching, kv_cache_dtype, dtype, device, shutdown_timeout):
    """Serve MODEL (default smollm2-135m) over HTTP with the OpenAI API: /v1/completions,
    /v1/chat/completions (streaming too), /v1/models, /health, /metrics.

    \b
    Example:
      quantkit serve out/demo-smollm2-awq-w4a16
      python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \\
        print(c.completions.create(model='demo-smollm2-awq-w4a16', prompt='Emma', max_tokens=20).choices[0].text)"
    """
    from quantkit.checkpoints.loader import load, load_tokenizer
    from quantkit.checkpoints.resolve import DEFAULT_MODEL, resolve_model
    from quantkit.engine.engine import EngineConfig
    from quantkit.platform.devices import resolve
    from quantkit.serve.server import ServeOptions, run

    if max_batched_tokens < max_num_seqs:
        raise click.BadParameter(f"must be >= --max-num-seqs ({max_num_seqs}): every running request decodes one "
                                 "token per step", param_hint="--max-batched-tokens")
    config = EngineConfig(kv_cache_gb=kv_cache_gb, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_batched_tokens=max_batched_tokens, prefix_caching=not no_prefix_caching,
                          kv_cache_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype)
    where = resolve(device).device
    resolve_model(model)  # a missing model fails before anything loads
    name = served_model_name or Path(model or DEFAULT_MODEL).name.removesuffix(".gguf")
    loaded = load(model, dtype=dtype, device=where, workload="decode")
    tokenizer = load_tokenizer(model)
    click.echo(loaded.quantkit_compute.describe(), err=True)

    def ready():
        from quantkit.engine.engine import pool_blocks

        blocks = pool_blocks(loaded, config)
        click.echo(f"KV cache: {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens in "
                   f"{kv_cache_gb:g} GB ({kv_cache_dtype}); prefix caching {'off' if no_prefix_caching else 'on'}",
                   err=True)
        click.echo(f"serving {name!r} on http://{host}:{port}/v1 (SIGTERM or Ctrl-C stops)", err=True)

    run(loaded, tokenizer, name, config, ServeOptions(host, port, max_waiting, shutdown_timeout), on_ready=ready)
