"""GGUF -> Hugging Face safetensors conversion, through transformers' GGUF reader (needs `gguf`).

Linears stored as Q8_0 or Q4_0 stay quantized (`quantkit.gguf.importer`: compressed-tensors int weights
with exactly ggml's values); every other type is dequantized as transformers does it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from quantkit.version import __version__
from quantkit.errors import CheckpointError

log = logging.getLogger(__name__)


def convert_gguf(gguf_file: Path, out: Path, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                 keep: bool = True, notify=log.info) -> Path:
    """A GGUF model as a checkpoint at `out` (written atomically): Q8_0 / Q4_0 linears kept quantized
    (unless not `keep`), the rest dequantized.

    transformers' GGUF-loaded model refuses `save_pretrained`, so a fresh model is built from
    the config (without the GGUF quantization_config) and given the dequantized state dict.
    """
    from quantkit.checkpoints.atomic import check_output_free
    from quantkit.checkpoints.export import export_checkpoint

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise CheckpointError(f"GGUF file {str(gguf_file)!r} does not exist")
    check_output_free(Path(out), overwrite, protect=[gguf_file])
    try:
        import gguf  # noqa: F401  (only to say it is missing before anything is read)
    except ImportError:
        raise CheckpointError("GGUF conversion needs the 'gguf' package: pip install 'quantkit[gguf]'") from None
    reader, model, tokenizer = _read_gguf(gguf_file, dtype)
    quantized = {}
    if keep:
        from quantkit.gguf.importer import keep_quantized

        quantized, how = keep_quantized(model, reader)
        notify(f"{gguf_file.name}: linears " + ", ".join(f"{k}: {v}" for k, v in sorted(how.items())))
    with _tokenizer_dir(tokenizer) as tok_dir:
        model.generation_config.save_pretrained(tok_dir)
        marker = {"quantkit_version": __version__, "converted_from": str(gguf_file.resolve()),
                  "dtype": str(dtype).removeprefix("torch.")}
        from quantkit.checkpoints.quantization_config import build_quantization_config

        qc = build_quantization_config(model, quantized) if quantized else None
        export_checkpoint(model, Path(out), storage_dtype=dtype, source=tok_dir, overwrite=overwrite,
                          quantization_config=qc,
                          protect=[gguf_file], extra_files={"quantkit.json": json.dumps(marker, indent=2) + "\n"})
    log.info("converted %s -> %s", gguf_file, out)
    return Path(out)


def _read_gguf(gguf_file: Path, dtype: torch.dtype):
    """(the GGUF reader, a fresh model in `dtype` holding the file's dequantized tensors, its tokenizer): read by
    transformers' GGUF support; a tensor it could not place is an error, never a random one kept."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        reader = gguf.GGUFReader(str(gguf_file))  # its key/values and tensors, read (memory-mapped) once here
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        _head_dim_from_file(config, reader)
        loaded, info = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, config=config,
                                                            dtype=torch.float32, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as exc:
        raise CheckpointError(f"{gguf_file}: not a GGUF model transformers can read ({type(exc).__name__}: {exc})") from exc
    wrong = [k for k, *_ in info.get("mismatched_keys", [])] + list(info.get("missing_keys", []))
    wrong = [k for k in wrong if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if wrong:  # transformers re-initializes these at random: never a silent part-random checkpoint
        raise CheckpointError(f"{gguf_file}: transformers' GGUF reader could not place {len(wrong)} tensor(s) "
                              f"({', '.join(wrong[:4])}); this GGUF's architecture or shapes are not supported")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=False)
    model.tie_weights()
    return reader, model, tokenizer


def _head_dim_from_file(config, reader) -> None:
    """transformers' GGUF config mapping drops `attention.key_length` for some architectures (qwen3 then
    takes its default head_dim 128): set it from the file (a gguf.GGUFReader)."""
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.parts[-1][0])


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
