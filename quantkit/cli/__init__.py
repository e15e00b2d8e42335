"""The `quantkit` command line: a click group whose commands live in the sibling modules."""

from __future__ import annotations

import logging
import signal
import sys

import click

from quantkit.version import __version__
from quantkit.errors import QuantkitError


INTERNAL_ERROR = 70  # EX_SOFTWARE: a fault of quantkit's, not of the input


class _Group(click.Group):
    """No stack traces on the screen: an error quantkit can name (QuantkitError) is one line and exit 2;
    anything else is a short "internal error" line naming the file its traceback was saved to, and exit 70.
    click's own usage errors, Ctrl-C and exits pass through as click makes them."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(2)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001  (the guard's purpose: nothing else reaches the screen)
            from quantkit.platform.crash import save_report

            report = save_report(exc, sys.argv)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            click.echo(f"Internal error: {type(exc).__name__}{': ' + first[:300] if first else ''}\n"
                       f"This is a fault in quantkit, not in your input. The traceback is in {report}; "
                       "please attach it to a bug report.", err=True)
            sys.exit(INTERNAL_ERROR)


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
                              recipes, report, serve)

    for module in (clean, convert, doctor, eval_cmd, export, generate, models, plan, plugins, quantize, recipes, report,
                   serve):
        main.add_command(module.command)
    main.add_command(generate.chat_command)


_register()
