"""Command line: `tandem generate [--model PATH] [--draft PATH] [sampling flags] "prompt"`."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time

from tandem.choices import KV_CACHE_DTYPES
from tandem.flags import (BATCH_INVARIANT_HELP, DOWNLOAD_DIR_HELP, DRAFT_TOKEN_MAP_HELP, DRAFT_VOCAB_HELP,
                          KV_CACHE_DTYPE_HELP, QUANTIZATION_HELP, REJECTION_HELP, SPEC_CONFIG_HELP, WATERMARK_HELP, draft_flag_conflicts,
                          float_in, hf_overrides, int_in, non_empty, size_in, speculative_config,
                          speculative_config_from_flags, structured_outputs, watermark_config)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# Best of k = 2, 3, 4 over three side-by-side runs of bench/real_pair.py on the 2-core dev machine
# (tok/s over target-only, code prompts: k=2 1.31x, k=3 1.35x, k=4 1.22x; docs/benchmarks.md).
DEFAULT_K = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference with draft-model speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion, streaming it to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, type=non_empty("pass a model path or name, or leave --model out"),
                     help=f"target model path or name (default: {DEFAULT_TARGET})")
    gen.add_argument("--draft", default=None, type=non_empty("pass a draft path or name, or use --no-draft"),
                     help=f"draft model path or name (default with no --model: {DEFAULT_DRAFT}), or ngram: "
                          "n-gram lookup in the context, no draft model (vLLM's method='ngram', prompt_lookup 5..5; "
                          "other lookups through --speculative-config), or suffix: suffix decoding (method='suffix')")
    gen.add_argument("--no-draft", action="store_true", help="run the target alone")
    gen.add_argument("--speculative-config", type=speculative_config, default=None, help=SPEC_CONFIG_HELP)
    # The draft-only flags default to None so that giving one without a draft is caught, not ignored.
    gen.add_argument("--num-speculative-tokens", "-k", type=int_in(1), default=None,
                     help=f"drafts per step (default {DEFAULT_K})")
    gen.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default=None,
                     help="how the draft picks its tokens (default greedy)")
    gen.add_argument("--adaptive", action="store_const", const=True, default=None,
                     help="each step drafts 0..k tokens, chosen from the measured acceptance and step costs "
                          "(num_speculative_tokens_per_batch_size='auto'; the steps are timed at start-up)")
    gen.add_argument("--draft-quantization", choices=["fp8"], default=None,
                     help="the draft's linear weights in fp8 (weight-only e4m3)")
    gen.add_argument("--rejection-sample-method", choices=["standard", "block"], default=None,
                     help=REJECTION_HELP)
    gen.add_argument("--draft-vocab-size", type=int_in(1), default=None, help=DRAFT_VOCAB_HELP)
    gen.add_argument("--draft-token-map", default=None, type=non_empty("pass a token map file"),
                     help=DRAFT_TOKEN_MAP_HELP)
    gen.add_argument("--watermark-config", type=watermark_config, default=None, help=WATERMARK_HELP)
    gen.add_argument("--structured-outputs", type=structured_outputs, default=None,
                     help="constrain the output, as JSON of StructuredOutputsParams' fields: "
                          "'{\"json\": SCHEMA}', '{\"regex\": ...}', '{\"choice\": [...]}' or '{\"grammar\": ...}'")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--compare", action="store_true", help="also run the target alone and print the speedup")
    gen.add_argument("--dtype", default="auto",
                     help="the weights' and activations' dtype: auto (the checkpoint's half dtype, float32 "
                          "checkpoints in bfloat16 as vLLM's auto; float16 runs as bfloat16 on a CPU), bfloat16, "
                          "float16 or float32")
    gen.add_argument("--quantization", "-q", choices=["fp8"], default=None, help=QUANTIZATION_HELP)
    gen.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    gen.add_argument("--device", default="auto", help="auto (CUDA where there is a GPU, else the CPU), cuda, cuda:N or cpu")
    gen.add_argument("--max-model-len", type=size_in(1), default=None,
                     help="the longest prompt + output, in tokens (default: the model's; units as vLLM: 32k, 32K)")
    gen.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto", help=KV_CACHE_DTYPE_HELP)
    gen.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                     help="dummy: seeded random weights of the model's shapes (for benchmarks), not its own")
    gen.add_argument("--download-dir", default=None, type=non_empty("pass a directory"), help=DOWNLOAD_DIR_HELP)
    gen.add_argument("--hf-overrides", type=hf_overrides, default=None,
                     help="config.json keys set over the model's, as a JSON object (vLLM's)")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int_in(1), default=1,
                     help="ranks (GPUs, or CPU processes) sharing each layer (default 1)")
    # The sampling defaults are this command's own (greedy, 128 tokens), not vLLM's SamplingParams() (1.0, 16),
    # and the model's generation_config.json is not read: a demonstration run is repeatable.
    gen.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate (default 128)")
    gen.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS or a stop may end it (default 0)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one's (default 0)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="default 1: off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="default 0: off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="default 0: off")
    gen.add_argument("--seed", type=int, default=None, help="the sampling seed (default: the engine's, 0)")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="run on past EOS, to --max-tokens")
    gen.add_argument("--quiet", action="store_true",
                     help="no statistics line after the completion (--compare still prints its comparison)")
    from tandem.server import add_serve_args

    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    det = sub.add_parser("detect", help="test text for the watermark of a key (--watermark-config)")
    det.add_argument("text", help="the text to test ('-': read it from stdin)")
    det.add_argument("--watermark-config", type=watermark_config, required=True, help="the generating engine's")
    det.add_argument("--model", default=DEFAULT_TARGET, type=non_empty("pass a model path or name"),
                     help=f"the model whose tokenizer encodes the text (default: {DEFAULT_TARGET})")
    det.add_argument("--p-value-threshold", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.01,
                     help="call the text watermarked below this p-value (default 0.01)")
    det.add_argument("--prompt", default=None,
                     help="the prompt the text was generated after, encoded as `generate` encodes it: its last "
                          "tokens are the first tokens' contexts, so those are scored too (without it they are not)")
    det.add_argument("--chat", action="store_true", help="the prompt went through the chat template (generate --chat)")
    tmap = sub.add_parser("token-map", help="rank token ids by their frequency in text files: a --draft-token-map")
    tmap.add_argument("files", nargs="+", help="text files ('-': stdin), e.g. a sample of the traffic to serve")
    tmap.add_argument("--model", default=DEFAULT_TARGET, type=non_empty("pass a model path or name"),
                      help=f"the model whose tokenizer counts the tokens (default: {DEFAULT_TARGET})")
    tmap.add_argument("--size", type=int_in(1), default=None,
                      help="keep the most frequent SIZE ids (default: every id seen)")
    tmap.add_argument("--output", "-o", required=True, help="the .json file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tandem.errors import TandemError
    from tandem.models.hub import CacheError

    try:
        if args.command == "serve":
            from tandem.server.api import run_server

            return run_server(args)
        if args.command == "detect":
            return _detect(args)
        if args.command == "token-map":
            return _token_map(args)
        return _generate(args)
    except TandemError as e:
        print(f"error: {in_flag_terms(str(e), args)}", file=sys.stderr)
        return 2
    except CacheError as e:  # the model cache could not be written (an OSError: its message says what to do)
        print(f"error: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, without a traceback
        return 130
    except BrokenPipeError:  # `tandem generate ... | head`: the reader has what it wanted
        try:  # so the flush at exit does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file behind it
            pass
        return 0


# The engine's names for what a command-line flag sets, in the errors it raises.
_ENGINE_FLAGS = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
                 "max_num_batched_tokens": "--max-num-batched-tokens", "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
                 "gpu_memory_utilization": "--gpu-memory-utilization", "tensor_parallel_size": "--tensor-parallel-size",
                 "num_gpu_blocks_override": "--num-gpu-blocks-override",
                 "block_size": "--block-size", "kv_cache_dtype": "--kv-cache-dtype", "quantization": "--quantization",
                 "dtype": "--dtype", "device": "--device", "generation_config": "--generation-config",
                 "override_generation_config": "--override-generation-config"}
_DRAFT_FLAGS = {"model": "--draft", "num_speculative_tokens": "--num-speculative-tokens",
                "quantization": "--draft-quantization", "draft_sample_method": "--draft-sample-method",
                "draft_vocab_size": "--draft-vocab-size", "draft_token_map": "--draft-token-map",
                "rejection_sample_method": "--rejection-sample-method",
                "num_speculative_tokens_per_batch_size": "--adaptive"}


def in_flag_terms(message: str, args: argparse.Namespace) -> str:
    """An engine error as the command line's user wrote it: "speculative_config.model: ..." becomes
    "--draft: ..." unless they gave --speculative-config themselves; each setting of an engine field the
    command has a flag for ("max_model_len=..., use max_model_len<=512") its flag; "StructuredOutputsParams.regex"
    "--structured-outputs regex"."""
    found = re.match(r"speculative_config\.(\w+)", message)
    if found and found[1] in _DRAFT_FLAGS and getattr(args, "speculative_config", None) is None:
        message = _DRAFT_FLAGS[found[1]] + message[found.end():]
    flags = {field: flag for field, flag in _ENGINE_FLAGS.items() if hasattr(args, field)}  # this command's
    if flags:
        # a field set or compared ("max_model_len=4096", "tensor_parallel_size > 1"), or named alone where
        # its name is no English word ("raise num_gpu_blocks_override", not "the device"); a name in quotes
        # is a key as written (speculative_config's known keys), not a field
        named = "|".join(f for f in flags if "_" in f)
        message = re.sub(r"(?<![\w.'\"-])(" + "|".join(flags) + r")(?=\s*[=<>])"
                         + (r"|(?<![\w.'\"-])(" + named + r")(?![\w.'\"])" if named else ""),
                         lambda m: flags[m[1] or m[2]], message)
    if getattr(args, "speculative_config", None) is None:  # a key no draft flag sets: --speculative-config does
        message = re.sub(r"speculative_config\.(\w+)=(\S+?)(?=[\s,;)]|$)",
                         lambda m: f"--speculative-config with \"{m[1]}\": {m[2]}", message)
    return re.sub(r"StructuredOutputsParams\.(\w+)", r"--structured-outputs \1", message)


def _token_map(args) -> int:
    """`tandem token-map`: the ids of the files' tokens, most frequent first, as a JSON list."""
    import json

    from tandem.errors import ConfigError
    from tandem.models.source import load_tokenizer, resolve_model_dir
    from tandem.spec.hot_vocab import count_token_map

    if not args.output.endswith(".json"):
        raise ConfigError(f"--output={args.output!r}: the token map is written as JSON; give a name ending in .json")
    texts = []
    for name in args.files:
        try:
            texts.append(sys.stdin.read() if name == "-" else open(name, encoding="utf-8").read())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {name!r} as UTF-8 text ({e})") from None
    tokenizer = load_tokenizer(resolve_model_dir(args.model, "auto", "--model"))
    if tokenizer is None:
        raise ConfigError(f"--model={args.model!r} has no tokenizer to count tokens with")
    ids = count_token_map(tokenizer, texts, args.size)
    if not ids:
        raise ConfigError(f"the files {args.files} hold no text to count tokens in; give text such as the traffic to "
                          "serve")
    try:
        with open(args.output, "w") as f:
            json.dump(ids, f)
    except OSError as e:
        raise ConfigError(f"--output={args.output!r} cannot be written ({e})") from None
    print(f"{len(ids)} token ids by frequency ({sum(len(t) for t in texts)} characters of text) -> {args.output}")
    return 0


def _draft_model(args) -> str | None:
    """The draft to run, or None; raises ConfigError for draft flags that would be ignored."""
    from tandem.errors import ConfigError

    draft_only = [("--num-speculative-tokens (-k)", args.num_speculative_tokens),
                  ("--draft-sample-method", args.draft_sample_method), ("--adaptive", args.adaptive),
                  ("--draft-quantization", args.draft_quantization), ("--draft-vocab-size", args.draft_vocab_size),
                  ("--rejection-sample-method", args.rejection_sample_method),
                  ("--draft-token-map", args.draft_token_map)]
    draft_flag_conflicts(args, draft_only)
    if args.no_draft:
        for flag, value in [("--draft", args.draft), ("--speculative-config", args.speculative_config),
                            ("--compare", args.compare or None)] + draft_only:
            if value is not None:
                raise ConfigError(f"{flag} conflicts with --no-draft, which runs the target alone; drop one of them")
        return None
    if args.speculative_config is not None:  # _generate passes it on as it is
        return None
    if args.draft is not None:
        return args.draft
    if args.model is None:  # the default target comes with its default draft
        return DEFAULT_DRAFT
    # a --model of the user's own runs alone unless given a --draft: nothing to tune or compare
    for flag, value in draft_only + [("--compare", args.compare or None)]:
        if value is not None:
            raise ConfigError(f"{flag} needs a draft model, and --model without --draft runs the target alone; "
                              f"add --draft PATH or drop {flag.split()[0]}")
    return None


def _generate(args) -> int:
    draft = _draft_model(args)  # before the imports and loads below, so a flag mistake fails fast
    model = DEFAULT_TARGET if args.model is None else args.model

    import torch

    from tandem import LLM, SamplingParams
    from tandem.errors import RequestError

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
            ignore_eos=args.ignore_eos, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            structured_outputs=args.structured_outputs,
        )
    except RequestError as e:  # "SamplingParams.max_tokens=0 ..." -> "--max-tokens=0 ...": the flag that set it
        raise RequestError(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(e))) from None
    # One request: a batch-1 engine (on a GPU one CUDA graph size; --adaptive times batch 1 alone).
    common = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  load_format=args.load_format, download_dir=args.download_dir, hf_overrides=args.hf_overrides,
                  max_num_seqs=1,
                  watermark_config=args.watermark_config,
                  tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
                  quantization=args.quantization, batch_invariant=args.batch_invariant)
    spec = speculative_config_from_flags(args, draft, DEFAULT_K)
    t0 = time.perf_counter()
    llm = LLM(model, speculative_config=spec, **common)
    load_s = time.perf_counter() - t0
    prompt_ids = _prompt_ids(llm.get_tokenizer(), args.prompt, args.chat)
    out, elapsed = _stream(llm, prompt_ids, params, echo=True)
    n = len(out.outputs[0].token_ids)
    m = out.metrics
    if not args.quiet:
        line = f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.2f} tok/s; load {load_s:.1f} s"
        spec_cfg = llm.config.spec
        if m.num_draft_rounds:
            drafts = f"0..{spec_cfg.k}" if spec_cfg.adaptive else spec_cfg.k
            line += (f"; k={drafts}, acceptance rate {m.acceptance_rate:.2f}, "
                     f"mean acceptance length {m.mean_acceptance_length:.2f}")
        elif spec_cfg is not None and spec_cfg.adaptive:  # "auto" judged drafting not worth its cost at every step
            line += f"; k=0..{spec_cfg.k}, no drafts (none judged worth their cost)"
        print("\n" + line + "]", file=sys.stderr)
    else:
        print()  # the completion's line ends
    if args.compare:  # (only with a draft: _draft_model refuses it otherwise)
        low_precision = llm.config.model.dtype != torch.float32
        _release(llm)  # its KV pool took the memory fraction the target-only engine is sized from
        del llm
        base_out, base_s = _stream(LLM(model, **common), prompt_ids, params, echo=False)
        bn = len(base_out.outputs[0].token_ids)
        a, b = base_out.outputs[0].token_ids, out.outputs[0].token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = "yes" if a == b else f"no, from token {first}"
        if a != b and params.temperature == 0 and low_precision:
            same += (" (greedy: in bf16/fp16 the 1 + k row verification can round differently from a 1-row"
                     " decode (on a GPU, or with cpu_matmul='torch'/'fbgemm'), so near-ties can flip; float32"
                     " gives identical tokens)")
        print(
            f"[target alone: {bn} tokens in {base_s:.2f} s: {bn / base_s:.2f} tok/s; speedup "
            f"{(n / elapsed) / (bn / base_s):.2f}x; identical output: {same}]",
            file=sys.stderr,
        )
    return 0


def _release(llm) -> None:
    """Free what an LLM holds (its tensor-parallel ranks, its GPU memory) once the caller drops it."""
    import gc

    import torch

    close = getattr(llm.engine, "close", None)  # a tensor-parallel engine's ranks
    if close is not None:
        close()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _detect(args) -> int:
    """`tandem detect`: encode the text with the model's tokenizer and test it for the key's watermark."""
    from tandem.detect import detect_watermark
    from tandem.errors import ConfigError
    from tandem.models.source import load_tokenizer, resolve_model_dir

    text = sys.stdin.read() if args.text == "-" else args.text
    tok = load_tokenizer(resolve_model_dir(args.model, "auto"))
    if tok is None:
        raise ConfigError(f"--model {args.model} has no tokenizer to encode the text with; pass one that has")
    ids = tok(text, add_special_tokens=False).input_ids
    if args.chat and args.prompt is None:
        raise ConfigError("--chat applies the chat template to --prompt; pass the prompt too")
    prompt_ids = _prompt_ids(tok, args.prompt, args.chat) if args.prompt is not None else None
    found = detect_watermark(ids, args.watermark_config, prompt_ids, p_value_threshold=args.p_value_threshold)
    if found.num_tokens == 0:  # nothing to test: "no" would claim more than the text shows
        print(f"watermarked: unknown (none of the text's {len(ids)} tokens could be scored: a token is scored after "
              "the context its key reads; give a longer text, or --prompt so the first tokens are scored too)")
        return 0
    verdict = "yes" if found.watermarked else "no"
    print(f"watermarked: {verdict} (p-value {found.p_value:.3g} over {found.num_tokens} scored tokens of "
          f"{len(ids)}; score {found.score:.1f}, expected {found.num_tokens} without the watermark)")
    return 0


def _prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids as `generate` feeds them (tok: the model's tokenizer, or None)."""
    from tandem.errors import RequestError

    if tok is None:
        raise RequestError("this model has no tokenizer, so a text prompt cannot be encoded")
    if chat:
        # transformers raises a bare ValueError here; say it in the CLI's terms instead.
        if not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; drop --chat")
        try:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
        except Exception as e:  # a template that fails to render (jinja errors, raise_exception)
            raise RequestError(f"--chat: this model's chat template could not be applied ({e}); drop --chat") from None
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt).input_ids


def _stream(llm, prompt_ids, params, echo: bool):
    engine = llm.engine
    request_id = f"cli-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt_ids, params)
    printed = 0
    start = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            if echo and len(text) > printed:
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
            if out.finished:
                final = out
    return final, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
