"""Fidelity of packed attention against native, per CSA layer, retention R and policy.

    python -m remnant.cli.fidelity --synthetic --out fidelity.json
    python -m remnant.cli.fidelity --captures captures.safetensors --out fidelity.json

writes the single-capture report (remnant.calibration.fidelity, schema remnant/fidelity
v1): one capture split by token, the training-free policies compared. The comparison
across every policy, the learned one included, on a split by capture source
(remnant.calibration.fidelity_compare, schema remnant/fidelity v2) is a subcommand:

    python -m remnant.cli.fidelity compare --train A.safetensors [B.safetensors ...]
        --eval C.safetensors --out benchmarks/fidelity/NAME.json
        [--retention 64,128,...] [--top-k 64] [--seed 0] [--steps 200] [--init attention]
        [--limit TEXT ...]
    python -m remnant.cli.fidelity compare --synthetic --out NAME.json

The fidelity of the KV parts beyond C4 records (remnant.calibration.fidelity_parts, schema
remnant/fidelity-parts v1: packed window and C128 records, MXFP4 indexer keys, bf16
compressor state, and all at once, per layer) on remnant-capture/2 files is another:

    python -m remnant.cli.fidelity parts --train A.safetensors --eval B.safetensors
        --out benchmarks/fidelity/NAME.json [--policy attention] [--retention 256]
        [--top-k 64] [--index-top-k 512] [--window 128] [--seed 0] [--limit TEXT ...]

Each prints its table (mean error per R and policy; per part, and per layer and part)
on stderr and the report's path on stdout. Errors are one line, `fidelity: error: ...` or `fidelity compare: error: ...`,
naming the file or flag; exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.calibration import fidelity, fidelity_compare
from remnant.calibration.captures import load_captures, synthetic_captures
from remnant.calibration.fidelity_compare import COMPARE_POLICIES, check_split, compare, synthetic_split, table_markdown
from remnant.calibration.learned import INITS, Hyperparameters
from remnant.calibration.retention import LEARNED, POLICIES
from remnant.cli.parser import OneLineParser
from remnant.kv.formats import RETENTION_VALUES


def _int_list(text: str, name: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text} must be comma-separated integers") from None




def _nonempty_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text} must be comma-separated integers") from None
    if not values:
        raise ValueError(f"--{name}={text!r} names no value")
    return values




def main(argv: list[str] | None = None) -> int:
    """`python -m remnant.cli.fidelity ...`, or its `compare` subcommand (see the module
    docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["parts"]:
        return parts_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m remnant.cli.fidelity", description=fidelity.__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--captures", type=Path, help="capture file (remnant-capture/1 or /2 safetensors)")
    src.add_argument("--synthetic", action="store_true",
                     help="use synthetic captures (see remnant.calibration.captures)")
    p.add_argument("--seed", type=int, default=0, help="synthetic generator seed and the random policy's seed")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--retention", default=",".join(map(str, RETENTION_VALUES)), help="R values, comma-separated")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    from remnant.records.schema import write_validated

    try:
        policies = [x.strip() for x in a.policies.split(",") if x.strip()]
        bad = [x for x in policies if x not in POLICIES]
        if bad:
            raise ValueError(f"--policies has {bad[0]}; allowed: {', '.join(POLICIES)}")
        values = _int_list(a.retention, "retention")
        bad_r = [r for r in values if r not in RETENTION_VALUES]
        if bad_r:
            raise ValueError(f"--retention has {bad_r[0]}; allowed: {', '.join(map(str, RETENTION_VALUES))}")
        if a.top_k < 1:
            raise ValueError(f"--top-k={a.top_k} must be >= 1")
        captures = synthetic_captures(seed=a.seed) if a.synthetic else load_captures(a.captures)
        doc = fidelity.report(captures, policies, values, a.top_k, a.seed)
        path = write_validated(a.out, doc)
    except (ValueError, OSError) as exc:
        print(f"fidelity: error: {exc}", file=sys.stderr)
        return 2
    print(fidelity.table(doc), file=sys.stderr)
    print(path)
    return 0



def compare_main(argv: list[str]) -> int:
    """`python -m remnant.cli.fidelity compare ...` (see the module docstring)."""
    p = OneLineParser(prog="fidelity compare", description=fidelity_compare.__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--train", type=Path, nargs="+", metavar="FILE", help="training capture files")
    src.add_argument("--synthetic", action="store_true",
                     help="one synthetic capture set split in two sources (see synthetic_split)")
    p.add_argument("--eval", type=Path, metavar="FILE", help="evaluation capture file (another source)")
    p.add_argument("--retention", default=",".join(map(str, RETENTION_VALUES)), help="R values, comma-separated")
    p.add_argument("--policies", default=",".join(COMPARE_POLICIES), help="policies, comma-separated")
    p.add_argument("--top-k", type=int, default=64, help="top-k of the overlap metric (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random policy seed, scorer seed, synthetic seed")
    d = Hyperparameters()
    p.add_argument("--steps", type=int, default=d.steps, help=f"scorer training steps per layer (default {d.steps})")
    p.add_argument("--init", choices=INITS, default=d.init, help=f"scorer starting score (default {d.init})")
    p.add_argument("--limit", action="append", default=[], metavar="TEXT",
                   help="a caveat to add to the report's limits (repeatable)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="report JSON to write")
    a = p.parse_args(argv)
    if a.train is not None and a.eval is None:
        p.error("--train needs --eval FILE: the capture source the policies are measured on")
    if a.synthetic and a.eval is not None:
        p.error("--eval is for --train; --synthetic makes both sources itself")
    try:
        policies = [x.strip() for x in a.policies.split(",") if x.strip()]
        bad = [x for x in policies if x not in COMPARE_POLICIES]
        if bad or not policies or len(set(policies)) != len(policies):
            raise ValueError(f"--policies={a.policies} must name distinct policies of "
                             f"{', '.join(COMPARE_POLICIES)}")
        if LEARNED not in policies:
            raise ValueError(f"--policies={a.policies} must include learned (for the others alone, use "
                             "python -m remnant.cli.fidelity --captures)")
        values = _nonempty_int_list(a.retention, "retention")
        bad_r = [r for r in values if r not in RETENTION_VALUES]
        if bad_r or len(set(values)) != len(values):
            raise ValueError(f"--retention={a.retention} must be distinct values of "
                             f"{', '.join(map(str, RETENTION_VALUES))}")
        if a.top_k < 1:
            raise ValueError(f"--top-k={a.top_k} must be >= 1")
        if a.out.suffix != ".json":
            raise ValueError(f"--out {a.out} must end in .json (the plots and the scorer go next to it)")
        hp = Hyperparameters(steps=a.steps, init=a.init)
        hp.check()
        if a.synthetic:
            tr, ev = synthetic_split(seed=a.seed)
            train_named, eval_named = [("synthetic-train", tr)], ("synthetic-eval", ev)
        else:
            train_named = [(str(f), load_captures(f)) for f in a.train]
            eval_named = (str(a.eval), load_captures(a.eval))
        check_split(train_named, eval_named)
        doc, path = compare(train_named, eval_named, policies, values, a.top_k, a.seed, hp, a.limit, a.out)
    except (ValueError, OSError) as exc:
        print(f"fidelity compare: error: {str(exc).replace(chr(10), ' ')}", file=sys.stderr)
        return 2
    print(table_markdown(doc), file=sys.stderr)
    print(path)
    return 0


def parts_main(argv: list[str]) -> int:
    """`python -m remnant.cli.fidelity parts ...` (see the module docstring)."""
    from remnant.calibration import fidelity_parts
    from remnant.records.schema import write_validated

    p = OneLineParser(prog="fidelity parts", description=fidelity_parts.__doc__.split("\n\n")[0])
    p.add_argument("--train", type=Path, required=True, metavar="FILE",
                   help="capture file (remnant-capture/2) the policy chooses every layer's kept coordinates from")
    p.add_argument("--eval", type=Path, required=True, metavar="FILE", help="capture file measured (another source)")
    p.add_argument("--policy", choices=POLICIES, default="attention", help="training-free policy (default attention)")
    p.add_argument("--retention", type=int, default=256, help="R of every layer's map (default 256)")
    p.add_argument("--top-k", type=int, default=64, help="top-k of the score overlap metric (default 64)")
    p.add_argument("--index-top-k", type=int, default=512, help="the indexer's top-k (default 512, V4's)")
    p.add_argument("--window", type=int, default=128, help="window latents in part all's softmax (default 128)")
    p.add_argument("--seed", type=int, default=0, help="the random policy's seed")
    p.add_argument("--limit", action="append", default=[], metavar="TEXT",
                   help="a caveat to add to the report's limits (repeatable)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="report JSON to write")
    a = p.parse_args(argv)
    try:
        if a.retention not in RETENTION_VALUES:
            raise ValueError(f"--retention={a.retention} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))}")
        for flag, value in (("top-k", a.top_k), ("index-top-k", a.index_top_k), ("window", a.window)):
            if value < 1:
                raise ValueError(f"--{flag}={value} must be >= 1")
        train = (str(a.train), load_captures(a.train))
        ev = (str(a.eval), load_captures(a.eval))
        doc = fidelity_parts.report(train, ev, a.policy, a.retention, a.top_k, a.index_top_k, a.window, a.seed,
                                    a.limit)
        path = write_validated(a.out, doc)
    except (ValueError, OSError) as exc:
        print(f"fidelity parts: error: {str(exc).replace(chr(10), ' ')}", file=sys.stderr)
        return 2
    print(fidelity_parts.table_markdown(doc), file=sys.stderr)
    print(file=sys.stderr)
    print(fidelity_parts.table_per_layer(doc), file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
