"""Matmul kernels for quantized linears, each beside its torch reference and a thin wrapper.

- `reference`: the plain torch computations every kernel is tested against (and the last resort).
- `cpu_int4`: W4A16 on CPU through `aten._weight_int4pack_mm_for_cpu` (weights repacked at load).
- `triton_w4a16`: fused dequantize + GEMM for int4 weights on CUDA (split-K for decode sizes).
- `triton_fp8`: e4m3 x e4m3 GEMM with scales in the epilogue, and per-token activation quantization.
- `wide_matmul`: 16-bit GEMMs on float32 kernels, for CPUs whose 16-bit GEMMs are slow (a forced bf16).
- `select`: which backend a quantized linear uses (`QUANTKIT_KERNEL=` forces one).

Triton modules import lazily: everything else works without triton installed.
"""
