"""Structured outputs: a grammar matcher per constrained sequence, and each step's token bitmasks.

A request's StructuredOutputsParams compiles (llguidance) into a matcher over the model's
tokenizer, one per output sequence. The matcher follows the tokens the sequence emits, on the
host; before a step that samples the sequence, it writes the bitmask of the tokens that keep the
output a prefix of the language, one row per logits row: with drafts pending, the row after each
draft comes from the matcher advanced over the drafts before it (and rolled back), so the
target verifies every draft against the constraint. The first draft the constraint rejects is
masked out of its own row, which rejects it whatever the verifier; the rows after it allow every
token (nothing from them is emitted). The runner applies the rows to the logits before any other
processor, as vLLM does, so logprobs see the constraint too.
"""
from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch

from tandem.errors import RequestError
from tandem.plan import GrammarMask, StepPlan
from tandem.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tandem")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; RequestError naming the field for one that is not
    well-formed (JSON that does not parse, a grammar that does not convert)."""
    import llguidance

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object (or true / false)")
            if params.disable_additional_properties:
                schema = _closed_objects(copy.deepcopy(schema))
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": not params.disable_any_whitespace})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise RequestError(f"StructuredOutputsParams.{kind} is invalid: {e}") from None


def _closed_objects(schema: Any) -> Any:
    """disable_additional_properties: every object schema that leaves additionalProperties unset
    gets additionalProperties false (in place; -> schema)."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _closed_objects(value)
    elif isinstance(schema, list):
        for value in schema:
            _closed_objects(value)
    return schema


class Grammars:
    """The matchers of the engine's constrained sequences, keyed by Request.req_id, and the drafts
    pending for each (which the next step's rows follow)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.num_words = (vocab_size + 31) // 32  # int32 words of a bitmask row
        self.matchers: dict[int, Any] = {}  # req_id -> llguidance.LLMatcher
        self.drafts: dict[int, list[int]] = {}  # req_id -> the drafts pending in its slot
        self._valid: dict[str, None] = {}  # grammars that compiled, oldest first
        self._ll_tokenizer = None  # built on first use (about a second for a 150k vocabulary)
        self._executor = None

    @property
    def active(self) -> bool:
        """A constrained sequence is running: each step's masks need the previous step's tokens."""
        return bool(self.matchers)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance
            import llguidance.hf

            if self.tokenizer is None:
                raise RequestError("SamplingParams.structured_outputs needs the model's tokenizer, and this model "
                                   "has none")
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids or None)
            except Exception as e:  # a slow (Python) tokenizer, or one larger than the model's vocabulary
                raise RequestError(f"SamplingParams.structured_outputs cannot run on this model's tokenizer "
                                   f"({type(self.tokenizer).__name__}): {e}") from None
            self._executor = llguidance.LLExecutor()
        return self._ll_tokenizer

    def validate(self, params: StructuredOutputsParams) -> str:
        """-> the constraint's grammar; RequestError naming the field when it does not compile (an
        unclosed regex, an unknown rule, an unsupported schema). The last grammars found valid are
        remembered, so checking a request and then adding it compiles its grammar once."""
        import llguidance

        text = grammar_text(params)
        if text in self._valid:
            return text
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self._tokenizer())
        if is_error:
            raise RequestError(f"StructuredOutputsParams.{params.kind} does not compile: {messages[0].strip()}")
        self._valid[text] = None
        if len(self._valid) > 64:
            del self._valid[next(iter(self._valid))]
        return text

    def compile(self, params: StructuredOutputsParams):
        """-> a matcher at the start of the output (RequestError as validate)."""
        import llguidance

        text = self.validate(params)
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise RequestError(f"StructuredOutputsParams.{params.kind} does not compile: {matcher.get_error()}")
        return matcher

    def add(self, req_id: int, matcher) -> None:
        self.matchers[req_id] = matcher

    def remove(self, req_id: int) -> None:
        self.matchers.pop(req_id, None)
        self.drafts.pop(req_id, None)

    def set_drafts(self, req_id: int, drafts: list[int]) -> None:
        """The drafts now pending in a sequence's slot (dropped for a finished one)."""
        if req_id in self.matchers:
            self.drafts[req_id] = drafts

    def accept(self, req_id: int, tokens: list[int]) -> None:
        """Advance a sequence's matcher over the tokens it emitted."""
        matcher = self.matchers.get(req_id)
        if matcher is None or not tokens or matcher.is_stopped():  # stopped: complete, only EOS follows
            return
        if not matcher.consume_tokens(tokens):
            # Only a row the constraint and another mask left empty (min_tokens holding back the EOS
            # a complete output needs, allowed_token_ids outside the language) samples such a token.
            logger.error("request %d emitted tokens its structured output does not allow (%s); it continues "
                         "unconstrained", req_id, matcher.get_error())
            self.remove(req_id)

    def bitmask(self, plan: StepPlan) -> GrammarMask | None:
        """The step's bitmask rows for its sampling constrained requests (None: it has none)."""
        import llguidance.torch

        reqs = [i for i, r in enumerate(plan.reqs) if r.sample and r.req_id in self.matchers]
        if not reqs:
            return None
        num_rows = sum(plan.reqs[i].num_drafts + 1 for i in reqs)
        bitmask = torch.full((num_rows, self.num_words), -1, dtype=torch.int32)  # -1: every token allowed
        plain, drafted, row = [], [], 0  # (matcher, first row[, drafts])
        for i in reqs:
            r = plan.reqs[i]
            drafts = self.drafts.get(r.req_id, [])[: r.num_drafts]
            if len(drafts) != r.num_drafts:
                raise RuntimeError(f"request {r.req_id} verifies {r.num_drafts} drafts but {len(drafts)} reached "
                                   "the host")
            matcher = self.matchers[r.req_id]
            if drafts:
                drafted.append((matcher, row, drafts))
            else:
                plain.append((matcher, row))
            row += r.num_drafts + 1
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:  # the matcher advanced over each draft in turn, then rolled back
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return GrammarMask(reqs, bitmask.numpy())
