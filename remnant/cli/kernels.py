"""`remnant-kernels` (`python -m remnant.cli.kernels`): run the kernel benchmark
(remnant.kernels.bench) on a CUDA GPU and write its validated record, or read one back
(--from); print its table and plot it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from remnant.kernels.bench.report import table
from remnant.kernels.bench.sweep import SWEEPS, flashmla_status, run

DESCRIPTION = ("remnant-kernels: time store, reconstruct and decode on one CUDA GPU, against FlashMLA and its own "
               "ceilings.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remnant-kernels", description=DESCRIPTION)
    parser.add_argument("--out", type=Path, default=Path("kernel-bench.json"), help="JSON file to write")
    parser.add_argument("--sweep", choices=SWEEPS, default="full",
                        help="full; decode (every decode and FlashMLA case, copies at quick sizes, decode at its "
                             "tuned defaults); quick (a short sweep)")
    parser.add_argument("--quick", action="store_true", help="the same as --sweep quick")
    parser.add_argument("--reps", type=int, default=30, help="graph replays per case (median taken)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-flashmla", action="store_true",
                        help="time Remnant's kernels alone where FlashMLA cannot run (no decode targets)")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="no run: read this kernel-bench JSON (validated), print its table and plot it")
    parser.add_argument("--ncu", action="store_true",
                        help="after the timings, Nsight Compute summaries of FlashMLA and each packed kernel at batch "
                             "64 and 512 into the record (reports beside it in OUT-ncu/, kept out of git)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG to write (default: the JSON's path with .png; 'none' for no plot)")
    args = parser.parse_args(argv)
    from remnant.records.schema import RecordError, validate, write_validated

    if args.source is not None and args.ncu:
        print("remnant-kernels: --ncu profiles on the GPU; it does not apply to --from", file=sys.stderr)
        return 2
    if args.source is not None:
        try:
            doc = json.loads(args.source.read_text())
            validate(doc, str(args.source))
        except (OSError, ValueError, RecordError) as exc:
            print(f"remnant-kernels: {args.source}: {exc}", file=sys.stderr)
            return 2
        json_path = args.source
    else:
        if not torch.cuda.is_available():
            print("remnant-kernels: needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "--from FILE plots an existing record", file=sys.stderr)
            return 2
        stock = flashmla_status(args.without_flashmla)
        if not stock["timed"] and not args.without_flashmla:
            print(f"remnant-kernels: FlashMLA, the baseline of every decode target, cannot run: {stock['reason']}; "
                  "pass --without-flashmla to time Remnant's kernels alone (no decode targets)", file=sys.stderr)
            return 2
        progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        if args.ncu:
            from remnant.kernels.bench.ncu import ncu_version

            if ncu_version() is None:  # before the timings, not after them
                print("remnant-kernels: --ncu needs Nsight Compute's ncu on PATH", file=sys.stderr)
                return 2
        doc = run("quick" if args.quick else args.sweep, args.reps, args.seed, progress=progress, stock=stock)
        if args.ncu:
            from remnant.kernels.bench.ncu import profile

            write_validated(args.out, doc)  # the timings are kept whatever ncu does
            doc["ncu"] = profile(args.out.with_name(args.out.stem + "-ncu"), progress,
                                 on_case=lambda so_far: write_validated(args.out, {**doc, "ncu": so_far}))
        write_validated(args.out, doc)
        json_path = args.out
    print(table(doc))
    if args.source is None:
        print(f"wrote {args.out}")
    if str(args.plot) != "none":
        from remnant.kernels.bench.plot import plot

        print(f"wrote {plot(doc, args.plot or json_path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
