"""GGUF -> Hugging Face safetensors conversion, through transformers' GGUF reader (needs `gguf`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from quantkit import __version__
from quantkit.errors import CheckpointError

log = logging.getLogger(__name__)


def convert_gguf(gguf_file: Path, out: Path, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Dequantize a GGUF model into a float checkpoint at `out` (written atomically).

    transformers' GGUF-loaded model refuses `save_pretrained`, so a fresh model is built from
    the config (without the GGUF quantization_config) and given the dequantized state dict.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.atomic import check_output_free
    from quantkit.export import export_checkpoint

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise CheckpointError(f"GGUF file {str(gguf_file)!r} does not exist")
    check_output_free(Path(out), overwrite, protect=[gguf_file])
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise CheckpointError("GGUF conversion needs the 'gguf' package: pip install 'quantkit[gguf]'") from None
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as exc:
        raise CheckpointError(f"{gguf_file}: not a GGUF model transformers can read ({type(exc).__name__}: {exc})") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=False)
    model.tie_weights()
    with _tokenizer_dir(tokenizer) as tok_dir:
        model.generation_config.save_pretrained(tok_dir)
        marker = {"quantkit_version": __version__, "converted_from": str(gguf_file.resolve()),
                  "dtype": str(dtype).removeprefix("torch.")}
        export_checkpoint(model, Path(out), storage_dtype=dtype, source=tok_dir, overwrite=overwrite,
                          protect=[gguf_file], extra_files={"quantkit.json": json.dumps(marker, indent=2) + "\n"})
    log.info("converted %s -> %s", gguf_file, out)
    return Path(out)


class _tokenizer_dir:
    """A temporary directory holding the saved tokenizer, to copy into the checkpoint."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __enter__(self) -> Path:
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="quantkit-tok-")
        path = Path(self._tmp.name)
        self.tokenizer.save_pretrained(path)
        return path

    def __exit__(self, *exc) -> None:
        self._tmp.cleanup()
