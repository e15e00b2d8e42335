"""`python -m quantkit ...`: the same command line as the `quantkit` script (and what torchrun runs)."""

from quantkit.cli import run

if __name__ == "__main__":
    run()
