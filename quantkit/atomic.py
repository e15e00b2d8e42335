"""Atomic directory output: everything is written to a hidden sibling, then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantkit.errors import OutputExistsError


def check_output_free(out: Path, overwrite: bool) -> None:
    """Fail before any work is done if `out` exists and may not be replaced."""
    if out.exists() and not overwrite:
        raise OutputExistsError(
            f"output {str(out)!r} already exists; pass --overwrite to replace it, or choose another -o"
        )


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` only if the block finishes.

    On any exception, KeyboardInterrupt included, the temporary directory is removed and an
    existing `out` is left untouched.
    """
    out = Path(out).expanduser().resolve()
    check_output_free(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _make_readable(tmp)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "previous")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


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
