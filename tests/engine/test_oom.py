"""Running out of GPU (or host) memory at start-up is a ConfigError that names the setting to change, and
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


def test_host_out_of_memory_becomes_a_config_error():
    """A CPU engine: the host allocator's refusal is the same ConfigError; other RuntimeErrors pass."""
    with pytest.raises(ConfigError, match=r"^allocating the KV cache \(9 blocks\) ran out of host memory; lower k$"):
        with OutOfMemoryGuard(torch.device("cpu"), "allocating the KV cache (9 blocks)", "lower k"):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 1000000000000000 bytes. Error code 12")
    with pytest.raises(RuntimeError, match="shape"):
        with OutOfMemoryGuard(torch.device("cpu"), "doing", "fix"):
            raise RuntimeError("shape mismatch")


def test_cpu_settings_beyond_the_machines_memory_are_refused(tmp_path):
    """Sizes Linux would grant and then kill the process for touching: refused up front, by name."""
    from tandem import LLM
    from tandem.oom import host_memory_bytes
    from tests.helpers import make_hf_model

    if host_memory_bytes() is None:
        pytest.skip("the OS does not report its memory")
    model = str(make_hf_model(tmp_path / "m", seed=0))
    for kwargs, name in ((dict(kv_cache_memory_bytes=1 << 60), "kv_cache_memory_bytes"),
                         (dict(num_gpu_blocks_override=1 << 50), "num_gpu_blocks_override"),
                         (dict(max_num_seqs=1 << 40), "max_num_seqs")):
        with pytest.raises(ConfigError, match=rf"{name}=\d+.* more than this machine's .* lower {name}$"):
            LLM(model, device="cpu", dtype="float32", **kwargs)


def test_cpu_settings_beyond_the_available_memory_are_refused(tmp_path, monkeypatch):
    """A KV budget within the machine's memory but beyond what it has available now (other processes,
    the weights just loaded): refused by name, not granted and then killed for when requests fill it. The
    default budget shrinks to half the available memory instead (as long as one request fits)."""
    from tandem import LLM
    from tandem import oom
    from tandem.runner import memory
    from tests.helpers import make_hf_model

    model = str(make_hf_model(tmp_path / "m", seed=0))
    monkeypatch.setattr(oom, "host_memory_bytes", lambda: 64 * GiB)
    for module in (oom, memory):
        monkeypatch.setattr(module, "host_available_bytes", lambda: 1 * GiB)
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes=\d+\) needs 2.0 GiB, more than the 1.0 GiB of 64.0 GiB "
                                          r"this machine has available now; lower kv_cache_memory_bytes$"):
        LLM(model, device="cpu", dtype="float32", kv_cache_memory_bytes=2 * GiB)
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=4096)  # 4096 full-length requests: 1 GiB
    cfg = llm.engine.cfg
    per_block, blocks_per_req = memory.bytes_per_block(cfg), -(-cfg.sched.max_model_len // cfg.cache.block_size)
    assert 4096 * blocks_per_req * per_block > GiB // 2  # what the default would have taken
    assert cfg.cache.num_blocks == GiB // 2 // per_block


def test_per_request_state_beyond_the_machines_memory_names_max_num_seqs(tmp_path):
    """Probabilistic drafts keep k x vocab draft probabilities per slot: more than the up-front check
    counts. The allocator's refusal names max_num_seqs beside the KV budget."""
    from tandem import LLM
    from tandem.oom import host_memory_bytes
    from tests.helpers import make_spec_models

    if host_memory_bytes() is None or host_memory_bytes() > 32 * GiB:  # (51 GB of them)
        pytest.skip("needs a machine whose memory 10M slots of draft probabilities exceed")
    models = make_spec_models(tmp_path)
    spec = {"model": str(models["near"]), "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}
    with pytest.raises(ConfigError, match=r"max_num_seqs=10000000 ran out of host memory; "
                                          r"lower kv_cache_memory_bytes or max_num_seqs$"):
        LLM(str(models["target"]), device="cpu", dtype="float32", max_model_len=64, block_size=8,
            kv_cache_memory_bytes=1 << 20, max_num_seqs=10_000_000, speculative_config=spec)


def test_a_gpu_share_larger_than_the_free_memory_is_refused_at_start_up(monkeypatch):
    """Less free memory than gpu_memory_utilization asks for (other processes hold it): refused before
    the weights load, naming the setting and what others hold (vLLM's start-up check)."""
    from types import SimpleNamespace

    from tandem.runner import memory

    cache = SimpleNamespace(num_blocks=None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    cfg = SimpleNamespace(device=torch.device("cuda"), cache=cache)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 140 * GiB))
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.9 asks for 126.0 GiB of the GPU's 140.0 GiB, "
                                          r"but only 70.0 GiB is free at start-up .* hold 70.0 GiB"):
        memory.check_gpu_share(cfg)
    cache.gpu_memory_utilization = 0.5
    memory.check_gpu_share(cfg)  # 70 GiB free covers it
    cache.gpu_memory_utilization, cache.kv_cache_memory_bytes = 0.9, GiB  # an explicit budget: no share to check
    memory.check_gpu_share(cfg)
