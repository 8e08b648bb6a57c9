"""The table of a remnant-kernels record (a fresh run's or one read back), one line per
row, then its targets as the record holds them."""

from __future__ import annotations


def table(doc: dict) -> str:
    lines = [f"{doc['provenance']['gpu']['name']}: copy {doc['ceilings']['copy_gbps']:.0f} GB/s, "
             f"bf16 {doc['ceilings']['matmul_bf16_tflops']:.0f} TFLOP/s"]
    for r in doc["store"] + doc["reconstruct"]:
        lines.append(f"{r['kernel']:<12} R={r['retention']:<3} {r.get('permute', ''):<9} n={r['records']:<8} {r['time_us']:9.1f} us "
                     f"{r['achieved_gbps']:7.0f} GB/s  {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy")
    for r in doc["decode"]:
        variant = r["variant"] + ("*" if r.get("columns") == "kept_first" else "") + (
            {"kept_first": "w", "packed": "p"}.get(r.get("window_columns"), "")) + (
            "@sm90" if r.get("kernel") == "sm90" else "")
        splits = f"s={r['splits']}" + ("" if r["auto_splits"] else "!") if "splits" in r else ""  # (v3: no splits)
        splits += "a" if r.get("window_apart") else ""
        splits += "c" if r.get("split_plan") == "by_cost" else ""
        lines.append(f"decode {variant:<8} R={r['retention']:<3} B={r['batch']:<4} k={r['topk']:<5} W={r['window']:<3} {splits:<5}"
                     f"{r['time_us']:9.1f} us {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy "
                     f"{100 * r['fraction_of_matmul_rate']:5.1f}% mma regs={r.get('n_regs', '?')} spills={r.get('n_spills', '?')}")
    for r in doc.get("flashmla_decode", []):
        lines.append(f"{r['kernel']:<21} R={r['retention']:<3} B={r['batch']:<4} k={r['topk']:<5} W={r['window']:<3} "
                     f"{r['time_us']:9.1f} us {100 * r['fraction_of_copy_bandwidth']:5.1f}% copy "
                     f"{100 * r['fraction_of_matmul_rate']:5.1f}% mma")
    for r in doc.get("against_flashmla", []):
        lines.append(f"/FlashMLA {r['value']:6.3f}  {r['name']}")
    if any(r.get("columns") == "kept_first" for r in doc["decode"]):
        lines.append("packed*: q and out in kept-first column order (the permutation folded into the projections); "
                     "packed..w: window records written in kept-first order")
    if any(r.get("window_columns") == "packed" for r in doc["decode"]):
        lines.append("packed..p: window records packed with the keep list, as the C4 records (read by the C4 loop)")
    if any(r.get("kernel") == "sm90" for r in doc["decode"]):
        lines.append("@sm90: the SM90 Gluon kernel (remnant.kernels.decode.sm90); every other decode row: Triton")
    lines.append("s=N: programs per token and head block (auto_splits); s=N!: fixed, the split sweep; "
                 "s=Na: the window in a program of its own (window_apart); s=Nc: splits cut by cost (split_plan)")
    for t in doc["targets"]:
        lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['name']}: {t['value']:.3f} (target {t['target']}) {t['note']}")
    for entry in (doc.get("ncu") or {}).get("cases", []):
        if entry.get("error"):
            lines.append(f"ncu {entry['case']:<8} B={entry['batch']:<4} failed: {entry['error'][:200]}")
        for k in entry["kernels"]:
            stalls = ", ".join(f"{s['reason']} {s['warps_per_issue']:.1f}" for s in k["stalls"])
            lines.append(f"ncu {entry['case']:<8} B={entry['batch']:<4} {_num(k['duration_us'], '.1f')} us "
                         f"dram {_num(k['dram_throughput_pct'], '.0f')}% sm {_num(k['sm_throughput_pct'], '.0f')}% "
                         f"occupancy {_num(k['achieved_occupancy_pct'], '.0f')}% regs "
                         f"{_num(k['registers_per_thread'], '.0f')} stalls: {stalls or '-'}  {k['kernel'][:60]}")
    return "\n".join(lines)


def _num(value, spec: str) -> str:
    return "?" if value is None else format(value, spec)
