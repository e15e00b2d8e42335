"""`quantkit clean`: list and remove the hidden work directories that crashed or killed runs left."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("clean")
@click.argument("directories", nargs=-1, type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def command(directories, dry_run):
    """Remove leftovers of stopped runs (.NAME.tmp-* / .NAME.old-* / .NAME.act-*) and stopped runs'
    resumable state (.NAME.run) in DIRECTORIES [default: .].

    A work directory whose run is still going is left alone. A run stopped while replacing an
    output had moved the old output aside: it is put back. Removing a .NAME.run discards the layers
    a stopped run finished (`quantize --resume` would have continued from them).

    \b
    Examples:
      quantkit clean
      quantkit clean ./out --dry-run
    """
    from quantkit.checkpoints.atomic import find_work_dirs, remove_stale

    found = [w for d in (directories or (Path("."),)) for w in find_work_dirs(d)]
    if not found:
        click.echo("no work directories left by stopped runs")
        return
    if dry_run:
        for w in found:
            click.echo(("would remove " if not w.active else "left alone: ") + w.describe())
        return
    for line in remove_stale(found):
        click.echo(line)
