"""`python -m remnant.cli`: remnant-run, where the console script is not installed."""

from remnant.cli.run import main

main()
