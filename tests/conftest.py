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
