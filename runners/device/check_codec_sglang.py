"""On a CUDA GPU: remnant.kv.quantize against SGLang 0.5.18's own FP8 quantizer kernel,
compiled (not interpreted), with its real float8 store. CPU tests cannot check the FP8
cast inside the kernel (Triton's interpreter rounds it wrongly near powers of two); this
does, on edge values and heavy-tailed random latents.

    python runners/device/check_codec_sglang.py PATH/TO/sglang/.../dsv4/quant_k_cache.py OUT.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from remnant.kv.codec import quantize  # noqa: E402


def load_kernel(path: Path):
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_quant_k_cache_fused_kernel")
    namespace = {"triton": triton, "tl": tl}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["_quant_k_cache_fused_kernel"]


def sglang_records(kernel, x: torch.Tensor) -> torch.Tensor:
    k = x.to(torch.bfloat16).cuda().contiguous()
    n = k.shape[0]
    nope = torch.empty(n, 448, dtype=torch.float8_e4m3fn, device="cuda")
    rope = torch.empty(n, 64, dtype=torch.bfloat16, device="cuda")
    scales = torch.empty(n, 7, dtype=torch.uint8, device="cuda")
    fp8 = torch.finfo(torch.float8_e4m3fn)
    kernel[(n, 8)](k, nope, rope, scales, k.stride(0), nope.stride(0), rope.stride(0), scales.stride(0),
                   DIM_NOPE=448, DIM_ROPE=64, TILE_SIZE=64, NUM_TILES=7, FP8_MIN=fp8.min, FP8_MAX=fp8.max, EPS=1e-8)
    out = torch.zeros(n, 584, dtype=torch.uint8)
    out[:, :448] = nope.view(torch.uint8).cpu()
    out[:, 448:576] = rope.view(torch.uint8).cpu()
    out[:, 576:583] = scales.cpu()
    return out


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tile = torch.randn(512, generator=g)
    edges = [torch.zeros(512), torch.full((512,), 1e-30), torch.full((512,), -3e38)]
    for amax in (448.0, 448.0 * 2**-10, 448.0 * 1.0000001, 1e-8, 1e-9, 2.0**-133, 126.35, 3.0e38):
        r = tile.clone()
        r[:64] = r[:64] / r[:64].abs().max() * amax
        edges.append(r)
    out = {"edges": torch.stack(edges)}
    for seed in range(4):
        gs = torch.Generator().manual_seed(100 + seed)
        out[f"heavy_tailed_{seed}"] = torch.randn(4096, 512, generator=gs) * torch.exp(torch.randn(1, 512, generator=gs) * 3)
    # Values straddling powers of two after scaling: where the interpreter's cast goes wrong.
    gp = torch.Generator().manual_seed(7)
    near = torch.exp2(torch.randint(-6, 8, (4096, 512), generator=gp).float()) * (1 + 1e-3 * torch.randn(4096, 512, generator=gp))
    out["near_powers_of_two"] = near
    return out


def main() -> int:
    kernel = load_kernel(Path(sys.argv[1]))
    results = []
    for name, x in cases().items():
        ours, theirs = quantize(x), sglang_records(kernel, x)
        results.append({
            "case": name, "rows": x.shape[0],
            "scales_equal": bool(torch.equal(ours[:, 576:583], theirs[:, 576:583])),
            "rope_equal": bool(torch.equal(ours[:, 448:576], theirs[:, 448:576])),
            "codes_differing": int((ours[:, :448] != theirs[:, :448]).sum()),
            "codes_total": int(ours[:, :448].numel()),
        })
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "results": results, "all_equal": all(r["scales_equal"] and r["rope_equal"] and not r["codes_differing"]
                                                 for r in results)}
    Path(sys.argv[2]).write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r['case']:<20} rows {r['rows']:>5}  scales {r['scales_equal']}  rope {r['rope_equal']}  "
              f"codes differing {r['codes_differing']} / {r['codes_total']}")
    print("ALL EQUAL" if doc["all_equal"] else "DIFFERENCES FOUND")
    return 0 if doc["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
