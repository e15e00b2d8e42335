"""Pure quantization maths: scales, quantize/dequantize and int32 bit packing (no modules, no I/O)."""
