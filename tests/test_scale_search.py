"""The importance-weighted block-scale search (quantkit.quant.scale_search) against brute force over every
float16 scale, against llama.cpp's candidate rule, and on blocks whose answer is known."""

import pytest
import torch

from quantkit.quant.scale_search import WINDOW, block_error, search_scale, sweep

TINY = float(torch.finfo(torch.float16).tiny)


def every_fp16(positive_only: bool = False) -> torch.Tensor:
    """Every finite float16 value of magnitude >= the smallest normal (both signs unless positive_only)."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    v = v[torch.isfinite(v) & (v.abs() >= TINY)]
    return v[v > 0] if positive_only else v


def brute(x, h, qmin, qmax, cand):
    """The least error over the candidate scales cand [k] for each block of x [R, n] (chunked)."""
    return torch.stack([block_error(x[r : r + 1], h if h.dim() == 1 else h[r : r + 1], cand.unsqueeze(0),
                                    qmin, qmax)[0].min() for r in range(x.shape[0])])


def blocks(n: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard cases: outliers, a few inputs dominating the importance, a zero block, a near-constant block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g)
    x[: rows // 4] *= torch.rand(rows // 4, n, generator=g) ** 3 * 4
    x[rows // 4] = 0.0
    x[rows // 4 + 1] = 0.3 + 1e-3 * torch.randn(n, generator=g)
    h = torch.rand(rows, n, generator=g) ** 4
    return x, h


@pytest.mark.parametrize("n,qmin,qmax", [(4, -8, 7), (8, -8, 7), (32, -8, 7), (32, -16, 15)])  # Q4_0, Q5_0
def test_search_equals_brute_force_over_every_fp16_scale(n, qmin, qmax):
    x, h = blocks(n, 48, seed=n - qmin)
    d = search_scale(x, h, qmin, qmax)
    assert d.dtype == torch.float32 and torch.equal(d, d.to(torch.float16).float())  # a float16 value
    ours = block_error(x, h, d.unsqueeze(-1), qmin, qmax)[:, 0]
    best = brute(x, h, qmin, qmax, every_fp16())
    assert bool((ours <= best * (1 + 1e-6) + 1e-12).all()), (ours / best).max()


def test_sweep_reports_its_error_and_no_dense_scan_beats_it():
    """The sweep's error is the real error of its (float16) d, and no scale of a dense scan of both signs,
    rounded to float16, does better."""
    x, h = blocks(32, 24, seed=5)
    x, h = x[x.abs().amax(-1) > 0], h[x.abs().amax(-1) > 0]
    d, e = sweep(x, h, -8, 7)
    S = (h * x * x).sum(-1)
    got = block_error(x, h, d.unsqueeze(-1), -8, 7)[:, 0]
    assert torch.allclose(got, S + e, rtol=1e-4, atol=1e-6)  # the reported error is the real one
    assert torch.equal(d, d.to(torch.float16).float())
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    scan = amax * torch.cat([torch.linspace(-1.0, -1e-3, 4000), torch.linspace(1e-3, 1.0, 4000)])
    scan = scan.to(torch.float16).float()
    dense = block_error(x, h, scan, -8, 7).amin(-1)
    assert bool((got <= dense * (1 + 1e-5) + 1e-9).all())


def llama_cpp_rule(x, h):
    """llama.cpp's imatrix Q4_0 choice as its source describes it (make_qx_quants, nmax 8): the signed
    extreme on -(8 + 0.1 k), k in -9..9, the codes that gives, their least-squares scale; the best of those
    (its codes kept), stored as float16."""
    ext = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    best_e = torch.full((x.shape[0],), float("inf"))
    best_d = torch.zeros(x.shape[0])
    for k in range(-9, 10):
        inv = -(8 + 0.1 * k) / ext
        c = (x * inv).round().clamp(-8, 7)
        d = (h * x * c).sum(-1) / (h * c * c).sum(-1).clamp_min(1e-30)
        e = (h * (x - d.unsqueeze(-1) * c) ** 2).sum(-1)
        better = e < best_e
        best_e, best_d = torch.where(better, e, best_e), torch.where(better, d, best_d)
    return best_d.to(torch.float16).float()


def test_q4_0_search_never_worse_than_llama_cpp_or_ggml_rule():
    x, h = blocks(32, 256, seed=7)
    x, h = x[x.abs().amax(-1) > 0], h[x.abs().amax(-1) > 0]
    ours = block_error(x, h, search_scale(x, h, -8, 7).unsqueeze(-1), -8, 7)[:, 0]
    theirs = block_error(x, h, llama_cpp_rule(x, h).unsqueeze(-1), -8, 7)[:, 0]
    ext = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    plain = block_error(x, h, (ext / -8).to(torch.float16).float(), -8, 7)[:, 0]
    assert bool((ours <= theirs * (1 + 1e-6)).all()) and bool((ours <= plain * (1 + 1e-6)).all())
    assert float(ours.sum()) < 0.95 * float(theirs.sum())  # better in sum on these outlier-heavy blocks (0.91x)


def test_q4_0_known_answers():
    """A block on a grid is found exactly; an outlier of no importance is ignored; zeros get the tiny scale."""
    x = torch.tensor([[0.25 * c for c in range(-8, 8)] * 2])  # codes -8..7 at d = 0.25
    d = search_scale(x, torch.ones(32), -8, 7)
    assert block_error(x, torch.ones(32), d.unsqueeze(-1), -8, 7).item() == 0.0
    y = x.clone()
    y[0, 0] = 100.0  # of no importance: the rest still fit exactly
    h = torch.ones(32)
    h[0] = 0.0
    d = search_scale(y, h, -8, 7)
    assert block_error(y, h, d.unsqueeze(-1), -8, 7).item() == 0.0
    assert search_scale(torch.zeros(2, 32), torch.ones(32), -8, 7).tolist() == [TINY, TINY]


def test_q8_0_search_exhaustive_in_its_window_and_never_worse_than_ggml():
    x, h = blocks(32, 32, seed=3)
    d = search_scale(x, h, -128, 127, symmetric=True)
    assert bool((d > 0).all())
    ours = block_error(x, h, d.unsqueeze(-1), -128, 127)[:, 0]
    amax = x.abs().amax(-1).clamp_min(TINY)
    plain = block_error(x, h, (amax / 127).to(torch.float16).float().unsqueeze(-1), -128, 127)[:, 0]
    assert bool((ours <= plain).all())
    allv = every_fp16(positive_only=True)
    for r in range(x.shape[0]):  # brute force over every float16 scale of the window
        lo, hi = amax[r] / (127 + WINDOW[1]), amax[r] / (127 + WINDOW[0])
        cand = allv[(allv >= lo.to(torch.float16).float()) & (allv <= hi.to(torch.float16).float())]
        if cand.numel():
            assert ours[r] <= block_error(x[r : r + 1], h[r : r + 1], cand.unsqueeze(0), -128, 127).min() * (1 + 1e-6)


def test_q4_k_sub_block_fit_never_worse_than_llama_cpp_family():
    """Each Q4_K sub-block's searched (scale, min), unrounded, does no worse than llama.cpp's make_qkx3_quants
    family as its source describes it (codes at 1/scale = (15 + r) / (max - min), r = -0.9 .. 0.9 by 0.05, the
    weighted least-squares scale and min of those codes, min <= 0, the best by weighted error)."""
    from quantkit.quant.ggml import _best_float_k4, _error

    x, h = blocks(32, 64, seed=11)
    x, h = x[x.abs().amax(-1) > 0], h[x.abs().amax(-1) > 0]
    scale, mins = _best_float_k4(x, h)
    ours = _error("Q4_K", x, h, scale, mins)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    best = torch.full_like(ours, float("inf"))
    for k in range(37):
        inv = (15 - 0.9 + 0.05 * k) / (hi - lo)
        q = ((x - lo[:, None]) * inv[:, None]).round().clamp(0, 15)
        sw, sx, sl = h.sum(-1), (h * x).sum(-1), (h * q).sum(-1)
        sl2, sxl = (h * q * q).sum(-1), (h * q * x).sum(-1)
        det = sw * sl2 - sl * sl
        a, b = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
        a, b = torch.where(b > 0, sxl / sl2, a), torch.where(b > 0, torch.zeros_like(b), b)
        # their error: of their codes on their (scale, min); ours re-rounds, which is never worse
        best = torch.minimum(best, (h * (x - (a[:, None] * q + b[:, None])) ** 2).sum(-1))
    assert bool((ours <= best * (1 + 1e-5) + 1e-9).all())


@pytest.mark.parametrize("preset", ["Q4_0", "Q8_0"])
def test_gptq_with_searched_scales_beats_the_plain_rule_in_both_orders(preset):
    """GPTQ onto Q4_0 / Q8_0 with searched block scales (as each block is reached; with act-order, fixed on
    the original weights before the solve) has a lower Hessian-weighted error than with ggml's plain rule,
    and its scales stay what GGUF stores (float16; Q4_0 zero points 0 / -1)."""
    from quantkit.quant.gptq import gptq_quantize, hessian_error
    from quantkit.quant.schemes import PRESETS, QuantScheme

    g = torch.Generator().manual_seed(0)
    n, out = 128, 96
    X = torch.randn(2048, n, generator=g) * (torch.rand(n, generator=g) ** 3 * 4 + 0.1)
    H = X.t() @ X / X.shape[0]
    W = torch.randn(out, n, generator=g) * 0.05
    for actorder in (False, True):
        scheme = QuantScheme(**PRESETS[preset], **({"actorder": "static"} if actorder else {}))
        errors = []
        for search in (False, True):
            res = gptq_quantize(W.clone(), H, scheme, torch.float16, actorder=actorder, scale_search=search)
            assert res.weight.scale.dtype == torch.float16
            if preset == "Q4_0":
                assert set(res.weight.zero_point.unique().tolist()) <= {0, -1}
            errors.append(hessian_error(W, res.weight.dequantize(torch.float32), H))
        assert errors[1] < 0.9 * errors[0], (actorder, errors)
