"""A pruned draft head: the draft scores a "hot" set of token ids only (FR-Spec, Zhao et al. 2025;
SGLang's speculative_token_map).

One draft step reads every row of the draft's LM head for a row of logits: hidden_size x V
weights, for a Llama-3.2-1B draft (V = 128256) 21% of the bytes a step streams, for
Qwen2.5-0.5B (V = 151936) 28%. Most of those rows score tokens the target seldom emits. With a
hot set the draft's head keeps only its rows (the embedding table stays whole, so the draft still
reads any token the target emits), the drafts are hot ids, and every other token has draft
probability zero. Verification does not change, so the output stays exactly the target's; only the
acceptance can fall (a target token outside the set is never drafted).

Which ids: `draft_token_map` (a file of ids, most frequent first: `tandem token-map` counts them
over text), cut to its first `draft_vocab_size`; without a map, ids 0 .. draft_vocab_size - 1
(byte-level BPE vocabularies number their tokens in merge order, which follows frequency in the
tokenizer's training text). The tokenizer's special and added tokens and the EOS ids are always
kept: a chat turn or a tool call ends on one.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable

import torch

from tandem.errors import ConfigError

logger = logging.getLogger("tandem")

FIELD = "speculative_config.draft_token_map"


def read_token_map(path: str | os.PathLike) -> list[int]:
    """A token map file -> its ids in order: a JSON list of integers, or a torch .pt file holding a
    1-D integer tensor or a list (SGLang's format)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{FIELD}={path!r} is not a file; give a .json or .pt file of token ids "
                          "(`tandem token-map` writes one)")
    try:
        if path.endswith(".pt"):
            data = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(data, (list, tuple)):  # a list of ids, or of 0-d tensors (torch.tensor takes both)
                data = torch.tensor(data) if data else []
            if isinstance(data, torch.Tensor):
                if data.dim() != 1 or data.dtype.is_floating_point or data.dtype == torch.bool:
                    raise ValueError(f"a tensor of shape {tuple(data.shape)} and dtype {data.dtype}, not 1-D integers")
                data = data.tolist()
        elif path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        else:
            raise ValueError("the name ends neither in .json nor in .pt")
    except Exception as e:  # noqa: BLE001 - torch.load's unpickler raises its own kinds for a bad file
        raise ConfigError(f"{FIELD}={path!r} cannot be read as a token map ({type(e).__name__}: {e}); give a .json "
                          "list of token ids, or a .pt file of a 1-D integer tensor") from None
    if not isinstance(data, list) or not data or any(not isinstance(t, int) or isinstance(t, bool) for t in data):
        raise ConfigError(f"{FIELD}={path!r} must hold a non-empty list of integer token ids")
    return data


def hot_token_ids(draft_vocab_size: int | None, token_map: str | None, vocab_size: int, tokenizer,
                  eos_token_ids: Iterable[int]) -> list[int] | None:
    """The ids the draft scores, ascending, or None for all of them.

    vocab_size: the ids the draft may score (the vocabulary it shares with the target); tokenizer
    (or None): its special and added tokens are kept, as are eos_token_ids."""
    if draft_vocab_size is None and token_map is None:
        return None
    ranked = read_token_map(token_map) if token_map is not None else range(vocab_size)
    bad = [t for t in ranked if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"{FIELD}={token_map!r} holds ids outside the draft's vocabulary [0, {vocab_size}), "
                          f"e.g. {bad[:3]}; make it with the model's own tokenizer")
    ranked = list(dict.fromkeys(ranked))  # duplicates: the first place counts
    if draft_vocab_size is not None:
        ranked = ranked[:draft_vocab_size]
    keep = set(ranked) | {t for t in special_token_ids(tokenizer) if 0 <= t < vocab_size}
    keep |= {t for t in eos_token_ids if 0 <= t < vocab_size}
    if len(keep) >= vocab_size:
        logger.info("the draft's token set covers its whole vocabulary (%d ids): its LM head is not pruned",
                    vocab_size)
        return None
    return sorted(keep)


def special_token_ids(tokenizer) -> set[int]:
    """A Hugging Face tokenizer's special and added token ids (chat markers, tool-call tags, EOS)."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    return {int(t) for t in ids}


def count_token_map(tokenizer, texts: Iterable[str], size: int | None = None) -> list[int]:
    """Token ids by how often tokenizer gives them over texts, most frequent first (ties: lower id
    first), at most size of them. What `tandem token-map` writes."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False).input_ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return ranked[:size] if size is not None else ranked
