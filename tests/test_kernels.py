"""Kernels against their torch references: the CPU int4 path, Triton W4A16 and FP8 (through the
interpreter on CPU, on the GPU where there is one), bit layouts, and the quantized linear's choice.

Tolerances: outputs in a 16-bit dtype may differ from the reference by the summation order of an
fp32 accumulation and one final rounding: |y - ref| <= 2 * eps(dtype) * max|ref| (bf16 eps 2^-7,
fp16 2^-10); float32 outputs within 1e-5 relative. FP8 activation codes and scales are bit-exact.
"""

import importlib.util

import pytest
import torch

from quantkit.errors import KernelError
from quantkit.kernels import cpu_int4, reference
from quantkit.kernels.select import choose_int_kernel, use_kernel
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.packing import pack_int32
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.quant.schemes import QuantScheme

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _close(y: torch.Tensor, ref: torch.Tensor):
    eps = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[y.dtype]
    err = (y.float() - ref.float()).abs().max().item()
    bound = 2 * eps * ref.float().abs().max().item() + 1e-6
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def _weight(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    groups = k // group
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zp = None if symmetric else torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8)
    return codes, scale, zp


# -- CPU int4 op --------------------------------------------------------------------------------

@pytest.mark.parametrize("group,symmetric,n,k", [(32, True, 48, 256), (64, False, 100, 512), (128, True, 64, 384),
                                                 (256, False, 32, 512), ("channel", True, 40, 320),
                                                 ("channel", False, 16, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_int4_matches_reference(group, symmetric, n, k, dtype):
    gs = k if group == "channel" else group
    codes, scale, zp = _weight(n, k, gs, symmetric)
    packed = cpu_int4.repack(codes, scale, zp, gs, dtype)
    for m in (1, 7, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n).to(dtype)
        y = packed.matmul(x, bias)
        assert y.shape == (m, n) and y.dtype == dtype
        # the reference in float32 (the op rounds scales/zeros to dtype: compare with those values)
        ref = reference.int_weight_matmul(x.float(), codes, scale, zp, gs, bias.float())
        _close(y, ref.to(dtype) if dtype == torch.float32 else ref)


def test_float32_inputs_can_run_the_op_in_bf16():
    """Weights repacked for a bf16 op take float32 inputs and return float32: exactly the op's result on
    the cast input (a W4A16 layer's 16-bit activations)."""
    codes, scale, zp = _weight(64, 256, 64, True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    w = cpu_int4.repack(codes, scale, zp, 64, torch.bfloat16)
    y = w.matmul(x)
    assert y.dtype == torch.float32 and torch.equal(y, w.matmul(x.to(torch.bfloat16)).float())


def test_the_loader_never_narrows_int4_activations_for_the_batch_workload(tiny_models, tmp_path, monkeypatch):
    """float32 chosen by the policy (as on an AVX2 CPU) or asked for: W4A16 layers run the op in float32, exactly
    as the model computes (until 2026-12-05 the policy's float32 let them round activations to bf16 unsaid)."""
    import quantkit
    from quantkit.platform import compute
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe
    from quantkit.qmodules.int_linear import PackedIntLinear

    out = quantize(str(tiny_models["llama"]), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
                   tmp_path / "q", progress=False).output
    monkeypatch.setattr(compute, "cpu_features", lambda: compute.CpuFeatures("AVX2", True))
    monkeypatch.delenv(compute.ENV, raising=False)  # the policy's own choice, whatever the suite was run with
    for model in (quantkit.load(out), quantkit.load(out, dtype="float32")):
        assert model.quantkit_compute.name == "float32"
        linears = [m for m in model.modules() if isinstance(m, PackedIntLinear)]
        assert linears and {m.op_dtype for m in linears} == {None}
        assert {m._prepared[2].dtype for m in linears if m.kernel == "cpu"} == {torch.float32}


def test_cpu_int4_rejects_what_it_cannot_run():
    assert cpu_int4.unsupported_reason(4, 256, 64) is None
    assert "4-bit" in cpu_int4.unsupported_reason(8, 256, 64)
    assert "group size 16" in cpu_int4.unsupported_reason(4, 256, 16)
    assert "group size 80" in cpu_int4.unsupported_reason(4, 80, 80)  # per channel, K has no supported divisor
    assert cpu_int4.kernel_group_size(320, 320) == 64  # per channel: largest supported divisor, scale repeated


# -- Triton W4A16 -------------------------------------------------------------------------------

LAYOUTS = [(32, True, 72, 192), (64, False, 72, 192), (128, True, 40, 256), ("channel", False, 72, 100)]


@needs_triton
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("group,symmetric,n,k", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_w4a16_matches_reference(m, group, symmetric, n, k, dtype):
    from quantkit.kernels import triton_w4a16

    gs = k if group == "channel" else group
    codes, scale, zp = _weight(n, k, gs, symmetric, seed=m)
    w = triton_w4a16.repack(pack_int32(codes, 4, 1).to(DEVICE), scale.to(DEVICE),
                            None if zp is None else zp.to(DEVICE), gs, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    y = triton_w4a16.matmul(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, reference.int_weight_matmul(x.float(), codes.to(DEVICE), scale.to(DEVICE),
                                          None if zp is None else zp.to(DEVICE), gs))


@needs_triton
@pytest.mark.parametrize("block_m,block_n,block_k,split", [(16, 32, 16, 1), (16, 16, 64, 3), (32, 64, 32, 4),
                                                           (16, 32, 32, 16)])
def test_triton_w4a16_configs_and_split_k(block_m, block_n, block_k, split):
    """Every tiling gives the reference's result, including split-K slices that end mid-group
    and slices left empty (split 16 over K = 192 with BLOCK_K 32)."""
    from quantkit.kernels import triton_w4a16

    codes, scale, zp = _weight(40, 192, 64, False, seed=3)
    w = triton_w4a16.repack(pack_int32(codes, 4, 1).to(DEVICE), scale.to(DEVICE), zp.to(DEVICE), 64, 192)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(2)).to(torch.float16).to(DEVICE)
    import triton

    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split})
    bias = torch.randn(40).to(torch.float16).to(DEVICE)
    y = triton_w4a16.matmul(x, w, bias, config=config)
    _close(y, reference.int_weight_matmul(x.float(), codes.to(DEVICE), scale.to(DEVICE), zp.to(DEVICE), 64,
                                          bias.float()))


@needs_triton
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("block_n,block_w,split,group,symmetric,k", [
    (32, 4, 1, 64, True, 192),    # a K step of 32 inside a group of 64: the scale once per column, after the products
    (16, 8, 3, 32, False, 192),   # a K step of 64 over two groups of 32: per-element scales; slices end mid-way
    (64, 16, 4, 128, True, 384),  # three K steps of 128 over four slices: one slice left empty
    (32, 2, 16, "channel", False, 200),  # K not a multiple of the step: the last step partly masked
])
def test_triton_w4a16_gemv_configs(m, block_n, block_w, split, group, symmetric, k):
    """The decode GEMV (each packed word loaded once, unpacked in registers) gives the reference's result in
    every tiling: one row by multiply-and-sum, several by tl.dot, with and without zero points and split K."""
    import triton

    from quantkit.kernels import triton_w4a16

    n = 40
    gs = k if group == "channel" else group
    codes, scale, zp = _weight(n, k, gs, symmetric, seed=m)
    w = triton_w4a16.repack(pack_int32(codes, 4, 1).to(DEVICE), scale.to(DEVICE),
                            None if zp is None else zp.to(DEVICE), gs, k)
    config = triton.Config({"BLOCK_N": block_n, "BLOCK_W": block_w, "SPLIT_K": split})
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
        y = triton_w4a16.matmul(x, w, config=config)
        assert y.shape == (m, n) and y.dtype == dtype
        _close(y, reference.int_weight_matmul(x.float(), codes.to(DEVICE), scale.to(DEVICE),
                                              None if zp is None else zp.to(DEVICE), gs))


# -- torch's CUDA int4 op (a GPU only) ----------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_int4_nibble_order_fixed_values():
    """The CUDA op's input: element 2j in byte j's high nibble, offset binary (runs anywhere: pure torch)."""
    from quantkit.kernels import cuda_int4

    codes = torch.tensor([[-8, 7, 0, -1]], dtype=torch.int8)  # u = 0, 15, 8, 7
    assert cuda_int4.pack_nibbles(codes).tolist() == [[0x0F, 0x87]]
    table = cuda_int4.scale_zeros(torch.tensor([[0.5, 2.0]]), torch.tensor([[1, -2]], dtype=torch.int8), 1)
    assert table.shape == (2, 1, 2) and table.float().tolist() == [[[0.5, -0.5]], [[2.0, 4.0]]]


def test_cuda_int4_refuses_what_it_cannot_run():
    from quantkit.kernels import cuda_int4

    assert "CUDA tensors" in cuda_int4.unsupported_reason(torch.device("cpu"), 4, 256, 64, 64)
    assert cuda_int4.kernel_group_size(4096, 4096) == 256 and cuda_int4.inner_k_tiles(4096) == 8
    assert cuda_int4.inner_k_tiles(48) is None


@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 64])
@pytest.mark.parametrize("group,symmetric,n,k", [(32, True, 64, 256), (128, False, 96, 512), ("channel", True, 32, 768)])
def test_cuda_int4_matches_reference(m, group, symmetric, n, k):
    from quantkit.kernels import cuda_int4

    gs = k if group == "channel" else group
    codes, scale, zp = _weight(n, k, gs, symmetric, seed=m)
    dev = torch.device("cuda")
    w = cuda_int4.repack(codes.to(dev), scale.to(dev), None if zp is None else zp.to(dev), gs)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
    bias = torch.randn(n).to(torch.bfloat16).to(dev)
    y = w.matmul(x, bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # the op rounds scales and zeros (-zp * scale) to bf16: the reference with those values
    _close(y, reference.int_weight_matmul(x.float(), codes.to(dev), scale.to(dev), None if zp is None else zp.to(dev),
                                          gs, bias.float()))


@needs_triton
def test_triton_w4a16_layout_fixed_values():
    """Codes 0..7 then -8..-1 along K of column 0: offset-binary nibbles 8..15 and 0..7, first
    k in the lowest bits; the kernel's words are compressed-tensors' words transposed."""
    from quantkit.kernels import triton_w4a16

    codes = torch.zeros(2, 16, dtype=torch.int8)
    codes[0] = torch.tensor(list(range(8)) + list(range(-8, 0)), dtype=torch.int8)
    w = triton_w4a16.repack(pack_int32(codes, 4, 1), torch.ones(2, 1, dtype=torch.bfloat16), None, 16, 16)
    assert w.qweight.shape == (2, 2)
    assert w.qweight[0, 0].item() == 0xFEDCBA98 - 2**32
    assert w.qweight[1, 0].item() == 0x76543210
    assert w.qweight[0, 1].item() == 0x88888888 - 2**32  # all-zero codes of row 1


@needs_triton
def test_triton_w4a16_rejects_bad_input():
    from quantkit.kernels import triton_w4a16

    codes, scale, _ = _weight(16, 64, 32, True)
    w = triton_w4a16.repack(pack_int32(codes, 4, 1), scale, None, 32, 64)
    with pytest.raises(ValueError, match="input width 32"):
        triton_w4a16.matmul(torch.randn(1, 32, dtype=torch.float16), w)


# -- Triton FP8 ---------------------------------------------------------------------------------

@needs_triton
def test_fp8_rounding_fixed_values():
    """Saturation at 448, ties to even on the e4m3 grid, subnormals (spacing 2^-9), signed zeros."""
    from quantkit.kernels import triton_fp8

    # the row's amax is 448, so its scale is exactly 1 and the codes are the values rounded
    values = torch.tensor([448.0, -448.0, 31.6, 30.0, 17.0, 2**-9, 2**-10, 3 * 2**-10, 1.0625, 1.1875, -0.0, 0.0, 400.0])
    expected = torch.tensor([448.0, -448.0, 32.0, 30.0, 16.0, 2**-9, 0.0, 2**-8, 1.0, 1.25, -0.0, 0.0, 384.0])
    q, s = triton_fp8.quantize_per_token(values[None].to(DEVICE))
    assert s.item() == 1.0
    assert torch.equal(q.float().cpu()[0], expected)
    assert torch.equal(torch.signbit(q.float().cpu()[0]), torch.signbit(expected))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_per_token_quantization_is_bit_exact(dtype):
    from quantkit.kernels import triton_fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 300, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    x[3] = 0.0  # a zero row: scale eps / 448, codes 0
    x[4, 7] = 6e4 if dtype == torch.float16 else 1e6  # one huge value: the row's other codes underflow towards 0
    x = x.to(dtype)
    q, s = triton_fp8.quantize_per_token(x.to(DEVICE))
    q_ref, s_ref = reference.fp8_quantize_per_token(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.isfinite(q.float()).all()
    # 3-D input keeps its leading dims
    q3, s3 = triton_fp8.quantize_per_token(x[:6].reshape(2, 3, 300).to(DEVICE))
    assert q3.shape == (2, 3, 300) and s3.shape == (2, 3, 1)


@needs_triton
@pytest.mark.parametrize("m", [1, 7, 16, 64, 100])  # 100: several M tiles (32 under the interpreter) and a ragged one
@pytest.mark.parametrize("per_token,per_channel", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("fp8_dot", [True, False])
def test_fp8_gemm_matches_reference(m, per_token, per_channel, fp8_dot):
    from quantkit.kernels import triton_fp8

    g = torch.Generator().manual_seed(m)
    n, k = 70, 200
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE) * 0.05
    if per_token:
        xq, xs = triton_fp8.quantize_per_token(x)
    else:
        xs = (x.abs().amax() / 448).reshape(1)
        xq = (x / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / 448
    wq = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
    bias = torch.randn(n, generator=g).to(DEVICE)
    for out_dtype in (torch.bfloat16, torch.float16):
        y = triton_fp8.matmul(xq, xs, wq, ws, out_dtype, bias=bias, fp8_dot=fp8_dot)
        _close(y, reference.fp8_matmul(xq, xs, wq, ws, torch.float32, bias))


@needs_triton
def test_scaled_mm_refuses_what_it_cannot_run(monkeypatch):
    from quantkit.kernels import cuda_fp8

    assert "CUDA tensors" in cuda_fp8.unsupported_reason(torch.device("cpu"), 64, 64, True, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "no FP8 tensor cores" in cuda_fp8.unsupported_reason(torch.device("cuda"), 64, 64, True, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert cuda_fp8.unsupported_reason(cuda, 64, 64, True, torch.bfloat16) is None
    assert "multiples of 16" in cuda_fp8.unsupported_reason(cuda, 72, 40, False, torch.bfloat16)
    assert "row-wise scales give bf16" in cuda_fp8.unsupported_reason(cuda, 64, 64, True, torch.float16)
    assert cuda_fp8.unsupported_reason(cuda, 64, 64, False, torch.float16) is None  # per tensor: any output


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 1024])
@pytest.mark.parametrize("per_token,per_channel", [(True, True), (False, False), (True, False), (False, True)])
def test_scaled_mm_matches_reference(m, per_token, per_channel):
    from quantkit.kernels import cuda_fp8, triton_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    dev, n, k = torch.device("cuda"), 256, 512
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    w = torch.randn(n, k, generator=g).to(dev)
    ws = (w.abs().amax(dim=1, keepdim=True) / 448) if per_channel else (w.abs().amax() / 448).reshape(1)
    wq = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
    if per_token:
        xq, xs = triton_fp8.quantize_per_token(x)
    else:
        xs = (x.float().abs().amax() / 448).reshape(1)
        xq = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(dev)
    y = cuda_fp8.matmul(xq, xs, wq, ws, torch.bfloat16, bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close(y, reference.fp8_matmul(xq, xs, wq, ws, torch.float32, bias))


def test_fp8_gemm_rejects_bad_input():
    from quantkit.kernels import triton_fp8

    xq = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        triton_fp8.matmul(xq.float(), torch.ones(4, 1), wq, torch.ones(1), torch.bfloat16)
    with pytest.raises(ValueError, match="3 activation scales for 4 tokens"):
        triton_fp8.matmul(xq, torch.ones(3, 1), wq, torch.ones(1), torch.bfloat16)


# -- the quantized linear's choice --------------------------------------------------------------

def _packed_linear(n: int, k: int, scheme: QuantScheme) -> PackedIntLinear:
    gs = k if scheme.strategy == "channel" else scheme.group_size
    codes, scale, zp = _weight(n, k, gs, scheme.symmetric)
    codes = codes.clamp(scheme.qmin, scheme.qmax)
    return PackedIntLinear.from_quantized(QuantizedWeight(codes, scale, zp, scheme), torch.randn(n).to(torch.bfloat16))


def test_choice_logic(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("QUANTKIT_KERNEL", raising=False)
    assert choose_int_kernel(cpu, 4, 256, 64) == "cpu"
    assert choose_int_kernel(cpu, 4, 256, 16) == "torch"  # group 16: the int4 op cannot, quietly the reference
    assert choose_int_kernel(cpu, 8, 256, 256) == "torch"
    monkeypatch.setenv("QUANTKIT_KERNEL", "torch")
    assert choose_int_kernel(cpu, 4, 256, 64) == "torch"
    monkeypatch.setenv("QUANTKIT_KERNEL", "cpu")
    with pytest.raises(KernelError, match="QUANTKIT_KERNEL=cpu cannot run.*group size 16"):
        choose_int_kernel(cpu, 4, 256, 16)
    monkeypatch.setenv("QUANTKIT_KERNEL", "fast")
    with pytest.raises(KernelError, match="names no kernel; use one of: auto, triton, cuda, cpu, torch"):
        choose_int_kernel(cpu, 4, 256, 64)
    monkeypatch.setenv("QUANTKIT_KERNEL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(KernelError, match="Triton runs on CUDA devices"):
            choose_int_kernel(cpu, 4, 256, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_int_kernel(cpu, 4, 256, 64) == "triton"
    with pytest.raises(KernelError, match="4-bit weights, not 8-bit"):
        choose_int_kernel(cpu, 8, 256, 64)


def test_cuda_candidates_keep_bf16_kernels_for_bf16_inputs(monkeypatch):
    """On a CUDA device (faked: a capability 9.0 card) torch's int4 op is a candidate only for bf16 inputs, ahead of
    Triton (the two are then timed); forced for float32 inputs it is refused, naming the dtype."""
    from quantkit.kernels.select import int_kernels

    monkeypatch.delenv("QUANTKIT_KERNEL", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    triton_ok = importlib.util.find_spec("triton") is not None
    expected = ("cuda", "triton", "torch") if triton_ok else ("cuda", "torch")
    assert int_kernels(cuda, 4, 4096, 128, 4096, torch.bfloat16) == expected
    assert int_kernels(cuda, 4, 4096, 128, 4096, torch.float32) == expected[1:]
    assert int_kernels(cuda, 4, 4096, 128, 4100, torch.bfloat16) == expected[1:]  # N not a multiple of 8
    assert int_kernels(cuda, 8, 4096, 128, 4096, torch.bfloat16) == ("torch",)
    with pytest.raises(KernelError, match="computes in bfloat16 and the inputs are float32"):
        int_kernels(cuda, 4, 4096, 128, 4096, torch.float32, forced="cuda")


@pytest.mark.parametrize("scheme", [QuantScheme(num_bits=4, group_size=32),
                                    QuantScheme(num_bits=4, symmetric=False, group_size=64),
                                    QuantScheme(num_bits=4, strategy="channel", group_size=None)])
@needs_triton
def test_packed_linear_gives_the_same_result_on_every_kernel(monkeypatch, scheme):
    lin = _packed_linear(48, 256, scheme)
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    use_kernel(lin, "torch")
    ref = lin(x)
    assert lin.kernel == "torch"
    outputs = {}
    for kernel in ("cpu", "triton"):
        use_kernel(lin, kernel)
        outputs[kernel] = lin(x)
        assert lin.kernel == kernel
        assert outputs[kernel].shape == ref.shape
        _close(outputs[kernel], ref.float())
    # past cpu_int4.MAX_TOKENS tokens the CPU kernel dequantizes once and runs a GEMM: same result
    from quantkit.kernels.cpu_int4 import MAX_TOKENS

    many = torch.randn(MAX_TOKENS + 40, 256, dtype=torch.bfloat16)
    use_kernel(lin, "torch")
    ref_many = lin(many)
    use_kernel(lin, "cpu")
    _close(lin(many), ref_many.float())
    # the repacked weight is cached per (device, dtype, weight version); loading new weights invalidates it
    use_kernel(lin, "cpu")
    lin(x)
    cached = lin._prepared
    lin(x)
    assert lin._prepared is cached
    lin.weight_scale.mul_(2)
    y2 = lin(x)
    assert lin._prepared is not cached
    bias = lin.bias.float()
    _close(y2, 2 * (outputs["cpu"].float() - bias) + bias)
    # the state dict holds only the checkpoint's tensors
    assert set(lin.state_dict()) <= {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "bias"}
