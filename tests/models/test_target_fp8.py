"""The target in weight-only fp8 (LLM(quantization="fp8"), tandem/layers/quant.py): its layers'
linears rounded, its LM head and embedding kept; the same function as transformers on the
rounded weights; in bf16 on our CPU kernel the e4m3 bytes alone (W8Linear); speculation over it
still exact."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_build
from tandem.layers.cpu_linear import W8Linear
from tandem.layers.quant import quantize_fp8
from tests.helpers import hf_model, make_hf_model, make_spec_models

MAX_LEN = 256
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in lengths]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _rounded(w: torch.Tensor) -> bool:
    q, s = quantize_fp8(w)
    return torch.equal(q.float() * s[:, None], w.float())


@pytest.mark.parametrize("arch,kw", [("llama", dict(tie=False)), ("qwen2", dict(tie=True))])
def test_fp8_target_is_transformers_on_rounded_weights(tmp_path, arch, kw):
    """Logits of the fp8 target (fp32 on CPU) == transformers' on the same checkpoint with every
    linear of its layers rounded the same way and the LM head left alone; and not the unrounded
    model's."""
    from tandem.layers.quant import fake_quantize_fp8_

    path = make_hf_model(tmp_path / "m", arch, **kw)
    llm = LLM(str(path), dtype="float32", quantization="fp8", max_model_len=MAX_LEN, block_size=8)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert _rounded(linear.weight)
    assert not _rounded(model.lm_head.weight) and not _rounded(model.model.embed_tokens.weight)

    hf = hf_model(path)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        plain = hf(torch.tensor([ids])).logits[0]
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                fake_quantize_fp8_(module.weight.data)
        ref = hf(torch.tensor([ids])).logits[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    # prompt_logprobs hold log p(token | prefix) of each prompt token: compare them to the reference's
    lp_ref = torch.log_softmax(ref.double(), -1)[torch.arange(39), torch.tensor(ids[1:])]
    lp_plain = torch.log_softmax(plain.double(), -1)[torch.arange(39), torch.tensor(ids[1:])]
    ours = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])], dtype=torch.float64)
    assert (ours - lp_ref).abs().max().item() < 1e-4
    assert (ours - lp_plain).abs().max().item() > 1e-3  # the rounding is visible: not a no-op


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("spec"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_over_fp8_target_is_exact(models, dtype):
    """Greedy speculative output over an fp8 target == that fp8 target's own greedy output, with
    the unrounded checkpoint as the draft and with it in fp8 (its LM head rounded too)."""
    kw = dict(dtype=dtype, block_size=8, max_model_len=MAX_LEN, quantization="fp8")
    prompts = _prompts([4, 19, 64, 7, 33])
    target = LLM(str(models["target"]), **kw)
    if dtype == "bfloat16" and cpu_build.load_error("avx2") is None:  # the e4m3 bytes on our CPU kernel
        layer = target.engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj, W8Linear) and layer.mlp.down_proj.w8.dtype == torch.float8_e4m3fn
        assert not isinstance(target.engine.runner.model.lm_head, W8Linear)  # the LM head kept
    expect = _tokens(target.generate(prompts, PARAMS, use_tqdm=False))
    plain = LLM(str(models["target"]), dtype=dtype, block_size=8, max_model_len=MAX_LEN)
    assert _tokens(plain.generate(prompts, PARAMS, use_tqdm=False)) != expect  # fp8 moved the output
    for quant in (None, "fp8"):
        llm = LLM(str(models["target"]), **kw, speculative_config=dict(
            model=str(models["target"]), num_speculative_tokens=4, quantization=quant))
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == expect
        assert 0.25 < llm.engine.spec_metrics.acceptance_rate <= 1.0
