"""Triton kernels for the GPU hot path, each checked against a pure-torch `*_ref` in tests/kernels/.

- kv_store.kv_store: scatter this step's K/V rows into the paged cache.
- attention.paged_attention: flash-style paged attention for decode, verification and prefill
  chunks in one launch (GQA, causal within each request, CUDA-graph safe).
- gumbel.gumbel_sample: seeded Gumbel-max sampling, bit-exact with tandem.sampling.gumbel.
- rejection.rejection_sample: the fused rejection sampler of tandem.spec.rejection.
- decode_inputs.decode_inputs: one draft decode step's positions, input tokens, KV slots and
  attention metadata (the draft loop graph's per-step preamble).
- fused: RMSNorm (+ residual), rotary (+ paged KV store), SiLU-and-mul.
- gemv: one-row linears (batch-1 steps), optionally with SiLU-and-mul or an RMSNorm of the input
  in the prologue, a residual add in the epilogue, or (the qkv projection) rotary + paged KV
  store in the epilogue, each with the separate kernel's rounding.
- gemm_rows: 2-32 row linears (a batch-1 verification, the draft's catch-up, decode steps of
  up to 32 requests) on tensor cores,
  the qkv projection optionally with rotary + paged KV store in the epilogue.
- pdl: programmatic dependent launch (Hopper): every kernel above launches with it and waits for
  the kernel before it first thing (the attention reads its step metadata before: see pdl.py),
  so its launch overlaps that kernel's tail.
- device: the SM count grids are sized by, and whether Triton's interpreter runs the kernels.

And the CPU kernels, in C (one library built with the system compiler on first use for AVX2 or
AVX-512 CPUs: cpu_build), which need no triton:
- cpu_gemm.gemm_w16: small-batch GEMM with bf16/fp16 weights (reference gemm_w16_ref; tested
  in tests/models/test_cpu_linear.py).
- cpu_rows: RMSNorm (+ residual), rotary, SiLU-and-mul rows (references: the torch paths of
  tandem/layers and decoder.MLP; tests/models/test_cpu_rows.py).
- cpu_attention.paged_attention: the step's KV store and every query token's paged attention
  (reference: tandem/layers/attention.py; tests/models/test_cpu_attention.py).
- cpu_gumbel.uniform_rows: the seeded Gumbel sampler's uniforms over whole vocabulary rows
  (reference: tandem.sampling.gumbel.uniform; tests/sampling/test_cpu_gumbel.py).

The Triton submodules import triton; this package file does not, so `import tandem.kernels` is free on
machines without it. Every wrapper takes its sizes from tensor shapes and host-known bounds
only (no device-to-host reads), so each launch can be captured in a CUDA graph.
"""
