"""Incremental detokenization and stop-string detection, one token at a time.

A fast tokenizer's text comes from the tokenizers library's own incremental decoder
(`DecodeStream`, Rust: about 1 us a token against 7 us for two `decode` calls of Qwen2.5's
tokenizer, on every running request's every token); others, and options it lacks, decode the
window of new tokens against the ones before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:
    DecodeStream = None

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
    stream: object | None = None  # a DecodeStream primed with the context; None: decode by windows


class Detokenizer:
    """Turns sampled token ids into text deltas and finds stop strings in them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._skipped: dict[int, bool] = {}  # token id -> whether skip_special_tokens leaves no text of it
        # Ids past the tokenizer's (a model's vocabulary is often padded: Qwen2.5's 151936 rows, 151665 tokens)
        # decode to nothing, and kept in the window they too would widen every later decode.
        self._num_known = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
        # The Rust tokenizer, where its decoder alone makes the text decode() makes: transformers'
        # clean_up_tokenization_spaces edits it afterwards.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = backend if DecodeStream is not None and backend is not None \
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None

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
        st = DetokState(ctx, 0, len(ctx), skip_special, spaces_between_special, stops=stops, include_stop=include_stop)
        if self._fast is not None and spaces_between_special:  # (DecodeStream has no such option)
            known = [t for t in ctx if self._num_known is None or t < self._num_known]
            if "\ufffd" not in self.tokenizer.decode(known, skip_special_tokens=skip_special):
                st.stream = DecodeStream(skip_special_tokens=skip_special)
                for token in known:  # the context: its text is the prompt's, not the output's
                    st.stream.step(self._fast, token)
        return st

    def _decode(self, st: DetokState, ids: list[int]) -> str:
        if st.spaces_between_special_tokens:  # the tokenizers' default
            return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special_tokens,
                                     spaces_between_special_tokens=False)

    def _stream_step(self, st: DetokState, token: int) -> str | None:
        """The text token adds through st's DecodeStream (None: none yet). Should the stream fail
        (its prefix no longer decoding as it did), the state goes on by windows from here: its
        offsets follow the text either way."""
        try:
            return st.stream.step(self._fast, token)
        except Exception:
            st.stream = None
            return None

    def push(self, st: DetokState, token: int, check_stop: bool) -> str | None:
        """Append one token; return the stop string if the text now contains one (text is then
        truncated before it, or after it with include_stop_str_in_output)."""
        if self.tokenizer is None or (self._num_known is not None and token >= self._num_known) \
                or (st.skip_special_tokens and self._is_skipped(token)):
            return None  # no text: the decode would drop it anyway
        before = len(st.text)
        piece = self._stream_step(st, token) if st.stream is not None else None
        st.ids.append(token)
        if st.stream is None:  # by windows: the new tokens' text against the ones before them
            prefix = self._decode(st, st.ids[st.prefix_offset : st.read_offset])
            full = self._decode(st, st.ids[st.prefix_offset :])
            piece = full[len(prefix) :] if len(full) > len(prefix) and not full.endswith("\ufffd") else None
        if not piece:
            return None  # an incomplete character: wait for more tokens
        st.text += piece
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
