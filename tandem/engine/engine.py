"""Engine: builds the model, KV pool, runner and scheduler in order, and runs the step loop.

step() is the three hops: scheduler.schedule -> runner.execute -> scheduler.update, then the
emitted tokens are detokenized, stop strings applied and RequestOutputs produced. execute is
launch + collect; with async scheduling, when the next step does not depend on the current
one's result (steady decoding), step() plans and launches it before collecting the current one,
so the host's work for a step overlaps the device's work for the next. With a structured-output
request running, only that step's forward is launched ahead: its sampling waits until the
current step's tokens have advanced the grammars and given its masks; its drafts follow its
grammar too (grammar_drafting: masked in the round, or a free round's misfits drawn again).
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import operator
import random
import time
from dataclasses import dataclass, field

import torch

from tandem.config import EngineConfig
from tandem.engine.build import build_runner, capture_graphs, rehearse, scratch_cache
from tandem.engine.detokenizer import Detokenizer, DetokState, StopStrings
from tandem.engine.grammar import Grammars
from tandem.engine.heap import freeze_startup_heap
from tandem.errors import ContextLengthError, RequestError, StepError
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.plan import StepPlan, StepResult, TokenLogprobs
from tandem.prompts import add_special_tokens
from tandem.prompts import prompt_token_ids as prompt_token_ids_of
from tandem.reasoning import reasoning_format
from tandem.oom import OutOfMemoryGuard, release_failed_step
from tandem.runner.memory import after_pool_bytes, budget_setting, bytes_per_block, num_kv_blocks
from tandem.runner.model_runner import Forwarded, Launched
from tandem.sampling_params import MAX_SEED, RequestOutputKind, SamplingParams
from tandem.scheduler.request import Request, Status
from tandem.scheduler.scheduler import Scheduler

logger = logging.getLogger("tandem")


@dataclass
class SeqState:
    """One output sequence of a request (n > 1 gives several)."""

    request_id: str
    req: Request
    index: int
    detok: DetokState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, token 1's, ...] as they arrive
    # What the request's outputs have shown: tokens, characters of text, and its finish (DELTA's offsets).
    num_shown_tokens: int = 0
    num_shown_chars: int = 0
    shown_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    metrics: RequestMetrics
    shown_prompt_logprobs: bool = False  # an output carried them (DELTA sends them once)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, kept cheap: asked of every running request every step
            return seqs[0].finish_reason is not None
        return all(s.finish_reason is not None for s in seqs)


def _count(m: RequestMetrics, seqs: list[SeqState], reqs: list[Request]) -> None:
    """A request's counts so far into m, summed over its sequences (every output carries them)."""
    if len(reqs) == 1:  # the common case, kept cheap: it runs for every running request every step
        r = reqs[0]
        m.num_generation_tokens = len(seqs[0].token_ids)
        m.num_cached_tokens, m.num_preemptions = r.num_cached_tokens, r.num_preemptions
        m.num_draft_rounds, m.num_draft_tokens = r.num_draft_rounds, r.num_draft_tokens
        m.num_accepted_tokens = r.num_accepted_tokens
        m.accepted_per_position = list(r.accepted_per_position)
        return
    m.num_generation_tokens = sum(len(s.token_ids) for s in seqs)
    m.num_cached_tokens = max(r.num_cached_tokens for r in reqs)
    m.num_preemptions = sum(r.num_preemptions for r in reqs)
    m.num_draft_rounds = sum(r.num_draft_rounds for r in reqs)
    m.num_draft_tokens = sum(r.num_draft_tokens for r in reqs)
    m.num_accepted_tokens = sum(r.num_accepted_tokens for r in reqs)
    width = max(len(r.accepted_per_position) for r in reqs)
    m.accepted_per_position = [
        sum(r.accepted_per_position[i] for r in reqs if i < len(r.accepted_per_position)) for i in range(width)
    ]


def _is_fatal(e: BaseException) -> bool:
    """A device error after which the CUDA context cannot run anything (an illegal memory access,
    a device-side assert): every later step would fail too. Out of memory is not one."""
    device_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
    return isinstance(e, device_error) and not isinstance(e, torch.OutOfMemoryError)


class Engine:
    """Continuous-batching engine over one target model (and, optionally, a draft model)."""

    def __init__(self, cfg: EngineConfig, model, tokenizer, eos_token_ids: tuple[int, ...], speculator_factory=None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # The model's EOS set grows with generation_config.json and the tokenizer's (models.source):
        # the sampler's min_tokens mask must hold back the same ids the stop check ends on.
        arch = dataclasses.replace(cfg.model.arch, eos_token_ids=tuple(eos_token_ids))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch=arch))
        draft_bytes = speculator_factory.kv_bytes_per_block(cfg.cache) if speculator_factory else 0
        draft_model = speculator_factory.model if speculator_factory is not None else None
        k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
        use_graphs = cfg.use_cuda_graphs
        # One side stream for every graph's warm-up and capture, the rehearsal's too (graphs.capture_on)
        self._capture_stream = torch.cuda.Stream(cfg.device) if use_graphs else None

        def after_pool() -> int:  # what the runner, speculator and graphs take, built once over a scratch pool
            with OutOfMemoryGuard(cfg.device, f"measuring the buffers and CUDA graphs of max_num_seqs={cfg.sched.max_num_seqs}",
                                  "lower max_num_seqs, max_num_batched_tokens or max_cudagraph_tokens, "
                                  "or pass enforce_eager=True"):
                t0 = time.monotonic()
                taken = after_pool_bytes(cfg.device, lambda: rehearse(cfg, model, speculator_factory, self._capture_stream),
                                         bytes_per_block(cfg, draft_bytes) * scratch_cache(cfg).num_blocks)
            logger.info("buffers, CUDA graphs and sampling take %.2f GiB (measured in %.1f s over a scratch KV cache)",
                        taken / 2**30, time.monotonic() - t0)
            return taken

        # after_pool_estimate: bytes the budget set aside for what follows the KV pool (GPU; else 0)
        num_blocks, self.after_pool_estimate = num_kv_blocks(cfg, model, draft_bytes, draft_model, after_pool)
        self.tensor_parallel = getattr(model, "tp", None) is not None
        if self.tensor_parallel:  # every rank's scheduler must see the same pool: the smallest any rank holds
            num_blocks = model.tp.min_int(num_blocks)
        cache = dataclasses.replace(cfg.cache, num_blocks=num_blocks)
        self.cfg = dataclasses.replace(cfg, cache=cache)
        kv_bytes = num_blocks * bytes_per_block(cfg, draft_bytes)
        self._budget_setting = budget_setting(cfg)  # the setting that sized the KV pool (for errors)
        with OutOfMemoryGuard(cfg.device, f"allocating the KV cache ({num_blocks} blocks, {kv_bytes / 2**30:.1f} GiB) "
                              f"and the per-request state of max_num_seqs={cfg.sched.max_num_seqs}",
                              f"lower {self._budget_setting} or max_num_seqs"):
            self.runner = build_runner(self.cfg, cache, model, speculator_factory)
        self.spec_metrics = None
        if speculator_factory is not None:
            from tandem.spec.metrics import SpecMetrics

            self.spec_metrics = SpecMetrics(k)
        self.log_interval_s = 10.0  # the speculative decoding log line's (math.inf: none; serve's --disable-log-stats)
        self._last_log = time.monotonic()
        self.graph_memory_bytes = 0  # device memory capturing the CUDA graphs took
        if use_graphs:
            with OutOfMemoryGuard(cfg.device, f"capturing CUDA graphs (batches up to max_num_seqs={cfg.sched.max_num_seqs})",
                                  f"lower max_num_seqs, max_cudagraph_tokens or {self._budget_setting}, "
                                  "or pass enforce_eager=True"):
                torch.cuda.empty_cache()  # so that what capture takes shows in the device's free memory
                free_before, t0 = torch.cuda.mem_get_info(cfg.device)[0], time.monotonic()
                self.capture_graphs()
                self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(cfg.device)[0]
            logger.info("captured CUDA graphs in %.1f s: %.2f GiB", time.monotonic() - t0, self.graph_memory_bytes / 2**30)
        k_for_batch = cfg.spec.k_for_batch if cfg.spec is not None else None
        self.adaptive = None  # the per-step choice of drafts under num_speculative_tokens_per_batch_size="auto"
        if cfg.spec is not None and cfg.spec.adaptive:
            from tandem.spec.adaptive import AdaptiveDrafts
            from tandem.spec.step_costs import profile_step_costs

            k_for_batch = self.adaptive = AdaptiveDrafts(k, profile_step_costs(self.runner, self.cfg))
        self.scheduler = Scheduler(cfg.sched, cache, num_speculative_tokens=k, k_for_batch=k_for_batch,
                                   record_spec_steps=cfg.per_request_spec_decode_metrics == "detailed",
                                   draft_kv=cfg.spec is None or not cfg.spec.lookup,
                                   sampled_drafts=cfg.spec is not None and cfg.spec.draft_sample_method == "probabilistic")
        self.async_scheduling = cfg.sched.async_scheduling and (cfg.spec is None
                                                                or cfg.spec.plans_ahead(cfg.sched.max_num_seqs))
        if self.async_scheduling:
            self.runner.enable_pending_inputs()
        self._inflight: tuple[StepPlan, Launched, float] | None = None  # launched, not collected
        self.detokenizer = Detokenizer(tokenizer)
        # token id -> its text alone, as logprobs name it (a decode is ~7 us of Python: logprobs=-1 made 150k
        # of them a step, prompt_logprobs a prompt's length times as many, for the whole batch to wait on)
        self._token_text: dict[int, str] = {}
        self.vocab_size = self.runner.vocab_size
        # structured outputs' matchers (after the thinking, with a reasoning parser, unless they hold in it too)
        gate = None if cfg.structured_outputs_in_reasoning else reasoning_format(cfg.reasoning_parser)
        self.grammars = Grammars(tokenizer, self.vocab_size, eos_token_ids, gate)
        # Grammar-aware drafting: structured-output requests draft under their grammar. "round": each
        # draft step is masked before it is drawn (a wait a step: on a CPU, where a host round trip
        # is free and a draft step is not); "repair": the round runs free (on a GPU, as one graph),
        # and only drafts that leave the grammar are drawn again under it; "auto" (on a GPU): repair,
        # but mask the rounds of a request whose free rounds often leave its grammar
        # (Grammars.prefers_masking). The drafts are the same every way. None: drafts free of the
        # grammar, as vLLM's (for A/B measurements of greedy drafts only: the ratio test of sampled
        # drafts takes them to be grammar-aware).
        self.grammar_drafting = "auto" if cfg.device.type == "cuda" else "round"
        if cfg.spec is not None and cfg.spec.lookup:  # a lookup's drafts are tokens seen before, free of the grammar
            self.grammar_drafting = None
        self._rng = random.Random(cfg.model.seed)
        self._warned: set[str] = set()  # the once-per-engine warnings given
        self._requests: dict[str, RequestState] = {}
        self._seq_of: dict[int, SeqState] = {}
        self._next_id = 0
        self._aborted: list[RequestState] = []
        self._dead: str | None = None  # why the engine takes no more work (a fatal step error; stop())
        freeze_startup_heap(self)  # no full collection walks the models and libraries while it serves

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLMEngine.get_tokenizer); None for a model folder without one."""
        return self.tokenizer

    def capture_graphs(self) -> None:
        """Capture (again) the CUDA graphs of uniform decode / verification steps and the draft's."""
        if self._capture_stream is None:
            raise RuntimeError("this engine runs eagerly (enforce_eager=True, or not on CUDA): it has no CUDA graphs")
        capture_graphs(self.runner, self.cfg, self._capture_stream)

    # ---------------------------------------------------------------- requests
    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt the request runs on: its last truncate_prompt_tokens tokens, when asked (-1:
        max_model_len, as vLLM)."""
        k = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
        if k is None:
            return prompt_token_ids
        k = self.cfg.sched.max_model_len if k == -1 else k
        return list(prompt_token_ids)[-k:]

    def truncate_text_prompt(self, text: str, prompt_token_ids: list[int], params: SamplingParams,
                             tokenizer=None) -> list[int]:
        """truncate_prompt for a prompt tokenized from text, with the tokenizer's special tokens:
        cut from the left the way the tokenizer cuts (as vLLM tokenizes), so the special tokens it
        puts around the text (a BOS) stay and count towards the limit. tokenizer: the one that
        encoded it (default: the engine's)."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        k = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
        k = self.cfg.sched.max_model_len if k == -1 else k
        full = list(prompt_token_ids)
        if k is None or len(full) <= k or tokenizer is None:
            return self.truncate_prompt(full, params)
        text_ids = tokenizer(text, add_special_tokens=False).input_ids
        n = len(text_ids)
        head = next((i for i in range(len(full) - n + 1) if full[i:i + n] == text_ids), None)
        num_special = len(full) - n
        if head is None or not num_special or k <= num_special:
            return self.truncate_prompt(full, params)  # nothing around the text, or no room: cut as ids
        return full[:head] + text_ids[n - (k - num_special):] + full[head + n:]

    def resolve_logprobs(self, params: SamplingParams) -> SamplingParams:
        """A copy of params (the request's own: a caller changing its object later changes no
        request, as vLLM's clone) with logprobs / prompt_logprobs of -1 as the whole vocabulary;
        RequestError past max_logprobs or the vocabulary (as vLLM's)."""
        return params.clone(**self._logprobs_changes(params))

    def _logprobs_changes(self, params: SamplingParams) -> dict[str, int]:
        """resolve_logprobs' changes to params, checked (with the truncation, which -1 also resolves
        against the engine)."""
        k, max_len = params.truncate_prompt_tokens, self.cfg.sched.max_model_len
        if k is not None and k > max_len:  # as vLLM's: a cut longer than any prompt that runs is a mistake
            raise RequestError(f"SamplingParams.truncate_prompt_tokens={k} is invalid: it is greater than "
                               f"max_model_len={max_len}; ask for at most {max_len} (-1: max_model_len)")
        cap = self.cfg.model.max_logprobs
        changes = {}
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is None:
                continue
            n = self.vocab_size if n == -1 else n
            if cap != -1 and n > cap:
                raise RequestError(f"SamplingParams.{name}={getattr(params, name)} is invalid: this engine returns at "
                                   f"most max_logprobs={cap} per token; ask for fewer, or raise max_logprobs")
            if n > self.vocab_size:
                raise RequestError(f"SamplingParams.{name}={n} is invalid: the vocabulary has {self.vocab_size} "
                                   "tokens; ask for at most that many (-1: all of them)")
            if n != getattr(params, name):
                changes[name] = n
        return changes

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, compiled: bool = False) -> None:
        """Raise RequestError for a request that cannot be served; changes nothing. compiled: its
        structured output was compiled already (compile_structured), so its grammar is not checked again."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self._logprobs_changes(params)
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params)
        if not prompt_token_ids:
            raise RequestError("prompt is empty: give at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise RequestError(f"SamplingParams.logit_bias has token ids outside [0, {self.vocab_size})")
        if params.allowed_token_ids and any(t >= self.vocab_size for t in params.allowed_token_ids):
            raise RequestError(f"SamplingParams.allowed_token_ids has token ids outside [0, {self.vocab_size})")
        if params.bad_words_token_ids and any(t >= self.vocab_size for w in params.bad_words_token_ids for t in w):
            raise RequestError(f"SamplingParams.bad_words_token_ids has token ids outside [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise RequestError("SamplingParams.bad_words needs a tokenizer, and this model has none; give "
                               "bad_words_token_ids instead")
        if params.structured_outputs is not None:
            self._check_structured(params, prompt_token_ids, compiled)
        max_len = self.cfg.sched.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ContextLengthError(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len={max_len} leaves no room to "
                f"generate; shorten the prompt or raise max_model_len"
            )

    def _check_watermark(self, params: SamplingParams) -> None:
        """Say once (as vLLM) when a request's watermarking cannot be applied; it runs without."""
        if params.watermarking is False or "watermark" in self._warned:
            return
        if self.cfg.watermark is None and params.watermarking:
            logger.warning("a request asks for watermarking=True but the engine has no watermark_config; it and "
                           "later ones run without a watermark (start the engine with watermark_config={'key': ...})")
            self._warned.add("watermark")
        elif self.cfg.watermark is not None and params.temperature == 0:
            logger.warning("watermarking is on, but greedy decoding (temperature 0) cannot be watermarked: this "
                           "request and later greedy ones run as ordinary greedy decoding")
            self._warned.add("watermark")

    def validate_priority(self, priority) -> None:
        """RequestError unless priority is an integer (numpy's too) this engine's scheduling_policy honours."""
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise RequestError(f"priority={priority!r} must be an integer (lower values run first)")
        if priority != 0 and self.cfg.sched.scheduling_policy != "priority":
            raise RequestError(f"priority={priority} needs an engine started with scheduling_policy='priority' "
                               "(--scheduling-policy priority); this one schedules first come, first served: "
                               "leave priority at 0")

    def add_request(
        self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
        lora_request=None, tokenization_kwargs: dict | None = None, trace_headers=None, priority: int = 0,
        prompt_text: str | None = None, *, cache_salt: str | None = None, matcher=None,
    ) -> None:
        """Queue a request, in vLLM's LLMEngine.add_request order. prompt: token ids, a string or a
        TextPrompt / TokensPrompt dict (tandem.prompts; a string tokenized with tokenization_kwargs'
        add_special_tokens); prompt_text: the text outputs show for token ids. arrival_time: taken, not
        used (the engine stamps arrival itself); lora_request and trace_headers: only None. priority
        (scheduling_policy="priority" only): lower values are scheduled first, and may preempt running
        requests of a higher value. cache_salt (vLLM's; or the dict prompt's): the request shares
        prefix-cache blocks only with requests of the same salt. matcher: params.structured_outputs
        compiled for this prompt by compile_structured, on another thread (None: compiled here)."""
        if self._dead is not None:
            raise StepError(self._dead, [], fatal=True)
        if not isinstance(request_id, str):  # (vLLM's are str: outputs and aborts name them so)
            raise RequestError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if lora_request is not None or trace_headers:
            raise RequestError("lora_request / trace_headers: tandem serves no LoRA adapters and exports no traces; "
                               "leave them None")
        if arrival_time is not None and (not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool)):
            raise RequestError(f"arrival_time must be a time (a float, as time.time()), got {arrival_time!r}")
        if prompt_text is not None and not isinstance(prompt_text, str):
            raise RequestError(f"prompt_text must be the prompt's text (a string), got {type(prompt_text).__name__}")
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        prompt_token_ids, text, from_text = prompt_token_ids_of(
            prompt, self.tokenizer, add_special_tokens(tokenization_kwargs, True), ids=True)
        if from_text and isinstance(params, SamplingParams):  # (bad params: validate_request's to name)
            prompt_token_ids = self.truncate_text_prompt(text, prompt_token_ids, params)
        prompt = text if prompt_text is None else prompt_text
        self.validate_priority(priority)
        priority = int(priority)
        check_cache_salt(cache_salt)
        self.validate_request(prompt_token_ids, params, compiled=matcher is not None)
        params = self.resolve_logprobs(params)
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params)
        self._check_watermark(params)
        if params.structured_outputs is None:
            matcher = None
        elif matcher is None:
            matcher = self.compile_structured(params, prompt_token_ids)
        params = self.resolve_bad_words(params)
        prompt_token_ids = list(prompt_token_ids)
        max_room = self.cfg.sched.max_model_len - len(prompt_token_ids)
        max_tokens = min(params.max_tokens or max_room, max_room)
        # A negative seed (vLLM takes any int64) folds into [0, MAX_SEED], like each choice's below.
        base_seed = params.seed % (MAX_SEED + 1) if params.seed is not None else self._rng.randrange(MAX_SEED)
        metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt_token_ids))
        state = RequestState(request_id, prompt, prompt_token_ids, params, [], metrics)
        stops, stop_token_set = StopStrings(params.stop), frozenset(params.stop_token_ids)  # (once for the n)
        for i in range(params.n):
            req = Request(
                req_id=self._next_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                seed=(base_seed + i * 0x9E3779B97F4A7C15) % (MAX_SEED + 1),
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                cache_salt=cache_salt,
                stop_token_set=stop_token_set,
            )
            self._next_id += 1
            detok = self.detokenizer.new_state(
                prompt_token_ids, stops, params.include_stop_str_in_output, params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            seq = SeqState(request_id, req, i, detok, logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
            state.seqs.append(seq)
            self._seq_of[req.req_id] = seq
            if matcher is not None:  # every sequence its own matcher, each a copy of the fresh one
                self.grammars.add(req.req_id, matcher if i == params.n - 1 else matcher.deep_copy())
            self.scheduler.add(req)
        self._requests[request_id] = state

    def compile_structured(self, params: SamplingParams, prompt_token_ids: list[int]):
        """params.structured_outputs' matcher at the start of the output to prompt_token_ids (after
        truncate_prompt); RequestError when it does not compile. Any thread may call it: the server
        compiles a request's on a tokenizing thread (a large grammar takes up to a second) and hands
        it to add_request, so the engine loop's thread, which steps every request, does not."""
        return self.grammars.compile(params.structured_outputs, prompt_token_ids)

    def _check_structured(self, params: SamplingParams, prompt_token_ids: list[int], compiled: bool = False) -> None:
        """RequestError for a constraint that does not compile (unless compiled), or an engine that
        cannot keep one."""
        if self.cfg.spec is not None and self.cfg.spec.synthetic:
            raise RequestError("SamplingParams.structured_outputs cannot run with rejection_sample_method="
                               "'synthetic', which accepts drafts whatever they are (a benchmark mode); use "
                               "the lossless verifier")
        if not compiled:
            self.grammars.validate(params.structured_outputs, prompt_token_ids)

    def resolve_bad_words(self, params: SamplingParams, tokenizer=None) -> SamplingParams:
        """params with its bad_words tokenized into bad_words_token_ids (bad_word_ids' rule), by
        tokenizer (None: the engine's). add_request does it; the server does it first, on a
        tokenizing thread, so that a long list (300k words take seconds) does not hold up the
        engine loop's thread, which steps every request."""
        if not params.bad_words:
            return params
        if tokenizer is None:
            tokenizer = self.tokenizer
        return params.clone(bad_words=None, bad_words_token_ids=(params.bad_words_token_ids or [])
                            + bad_word_ids(tokenizer, params.bad_words))

    def unstarted_requests(self) -> list[tuple[int, int, str, int]]:
        """(priority, arrival order, request id, sequences) of each request none of whose sequences
        has run yet: all waiting for a slot, none ever admitted."""
        out = []
        for request_id, state in self._requests.items():
            reqs = [seq.req for seq in state.seqs]
            if all(r.status == Status.WAITING and not r.num_preemptions for r in reqs):
                out.append((reqs[0].priority, reqs[0].req_id, request_id, len(reqs)))
        return out

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt block (vLLM's LLM.reset_prefix_cache): False, and nothing done,
        while requests hold blocks, as vLLM's. reset_running_requests (vLLM's: preempt them first) is
        not taken; reset_connector asks nothing here (no KV connector)."""
        if reset_running_requests:
            raise RequestError("reset_prefix_cache(reset_running_requests=True) is not supported: the cache is reset "
                               "once no request holds blocks; abort or finish them first")
        if self.scheduler.requests:
            logger.warning("the prefix cache was not reset: %d requests still hold blocks", len(self.scheduler.requests))
            return False
        self.scheduler.blocks.reset_prefix_cache()
        return True

    def abort_request(self, request_id: str | list[str], internal: bool = False) -> bool:
        """End a request (or each of vLLM's list of ids): -> whether any was in flight. internal: vLLM's
        (its ids internal or the caller's); tandem's ids are the caller's either way."""
        if isinstance(request_id, (list, tuple, set, frozenset)):
            return any([self.abort_request(r) for r in request_id])  # (a list: every id, not the first found)
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            self.scheduler.abort(seq.req.req_id)
            self._seq_of.pop(seq.req.req_id, None)
            self.grammars.remove(seq.req.req_id)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        self._aborted.append(state)
        return True

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet reported finished (vLLM's LLMEngine method)."""
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that progressed, as each one's
        SamplingParams.output_kind asks (CUMULATIVE: everything so far; DELTA: what is new;
        FINAL_ONLY: only once it finished).

        A step that fails (a CUDA out-of-memory error, a bug) ends the requests it ran, whose
        device state it may have left half-written, and raises StepError naming them; the engine
        stays usable and the requests it did not run go on. Out of memory is reported with the
        settings that leave the step more room."""
        # the requests this step reports, by identity: an id aborted and added again before this step is
        # two requests, the ended one reported first
        touched = {id(s): s for s in self._aborted}
        self._aborted = []
        running: list[StepPlan] = []  # the plans this call launched or collects
        try:
            if self._inflight is None and not self._launch(running):
                return self._outputs(touched)  # nothing to run
            plan, launched, start = self._inflight
            self._inflight = None
            running[:] = [plan]
            ahead = self._launch_ahead(plan, running) if self.async_scheduling else None
            result = self.runner.collect(launched)
            self._apply(plan, launched, result, start, touched)
            if ahead is not None:  # its sampling waited for this step's tokens (grammar masks)
                forwarded, scheduled = ahead
                forwarded.plan.grammar = self.grammars.bitmask(forwarded.plan)
                masks = self._draft_masks(forwarded.plan)
                self._inflight = (forwarded.plan, self.runner.launch_sampling(forwarded, masks), scheduled)
            self._observe_speculation(plan, result, start)
            if self._inflight is not None and not self.scheduler.has_unfinished:
                # Everything stopped at this step: the step launched ahead has no one left to serve.
                self.runner.collect(self._inflight[1])
                self._inflight = None
        except BaseException as e:
            error = self._fail(e, running, touched)
            if error is None:  # KeyboardInterrupt and the like: the caller's to handle
                raise
            raise error from (None if isinstance(e, torch.OutOfMemoryError) else e)
        return self._outputs(touched)

    def _launch(self, running: list[StepPlan]) -> bool:
        """Plan a step and queue it (self._inflight); False when there is nothing to run."""
        scheduled = time.monotonic()  # a step's start: before its planning and its launch
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.runner.release(plan)  # slots freed and responses ended since the last plan
            return False
        running.append(plan)
        if self.grammars.active:  # the masks are made while the device runs the forward
            fwd = self.runner.forward(plan)
            plan.grammar = self.grammars.bitmask(plan)
            self._inflight = (plan, self.runner.launch_sampling(fwd, self._draft_masks(plan)), scheduled)
        else:
            self._inflight = (plan, self.runner.launch(plan), scheduled)
        return True

    def _launch_ahead(self, plan: StepPlan, running: list[StepPlan]) -> tuple[Forwarded, float] | None:
        """Plan and queue the step after plan before plan's result is in (async scheduling), when
        the scheduler can. -> None, or (its forward, when planned) where its sampling must wait for
        plan's tokens (the grammar masks follow them)."""
        scheduled = time.monotonic()
        ahead = self.scheduler.schedule_ahead(plan)
        if ahead is None:
            return None
        running.append(ahead)
        if self.grammars.active:
            return self.runner.forward(ahead), scheduled
        self._inflight = (ahead, self.runner.launch(ahead), scheduled)
        return None

    def _apply(self, plan: StepPlan, launched: Launched, result: StepResult, start: float, touched: dict) -> None:
        """A collected step's result into the requests: their tokens and outputs, and the grammars
        and the drafts they follow."""
        events = self.scheduler.update(plan, result)
        for req, emitted in events if self.grammars.active else ():  # the matchers follow the tokens
            self.grammars.accept(req.req_id, emitted)
        self._emit(plan, result, events, start, touched)
        drafts = self.runner.collect_drafts(launched)
        if drafts and launched.masked_drafts:
            self.grammars.masked_rounds(drafts)
        elif drafts and self.grammar_drafting in ("repair", "auto"):
            misfits = self.grammars.misfits(drafts)
            if misfits:
                drafts.update(self.runner.repair_drafts(launched, result, misfits, drafts, self.grammars))
        for req_id, tokens in drafts.items():  # the next masks follow them
            self.grammars.set_drafts(req_id, tokens)

    def _observe_speculation(self, plan: StepPlan, result: StepResult, start: float) -> None:
        """The speculation metrics and the acceptance estimator follow a collected step."""
        if self.spec_metrics is not None:
            self.spec_metrics.observe(plan, result)
            if self.adaptive is not None:
                self.adaptive.observe(plan, result)
            if start - self._last_log >= self.log_interval_s:
                line = self.spec_metrics.interval_line(start - self._last_log)
                self._last_log = start
                if line is not None:  # (an idle interval logs nothing)
                    logger.info(line)
                    if self.adaptive is not None:
                        logger.info(self.adaptive.log_line())

    def _fail(self, e: BaseException, running: list[StepPlan], touched: dict) -> StepError | None:
        """A step that raised e: end the requests of running (reported by the next step) and stop
        the engine when it cannot go on. -> the error to raise; None for what is not an Exception
        (KeyboardInterrupt and the like), which the caller raises as it is."""
        self._inflight = None  # a step launched ahead is dropped: its requests end below
        fatal = _is_fatal(e)
        if self.cfg.device.type == "cuda" and not fatal:
            try:  # let what was queued finish before its requests' slots and buffers are reused
                torch.cuda.synchronize(self.cfg.device)
            except Exception:
                fatal = True
        self._aborted[:0] = touched.values()  # reported by the next step
        ended = self._end_requests_of(running)
        if not isinstance(e, Exception):
            if self.tensor_parallel:  # the other ranks may wait in this step's collectives for good
                self.stop("the engine stopped: a step was interrupted under tensor parallelism, so its ranks "
                          "no longer agree; restart the process")
            return None
        error = self._step_error(e, running, ended if running else None, fatal)
        cause = "a device error" if fatal else "a failed step under tensor parallelism"
        if self.tensor_parallel and not fatal:
            # One rank's failure (its memory, say) need not be the others': they may have run the
            # step and gone on, and the ranks' engines must agree for their collectives to meet.
            fatal = True
            error = StepError(f"{error}; under tensor parallelism a failed step stops the engine (its ranks may "
                              "no longer agree); restart the process", error.request_ids, fatal=True)
        if fatal:
            self.stop(f"the engine stopped after {cause} ({error}); restart the process")
        return error

    def stop(self, why: str) -> None:
        """Take no more work: every request ends (aborted, reported by the next step) and every
        later add_request raises a fatal StepError saying why."""
        self._dead = why
        for request_id in list(self._requests):  # nothing can run them any more
            self.abort_request(request_id)

    @property
    def stopped(self) -> bool:
        return self._dead is not None

    def _outputs(self, touched: dict[int, RequestState]) -> list[RequestOutput]:
        """The outputs of the requests that progressed, as each one's output_kind asks: every one
        (CUMULATIVE), those with something new (DELTA), the finished (FINAL_ONLY)."""
        outs = []
        for state in touched.values():
            kind = state.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
                continue
            out = self._output(state, delta=kind == RequestOutputKind.DELTA)
            if out is not None:
                outs.append(out)
        return outs

    def _draft_masks(self, plan: StepPlan):
        """The grammars a step's drafting round masks its drafts with, or None (a free round)."""
        way = self.grammar_drafting
        if way == "round" or (way == "auto" and self.grammars.prefers_masking(plan)):
            return self.grammars.draft_masks(plan)
        return None

    def _end_requests_of(self, plans: list[StepPlan]) -> list[str]:
        """Abort every request with a sequence in plans; -> their request ids."""
        ended = []
        for plan in plans:
            for item in plan.reqs:
                seq = self._seq_of.get(item.req_id)
                if seq is not None and self.abort_request(seq.request_id):
                    ended.append(seq.request_id)
        return ended

    def _step_error(self, e: Exception, plans: list[StepPlan], ended: list[str] | None, fatal: bool) -> StepError:
        num_tokens = max((p.num_tokens for p in plans), default=0)
        # ended None: it failed before a step ran (while planning), and the caller ends every request
        what = (f"an engine step ({len(ended)} requests, {num_tokens} tokens)" if ended is not None
                else "planning an engine step (every request in flight)")
        if isinstance(e, torch.OutOfMemoryError):
            memory = release_failed_step(e, self.cfg.device)
            return StepError(
                f"{what} ran out of GPU memory{memory} and its requests were ended; leave more memory outside "
                f"the KV cache (lower {self._budget_setting}) or make steps smaller (lower "
                f"max_num_batched_tokens={self.cfg.sched.max_num_batched_tokens} or "
                f"max_num_seqs={self.cfg.sched.max_num_seqs})",
                ended,
            )
        if fatal:
            return StepError(f"{what} failed with a device error that leaves the GPU unusable ({e!r}); its "
                             f"requests were ended; restart the process", ended, fatal=True)
        return StepError(f"{what} failed and its requests were ended: {e!r}", ended)

    def _emit(self, plan: StepPlan, result: StepResult, events, start: float, touched: dict) -> None:
        now = time.monotonic()
        for new in plan.new_reqs:  # admitted by this step (a request preempted before keeps its first time)
            seq = self._seq_of.get(new.req_id)
            if seq is not None:
                m = self._requests[seq.request_id].metrics
                m.first_scheduled_time = m.first_scheduled_time or start
        if result.prompt_logprobs is not None:
            for item, lps in zip(plan.reqs, result.prompt_logprobs):
                seq = self._seq_of.get(item.req_id)
                if seq is not None and lps is not None:
                    self._push_prompt_logprobs(seq, item.start_pos + 1, lps)
        # where a request's logprobs are (None: no request asked for them)
        index_of = {r.req_id: i for i, r in enumerate(plan.reqs)} \
            if result.logprobs.count(None) < len(result.logprobs) else None
        for req, emitted in events:
            seq = self._seq_of.get(req.req_id)
            if seq is None:
                continue
            state = self._requests[seq.request_id]
            logprobs = result.logprobs[index_of[req.req_id]] if index_of is not None else None
            self._push_tokens(seq, emitted, logprobs)
            m = state.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            touched[id(state)] = state
        for state in touched.values():
            if state.finished and self._requests.get(state.request_id) is state:  # (not an ended one's id reused)
                state.metrics.finished_time = now
                del self._requests[state.request_id]
                for seq in state.seqs:
                    self._seq_of.pop(seq.req.req_id, None)
                    self.grammars.remove(seq.req.req_id)

    def _push_tokens(self, seq: SeqState, emitted: list[int], logprobs: list[TokenLogprobs] | None) -> None:
        req = seq.req
        # A stop token (EOS, or one of stop_token_ids) that ended the request is kept in token_ids
        # but not in the text, unless include_stop_str_in_output asks for it (as vLLM does).
        ended_by_token = (req.is_finished and req.finish_reason == "stop" and not isinstance(req.stop_reason, str)
                          and not req.params.include_stop_str_in_output)
        for j, token in enumerate(emitted):
            seq.token_ids.append(token)
            if seq.logprobs is not None and logprobs is not None:
                seq.logprobs.append(self._logprob_dict(logprobs[j], req.params.detokenize))
                seq.cumulative_logprob += logprobs[j].logprob
            if ended_by_token and j == len(emitted) - 1:
                break
            if not req.params.detokenize:  # token ids only: no text, so no stop string either
                continue
            # As EOS, a stop string cannot end in the text of the first min_tokens tokens.
            stop = self.detokenizer.push(seq.detok, token, len(seq.token_ids) > req.params.min_tokens)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                self.scheduler.finish(req, "stop", stop, num_output_tokens=len(seq.token_ids))
                return
        if req.is_finished:
            seq.finish_reason, seq.stop_reason = req.finish_reason, req.stop_reason

    @staticmethod
    def _prompt_logprobs_of(state: RequestState) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs: its sequences each prefill the prompt, and the one furthest
        along has the most (n > 1 in chunked prefill)."""
        if state.seqs[0].prompt_logprobs is None:
            return None
        return max((s.prompt_logprobs for s in state.seqs), key=len)

    def _push_prompt_logprobs(self, seq: SeqState, first: int, lps: list[TokenLogprobs]) -> None:
        """Prompt tokens first, first + 1, ...'s logprobs; a recomputation after preemption adds nothing."""
        for j, lp in enumerate(lps):
            if first + j == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(self._logprob_dict(lp, seq.req.params.detokenize))

    def _decoded(self, token: int) -> str:
        """The token's text alone (tokenizer.decode([token])), decoded once per engine."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _logprob_dict(self, lp: TokenLogprobs, detokenize: bool = True) -> dict[int, Logprob]:
        decode = self._decoded if self.tokenizer is not None and detokenize else (lambda t: None)
        # The sampled token first, ranked by the tokens at least as likely; one among the top-n takes its place
        # there instead, so a tie ranks 1..n with none left out (vLLM's dict: the top-n entries overwrite it).
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
        for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            if t == lp.token_id:
                out[t] = Logprob(lp.logprob, r + 1, out[t].decoded_token)
            elif t not in out:
                out[t] = Logprob(v, r + 1, decode(t))
        return out

    def _final_acceptance(self, m: RequestMetrics, reqs: list[Request]) -> None:
        """A finished request's acceptance histograms, summed over its sequences, and its rounds'
        counts in order (one sequence, when the scheduler kept them)."""
        by_num_drafts: dict[int, list[int]] = {}
        for r in reqs:
            for num_drafts, row in r.acceptance_by_num_drafts.items():
                total = by_num_drafts.setdefault(num_drafts, [0] * (num_drafts + 1))
                for j, count in enumerate(row):
                    total[j] += count
        m.acceptance_by_num_drafts = dict(sorted(by_num_drafts.items()))
        m.acceptance_histogram = [sum(row[j] for row in by_num_drafts.values() if j < len(row))
                                  for j in range(self.scheduler.k + 1)] if self.scheduler.k else []
        if len(reqs) == 1 and reqs[0].per_step_accepted is not None:
            m.per_step_accepted, m.per_step_drafted = list(reqs[0].per_step_accepted), list(reqs[0].per_step_drafted)

    @staticmethod
    def _shown_text_end(seq: SeqState, params: SamplingParams) -> int:
        """How much of seq's text an output may show: all of it once the sequence finished, else
        all but the characters that could still turn out to be the start of a stop string (the
        stop and what follows it are then cut from the text, which must not take back what an
        output showed; as vLLM, nothing is held back when the stop string stays in the output).
        A stop string found ends at or after the end shown before, so the text never shrinks."""
        length = seq.detok.buffer.length
        if seq.finish_reason is not None or not params.stop or params.include_stop_str_in_output:
            return length
        hold = seq.detok.stops.max_len - 1
        return max(seq.num_shown_chars, length - hold)

    def _completion(self, seq: SeqState, params: SamplingParams, delta: bool) -> CompletionOutput | None:
        """seq's output: all of it, or (delta) what is new since its previous output (None: nothing)."""
        end = self._shown_text_end(seq, params)
        first_token, first_char = (seq.num_shown_tokens, seq.num_shown_chars) if delta else (0, 0)
        if delta and first_token == len(seq.token_ids) and first_char == end \
                and (seq.finish_reason is None or seq.shown_finish):
            return None
        seq.num_shown_tokens, seq.num_shown_chars = len(seq.token_ids), end
        seq.shown_finish = seq.finish_reason is not None
        return CompletionOutput(
            index=seq.index,
            text=seq.detok.buffer.between(first_char, end) if end > first_char else "",
            token_ids=seq.token_ids[first_token:],
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[first_token:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _output(self, state: RequestState, delta: bool = False) -> RequestOutput | None:
        """The request's output: everything so far, or (delta) only what is new since the last one
        (its sequences with nothing new left out, the prompt logprobs in the first alone; None when
        nothing is new and it has not finished)."""
        m, seqs, params = state.metrics, state.seqs, state.params
        reqs = [s.req for s in seqs]
        _count(m, seqs, reqs)
        finished = state.finished
        if finished:  # the histograms and each round's counts: on the final output alone
            self._final_acceptance(m, reqs)
        outputs = []
        for seq in seqs:
            completion = self._completion(seq, params, delta)
            if completion is not None:
                outputs.append(completion)
        if not outputs and not finished:
            return None
        prompt_lps = self._prompt_logprobs_of(state)
        if prompt_lps is not None and delta and state.shown_prompt_logprobs:
            prompt_lps = None
        state.shown_prompt_logprobs = state.shown_prompt_logprobs or prompt_lps is not None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished, m,
                             prompt_logprobs=list(prompt_lps) if prompt_lps is not None else None)


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it reads at the start of a text and, where the tokenizer folds
    a leading space into the first token (the spaced spelling starts with another token and is no
    longer), after a space: vLLM bans both, by this rule."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [w for w in out if w]


def check_cache_salt(cache_salt) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestError(f"cache_salt={cache_salt!r} must be a non-empty string (or left out)")


def progress_bar(use_tqdm, total: int, desc: str):
    """LLM.generate's bar: None (use_tqdm false), tqdm's, or use_tqdm's own where it is a callable
    (vLLM's: a tqdm-like class or factory, called as tqdm is)."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, dynamic_ncols=True)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def as_token_ids(ids, name: str = "prompt_token_ids") -> list:
    """Token ids as LLM.generate takes them: a list or tuple, a numpy array or a tensor (of Python's,
    numpy's or 0-d tensors' integers, made Python ints) -> a list; RequestError naming them for
    anything else. What is not an integer is left for the caller's check to refuse."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a numpy array, a tensor
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"{name} must be a list of integers, got {type(ids).__name__}")
    return [_as_int(t) for t in ids]


def _as_int(t):
    """An integer-like id (numpy's integers too) as a Python int; anything else is left for the
    engine's check to refuse (bool included)."""
    if isinstance(t, bool):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t
