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
