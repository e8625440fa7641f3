"""Incremental detokenization and stop-string detection, one token at a time."""
from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens kept as decoding context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 6


@dataclass
class DetokState:
    """Text of one output sequence, grown token by token."""

    ids: list[int]  # context tokens then output tokens
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool = True
    text: str = ""
    stops: list[str] = field(default_factory=list)
    include_stop: bool = False


class Detokenizer:
    """Turns sampled token ids into text deltas and finds stop strings in them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._skipped: dict[int, bool] = {}  # token id -> whether skip_special_tokens leaves no text of it
        # Ids past the tokenizer's (a model's vocabulary is often padded: Qwen2.5's 151936 rows, 151665 tokens)
        # decode to nothing, and kept in the window they too would widen every later decode.
        self._num_known = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None

    def _is_skipped(self, token: int) -> bool:
        """A special token skip_special_tokens drops: it adds no text and, kept in the ids, would widen
        every later decode (a run of EOS under ignore_eos made each push O(run))."""
        skipped = self._skipped.get(token)
        if skipped is None:
            skipped = self._skipped[token] = (self.tokenizer.decode([token], skip_special_tokens=True) == ""
                                              and self.tokenizer.decode([token], skip_special_tokens=False) != "")
        return skipped

    def new_state(self, prompt_ids: list[int], stops: list[str], include_stop: bool, skip_special: bool,
                  spaces_between_special: bool = True) -> DetokState:
        ctx = list(prompt_ids[-_CONTEXT_TOKENS:])
        return DetokState(ctx, 0, len(ctx), skip_special, spaces_between_special, stops=stops, include_stop=include_stop)

    def _decode(self, st: DetokState, ids: list[int]) -> str:
        if st.spaces_between_special_tokens:  # the tokenizers' default
            return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special_tokens,
                                     spaces_between_special_tokens=False)

    def push(self, st: DetokState, token: int, check_stop: bool) -> str | None:
        """Append one token; return the stop string if the text now contains one (text is then
        truncated before it, or after it with include_stop_str_in_output)."""
        if self.tokenizer is None or (self._num_known is not None and token >= self._num_known) \
                or (st.skip_special_tokens and self._is_skipped(token)):
            return None  # no text: the decode would drop it anyway
        st.ids.append(token)
        prefix = self._decode(st, st.ids[st.prefix_offset : st.read_offset])
        full = self._decode(st, st.ids[st.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for more tokens
        before = len(st.text)
        st.text += full[len(prefix) :]
        st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
        if not (check_stop and st.stops):
            return None
        found = []
        for stop in st.stops:
            at = st.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                found.append((at, stop))
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])
        st.text = st.text[: at + len(stop)] if st.include_stop else st.text[:at]
        return stop
