"""Quantized modules: the in-memory form of a quantized layer (packed int linears, FP8 linears, the
KV-cache scale observer).

Below everything that uses them: algorithms make them, formats save and load them, the runtime
runs them. They import only the maths (`quant`), the kernels and the schemes.
"""
