"""Crash reports: what an unexpected error leaves on disk instead of a traceback on the screen."""

from __future__ import annotations

import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

from quantkit.version import __version__

REPORTS = "crash-reports"  # under the cache directory


def save_report(exc: BaseException, argv: Sequence[str]) -> Path:
    """Write `exc`'s traceback with the command line and versions to a new file under the cache directory
    (a temporary directory when that cannot be written); returns the file."""
    from quantkit.platform.paths import cache_dir

    text = "".join([
        f"quantkit {__version__}, python {platform.python_version()}, {platform.platform()}\n",
        f"command: {' '.join(argv)}\n",
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n",
        *traceback.format_exception(type(exc), exc, exc.__traceback__),
    ])
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (cache_dir() / REPORTS, Path(tempfile.gettempdir()) / f"quantkit-{REPORTS}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text, encoding="utf-8")
            return folder / name
        except OSError:
            continue
    raise exc  # nowhere to write it: the traceback itself is the last resort
