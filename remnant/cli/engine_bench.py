"""python -m remnant.cli.engine_bench: the embedded engine's decode step per mode beside
its roofline, and its prefill speed (remnant.engine.bench), written as one
remnant/engine-bench record.

    python -m remnant.cli.engine_bench --model dsv4_flash_h200 --out engine-bench.json   # one GPU
    python -m remnant.cli.engine_bench --model tiny --batches 1,4 --contexts 256 --out tiny.json
    # the prefill-read study: what each mode's prefill reads and where its kernels' time goes
    python -m remnant.cli.engine_bench --batches= --prefill-contexts 4096,32768,131072 --prefill-profile --out p.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from remnant.engine.bench import row_line, run
from remnant.kv.formats import C128_RECORDS, INDEX_KEY_FORMATS, WINDOW_RECORDS
from remnant.kv.modes import MODE_NAMES
from remnant.records.schema import write_validated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The engine's decode step per mode beside its roofline.")
    p.add_argument("--model", default="dsv4_flash_h200", help="conf/model preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--modes", default=",".join(MODE_NAMES))
    p.add_argument("--batches", default="1,8,32,128", help="decode batches (empty: no decode rows)")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-contexts", default="4096,32768,131072",
                   help="prompt lengths whose prefill is timed (empty: none)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (host.chunked_prefill_size)")
    p.add_argument("--index-fp8-queries", action="store_true",
                   help="the indexer scores (decode and prefill) with FP8 queries on FP8 MMAs (ScoresConfig.fp8_q; "
                        "FP8 keys)")
    p.add_argument("--prefill-profile", action="store_true",
                   help="prefill each prompt again, untimed, counting the records its attention reads and, "
                        "on cuda, its kernels' time by part (rebuild, attention, indexer, store, moe, dense, other)")
    p.add_argument("--disable-cuda-graph", dest="cuda_graph", action="store_false")
    p.add_argument("--disable-torch-compile", dest="torch_compile", action="store_false",
                   help="plain torch operations for the elementwise chains (remnant.engine.step_ops)")
    p.add_argument("--index-key-format", default="fp8", choices=INDEX_KEY_FORMATS,
                   help="the indexer keys' format (host.index_key_format)")
    p.add_argument("--window-records", default="native", choices=WINDOW_RECORDS,
                   help="packed modes' window records (retention.window_records)")
    p.add_argument("--c128-records", default="native", choices=C128_RECORDS,
                   help="packed modes' C128 records (retention.c128_records)")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--kernel-logs", type=Path, help="folder for each CUDA cell's kernels in order (TSV)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if a.index_fp8_queries and a.index_key_format != "fp8":
        p.error(f"--index-fp8-queries takes FP8 keys, got --index-key-format {a.index_key_format}")
    bad = [m for m in modes if m not in MODE_NAMES]
    if bad:
        p.error(f"--modes {','.join(bad)} is not allowed; allowed: {', '.join(MODE_NAMES)}")
    def write(doc: dict) -> None:
        write_validated(a.out, doc)  # schemas/engine-bench: checked before each write

    doc = run(a.model, a.device, modes, [int(b) for b in a.batches.split(",") if b],
              [int(c) for c in a.contexts.split(",")], a.steps, a.cuda_graph,
              [int(c) for c in a.prefill_contexts.split(",") if c], a.chunk, on_row=write,
              torch_compile=a.torch_compile, index_key_format=a.index_key_format, window_records=a.window_records,
              c128_records=a.c128_records, kernel_logs=a.kernel_logs,
              prefill_profile=a.prefill_profile, index_fp8_queries=a.index_fp8_queries)
    write(doc)
    for row in doc["rows"]:
        print(row_line(row))
    for row in doc["prefill"]:
        line = f"{row['mode']:>7} prefill {row['context']:>6}: {row['tokens_per_s']:10.0f} tok/s"
        if row["reads"]:
            line += "  distinct records a chunk: " + ", ".join(
                f"{part} {r['distinct'] / row['chunks']:.0f}" for part, r in row["reads"].items())
        if row["kernel_ms"]:
            line += "  kernel ms: " + ", ".join(f"{part} {ms:.1f}" for part, ms in row["kernel_ms"].items())
        print(line)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
