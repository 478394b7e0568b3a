"""plugins/fp8.py: the e4m3 rules every FP8 path is checked against."""
import torch

from kiln.plugins.fp8 import E4M3_MAX, FP8, MIN_SCALE, dequantize_rows, fp8_linear, quantize_rows, to_e4m3


def test_rows_map_their_largest_magnitude_to_448_and_round_within_e4m3_precision():
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), E4M3_MAX))
    # e4m3 keeps 3 mantissa bits: a normal value is within 2**-4 of itself.
    back = dequantize_rows(q, scale)
    normal = x.abs() >= scale[:, None] * 2.0 ** -6
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + 1e-12)[normal].all()


def test_a_zero_row_stays_zero_and_overflow_saturates_instead_of_becoming_nan():
    q, scale = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(scale, torch.full((2,), MIN_SCALE)) and not q.float().any()
    assert to_e4m3(torch.tensor([1e6, -1e6]), torch.tensor(1.0)).float().tolist() == [E4M3_MAX, -E4M3_MAX]


def test_fp8_linear_is_close_to_the_full_precision_product():
    torch.manual_seed(0)
    x, w = torch.randn(8, 512, dtype=torch.bfloat16), torch.randn(256, 512)
    wq, w_scale = quantize_rows(w)
    y = fp8_linear(x, wq, w_scale)
    ref = x.float() @ w.t()
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).norm() / ref.norm() < 0.06
