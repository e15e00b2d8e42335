"""`quantkit plugins`: what is registered, and where it came from."""

from __future__ import annotations

import click


@click.command("plugins")
def command():
    """List registered algorithms, formats and architectures with their source.

    \b
    Example:
      quantkit plugins
    """
    from quantkit.plugins import catalog  # noqa: F401  (registers the built-ins)
    from quantkit.core.registry import ALGORITHMS, ARCHITECTURES, FORMATS

    for registry in (ALGORITHMS, FORMATS, ARCHITECTURES):
        click.echo(f"{registry.kind}s:")
        for entry in registry.entries():
            click.echo(f"  {entry.name:<16} {entry.source}")
