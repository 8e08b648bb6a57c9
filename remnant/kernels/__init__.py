"""GPU kernels for C4 records in paged pools (SGLang's split page layout).

- `store`: quantize bf16 latents to native records, or quantize and pack to R + 72-byte
  records, written at given pool locations;
- `reconstruct`: packed -> native records for selected locations (the triton mode);
- `decode`: sparse decode attention of one CSA layer (H heads, selected C4 records, the
  sliding window and the attention sink, V = K) over native or packed C4 records;
- `packed_sm90`: the folded packed decode (R = 256, q, out and the window in kept-first
  order) in Gluon for sm_90, which `plan` chooses there; the Triton `decode` is its
  CPU-tested reference and its fallback;
- `flashmla`: FlashMLA's V4 decode (PyPI sgl-flash-mla, optional, CUDA only) over native
  records: the stock attention SGLang runs, and the baseline of every decode figure.

Each has its plain torch reference in `remnant.kv.paged` (`*_reference`); tests compare the
two (float64 reference, poisoned outputs, odd sizes). `remnant.kernels.dispatch` runs the
kernel on CUDA tensors and the reference elsewhere (what the engine and the SGLang plugin
call); `remnant.kernels.plan` makes each decode call's DecodePlan. `remnant.kernels.bench`
is the `remnant-kernels` microbenchmark.
"""
