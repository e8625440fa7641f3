"""Weight-only fp8 quantization (tandem/layers/quant.py): per-row power-of-two scales, exact
fake quantization, and the loader applying it."""
import torch
from torch import nn

from tandem.layers.quant import FP8_MAX, fake_quantize_fp8_, quantize_fp8, quantize_linears_


def test_rows_scaled_by_least_power_of_two():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-4, 1, 64)[:, None]
    w[5] = 0
    w[6] = -w[6].abs()  # the largest magnitude a row's minimum
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    amax = w.abs().amax(1)
    live = amax > 0
    assert (amax[live] / s[live] <= FP8_MAX).all() and (amax[live] / s[live] > FP8_MAX / 2).all()
    assert (q[5].float() == 0).all()
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= 16 * s[:, None]).all()  # half a step of e4m3's coarsest spacing (32 in [256, 448])


def test_bf16_weights_are_scaled_in_bf16_to_the_same_bytes():
    """quantize_fp8 scales bf16 weights in bf16 (faster on the CPU): the bytes fp32 arithmetic
    gives, tiny rows, all-zero rows and values under e4m3's least step included."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 257, generator=g) * torch.logspace(-38, 3, 96)[:, None]).to(torch.bfloat16)
    w[7] = 0
    w[9, :5] = torch.tensor([1e-38, -3e-39, 2.0, 1e-10, 0.0])  # bf16 subnormals beside a large value
    q, s = quantize_fp8(w)
    q32, s32 = quantize_fp8(w.float())
    assert torch.equal(s, s32) and torch.equal(q.view(torch.uint8), q32.view(torch.uint8))
    fake = w.clone()
    fake_quantize_fp8_(fake)
    assert torch.equal(fake, (q32.float() * s32[:, None]).to(torch.bfloat16))


def test_fake_quantization_is_exact_and_idempotent():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(32, 200, generator=g) * 0.03).to(dtype)
        ref = w.clone()
        fake_quantize_fp8_(w)
        q, s = quantize_fp8(w)
        assert torch.equal(q.float() * s[:, None], w.float())  # q * s in the dtype, exactly
        again = w.clone()
        fake_quantize_fp8_(again)
        assert torch.equal(again, w)
        rel = ((w.float() - ref.float()).abs().amax() / ref.float().abs().amax()).item()
        assert 0 < rel <= 2 ** -4


def test_marking_only_rounds_shared_weights_alone():
    """quantize_linears_(in_place=False) marks the linears and rounds in place only a weight another
    module shares (a tied embedding); the fp8 bytes of each (what W8Linear streams) are those of
    the weights rounded in place."""

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(48, 32)
            self.proj = nn.Linear(32, 40, bias=False)
            self.lm_head = nn.Linear(32, 48, bias=False)
            self.lm_head.weight = self.embed.weight

    torch.manual_seed(3)
    marked, rounded = Tiny().to(torch.bfloat16), Tiny().to(torch.bfloat16)
    rounded.load_state_dict(marked.state_dict())
    before = marked.proj.weight.clone()
    quantize_linears_(marked, "fp8", in_place=False)
    quantize_linears_(rounded, "fp8")
    assert marked.proj.fp8_weights and marked.lm_head.fp8_weights
    assert torch.equal(marked.proj.weight, before)  # left for W8Linear to round
    assert torch.equal(marked.embed.weight, rounded.embed.weight)  # the tied table: rounded
    assert not torch.equal(rounded.proj.weight, before)
    for a, b in ((marked.proj, rounded.proj), (marked.lm_head, rounded.lm_head)):
        (qa, sa), (qb, sb) = quantize_fp8(a.weight), quantize_fp8(b.weight)
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
