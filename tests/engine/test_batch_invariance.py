"""A request's output does not depend on what else runs: batch, preemption, prefix cache."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import read_arch_config
from tandem.models.decoder import KVCache
from tests.helpers import make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("inv") / "m", "llama", num_layers=2, init_std=0.3)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in lengths]


PROMPTS = _prompts([5, 40, 17, 70, 9, 26])
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=100 + i)
    for i in range(len(PROMPTS))
]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _llm(model, **kw):
    kw.setdefault("max_model_len", 160)
    return LLM(str(model), dtype="float32", block_size=8, **kw)


@pytest.fixture(scope="module")
def alone(model):
    llm = _llm(model)
    greedy = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    sampled = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(PROMPTS, SAMPLED)]
    return greedy, sampled


def test_batched_equals_alone(model, alone):
    llm = _llm(model)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone[0]
    assert _tokens(llm.generate(PROMPTS, SAMPLED, use_tqdm=False)) == alone[1]
    # Reversed order and mixed greedy/sampled in one batch.
    mixed = [GREEDY if i % 2 else SAMPLED[i] for i in range(len(PROMPTS))]
    outs = _tokens(llm.generate(PROMPTS[::-1], mixed[::-1], use_tqdm=False))[::-1]
    expect = [alone[0][i] if i % 2 else alone[1][i] for i in range(len(PROMPTS))]
    assert outs == expect


def test_preemption_does_not_change_outputs(model, alone):
    arch = read_arch_config(model)
    per_block = KVCache.bytes_per_block(arch, 8, torch.float32)
    llm = _llm(model, kv_cache_memory_bytes=per_block * 22)
    assert _tokens(llm.generate(PROMPTS, SAMPLED, use_tqdm=False)) == alone[1]
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone[0]
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.cfg.cache.num_blocks


def test_prefix_cache_hits_do_not_change_outputs(model, alone):
    llm = _llm(model)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # fills the prefix cache
    outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert _tokens(outs) == alone[1]
    assert outs[3].metrics.num_cached_tokens >= 64


def test_prompts_sharing_a_prefix_in_one_batch_compute_it_once(model):
    """A batch whose prompts share a prefix nobody computed yet (a few-shot preamble; n > 1's
    copies): the first computes it, the others hit it a step later (the scheduler's in-batch
    prefix sharing); each output is what it is alone without a prefix cache."""
    shared = _prompts([64], seed=3)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in _prompts([3, 11, 6], seed=4)]
    params = [GREEDY, SAMPLED[1], SAMPLED[2].clone(n=3)]
    plain = _llm(model, enable_prefix_caching=False)
    expect = [[c.token_ids for c in plain.generate([p], s, use_tqdm=False)[0].outputs] for p, s in zip(prompts, params)]
    outs = _llm(model).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == expect
    assert len(set(map(tuple, expect[2]))) == 3  # n = 3 drew three outputs
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 64, 64]


def test_chunked_prefill_does_not_change_outputs(model, alone):
    llm = _llm(model, max_num_batched_tokens=16)
    assert _tokens(llm.generate(PROMPTS, SAMPLED, use_tqdm=False)) == alone[1]


def test_unseeded_requests_are_reproducible_per_engine_seed(model):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = _tokens(_llm(model, seed=5).generate(PROMPTS[:3], params, use_tqdm=False))
    b = _tokens(_llm(model, seed=5).generate(PROMPTS[:3], params, use_tqdm=False))
    assert a == b
    assert len({tuple(t) for t in a}) == 3


def test_batch_invariant_on_cpu_gives_each_row_its_own_bits(model):
    """LLM(batch_invariant=True) on a CPU runs tandem's C kernels (which compute each row alone): the
    greedy tokens and their logprobs' bits of each prompt alone equal those batched, in small prefill
    chunks and under speculation with the model as its own draft."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(batched=True, **kw):
        llm = LLM(str(model), dtype="bfloat16", block_size=8, max_model_len=160, batch_invariant=True, **kw)
        outs = (llm.generate(PROMPTS, params, use_tqdm=False) if batched else
                [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS])
        return [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for c in (o.outputs[0] for o in outs)]

    alone = run(batched=False, max_num_seqs=1)
    assert run() == alone
    assert run(max_num_batched_tokens=16) == alone
    assert run(speculative_config=dict(model=str(model), num_speculative_tokens=3)) == alone


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="bfloat16", batch_invariant="false"), "batch_invariant='false' must be True or False"),
    (dict(dtype="float32"), "needs dtype bfloat16 or float16"),
    (dict(dtype="bfloat16", cpu_matmul="torch"), "needs tandem's C kernels; cpu_matmul='torch' runs 'torch': pass cpu_matmul='auto'"),
    (dict(dtype="bfloat16", tensor_parallel_size=2), "not supported with tensor_parallel_size=2"),
])
def test_batch_invariant_refuses_what_cannot_keep_it(model, kw, match):
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        LLM(str(model), device="cpu", max_model_len=160, **{"batch_invariant": True, **kw})


def test_batch_invariant_where_the_c_kernels_cannot_run_says_why(model, monkeypatch):
    from tandem.errors import ConfigError
    from tandem.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "best_isa", lambda: None)
    monkeypatch.setattr(cpu_build, "load_error", lambda isa: "no C compiler (cc) found")
    with pytest.raises(ConfigError, match=r"cannot run here \(no C compiler \(cc\) found\); leave batch_invariant off"):
        LLM(str(model), dtype="bfloat16", device="cpu", max_model_len=160, batch_invariant=True)


def test_batch_invariant_logprobs_entries_do_not_hang_on_the_widest_request(tmp_path):
    """A logprobs=1 request beside a logprobs=5 one (the step's top-k is the widest's): the same entries as
    alone, tied values too (small weights in bf16: equal logits; torch.topk orders ties by its k), and its
    prompt_logprobs=1 beside prompt_logprobs=5 likewise."""
    path = make_hf_model(tmp_path / "m", "qwen3", num_layers=2, init_std=0.02, max_position_embeddings=1024, seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in (2, 64)]
    kw = dict(dtype="bfloat16", device="cpu", max_model_len=256, batch_invariant=True)
    one = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    five = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5, prompt_logprobs=5)

    def entries(out):
        pick = lambda lps: [{t: (e.logprob, e.rank) for t, e in lp.items()} if lp else lp for lp in lps]  # noqa: E731
        return out.outputs[0].token_ids, pick(out.outputs[0].logprobs), pick(out.prompt_logprobs)

    alone = LLM(str(path), max_num_seqs=1, enable_prefix_caching=False, **kw).generate([prompts[1]], one,
                                                                                       use_tqdm=False)[0]
    beside = LLM(str(path), enable_prefix_caching=False, **kw).generate(prompts, [five, one], use_tqdm=False)[1]
    assert entries(beside) == entries(alone)
