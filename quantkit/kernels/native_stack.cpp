// The decoder layers of one llama-family decode step (one token, one sequence) in one call from Python.
//
// The lean decode step (quantkit/runtime/lean_decode.py) runs each layer as about fifteen Python-level calls:
// on a 2-core EPYC a SmolLM2 W4A16 step spent about as long in that dispatch as in its int4 GEMVs. DecodeStack
// runs the same sequence of the same kernels and torch ops from C++: the RMSNorm (native, or torch's fused op in
// the module's arithmetic), each linear as the step would run it (`Linear`), RoPE + cache write + attention
// (rope_store_attend), the residual adds, the activation of the gate times up, all in the step's dtypes, so its
// hidden state equals the Python step's bit for bit; Gemma 3's layer (runtime/lean_gemma.py) with its per-head
// q / k norms and its norms after attention and around the MLP. What runs where is decided in Python
// (quantkit/runtime/decode_stack.py).

#include "native_cpu.h"

#include <utility>
#include <vector>

namespace {

// How a linear runs, as lean_decode's `_run` / `_linear` would run it for one token.
enum Kind : int64_t { kNativeGemv = 0, kMv = 1, kLinear = 2, kInt4 = 3 };

struct Linear {
  int64_t kind;
  torch::Tensor weight;                      // the dense weight, or the int4 op's packed layout
  c10::optional<torch::Tensor> scale_zeros;  // int4: [K / group, N_pad, 2] in the op's dtype
  c10::optional<torch::Tensor> bias;
  int64_t group;                             // int4
  int64_t out_features;                      // int4
  int64_t block_rows;                        // int4: rows per block read by the native GEMV; 0 = the op itself

  // x [1, K] -> [1, N]: a bias-free int4 result stays in the op's dtype (its consumers promote it exactly)
  torch::Tensor run(const torch::Tensor& x) const {
    if (kind == kLinear) return at::linear(x, weight, bias);
    if (kind != kInt4) {
      auto y = (kind == kMv ? at::mv(weight, x.reshape({-1})) : gemv_bf16(weight, x.reshape({-1}))).view({1, -1});
      return bias ? y + *bias : y;
    }
    const auto dtype = scale_zeros->scalar_type();
    auto x2 = (x.scalar_type() == dtype ? x : x.to(dtype)).contiguous();
    auto y = block_rows
                 ? int4_gemv(weight, *scale_zeros, x2.reshape({-1}), group, out_features, block_rows).view({1, -1})
                 : at::_weight_int4pack_mm_for_cpu(x2, weight, group, *scale_zeros);
    if (y.size(1) != out_features) y = y.slice(1, 0, out_features);
    if (bias) {
      if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
      y = y + bias->to(y.scalar_type());
    }
    return y;
  }
};

// Gemma 3's parts of a layer (absent for llama-family layers): per-head q / k norms, the norms before and after
// the MLP (its ln2 then normalizes the attention's output before the residual add)
struct GemmaParts {
  torch::Tensor q_norm, k_norm, pre_ff, post_ff;
  double eps;
};

struct Layer {
  torch::Tensor ln1, ln2;  // RMSNorm weights before attention and (llama) before the MLP / (Gemma) after attention
  double eps1, eps2;
  Linear qkv, o, gate_up, down;
  int64_t gate;            // gate_up's first `gate` outputs are the gate, the rest the up projection
  torch::Tensor keys, values;  // the layer's static cache [1, H_kv, S, D]
  int64_t rope;            // which of the step's RoPE tables the layer takes (Gemma: local or global frequencies)
  int64_t act;             // the MLP's activation: 0 SiLU, 1 GELU (tanh approximation)
  c10::optional<GemmaParts> gemma;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<Layer> layers, bool native_norm, double scale, int64_t heads)
      : layers_(std::move(layers)), native_norm_(native_norm), scale_(scale), heads_(heads) {}

  // h [1, H] (the embedded token) through every layer at cache slot `slot`; ropes: (cos, signed_sin [1, D]) per
  // table; mask [1, slot + 1] float32 added to the scores (or None). Returns the last layer's output [1, H].
  torch::Tensor step(torch::Tensor h, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& ropes, int64_t slot,
                     const c10::optional<torch::Tensor>& mask) const {
    TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "DecodeStack.step: h must be one token's hidden state [1, H]");
    const auto dtype = h.scalar_type();
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.rope >= 0 && l.rope < static_cast<int64_t>(ropes.size()), "DecodeStack.step: a RoPE table short");
      const bool gemma = l.gemma.has_value();
      auto y = l.qkv.run(norm(h, l.ln1, l.eps1, gemma)).to(dtype);
      if (gemma) y = head_norms(y, *l.gemma, l.keys.size(1), l.keys.size(3));
      const auto& rope = ropes[l.rope];
      auto o = rope_store_attend(y.contiguous(), rope.first, rope.second, l.keys, l.values, slot, mask, scale_, heads_);
      o = l.o.run(o).to(dtype);
      h = h + (gemma ? norm(o, l.ln2, l.eps2, true) : o);
      auto x = gemma ? norm(h, l.gemma->pre_ff, l.gemma->eps, true) : norm(h, l.ln2, l.eps2, false);
      auto gate_up = l.gate_up.run(x);
      auto gate = gate_up.slice(1, 0, l.gate).to(dtype);
      auto act = (l.act == 0 ? at::silu(gate) : at::gelu(gate, "tanh")) * gate_up.slice(1, l.gate).to(dtype);
      auto down = l.down.run(act).to(dtype);
      h = h + (gemma ? norm(down, l.gemma->post_ff, l.gemma->eps, true) : down);
    }
    return h;
  }

 private:
  // Gemma: q and k of a fused q/k/v row [1, (H + 2 H_kv) D] normalized per head, v as it was
  torch::Tensor head_norms(const torch::Tensor& y, const GemmaParts& g, int64_t kv_heads, int64_t dim) const {
    auto q = norm(y.slice(1, 0, heads_ * dim).reshape({heads_, dim}), g.q_norm, g.eps, true);
    auto k = norm(y.slice(1, heads_ * dim, (heads_ + kv_heads) * dim).reshape({kv_heads, dim}), g.k_norm, g.eps, true);
    return at::cat({q.reshape({1, -1}), k.reshape({1, -1}), y.slice(1, (heads_ + kv_heads) * dim)}, 1);
  }

  // quantkit.runtime.row_norm: the native kernel where chosen, else torch's ops as the module computes them
  // (llama: rms_norm's reference; gemma: Gemma3RMSNorm's forward)
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool gemma) const {
    if (native_norm_ && weight.scalar_type() == x.scalar_type() && x.is_contiguous() && weight.is_contiguous())
      return rms_norm(x, weight, eps, gemma);
    const int64_t width = x.size(-1);
    if (gemma) {
      auto xf = x.to(torch::kFloat32);
      auto out = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
      return (out * (1.0 + weight.to(torch::kFloat32))).to(x.scalar_type());
    }
    if (x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32)
      return at::rms_norm(x, {width}, weight, eps);
    return weight * at::rms_norm(x.to(torch::kFloat32), {width}, c10::nullopt, eps).to(x.scalar_type());
  }

  std::vector<Layer> layers_;
  bool native_norm_;
  double scale_;
  int64_t heads_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Linear>(m, "StackLinear")
      .def(py::init<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t,
                    int64_t, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("scale_zeros"), py::arg("bias"), py::arg("group"),
           py::arg("out_features"), py::arg("block_rows"))
      .def("run", &Linear::run, py::arg("x"));
  py::class_<GemmaParts>(m, "StackGemmaParts")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double>(), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("pre_ff"), py::arg("post_ff"), py::arg("eps"));
  py::class_<Layer>(m, "StackLayer")
      .def(py::init<torch::Tensor, torch::Tensor, double, double, Linear, Linear, Linear, Linear, int64_t,
                    torch::Tensor, torch::Tensor, int64_t, int64_t, c10::optional<GemmaParts>>(),
           py::arg("ln1"), py::arg("ln2"), py::arg("eps1"), py::arg("eps2"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("gate"), py::arg("keys"), py::arg("values"),
           py::arg("rope") = 0, py::arg("act") = 0, py::arg("gemma") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<Layer>, bool, double, int64_t>(), py::arg("layers"), py::arg("native_norm"),
           py::arg("scale"), py::arg("heads"))
      .def("step", &DecodeStack::step, py::arg("h"), py::arg("ropes"), py::arg("slot"), py::arg("mask"));
}
