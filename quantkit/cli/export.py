"""`quantkit export`: write a checkpoint in another runtime's format (GGUF for llama.cpp, GPTQ, AWQ)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("export")
def command():
    """Export a checkpoint to another format."""


@command.command("gguf")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output file (.gguf).")
@click.option("--type", "file_type", type=click.Choice(["q4_0", "q4_1", "q8_0", "q4_k_m", "f16"], case_sensitive=False), default=None,
              help="GGUF file type. Default: the grid the checkpoint was quantized on (gptq-q4_0 -> q4_0, gptq-q4_k_m -> "
                   "q4_k_m); a float checkpoint needs it (then rounded to nearest, as llama-quantize without an imatrix).")
@click.option("--tokenizer-pre", default=None, metavar="NAME",
              help="llama.cpp's pre-tokenizer name for this tokenizer (default: looked up; 'default' if unknown).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--requantize", is_flag=True,
              help="Round quantized weights on no GGUF grid (group size other than 32, act-order groups) again to nearest "
                   "on their tensor's type, listing each (default: refuse them).")
def gguf(checkpoint, output, file_type, tokenizer_pre, overwrite, requantize):
    """Write CHECKPOINT as one GGUF file for llama.cpp.

    Weights quantized on a GGUF grid (recipes gptq-q4_0, awq-q4_0, gptq-q4_1, gptq-q8_0, gptq-q4_k_m, and any int4 /
    int8 group-32 checkpoint: Q4_0, Q4_1 or Q8_0) are written code for code; embeddings and the output matrix get
    llama.cpp's type for them, rounded to nearest.

    \b
    Example:
      quantkit quantize smollm2-135m --recipe gptq-q4_0 -o ./smollm2-q4_0
      quantkit export gguf ./smollm2-q4_0 -o smollm2-q4_0.gguf
    """
    from quantkit.checkpoints.to_gguf import export_gguf

    export_gguf(checkpoint, output, file_type, overwrite, tokenizer_pre, notify=click.echo, requantize=requantize)


@command.command("gptq")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--checkpoint-format", "fmt", type=click.Choice(["gptq", "gptq_v2"]), default="gptq", show_default=True,
              help="gptq: AutoGPTQ's v1 (stores zero - 1; cannot hold a zero point of 0); gptq_v2: GPTQModel's.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory (an earlier quantkit output).")
def gptq(checkpoint, output, fmt, overwrite):
    """Write the int-quantized compressed-tensors CHECKPOINT as a GPTQ checkpoint (qweight, qzeros, scales, g_idx).

    Codes and scales are carried over unchanged; a grid the layout cannot hold is refused, naming the linear.

    \b
    Example:
      quantkit quantize smollm2-135m --recipe gptq-w4a16 -o ./smollm2-gptq
      quantkit export gptq ./smollm2-gptq -o ./smollm2-gptq-autogptq
    """
    from quantkit.checkpoints.foreign_io import export_foreign

    export_foreign(checkpoint, output, "gptq", 1 if fmt == "gptq" else 2, overwrite, notify=click.echo)
    click.echo(f"Wrote {output}")


@command.command("awq")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory (an earlier quantkit output).")
def awq(checkpoint, output, overwrite):
    """Write the 4-bit int compressed-tensors CHECKPOINT as an AWQ GEMM checkpoint (qweight, qzeros, scales).

    Codes and scales are carried over unchanged; other bit widths and act-order groups are refused.

    \b
    Example:
      quantkit quantize smollm2-135m --recipe awq-w4a16 -o ./smollm2-awq
      quantkit export awq ./smollm2-awq -o ./smollm2-autoawq
    """
    from quantkit.checkpoints.foreign_io import export_foreign

    export_foreign(checkpoint, output, "awq", overwrite=overwrite, notify=click.echo)
    click.echo(f"Wrote {output}")
