"""GPU kernels for C4 records in paged pools (SGLang's split page layout).

- `store`: quantize bf16 latents to native records, or quantize and pack to R + 72-byte
  records, written at given pool locations;
- `reconstruct`: packed -> native records for selected locations (the triton mode);
- `decode`: sparse decode attention of one CSA layer (H heads, selected C4 records, the
  sliding window and the attention sink, V = K) over native or packed C4 records, a
  package: its one entry point `decode`, the choice of kernel and the plan (`plan`), one
  module per kernel (`triton`, `sm90`, `flashmla`) and their torch references
  (`reference`);
- `moe`: the routed experts' FP8 grouped products.

store and reconstruct have their plain torch references in `remnant.kv.paged`
(`*_reference`); tests compare each kernel with its reference (float64 reference, poisoned
outputs, odd sizes). `remnant.kernels.dispatch` runs store and reconstruct on CUDA tensors
and their references elsewhere (what the engine and the SGLang plugin call).
`remnant.kernels.bench` is the `remnant-kernels` microbenchmark (harness, cases, inputs,
checks, sweep, targets, report, plot; its command is remnant.cli.kernels).
"""
