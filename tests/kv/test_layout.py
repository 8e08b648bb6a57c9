"""remnant.kv.layout: the kept-columns table's word plan (the reconstruct kernel's byte
permutes), and the layering it exists for: remnant.kv imports no kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import remnant.kv
from remnant.kv.layout import KeptColumns
from tests.kernels.inputs import prmt


def test_word_plan_rebuilds_every_native_code_word_from_two_packed_words():
    # N = 64 with: native word 0 holding only byte 3 (a negative mask), a run across a packed
    # word boundary starting at slot 3 (first % 4 == 3), and the last slot N - 1 in word 111.
    keep = sorted({3, 8, 9, 10, 11, 12, 13, 14} | set(range(100, 155)) | {447})
    assert len(keep) == 64
    gen = torch.Generator().manual_seed(6)
    for kept in (torch.tensor(keep), torch.arange(0, 448, 7)[:64], torch.arange(384, 448), torch.empty(0, dtype=torch.long)):
        cols = KeptColumns.of(kept, torch.device("cpu"))
        codes = torch.randint(1, 256, (cols.n_kept + 128,), dtype=torch.uint8, generator=gen)  # codes, then RoPE
        words = codes.view(torch.int32).tolist()
        native = torch.zeros(448, dtype=torch.uint8)
        native[kept] = codes[: cols.n_kept]
        want = native.view(torch.int32).tolist()
        first, selector, mask = (cols.word_plan[i].tolist() for i in range(3))
        for w in range(112):
            if mask[w] == 0:
                assert want[w] == 0
                continue
            assert first[w] + 1 <= cols.n_kept // 4  # the second word read is at most the RoPE's first
            assert all((selector[w] >> (4 * k)) & 0xF < 8 for k in range(4))  # no sign-replicating nibble
            pair = (words[first[w]] & 0xFFFFFFFF) | ((words[first[w] + 1] & 0xFFFFFFFF) << 32)
            got = prmt(pair, selector[w]) & (mask[w] & 0xFFFFFFFF)
            assert got == want[w] & 0xFFFFFFFF, f"native word {w}"


def test_kv_imports_no_kernel():
    # remnant.kernels builds on remnant.kv (layouts, references); remnant.kernels.dispatch
    # chooses between a copy kernel and its reference. An import the other way would close
    # the circle again.
    for path in sorted(Path(remnant.kv.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "remnant.kernels" or n.startswith("remnant.kernels.") for n in names), path.name


def test_kv_imports_no_calibration():
    # The byte formats are the lower half: remnant.calibration (captures, policies, maps,
    # fidelity) reads them, never the other way.
    for path in sorted(Path(remnant.kv.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "remnant.calibration" or n.startswith("remnant.calibration.") for n in names), path.name
