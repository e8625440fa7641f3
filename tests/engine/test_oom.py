"""Running out of GPU memory at start-up is a ConfigError that names the setting to change, and
what the failed step allocated is released (the GPU side: tests/gpu/test_gpu_engine.py)."""
import weakref

import pytest
import torch

from tandem.errors import ConfigError
from tandem.oom import GiB, OutOfMemoryGuard, check_weights_fit


def test_out_of_memory_becomes_a_config_error_and_frees_the_failed_step():
    held = []

    def step():
        scratch = torch.empty(1 << 20)
        held.append(weakref.ref(scratch))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(ConfigError) as e:
        with OutOfMemoryGuard(torch.device("cpu"), "profiling the largest step (max_num_batched_tokens=8192)",
                              "lower max_num_batched_tokens"):
            step()
    assert str(e.value) == ("profiling the largest step (max_num_batched_tokens=8192) ran out of GPU memory; "
                            "lower max_num_batched_tokens")
    assert e.value.__suppress_context__  # torch's message is not shown as the cause
    assert held[0]() is None  # the finished frame's tensor is gone while the error is still held


def test_other_errors_pass_through_the_guard():
    with pytest.raises(ValueError, match="not memory"):
        with OutOfMemoryGuard(torch.device("cpu"), "doing", "fix"):
            raise ValueError("not memory")
    with OutOfMemoryGuard(torch.device("cpu"), "doing", "fix"):
        pass


def test_weights_that_cannot_fit_are_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError) as e:
        check_weights_fit(16 * GiB, cuda, "model='big' in bfloat16", "use a smaller model, or a smaller dtype")
    assert str(e.value) == ("model='big' in bfloat16: the weights need 16.0 GiB, the GPU has 10.0 GiB free of "
                            "80.0 GiB (other processes hold 70.0 GiB); use a smaller model, or a smaller dtype")
    check_weights_fit(8 * GiB, cuda, "model='small'", "-")  # fits
    check_weights_fit(1 << 50, torch.device("cpu"), "model='big'", "-")  # host memory is not checked


@pytest.mark.parametrize("method", [None, "greedy", "probabilistic"])
def test_the_rehearsal_runs_a_worst_case_step(tmp_path, method):
    """On a GPU the KV budget sets aside what the engine allocates after the pool, measured by a
    rehearsal (tandem/engine/build.py) over a scratch pool of a few blocks: its worst-case step
    (max_num_seqs requests verifying k drafts, every sampling feature on) runs through the real
    runner and speculator. On the CPU: every request of it samples (penalties count the emitted
    tokens) and, with a draft, gets k new drafts."""
    import dataclasses

    from tandem import LLM
    from tandem.engine.build import WORST_CASE_PARAMS, rehearse
    from tandem.spec.factory import SpeculatorFactory
    from tests.helpers import make_hf_model

    target = make_hf_model(tmp_path / "t", "llama")
    spec = None
    if method is not None:
        draft = make_hf_model(tmp_path / "d", "llama", num_layers=1, seed=2)
        spec = dict(model=str(draft), num_speculative_tokens=3, draft_sample_method=method)
    llm = LLM(str(target), dtype="float32", max_model_len=64, max_num_seqs=5, speculative_config=spec)
    cfg = llm.engine.cfg
    factory = SpeculatorFactory(cfg.spec, cfg.model, llm.tokenizer, cfg.device) if spec else None
    k = cfg.spec.num_speculative_tokens if spec else 0
    scratch = dataclasses.replace(cfg.cache, num_blocks=-(-(2 * k + 3) // cfg.cache.block_size))
    runner = rehearse(cfg, scratch, llm.engine.runner.model, factory, use_graphs=False)
    state = runner.state
    assert state.params == [WORST_CASE_PARAMS] * 5
    assert all(int(state.output_counts[s].sum()) >= 2 for s in range(5))  # the prompt's output token + one emitted
    if spec:
        assert bool((runner.speculator.drafts[:5] != 0).any())
