"""Turn a MODEL argument (local dir, demo name, hub id) into a local checkpoint directory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from quantkit.errors import ModelNotFoundError
from quantkit.checkpoints.demo import DEMO_MODELS, demo_model_dir

DEFAULT_MODEL = "smollm2-135m"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(spec: Optional[str]) -> Path:
    """A local directory with config.json for `spec` (a .gguf file: its converted checkpoint); None means the
    default demo model."""
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_checkpoint(path)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model path {spec!r} is not a model directory (no config.json in it)")
        return path
    if spec in DEMO_MODELS:
        cached = demo_model_dir(spec)
        if (cached / "config.json").is_file():
            return cached
        raise ModelNotFoundError(f"demo model {spec!r} is not downloaded yet; run: quantkit models fetch {spec}")
    if spec.startswith((".", "/", "~")) or not HUB_ID.match(spec):
        raise ModelNotFoundError(
            f"model path {spec!r} does not exist (demo models: {', '.join(DEMO_MODELS)}; "
            "hub ids look like org/name)"
        )
    return _download_from_hub(spec)


def gguf_checkpoint(file: Path) -> Path:
    """A GGUF file as a checkpoint directory: converted once (Q8_0 / Q4_0 linears kept exact,
    `quantkit.checkpoints.from_gguf`) into quantkit's cache, keyed by the file's path, size and mtime."""
    import hashlib
    import logging

    from quantkit.checkpoints.from_gguf import convert_gguf
    from quantkit.platform.paths import cache_dir, cache_entry_lock

    st = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    with cache_entry_lock(out):  # another process converting the same file: wait for it, then reuse
        if (out / "config.json").is_file():
            return out
        log = logging.getLogger(__name__)
        log.warning("%s: converting the GGUF file once into %s (Q8_0 / Q4_0 linears kept exact)", file, out)
        convert_gguf(file, out, notify=log.info)
    return out


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        )
    except Exception as exc:  # offline, unknown repo, gated repo...
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local directory, and fetching it from the Hugging Face Hub failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no details'}). "
            "This machine may be offline: download the model where there is network access and pass "
            "its local directory instead."
        ) from exc
    return Path(local)
