"""LLM: the offline entry point, shaped like vLLM's (`LLM(...).generate(prompts, params)`)."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.choices import CPU_MATMULS, KV_CACHE_DTYPES, LOGPROBS_MODES, SCHEDULING_POLICIES, SPEC_DECODE_METRICS_LEVELS
from tandem.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    check_device_support,
    check_dtype_name,
    parse_structured_outputs_config,
    read_arch_config,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from tandem.beam_search import BeamSearchOutput, run_beam_search
from tandem.chat import content_format, developer_as_system, template_kwargs, text_message
from tandem.engine.engine import Engine, progress_bar
from tandem.engine.vllm_args import check_vllm_only
from tandem.errors import ConfigError, RequestError
from tandem.layers.quant import QUANTIZATIONS
from tandem.models.loader import load_model
from tandem.metrics_reader import Metric, engine_metrics
from tandem.models.source import eos_token_ids, generation_defaults, load_tokenizer, resolve_model_dir
from tandem.oom import check_host_fits
from tandem.runner.memory import check_gpu_share
from tandem.outputs import RequestOutput
from tandem.parallel.group import TPGroup, backend_for, host_store
from tandem.parallel.shard import check_shardable
from tandem.parallel.workers import ReplicatedEngine, Workers, is_transport_error, threads_per_rank
from tandem.reasoning import reasoning_format
from tandem.sampling.watermark import parse_watermark_config
from tandem.prompts import add_special_tokens, check_encodable, prompt_token_ids
from tandem.sampling_params import MAX_SEED, BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict


# Bytes one slot of max_num_seqs takes at least, on the host whatever the device (the scheduler's
# and the sampler's per-slot lists and buffers; block tables and a speculator's buffers add more):
# a count whose slots alone exceed the machine's memory is refused up front (Linux would grant
# the allocations, then kill the process for touching them).
SLOT_HOST_BYTES = 1024


class LLM:
    """Load a model (and optionally a draft model) and generate from batches of prompts."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        seed: int = 0,
        speculative_config: Any = None,
        num_gpu_blocks_override: int | None = None,
        enforce_eager: bool = False,
        max_cudagraph_tokens: int = 512,
        cpu_matmul: str = "auto",
        async_scheduling: bool | None = None,
        logprobs_mode: str = "raw_logprobs",
        max_logprobs: int = 20,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        trust_remote_code: bool = False,
        tokenizer_mode: str = "auto",
        watermark_config: Any = None,
        reasoning_parser: str | None = None,
        structured_outputs_config: dict | None = None,
        per_request_spec_decode_metrics: str = "none",
        scheduling_policy: str = "fcfs",
        disable_log_stats: bool = True,
        enable_chunked_prefill: bool | None = None,
        swap_space: float | None = None,
        disable_custom_all_reduce: bool = False,
        download_dir: str | None = None,
        hf_overrides: dict | None = None,
        batch_invariant: bool = False,
        _rank: tuple[int, int] | None = None,
        **unsupported: Any,
    ):
        """_rank: (rank, port of rank 0's group store) in the processes of ranks 1.. of a
        tensor-parallel engine (tandem/parallel/workers.py); not for callers.

        disable_log_stats: as vLLM's LLM, True by default: no periodic speculative decoding line in
        the log (False: one every 10 s that verified drafts, on the "tandem" logger at INFO).
        enable_chunked_prefill (True or None), swap_space and disable_custom_all_reduce are vLLM's
        arguments that ask for nothing here: prompts are always chunked to max_num_batched_tokens,
        a preemption recomputes (no swap), and tensor parallelism reduces through NCCL. download_dir
        (vLLM's): where models named by a known name, a GGUF file or a hub id are fetched and converted
        (None: $TANDEM_CACHE, else ~/.cache/tandem; a hub id the Hugging Face cache). hf_overrides
        (vLLM's, a dict): config.json's keys set over the file's for the target model (its shape,
        positions, rope scaling...), checked as the file's own. batch_invariant (vLLM's VLLM_BATCH_INVARIANT=1):
        a token's logits have the same bits whatever step computes it (alone or in a batch, decoded, verified
        among drafts or prefilled), so speculative greedy output equals target-only greedy output on a GPU in
        bf16 too; slower on a GPU (README). vLLM's other arguments pass where they ask for nothing (their defaults,
        None, False; tandem/engine/vllm_args.py) and are a ConfigError saying why otherwise; max_num_seqs,
        block_size and enable_prefix_caching take None for their defaults, as vLLM's EngineArgs; any other
        argument is a ConfigError naming it."""
        unsupported = check_vllm_only(unsupported)
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise ConfigError(f"LLM() got {names}: not an argument tandem takes (README, 'Using it', lists those it "
                              "takes); leave it out")
        # vLLM's EngineArgs leave these None for their defaults, and reasoning_parser "" for none
        max_num_seqs = 256 if max_num_seqs is None else max_num_seqs
        block_size = 16 if block_size is None else block_size
        enable_prefix_caching = True if enable_prefix_caching is None else enable_prefix_caching
        if reasoning_parser == "":
            reasoning_parser = None
        launch = {name: value for name, value in locals().items() if name not in ("self", "_rank", "unsupported")}
        _check_arguments(**launch)
        given = reasoning_parser
        reasoning_parser, in_reasoning = parse_structured_outputs_config(structured_outputs_config, reasoning_parser)
        try:
            reasoning_format(reasoning_parser)
        except ValueError as e:  # (named by where it was given)
            where = "structured_outputs_config." if given is None else ""
            raise ConfigError(f"{where}{e}") from None
        if seed is None:  # vLLM's "unseeded": a fresh seed per engine
            seed = random.randrange(MAX_SEED)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
            raise ConfigError(f"seed={seed!r} must be an integer in [0, {MAX_SEED}], or None for a random one")
        tp_size = tensor_parallel_size
        rank, port = _rank if _rank is not None else (0, 0)
        launch["seed"] = seed  # every rank the same
        dev = resolve_device(device)
        eager_asked = enforce_eager
        if tp_size > 1:
            dev = _rank_device(dev, rank, tp_size)
            if dev.type == "cuda" and not enforce_eager:
                logger.info("tensor_parallel_size=%d runs eagerly: CUDA graphs around collectives are not built",
                            tp_size)
                enforce_eager = True
        for name, value, off in (("kv_cache_dtype", kv_cache_dtype, "auto"), ("quantization", quantization, None)):
            if value != off and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
                raise ConfigError(f"{name}={value!r} needs a GPU with float8 (compute capability 8.9 or newer; "
                                  f"measured on Hopper); this one is {torch.cuda.get_device_name(dev)}; leave it "
                                  f"{off!r}")
        model_dir = resolve_model_dir(model, dtype, device=dev, weights=load_format != "dummy",
                                      cache_dir=download_dir)
        arch = read_arch_config(model_dir, overrides=hf_overrides)
        check_device_support(arch, dev)
        if tp_size > 1:
            check_shardable(arch, tp_size)
        self.generation_defaults = _checked_defaults(generation_defaults(generation_config, model_dir,
                                                                         override_generation_config))
        torch_dtype = resolve_dtype(dtype, arch, dev)
        if batch_invariant:
            _check_batch_invariant(dev, torch_dtype, cpu_matmul, tp_size)
        max_len = resolve_max_model_len(max_model_len, arch)
        spec = _parse_spec(speculative_config, max_len)
        watermark = parse_watermark_config(watermark_config)
        _check_speculation(spec, dev=dev, tp_size=tp_size, enforce_eager=enforce_eager, eager_asked=eager_asked,
                           per_request_spec_decode_metrics=per_request_spec_decode_metrics, watermark=watermark)
        k = spec.num_speculative_tokens if spec is not None else 0
        async_scheduling = _resolve_async_scheduling(async_scheduling, spec, dev, max_num_seqs)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs * (1 + k))
        if max_num_batched_tokens < 1 + k:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} cannot fit one verification of 1 + k={1 + k} tokens"
            )
        if (batch_invariant and spec is not None and spec.draft_sample_method == "probabilistic"
                and max_num_batched_tokens < max_num_seqs * (1 + k)):
            raise ConfigError(
                f"batch_invariant=True with draft_sample_method='probabilistic' needs max_num_batched_tokens >= "
                f"max_num_seqs * (1 + k) = {max_num_seqs * (1 + k)} (it is {max_num_batched_tokens}): a smaller budget "
                "verifies some requests' drafts in part, and where a round ends picks another seeded token; raise "
                "it, lower max_num_seqs, or use greedy drafts"
            )
        cfg = EngineConfig(
            model=ModelConfig(str(model_dir), arch, torch_dtype, max_len, load_format, seed, cpu_matmul,
                              quantization=quantization, logprobs_mode=logprobs_mode, max_logprobs=max_logprobs,
                              tp_size=tp_size, batch_invariant=batch_invariant),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=float(gpu_memory_utilization),
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_gpu_blocks_override,
                cache_dtype=kv_cache_dtype,
            ),
            sched=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_len,
                num_lookahead_tokens=k,
                async_scheduling=async_scheduling,
                scheduling_policy=scheduling_policy,
            ),
            device=dev,
            spec=spec,
            watermark=watermark,
            reasoning_parser=reasoning_parser,
            structured_outputs_in_reasoning=in_reasoning,
            per_request_spec_decode_metrics=per_request_spec_decode_metrics,
            enforce_eager=enforce_eager,
            max_cudagraph_tokens=max_cudagraph_tokens,
        )
        self._start(cfg, spec, model_dir, tokenizer, launch, rank, port)
        self.config = self.engine.cfg
        self._model_name = str(model)  # as given: get_metrics' model_name label, as vLLM's
        self._counter = 0

    def _start(self, cfg: EngineConfig, spec, model_dir, tokenizer: str | None, launch: dict, rank: int,
               port: int) -> None:
        """Load the tokenizer and the models and build the engine (self.engine): on rank 0 of a
        tensor-parallel engine, after starting the other ranks' processes, which build theirs from
        launch (LLM's arguments, resolved)."""
        dev, arch, tp_size, torch_dtype = cfg.device, cfg.model.arch, cfg.model.tp_size, cfg.model.dtype
        self.tokenizer = load_tokenizer(tokenizer, "tokenizer") if tokenizer is not None else load_tokenizer(model_dir)
        if self.tokenizer is not None and len(self.tokenizer) > arch.vocab_size:
            where = f"tokenizer={tokenizer!r}" if tokenizer is not None else f"the tokenizer in {model_dir}"
            raise ConfigError(f"{where} has {len(self.tokenizer)} tokens but the model's embedding table only "
                              f"{arch.vocab_size} rows; pass the model's own tokenizer")
        workers = None
        self.tp = None  # this rank's tensor-parallel group
        threads = torch.get_num_threads()  # the caller's, back once the ranks stop (ReplicatedEngine.close)
        if tp_size > 1:
            if dev.type == "cpu":
                torch.set_num_threads(threads_per_rank(tp_size))
            if rank == 0:  # the other ranks build the same engine from what this one resolved
                launch["model"] = str(model_dir)
                if spec is not None and not spec.lookup:  # fetched once, here
                    draft_dir = resolve_model_dir(spec.model, spec.dtype if spec.dtype != "auto" else torch_dtype,
                                                  "speculative_config.model", weights=spec.draft_load_format != "dummy",
                                                  cache_dir=launch["download_dir"])
                    launch["speculative_config"] = dataclasses.replace(spec, model=str(draft_dir))
                store = host_store(tp_size)
                workers = Workers(tp_size, store.port, launch)
        try:
            if workers is not None:
                workers.wait_started()
                workers.wait_joining(store)  # rank 0's join waits for every rank: not for one that failed
                self.tp = TPGroup(0, tp_size, store.port, dev, store)
            elif tp_size > 1:
                self.tp = TPGroup(rank, tp_size, port, dev)
            check_gpu_share(cfg)  # before the weights: less free than the share asked for is refused at once
            target = load_model(cfg.model, dev, tp=self.tp)
            eos = eos_token_ids(model_dir, arch, self.tokenizer)
            factory = None
            if spec is not None and spec.lookup:
                from tandem.spec.ngram import LookupFactory

                factory = LookupFactory(spec)
            elif spec is not None:
                from tandem.spec.factory import SpeculatorFactory

                factory = SpeculatorFactory(spec, cfg.model, self.tokenizer, dev, self.tp, eos,
                                            launch["download_dir"])
            self.engine = Engine(cfg, target, self.tokenizer, eos, factory)
            if launch["disable_log_stats"]:
                self.engine.log_interval_s = math.inf
            if workers is not None:
                workers.wait_ready()
                self.engine = ReplicatedEngine(self.engine, workers, self.tp, threads)
        except BaseException as e:
            if workers is not None:
                # A rank that failed (its own out-of-memory, say) broke rank 0's collective: its error is the cause.
                cause = workers.failed_rank() if is_transport_error(e) else None
                workers.close()
                if self.tp is not None:
                    self.tp.close()
                torch.set_num_threads(threads)
                if cause is not None:
                    raise cause from e
            raise

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def llm_engine(self):
        """vLLM's name for the engine (tandem's Engine: add_request takes token ids)."""
        return self.engine

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt block (vLLM's): False, and nothing done, while requests run
        (Engine.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics(): the engine's counters and gauges now (tandem/metrics_reader.py),
        named as /metrics names them, "tandem_spec_decode_num_drafts" for vLLM's "vllm:spec_decode_num_drafts"."""
        return engine_metrics(self.engine, self._model_name)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params runs: the model's generation_config.json sampling
        defaults (see generation_config), else SamplingParams()'s."""
        return SamplingParams(**self.generation_defaults)

    # ---------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order. priority:
        one integer per prompt (lower first), for an LLM built with scheduling_policy="priority".
        A dict prompt may carry "cache_salt" (vLLM's): it shares cached prefix blocks only with
        prompts of the same salt. use_tqdm: a progress bar (vLLM's: True for tqdm's, or a callable
        made as tqdm is, tqdm(total=..., desc=..., dynamic_ncols=True)). lora_request: vLLM's
        argument, in its place; only None (no adapters), or a None per prompt. tokenization_kwargs
        (vLLM's): {"add_special_tokens": False} tokenizes text prompts without the tokenizer's special
        tokens (a BOS); no other key is taken."""
        _no_lora(lora_request)
        special_tokens = add_special_tokens(tokenization_kwargs, True)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(
                f"prompts must be a string, a {{'prompt_token_ids': [...]}} dict, or a list of them; "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise RequestError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or "
                                   f"None (the model's defaults), got {type(sampling_params).__name__}")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts; give one or one per prompt"
                )
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise RequestError(f"priority must be a list of one integer per prompt ({len(prompts)}), got "
                               f"{priority!r}")
        for value in priority:
            self.engine.validate_priority(value)
        items = []
        for prompt, p in zip(prompts, params):
            ids, text, from_text = prompt_token_ids(prompt, self.tokenizer, special_tokens)
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            items.append((self.engine.truncate_text_prompt(text, ids, p) if from_text else ids, text, salt))
        for (ids, _, _), p in zip(items, params):
            self.engine.validate_request(ids, p)  # every request checked before any work starts
        return self._run(items, params, use_tqdm, priority)

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool | Callable = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's, tandem/beam_search.py): one BeamSearchOutput per prompt, its best
        beam_width sequences best first. concurrency_limit: prompts searched at once (None: all).
        Each step asks for 2 * beam_width logprobs, so beam_width is at most max_logprobs / 2.
        lora_request: only None (no adapters)."""
        _no_lora(lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"beam_search(): prompts must be a list of prompts, got {type(prompts).__name__}")
        if not isinstance(params, BeamSearchParams):
            raise RequestError(f"beam_search(): params must be a BeamSearchParams, got {type(params).__name__}")
        return run_beam_search(self, list(prompts), params, use_tqdm, concurrency_limit)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate. As vLLM's (its
        arguments in its order): OpenAI-style content parts of type "text" are joined by newlines, or
        passed as parts to a template that loops over them (chat_template_content_format "auto"; or
        "string", "openai"); continue_final_message leaves the last message open (with
        add_generation_prompt=False); tools go to the template; chat_template_kwargs are extra template
        variables and override the arguments above. lora_request: only None (no adapters);
        tokenization_kwargs: {"add_special_tokens": True} adds the tokenizer's special tokens to the rendered
        conversation (default False: the template holds its own, as vLLM); mm_processor_kwargs: only None or
        empty (text-only models)."""
        _no_lora(lora_request)
        special_tokens = add_special_tokens(tokenization_kwargs, False)
        if mm_processor_kwargs:
            raise RequestError(f"chat(): mm_processor_kwargs={mm_processor_kwargs!r} is not supported: tandem runs "
                               "text-only models; leave it out")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise RequestError(f"chat(): chat_template_content_format={chat_template_content_format!r} must be "
                               "'auto', 'string' or 'openai'")
        if self.tokenizer is None:
            raise RequestError("chat() needs a tokenizer, and this model directory has none")
        seq = (list, tuple)  # (vLLM's: any sequence of messages, or of conversations)
        conversations = [messages] if isinstance(messages, seq) and messages and isinstance(messages[0], dict) \
            else messages
        if not isinstance(conversations, seq) or not all(
            isinstance(conv, seq) and conv and all(isinstance(m, dict) and "role" in m for m in conv)
            for conv in conversations
        ):
            raise RequestError("chat() takes a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                               "list of conversations")
        if continue_final_message and add_generation_prompt:
            raise RequestError("chat(): continue_final_message continues the last message, so add_generation_prompt "
                               "must be False; pass add_generation_prompt=False")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise RequestError("chat(): chat_template_kwargs must be a dict of template variables")
        kwargs = template_kwargs(chat_template, add_generation_prompt, continue_final_message, tools,
                                 chat_template_kwargs)
        fmt = content_format(kwargs["chat_template"] or getattr(self.tokenizer, "chat_template", None)) \
            if chat_template_content_format == "auto" else chat_template_content_format
        prompts = []
        for conv in conversations:
            try:
                messages = [text_message(m, fmt) for m in conv]
            except RequestError as e:
                raise RequestError(f"chat(): {e}") from None
            messages = developer_as_system(messages, kwargs["chat_template"] or getattr(self.tokenizer, "chat_template",
                                                                                         None))
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            except Exception as e:  # jinja's errors, a template's raise_exception, bad tools: the template's input
                from jinja2 import TemplateSyntaxError

                fix = ("; the model's template is broken: pass chat_template=" if isinstance(e, TemplateSyntaxError)
                       and kwargs["chat_template"] is None else "")
                raise RequestError(f"chat template could not be applied: {type(e).__name__}: {e}{fix}") from None
            check_encodable(text, "chat(): the rendered conversation")
            ids = self.tokenizer(text, add_special_tokens=special_tokens).input_ids
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, items, params, use_tqdm: bool, priority: Sequence[int]) -> list[RequestOutput]:
        ids = []
        final_only: dict[int, SamplingParams] = {}  # id of a caller's params -> its FINAL_ONLY copy
        done: dict[str, RequestOutput] = {}
        bar = None
        try:
            for (token_ids, text, salt), p, rank in zip(items, params, priority):
                request_id = str(self._counter)
                self._counter += 1
                if p.output_kind != RequestOutputKind.FINAL_ONLY:  # only the final outputs are read (as vLLM)
                    if id(p) not in final_only:
                        final_only[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                    p = final_only[id(p)]
                self.engine.add_request(request_id, token_ids, p, prompt_text=text, priority=rank, cache_salt=salt)
                ids.append(request_id)
            bar = progress_bar(use_tqdm, len(ids), "Processed prompts")
            mine = set(ids)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:  # not an earlier call's aborted request
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a refused request, a failed step (StepError), Ctrl-C: end this call's requests
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _check_arguments(*, max_num_seqs, block_size, max_num_batched_tokens, kv_cache_memory_bytes,
                     num_gpu_blocks_override, gpu_memory_utilization, max_cudagraph_tokens, cpu_matmul, max_logprobs,
                     per_request_spec_decode_metrics, quantization, kv_cache_dtype, scheduling_policy, logprobs_mode,
                     load_format, tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend,
                     tokenizer_mode, trust_remote_code, enable_prefix_caching, enforce_eager, tokenizer, dtype,
                     disable_log_stats, enable_chunked_prefill, swap_space, disable_custom_all_reduce, download_dir,
                     hf_overrides, batch_invariant, **_) -> None:
    """LLM's arguments that can be checked before anything is resolved: a ConfigError naming the
    first bad one and its fix."""
    _check_positive_int("max_num_seqs", max_num_seqs)
    check_host_fits(max_num_seqs * SLOT_HOST_BYTES, f"max_num_seqs={max_num_seqs} (its per-request slots)",
                    "lower max_num_seqs")
    _check_positive_int("block_size", block_size)
    if max_num_batched_tokens is not None:
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if kv_cache_memory_bytes is not None:
        _check_positive_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
    if num_gpu_blocks_override is not None:
        _check_positive_int("num_gpu_blocks_override", num_gpu_blocks_override)
    if (
        not isinstance(gpu_memory_utilization, (int, float))
        or isinstance(gpu_memory_utilization, bool)
        or not 0 < gpu_memory_utilization <= 1
    ):
        raise ConfigError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]")
    if not isinstance(max_cudagraph_tokens, int) or isinstance(max_cudagraph_tokens, bool) \
            or max_cudagraph_tokens < 0:
        raise ConfigError(f"max_cudagraph_tokens={max_cudagraph_tokens!r} must be an integer >= 0 (0: run "
                          "prefill-mixed and ragged steps eagerly)")
    if cpu_matmul not in CPU_MATMULS:
        raise ConfigError(f"cpu_matmul={cpu_matmul!r} is not supported; use one of {list(CPU_MATMULS)}")
    if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or max_logprobs < -1:
        raise ConfigError(f"max_logprobs={max_logprobs!r} must be an integer >= 0, or -1 for no cap")
    if per_request_spec_decode_metrics not in SPEC_DECODE_METRICS_LEVELS:
        raise ConfigError(f"per_request_spec_decode_metrics={per_request_spec_decode_metrics!r} is not supported; "
                          f"use one of {list(SPEC_DECODE_METRICS_LEVELS)}")
    if quantization not in (None,) + QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization!r} is not supported; use 'fp8' (the linear layers' weights "
                          "rounded to float8 e4m3 on load, one scale per output row: half the weight memory and "
                          "traffic) or leave it out; tandem loads unquantized checkpoints only")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {list(KV_CACHE_DTYPES)} "
                          "('fp8': keys and values in float8 e4m3, half the memory a token takes)")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ConfigError(f"scheduling_policy={scheduling_policy!r} is not supported; use one of "
                          f"{list(SCHEDULING_POLICIES)}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode={logprobs_mode!r} is not supported; use one of {list(LOGPROBS_MODES)}")
    if load_format not in ("auto", "dummy"):
        raise ConfigError(f"load_format={load_format!r} is not supported; use 'auto' or 'dummy'")
    _check_positive_int("tensor_parallel_size", tensor_parallel_size)
    if pipeline_parallel_size != 1:
        raise ConfigError(f"pipeline_parallel_size={pipeline_parallel_size!r} is not supported: tandem splits a "
                          "model across devices by tensor_parallel_size alone; leave it out or set 1")
    # vLLM's executors: "mp" (ranks as processes, tandem's way), "uni" (one process: one rank)
    if distributed_executor_backend not in (None, "mp") and not (distributed_executor_backend == "uni"
                                                                 and tensor_parallel_size == 1):
        raise ConfigError(f"distributed_executor_backend={distributed_executor_backend!r} is not supported: "
                          "tandem runs its tensor-parallel ranks as processes; leave it out or set 'mp' (or "
                          "'uni' with tensor_parallel_size=1)")
    # vLLM arguments whose only value here asks for nothing (trust_remote_code only permits code,
    # and tandem runs none: its architectures are its own).
    if tokenizer_mode not in ("auto", "hf"):  # (vLLM's "hf": the Hugging Face tokenizer, as "auto" is here)
        raise ConfigError(f"tokenizer_mode={tokenizer_mode!r} is not supported; leave it out or set 'auto' or 'hf' "
                          "(the model's Hugging Face tokenizer, fast where it has one)")
    for name, flag in (("trust_remote_code", trust_remote_code), ("enable_prefix_caching", enable_prefix_caching),
                       ("enforce_eager", enforce_eager), ("disable_log_stats", disable_log_stats),
                       ("disable_custom_all_reduce", disable_custom_all_reduce), ("batch_invariant", batch_invariant)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name}={flag!r} must be True or False")
    if enable_chunked_prefill not in (None, True):
        raise ConfigError(f"enable_chunked_prefill={enable_chunked_prefill!r} is not supported: tandem's scheduler "
                          "always splits a prompt into chunks of max_num_batched_tokens; leave it out (or True), and "
                          "set max_num_batched_tokens to max_model_len to prefill every prompt whole")
    if swap_space is not None and (not isinstance(swap_space, (int, float)) or isinstance(swap_space, bool)
                                   or swap_space < 0):
        raise ConfigError(f"swap_space={swap_space!r} must be a number of GiB >= 0 (unused: a preemption recomputes)")
    if hf_overrides is not None and (not isinstance(hf_overrides, dict) or not all(isinstance(k, str)
                                                                                  for k in hf_overrides)):
        raise ConfigError(f"hf_overrides={hf_overrides!r} must be a dict of config.json keys and their values (vLLM's "
                          "function form is not taken), or None")
    if download_dir is not None and (not isinstance(download_dir, (str, os.PathLike)) or not str(download_dir)):
        raise ConfigError(f"download_dir={download_dir!r} must be a directory (a path), or None for $TANDEM_CACHE "
                          "(else ~/.cache/tandem)")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise ConfigError(f"tokenizer={tokenizer!r} must be a path or a model name (a string), or None for the "
                          "model's own")
    check_dtype_name(dtype)  # before a model is fetched or converted for it


def _check_batch_invariant(dev: torch.device, dtype: torch.dtype, cpu_matmul: str, tp_size: int) -> None:
    """batch_invariant=True needs kernels that compute a row the same way whatever its step: on a GPU
    tandem's Triton kernels (bf16 / fp16; fp32 runs cuBLAS), on a CPU tandem's C kernels (bf16 / fp16,
    cpu_matmul 'auto' or a build), one rank (a sum reduced across ranks rounds as the collective splits it)."""
    if dtype not in (torch.bfloat16, torch.float16):
        kernels = "Triton" if dev.type == "cuda" else "C"
        raise ConfigError(f"batch_invariant=True needs dtype bfloat16 or float16 (tandem's {kernels} kernels); this "
                          f"model runs in {str(dtype).removeprefix('torch.')}: pass dtype='bfloat16' "
                          "or leave batch_invariant off")
    if tp_size > 1:
        raise ConfigError(f"batch_invariant=True is not supported with tensor_parallel_size={tp_size} (a sum reduced "
                          "across ranks rounds as the collective splits it): use tensor_parallel_size=1 or leave "
                          "batch_invariant off")
    if dev.type == "cuda":
        from tandem.layers.backend import triton_available
        from tandem.layers.norm import fused_kernels_available

        if not (triton_available(dev) and fused_kernels_available()):
            raise ConfigError("batch_invariant=True on a GPU needs Triton (tandem's kernels), which does not import "
                              "here: install triton or leave batch_invariant off")
    elif dev.type == "cpu":
        from tandem.kernels import cpu_build
        from tandem.layers.cpu_linear import cpu_linear_kind

        kind = cpu_linear_kind(cpu_matmul, dev, dtype)
        if kind not in cpu_build.ISAS:
            if cpu_matmul == "auto":  # the C kernels do not run here
                raise ConfigError(f"batch_invariant=True on a CPU needs tandem's C kernels, which cannot run here "
                                  f"({cpu_build.load_error('avx2')}); leave batch_invariant off")
            raise ConfigError(f"batch_invariant=True on a CPU needs tandem's C kernels; cpu_matmul={cpu_matmul!r} "
                              f"runs {kind!r}: pass cpu_matmul='auto' or leave batch_invariant off")


def _check_speculation(spec, *, dev: torch.device, tp_size: int, enforce_eager: bool, eager_asked: bool,
                       per_request_spec_decode_metrics: str, watermark) -> None:
    """speculative_config against the rest of the engine: a ConfigError for each combination tandem
    does not run (enforce_eager: as resolved, on for tensor parallelism on CUDA; eager_asked: as given)."""
    if spec is None:
        if per_request_spec_decode_metrics != "none":
            raise ConfigError(f"per_request_spec_decode_metrics={per_request_spec_decode_metrics!r} needs a draft "
                              "model (speculative_config); leave it out, or set 'none'")
        return
    if spec.draft_tensor_parallel_size not in (None, 1, tp_size):
        raise ConfigError(f"speculative_config.draft_tensor_parallel_size={spec.draft_tensor_parallel_size} must "
                          f"be 1 (the whole draft on every rank) or tensor_parallel_size={tp_size}")
    if spec.enforce_eager is False and enforce_eager:
        if not eager_asked:
            raise ConfigError(f"speculative_config.enforce_eager=False is not supported with tensor_parallel_size="
                              f"{tp_size} on CUDA, which runs eagerly (no CUDA graphs around collectives yet); "
                              "leave speculative_config.enforce_eager out")
        raise ConfigError("speculative_config.enforce_eager=False with enforce_eager=True is not supported: the "
                          "draft's CUDA graphs are captured with the target's; leave speculative_config."
                          "enforce_eager out or drop enforce_eager=True")
    if spec.draft_confidence_threshold is not None and dev.type != "cpu":
        raise ConfigError("speculative_config.draft_confidence_threshold is supported on the CPU only: it reads "
                          "each draft step's confidence on the host, which would stall a GPU between draft steps "
                          "(vLLM allows it on SM121 alone); leave it out, or run with device='cpu'")
    if spec.adaptive and tp_size > 1:
        raise ConfigError("speculative_config.num_speculative_tokens_per_batch_size=\"auto\" is not supported "
                          "with tensor_parallel_size > 1 (its choice rests on step times one rank measures); "
                          "give explicit [start, end, K] ranges or leave it out")
    if watermark is not None and spec.synthetic:
        raise ConfigError("watermark_config cannot be combined with speculative_config's rejection_sample_method="
                          "'synthetic': synthetic acceptance does not keep the target's output, so the keyed draws "
                          "would not survive it; use 'standard' or leave watermark_config out")


def _resolve_async_scheduling(async_scheduling, spec, dev: torch.device, max_num_seqs: int) -> bool:
    """LLM's async_scheduling (True, False or None: auto) against the speculative config."""
    if async_scheduling not in (None, True, False):
        raise ConfigError(f"async_scheduling={async_scheduling!r} must be True, False or None (auto)")
    unreachable = spec.unreachable_ranges(max_num_seqs) if spec is not None else []
    if unreachable:
        logger.warning("speculative_config.num_speculative_tokens_per_batch_size: %s start past max_num_seqs=%d; "
                       "no batch reaches them, so they never apply", unreachable, max_num_seqs)
    # Steps that draft nothing are planned ahead as without a draft; the others overlap the
    # host's work with the device's drafting instead. A lookup's steps are planned ahead while
    # it finds nothing (Scheduler.schedule_ahead).
    undrafted = spec is None or spec.plans_ahead(max_num_seqs)
    if async_scheduling and not undrafted:
        raise ConfigError(
            "async_scheduling=True is not supported with speculative_config unless method='ngram' or 'suffix', or "
            "num_speculative_tokens_per_batch_size turns drafting off at some batch sizes or is \"auto\" with "
            "greedy drafts (it plans only steps without drafts ahead): with a draft model the host already applies "
            "each step while the device drafts; leave async_scheduling unset"
        )
    if async_scheduling is None:  # auto: on a GPU, for steps without drafts (on a CPU nothing overlaps)
        async_scheduling = dev.type == "cuda" and undrafted
    return async_scheduling


def _parse_spec(spec, target_max_len: int):
    if spec is None:
        return None
    from tandem.spec.config import SpeculativeConfig

    return SpeculativeConfig.from_user(spec, target_max_len)


def _rank_device(dev: torch.device, rank: int, size: int) -> torch.device:
    """A tensor-parallel rank's device: GPU `rank` (each rank its own), or the CPU."""
    if dev.type != "cuda":
        return dev
    n = torch.cuda.device_count()
    if n < size and backend_for(dev) == "nccl":
        raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs and {n} are visible; lower "
                          "tensor_parallel_size")
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    return dev


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _checked_defaults(defaults: dict) -> dict:
    """generation_config's sampling defaults, refused at load if SamplingParams would refuse them
    (else every request would fail, blaming itself)."""
    if defaults:
        try:
            SamplingParams(**defaults)
        except RequestError as e:
            raise ConfigError(f"the model's generation_config.json or override_generation_config sets an invalid "
                              f"sampling default ({e}); fix it, or pass generation_config='vllm' to ignore the "
                              "file") from None
        logger.warning("sampling defaults from the model's generation_config.json and override_generation_config "
                       "(pass generation_config='vllm' to use the engine's own): %s", defaults)
    return defaults


def _no_lora(lora_request) -> None:
    """RequestError unless lora_request asks for no adapter: None, or a None per prompt (vLLM's list form)."""
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        return
    if lora_request is not None:
        raise RequestError("lora_request: LoRA adapters are not supported; leave it None")
