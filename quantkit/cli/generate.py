"""`quantkit generate`: stream text from any checkpoint quantkit can load."""

from __future__ import annotations

import click

DEFAULT_PROMPT = "It is a truth universally acknowledged"


@click.command("generate")
@click.argument("model", required=False)
@click.argument("prompt", required=False)
@click.option("-n", "--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("-t", "--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: keep the KV cache on the FP8 grid with the checkpoint's k/v scales (1.0 where absent).")
def command(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, kv_cache_dtype):
    """Generate a continuation of PROMPT with MODEL (default smollm2-135m), streamed to the terminal.

    \b
    Examples:
      quantkit generate ./smollm2-w4 "It is a truth universally acknowledged"
      quantkit generate smollm2-135m "Write a haiku about tea" --chat -t 0.7 --top-p 0.9
    """
    from quantkit.runtime.generate import SamplingConfig, generate
    from quantkit.runtime.loader import load, load_tokenizer

    prompt = prompt if prompt is not None else DEFAULT_PROMPT
    m = load(model)
    tokenizer = load_tokenizer(model)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    cfg = SamplingConfig(max_new_tokens, temperature, top_k, top_p, seed)
    if not chat:
        click.echo(prompt, nl=False)
    result = generate(m, tokenizer, list(ids), cfg, on_text=lambda s: click.echo(s, nl=False),
                      kv_cache_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype)
    click.echo()
    click.echo(f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}, prefill {result.prefill_seconds:.2f} s, "
               f"decode {result.decode_tokens_per_second:.1f} tok/s]", err=True)
