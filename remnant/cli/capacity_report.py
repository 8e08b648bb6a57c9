"""Capacity report: native vs packed KV capacity at one byte budget, per request length.

    python -m remnant.cli.capacity_report --model dsv4_flash_attn --budget-gib 30 \\
        --lengths 4096,32768,131072 --out capacity.json

For the model's geometry (a conf/model preset, or --model-config FILE) it sizes the pools
as SGLang 0.5.18 does for native records and for packed records at the retention given,
and for each standard combination of stored parts (packed C4, window and C128 records at
--combination-retention, MXFP4 indexer keys, bf16 compressor state; the engine serves each
of them, the SGLang plugin native and C4 alone), and writes the report (schema
remnant/capacity) that remnant.engine.capacity_report computes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.engine.capacity_report import load_model_preset, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remnant.cli.capacity_report", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="dsv4_flash_attn", help="conf/model preset")
    src.add_argument("--model-config", type=Path, help="a model YAML file instead of a preset")
    p.add_argument("--budget-gib", type=float, required=True, help="KV budget per GPU, GiB")
    p.add_argument("--lengths", default="4096,32768,131072", help="request lengths L in tokens")
    p.add_argument("--retention", default="256", help="R, or R per CSA layer, comma-separated")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--swa-ratio", type=float, default=0.1)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--combination-retention", type=int, default=256,
                   help="R of every packed part in the standard combinations")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    from remnant.records.schema import write_validated

    try:
        model = load_model_preset(None if a.model_config else a.model, a.model_config)
        lengths = [int(v) for v in a.lengths.split(",")]
        retention = [int(v) for v in a.retention.split(",")]
        if any(v < 1 for v in lengths):
            raise ValueError(f"--lengths={a.lengths} must be positive token counts")
        if a.budget_gib <= 0:
            raise ValueError(f"--budget-gib={a.budget_gib} must be > 0")
        doc = report(model, int(a.budget_gib * (1 << 30)), lengths, retention, a.page_size, a.swa_ratio,
                     a.max_running_requests, a.combination_retention)
        path = write_validated(a.out, doc)
    except (ValueError, OSError) as exc:
        print(f"capacity: error: {exc}", file=sys.stderr)
        return 2
    f = doc["formula"]
    print(f"{doc['model']['name']}: {f['native_bytes_per_token']:.2f} -> {f['packed_bytes_per_token']:.2f} "
          f"bytes/token, capacity x{f['capacity_ratio']:.4f} (tokens x{doc['token_ratio']:.4f})", file=sys.stderr)
    for row in doc["lengths"]:
        print(f"  L={row['request_tokens']}: {row['native']['requests']} -> {row['packed']['requests']} requests "
              f"(bound by {row['native']['bound_by']})", file=sys.stderr)
    print(f"combinations at R={a.combination_retention}:", file=sys.stderr)
    for c in doc["combinations"]:
        print(f"  {c['name']}: {c['bytes_per_token_total']:.2f} bytes/token, capacity x{c['capacity_ratio']:.4f}, "
              f"{c['max_total_num_tokens']} tokens{'' if c['served'] else ' (not served)'}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
