"""Atomic directory output: everything is written to a hidden sibling, then renamed into place.

`--overwrite` replaces only what quantkit wrote: an empty directory, or one holding a quantkit
output (its `quantkit.json`) and nothing but the files quantkit writes. It never replaces the
current directory, the home directory, a parent of either, or the source model. Each hidden work
directory carries a marker with its process id and that process's start time, so a later run can
tell a crashed run's leftovers (removed, and said so) from a run still in progress (left alone).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from quantkit.errors import OutputExistsError, QuantkitError

OUTPUT_MARKER = "quantkit.json"  # every quantkit output holds it
WORK_MARKER = ".quantkit-work.json"  # inside a hidden work directory while it is being written
# .NAME.tmp-*: the output being written; .NAME.old-*: the output being replaced; .NAME.act-*: a run's scratch
# files (calibration activations waiting on disk)
WORK_KINDS = ("tmp", "old", "act")
# .NAME.run: a layer-by-layer run's resumable state (`quantkit.flow.resume`); kept after the run stops, removed by
# --restart, by `quantkit clean`, or when the run finishes, never by the next run's cleanup of leftovers
RUN_SUFFIX = ".run"
UNMARKED_GRACE_SECONDS = 600  # a work directory without a marker (older quantkit) is stale after this
# what quantkit writes into an output directory (weights, config, recipe, tokenizer files; a report's files)
OUTPUT_FILES = ("config.json", OUTPUT_MARKER, "recipe.yaml", "model.safetensors", "model.safetensors.index.json",
                "model-*-of-*.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja", "chat_template.json", "*.py",
                "report.md", "report.html", "report.json", "*.png")  # `quantkit report`


class OutputWriteError(QuantkitError, OSError):
    """The output could not be written (permissions, a read-only or full filesystem)."""


def check_output_free(out: Path, overwrite: bool, protect: Sequence[Path] = ()) -> None:
    """Fail before any work is done if `out` exists and may not be replaced.

    protect: paths that must survive (the source model): `out` may be neither one of them nor a parent."""
    out = Path(out).expanduser()
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise OutputExistsError(
            f"output {str(out)!r} already exists; pass --overwrite to replace it (only an earlier quantkit "
            "output or an empty directory can be replaced), or choose another -o"
        )
    check_replaceable(out, protect)


def check_replaceable(out: Path, protect: Sequence[Path] = ()) -> None:
    """Refuse to replace anything quantkit did not write (see the module docstring)."""
    real = Path(out).expanduser().resolve()
    label = str(out)
    if not real.is_dir():
        raise OutputExistsError(f"output {label!r} is a file, not a directory; --overwrite replaces only a directory "
                                "quantkit wrote: choose another -o")
    for place, what in ((Path.cwd(), "the current directory"), (Path.home(), "your home directory")):
        place = place.resolve()
        if real == place or real in place.parents:
            raise OutputExistsError(f"--overwrite refuses to replace {label!r}: it is {what}"
                                    + ("" if real == place else " or a parent of it") + "; choose another -o")
    for path in protect:
        p = Path(path).expanduser().resolve()
        if real == p or real in p.parents:
            raise OutputExistsError(f"--overwrite refuses to replace {label!r}: it "
                                    + ("is" if real == p else "contains") + f" the source model {str(path)!r}; "
                                    "choose another -o")
    entries = sorted(real.iterdir())
    if not entries:
        return
    foreign = [e.name + ("/" if e.is_dir() else "") for e in entries
               if e.is_dir() or not any(fnmatch.fnmatchcase(e.name, p) for p in OUTPUT_FILES)]
    if not _is_quantkit_output(real):
        foreign = foreign or [e.name for e in entries]
        raise OutputExistsError(
            f"--overwrite refuses to replace {label!r}: it is not a quantkit output (no {OUTPUT_MARKER} written by "
            f"quantkit) and holds {_some(foreign)}; move those files away or choose another -o")
    if foreign:
        raise OutputExistsError(f"--overwrite refuses to replace {label!r}: besides quantkit's output it holds "
                                f"{_some(foreign)}, which quantkit did not write; move them away or choose another -o")


def _is_quantkit_output(path: Path) -> bool:
    try:
        data = json.loads((path / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "quantkit_version" in data


def _some(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_writable(out: Path) -> Path:
    """Fail now, not after the work, if nothing can be created beside `out`; returns the directory
    that will hold it (the nearest existing ancestor when parents are still to be made)."""
    existing = _existing_parent(out)
    if not existing.is_dir():
        raise OutputWriteError(f"output {str(out)!r}: {existing} is a file, not a directory")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".quantkit-probe-", dir=existing))
        probe.rmdir()
    except OSError as exc:
        raise OutputWriteError(f"output {str(out)!r}: cannot write in {existing} ({exc.strerror or exc}); "
                               "choose a writable -o") from exc
    return existing


def _existing_parent(out: Path) -> Path:
    """The nearest existing ancestor of `out`'s parent (where the output's directories would be made)."""
    existing = Path(out).expanduser().resolve().parent
    while not existing.exists():
        existing = existing.parent
    return existing


def check_free_space(out: Path, needed_bytes: int, margin: float = 1.1) -> None:
    """Fail now if the filesystem of `out` has less room than the output needs (with a margin);
    `check_writable(out)` first."""
    where = _existing_parent(out)
    free = shutil.disk_usage(where).free
    if free < needed_bytes * margin:
        raise OutputWriteError(
            f"output {str(out)!r}: the checkpoint needs about {needed_bytes / 1e9:.2f} GB but {where} has "
            f"{free / 1e9:.2f} GB free; free some space or choose another -o")


# -- work directories ---------------------------------------------------------------------------


def _process_start(pid: int) -> Optional[str]:
    """The start time of process `pid` as the kernel reports it (None: no such process, or unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # field 22: starttime in clock ticks since boot
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"  # alive, start time unknown (not Linux)


def _write_marker(work: Path, out: Path) -> None:
    pid = os.getpid()
    (work / WORK_MARKER).write_text(json.dumps({"pid": pid, "process_start": _process_start(pid),
                                                "started": time.time(), "output": str(out)}) + "\n")


@dataclass
class WorkDir:
    path: Path
    output: Path  # the output it belongs to
    kind: str  # "tmp" (being written), "old" (being replaced), "act" (scratch), "run" (a run's resumable state)
    active: bool  # its process is still running
    bytes: int

    def describe(self) -> str:
        state = "in use by a running process" if self.active else (
            "a stopped run's finished layers: `quantize --resume` continues it" if self.kind == "run"
            else "left by a process that is gone")
        return f"{self.path} ({self.kind}, {self.bytes / 1e6:.1f} MB, {state})"


def _owner_alive(work: Path) -> bool:
    try:
        data = json.loads((work / WORK_MARKER).read_text())
    except (OSError, ValueError):
        # no marker: an older quantkit's leftover, or a run between removing it and renaming
        return time.time() - work.stat().st_mtime < UNMARKED_GRACE_SECONDS
    start = _process_start(int(data.get("pid", -1)))
    return start is not None and (start == "?" or start == data.get("process_start"))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def find_work_dirs(directory: Path, output_name: Optional[str] = None) -> list[WorkDir]:
    """Hidden work directories in `directory` (of the output named `output_name`, or of any)."""
    found = []
    directory = Path(directory)
    if not directory.is_dir():
        return found
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and entry.name.startswith(".") and entry.name.endswith(RUN_SUFFIX) and \
                (output_name is None or entry.name == f".{output_name}{RUN_SUFFIX}"):
            active = (entry / WORK_MARKER).exists() and _owner_alive(entry)  # no marker: the run has stopped
            found.append(WorkDir(entry, directory / entry.name[1:-len(RUN_SUFFIX)], "run", active, _size(entry)))
            continue
        for kind in WORK_KINDS:
            prefix = f".{output_name}.{kind}-" if output_name else "."
            if entry.is_dir() and entry.name.startswith(prefix) and f".{kind}-" in entry.name:
                name = entry.name[1:].rpartition(f".{kind}-")[0]
                found.append(WorkDir(entry, directory / name, kind, _owner_alive(entry), _size(entry)))
                break
    return found


def remove_stale(work_dirs: Iterable[WorkDir]) -> list[str]:
    """Remove the work directories whose process is gone; returns what was done, one line each.

    A replaced output whose replacement never arrived (a crash between the two renames) is put back."""
    lines = []
    for w in work_dirs:
        if w.active:
            lines.append(f"left alone: {w.describe()}")
            continue
        previous = w.path / "previous"
        if w.kind == "old" and previous.is_dir() and not w.output.exists():
            os.rename(previous, w.output)
            lines.append(f"restored {w.output} from {w.path} (a run was stopped while replacing it)")
        shutil.rmtree(w.path, ignore_errors=True)
        lines.append(f"removed {w.describe()}")
    return lines


def clean_stale_for(out: Path) -> list[str]:
    """Remove stale work directories of output `out` (called before a run writes it)."""
    out = Path(out).expanduser().resolve()
    return remove_stale(w for w in find_work_dirs(out.parent, out.name) if w.kind != "run")  # a stopped run: resumable


@contextmanager
def scratch_dir(out: Path, kind: str = "act") -> Iterator[Path]:
    """A hidden, marked sibling of output `out` for a run's scratch files, removed when the block ends
    (a crashed run's is removed by the next run for the same output, or by `quantkit clean`)."""
    assert kind in WORK_KINDS
    out = Path(out).expanduser().resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent))
        _write_marker(path, out)
    except OSError as exc:
        raise OutputWriteError(f"cannot create a scratch directory next to {out}: {exc.strerror or exc}; "
                               "choose a writable -o") from exc
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False, protect: Sequence[Path] = ()) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` only if the block finishes.

    On any exception, KeyboardInterrupt included, the temporary directory is removed and an
    existing `out` is left untouched. OS errors (permissions, a full disk) become OutputWriteError.
    """
    out = Path(out).expanduser().resolve()
    check_output_free(out, overwrite, protect)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        _write_marker(tmp, out)
    except OSError as exc:
        raise OutputWriteError(f"cannot create the output {out}: {exc.strerror or exc}; choose a writable -o") from exc
    try:
        yield tmp
        (tmp / WORK_MARKER).unlink()
        _make_readable(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            _write_marker(old, out)
            os.rename(out, old / "previous")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputWriteError(f"writing {out} failed ({exc.strerror or exc}); nothing was written there"
                               + ("" if not out.exists() else ", and the existing output is untouched")) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp creates 0700; give the output the permissions a plain mkdir/open would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~umask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)
