"""`python -m quantkit ...`: the same command line as the `quantkit` script (and what torchrun runs)."""

from quantkit.cli import main

if __name__ == "__main__":
    main()
