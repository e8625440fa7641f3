"""Incremental detokenization and stop-string detection, one token at a time.

A fast tokenizer's text comes from the tokenizers library's own incremental decoder
(`DecodeStream`, Rust: about 1 us a token against 7 us for two `decode` calls of Qwen2.5's
tokenizer, on every running request's every token); others, and options it lacks, decode the
window of new tokens against the ones before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.text_buffer import TextBuffer

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:
    DecodeStream = None

# Prompt tokens kept as decoding context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 6


class StopStrings:
    """A request's stop strings, shared by its sequences. A stop string newly in the text ends in the
    newest piece, so where there are many only those ending with one of its characters are looked
    for (100k stop strings were 100k searches a token, a second a step for the batch)."""

    INDEX_FROM = 16  # fewer are all looked for

    def __init__(self, stops: list[str]):
        self.stops = tuple(stops)
        self.max_len = max(map(len, stops), default=0)
        self._by_last: dict[str, list[int]] | None = None  # last character -> the stops' indices, in order
        if len(stops) >= self.INDEX_FROM:
            self._by_last = {}
            for i, stop in enumerate(stops):
                self._by_last.setdefault(stop[-1], []).append(i)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def ending_in(self, piece: str) -> tuple[str, ...] | list[str]:
        """The stops that may end in piece, in the request's order (the first of two found at one
        place is the one reported)."""
        if self._by_last is None:
            return self.stops
        hits = [i for c in set(piece) for i in self._by_last.get(c, ())]
        return [self.stops[i] for i in sorted(hits)]


@dataclass
class DetokState:
    """Text of one output sequence, grown token by token.

    The text lives in a TextBuffer, as appending to a str attribute copies the whole text every
    token: with Qwen2.5's tokenizer on 70k tokens of code (dev CPU), a push averaged 5.2-6.3 us
    that way, 2.4-2.6 us this way, the same at 8k tokens. An output reads only what is new
    (buffer.between), and stop strings are looked for in the piece and the few characters before
    it (recent)."""

    ids: list[int]  # context tokens then output tokens
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool = True
    stops: StopStrings = field(default_factory=lambda: StopStrings([]))
    include_stop: bool = False
    stream: object | None = None  # a DecodeStream primed with the context; None: decode by windows
    recent: str = ""  # with stops: the text's last stops.max_len - 1 characters (where a stop may begin)
    buffer: TextBuffer = field(default_factory=TextBuffer)

    @property
    def text(self) -> str:
        """The whole text (a copy: buffer.between for a part)."""
        return self.buffer.text


def num_token_ids(tokenizer) -> int:
    """One past the tokenizer's highest token id: its length, unless its vocabulary skips ids (len()
    counts entries, so a token past such a gap would count as no token: vLLM's max_token_id rule)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max(len(tokenizer), max(vocab.values(), default=-1) + 1)


class Detokenizer:
    """Turns sampled token ids into text deltas and finds stop strings in them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._skipped: dict[int, bool] = {}  # token id -> whether skip_special_tokens leaves no text of it
        # Ids past the tokenizer's (a model's vocabulary is often padded: Qwen2.5's 151936 rows, 151665 tokens)
        # decode to nothing, and kept in the window they too would widen every later decode.
        self._num_known = num_token_ids(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
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

    def new_state(self, prompt_ids: list[int], stops: list[str] | StopStrings, include_stop: bool, skip_special: bool,
                  spaces_between_special: bool = True) -> DetokState:
        """stops: the stop strings (a StopStrings, to share one among a request's sequences)."""
        ctx = list(prompt_ids[-_CONTEXT_TOKENS:])
        st = DetokState(ctx, 0, len(ctx), skip_special, spaces_between_special,
                        stops=stops if isinstance(stops, StopStrings) else StopStrings(stops), include_stop=include_stop)
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
        before = st.buffer.length
        piece = self._stream_step(st, token) if st.stream is not None else None
        st.ids.append(token)
        if st.stream is None:  # by windows: the new tokens' text against the ones before them
            prefix = self._decode(st, st.ids[st.prefix_offset : st.read_offset])
            full = self._decode(st, st.ids[st.prefix_offset :])
            piece = full[len(prefix) :] if len(full) > len(prefix) and not full.endswith("\ufffd") else None
        if not piece:
            return None  # an incomplete character: wait for more tokens
        st.buffer.append(piece)
        st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
        if not st.stops:
            return None
        tail = st.recent + piece  # a stop may start up to stops.max_len - 1 characters before the piece
        first = before - len(st.recent)
        found = [(first + at, stop) for stop in st.stops.ending_in(piece)
                 if (at := tail.find(stop, max(0, before - len(stop) + 1 - first))) != -1] if check_stop else None
        if not found:
            max_len = st.stops.max_len
            st.recent = tail[max(0, len(tail) - max_len + 1):] if max_len > 1 else ""
            return None
        at, stop = min(found, key=lambda f: f[0])
        st.buffer.cut(at + len(stop) if st.include_stop else at)
        return stop
