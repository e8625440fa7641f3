"""Reasoning models' thinking, told apart from their answers (vLLM's `--reasoning-parser`).

DeepSeek-R1 and Qwen3 write their thinking between `<think>` and `</think>`, then the answer. A
reasoning parser does three things with that:

- **where a reply starts** (`ReasoningFormat.opens`): in the thinking when the prompt ends by
  opening it (DeepSeek-R1's template ends with `<think>\\n`; so do Qwen3's thinking-only models),
  in the answer when the prompt already closed it (Qwen3 with `enable_thinking: false` ends with
  an empty `<think>\\n\\n</think>\\n\\n`); otherwise DeepSeek-R1 is thinking and Qwen3 thinks only if
  its reply begins with `<think>`;
- **the split** (`ReasoningSplit`, fed the reply piece by piece or whole; the same result either
  way): the thinking up to `</think>` (a `<think>` that opens the reply dropped) and the answer after
  it. A reply cut short before `</think>` is all thinking. (vLLM's qwen3 parser calls such a reply
  all answer when split whole, but streams it as thinking; here the two agree.) Streaming holds
  back only the text that may be the start of a tag;
- **structured outputs after the thinking** (`ReasoningFormat.gate`): a constrained reply thinks
  freely and the constraint holds from `</think>` on, as vLLM's structured outputs do with a
  reasoning parser; the gate is part of the grammar (llguidance's grammar references), so
  speculative drafts are proposed and verified under it like any other constraint.

A tag the tokenizer holds as a special token is named in the grammar by id (its text does not
match it); one that is an ordinary added token (Qwen3's) is text, whichever tokens write it
(grammar.ll_tokenizer_of, Grammars.special_tags).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """One reasoning parser's rules. implicit: a reply whose prompt neither opened nor closed the
    thinking starts in it (DeepSeek-R1's rule), rather than only when it begins with `<think>`."""

    name: str
    implicit: bool

    def opens(self, prompt_text: str | None) -> bool | None:
        """Whether a reply to this prompt starts in the thinking: True, False (the prompt closed it),
        or None (Qwen3: decided by whether the reply begins with `<think>`)."""
        tail = (prompt_text or "").rstrip()
        if tail.endswith(START):
            return True
        if tail.endswith(END):
            return False
        return True if self.implicit else None

    def split(self, text: str, opens: bool | None) -> tuple[str | None, str | None]:
        """(thinking, answer) of a whole reply; None for a part it does not have."""
        split = ReasoningSplit(opens)
        parts = [split.feed(text), split.finish()]
        thinking = "".join(p[0] for p in parts)
        answer = "".join(p[1] for p in parts)
        return (thinking if split.thought else None), (answer or None)

    def thinking_tokens(self, text: str, token_ids: list[int], opens: bool | None, tag_tokens: dict[str, int],
                        decode: Callable[[list[int]], str] | None = None) -> int:
        """How many of a reply's tokens (token_ids, whose text is `text`) are its thinking: those up
        to and with the `</think>` token, all of them when the reply is cut short in the thinking, 0
        when it does not think. Where `</think>` is spelt in text (not one token of its own), the
        fewest tokens whose text (decode: token ids -> text) holds it; 0 without decode."""
        thinking, _ = self.split(text, opens)
        if thinking is None:
            return 0
        if END not in text:
            return len(token_ids)
        end = tag_tokens.get(END)
        if end is not None and end in token_ids:
            return token_ids.index(end) + 1
        if decode is None:
            return 0
        lo, hi = 1, len(token_ids)  # the text of token_ids[:hi] holds the tag; find the least such hi
        while lo < hi:
            mid = (lo + hi) // 2
            if END in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def gate(self, grammar: str, opens: bool | None, tag_tokens: dict[str, int]) -> str:
        """The grammar of a constrained reply that thinks first: free text up to `</think>`, then
        `grammar` (any llguidance grammar: Lark, or a JSON list of grammars) from there on. A reply
        whose prompt closed the thinking gets `grammar` unchanged."""
        if opens is False:
            return grammar

        def tag(text: str) -> str:
            return f"<[{tag_tokens[text]}]>" if text in tag_tokens else json.dumps(text)

        # GAP: the blank a model writes around the tags (Qwen3: "\n\n" before the answer), bounded, as
        # free whitespace lets a model pad until max_tokens
        lines = ["%llguidance {}", "", "THOUGHT: /(.|\\n)*/", "GAP: /[ \\t\\r\\n]{1,4}/"]
        if END in tag_tokens:  # the thinking ends at the token, after any text
            lines.append(f"thinking: THOUGHT {tag(END)}")
        else:  # or at the tag's text, once it appears (a lazy lexeme ends the text there)
            lines.append(f"thinking[lazy]: THOUGHT {tag(END)}")
        opener = f"GAP? {tag(START)}"
        if opens is None:  # Qwen3: a reply that begins with <think> thinks first; any other is all answer
            lines[1] = f"start: {opener} thinking GAP? @answer | GAP? @answer"  # (blanks may open the answer too)
        else:  # already thinking (a <think> the reply opens with is the same thinking)
            lines[1] = f"start: ({opener})? thinking GAP? @answer"
        top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
        inner = top["grammars"]
        if len(inner) != 1:  # (every grammar this engine builds is one)
            raise ValueError("a reasoning gate wraps a single grammar")
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(lines)}, {**inner[0], "name": "answer"}]})


REASONING_PARSERS = {"deepseek_r1": ReasoningFormat("deepseek_r1", implicit=True),
                     "qwen3": ReasoningFormat("qwen3", implicit=False)}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The parser of that name (None: none); ValueError listing the names for another."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not supported; use one of {sorted(REASONING_PARSERS)} "
                         "or leave it out")
    return REASONING_PARSERS[name]


def reasoning_tag_tokens(tokenizer) -> dict[str, int]:
    """The tags the tokenizer holds as single added tokens -> their ids."""
    if tokenizer is None:
        return {}
    added = tokenizer.get_added_vocab()
    return {t: added[t] for t in (START, END) if t in added}


class ReasoningSplit:
    """A reply's text in pieces -> (thinking, answer) pieces, as ReasoningFormat.split splits the
    whole. opens: ReasoningFormat.opens of the reply's prompt."""

    def __init__(self, opens: bool | None):
        self.state = "answer" if opens is False else "start"
        self.decided = opens is not None  # None: thinking only if the reply begins with <think>
        self.thought = False  # the reply had a thinking part
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking, answer = [], []
        while self.held:
            if self.state == "answer":
                answer.append(self.held)
                self.held = ""
            elif self.state == "start":  # a <think> may open the reply, after blank text
                lead = self.held.lstrip()
                if lead.startswith(START):
                    self.held, self.state, self.thought = lead[len(START):], "thinking", True
                elif START.startswith(lead):  # blank, or a <think> not yet whole
                    break
                elif self.decided:  # thinking without the tag
                    self.state, self.thought = "thinking", True
                else:
                    self.state = "answer"
            else:  # thinking, until </think>
                end = self.held.find(END)
                if end >= 0:
                    thinking.append(self.held[:end])
                    self.held, self.state = self.held[end + len(END):], "answer"
                    continue
                keep = _partial_tag(self.held, END)
                thinking.append(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
        return "".join(thinking), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply has ended."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        if self.state == "start" and self.decided and held:
            self.thought = True
            return held, ""
        return "", held


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (and is not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
