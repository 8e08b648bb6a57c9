"""The load client's ceiling: output tokens/s and requests/s it ingests from a server that
computes nothing, beside SGLang's bench client against the same server in the same run.

    python -m remnant.cli.ceiling --concurrency 16 64 256 --rounds 3 \\
        --out benchmarks/client/ceiling.json --plot benchmarks/client/ceiling.png

What it measures and how: remnant.client.ceiling. Writes the JSON (schema
remnant/client-bench, validated on write) and the plot; prints each client's median
throughput per concurrency and their ratio on stderr, the JSON's path on stdout. The
hidden --drive runs one remnant client in the child process the measurement starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remnant.client.ceiling import CLIENTS, Ceiling, drive, measure, plot
from remnant.records.schema import write_validated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remnant.cli.ceiling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Ceiling()
    p.add_argument("--concurrency", type=int, nargs="+", default=d.concurrency, help="concurrencies to measure")
    p.add_argument("--requests", type=int, default=d.requests,
                   help="measured requests per run (default: 4 x concurrency, at least 256)")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds; the clients' order alternates between rounds")
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=d.clients)
    p.add_argument("--sglang-python", default=d.sglang_python,
                   help="interpreter with sglang for its bench client ('none': skip it; default: search)")
    p.add_argument("--stream", choices=("fast", "httpx"), default=d.stream, help="the remnant client's stream path")
    p.add_argument("--incremental", action="store_true", help="stream only new output_ids per frame")
    p.add_argument("--description", default=d.description, help="what this measurement is, for the record")
    p.add_argument("--note", action="append", default=[], help="a note for the record (repeatable)")
    p.add_argument("--out", type=Path, required=False, help="JSON to write (schema remnant/client-bench)")
    p.add_argument("--plot", type=Path, default=None, help="PNG of throughput against concurrency")
    p.add_argument("--drive", metavar="BASE_URL", help=argparse.SUPPRESS)
    p.add_argument("--drive-dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.drive:
        print(json.dumps(drive(a.drive, a.requests, a.concurrency[0], a.input_len, a.output_len, a.drive_dir, a.stream)))
        return 0
    if a.out is None:
        p.error("--out is required")
    for name in ("input_len", "output_len", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} is not allowed; it must be >= 1")
    if any(c < 1 for c in a.concurrency) or (a.requests is not None and a.requests < 1):
        p.error("--concurrency and --requests must be >= 1")

    settings = Ceiling(concurrency=a.concurrency, requests=a.requests, input_len=a.input_len,
                       output_len=a.output_len, rounds=a.rounds, clients=a.clients, sglang_python=a.sglang_python,
                       stream=a.stream, incremental=a.incremental, description=a.description, notes=a.note)
    doc = measure(settings)
    write_validated(a.out, doc)
    clients = [name for name in dict.fromkeys(a.clients) if doc["clients"][name] is not None]
    if a.plot is not None:
        plot(doc, a.plot)
    for row in doc["summary"]:
        line = f"C={row['concurrency']}: " + ", ".join(
            f"{name} {row[name]['output_throughput']['median']:,.0f} tok/s" for name in clients)
        if "ratio_output_throughput" in row:
            rt = row["ratio_output_throughput"]
            line += f"; ratio {rt['median']:.2f}x ({rt['min']:.2f}-{rt['max']:.2f})"
        if "ratio_output_tokens_per_client_cpu_s" in row:
            rt = row["ratio_output_tokens_per_client_cpu_s"]
            line += f", per client CPU-second {rt['median']:.2f}x ({rt['min']:.2f}-{rt['max']:.2f})"
        print(line, file=sys.stderr)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
