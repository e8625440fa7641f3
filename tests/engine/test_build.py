"""The start-up rehearsal (tandem/engine/build.py): on a GPU the KV budget sets aside what it
measures (tests/gpu/test_gpu_engine.py); here its worst-case steps run through the real runner
and speculator on the CPU."""
import pytest

from tandem.runner.model_runner import ModelRunner

from tandem import LLM
from tandem.engine.build import rehearse, scratch_cache, worst_case_params
from tandem.spec.factory import SpeculatorFactory
from tests.helpers import make_hf_model


def _rehearse(tmp_path, method, k=3, max_model_len=64, max_num_seqs=5):
    target = make_hf_model(tmp_path / "t", "llama")
    spec = None
    if method is not None:
        draft = make_hf_model(tmp_path / "d", "llama", num_layers=1, seed=2)
        spec = dict(model=str(draft), num_speculative_tokens=k, draft_sample_method=method)
    llm = LLM(str(target), dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              speculative_config=spec)
    cfg = llm.engine.cfg
    factory = SpeculatorFactory(cfg.spec, cfg.model, llm.tokenizer, cfg.device) if spec else None
    return rehearse(cfg, llm.engine.runner.model, factory, capture_stream=None)


@pytest.mark.parametrize("method", [None, "greedy", "probabilistic"])
def test_the_worst_case_step_samples_every_request(tmp_path, method):
    """max_num_seqs requests verifying k drafts with every sampling feature on: each samples
    (penalties count what it emitted) and, with a draft, gets k new drafts."""
    runner = _rehearse(tmp_path, method)
    state = runner.state
    assert state.params == [worst_case_params()] * 5
    assert all(int(state.output_counts[s].sum()) >= 1 for s in range(5))
    if method is not None:
        assert bool((runner.speculator.drafts[:5] != 0).any())


def test_the_rehearsal_runs_each_kind_of_step(tmp_path, monkeypatch):
    """A full prefill of max_num_seqs prompts, a uniform verification, a ragged one (eager)."""
    plans = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, plan: (plans.append(plan), execute(self, plan))[1])
    _rehearse(tmp_path, "greedy", k=3, max_model_len=64, max_num_seqs=5)
    assert len(plans) == 3
    prefill, uniform, ragged = ([(len(r.input_token_ids), r.num_drafts) for r in p.reqs] for p in plans)
    assert prefill == [(60, 0)] * 5  # min(2048 // 5, 64 - 1 - 3) tokens each
    assert uniform == [(1, 3)] * 5
    assert ragged == [(1, 3)] * 4 + [(1, 2)]


@pytest.mark.parametrize("k, max_model_len", [(1, 64), (4, 6), (4, 5)])  # k >= max_model_len is refused
def test_the_rehearsal_fits_any_k_and_context(tmp_path, k, max_model_len):
    """A context shorter than the 2k + 3 tokens of a full round gets fewer drafts, as the
    scheduler would give it (before: the catch-up read a rotary position past the table)."""
    runner = _rehearse(tmp_path, "probabilistic", k=k, max_model_len=max_model_len, max_num_seqs=2)
    assert all(int(runner.state.output_counts[s].sum()) >= 1 for s in range(2))


def test_the_scratch_pool_holds_a_whole_round(tmp_path):
    target = make_hf_model(tmp_path / "t", "llama")
    draft = make_hf_model(tmp_path / "d", "llama", num_layers=1, seed=2)
    llm = LLM(str(target), dtype="float32", max_model_len=64, block_size=4,
              speculative_config=dict(model=str(draft), num_speculative_tokens=5))
    assert scratch_cache(llm.engine.cfg).num_blocks * 4 >= 2 * 5 + 3
