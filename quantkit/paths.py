"""Where quantkit finds its shipped data (recipes, calibration and evaluation texts) and its cache."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_ROOT.parent  # the checkout; quantkit is installed editable by `make install`
RECIPES_DIR = PROJECT_ROOT / "recipes"
CALIBRATION_DIR = PROJECT_ROOT / "calibration_data"
EVAL_DATA_DIR = PROJECT_ROOT / "evals" / "data"
EVAL_TASKS_DIR = PROJECT_ROOT / "evals" / "tasks"  # lm-eval YAML tasks shipped with quantkit


def cache_dir() -> Path:
    """Root of quantkit's cache: $QUANTKIT_CACHE, else ~/.cache/quantkit."""
    env = os.environ.get("QUANTKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"
