"""The `quantkit` command line: a click group whose commands live in the sibling modules."""

from __future__ import annotations

import logging
import signal
import sys

import click

from quantkit.version import __version__
from quantkit.errors import QuantkitError


class _Group(click.Group):
    """Prints QuantkitError as a one-line error (exit 2) instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantkit")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """quantkit: quantize LLMs into compressed-tensors checkpoints, evaluate and run them.

    \b
    Examples:
      quantkit models fetch smollm2-135m
      quantkit quantize --recipe rtn-w4a16 --set stages.0.scheme.group_size=64 -o smollm2-w4
      quantkit eval ppl smollm2-135m smollm2-w4
      quantkit generate smollm2-w4 "It is a truth universally acknowledged"
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


def run() -> None:
    """The `quantkit` program (console script, `python -m quantkit`): `main` with SIGTERM unwinding like
    Ctrl-C. Installed here, not in `main`, so a host that invokes `main` in its own process (a test
    runner, a notebook) keeps its own SIGTERM handling."""
    _terminate_cleanly()
    main()


def _terminate_cleanly() -> None:
    """SIGTERM (kill, a scheduler's stop) unwinds like Ctrl-C: work directories are removed on the way out."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)


def _register() -> None:
    from quantkit.cli import (clean, convert, doctor, eval_cmd, export, generate, models, plan, plugins, quantize,
                              recipes, report)

    for module in (clean, convert, doctor, eval_cmd, export, generate, models, plan, plugins, quantize, recipes, report):
        main.add_command(module.command)
    main.add_command(generate.chat_command)


_register()
