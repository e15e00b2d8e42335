"""`quantkit convert`: turn other model formats (GGUF, GPTQ, AWQ) into Hugging Face safetensors checkpoints."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("convert")
def command():
    """Convert models from other formats."""


@command.command("gguf")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--dequantize", is_flag=True, help="Dequantize Q8_0 / Q4_0 linears too (default: kept quantized).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
def gguf(file, output, dtype, dequantize, overwrite):
    """Convert the GGUF model FILE into a safetensors checkpoint.

    Linears stored as Q8_0 or Q4_0 stay quantized (compressed-tensors int8 / int4 group 32 with the
    file's exact values), Q4_1, Q5_0, Q4_K and Q6_K keep their blocks (quantkit's ggml-blocks format, exact;
    quantkit and `export gguf` read it, vLLM does not); other types are dequantized to --dtype. The
    command says which went which way.

    \b
    Example:
      quantkit convert gguf SmolLM2-135M-Instruct.Q4_1.gguf -o ./smollm2
    """
    import torch

    from quantkit.checkpoints.from_gguf import convert_gguf

    convert_gguf(file, output, getattr(torch, dtype), overwrite, keep=not dequantize, notify=click.echo)
    click.echo(f"Wrote {output}")


def _foreign_command(method: str, label: str):
    @command.command(method)
    @click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
    @click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output directory.")
    @click.option("--overwrite", is_flag=True, help="Replace an existing output directory (an earlier quantkit output).")
    def run(checkpoint, output, overwrite):
        from quantkit.checkpoints.foreign_io import convert_foreign

        convert_foreign(checkpoint, output, method, overwrite, notify=click.echo)
        click.echo(f"Wrote {output}")

    run.__doc__ = (f"Convert the {label} checkpoint CHECKPOINT to compressed-tensors, without requantizing.\n\n"
                   "The packed codes, scales and zero points are carried over: the dequantized weights are identical, "
                   "and vLLM, transformers and quantkit load the result. Act-order GPTQ (a non-contiguous g_idx) "
                   "has no compressed-tensors layout: quantkit loads it as it is instead.\n\n"
                   f"\b\nExample:\n  quantkit convert {method} ./model-{method} -o ./model-ct")
    return run


gptq = _foreign_command("gptq", "GPTQ (AutoGPTQ / GPTQModel, v1 or v2)")
awq = _foreign_command("awq", "AWQ (AutoAWQ GEMM)")
