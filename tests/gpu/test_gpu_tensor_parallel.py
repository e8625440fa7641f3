"""GPU: tensor parallelism's sharded shapes through the CUDA kernels: both ranks on one GPU, their
collectives through gloo (TANDEM_TP_BACKEND=gloo, staged through the host), and, where two GPUs
are visible, one GPU a rank over NCCL (the default)."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tests.helpers import assert_greedy_equal_up_to_near_tie, make_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-tp")
    target = make_hf_model(root / "t", "qwen2", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                           init_std=0.3, max_position_embeddings=1024, vocab_size=321)
    draft = make_hf_model(root / "d", "llama", num_layers=1, hidden_size=64, seed=3, max_position_embeddings=1024,
                          vocab_size=321)
    return target, draft


def _run(target, dtype, tp, spec=None, params=None, **kw):
    llm = LLM(str(target), dtype=dtype, device="cuda", max_model_len=512, block_size=16, max_num_seqs=8,
              speculative_config=spec, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in (3, 17, 64, 200, 9)]
    params = params or SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        if tp > 1:
            llm.engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", [
    "gloo", pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def test_two_ranks_on_gpu_match_one(models, dtype, backend, monkeypatch):
    """Greedy on two ranks (each half the heads, intermediate rows and vocabulary) gives the
    one-rank tokens up to near ties (a sum reduced across ranks rounds differently), alone and
    with a sharded draft (its drafts from each rank's best token); the speculative tokens are the
    two-rank target's own. gloo: both ranks on one GPU; nccl: GPUs 0 and 1."""
    if backend == "gloo":
        monkeypatch.setenv("TANDEM_TP_BACKEND", "gloo")
    else:
        monkeypatch.delenv("TANDEM_TP_BACKEND", raising=False)
    target, draft = models
    gap = 1e-3 if dtype == "float32" else 0.3  # bf16: a few ulps of a logit near 8-16 (0.0625 each)
    ref = _run(target, dtype, 1)
    alone = _run(target, dtype, 2)
    for out, r in zip(alone, ref):
        assert_greedy_equal_up_to_near_tie(out, r, gap=gap)
    spec = _run(target, dtype, 2, dict(model=str(draft), num_speculative_tokens=3))
    assert [o.token_ids for o in spec] == [o.token_ids for o in alone]


def test_two_ranks_fp8_target_on_gpu(models, monkeypatch):
    """An fp8 target (bf16 activations) on two ranks: each rank's fp8 weights are its part of the
    one-rank model's (tandem/layers/quant.py scales a row-parallel row by the whole row), so two
    ranks give one rank's tokens up to near ties, and speculation over them their own tokens."""
    monkeypatch.setenv("TANDEM_TP_BACKEND", "gloo")
    target, draft = models
    ref = _run(target, "bfloat16", 1, quantization="fp8")
    alone = _run(target, "bfloat16", 2, quantization="fp8")
    for out, r in zip(alone, ref):
        assert_greedy_equal_up_to_near_tie(out, r, gap=0.3)
    spec = _run(target, "bfloat16", 2, dict(model=str(draft), num_speculative_tokens=3), quantization="fp8")
    assert [o.token_ids for o in spec] == [o.token_ids for o in alone]


def test_nccl_group_of_one_runs_every_collective(monkeypatch):
    """The NCCL group's construction and each collective the model calls, on the one GPU lent (a
    group of one rank: the values pass through; several GPUs were not lent here)."""
    from tandem.parallel.group import TPGroup, host_store

    monkeypatch.delenv("TANDEM_TP_BACKEND", raising=False)
    store = host_store(1)
    group = TPGroup(0, 1, store.port, torch.device("cuda", 0), store)
    x = torch.randn(3, 64, device="cuda")
    assert torch.equal(group.all_reduce_(x.clone()), x)
    logits = torch.randn(4, 100, device="cuda")
    assert torch.equal(group.gather_vocab(logits, 100), logits)
    assert torch.equal(group.top_tokens(logits, 100), logits.argmax(dim=-1))
    assert group.min_int(7) == 7
    group.close()
