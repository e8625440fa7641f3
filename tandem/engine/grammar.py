"""Structured outputs: a grammar matcher per constrained sequence, and each step's token bitmasks.

A request's StructuredOutputsParams compiles (llguidance) into a matcher over the model's
tokenizer, one per output sequence. The matcher follows the tokens the sequence emits, on the
host; before a step that samples the sequence, it writes the bitmask of the tokens that keep the
output a prefix of the language, one row per logits row: with drafts pending, the row after each
draft comes from the matcher advanced over the drafts before it (and rolled back), so the
target verifies every draft against the constraint. The first draft the constraint rejects is
masked out of its own row, which rejects it whatever the verifier; the rows after it allow every
token (nothing from them is emitted). Once an EOS completes the output, the rows after it allow
EOS alone (an output goes on past it under ignore_eos, and only EOS may follow: target-only output
pads so, and speculative output must equal it). The runner applies the rows to the logits before
any other processor, as vLLM does, so logprobs see the constraint too.

The drafts are proposed under the constraint as well (DraftMasks): while the draft model runs a
round, each matcher is advanced over the tokens the step emitted and then over each draft, and
the draft's next row is masked with the language after them, so the draft proposes only tokens
the target may emit. Everything the round consumed is rolled back after it; the engine then
advances the matchers over what the step emitted (Grammars.accept). On a GPU a round runs free
instead, and the drafts from the first that the target's row forbids (misfits) are drawn again
under masks from the matchers advanced over the drafts that fit (repair_masks).
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from tandem.engine.detokenizer import num_token_ids
from tandem.errors import RequestError
from tandem.plan import GrammarMask, StepPlan
from tandem.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tandem")

# "auto" grammar-aware drafting (Engine.grammar_drafting): a request whose free rounds leave its
# grammar in ROUND_ABOVE of them or more (a moving average of weight MISFIT_WEIGHT) has its rounds
# masked step by step; each masked round fades the average by MISFIT_FADE until a free round
# measures again. On the H200 (Qwen2.5-Coder 1.5B / 0.5B shapes, batch 1, k = 4), masking a round
# cost 0.57 ms (6.26 against 5.69 ms a round) and redrawing a round from its first draft 2.7 ms.
ROUND_ABOVE = 0.25
MISFIT_WEIGHT = 0.25
MISFIT_FADE = 0.95


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
            if params.disable_additional_properties and kind == "json":  # (json_object: any object, as vLLM)
                schema = _closed_objects(copy.deepcopy(schema))
            # Free whitespace unless disabled; a schema's own "x-guidance" options (llguidance's) hold otherwise.
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False} if params.disable_any_whitespace else None)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # One regex lexeme, not a Lark rule of alternatives: llguidance's parser refuses a row of
            # more than 2000 items (max_items_in_row) once the output starts, which ended a request
            # of many choices after one token.
            return llguidance.LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, RecursionError) as e:  # (RecursionError: JSON text nested past json's limit)
        raise RequestError(f"StructuredOutputsParams.{kind} is invalid: {e}") from None


# llguidance checks and compiles a grammar by recursion, one level per nested rule or $ref: on a
# thread's usual 8 MB stack a chain of ~2,500 (a 40 KB request) overflowed it and killed the process.
# It runs on a thread of GRAMMAR_STACK_BYTES (reserved, not committed, until used), and a grammar
# is at most MAX_GRAMMAR_BYTES: the longest chain that size holds (~75k rules, ~35k $refs) took
# under a second on that stack.
GRAMMAR_STACK_BYTES = 512 << 20
MAX_GRAMMAR_BYTES = 1 << 20
# threading.stack_size is the process's: the engine loop's thread and the server's tokenizing threads
# each set it, start their grammar thread and put it back under this lock, so that none starts its
# thread on another's setting (an 8 MB stack: a deep grammar's SIGSEGV) or leaves 512 MB set for all.
_STACK_SIZE_LOCK = threading.Lock()


def _on_grammar_stack(fn: Callable[[], Any]) -> Any:
    """fn() on a thread with a GRAMMAR_STACK_BYTES stack; its result returned, its exception raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            out["error"] = e

    thread = threading.Thread(target=run, name="tandem-grammar")
    with _STACK_SIZE_LOCK:
        old = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread.start()
        except RuntimeError:  # no thread of that stack (a strict memory overcommit policy): on this one's
            thread = None
        finally:
            threading.stack_size(old)
    if thread is not None:
        thread.join()
    else:
        logger.warning("no thread with a %d MB stack for llguidance; checking the grammar on this thread's",
                       GRAMMAR_STACK_BYTES >> 20)
        run()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _told(message: str) -> str:
    """llguidance's message as a request error tells it: without the native backtrace an internal
    assertion (a grammar of ~70k alternatives: "panic: ... symbols.len() < u16::MAX") carries."""
    return message.split("<backtrace>")[0].strip()


# llguidance refuses an Earley row of more items than this once the output starts (its default, 2000,
# ended a JSON object of 3000 properties or an anyOf of 3000 branches after "{"); a step's items stay
# capped by step_max_items (50_000), so this lets such a row be as large as a step may be.
MAX_ITEMS_IN_ROW = 50_000


def _parser_limits():
    """llguidance's limits for validation and matching; verbose_errors off: a failure mid-output
    (logged in Grammars.accept) names its cause without the whole grammar (hundreds of KB for a
    large schema)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """text as a regex (Rust's syntax, llguidance's) that matches it alone."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


_SCHEMA_VALUES = ("const", "enum", "default", "examples")  # a JSON schema's keys that hold data, not schemas
# keys whose object maps names (of properties, patterns, definitions) to schemas: a name is no keyword
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed_objects(schema: Any) -> Any:
    """disable_additional_properties: every object schema that names properties (or patterns of
    them) and leaves additionalProperties unset gets additionalProperties false, as vLLM's; a
    free-form {"type": "object"} stays free, and values (const, enum, default, examples) stay as
    they are (in place; -> schema). A property named "default" or "properties" is a name, not a
    keyword: its schema closes too, and the map of properties gets no key of its own."""
    if isinstance(schema, dict):
        if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for named in value.values():
                    _closed_objects(named)
            elif key not in _SCHEMA_VALUES:
                _closed_objects(value)
    elif isinstance(schema, list):
        for value in schema:
            _closed_objects(value)
    return schema


def rebased_refs(schema: Any, base: str) -> Any:
    """A copy of schema with its local references ("#", "#/...") pointing into base (a JSON pointer,
    "#/$defs/x"), for a schema moved there inside a larger one; others (anchors, URIs) kept, and so
    is a subschema with an "$id" of its own (its "#" is itself, wherever it lies)."""
    if isinstance(schema, list):
        return [rebased_refs(value, base) for value in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebased_refs(named, base) for name, named in value.items()}
        else:
            out[key] = value if key in _SCHEMA_VALUES else rebased_refs(value, base)
    return out


def ll_tokenizer_of(tokenizer, n_vocab: int, eos_token_ids) -> Any:
    """llguidance's tokenizer of a fast Hugging Face tokenizer, mending two things in its own
    reading (llguidance.hf.from_tokenizer) so that a constraint may spell any text:
    - an added token that is not special (Qwen2.5's <tool_call>, Qwen3's <think>) is text, as
      Hugging Face holds it (llguidance takes every added token as special);
    - forced text (the rest of a JSON key, a regex's literal) is tokenized with special tokens
      spelt out in ordinary ones (_forced_text_tokenizer), so text that names a special token
      (<|im_end|>) is written as text.
    Without them such text could never be written: the mask allowed the token its tokenization
    gave, the matcher then refused it, and the output ended cut ("stop") short of the constraint.
    The tokens' bytes and the other special tokens are llguidance's reading's; ids past the
    tokenizer's (an embedding's padding rows) are no text."""
    import functools

    import llguidance
    import llguidance.hf

    eos = list(eos_token_ids) or [tokenizer.eos_token_id]
    base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    as_text = {i for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
    n_text = num_token_ids(tokenizer)
    backend = _forced_text_tokenizer(tokenizer)

    @functools.lru_cache(maxsize=4096)  # forced texts repeat (a schema's keys): llguidance asks each step
    def encode(text: str) -> tuple[int, ...]:
        return tuple(backend.encode(text, add_special_tokens=False).ids)

    class Source:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_token_id
        tokens = [base.decode_bytes([i]) if i < n_text else b"" for i in range(n_vocab)]
        special_token_ids = [i for i in range(n_vocab) if base.is_special_token(i) and i not in as_text]

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):  # (the wrapper then hands over str)
                raise TypeError("text as str")
            return list(encode(text))

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Source()), n_vocab=n_vocab, eos_token=eos)


def _forced_text_tokenizer(tokenizer):
    """A copy of the tokenizer's backend for the text a constraint forces, read as llguidance reads
    text: a piece from the middle of an output, so no sentencepiece "▁" (nor a byte-level space) is
    put before it, and special tokens' text is spelt out in ordinary tokens."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["truncation"] = spec["padding"] = None
    spec["normalizer"] = _without_prepend(spec.get("normalizer"))
    spec["pre_tokenizer"] = _without_prefix_space(spec.get("pre_tokenizer"))
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.encode_special_tokens = True
    return backend


def _without_prepend(node: dict | None) -> dict | None:
    """A normalizer without its Prepend steps (sentencepiece's "▁" before a text)."""
    if node is None or node.get("type") == "Prepend":
        return None
    if node.get("type") == "Sequence":
        kept = [n for n in map(_without_prepend, node.get("normalizers", [])) if n is not None]
        return {**node, "normalizers": kept} if kept else None
    return node


def _without_prefix_space(node: dict | None) -> dict | None:
    """A pre-tokenizer that puts nothing before a text (Metaspace's prepend_scheme "never",
    ByteLevel's add_prefix_space false)."""
    if node is None:
        return None
    if node.get("type") == "Sequence":
        return {**node, "pretokenizers": [_without_prefix_space(n) for n in node.get("pretokenizers", [])]}
    if node.get("type") == "Metaspace":
        return {**node, "prepend_scheme": "never", **({"add_prefix_space": False} if "add_prefix_space" in node else {})}
    if node.get("type") == "ByteLevel":
        return {**node, "add_prefix_space": False}
    return node


class Grammars:
    """The matchers of the engine's constrained sequences, keyed by Request.req_id, and the drafts
    pending for each (which the next step's rows follow)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], reasoning=None):
        """reasoning: a tandem.reasoning.ReasoningFormat: constraints hold after the thinking."""
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.num_words = (vocab_size + 31) // 32  # int32 words of a bitmask row
        self.matchers: dict[int, Any] = {}  # req_id -> llguidance.LLMatcher
        # req_id -> (a copy of its matcher at the output's start or its last rebuild, the tokens accept()
        # consumed since): how a matcher that a speculative rollback left in error is rebuilt (_live)
        self._history: dict[int, tuple[Any, list[int]]] = {}
        self._failed: set[int] = set()  # req_ids whose matchers erred over emitted tokens (as target-only's)
        self.drafts: dict[int, list[int]] = {}  # req_id -> the drafts pending in its slot
        # req_id -> how often its free drafting rounds leave the grammar (a moving average, "auto")
        self.misfit_rate: dict[int, float] = {}
        # req_id -> (drafts, their rows [len(drafts) + 1, words]): what misfits computed for a free
        # round's drafts that fit, for the next bitmask, until the matcher moves (accept, remove).
        self._fitting_rows: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._valid: dict[str, None] = {}  # grammars that compiled, oldest first
        self._valid_lock = threading.Lock()  # validate runs on the server's tokenizing threads too
        self._ll_tokenizer = None  # built on first use (about a second for a 150k vocabulary)
        self._building = threading.Lock()  # the server's loop may ask for it too (token_bytes)
        self._build_error: RequestError | None = None  # why it cannot be built, once found
        self._executor = None

    @property
    def active(self) -> bool:
        """A constrained sequence is running: each step's masks need the previous step's tokens."""
        return bool(self.matchers)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            with self._building:
                if self._build_error is not None:  # (a second try would take as long to fail again)
                    raise self._build_error
                if self._ll_tokenizer is None:
                    try:
                        self._build_tokenizer()
                    except RequestError as e:
                        self._build_error = e
                        raise
        return self._ll_tokenizer

    def _build_tokenizer(self) -> None:
        import llguidance

        if self.tokenizer is None:
            raise RequestError("SamplingParams.structured_outputs needs the model's tokenizer, and this model "
                               "has none")
        try:
            ll_tokenizer = ll_tokenizer_of(self.tokenizer, self.vocab_size, self.eos_token_ids)
        except Exception as e:  # a slow (Python) tokenizer, or one larger than the model's vocabulary
            raise RequestError(f"SamplingParams.structured_outputs cannot run on this model's tokenizer "
                               f"({type(self.tokenizer).__name__}): {e}") from None
        import llguidance.torch  # noqa: F401  (here, not in the first constrained step: it imports ~740 modules,
        # torch.compile's among them, a 1-1.75 s stall of the whole batch)

        self._executor = llguidance.LLExecutor()
        self._ll_tokenizer = ll_tokenizer

    def special_tags(self, tags: dict[str, int]) -> dict[str, int]:
        """Of tags (tag text -> its token id), those llguidance holds as special tokens, which a
        grammar must name by id (`<[id]>`: their text does not match them); it matches the others
        as text, whichever tokens spell it (ll_tokenizer_of). All of them where llguidance cannot
        read the tokenizer (no structured output runs then)."""
        try:
            ll_tokenizer = self._tokenizer()
        except RequestError:
            return dict(tags)
        return {text: token for text, token in tags.items() if ll_tokenizer.is_special_token(token)}

    def token_bytes(self) -> Callable[[int], bytes] | None:
        """token id -> the bytes it stands for (a piece of a character is its own bytes, where its
        decoded text has U+FFFD), from the tokenizer llguidance reads; None where it cannot read this
        one. The first call builds it (a second or two at a 150k vocabulary, holding the GIL: the
        server makes it at start-up). It is read-only once built, so any thread may use it."""
        try:
            ll_tokenizer = self._tokenizer()
        except RequestError:
            return None
        return lambda token: ll_tokenizer.decode_bytes([token])

    def validate(self, params: StructuredOutputsParams, prompt_token_ids: list[int] | None = None) -> str:
        """-> the constraint's grammar; RequestError naming the field when it does not compile (an
        unclosed regex, an unknown rule, an unsupported schema). The last grammars found valid are
        remembered, so checking a request and then adding it compiles its grammar once. With a
        reasoning parser the constraint holds from the end of the thinking (where the reply to
        prompt_token_ids starts in it; tandem/reasoning.py)."""
        import llguidance

        text = grammar_text(params)
        if self.reasoning is not None:
            text = self._after_thinking(text, prompt_token_ids or [])
        if text in self._valid:
            return text
        if len(text) > MAX_GRAMMAR_BYTES:
            raise RequestError(f"StructuredOutputsParams.{params.kind} is too large: its grammar takes {len(text)} "
                               f"bytes, at most {MAX_GRAMMAR_BYTES}; split the constraint or simplify it")
        tokenizer, limits = self._tokenizer(), _parser_limits()
        is_error, messages = _on_grammar_stack(
            lambda: llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=limits))
        if is_error:
            raise RequestError(f"StructuredOutputsParams.{params.kind} does not compile: {_told(messages[0])}")
        with self._valid_lock:
            self._valid[text] = None
            if len(self._valid) > 64:
                del self._valid[next(iter(self._valid))]
        return text

    def _after_thinking(self, text: str, prompt_token_ids: list[int]) -> str:
        from tandem.reasoning import reasoning_tag_tokens

        tail = self.tokenizer.decode(prompt_token_ids[-8:]) if self.tokenizer is not None else None
        tags = self.special_tags(reasoning_tag_tokens(self.tokenizer))  # those named by id; the others are text
        return self.reasoning.gate(text, self.reasoning.opens(tail), tags)

    def compile(self, params: StructuredOutputsParams, prompt_token_ids: list[int] | None = None):
        """-> a matcher at the start of the output (RequestError as validate)."""
        import llguidance

        text = self.validate(params, prompt_token_ids)
        matcher = _on_grammar_stack(lambda: llguidance.LLMatcher(self._tokenizer(), text, log_level=0,
                                                                 limits=_parser_limits()))
        if matcher.is_error():
            raise RequestError(f"StructuredOutputsParams.{params.kind} does not compile: {_told(matcher.get_error())}")
        return matcher

    def add(self, req_id: int, matcher) -> None:
        self.matchers[req_id] = matcher
        self._history[req_id] = (matcher.deep_copy(), [])

    def remove(self, req_id: int) -> None:
        self.matchers.pop(req_id, None)
        self._history.pop(req_id, None)
        self._failed.discard(req_id)
        self.drafts.pop(req_id, None)
        self.misfit_rate.pop(req_id, None)
        self._fitting_rows.pop(req_id, None)

    def set_drafts(self, req_id: int, drafts: list[int]) -> None:
        """The drafts now pending in a sequence's slot (dropped for a finished one)."""
        if req_id in self.matchers:
            self.drafts[req_id] = drafts

    def accept(self, req_id: int, tokens: list[int]) -> None:
        """Advance a sequence's matcher over the tokens it emitted, as far as it goes: once it
        stops (the output complete: only EOS may follow) what follows is not consumed, whether
        one step emitted it with the last token or a later step did (a row the constraint and
        another mask left empty: allowed_token_ids without that EOS), so a speculative step and
        target-only steps leave the matcher alike. A token it refuses (drawn from such an empty
        row before the output was complete) or its own failure puts it in error, which llguidance
        counts as stopped: its rows allow only EOS from then on, so the output ends (vLLM's
        rows of an errored matcher)."""
        matcher = self._live(req_id)
        if matcher is None or not tokens or matcher.is_stopped():  # stopped: complete, only EOS follows
            return
        self._fitting_rows.pop(req_id, None)
        n = matcher.try_consume_tokens(tokens)
        self._history[req_id][1].extend(tokens[:n])
        if n < len(tokens) and not matcher.is_stopped():
            matcher.consume_tokens(tokens[n:n + 1])  # refused: the matcher errs
        if matcher.is_error():
            self._failed.add(req_id)
            logger.error("request %d: its structured output's matcher failed (%s); only EOS may follow, so its "
                         "output ends", req_id, matcher.get_error())

    def _live(self, req_id: int):
        """req_id's matcher, rebuilt if it is in error though the tokens it followed never put it
        there: llguidance can fail to roll back a draft that entered a branch whose forced text it
        will not expand (a rule with no end), leaving the matcher in error where target-only
        decoding, which never rolls back, goes on. The rebuilt one is a copy of the last checkpoint (the
        output's start, or the last rebuild: each replays only what was emitted since) advanced over the
        tokens accepted since, a row computed before each as target-only steps do; a token it then
        refuses is one target-only steps fail on too, and the output ends. (Where llguidance's limits
        hang on the rows computed between tokens, a step that accepts several at once may pass one that
        target-only steps fail on: in such grammars, and only there, the two can end a few tokens apart.)
        None: no matcher."""
        matcher = self.matchers.get(req_id)
        if matcher is None or req_id in self._failed or not matcher.is_error():
            return matcher
        checkpoint, consumed = self._history[req_id]
        matcher = checkpoint.deep_copy()
        # A row before each token and at the end, as target-only steps compute them: whether llguidance's
        # limits let a token through depends on the row computed before it.
        for token in consumed:
            matcher.compute_bitmask()
            if matcher.try_consume_tokens([token]) < 1 or matcher.is_error():
                break
        else:
            matcher.compute_bitmask()
        self.matchers[req_id] = matcher
        if matcher.is_error():  # where target-only steps would have failed too (not seen but in such grammars)
            self._failed.add(req_id)
            logger.error("request %d: its structured output's matcher failed (%s); only EOS may follow, so its "
                         "output ends", req_id, matcher.get_error())
        else:  # the next rebuild starts here: each replays only what was emitted since the last
            self._history[req_id] = (matcher.deep_copy(), [])
            logger.debug("request %d: its matcher erred in a speculative rollback; rebuilt over %d tokens", req_id,
                         len(consumed))
        return matcher

    def draft_masks(self, plan: StepPlan) -> DraftMasks | None:
        """The masks of the step's drafting round for its constrained requests that draft (None:
        it has none)."""
        reqs = self._drafting(plan)
        if not reqs:
            return None
        return DraftMasks(reqs, [self._live(plan.reqs[i].req_id) for i in reqs], self.num_words, self._executor,
                          self._eos_row())

    def misfits(self, drafts: dict[int, list[int]]) -> dict[int, int]:
        """The constrained sequences among drafts (req_id -> the drafts of a free round) whose
        drafts leave the language -> req_id -> the index of the first that does. A draft fits
        where the row the target will verify it with allows it (_draft_rows: after an EOS that
        completes the output only EOS), not merely where the matcher could consume it: a matcher
        follows any tokens that spell the language's bytes, while the rows of forced text (a
        choice's rest, a JSON key) allow one tokenization of it, and a draft the target's row
        forbids, kept because it fits the bytes, would be verified against a draft distribution
        it was not drawn from (and emit a token the grammar forbids). Each sequence's misfit rate
        follows."""
        seqs = [(req_id, tokens) for req_id, tokens in drafts.items() if tokens and req_id in self.matchers]
        out = {}
        for req_id, tokens in seqs:  # a first draft the matcher cannot follow needs no rows (no row allows it)
            if tokens[0] not in self.eos_token_ids and self._live(req_id).validate_tokens(tokens[:1]) == 0:
                out[req_id] = 0
        for req_id in out:
            self._note_misfit(req_id, True)
        seqs = [(req_id, tokens) for req_id, tokens in seqs if req_id not in out]
        if not seqs:
            return out
        rows = self._draft_rows([(self._live(req_id), tokens) for req_id, tokens in seqs])
        row = 0
        for req_id, tokens in seqs:
            ids = torch.tensor(tokens, dtype=torch.int64)  # [n]
            words = rows[row + torch.arange(len(tokens)), ids // 32].long()  # [n] each draft's word of its row
            misfit = (((words >> (ids % 32)) & 1) == 0).nonzero()
            if len(misfit):
                out[req_id] = int(misfit[0, 0])
            else:  # the next step verifies these drafts with these rows
                self._fitting_rows[req_id] = (tokens, rows[row: row + len(tokens) + 1])
            row += len(tokens) + 1
            self._note_misfit(req_id, req_id in out)
        return out

    def _note_misfit(self, req_id: int, missed: bool) -> None:
        rate = self.misfit_rate.get(req_id, 0.0)
        self.misfit_rate[req_id] = (1 - MISFIT_WEIGHT) * rate + MISFIT_WEIGHT * missed

    def masked_rounds(self, req_ids) -> None:
        """Sequences whose drafts were masked in the round: their drafts could not miss, so their
        misfit rates fade, and a later round runs free and measures again."""
        for req_id in req_ids:
            if req_id in self.misfit_rate:
                self.misfit_rate[req_id] *= MISFIT_FADE

    def prefers_masking(self, plan: StepPlan) -> bool:
        """"auto" grammar-aware drafting: mask this step's drafting round step by step (a wait a
        draft step) rather than run it free and draw its misfits again, because a constrained
        request that drafts leaves the grammar in at least ROUND_ABOVE of its free rounds."""
        return any(self.misfit_rate.get(plan.reqs[i].req_id, 0.0) >= ROUND_ABOVE for i in self._drafting(plan))

    def _drafting(self, plan: StepPlan) -> list[int]:
        """Indices into plan.reqs of the constrained requests that sample and draft after the step."""
        return [i for i, r in enumerate(plan.reqs) if r.sample and r.num_next_drafts and r.req_id in self.matchers]

    def repair_masks(self, req_ids: list[int], drafts: list[list[int]]) -> DraftMasks:
        """Masks for redrafting sequences req_ids from the end of the drafts that fit (drafts[j],
        per sequence): each matcher advanced over them."""
        masks = DraftMasks(list(range(len(req_ids))), [self._live(r) for r in req_ids], self.num_words,
                           self._executor, self._eos_row())
        for j, tokens in enumerate(drafts):
            masks.advance(j, tokens)
        return masks

    def bitmask(self, plan: StepPlan) -> GrammarMask | None:
        """The step's bitmask rows for its sampling constrained requests (None: it has none)."""
        reqs = [i for i, r in enumerate(plan.reqs) if r.sample and r.req_id in self.matchers]
        if not reqs:
            return None
        parts, todo = [], []  # each request's rows; (its index in parts, (matcher, drafts)) to compute
        for i in reqs:
            r = plan.reqs[i]
            drafts = self.drafts.get(r.req_id, [])[: r.num_drafts]
            if len(drafts) != r.num_drafts:
                raise RuntimeError(f"request {r.req_id} verifies {r.num_drafts} drafts but {len(drafts)} reached "
                                   "the host")
            fitting = self._fitting_rows.get(r.req_id)
            if fitting is not None and fitting[0][: len(drafts)] == drafts:  # (a row depends on the drafts before)
                parts.append(fitting[1][: len(drafts) + 1])
            else:
                todo.append((len(parts), (self._live(r.req_id), drafts)))
                parts.append(None)
        if todo:
            rows = self._draft_rows([seq for _, seq in todo])
            for (j, _), part in zip(todo, rows.split([len(drafts) + 1 for _, (_, drafts) in todo])):
                parts[j] = part
        return GrammarMask(reqs, torch.cat(parts).numpy())

    def _draft_rows(self, seqs: list[tuple[Any, list[int]]]) -> torch.Tensor:
        """The bitmask rows the target verifies drafts with: for each (matcher, drafts), len(drafts)
        + 1 rows, the matcher's next-token row after each prefix of the drafts (advanced over them
        and rolled back) -> [sum(len(drafts) + 1), words] int32 (host)."""
        import llguidance.torch

        num_rows = sum(len(drafts) + 1 for _, drafts in seqs)
        bitmask = torch.full((num_rows, self.num_words), -1, dtype=torch.int32)  # -1: every token allowed
        plain, drafted, row = [], [], 0  # (matcher, first row[, drafts])
        for matcher, drafts in seqs:
            end = row + len(drafts) + 1
            n = self._completed_by(matcher, drafts)
            if n is not None:  # the rows after a draft EOS that completes the output: EOS again
                bitmask[row + n: end] = self._eos_row()
                drafts = drafts[:max(n - 1, 0)]  # (llguidance fills no row after a draft that stops the matcher)
            if matcher.is_stopped():
                bitmask[row] = self._eos_row()
            elif drafts:
                drafted.append((matcher, row, drafts))
            else:
                plain.append((matcher, row))
            row = end
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:  # the matcher advanced over each draft in turn, then rolled back
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
            for matcher, row, drafts in drafted:
                if matcher.is_error():  # it failed on a draft (_live rebuilds it): the rows it left unfilled
                    rows = bitmask[row: row + len(drafts) + 1]  # allow EOS alone, as an erring matcher's do
                    rows[(rows == -1).all(dim=1)] = self._eos_row()
        return bitmask

    def _completed_by(self, matcher, tokens: list[int]) -> int | None:
        """How many of tokens the matcher follows up to and with the EOS that completes the output
        (0: it is complete already; None: no token completes it). Only EOS may follow that one:
        an output goes on past it under ignore_eos."""
        if matcher.is_stopped():
            return 0
        if not any(t in self.eos_token_ids for t in tokens):
            return None
        n = matcher.validate_tokens(tokens)
        return n if n > 0 and tokens[n - 1] in self.eos_token_ids else None

    def _eos_row(self) -> torch.Tensor:
        """[words] int32: the bitmask row that allows the EOS tokens alone."""
        row = torch.zeros(self.num_words, dtype=torch.int64)
        for t in self.eos_token_ids:
            row[t // 32] |= 1 << (t % 32)
        return torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)


class DraftMasks:
    """Grammar-aware drafting: the bitmask rows of the drafts of some constrained requests.

    Each request j has its matcher; advance(j, tokens) moves it over tokens (the ones its request
    emitted this step, the drafts that fit), rows(js) gives the bitmask rows of the next drafts of
    requests js, and finish() rolls back everything consumed (the engine advances the matchers
    over what is emitted: Grammars.accept). A request whose output is complete (an EOS stopped
    its matcher) gets rows that allow EOS alone, as the target's rows do (under ignore_eos the
    output goes on); one whose token does not consume otherwise (drawn from a row the constraint
    and another mask left empty) gets rows that allow everything from then on: nothing drafted
    after that token can be emitted."""

    def __init__(self, reqs: list[int], matchers: list, num_words: int, executor, eos_row: torch.Tensor):
        self.reqs = reqs  # whose requests: indices into StepPlan.reqs
        self._matchers = matchers
        self._num_words = num_words
        self._executor = executor
        self._eos_row = eos_row
        self._consumed = [0] * len(reqs)  # tokens each matcher consumed, to roll back
        self._open = [False] * len(reqs)  # its rows allow everything from now on

    def advance(self, j: int, tokens: list[int]) -> None:
        if self._open[j] or not tokens or self._matchers[j].is_stopped():
            return
        n = self._matchers[j].try_consume_tokens(tokens)
        self._consumed[j] += n
        if n < len(tokens) and not self._matchers[j].is_stopped():
            self._open[j] = True

    def rows(self, js: list[int] | None = None) -> torch.Tensor:
        """The next drafts' rows of requests js (None: all) -> [len(js), words] int32 (host)."""
        import llguidance.torch

        js = range(len(self.reqs)) if js is None else js
        bitmask = torch.full((len(js), self._num_words), -1, dtype=torch.int32)  # -1: everything
        for row, j in enumerate(js):
            if not self._open[j] and self._matchers[j].is_stopped():
                bitmask[row] = self._eos_row
        closed = [(self._matchers[j], row) for row, j in enumerate(js)
                  if not self._open[j] and not self._matchers[j].is_stopped()]
        if closed:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, closed, bitmask)
        return bitmask

    def finish(self) -> None:
        """Roll every matcher back to where it was found."""
        for j, matcher in enumerate(self._matchers):
            if self._consumed[j]:
                matcher.rollback(self._consumed[j])
                self._consumed[j] = 0
