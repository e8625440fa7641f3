"""The block-table attention path (used on CUDA) equals the grouped CPU reference."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.layers.backend import AttnBackend
from tandem.layers.block_table import BlockTable
from tests.helpers import make_hf_model


def _table_backend_outputs(path, draft, prompts, params, persistent: bool | None, **kw):
    """Token ids of a speculative generate; persistent None: the grouped CPU reference, else the
    block-table path with (True) or without (False) the persistent per-slot table."""
    max_num_seqs = kw.pop("max_num_seqs", 8)
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=24,
              max_num_seqs=max_num_seqs, speculative_config=dict(model=str(draft), num_speculative_tokens=3), **kw)
    if persistent is not None:
        sizes = dict(max_num_seqs=max_num_seqs, max_model_len=128) if persistent else {}
        backend = AttnBackend(8, torch.device("cpu"), use_table=True, use_triton=False, **sizes)
        assert (backend.block_table is not None) == persistent
        llm.engine.runner.attn_backend = backend
        llm.engine.runner.speculator.attn_backend = backend
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions


def test_table_metadata_path_matches_reference(tmp_path):
    path = make_hf_model(tmp_path / "m", "qwen2", init_std=0.3)
    draft = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=4)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in (5, 17, 40, 3)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=1)] * 2
    ref, _ = _table_backend_outputs(path, draft, prompts, params, None)
    for persistent in (False, True):
        assert _table_backend_outputs(path, draft, prompts, params, persistent)[0] == ref


def test_persistent_block_table_through_preemption_and_shared_prefixes(tmp_path):
    """Slots that change hands (preempted requests re-admitted, often to another slot, new
    requests in freed slots) and block lists that start with shared prefix-cache blocks: the
    persistent table's rows follow each slot's request."""
    path = make_hf_model(tmp_path / "m", "qwen2", init_std=0.3)
    draft = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=4)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(2, 300, (24,), generator=g).tolist()  # three full blocks every prompt starts with
    prompts = [{"prompt_token_ids": shared + torch.randint(2, 300, (n,), generator=g).tolist()}
               for n in (3, 11, 20, 6, 9, 1, 15, 4)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(prompts)
    kw = dict(max_num_seqs=4, num_gpu_blocks_override=24)
    ref, _ = _table_backend_outputs(path, draft, prompts, params, None, **kw)
    got, preemptions = _table_backend_outputs(path, draft, prompts, params, True, **kw)
    assert preemptions > 0
    assert got == ref


def test_block_table_sends_only_new_ids():
    table = BlockTable(max_num_seqs=3, max_blocks=4, device=torch.device("cpu"))

    def sync(slots, lists):
        index, values = table.new_entries(slots, lists)
        table.write(torch.tensor(index, dtype=torch.int64), torch.tensor(values, dtype=torch.int64))
        return index, values

    assert sync([0, 2], [[5, 6], [7]]) == ([0, 1, 8], [5, 6, 7])
    assert sync([0, 2], [[5, 6], [7]]) == ([], [])  # nothing new
    assert sync([2, 0], [[7, 9], [5, 6, 1]]) == ([9, 2], [9, 1])  # appended ids only
    assert table.rows(torch.tensor([2, 0]), 3).tolist() == [[7, 9, 0], [5, 6, 1]]
    table.clear(0)  # a new request in slot 0: written whole, though it starts with the same blocks
    assert sync([0], [[5, 6]]) == ([0, 1], [5, 6])
    assert sync([0], [[5, 8]]) == ([0, 1], [5, 8])  # not grown from the synced list: written again
    assert table.rows(torch.tensor([0]), 9).shape == (1, 4)  # no wider than the table
    with pytest.raises(RuntimeError, match="slot 1 holds 5 blocks; its block table has room for 4"):
        table.new_entries([1], [[1, 2, 3, 4, 5]])


def test_step_cost_profile_fits_a_short_max_model_len(tmp_path):
    """Adaptive speculation's start-up profile gives its dummy requests blocks for context + 2k + 2
    positions; under a max_model_len shorter than that they get no more than a real request
    (the persistent table's rows hold ceil(max_model_len / block_size) ids)."""
    from tandem.spec.step_costs import profile_step_costs

    path = make_hf_model(tmp_path / "m", "qwen2", init_std=0.3)
    draft = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=4)
    llm = LLM(str(path), dtype="float32", max_model_len=16, block_size=8, max_num_seqs=2,
              speculative_config=dict(model=str(draft), num_speculative_tokens=7))
    backend = AttnBackend(8, torch.device("cpu"), use_table=True, use_triton=False, max_num_seqs=2, max_model_len=16)
    llm.engine.runner.attn_backend = llm.engine.runner.speculator.attn_backend = backend
    costs = profile_step_costs(llm.engine.runner, llm.engine.cfg)
    assert costs.table()


def test_fast_backend_shares_the_table_and_drops_invariance(tmp_path):
    """AttnBackend.fast(): the draft's view under batch_invariant, the default attention over the same uploader
    and persistent block table; the engine's greedy draft speculator takes it, its runner keeps the invariant one."""
    backend = AttnBackend(8, torch.device("cpu"), use_table=True, use_triton=False, max_num_seqs=2, max_model_len=16,
                          invariant=True)
    fast = backend.fast()
    assert not fast.invariant and backend.invariant
    assert fast.upload is backend.upload and fast.block_table is backend.block_table
    assert fast.prefill([0], [3], [[1]], slots=[0]).invariant is False
    assert backend.prefill([0], [3], [[1]], slots=[0]).invariant is True
    assert AttnBackend(8, torch.device("cpu")).fast().invariant is False
    target = make_hf_model(tmp_path / "t", "llama")
    llm = LLM(str(target), dtype="bfloat16", device="cpu", max_model_len=64, block_size=8, batch_invariant=True,
              speculative_config=dict(model=str(target), num_speculative_tokens=2))
    runner = llm.engine.runner
    assert runner.attn_backend.invariant and not runner.speculator.attn_backend.invariant
    assert runner.speculator.attn_backend.upload is runner.attn_backend.upload


def test_probabilistic_drafts_under_batch_invariance(tmp_path):
    """Probabilistic drafts' probabilities, and where each round ends, choose the kept seeded token: under
    batch_invariant their draft computes invariantly, at one k, with every request's drafts verified whole;
    what would break that is refused by name."""
    target = make_hf_model(tmp_path / "t", "llama")
    llm = LLM(str(target), dtype="bfloat16", device="cpu", max_model_len=64, block_size=8, batch_invariant=True,
              speculative_config=dict(model=str(target), num_speculative_tokens=2, draft_sample_method="probabilistic"))
    assert llm.engine.runner.speculator.attn_backend.invariant
    del llm
    for per in ("auto", ((2, 8, 1),)):  # (a k by the batch: where a round ends picks another seeded token)
        with pytest.raises(ConfigError, match=r"probabilistic' needs one k for every step: num_speculative_tokens_per"):
            LLM(str(target), dtype="bfloat16", device="cpu", max_model_len=64, block_size=8, batch_invariant=True,
                speculative_config=dict(model=str(target), num_speculative_tokens=2, draft_sample_method="probabilistic",
                                        num_speculative_tokens_per_batch_size=per))
    with pytest.raises(ConfigError, match=r"probabilistic' needs max_num_batched_tokens >= max_num_seqs \* \(1 \+ k\) = 12"):
        LLM(str(target), dtype="bfloat16", device="cpu", max_model_len=64, block_size=8, batch_invariant=True,
            max_num_seqs=4, max_num_batched_tokens=8,  # (drafts verified in part: rounds end elsewhere)
            speculative_config=dict(model=str(target), num_speculative_tokens=2, draft_sample_method="probabilistic"))
    with pytest.raises(ConfigError, match=r"draft_sample_method='probabilistic'.*speculative_config.dtype='float32'"):
        LLM(str(target), dtype="bfloat16", device="cpu", max_model_len=64, block_size=8, batch_invariant=True,
            speculative_config=dict(model=str(target), num_speculative_tokens=2, draft_sample_method="probabilistic",
                                    dtype="float32"))
