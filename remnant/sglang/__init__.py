"""Remnant inside SGLang 0.5.18: packed C4 records for DeepSeek-V4, as a plugin.

- settings: REMNANT_* variables (mode, retention, map), checked with the run configs' rules.
- plugin: the entry point SGLang's plugin loader calls, and the hooks it registers.
- pool: the packed C4 pool that replaces SGLang's (imports sglang).
- buffers: the pool's buffers and the store / reconstruct / decode steps (torch only).

SGLang's launch_server with the plugin on is a command: `python -m
remnant.cli.sglang_launch`. Importing this package imports neither torch nor sglang.
"""
