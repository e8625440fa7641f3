"""Weight-only fp8 quantization (tandem/layers/quant.py): per-row power-of-two scales, exact
fake quantization, and the loader applying it."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig, read_arch_config
from tandem.layers.attention import build_attn_metadata
from tandem.layers.quant import FP8_MAX, fake_quantize_fp8_, quantize_fp8
from tandem.models.decoder import KVCache
from tandem.models.loader import load_model
from tests.helpers import hf_model, make_hf_model


def test_rows_scaled_by_least_power_of_two():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-4, 1, 64)[:, None]
    w[5] = 0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    amax = w.abs().amax(1)
    live = amax > 0
    assert (amax[live] / s[live] <= FP8_MAX).all() and (amax[live] / s[live] > FP8_MAX / 2).all()
    assert (q[5].float() == 0).all()
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= 16 * s[:, None]).all()  # half a step of e4m3's coarsest spacing (32 in [256, 448])


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


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_fp8_model_matches_transformers_on_quantized_weights(tmp_path, arch, tie):
    """quantization="fp8" is the model whose every linear weight (a tied head: the embedding too)
    is rounded to fp8 with its row's scale: logits equal transformers' on those weights, and differ
    from the unquantized model's."""
    path = make_hf_model(tmp_path / "m", arch, tie=tie)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_model = hf_model(path)
    with torch.no_grad():
        plain = ref_model(torch.tensor([ids])).logits[0]
        for module in ref_model.modules():
            if isinstance(module, torch.nn.Linear):
                fake_quantize_fp8_(module.weight.data)
        ref = ref_model(torch.tensor([ids])).logits[0]
    arch_cfg = read_arch_config(path)
    model = load_model(ModelConfig(str(path), arch_cfg, torch.float32, 512, quantization="fp8"), torch.device("cpu"))
    kv = KVCache(arch_cfg, 8, 8, torch.float32, "cpu")
    with torch.inference_mode():
        attn = build_attn_metadata([0], [len(ids)], [list(range(8))], 8, torch.device("cpu"))
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, kv))
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-4 * scale
    assert (plain - ref).abs().max().item() > 1e-3 * scale  # the quantization is not a no-op


def test_fp8_target_through_llm(tmp_path):
    """LLM(quantization="fp8"): the target's weights are fp8-representable, its greedy output is
    its own (not the bf16 model's, in general), and speculation keeps it token for token."""
    path = make_hf_model(tmp_path / "m", "qwen2", num_layers=2, init_std=0.3)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=128, block_size=8)
    fp8 = LLM(str(path), quantization="fp8", **common)
    w = fp8.engine.runner.model.model.layers[0].mlp.down_proj.weight
    q, s = quantize_fp8(w)
    assert torch.equal(q.float() * s[:, None], w.float())
    expect = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(path), quantization="fp8", speculative_config=dict(model=str(path), num_speculative_tokens=3),
               **common)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expect
    # the unquantized weights as the draft: this random model's flat logits make fp8 a real change
    assert 0.2 < spec.engine.spec_metrics.acceptance_rate < 1
    plain = LLM(str(path), **common)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] != expect
