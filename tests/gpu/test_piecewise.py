"""GPU: the piecewise CUDA graphs of steps the uniform graphs do not take (a prefill chunk beside
decodes, unequal verifications, the draft's catch-up over them; tandem/runner/piecewise.py)
give the eager forward's bits for the same padded batch, and the engine's output with them is
the output without them."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.layers.table_attention import TableAttnMetadata
from tandem.runner.piecewise import PiecewiseGraphs, piece_sizes
from tests.helpers import make_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pieces")
    target = make_hf_model(root / "t", "qwen2", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                           init_std=0.3, max_position_embeddings=1024)
    llama = make_hf_model(root / "l", "llama", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                          init_std=0.3, max_position_embeddings=1024)
    draft = make_hf_model(root / "d", "qwen2", num_layers=1, hidden_size=64, seed=3, max_position_embeddings=1024)
    return target, llama, draft


def _llm(path, dtype="float32", **kw):
    kw.setdefault("max_num_seqs", 8)
    return LLM(str(path), dtype=dtype, max_model_len=512, block_size=16, kv_cache_memory_bytes=64 << 20, **kw)


@pytest.mark.parametrize("which", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pieces_equal_the_eager_forward(models, which, dtype):
    """A batch of a prompt chunk, a chunk against a cached prefix, a decode and a verification-like
    run, over a poisoned cache: the pieces' hidden rows == the eager forward's over the same
    padded rows, bit for bit."""
    path = models[0] if which == "qwen2" else models[1]
    llm = _llm(path, dtype)
    runner = llm.engine.runner
    pw = runner.piecewise
    assert isinstance(pw, PiecewiseGraphs) and pw.sizes == piece_sizes(512)
    model, kv, device = runner.model, runner.kv, runner.device
    g = torch.Generator(device=device).manual_seed(0)
    for t in kv.k + kv.v:  # earlier tokens' K/V: random
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(t.dtype))
    starts, lens = [0, 20, 50, 100], [37, 3, 1, 5]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    meta = runner.attn_backend.prefill(starts, lens, tables)
    n = sum(lens)
    t = pw.bucket(n)
    assert t == 48
    ids = torch.randint(0, model.arch.vocab_size, (n,), generator=g, device=device)
    positions = torch.cat([torch.arange(s, s + q, device=device) for s, q in zip(starts, lens)])
    pad = t - n
    padded = TableAttnMetadata(slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)]),
                               block_tables=meta.block_tables, seq_lens=meta.seq_lens, cu_q_lens=meta.cu_q_lens,
                               max_q_len=meta.max_q_len, block_size=meta.block_size, use_triton=True)
    with torch.inference_mode():
        eager = model(torch.cat([ids, ids.new_zeros(pad)]), torch.cat([positions, positions.new_zeros(pad)]), padded,
                      kv)[:n].clone()
        pw.out.fill_(float("nan"))  # what the attention does not write must not matter
        pieces = pw.run(ids, positions, meta).clone()
        unpadded = model(ids, positions, meta, kv)
    assert torch.equal(pieces, eager)
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(pieces, unpadded, atol=tol, rtol=tol)


def _staggered(llm, n=10):
    """More requests than slots, of unequal lengths: prefills join running decodes (mixed steps)."""
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (int(m),), generator=g).tolist()}
               for m in torch.randint(3, 90, (n,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(8, 40, (n,), generator=g)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_output_with_pieces_equals_without(models, dtype, monkeypatch):
    """Target-only and speculative (k = 3, greedy and probabilistic drafts), mixed steps on the
    pieces: the same tokens as with max_cudagraph_tokens=0 (those steps eager), and speculative
    greedy == target-only."""
    target, _, draft = models
    ran = []
    run = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, *a: ran.append(1) or run(self, *a))
    base = _staggered(_llm(target, dtype, max_num_seqs=3))
    assert ran, "no step took the pieces"
    assert _staggered(_llm(target, dtype, max_num_seqs=3, max_cudagraph_tokens=0)) == base
    for method in ("greedy", "probabilistic"):
        spec = dict(model=str(draft), num_speculative_tokens=3, draft_sample_method=method)
        ran.clear()
        with_pieces = _staggered(_llm(target, dtype, max_num_seqs=3, speculative_config=spec))
        assert ran
        without = _staggered(_llm(target, dtype, max_num_seqs=3, speculative_config=spec, max_cudagraph_tokens=0))
        assert with_pieces == without == base


def test_max_cudagraph_tokens_is_checked(models):
    with pytest.raises(ConfigError, match="max_cudagraph_tokens"):
        _llm(models[0], max_cudagraph_tokens=-1)
    llm = _llm(models[0], max_cudagraph_tokens=100, max_num_batched_tokens=64)
    assert llm.engine.runner.piecewise.sizes == [16, 32, 48, 64]
    assert _llm(models[0], max_cudagraph_tokens=0).engine.runner.piecewise is None


@pytest.mark.parametrize("spec_on", [False, True])
def test_a_request_joining_waits_for_the_device_once(models, spec_on):
    """A request joining running ones (its parameters installed in the slot, its prefill beside
    the decodes on the pieces) waits for nothing but the step's result copy: a hidden
    synchronisation raises."""
    target, _, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3) if spec_on else None
    engine = _llm(target, "bfloat16", speculative_config=spec).engine
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(2):
        engine.add_request(str(i), list(range(5 + 20 * i, 40 + 20 * i)), greedy)
    for _ in range(4):
        engine.step()
    ran = []
    run = engine.runner.piecewise.run
    engine.runner.piecewise.run = lambda *a: ran.append(1) or run(*a)
    every = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                           presence_penalty=0.2, frequency_penalty=0.1, logit_bias={5: 1.0}, min_tokens=3, seed=1,
                           max_tokens=20)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.add_request("new", list(range(7, 70)), every)
        for _ in range(6):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ran and engine.has_unfinished_requests()
