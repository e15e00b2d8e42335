"""PackedIntLinear: a linear layer that keeps int weights packed as on disk and dequantizes to run.

Its buffers are exactly the compressed-tensors `pack-quantized` tensors of one module, so
`state_dict()` is what gets saved and `load_state_dict()` is what gets loaded. Act-order checkpoints
(scheme actorder "group") carry `weight_g_idx`, each input column's group: the reference path gathers
each column's scale; the kernels run on the columns permuted so groups are contiguous, the input
permuted alike (one index per forward). The matmul runs
through the kernel `quantkit.kernels.select` picks for the input's device (Triton on CUDA, the int4
op on CPU, dequantize + matmul otherwise); a kernel's repacked copy of the weight is made once
(`prepare`, called by the loader, or at the first forward) and kept outside the state dict.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels import cpu_int4, cuda_int4
from quantkit.kernels.select import fastest, forced_kernel, int_kernels
from quantkit.quant.intq import QuantizedWeight, dequantize, dequantize_columns, dequantize_packed4
from quantkit.quant.packing import pack_int32, packed_size, unpack_int32
from quantkit.quant.schemes import QuantScheme


class PackedIntLinear(nn.Module):
    """y = x @ dequant(W)^T + b with W stored as packed int codes, per-group scales (and zero points)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        scale_dtype: torch.dtype,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.group_count(in_features)
        bits = scheme.num_bits
        self.register_buffer("weight_packed", torch.zeros(out_features, packed_size(in_features, bits), dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, device=device))
        if not scheme.symmetric:
            # zero points pack along the output dim: [ceil(out * bits / 32), groups]
            self.register_buffer("weight_zero_point", torch.zeros(packed_size(out_features, bits), groups, dtype=torch.int32, device=device))
        else:
            self.weight_zero_point = None
        if scheme.actorder == "group":
            # contiguous groups until a checkpoint's g_idx is loaded (what the decode plan's timing copies run)
            self.register_buffer("weight_g_idx", torch.arange(in_features, dtype=torch.int32, device=device)
                                 // scheme.group_size)
        else:
            self.weight_g_idx = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=scale_dtype, device=device), requires_grad=False) if bias else None
        self._prepared: Optional[tuple] = None  # (key, kernel name, repacked weight or None)
        self._order: Optional[torch.Tensor] = None  # act-order: the kernels' column permutation (`column_order`)
        # the CPU int4 op's dtype (None: the input's, exact) and up to how many tokens it runs (longer inputs
        # dequantize once per forward): the decode plan sets both from measurements (`runtime.decode_plan`),
        # a narrower op dtype only when the plan chose it and said so
        self.op_dtype: Optional[torch.dtype] = None
        self.op_tokens: int = cpu_int4.MAX_TOKENS
        # one bf16 token on the op's layout: "op", or "native" (quantkit's own GEMV, where the plan measured it faster)
        self.one_token: str = "op"
        # the kernel asked for (None: automatic): QUANTKIT_KERNEL as it was when the module was made; the loader
        # sets it once per model, `kernels.select.use_kernel` changes it
        self.kernel_request: Optional[str] = forced_kernel()

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor],
                       g_idx: Optional[torch.Tensor] = None) -> "PackedIntLinear":
        """The module holding `qw` (with g_idx, each input column's group, for a scheme with actorder "group")."""
        out_features, in_features = qw.q.shape
        if (g_idx is not None) != (qw.scheme.actorder == "group"):
            raise ValueError("a g_idx goes with scheme actorder 'group', and only with it")
        mod = cls(in_features, out_features, bias is not None, qw.scheme, qw.scale.dtype, device=qw.q.device)
        if g_idx is not None:
            mod.weight_g_idx.copy_(g_idx)
        mod.weight_packed.copy_(pack_int32(qw.q, qw.scheme.num_bits, dim=1))
        mod.weight_scale.copy_(qw.scale)
        if qw.zero_point is not None:
            mod.weight_zero_point.copy_(pack_int32(qw.zero_point, qw.scheme.num_bits, dim=0))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def codes(self) -> torch.Tensor:
        return unpack_int32(self.weight_packed, self.scheme.num_bits, self.in_features, dim=1)  # [out, in] int8

    def zero_points(self) -> Optional[torch.Tensor]:
        if self.weight_zero_point is None:
            return None
        return unpack_int32(self.weight_zero_point, self.scheme.num_bits, self.out_features, dim=0)  # [out, groups]

    def quantized_weight(self) -> QuantizedWeight:
        if self.weight_g_idx is not None:
            raise ValueError("an act-order layer (weight_g_idx) has no contiguous-group QuantizedWeight")
        return QuantizedWeight(self.codes(), self.weight_scale, self.zero_points(), self.scheme)

    def column_order(self) -> Optional[torch.Tensor]:
        """With a g_idx: the input permutation that makes every group a contiguous run of group_size columns
        (the kernels run on W[:, order] and x[..., order]); None without one, or where the groups are not all
        group_size columns (only the reference path then runs)."""
        if self.weight_g_idx is None or self.in_features % self.kernel_group_size:
            return None  # (a short last group: no kernel layout)
        g = self.weight_g_idx.to(torch.int64)
        order = torch.argsort(g, stable=True)
        contiguous = torch.arange(self.in_features, device=g.device) // self.kernel_group_size
        return order if torch.equal(g[order], contiguous) else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.weight_g_idx is not None:
            return dequantize_columns(self.codes(), self.weight_scale, self.zero_points(),
                                      self.weight_g_idx.to(torch.int64), dtype)
        if self.in_features % 8 == 0:  # 4-bit words without padding: straight from the packed words
            w = dequantize_packed4(self.weight_packed, self.weight_scale, self.zero_points(), self.scheme, dtype)
            if w is not None:
                return w
        return dequantize(self.codes(), self.weight_scale, self.zero_points(), self.scheme, dtype)

    @property
    def kernel_group_size(self) -> int:
        return self.in_features if self.scheme.strategy == "channel" else self.scheme.group_size

    @property
    def kernel(self) -> Optional[str]:
        """The kernel the last prepare() / forward chose (None before either)."""
        return None if self._prepared is None else self._prepared[1]

    def prepare(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> str:
        """Choose the kernel for inputs on `device` in `dtype` and repack the weight for it (once per
        device, dtype, weight version and kernel request). Returns the kernel's name."""
        device = torch.device(device) if device is not None else self.weight_packed.device
        dtype = dtype or self.weight_scale.dtype
        key = (self.kernel_request, device, dtype, self.op_dtype, self.op_tokens, self.one_token,
               self.weight_packed._version,
               self.weight_scale._version, None if self.weight_zero_point is None else self.weight_zero_point._version,
               None if self.weight_g_idx is None else self.weight_g_idx._version)
        if self._prepared is not None and self._prepared[0] == key:
            return self._prepared[1]
        names = int_kernels(device, self.scheme.num_bits, self.in_features, self.kernel_group_size,
                            self.out_features, self.op_dtype or dtype, self.kernel_request)
        order = self.column_order()
        if self.weight_g_idx is not None and order is None:
            names = ["torch"]  # groups of uneven sizes: no kernel layout holds them
        self._order = order
        name = names[0]
        if name == "cpu" and self.op_tokens < 1 and self.kernel_request is None:
            name = "torch"  # the plan found dequantizing faster at every size: no repacked copy
        packs = {n: self._pack(n, dtype) for n in names[:-1] if n in ("cuda", "triton")}
        if len(packs) > 1:  # CUDA, bf16: torch's int4 op or Triton, whichever is faster on this shape here
            x = torch.randn(1, self.in_features, device=device, dtype=dtype)
            shape = (torch.cuda.get_device_name(device), self.out_features, self.in_features, self.kernel_group_size,
                     self.weight_zero_point is None, dtype)
            name = fastest(shape, {n: (lambda n=n: self._run(n, packs[n], x)) for n in packs})
        packed = packs[name] if name in packs else self._pack(name, dtype)
        self._prepared = (key, name, packed)
        return name

    def _pack(self, name: str, dtype: torch.dtype):
        """The weight repacked for kernel `name` (None for torch's reference: it dequantizes per forward)."""
        codes = self.codes() if self._order is None else self.codes()[:, self._order]
        if name == "cpu":
            packed = cpu_int4.repack(codes, self.weight_scale, self.zero_points(), self.kernel_group_size,
                                     self.op_dtype or dtype)
            packed.native_one_token = (self.one_token == "native" and packed.native_fits
                                       and cpu_int4.native_reason() is None)
            return packed
        if name == "cuda":
            return cuda_int4.repack(codes, self.weight_scale, self.zero_points(), self.kernel_group_size)
        if name == "triton":
            from quantkit.kernels import triton_w4a16  # imports triton: only when it is used

            packed = self.weight_packed if self._order is None else pack_int32(codes, self.scheme.num_bits, dim=1)
            return triton_w4a16.repack(packed, self.weight_scale, self.zero_points(), self.kernel_group_size,
                                       self.in_features)
        return None

    def _run(self, name: str, packed, x: torch.Tensor) -> torch.Tensor:
        if name != "torch" and self._order is not None:
            x = x.index_select(-1, self._order.to(x.device))  # the kernels' columns are permuted into groups
        if name in ("cpu", "cuda"):
            return packed.matmul(x, self.bias)
        if name == "triton":
            from quantkit.kernels import triton_w4a16

            return triton_w4a16.matmul(x, packed, self.bias)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = self.prepare(x.device, x.dtype)
        if name == "cpu" and x.numel() // self.in_features > self.op_tokens:
            name = "torch"  # a long input: dequantize once and run one GEMM
        return self._run(name, self._prepared[2], x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.short()}"
