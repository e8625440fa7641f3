"""GPU: the mixed workload of tests/engine/test_mixed_workload.py (requests of every kind arriving
and aborted over time, a pool that preempts, a budget that chunks prompts) on the CUDA graphs and
Triton kernels, async scheduling on where it is the default: each request equals itself alone."""
import pytest

from tests.engine.test_mixed_workload import CONFIGS, _workload, alone_by_settings, run_and_check
from tests.helpers import make_spec_models

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("gpu-mixed"))


@pytest.fixture(scope="module")
def workload(models):
    jobs = _workload(seed=2026)
    return jobs, alone_by_settings(models["target"], jobs, device="cuda", kv_cache_memory_bytes=64 << 20)


# The confidence stop reads each draft step's confidence on the host: refused on a GPU.
@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "draft-confidence"])
def test_each_request_equals_itself_alone_on_gpu(models, workload, name, monkeypatch):
    llm = run_and_check(models, *workload, name, monkeypatch, device="cuda")
    assert llm.engine.runner.graphs
