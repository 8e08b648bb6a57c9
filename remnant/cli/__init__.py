"""The command line: every command Remnant ships, one module each, and the only package
that imports Hydra. Library modules take plain dataclasses and arguments; where a
command's flags are shared with the code that writes them (remnant-serve's, in
remnant.engine.args), the definition stays there and the parsing here.

Hydra's commands (conf/ composed into remnant.config's dataclasses):
- run: `remnant-run` (`python -m remnant.cli`), one run or a sweep (-m);
- frontier: `remnant-frontier`, the highest load meeting an SLO;
- capture: `remnant-capture`, remnant-run with capture=on;
- errors: a config mistake as one line; sweep: what run and frontier share around their
  Hydra task (signals, the sweep's table, SLURM, exit statuses).

Commands with argparse: check (`remnant-check`), serve (`remnant-serve`), report
(`remnant-report`), kernels (`remnant-kernels`), and those run as `python -m
remnant.cli.<name>`, each named in its module's docstring: curate, ceiling,
stream_server, capacity_report, engine_bench, model_dir, local, sglang_launch, and calibration's
captures, build_map, learned and fidelity (parser: their one-line usage errors).
"""
