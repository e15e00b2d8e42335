"""`quantkit doctor`: what this machine is, and how a model would decode on it, measured now."""

from __future__ import annotations

import click


@click.command("doctor")
@click.argument("model", required=False)
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Plan for this compute dtype (auto: the one `generate` would choose).")
@click.option("--cached", is_flag=True, help="Print the cached figures (measuring only what is missing) instead of "
                                             "measuring every figure again.")
@click.option("--bandwidth/--no-bandwidth", default=True, show_default=True,
              help="Also measure the read bandwidth (a sum over 1 GiB): the roofline of a decode step.")
def command(model, dtype, cached, bandwidth):
    """Measure how MODEL decodes here: every layer kind it has (dense, packed int4 with its group size, FP8,
    ...) timed in each candidate compute dtype and kernel, at one token and at prefill chunks; the plan
    `quantkit generate` then uses (the figures are cached per machine and torch version). MODEL defaults
    to smollm2-135m.

    \b
    Examples:
      quantkit doctor smollm2-w4
      quantkit doctor smollm2-w4 --dtype bfloat16 --cached
    """
    from quantkit.platform import compute
    from quantkit.kernels.roofline import read_bandwidth
    from quantkit.checkpoints.loader import decode_plan_for

    click.echo(compute.machine_summary())
    click.echo(_native_line())
    if bandwidth:
        click.echo(f"read bandwidth {read_bandwidth('cpu') / 1e9:.1f} GB/s (a sum over a 1 GiB float32 buffer, best of 6)")
    choice, plan = decode_plan_for(model, None if dtype == "auto" else dtype, remeasure=not cached)
    click.echo(choice.describe())
    for row in plan.table():
        click.echo(row)
    limits = ", ".join(f"{k.key()}: {'dequantize always' if n == 0 else f'op up to {n} tokens'}"
                       for k, n in sorted(plan.op_tokens.items(), key=lambda kv: kv[0].key()))
    if limits:
        click.echo(f"int4 prompts: {limits}")


def _native_line() -> str:
    """Whether quantkit's own one-token CPU kernels are built and which of them may run here."""
    from quantkit.kernels import cpu_int4, native

    if native.module() is None:
        return f"native CPU kernels: not in use ({native.reason()})"
    int4 = cpu_int4.native_reason()
    return "native CPU kernels: bf16 GEMV" + ("; int4 GEMV" if int4 is None else f"; no int4 GEMV ({int4})") + \
        " (each used where the probe or the plan below measured it faster)"
