"""The command line: every command Remnant ships, one module each, and the only package
that imports Hydra or argparse. Library modules take plain dataclasses and arguments.

Hydra's commands (conf/ composed into remnant.config's dataclasses):
- run: `remnant-run` (`python -m remnant.cli`), one run or a sweep (-m);
- frontier: `remnant-frontier`, the highest load meeting an SLO;
- capture: `remnant-capture`, remnant-run with capture=on;
- errors: a config mistake as one line; sweep: what run and frontier share around their
  Hydra task (signals, the sweep's table, SLURM, exit statuses).

Commands with argparse: check (`remnant-check`), serve (`remnant-serve`), report
(`remnant-report`), kernels (`remnant-kernels`), and those run as `python -m
remnant.cli.<name>`, each named in its module's docstring.
"""
