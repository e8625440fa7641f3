"""SamplingParams: what a request asks of the sampler, validated at construction."""
from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import logging
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Any

from tandem.errors import RequestError

logger = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
# The sampler works in float32: a parameter outside its normal range becomes inf or 0 there, and a masked
# logit (-inf) times 0, or over inf, is NaN.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
MIN_TEMPERATURE = 0.01  # a positive temperature below this is raised to it (vLLM's rule): logits / T overflow
MAX_N = 1 << 16  # samples a request may ask for: each is a sequence the engine keeps (n = 10**7 filled memory)

# The kinds of constraint a StructuredOutputsParams holds (exactly one is set).
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, as vLLM's: every token is drawn among those that keep
    the text a prefix of the language (tandem.engine.grammar). Set exactly one of:

    json: a JSON schema (a dict, or its text); json_object: True for any JSON object; regex: a
    regular expression (Rust regex syntax); choice: a list of strings, the output one of them;
    grammar: a context-free grammar in Lark syntax or GBNF (llama.cpp's, with `::=`).
    disable_any_whitespace: JSON without free whitespace between tokens (compact, and shorter
    for a model that would pad); disable_additional_properties: objects whose schema leaves
    additionalProperties unset get only the properties it names.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # vLLM's fields tandem does not take: accepted at values that ask for nothing, refused otherwise
    disable_fallback: dataclasses.InitVar[bool] = False
    whitespace_pattern: dataclasses.InitVar[str | None] = None
    structural_tag: dataclasses.InitVar[str | None] = None

    def __post_init__(self, disable_fallback=False, whitespace_pattern=None, structural_tag=None) -> None:
        def bad(name: str, rule: str) -> RequestError:
            return RequestError(f"StructuredOutputsParams.{name}={getattr(self, name)!r} is invalid: {rule}")

        _refuse_vllm_only("StructuredOutputsParams", {
            "disable_fallback": (disable_fallback, "llguidance is the one backend, so there is nothing to fall back "
                                                   "from; leave it out"),
            "whitespace_pattern": (whitespace_pattern, "no pattern is taken; disable_any_whitespace=True gives JSON "
                                                       "without free whitespace"),
            "structural_tag": (structural_tag, "give the constraint as json, regex, choice, grammar or json_object"),
        })

        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise RequestError(
                f"StructuredOutputsParams sets {', '.join(set_kinds) or 'no constraint'}: set exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise bad("json", "give a JSON schema, as a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            blank = isinstance(value, str) and not (value if name == "regex" else value.strip())  # (" ": a regex)
            if value is not None and (not isinstance(value, str) or blank):
                raise bad(name, "give a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise bad("choice", "give a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise bad("json_object", "it must be True (any JSON object) or None")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "it must be True or False")

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        """From a dict of the fields (a server request's structured_outputs); RequestError for
        fields it does not have."""
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__), key=repr)  # (its InitVars: vLLM's fields)
        if unknown:
            raise RequestError(f"StructuredOutputsParams has no fields {unknown}: give one of "
                               f"{', '.join(STRUCTURED_KINDS)}, and disable_any_whitespace or "
                               "disable_additional_properties")
        return cls(**fields)

    @property
    def kind(self) -> str:
        """The constraint that is set: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.IntEnum):
    """What the engine's outputs of an unfinished request carry (vLLM's values).

    CUMULATIVE: every output holds everything so far. DELTA: each holds only what is new since the
    request's previous output (tokens, text, logprobs; the prompt logprobs with the first), the
    final one too. FINAL_ONLY: the request yields one output, when it finishes (LLM.generate's)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters, named as in vLLM.

    temperature 0 means greedy (one in (0, 0.01) is raised to 0.01, as in vLLM). top_k 0 or -1
    disables top-k; top_p 1 disables top-p. seed -1 means no seed, as None.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these
    # Words never to generate: the last token of a word is banned where the output so far ends with
    # the rest of it. The engine tokenizes bad_words into bad_words_token_ids (which may also be
    # given directly, as token id sequences).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprobs of each prompt token (after the first) and its top-n
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len); text keeps BOS
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # With skip_special_tokens=False: spaces around special tokens in the text, as vLLM (the
    # tokenizer's decode applies it; Hugging Face's fast tokenizers have no such spaces to add).
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (text "", logprobs without decoded tokens), as vLLM
    # With an engine watermark_config: None or True draws sampled tokens with the key, False opts out (vLLM).
    watermarking: bool | None = None
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (vLLM's field); a dict
    # is read as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: arbitrary arguments for plugins and custom samplers; carried with the request, read by none.
    extra_args: dict[str, Any] | None = None
    # What each output of the request carries: a RequestOutputKind, or its value or name.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's fields tandem does not take: accepted at values that ask for nothing, refused otherwise
    best_of: dataclasses.InitVar[int | None] = None
    logits_processors: dataclasses.InitVar[Any] = None
    guided_decoding: dataclasses.InitVar[Any] = None
    flat_logprobs: dataclasses.InitVar[bool] = False

    def __post_init__(self, best_of=None, logits_processors=None, guided_decoding=None, flat_logprobs=False) -> None:
        _refuse_vllm_only("SamplingParams", {
            "best_of": (None if best_of == self.n else best_of,
                        "n samples are returned, each drawn on its own (vLLM's V1 engine dropped best_of too); "
                        "leave it out, or equal to n"),
            "logits_processors": (logits_processors or None,
                                  "tandem runs no custom logits processors; logit_bias, allowed_token_ids, "
                                  "bad_words and min_tokens shape the logits; leave it out"),
            "guided_decoding": (guided_decoding, "pass the constraint as structured_outputs (vLLM's newer name "
                                                 "for it)"),
            "flat_logprobs": (flat_logprobs, "logprobs come as a list of dicts, one a token; leave it out"),
        })
        self.output_kind = _output_kind(self.output_kind)
        for name in ("logprobs", "prompt_logprobs"):  # bools as vLLM reads them: True is 1, False 0
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        for name in ("allowed_token_ids", "stop_token_ids"):  # a numpy array (or a tensor) as its list
            value = getattr(self, name)
            if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
                setattr(self, name, value.tolist())
        for name in _INT_FIELDS:  # numpy's integers (and other integer types) as int, as vLLM takes them
            setattr(self, name, _as_int(getattr(self, name)))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(getattr(self, name)))
        if _is_int(self.seed) and self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise RequestError(f"SamplingParams.stop={self.stop!r} is invalid: give a string or a list of strings")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids!r} is invalid: give a list of token ids"
            )
        self.stop = list(self.stop or [])
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise RequestError(f"SamplingParams.allowed_token_ids={self.allowed_token_ids!r} is invalid: "
                                   "give a list of token ids")
            self.allowed_token_ids = _int_list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and not isinstance(self.bad_words, (list, tuple)):
            raise RequestError(f"SamplingParams.bad_words={self.bad_words!r} is invalid: give a list of strings")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)) or not (
                set(map(type, self.bad_words_token_ids)) <= {list, tuple}
                or all(isinstance(w, (list, tuple)) for w in self.bad_words_token_ids)
            ):
                raise RequestError(f"SamplingParams.bad_words_token_ids={self.bad_words_token_ids!r} is invalid: "
                                   "give a list of token id lists")
            words = self.bad_words_token_ids
            self.bad_words_token_ids = [list(w) for w in words] if _plain_ints(itertools.chain.from_iterable(words)) \
                else [[_as_int(t) for t in w] for w in words]
        self.stop_token_ids = _int_list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(_as_int(t)) or is_int_text(t) for t in self.logit_bias
            ) or not all(_is_num(_as_float(b)) for b in self.logit_bias.values()):
                raise RequestError(
                    f"SamplingParams.logit_bias={self.logit_bias!r} is invalid: give a dict of token id -> bias"
                )
            self.logit_bias = {int(_as_int(t)): float(b) for t, b in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError(f"SamplingParams.structured_outputs={self.structured_outputs!r} is invalid: give a "
                               "StructuredOutputsParams (or a dict of its fields)")
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, where logits / temperature overflow; using %s",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> RequestError:
            return RequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {rule}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"it must be an integer in [1, {MAX_N}]; ask for more samples in several requests")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", "it must be >= 0 (0 means greedy) and a finite float32")
        if self.temperature == 0 and self.n > 1:  # vLLM's rule: n copies of one greedy output
            raise bad("n", "greedy sampling (temperature 0) gives one output: set n=1, or a temperature > 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "it must be in (0, 1]; use 1 to disable")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "it must be an integer >= -1; use 0 or -1 to disable")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "it must be in [0, 1]; use 0 to disable")
        if not _is_num(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise bad("repetition_penalty", "it must be > 0 and a finite, normal float32 (in [1.2e-38, 3.4e38]); "
                      "use 1 to disable")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2 <= value <= 2:
                raise bad(name, "it must be in [-2, 2]; use 0 to disable")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "it must be an integer >= 1 (or None for up to max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "it must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"it must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None and (not _is_int(self.seed) or not -MAX_SEED - 1 <= self.seed <= MAX_SEED):
            raise bad("seed", f"it must be a 64-bit integer, in [{-MAX_SEED - 1}, {MAX_SEED}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < -1):
            raise bad("logprobs", "it must be an integer >= 0, or -1 for the whole vocabulary")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise bad("truncate_prompt_tokens", "it must be an integer >= 1, or -1 for max_model_len")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < -1):
            raise bad("prompt_logprobs", "it must be an integer >= 0, or -1 for the whole vocabulary")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if not _token_ids(self.stop_token_ids) and any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be integers >= 0")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "give at least one token id, or None for the whole vocabulary")
            if not _token_ids(self.allowed_token_ids) and any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "token ids must be integers >= 0")
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            raise bad("bad_words", "bad words must be non-empty strings")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):  # (stripped, as vLLM: no tokens)
            raise bad("bad_words", "a bad word is whitespace alone, which leaves nothing to ban (words are stripped)")
        if self.bad_words is not None and any(lone_surrogate(w) is not None for w in self.bad_words):
            raise bad("bad_words", "a bad word holds a lone surrogate, which is not valid Unicode")
        words = self.bad_words_token_ids
        if words is not None and not (all(words) and _token_ids(list(itertools.chain.from_iterable(words)))) and any(
            not w or any(not _is_int(t) or t < 0 for t in w) for w in words
        ):
            raise bad("bad_words_token_ids", "each word must be a non-empty list of token ids >= 0")
        if self.logit_bias and any(not -FLOAT32_MAX <= b <= FLOAT32_MAX and b != float("-inf")
                                   for b in self.logit_bias.values()):
            raise bad("logit_bias", "biases must be finite float32 values, or -inf to ban a token (the server "
                      "takes OpenAI's [-100, 100])")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "ignore_eos",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "it must be True or False")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "give a dict (or None)")
        if not (self.watermarking is None or isinstance(self.watermarking, bool)):
            raise bad("watermarking", "it must be True, False or None (the engine's watermark_config decides)")
        if not self.detokenize and self.stop:
            raise bad("detokenize", "stop strings need the text: set detokenize=True, or use stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    def clone(self, **changes) -> "SamplingParams":
        """A copy with changes; nothing in it is shared with self (vLLM's clone is a deep copy):
        the lists and dicts are rebuilt, the constraint and extra_args copied (extra_args that do
        not deep-copy, a lock say, shallowly) unless changes replace them."""
        own = {} if "structured_outputs" in changes else {"structured_outputs": copy.deepcopy(self.structured_outputs)}
        if self.extra_args is not None and "extra_args" not in changes:
            try:
                own["extra_args"] = copy.deepcopy(self.extra_args)
            except Exception:
                own["extra_args"] = dict(self.extra_args)
        return dataclasses.replace(self, **{**own, **changes})


def _refuse_vllm_only(owner: str, fields: dict[str, tuple[Any, str]]) -> None:
    """RequestError for the first of vLLM's fields (name -> (value, why)) set to ask for something."""
    for name, (value, why) in fields.items():
        if value is not None and value is not False:
            raise RequestError(f"{owner}.{name}={value!r} is not supported: {why}")


@dataclass
class BeamSearchParams:
    """LLM.beam_search's settings (vLLM's): keep the beam_width likeliest sequences, each step
    extending every beam by its 2 * beam_width likeliest next tokens; a sequence ends at EOS
    (unless ignore_eos) or after max_tokens. Sequences rank by cum_logprob / length **
    length_penalty (length counting the prompt, an ending EOS not); temperature > 0 adds each
    beam's sampled token to its candidates. Unlike vLLM's, a result's text is the output alone
    (special tokens skipped), and any of the engine's EOS ids ends a beam (README)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the text keeps the ending EOS's (empty where it is special)

    def __post_init__(self):
        def bad(name: str, rule: str) -> RequestError:
            return RequestError(f"BeamSearchParams.{name}={getattr(self, name)!r} is invalid: {rule}")

        self.beam_width, self.max_tokens = _as_int(self.beam_width), _as_int(self.max_tokens)
        self.temperature, self.length_penalty = _as_float(self.temperature), _as_float(self.length_penalty)
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise bad("beam_width", "it must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "it must be an integer >= 1")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", "it must be >= 0 (0: each beam's candidates are its likeliest tokens alone) "
                      "and a finite float32")
        if not _is_num(self.length_penalty) or abs(self.length_penalty) == float("inf"):
            raise bad("length_penalty", "it must be a finite number (1: score by logprob per token, 0: total logprob)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "it must be True or False")


# The fields that hold an integer and a number: numpy's (and other numeric types) taken as int / float.
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _plain_ints(values) -> bool:
    """Every value an int, not of a subclass (bool): at C speed, for long lists."""
    return set(map(type, values)) <= {int}


def _int_list(values) -> list:
    """values as a list, integers of other types (numpy's) as int: at C speed where all are plain
    ints (a request's 1M stop ids were a second of Python each time its params were copied)."""
    values = list(values)
    return values if _plain_ints(values) else [_as_int(t) for t in values]


def _token_ids(values: list) -> bool:
    """Every value a plain int >= 0, checked at C speed (False: look at each)."""
    return _plain_ints(values) and min(values, default=0) >= 0


def _as_int(x):
    """An integer of another type (numpy's) as int; anything else (bool too) as it is, for the checks."""
    if isinstance(x, (bool, int)) or not isinstance(x, numbers.Integral):
        return x
    return operator.index(x)


def lone_surrogate(text: str) -> int | None:
    """Where text holds a lone surrogate (not valid Unicode, as from a decode with errors="surrogateescape";
    a tokenizer refuses it with a bare TypeError), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _as_float(x):
    """A real number of another type (numpy's float32) as float; anything else as it is."""
    if isinstance(x, (bool, int, float)) or not isinstance(x, numbers.Real):
        return x
    return float(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_int_text(x) -> bool:
    """Whether x is the decimal text of an integer as JSON object keys carry token ids ("42", "-1"):
    ASCII digits only (str.isdigit also takes "²", which int() refuses), at most 20 of them."""
    return isinstance(x, str) and re.fullmatch(r"-?[0-9]{1,20}", x) is not None


def _is_num(x) -> bool:
    """A number (NaN, and an integer past a float's range, are none: no check may overflow on them)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return float(x) == float(x)
    except OverflowError:
        return False


def _output_kind(value) -> RequestOutputKind:
    """A RequestOutputKind from itself, its value (0, 1, 2) or its name (any case)."""
    if isinstance(value, str) and value.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[value.upper()]
    if _is_int(value) and value in set(RequestOutputKind):
        return RequestOutputKind(value)
    names = ", ".join(k.name for k in RequestOutputKind)
    raise RequestError(f"SamplingParams.output_kind={value!r} is invalid: give a RequestOutputKind ({names}), "
                       "its value or its name")
