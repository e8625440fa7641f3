"""Fill in the middle: /v1/completions' `suffix` (OpenAI's legacy field, which vLLM refuses) for
code models trained with FIM sentinel tokens. The prompt is the code before the gap and `suffix`
the code after it; the model writes the middle, in the prefix-suffix-middle order its sentinels
spell (Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`, DeepSeek-Coder's
`<｜fim▁begin｜>`). A tokenizer with none of them cannot fill a gap: FimError. No FastAPI, no engine."""
from __future__ import annotations

# (before the prefix, before the suffix, before the middle), as each family's tokenizer spells them
FIM_SENTINELS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


class FimError(ValueError):
    """The model cannot fill in the middle."""


def fim_sentinels(tokenizer) -> tuple[str, str, str] | None:
    """The first family of FIM sentinels that the tokenizer encodes as one token each. (General
    Qwen2.5 / Qwen3 tokenizers share Qwen2.5-Coder's: the vocabulary cannot tell a model trained to
    fill gaps from one that was not.)"""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return next((s for s in FIM_SENTINELS
                 if all(t in vocab and tokenizer.encode(t, add_special_tokens=False) == [vocab[t]] for t in s)), None)


def fim_prompt(prefix: str, suffix: str, sentinels: tuple[str, str, str] | None) -> str:
    """The text whose continuation is the middle between prefix and suffix."""
    if sentinels is None:
        known = ", ".join(s[0] for s in FIM_SENTINELS)
        raise FimError(f"this model's tokenizer has none of the fill-in-the-middle tokens tandem knows ({known}: "
                       "Qwen2.5-Coder's, StarCoder's, DeepSeek-Coder's), so it cannot write between a prompt and a "
                       "'suffix'; leave 'suffix' out")
    before_prefix, before_suffix, before_middle = sentinels
    return f"{before_prefix}{prefix}{before_suffix}{suffix}{before_middle}"
