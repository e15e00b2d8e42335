"""`quantkit export`: write a checkpoint in another runtime's format (GGUF for llama.cpp)."""

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
def gguf(checkpoint, output, file_type, tokenizer_pre, overwrite):
    """Write CHECKPOINT as one GGUF file for llama.cpp.

    Weights quantized on a GGUF grid (recipes gptq-q4_0, awq-q4_0, gptq-q4_1, gptq-q8_0, gptq-q4_k_m) are written
    code for code; embeddings and the output matrix get llama.cpp's type for them, rounded to nearest.

    \b
    Example:
      quantkit quantize smollm2-135m --recipe gptq-q4_0 -o ./smollm2-q4_0
      quantkit export gguf ./smollm2-q4_0 -o smollm2-q4_0.gguf
    """
    from quantkit.checkpoints.to_gguf import export_gguf

    export_gguf(checkpoint, output, file_type, overwrite, tokenizer_pre, notify=click.echo)
