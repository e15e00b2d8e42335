"""Round-to-nearest maths: fixed examples, error bounds, SQNR thresholds, storage-dtype exactness."""

import pytest
import torch

from quantkit.quant.intq import dequantize, minmax_qparams, quantize, rtn, sqnr_db
from quantkit.quant.schemes import QuantScheme

SYM4_CH = QuantScheme(num_bits=4, symmetric=True, strategy="channel", group_size=None)
ASYM4_CH = QuantScheme(num_bits=4, symmetric=False, strategy="channel", group_size=None)


def test_symmetric_fixed_values():
    w = torch.tensor([[-1.5, 0.0, 0.75, 1.5]])
    qw = rtn(w, SYM4_CH, torch.float32)
    assert qw.scale.tolist() == [[pytest.approx(0.2)]]  # absmax / 7.5
    assert qw.q.tolist() == [[-8, 0, 4, 7]]  # -7.5 rounds to -8 (half to even), +7.5 -> 8 clamps to 7
    assert qw.zero_point is None
    assert torch.allclose(qw.dequantize(), torch.tensor([[-1.6, 0.0, 0.8, 1.4]]))


def test_asymmetric_fixed_values():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    qw = rtn(w, ASYM4_CH, torch.float32)
    assert qw.scale.tolist() == [[pytest.approx(0.2)]]  # (3 - 0) / 15
    assert qw.zero_point.tolist() == [[-8]]
    assert qw.q.tolist() == [[-8, -3, 2, 7]]
    assert torch.allclose(qw.dequantize(), w, atol=1e-6)


def test_group_scales_are_per_group():
    w = torch.cat([torch.full((2, 4), 0.5), torch.full((2, 4), 8.0)], dim=1)  # two groups of 4
    scheme = QuantScheme(num_bits=4, group_size=4)
    scale, _ = minmax_qparams(w, scheme, torch.float32)
    assert scale.shape == (2, 2)
    assert torch.allclose(scale, torch.tensor([[0.5 / 7.5, 8 / 7.5]] * 2))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_error_bounded_by_half_step(symmetric, group_size):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    scheme = QuantScheme(num_bits=4, symmetric=symmetric, group_size=group_size)
    qw = rtn(w, scheme, torch.float32)
    err = (w - qw.dequantize()).abs().reshape(16, -1, group_size)
    assert (err <= qw.scale.unsqueeze(-1) * 0.5 + 1e-6).all()


@pytest.mark.parametrize(
    "scheme,min_db",
    [
        (QuantScheme(num_bits=4, group_size=128), 18.0),
        (QuantScheme(num_bits=4, symmetric=False, group_size=32), 20.0),
        (QuantScheme(num_bits=8, strategy="channel", group_size=None), 38.0),
    ],
)
def test_sqnr_on_gaussian_weights(scheme, min_db):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    db = sqnr_db(w, rtn(w, scheme, torch.bfloat16).dequantize())
    assert db > min_db


def test_bf16_scales_reproduce_codes_exactly():
    """Codes are computed with the stored (rounded) scale, so re-quantizing the dequantized weight is exact."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    for symmetric in (True, False):
        scheme = QuantScheme(num_bits=4, symmetric=symmetric, group_size=64)
        qw = rtn(w, scheme, torch.bfloat16)
        assert qw.scale.dtype == torch.bfloat16
        again = quantize(qw.dequantize(), qw.scale, qw.zero_point, scheme)
        assert torch.equal(again, qw.q)


def test_zero_weights_give_zero_and_finite_scales():
    w = torch.zeros(4, 64)
    for symmetric in (True, False):
        qw = rtn(w, QuantScheme(num_bits=4, symmetric=symmetric, group_size=32), torch.bfloat16)
        assert torch.isfinite(qw.scale.float()).all() and (qw.scale > 0).all()
        assert torch.equal(qw.dequantize(), w)


def test_dequantize_in_bf16_is_single_rounding_of_exact_product():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    scheme = QuantScheme(num_bits=4, symmetric=False, group_size=32)
    qw = rtn(w, scheme, torch.bfloat16)
    exact = dequantize(qw.q, qw.scale, qw.zero_point, scheme, torch.float64)
    assert torch.equal(qw.dequantize(torch.bfloat16), exact.to(torch.bfloat16))


def test_group_size_that_does_not_divide_is_refused_not_regrouped():
    """[4, 130] with group 64: the old check (`in % groups`, groups = 130 // 64 = 2) passed and quantized in
    groups of 65; 64 does not divide 130, so it must be an error."""
    w = torch.randn(4, 130)
    with pytest.raises(ValueError, match="group_size 64 does not divide in_features 130"):
        rtn(w, QuantScheme(num_bits=4, group_size=64), torch.float32)
    qw = rtn(torch.randn(4, 128), QuantScheme(num_bits=4, group_size=64), torch.float32)
    assert qw.scale.shape == (4, 2)
