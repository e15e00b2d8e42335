"""Where quantkit finds its shipped data (recipes, calibration and evaluation texts) and its cache."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # quantkit/ (this file is quantkit/platform/paths.py)
PROJECT_ROOT = PACKAGE_ROOT.parent  # the checkout; quantkit is installed editable by `make install`
RECIPES_DIR = PROJECT_ROOT / "recipes"
CALIBRATION_DIR = PROJECT_ROOT / "calibration_data"
EVAL_DATA_DIR = PROJECT_ROOT / "evals" / "data"
EVAL_TASKS_DIR = PROJECT_ROOT / "evals" / "tasks"  # lm-eval YAML tasks shipped with quantkit


def cache_dir() -> Path:
    """Root of quantkit's cache: $QUANTKIT_CACHE, else ~/.cache/quantkit."""
    env = os.environ.get("QUANTKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"


@contextlib.contextmanager
def cache_entry_lock(entry: Path) -> Iterator[None]:
    """Hold `entry`'s lock file (`<entry>.lock`, beside it) while it is checked and filled, so two processes
    that want the same cache entry at once (two jobs, two test workers) fill it once: the second waits, then
    finds it made. filelock (huggingface_hub's own dependency) works on every OS. A fill that fails removes
    the lock file too."""
    from filelock import FileLock

    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = entry.parent / f"{entry.name}.lock"
    with FileLock(str(lock)):
        try:
            yield
        except BaseException:
            if not entry.exists():  # a failed fill leaves no empty lock file behind (a waiting process then
                lock.unlink(missing_ok=True)  # finds no entry and tries itself, as it would have anyway)
            raise
