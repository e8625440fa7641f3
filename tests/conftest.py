import os
import pathlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tandem_cache(tmp_path_factory) -> pathlib.Path:
    """The model cache for real-model tests: $TANDEM_CACHE when set (downloads reused across
    runs), else one cache for this test session, exported so LLM("<name>") finds it too."""
    env = os.environ.get("TANDEM_CACHE")
    path = pathlib.Path(env) if env else tmp_path_factory.getbasetemp() / "tandem-cache"
    os.environ["TANDEM_CACHE"] = str(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention (sdpa on 2 busy cores is ~1000x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def _cpu_engines_outside_gpu_tests(request):
    """On a CUDA machine, engines built by modules outside tests/gpu still run the CPU
    reference paths they were written for (device="auto" would give each LLM 90% of the GPU,
    and a module holding two of them could not size the second pool)."""
    if not torch.cuda.is_available() or request.node.path.parent.name == "gpu":
        yield
        return
    import tandem.engine.llm as llm_module

    real = llm_module.resolve_device
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_module, "resolve_device", lambda device: real("cpu" if device == "auto" else device))
        yield


@pytest.fixture(autouse=True)
def _tandem_log_level_restored():
    """`tandem serve` (run_server) raises the "tandem" logger to INFO, as a server logs: not past its test."""
    import logging

    logger = logging.getLogger("tandem")
    level = logger.level
    yield
    logger.setLevel(level)
