"""The engine freezes its start-up heap out of full garbage collections, and hands it back when released."""
import gc
import weakref

from tandem import LLM, SamplingParams
from tests.helpers import make_hf_model


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector reclaims it


def test_start_up_collects_then_freezes_and_release_thaws(tmp_path):
    model = make_hf_model(tmp_path / "m")
    before = _Node()
    garbage = weakref.ref(before)
    del before  # cyclic garbage made before start-up: collected, not frozen for good
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    assert garbage() is None
    assert gc.get_freeze_count() > 1000  # the models, the libraries: out of full collections
    frozen = gc.get_freeze_count()

    later = _Node()  # what serving makes is collected as usual
    made_later = weakref.ref(later)
    del later
    out = llm.generate(["ab"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    gc.collect()
    assert made_later() is None
    assert 0 < gc.get_freeze_count() <= frozen  # steps freeze nothing more (some frozen objects were freed)

    engine = weakref.ref(llm.engine)
    del llm, out
    assert engine() is None  # released without the collector
    assert gc.get_freeze_count() == 0  # so the heap is handed back: its cycles can be reclaimed again
