"""GPU: an engine's suffix speculator looks up with the Triton kernel (tandem/kernels/suffix.py), and
its drafts equal the reference's (suffix_drafts) on fresh random slots and corpora, with and
without a corpus, the drafts buffer poisoned first."""
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
    assert spec.tables is not None  # the kernel, not the torch ops
    return spec


@pytest.mark.parametrize("vocab", [3, 12, 300])
@pytest.mark.parametrize("with_corpus", [True, False])
def test_kernel_lookup_equals_the_reference(speculator, vocab, with_corpus):
    spec, g = speculator, torch.Generator(device="cuda").manual_seed(vocab)
    rows, width = spec.context.shape
    spec.context.copy_(torch.randint(0, vocab, (rows, width), generator=g, device="cuda", dtype=torch.int32))
    spec.num_tokens.copy_(torch.randint(1, width, (rows,), generator=g, device="cuda"))
    corpus = torch.randint(0, vocab, spec.corpus.shape, generator=g, device="cuda", dtype=torch.int32)
    corpus[torch.randint(0, corpus.numel(), (200,), generator=g, device="cuda")] = SEPARATOR
    spec.corpus.copy_(corpus)
    spec.responses.clear()
    if with_corpus:
        spec.responses.append((0, corpus.numel() - 1))  # the lookup reads the corpus only once it holds a response
    proposed = 0
    for n in (1, 3, 8, 11, 16):
        slots = torch.randperm(rows, generator=g, device="cuda")[:n]
        want = torch.randint(0, spec.k + 1, (n,), generator=g, device="cuda")
        want[0] = spec.k
        spec.drafts.fill_(-7)
        counts = spec.lookup(slots, want, width)
        want_drafts, want_counts = suffix_drafts(spec.context[slots], spec.num_tokens[slots],
                                                 spec.corpus if with_corpus else None, spec.depth, spec.k,
                                                 spec.max_spec_factor, spec.min_token_prob, spec.max_model_len)
        assert torch.equal(counts, torch.minimum(want_counts, want)), n
        drafts = spec.drafts[slots]
        assert all(torch.equal(drafts[i, :c], want_drafts[i, :c]) for i, c in enumerate(counts.tolist())), n
        proposed += int(counts.sum())
    assert proposed > 0
    spec.responses.clear()
