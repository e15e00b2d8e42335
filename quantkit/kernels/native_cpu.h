// The torch-level entry points of quantkit's native CPU kernels (native_cpu.cpp), shared with the decode stack
// (native_stack.cpp). Each checks its arguments and returns a new tensor; see native_cpu.cpp for the maths.
#pragma once

#include <torch/extension.h>

torch::Tensor gemv_bf16(const torch::Tensor& weight, const torch::Tensor& x);
torch::Tensor int4_gemv(const torch::Tensor& packed, const torch::Tensor& scale_zeros, const torch::Tensor& x,
                        int64_t group, int64_t out_features, int64_t block_rows);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool plus_one = false);
torch::Tensor rope_store_attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                torch::Tensor keys, torch::Tensor values, int64_t slot,
                                const c10::optional<torch::Tensor>& mask, double scale, int64_t heads);

// registers DecodeStack and its parts on the extension module (native_stack.cpp)
void bind_decode_stack(pybind11::module& m);
