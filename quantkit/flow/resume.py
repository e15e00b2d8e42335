"""Resumable quantize runs: the state of a layer-by-layer run at each layer boundary, on disk.

A run (load mode "layers") keeps, in a hidden directory next to its output (`.NAME.run`):
- `manifest.json`: what the run is a function of (the source checkpoint's file names, sizes and
  safetensors-header hashes and its config, the resolved recipe, the calibration tokens, the
  quantkit version, the compute dtype and whether its 16-bit matmuls run widened, the device type,
  the world size, the shard size);
- one safetensors file per finished part (`head`: tensors before the decoder layers, `layer-NNNNN`,
  `tail`), holding exactly the tensors the output will hold, in the order they were made;
- `hidden.safetensors`: the calibration activations entering the first unfinished layer;
- `state.json`: how many layers are finished and what the pipeline reported for them (per-linear
  rows, quantized schemes, KV scales), replaced atomically after each layer's files are complete.

`--resume` checks the manifest (a difference is refused, naming it), restores the report and the
activations, and continues at the first unfinished layer. The output is assembled from the part
files in order, uninterrupted or resumed alike, so a resumed run writes the same bytes. A
finished run removes the directory; a stopped one leaves it, and says how to resume or discard it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from quantkit.checkpoints.atomic import RUN_SUFFIX
from quantkit.errors import QuantizationError

MANIFEST, STATE, HIDDEN = "manifest.json", "state.json", "hidden.safetensors"


class ResumeError(QuantizationError):
    """A stopped run cannot be continued as asked (or is in the way of a new one)."""


def run_dir(out: Path) -> Path:
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}{RUN_SUFFIX}"


def _header_sha(path: Path) -> str:
    """sha256 of a safetensors file's header (names, dtypes, shapes, offsets): cheap, and changes with any
    re-save; the data itself is hashed by nobody (a 140 GB checkpoint)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(min(n, 100 << 20))).hexdigest()


def fingerprint(source: Path, recipe_yaml: str, batches: Optional[list[torch.Tensor]], settings: dict) -> dict:
    """What the run's result depends on (see the module docstring)."""
    from quantkit.version import __version__
    from quantkit.formats.checkpoint import weight_files

    files = {f.name: {"bytes": f.stat().st_size, "header_sha256": _header_sha(f)} for f in weight_files(source)}
    config = source / "config.json"
    files["config.json"] = {"bytes": config.stat().st_size, "sha256": hashlib.sha256(config.read_bytes()).hexdigest()}
    tokens = None
    if batches:
        h = hashlib.sha256()
        for b in batches:
            h.update(str(tuple(b.shape)).encode())
            h.update(b.to(torch.int64).contiguous().numpy().tobytes())
        tokens = {"sha256": h.hexdigest(), "batches": len(batches), "tokens": sum(b.numel() for b in batches)}
    return {"quantkit_version": __version__, "source": str(source), "source_files": files,
            "recipe_sha256": hashlib.sha256(recipe_yaml.encode()).hexdigest(), "recipe": recipe_yaml,
            "calibration": tokens, **settings}


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "recipe" or old.get(key) == new.get(key):
            continue
        if key == "source_files":
            a, b = old.get(key) or {}, new.get(key) or {}
            for name in sorted(set(a) | set(b)):
                if name not in b:
                    out.append(f"source file {name} is gone")
                elif name not in a:
                    out.append(f"source file {name} is new")
                elif a[name] != b[name]:
                    out.append(f"source file {name} changed ({'size' if a[name]['bytes'] != b[name]['bytes'] else 'contents'})")
        elif key == "recipe_sha256":
            out.append("the recipe (or its --set overrides) changed")
        elif key == "calibration":
            out.append("the calibration data changed")
        else:
            out.append(f"{key}: {old.get(key)!r} then, {new.get(key)!r} now")
    return out


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


class PartWriter:
    """Collects one part's tensors (a ShardWriter's `add`), written as one safetensors file on `close`."""

    def __init__(self, path: Path):
        from quantkit.formats.checkpoint import _StreamedShard

        self.path = path
        self.names: list[str] = []
        self._shard = _StreamedShard(path.with_name(path.name + ".tmp"))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._shard.add(name, tensor)
        self.names.append(name)

    def close(self) -> list[str]:
        self._shard.close()
        os.replace(self._shard.path, self.path)
        return self.names


@dataclass
class RunState:
    """The work directory of one run (see the module docstring)."""

    path: Path
    manifest: dict
    finished: int = 0  # decoder layers done
    parts: dict[str, list[str]] = field(default_factory=dict)  # part -> tensor names in order
    report: dict = field(default_factory=dict)  # layers, quantized, kv_scales, kv_cache_scheme

    @classmethod
    def open(cls, out: Path, manifest: dict, resume: bool, restart: bool,
             notify: Callable[[str], None]) -> "RunState":
        from quantkit.checkpoints.atomic import WORK_MARKER, _owner_alive, _write_marker

        path = run_dir(out)
        if path.is_dir() and (path / WORK_MARKER).exists() and _owner_alive(path):
            raise ResumeError(f"another quantkit run is writing {out} right now (its work is in {path}); wait for it "
                              "or stop it first")
        if path.is_dir() and restart:
            shutil.rmtree(path)
            notify(f"--restart: discarded the stopped run in {path}")
        elif path.is_dir():
            state = _read_state(path)
            done = state.get("finished", 0)
            if not resume:
                raise ResumeError(f"a stopped run of {out} left its work in {path} ({done} layer(s) finished): "
                                  "pass --resume to continue it, or --restart to discard it and start over "
                                  f"(`quantkit clean {path.parent}` also discards it)")
            try:
                old = json.loads((path / MANIFEST).read_text())
            except (OSError, ValueError) as exc:
                raise ResumeError(f"{path / MANIFEST} cannot be read ({exc}); discard the stopped run with "
                                  "--restart") from exc
            diff = differences(old, manifest)
            if diff:
                raise ResumeError(f"cannot resume the stopped run in {path}: " + "; ".join(diff) + ". Run with the "
                                  "same source, recipe and settings, or --restart to discard it")
            _write_marker(path, Path(out))
            notify(f"resuming: {done} layer(s) of the stopped run are kept, continuing at layer {done}")
            return cls(path, manifest, done, state.get("parts", {}), state.get("report", {}))
        elif resume:
            notify(f"--resume: no stopped run of {out} to continue; starting from layer 0")
        path.mkdir(parents=True)
        _write_marker(path, Path(out))
        _atomic_json(path / MANIFEST, manifest)
        run = cls(path, manifest)
        run._save()
        return run

    def _save(self) -> None:
        _atomic_json(self.path / STATE, {"finished": self.finished, "parts": self.parts, "report": self.report})

    def part(self, name: str) -> PartWriter:
        return PartWriter(self.path / f"{name}.safetensors")

    def has(self, name: str) -> bool:
        return name in self.parts

    def keep(self, name: str, writer: PartWriter) -> None:
        """A part is complete (written to its own file, recorded with its tensor order)."""
        self.parts[name] = writer.close()
        self._save()

    def layer_done(self, index: int, hidden, report: dict) -> None:
        """Layer `index` finished: its part is kept; save the next layer's inputs, then the state."""
        if hidden is not None:
            from quantkit.formats.checkpoint import _StreamedShard

            tmp = self.path / (HIDDEN + ".tmp")
            shard = _StreamedShard(tmp)
            for i, t in enumerate(hidden):
                shard.add(f"b{i:06d}", t)
            shard.close()
            os.replace(tmp, self.path / HIDDEN)
        self.finished = index + 1
        self.report = report
        self._save()

    def hidden(self) -> Iterator[torch.Tensor]:
        """The saved inputs of the first unfinished layer, batch by batch (read lazily, one at a time)."""
        from safetensors import safe_open

        with safe_open(str(self.path / HIDDEN), "pt") as f:
            for key in sorted(f.keys()):
                yield f.get_tensor(key)

    def assemble(self, writer, order: list[str]) -> None:
        """Every kept part's tensors into `writer` (a ShardWriter), part by part in `order`."""
        from safetensors import safe_open

        for name in order:
            with safe_open(str(self.path / f"{name}.safetensors"), "pt") as f:
                for key in self.parts[name]:
                    writer.add(key, f.get_tensor(key))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        """The run stopped (an error, Ctrl-C): no process owns the directory any more."""
        from quantkit.checkpoints.atomic import WORK_MARKER

        (self.path / WORK_MARKER).unlink(missing_ok=True)

    def stopped_message(self, out: Path, total: int) -> str:
        return (f"stopped with {self.finished} of {total} layer(s) finished; they are kept in {self.path}. "
                f"Run the same command with --resume to continue from layer {self.finished}, or with --restart "
                "to discard them")


def _read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return {"finished": 0}


def layer_part(index: int) -> str:
    return f"layer-{index:05d}"
