"""Tiny random-weight Hugging Face models and a tokenizer, built in the test process."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Paris is the capital of France. Speculative decoding drafts tokens and verifies them in one pass.\n"
)


@functools.cache
def _tokenizer_files() -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    return {"json": tok.to_str()}


def save_tokenizer(path: Path, add_bos: bool = False) -> None:
    """The test tokenizer; add_bos=True makes it put <s> before every text, as Llama's does."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tokenizer_files()["json"])
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok.save_pretrained(str(path))


def make_hf_model(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie: bool = False,
    max_position_embeddings: int = 512,
    rope_scaling: dict | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    add_bos: bool = False,
    init_std: float = 0.2,
    extra: dict | None = None,
) -> Path:
    """Save a random transformers model (fp32 safetensors) and a tokenizer into path; extra: more
    config settings (attention_bias, ...)."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=init_std,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra or {})
    config = cls[0](**kwargs)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # make biases and norms non-trivial so their loading is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        save_tokenizer(path, add_bos=add_bos)
    return path


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


def assert_greedy_equal_up_to_near_tie(out, ref, gap: float = 0.05, logprob_tol: float | None = None) -> None:
    """Two greedy CompletionOutputs of one prompt (both with logprobs >= 2) agree token for token
    until, if ever, the first place where they differ, and there the reference's two best tokens
    were within `gap` of each other (a different rounding may break such a tie either way). With
    logprob_tol, the chosen tokens' logprobs before that place agree within it."""
    for t, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)):
        if a != b:
            top = sorted(lp.logprob for lp in ref.logprobs[t].values())[-2:]
            assert top[1] - top[0] < gap, f"token {t}: {a} != {b}, but the reference's best two were {top}"
            return
        if logprob_tol is not None:
            assert abs(out.logprobs[t][a].logprob - ref.logprobs[t][b].logprob) < logprob_tol, t


def make_spec_models(root: Path) -> dict[str, Path]:
    """The speculation tests' trio: a 3-layer qwen2 target, an unrelated 1-layer draft ("other")
    and the target with noisy weights ("near": partial acceptance)."""
    from safetensors.torch import load_file, save_file

    target = make_hf_model(root / "target", "qwen2", num_layers=3, hidden_size=64, init_std=0.3)
    other = make_hf_model(root / "other", "qwen2", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7)
    near = root / "near"
    make_hf_model(near, "qwen2", num_layers=3, hidden_size=64, init_std=0.3)
    weights = load_file(str(near / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    weights = {n: w + 0.04 * torch.randn(w.shape, generator=g) * w.std() for n, w in weights.items()}
    save_file(weights, str(near / "model.safetensors"), metadata={"format": "pt"})
    return {"target": target, "other": other, "near": near}


def assert_lookup_output(counts: torch.Tensor, ref_counts: torch.Tensor, drafts: torch.Tensor,
                         ref_drafts: torch.Tensor, chosen: torch.Tensor, poison: int) -> None:
    """A lookup kernel's output against its reference: the same counts; for each chosen slot the
    same drafts up to its count and the poison past it; the other rows of drafts untouched."""
    assert torch.equal(counts, ref_counts), (counts, ref_counts)
    for i, slot in enumerate(chosen.tolist()):
        c = int(counts[i])
        assert drafts[slot, :c].tolist() == ref_drafts[i, :c].tolist(), (i, slot)
        assert (drafts[slot, c:] == poison).all()  # nothing written past the count
    unchosen = sorted(set(range(drafts.shape[0])) - set(chosen.tolist()))
    assert (drafts[unchosen] == poison).all()
