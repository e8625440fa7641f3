"""SpeculativeConfig: the proposer (a draft model, n-gram lookup in the context, or suffix lookup in
the context and in earlier responses) and how its proposals are drawn and verified."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from tandem.config import check_dtype_name
from tandem.errors import ConfigError
from tandem.layers.quant import QUANTIZATIONS
from tandem.sampling_params import MAX_SEED

METHODS = ("draft_model", "ngram", "suffix")
LOOKUPS = ("ngram", "suffix")  # the methods without a draft model
# vLLM's other names for n-gram lookup (its "ngram_gpu" runs it on the device, as tandem's does)
NGRAM_ALIASES = ("ngram", "[ngram]", "ngram_gpu")
SUFFIX_ALIASES = ("suffix", "[suffix]")  # model="suffix": --draft suffix on the command line
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
PROMPT_LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
               "suffix_decoding_max_cached_requests", "suffix_decoding_corpus_tokens")
# The lookup holds [batch, 1024, depth] and [batch, corpus] temporaries: bounds that keep them small
MAX_TREE_DEPTH = 256
MAX_CORPUS_TOKENS = 1 << 24
# Keys that configure a draft model, refused with a lookup method when set (their defaults pass)
DRAFT_MODEL_KEYS = ("dtype", "max_model_len", "quantization", "draft_tensor_parallel_size", "draft_vocab_size",
                    "draft_token_map", "draft_confidence_threshold", "use_local_argmax_reduction", "enforce_eager",
                    "seed", "draft_load_format")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# vLLM's speculators that draft from heads trained on the target's hidden states (refused by name; so is
# every "<model>_mtp")
HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "dspark")
_HEADS = "an EAGLE / MTP / DSpark setting, and tandem runs no heads on the target's hidden states; leave it out"
# vLLM's speculative_config keys tandem does not take -> (the values beside those that ask for nothing that pass,
# as tandem.engine.vllm_args' table; why, and what to do instead): a config written out for vLLM loads
VLLM_ONLY_KEYS = {
    "parallel_drafting": ((), "PARD drafts all k tokens in one forward of a draft trained for it, and tandem's "
                              "draft model proposes one token a step; leave it out"),
    "use_heterogeneous_vocab": ((), "tandem maps no tokens between tokenizers, so the draft must use the target's "
                                    "vocabulary; pick a draft of the target's family"),
    "enable_adaptive_verification": ((), "tandem picks how many drafts each step verifies with "
                                         "num_speculative_tokens_per_batch_size='auto' (its acceptance estimator and "
                                         "the measured step costs); pass that instead"),
    "kv_cache_dtype": (("auto",), "the draft's KV cache takes LLM's kv_cache_dtype, as the target's does (they "
                                  "share block ids); set it there"),
    "attention_backend": (("auto",), "tandem picks its attention kernels itself (Triton on a GPU, C or torch on a "
                                     "CPU); leave it out"),
    "moe_backend": ((), "tandem runs dense models only; leave it out"),
    "revision": (("main",), "tandem loads a local folder, a GGUF file or a known name, never a hub revision; leave "
                            "it out"),
    "code_revision": ((), "tandem runs no checkpoint code; leave it out"),
    "draft_load_config": ((), "pass draft_load_format ('auto' or 'dummy') instead"),
    "disable_padded_drafter_batch": ((), _HEADS),
    "disable_eagle_block_drop": ((), _HEADS),
    "index_share_for_mtp_iteration": ((), _HEADS),
}
REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")


def lookup_method(spec: dict) -> str | None:
    """"ngram" or "suffix" when a speculative_config dict asks for a lookup, else None: by vLLM's
    names for them, as method, or as model when the method is left to it (a SpeculativeConfig object
    carries method="draft_model", the field's default)."""
    unset = spec.get("method", "draft_model") in ("draft_model", None)
    for method, aliases in (("ngram", NGRAM_ALIASES), ("suffix", SUFFIX_ALIASES)):
        if spec.get("method") in aliases or (unset and spec.get("model") in aliases):
            return method
    return None


def with_draft_load_format(spec: dict, load_format: str) -> dict:
    """The command line's --load-format for the draft model as well (unless the spec sets its own);
    a lookup has no model to load, and refuses the key."""
    return spec if lookup_method(spec) is not None else {"draft_load_format": load_format, **spec}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Accepted by LLM(speculative_config=...) as this object or a dict with the same keys.

    method "draft_model" (the default) proposes with the draft model `model`; "ngram" (vLLM's
    prompt lookup, tandem/spec/ngram.py) proposes the tokens that followed the earliest earlier
    occurrence of the context's last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min, with no draft model (`model` left out); "suffix" (vLLM's suffix decoding,
    tandem/spec/suffix.py) the most frequent continuation of the longest suffix of the context
    (up to suffix_decoding_max_tree_depth tokens) that occurred before, in the request's own
    tokens or in the responses of finished requests, as many tokens as that continuation stays
    likely (suffix_decoding_min_token_prob) and the match is long (suffix_decoding_max_spec_factor).

    synthetic_acceptance_rates are unconditional: a_i = P(the first i+1 drafts are accepted).
    synthetic_acceptance_length L in [1, k+1] is turned into the least-variance rates
    [1] * floor(L - 1) + [frac(L - 1)] + [0] * ... (so E[tokens per round] = L).
    """

    model: str | None
    num_speculative_tokens: int
    method: str = "draft_model"
    prompt_lookup_max: int | None = None  # method="ngram": the longest n-gram matched (vLLM's key)
    prompt_lookup_min: int | None = None  # method="ngram": the shortest
    # method="suffix" (vLLM's keys and defaults, and its Model Runner V2's corpus size):
    suffix_decoding_max_tree_depth: int = 24  # the longest suffix matched
    suffix_decoding_max_spec_factor: float = 1.0  # at most this many drafts per matched token (at least 1)
    suffix_decoding_min_token_prob: float = 0.1  # a draft's least share among the match's continuations
    suffix_decoding_max_cached_requests: int = 10000  # finished responses kept (0: the request's own tokens only)
    suffix_decoding_corpus_tokens: int = 1 << 16  # the tokens those responses may take (oldest first out)
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    dtype: Any = "auto"
    max_model_len: int | None = None
    draft_load_format: str = "auto"
    seed: int = 0
    quantization: str | None = None  # "fp8": the draft's linears in weight-only e4m3 (tandem/layers/quant.py)
    # Dynamic speculation (vLLM's key): ranges [start, end, K] of batch sizes (requests running or
    # waiting, at most max_num_seqs) that draft K <= k tokens instead of k; K = 0 turns the draft
    # off (it catches up on the skipped tokens when drafting resumes). Other sizes draft k.
    # "auto": every step picks K in 0..k from the measured acceptance and step costs (spec/adaptive.py).
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | str | None = None
    # The draft's tensor parallelism: None (the target's tensor_parallel_size, as vLLM) or 1 (the
    # whole draft on every rank, drafting the same tokens: no collective in the draft loop).
    draft_tensor_parallel_size: int | None = None
    # A pruned draft head (FR-Spec; SGLang's speculative_token_map): the draft scores only these
    # token ids (tandem/spec/hot_vocab.py), so each draft step reads a fraction of its LM head.
    # draft_vocab_size N: the N most frequent ids, by draft_token_map when given, else by id (BPE
    # ids follow merge order, a frequency ranking); draft_token_map: a .json or .pt file of ids,
    # most frequent first. Special tokens (EOS among them) are always kept. Lossless either way.
    draft_vocab_size: int | None = None
    draft_token_map: str | None = None
    # vLLM's per-draft override of enforce_eager: True runs the draft without CUDA graphs (the
    # target keeps its own); None: the target's setting.
    enforce_eager: bool | None = None
    # vLLM's use_local_argmax_reduction: under tensor parallelism a sharded draft's greedy drafts come
    # from each rank's best (logit, id), 2 numbers a row per rank, not its V / tp logits. Same drafts.
    # None (tandem's default): wherever it applies; False: the logits gathered instead (A/B); True: as
    # None, and refused with probabilistic drafts (as vLLM refuses it).
    use_local_argmax_reduction: bool | None = None
    # vLLM's confidence-based early stop (tau): a request's chain of drafts ends at its first draft
    # whose top-1 probability under the draft model is below tau (the drafts before it verified; the
    # first draft always), and a round stops drafting once every chain has ended. The stop
    # reads only the draft's distributions, so the output keeps the target's. CPU only (on a GPU
    # the readback after each draft step would stall the draft graphs; vLLM allows it on SM121).
    draft_confidence_threshold: float | None = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def ngram(self) -> bool:
        """Proposals by n-gram lookup in the context (no draft model)."""
        return self.method == "ngram"

    @property
    def lookup(self) -> bool:
        """Proposals looked up in tokens seen before (n-gram or suffix), no draft model."""
        return self.method in LOOKUPS

    @property
    def verify_counts(self) -> tuple[int, ...]:
        """The numbers of drafts a uniform verification step may carry (each gets its CUDA graphs):
        a draft model's rounds propose draft_counts; a lookup proposes what it finds, 1..k."""
        if self.lookup:
            return tuple(range(1, self.k + 1))
        return tuple(d for d in self.draft_counts if d > 0)

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @property
    def adaptive(self) -> bool:
        """num_speculative_tokens_per_batch_size="auto": the engine picks each step's drafts."""
        return self.num_speculative_tokens_per_batch_size == "auto"

    def plans_ahead(self, max_num_seqs: int) -> bool:
        """Some steps can be planned before the previous result is known (async scheduling) with the
        synchronous engine's output: a lookup's while it finds nothing, a draft model's at batch sizes
        (up to max_num_seqs: a range past it never applies) that draft nothing. Not "auto" with
        probabilistic drafts: its K follows the result being collected (the estimate, a probe falling
        due), and whether a step drafts decides its seeded draws."""
        if self.lookup:
            return True
        if self.adaptive:
            return self.draft_sample_method != "probabilistic"
        return any(K == 0 and start <= max_num_seqs for start, _, K in self._ranges())

    def unreachable_ranges(self, max_num_seqs: int) -> list[tuple[int, int, int]]:
        """The [start, end, K] ranges no batch reaches: they start past max_num_seqs."""
        return [r for r in self._ranges() if r[0] > max_num_seqs]

    def _ranges(self) -> tuple[tuple[int, int, int], ...]:
        return () if self.adaptive else self.num_speculative_tokens_per_batch_size or ()

    def k_for_batch(self, num_reqs: int) -> int:
        """The drafts per request at a batch of num_reqs (num_speculative_tokens_per_batch_size;
        k when adaptive, whose choice is the engine's: tandem.spec.adaptive)."""
        for start, end, k in self._ranges():
            if start <= num_reqs <= end:
                return k
        return self.k

    @property
    def draft_counts(self) -> tuple[int, ...]:
        """Every number of drafts a step may propose (k and the schedule's; 0..k when adaptive), ascending."""
        if self.adaptive:
            return tuple(range(self.k + 1))
        return tuple(sorted({self.k, *(k for _, _, k in self._ranges())}))

    @classmethod
    def from_user(cls, spec: Any, target_max_model_len: int) -> "SpeculativeConfig":
        if isinstance(spec, cls):
            spec = dataclasses.asdict(spec)
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative_config must be a dict or SpeculativeConfig, got {type(spec).__name__}")
        # numpy or torch values (an array of ranges, an np.int64 k) as the Python values they hold
        spec = {key: value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes)) else value
                for key, value in spec.items()}
        if "method" in spec and spec["method"] is None:  # vLLM's "detect": a separate draft model here
            del spec["method"]
        spec = _without_vllm_defaults(spec)
        if "draft_confidence_fallback_depth" in spec:
            raise ConfigError("speculative_config.draft_confidence_fallback_depth is not needed: tandem ends each "
                              "request's chain of drafts on its own, in a batch of any size, so no round falls back "
                              "to a fixed depth; leave it out")
        if "tensor_parallel_size" in spec:  # vLLM's trap for the same mistake
            raise ConfigError("speculative_config.tensor_parallel_size is not a draft setting; pass "
                              "draft_tensor_parallel_size instead (1: the whole draft on every rank, or the target's "
                              "tensor_parallel_size)")
        lookup = lookup_method(spec)
        if lookup is not None:
            return cls._lookup_from_user(spec, lookup, target_max_model_len)
        if spec.get("method", "draft_model") not in METHODS:  # before the keys a draft model needs
            _one_of("method", spec["method"], METHODS)
        for key in PROMPT_LOOKUP_KEYS:
            if spec.get(key) is not None:
                raise ConfigError(f"speculative_config.{key} sets n-gram lookup, which method='draft_model' does not "
                                  "use: pass method='ngram' (no draft model), or leave it out")
        _refuse_set(spec, SUFFIX_KEYS, "sets suffix decoding, which method='draft_model' does not use: pass "
                                       "method='suffix' (no draft model), or leave it out")
        tp = spec.get("draft_tensor_parallel_size")
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ConfigError(f"speculative_config.draft_tensor_parallel_size={tp!r} must be a positive integer "
                              "(1, or the target's tensor_parallel_size), or None for the target's")
        cls._refuse_unknown(spec)  # first: a misspelt key is named as such, not as a missing one
        if "num_speculative_tokens" not in spec:
            raise ConfigError("speculative_config.num_speculative_tokens is required (the number of drafts k)")
        if not spec.get("model"):
            raise ConfigError("speculative_config.model is required: the draft model's path or name")
        rates = spec.get("synthetic_acceptance_rates")
        if rates is not None:
            if isinstance(rates, (str, bytes, dict, set, frozenset)) or not hasattr(rates, "__iter__"):
                raise ConfigError("speculative_config.synthetic_acceptance_rates must be a list of floats")
            spec["synthetic_acceptance_rates"] = tuple(rates)
        ranges = spec.get("num_speculative_tokens_per_batch_size")
        if ranges is not None and ranges != "auto":
            spec["num_speculative_tokens_per_batch_size"] = _batch_ranges(ranges)
        cfg = cls(**spec)
        cfg._validate(target_max_model_len)
        if cfg.synthetic_acceptance_length is not None:
            cfg = dataclasses.replace(
                cfg,
                synthetic_acceptance_rates=length_to_rates(cfg.synthetic_acceptance_length, cfg.k),
                synthetic_acceptance_length=None,
            )
        return cfg

    @classmethod
    def _refuse_unknown(cls, spec: dict) -> None:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known, key=repr)  # (repr: keys of any type, from Python callers)
        if unknown:
            raise ConfigError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}")

    @classmethod
    def _lookup_from_user(cls, spec: dict, method: str, target_max_model_len: int) -> "SpeculativeConfig":
        """A lookup without a draft model: method="ngram" (or vLLM's "[ngram]" / "ngram_gpu", or
        model="[ngram]") or method="suffix"; the draft model's keys are refused, and the other
        lookup's."""
        model = spec.pop("model", None)
        if model is not None and model not in (NGRAM_ALIASES if method == "ngram" else SUFFIX_ALIASES):
            raise ConfigError(f"speculative_config.model={model!r} is not used by method={method!r}, which proposes "
                              "from tokens seen before; leave model out (or pass method='draft_model' to draft with it)")
        spec["method"] = method
        cls._refuse_unknown(spec)
        if "num_speculative_tokens" not in spec:
            why = "; vLLM's default for suffix lookup, the tree depth (24), would have a GPU capture verification " \
                  "graphs for each of 1..24 drafts, so tandem asks (its benchmarks use 4 and 8)" if method == "suffix" else ""
            raise ConfigError(f"speculative_config.num_speculative_tokens is required (the most tokens a lookup "
                              f"proposes){why}")
        for key in DRAFT_MODEL_KEYS:
            field = cls.__dataclass_fields__[key]
            if key in spec and spec[key] != field.default:
                raise ConfigError(f"speculative_config.{key}={spec[key]!r} configures a draft model, and "
                                  f"method={method!r} has none; leave it out")
        if spec.get("draft_sample_method", "greedy") != "greedy":
            raise ConfigError(f"speculative_config.draft_sample_method={spec['draft_sample_method']!r}: a lookup "
                              "has no draft distribution to sample; its drafts are verified as greedy ones (use "
                              "'greedy' or leave it out)")
        if spec.get("rejection_sample_method") not in (None, "standard", "block", "synthetic"):
            _one_of("rejection_sample_method", spec["rejection_sample_method"], ("standard", "block"))
        for key in ("rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length"):
            if spec.get(key) not in (None, "standard", "block"):
                raise ConfigError(f"speculative_config.{key}={spec[key]!r}: synthetic acceptance measures a draft "
                                  f"model's costs at set acceptance rates; with method={method!r} leave it out")
        if spec.get("num_speculative_tokens_per_batch_size") == "auto":
            raise ConfigError("speculative_config.num_speculative_tokens_per_batch_size='auto' prices a draft model's "
                              f"steps, and method={method!r} has none; give [start, end, K] ranges or leave it out")
        if method == "ngram":
            _refuse_set(spec, SUFFIX_KEYS, "sets suffix decoding: pass method='suffix' instead of 'ngram', or leave "
                                           "it out")
            cls._prompt_lookup(spec)
        else:
            for key in PROMPT_LOOKUP_KEYS:
                if spec.get(key) is not None:
                    raise ConfigError(f"speculative_config.{key} sets n-gram lookup: method='suffix' matches the "
                                      "longest suffix up to suffix_decoding_max_tree_depth instead; leave it out")
            _suffix_keys(spec)
        ranges = spec.get("num_speculative_tokens_per_batch_size")
        if ranges is not None:
            spec["num_speculative_tokens_per_batch_size"] = _batch_ranges(ranges)
        cfg = cls(model=None, **spec)
        cfg._validate(target_max_model_len)
        return cfg

    @staticmethod
    def _prompt_lookup(spec: dict) -> None:
        """prompt_lookup_min / _max checked, and their defaults (vLLM's: 5 and 5; one given sets the other)."""
        for key in PROMPT_LOOKUP_KEYS:
            n = spec.get(key)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ConfigError(f"speculative_config.{key}={n!r} must be an integer >= 1 (an n-gram's length)")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ConfigError(f"speculative_config.prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}; the lookup "
                              "tries n from prompt_lookup_max down to prompt_lookup_min")
        spec["prompt_lookup_min"], spec["prompt_lookup_max"] = lo, hi

    def _validate(self, target_max_model_len: int) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
        if k >= target_max_model_len:
            raise ConfigError(f"speculative_config.num_speculative_tokens={k} must be below max_model_len="
                              f"{target_max_model_len}: a request's context holds its drafts while they are verified")
        _one_of("method", self.method, METHODS)
        _one_of("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _one_of("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        _one_of("draft_load_format", self.draft_load_format, ("auto", "dummy"))
        _one_of("quantization", self.quantization, (None,) + QUANTIZATIONS)
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if (rates is not None or length is not None) and not self.synthetic:
            raise ConfigError(
                "speculative_config.synthetic_acceptance_rates / synthetic_acceptance_length need "
                "rejection_sample_method='synthetic'"
            )
        if self.synthetic and (rates is None) == (length is None):
            raise ConfigError(
                "rejection_sample_method='synthetic' needs exactly one of synthetic_acceptance_rates "
                "or synthetic_acceptance_length"
            )
        if rates is not None:
            if len(rates) != k:
                raise ConfigError(
                    f"speculative_config.synthetic_acceptance_rates has {len(rates)} entries; it needs k={k}"
                )
            if any(not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1 for r in rates):
                raise ConfigError(f"speculative_config.synthetic_acceptance_rates={list(rates)} must lie in [0, 1]")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ConfigError(
                    f"speculative_config.synthetic_acceptance_rates={list(rates)} must be non-increasing "
                    "(they are unconditional: P(first i+1 drafts accepted))"
                )
        self._validate_batch_ranges()
        for name in ("enforce_eager", "use_local_argmax_reduction"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"speculative_config.{name}={getattr(self, name)!r} must be true, false or None")
        if self.use_local_argmax_reduction and self.draft_sample_method != "greedy":
            raise ConfigError("speculative_config.use_local_argmax_reduction=True needs draft_sample_method='greedy': "
                              "probabilistic drafts are drawn from the whole distribution, which no rank's best token "
                              "gives; drop one of them")
        tau = self.draft_confidence_threshold
        if tau is not None and (not isinstance(tau, (int, float)) or isinstance(tau, bool) or not 0 < tau < 1):
            raise ConfigError(f"speculative_config.draft_confidence_threshold={tau!r} must be a number in (0, 1): "
                              "the draft's top-1 probability below which a request stops drafting")
        if self.lookup:
            if self.model is not None:
                raise ConfigError(f"speculative_config.model is not used by method={self.method!r}; leave it out")
        elif not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"speculative_config.model={self.model!r} must be a path or a model name")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"speculative_config.seed={self.seed!r} must be an integer in [0, {MAX_SEED}]")
        check_dtype_name(self.dtype, "speculative_config.dtype")
        if length is not None and (not isinstance(length, (int, float)) or isinstance(length, bool)
                                   or not 1 <= length <= k + 1):
            raise ConfigError(f"speculative_config.synthetic_acceptance_length={length!r} must be in [1, k+1={k + 1}]")
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ConfigError(f"speculative_config.draft_vocab_size={size!r} must be a positive integer (the number "
                              "of most frequent token ids the draft scores), or None for its whole vocabulary")
        if self.draft_token_map is not None:
            if not isinstance(self.draft_token_map, (str, os.PathLike)):
                raise ConfigError(f"speculative_config.draft_token_map={self.draft_token_map!r} must be the path of a "
                                  ".json or .pt file of token ids")
            from tandem.spec.hot_vocab import read_token_map

            read_token_map(self.draft_token_map)  # a bad file is refused before any model loads
        mml = self.max_model_len
        if mml is not None:
            if not isinstance(mml, int) or isinstance(mml, bool) or mml < 1:
                raise ConfigError(f"speculative_config.max_model_len={mml!r} must be a positive integer")
            if mml > target_max_model_len:
                raise ConfigError(
                    f"speculative_config.max_model_len={mml} exceeds the target's max_model_len="
                    f"{target_max_model_len}; use at most {target_max_model_len}"
                )

    def _validate_batch_ranges(self) -> None:
        name = "speculative_config.num_speculative_tokens_per_batch_size"
        ranges = sorted(self._ranges())
        for start, end, k in ranges:
            if not 1 <= start <= end:
                raise ConfigError(f"{name}: the range [{start}, {end}, {k}] needs 1 <= start <= end (batch sizes)")
            if not 0 <= k <= self.k:
                raise ConfigError(f"{name}: the range [{start}, {end}, {k}] drafts {k} tokens; use 0 .. "
                                  f"num_speculative_tokens={self.k} (0 turns drafting off)")
        for (s0, e0, _), (s1, e1, _) in zip(ranges, ranges[1:]):
            if s1 <= e0:
                raise ConfigError(f"{name}: the ranges [{s0}, {e0}] and [{s1}, {e1}] overlap; give each batch "
                                  "size at most one range")

    def conditional_rates(self) -> list[float]:
        """c_i = a_i / a_{i-1} (a_{-1} = 1; 0 after a zero): P(accept draft i | drafts < i accepted)."""
        out, prev = [], 1.0
        for a in self.synthetic_acceptance_rates or ():
            out.append(a / prev if prev > 0 else 0.0)
            prev = a
        return out


def _batch_ranges(ranges) -> tuple[tuple[int, int, int], ...]:
    """[[start, end, K], ...] (lists or tuples of three integers) -> a tuple of int triples."""
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if isinstance(ranges, (str, bytes, dict)) or not hasattr(ranges, "__iter__"):
        raise ConfigError(f"{name}={ranges!r}: use a list of [start_batch_size, end_batch_size, num_drafts] "
                          "ranges, or \"auto\" (each step's drafts chosen from the measured acceptance and step costs)")
    out = []
    for r in ranges:
        if isinstance(r, (str, bytes, dict)) or not hasattr(r, "__iter__") or len(r := tuple(r)) != 3 \
                or any(not isinstance(v, int) or isinstance(v, bool) for v in r):
            raise ConfigError(f"{name}: {r!r} is not a [start_batch_size, end_batch_size, num_drafts] "
                              "triple of integers")
        out.append(r)
    return tuple(out)


def length_to_rates(length: float, k: int) -> tuple[float, ...]:
    full = math.floor(length - 1)
    frac = (length - 1) - full
    rates = [1.0] * full + ([frac] if full < k else [])
    return tuple((rates + [0.0] * k)[:k])


def _refuse_set(spec: dict, keys, why: str) -> None:
    """ConfigError naming the first of keys that spec sets to other than its default."""
    for key in keys:
        if key in spec and spec[key] != SpeculativeConfig.__dataclass_fields__[key].default:
            raise ConfigError(f"speculative_config.{key}={spec[key]!r} {why}")


def _suffix_keys(spec: dict) -> None:
    """method="suffix": each suffix_decoding_* key in its range."""
    def bad(key: str, rule: str) -> ConfigError:
        return ConfigError(f"speculative_config.{key}={spec[key]!r} must be {rule}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    checks = {
        "suffix_decoding_max_tree_depth": (lambda v: is_int(v) and 1 <= v <= MAX_TREE_DEPTH,
                                           f"an integer in [1, {MAX_TREE_DEPTH}] (tokens matched)"),
        "suffix_decoding_max_spec_factor": (lambda v: is_num(v) and v > 0, "a number > 0 (drafts per matched token)"),
        "suffix_decoding_min_token_prob": (lambda v: is_num(v) and 0 <= v <= 1, "a probability in [0, 1]"),
        "suffix_decoding_max_cached_requests": (lambda v: is_int(v) and v >= 0,
                                                "an integer >= 0 (0: no responses kept, the request's own tokens only)"),
        "suffix_decoding_corpus_tokens": (lambda v: is_int(v) and 2 <= v <= MAX_CORPUS_TOKENS,
                                          f"an integer in [2, {MAX_CORPUS_TOKENS}] (the responses' tokens kept)"),
    }
    for key, (ok, rule) in checks.items():
        if key in spec and not ok(spec[key]):
            raise bad(key, rule)


def _without_vllm_defaults(spec: dict) -> dict:
    """spec less the vLLM-only keys (VLLM_ONLY_KEYS, dspark_*) left at values that ask for nothing;
    one set to anything else, or a method of vLLM's trained heads, is refused saying why."""
    from tandem.engine.vllm_args import check_vllm_only

    method = spec.get("method")
    if method in HEAD_METHODS or (isinstance(method, str) and method.endswith("_mtp")):
        raise ConfigError(f"speculative_config.method={spec['method']!r} drafts with heads trained on the target's "
                          "hidden states, which tandem does not run; use 'draft_model' (a small model with the "
                          "target's vocabulary, given as model), 'ngram' or 'suffix'")
    table = {**VLLM_ONLY_KEYS, **{key: ((), _HEADS) for key in spec if str(key).startswith("dspark_")}}
    return check_vllm_only(spec, table, prefix="speculative_config.", then="")


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"speculative_config.{name}={value!r} is not supported; use one of {list(allowed)}")
