"""GPU: suffix lookup's CUDA graphs (LookupGraphs) against the eager lookup (suffix_drafts, the
reference) on fresh random contexts and corpora, in every batch bucket, outputs poisoned first."""
import pytest
import torch

from tandem import LLM
from tandem.spec.suffix import SEPARATOR, suffix_drafts
from tests.helpers import make_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def speculator(tmp_path_factory):
    target = make_hf_model(tmp_path_factory.mktemp("gpu-suffix") / "t", "qwen2", num_layers=1, hidden_size=64,
                           max_position_embeddings=1024)
    llm = LLM(str(target), dtype="bfloat16", max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=16 << 20,
              speculative_config=dict(method="suffix", num_speculative_tokens=6, suffix_decoding_corpus_tokens=4096))
    spec = llm.engine.runner.speculator
    assert spec.graphs is not None and spec.graphs.sizes == [1, 2, 4, 8, 16]
    return spec


@pytest.mark.parametrize("vocab", [3, 12, 300])
def test_graphs_equal_the_eager_lookup(speculator, vocab):
    spec, g = speculator, torch.Generator(device="cuda").manual_seed(vocab)
    rows, width = spec.context.shape
    spec.context.copy_(torch.randint(0, vocab, (rows, width), generator=g, device="cuda", dtype=torch.int32))
    spec.num_tokens.copy_(torch.randint(1, width, (rows,), generator=g, device="cuda"))
    corpus = torch.randint(0, vocab, spec.corpus.shape, generator=g, device="cuda", dtype=torch.int32)
    corpus[torch.randint(0, corpus.numel(), (200,), generator=g, device="cuda")] = SEPARATOR
    spec.corpus.copy_(corpus)
    for n in (1, 3, 8, 11, 16):
        slots = torch.randperm(rows, generator=g, device="cuda")[:n]
        spec.graphs.drafts.fill_(-7)
        spec.graphs.counts.fill_(-7)
        drafts, counts = spec.graphs(slots)
        want_drafts, want_counts = suffix_drafts(spec.context[slots], spec.num_tokens[slots], spec.corpus, spec.depth,
                                                 spec.k, spec.max_spec_factor, spec.min_token_prob, spec.max_model_len)
        assert torch.equal(counts, want_counts), n
        assert all(torch.equal(drafts[i, :c], want_drafts[i, :c]) for i, c in enumerate(counts.tolist())), n
        assert (counts > 0).any()  # small vocabularies: matches everywhere
