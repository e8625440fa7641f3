"""argparse types and help shared by `tandem generate` and `tandem serve`: each type range-checks its flag
while parsing, so a bad value fails at once, before any model loads, with argparse's "argument --flag: ..."
error naming the flag. No torch here: the parsers are built without it."""
from __future__ import annotations

import argparse
import math
import re


def int_in(lo: int, hi: int | None = None):
    """An integer >= lo (and <= hi)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; use {want}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range; use {want}")
        return value

    return parse


_DECIMAL_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def size_in(lo: int):
    """An integer >= lo, plain or with vLLM's unit suffixes: k m g t are powers of 1000 (25.6k is 25600),
    K M G T powers of 1024 (whole numbers only: 1K is 1024)."""
    want = f"an integer >= {lo}, or one with a unit (32k = 32000, 32K = 32768, 1G = 2**30)"

    def parse(text: str) -> int:
        found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
        try:
            if found is None:
                value = int(text)
            elif found[2] in _DECIMAL_UNITS:
                value = int(float(found[1]) * _DECIMAL_UNITS[found[2]])
            else:
                value = int(found[1]) * _BINARY_UNITS[found[2]]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; use {want}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is out of range; use {want}")
        return value

    return parse


def float_in(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False):
    """A finite float in [lo, hi] (the end left out where lo_open / hi_open)."""
    want = f"a number {'>' if lo_open else '>='} {lo}" + (
        "" if hi == math.inf else f" and {'<' if hi_open else '<='} {hi}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; use {want}") from None
        if (not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi
                or (hi_open and value == hi)):
            raise argparse.ArgumentTypeError(f"{value} is out of range; use {want}")
        return value

    return parse


def non_empty(fix: str):
    """A string that is not empty: "" is a typo or an unset shell variable, never a choice to fall back on."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty; {fix}")
        return text

    return parse


def _json(text: str, example: str):
    """A JSON flag's value, or ArgumentTypeError naming an example of what to give."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); give an object such as '{example}'") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"nested too deeply to read; give an object such as '{example}'") from None


def _checked(check, value, errors):
    """check(value), its errors (the exception types `errors`) turned into ArgumentTypeError."""
    try:
        return check(value)
    except errors as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def watermark_config(text: str) -> dict:
    """--watermark-config: a JSON object such as '{"key": 42}', checked field by field while parsing."""
    from tandem.errors import ConfigError
    from tandem.sampling.watermark import parse_watermark_config

    value = _json(text, '{"key": 42}')
    _checked(parse_watermark_config, value, ConfigError)
    return value


def override_generation_config(text: str) -> dict:
    """--override-generation-config: vLLM's JSON object of sampling defaults, e.g. '{"temperature": 0.5}'."""
    from tandem.errors import ConfigError
    from tandem.models.source import check_generation_override

    return _checked(check_generation_override, _json(text, '{"temperature": 0.5}'), ConfigError)


def hf_overrides(text: str) -> dict:
    """--hf-overrides: vLLM's JSON object of config.json keys set over the model's, e.g. '{"max_position_embeddings": 4096}'."""
    value = _json(text, '{"max_position_embeddings": 4096}')
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; give one such as "
                                         "'{\"max_position_embeddings\": 4096}'")
    return value


def structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config: vLLM's JSON object, e.g. '{"enable_in_reasoning": true}', checked while parsing."""
    from tandem.config import parse_structured_outputs_config
    from tandem.errors import ConfigError

    value = _json(text, '{"enable_in_reasoning": true}')
    _checked(lambda v: parse_structured_outputs_config(v, None), value, ConfigError)
    return value


def structured_outputs(text: str):
    """--structured-outputs: StructuredOutputsParams' fields as a JSON object, such as
    '{"regex": "[0-9]+"}', checked while parsing (the grammar compiles when the request is added)."""
    from tandem.errors import RequestError
    from tandem.sampling_params import StructuredOutputsParams

    value = _json(text, '{"regex": "[0-9]+"}')
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of StructuredOutputsParams' fields, such as "
                                         "'{\"json\": {\"type\": \"object\"}}'")
    return _checked(StructuredOutputsParams.from_dict, value, RequestError)


def speculative_config(text: str) -> dict:
    """--speculative-config: vLLM's JSON object, e.g. '{"model": "PATH", "num_speculative_tokens": 4}'
    (its keys are checked when the engine is built, against the target)."""
    value = _json(text, '{"model": "PATH", "num_speculative_tokens": 4}')
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of speculative_config's keys, such as "
                                         "'{\"model\": \"PATH\", \"num_speculative_tokens\": 4}'")
    return value


SPEC_CONFIG_HELP = ("the draft as vLLM's JSON speculative_config, e.g. '{\"model\": \"PATH\", "
                    "\"num_speculative_tokens\": 4}' (every key of LLM's speculative_config; instead of --draft "
                    "and its flags)")


def draft_flag_conflicts(args, draft_only: list[tuple[str, object]]) -> None:
    """--speculative-config names the draft and its settings: --draft and the draft flags may not
    give them a second time."""
    from tandem.errors import ConfigError

    if args.speculative_config is None:
        return
    for flag, value in [("--draft", args.draft)] + draft_only:
        if value is not None:
            raise ConfigError(f"{flag} conflicts with --speculative-config, which sets the draft and its settings; "
                              f"put it in the JSON object or drop {flag.split()[0]}")


KV_CACHE_DTYPE_HELP = ("the KV cache's dtype: auto (the model's) or fp8 (float8 e4m3, saturated, no scale: half the memory a "
                        "token takes, as vLLM's fp8 cache without calibrated scales; on a GPU needs compute capability 8.9+)")
DOWNLOAD_DIR_HELP = ("where models named by a known name, a .gguf file or a hub id are fetched and converted "
                     "(vLLM's flag; default: $TANDEM_CACHE, else ~/.cache/tandem; a hub id: the Hugging Face cache)")
BATCH_INVARIANT_HELP = ("a token's logits get the same bits whatever step computes it (alone or batched, decoded, "
                        "verified or prefilled): speculative greedy output equals target-only greedy output on a GPU "
                        "in bf16 too (vLLM's VLLM_BATCH_INVARIANT=1); bf16 / fp16, one rank; slower on a GPU")
QUANTIZATION_HELP = ("fp8: the target's linear layers rounded to float8 e4m3 on load, one power-of-two scale per "
                     "output row, its LM head kept (vLLM's online fp8, weight-only here): on a GPU half the weight "
                     "memory and traffic; needs compute capability 8.9+")
REJECTION_HELP = ("how sampled requests verify the drafts: one at a time (standard, default) or as a block "
                  "(Sun et al. 2024: more drafts accepted with probabilistic drafts, the same output distribution; "
                  "greedy drafts keep the standard, coupled test, which no block test beats)")
DRAFT_VOCAB_HELP = ("the draft scores only this many of the most frequent token ids (its LM head pruned to them; "
                    "by --draft-token-map's order, else by id); the output stays the target's")
DRAFT_TOKEN_MAP_HELP = ("a .json or .pt file of token ids, most frequent first (`tandem token-map` writes one): "
                        "the ids the draft scores (cut to --draft-vocab-size when given)")
WATERMARK_HELP = ("draw sampled tokens with a secret key, as JSON: '{\"key\": 42, \"context_width\": 4}' "
                  "(vLLM's --watermark-config; `tandem detect` tests text for it)")


def speculative_config_from_flags(args, draft: str | None, default_k: int) -> dict | None:
    """`generate`'s and `serve`'s speculative_config: --speculative-config as given, else one for
    draft (a model, or a lookup's name) from the draft flags; --load-format applies to a draft model
    too, and to nothing a lookup holds."""
    if args.speculative_config is None and draft is None:
        return None  # before importing tandem.spec: the engine without it still runs
    from tandem.spec.config import with_draft_load_format

    if args.speculative_config is not None:
        return with_draft_load_format(args.speculative_config, args.load_format)
    k = default_k if args.num_speculative_tokens is None else args.num_speculative_tokens
    spec = dict(model=draft, num_speculative_tokens=k, draft_sample_method=args.draft_sample_method or "greedy",
                quantization=args.draft_quantization, draft_vocab_size=args.draft_vocab_size,
                draft_token_map=args.draft_token_map,
                rejection_sample_method=args.rejection_sample_method or "standard")
    if args.adaptive:
        spec["num_speculative_tokens_per_batch_size"] = "auto"
    return with_draft_load_format(spec, args.load_format)
