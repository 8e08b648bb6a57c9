"""remnant-kernels: time store, reconstruct and decode on one CUDA GPU, against FlashMLA and its own ceilings.

Every decode figure is stated against FlashMLA's V4 sparse decode (sgl-flash-mla, the
stock attention SGLang serves DeepSeek-V4 with), timed in the same run and harness:
kernel mode's direct packed decode / FlashMLA (the targets), and triton mode's decode
(SGLang's staging of the selected records by Remnant's reconstruct, then FlashMLA) /
FlashMLA. Remnant's Triton native kernel is a cross-check row, not the anchor.

Every number comes from this run: the copy bandwidth (device-to-device copy, bytes read
plus written) and the bf16 matrix rate are measured first and serve as the roofline.
Each case is timed as CUDA-graph replays of a rotation of input sets whose bytes exceed
three times the L2 cache (so the cache does not serve repeated reads), with CUDA events,
after warm-up; the median replay over the rotation length is the time of one call.

Bytes are the fewest a call must move (each input read once, each output written once);
FLOPs count the tensor-core work the kernel issues (padding included: a packed kernel at
R = 384 multiplies its 320 kept columns as blocks of 256 and 64, and 64 RoPE columns, per
C4 record, and for window tokens the kept blocks, the dropped columns padded to a power of
two, and RoPE, or, with the window in a program of its own, the native program's 512 and
64, or, with the window packed as the C4 records, a C4 record's). The JSON
(remnant.records.kinds.KERNEL_BENCH) is validated before it is written.
"""
