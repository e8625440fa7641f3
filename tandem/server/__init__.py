"""OpenAI-compatible HTTP server: protocol (pydantic models), async_engine (the engine loop thread),
api (FastAPI app and `run_server`), metrics (Prometheus).

`add_serve_args` only touches argparse, so the CLI can build its parser without importing FastAPI;
`tandem.server.api.run_server(args)` then serves.
"""
from __future__ import annotations

import argparse
import os
import socket

from tandem.chat import load_chat_template
from tandem.choices import CPU_MATMULS, KV_CACHE_DTYPES, LOGPROBS_MODES, SCHEDULING_POLICIES, SPEC_DECODE_METRICS_LEVELS
from tandem.flags import (BATCH_INVARIANT_HELP, DOWNLOAD_DIR_HELP, DRAFT_TOKEN_MAP_HELP, DRAFT_VOCAB_HELP,
                          KV_CACHE_DTYPE_HELP, QUANTIZATION_HELP, REJECTION_HELP, SPEC_CONFIG_HELP, WATERMARK_HELP, draft_flag_conflicts,
                          float_in, hf_overrides, int_in, non_empty, override_generation_config, size_in,
                          speculative_config, structured_outputs_config, watermark_config)
from tandem.reasoning import REASONING_PARSERS

DEFAULT_K = 4
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json")  # "auto" tool choice's parsers (tandem/server/tools.py)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `tandem serve` flags to parser (a subparser); run_server(args) reads them."""
    model = parser.add_argument_group("model")
    # Every numeric flag is range-checked while parsing (int_in, float_in), before the model loads.
    model.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       type=non_empty("pass a model path or name"), help="target model path or name (as vLLM's "
                                                                         "`vllm serve MODEL`; or --model)")
    model.add_argument("--model", default=None, type=non_empty("pass a model path or name"),
                       help="target model path or name")
    model.add_argument("--draft", default=None, type=non_empty("pass a draft path or name, or leave --draft out"),
                       help="draft model path or name (enables speculative decoding), or ngram: n-gram lookup in "
                            "the context, no draft model (vLLM's method='ngram', prompt_lookup 5..5; other lookups "
                            "through --speculative-config), or suffix: suffix decoding (method='suffix')")
    model.add_argument("--speculative-config", type=speculative_config, default=None, help=SPEC_CONFIG_HELP)
    # The draft-only flags default to None so that check_serve_args can refuse them without --draft.
    model.add_argument("--num-speculative-tokens", "-k", type=int_in(1), default=None,
                       help=f"drafts per step with --draft (default {DEFAULT_K})")
    model.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default=None,
                       help="how the draft picks its tokens, with --draft (default greedy)")
    model.add_argument("--adaptive", action="store_const", const=True, default=None,
                       help="with --draft, each step drafts 0..k tokens, chosen from the measured acceptance and "
                            "step costs (num_speculative_tokens_per_batch_size='auto'; timed at start-up)")
    model.add_argument("--draft-quantization", choices=["fp8"], default=None,
                       help="with --draft, the draft's linear weights in fp8 (weight-only e4m3)")
    model.add_argument("--rejection-sample-method", choices=["standard", "block"], default=None,
                       help=f"with --draft, {REJECTION_HELP}")
    model.add_argument("--draft-vocab-size", type=int_in(1), default=None, help=DRAFT_VOCAB_HELP)
    model.add_argument("--draft-token-map", default=None, type=non_empty("pass a token map file"),
                       help=DRAFT_TOKEN_MAP_HELP)
    model.add_argument("--tokenizer", default=None, type=non_empty("pass a tokenizer path, or leave --tokenizer out"),
                       help="tokenizer path (default: the model's)")
    model.add_argument("--served-model-name", action="extend", nargs="+", default=None, type=non_empty("pass a name"),
                       help="names clients use for the model (several after one flag, as vLLM, or the flag repeated; "
                            "the first names it in /metrics; default: the model as given)")
    model.add_argument("--dtype", default="auto")
    model.add_argument("--device", default="auto")
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    model.add_argument("--download-dir", default=None, type=non_empty("pass a directory"), help=DOWNLOAD_DIR_HELP)
    model.add_argument("--seed", type=int_in(0), default=0)
    model.add_argument("--logprobs-mode", default="raw_logprobs", choices=list(LOGPROBS_MODES),
                       help="returned logprobs: the model's (default, as vLLM) or the sampled distribution's")
    model.add_argument("--max-logprobs", type=int_in(-1), default=20,
                       help="the most logprobs a request may ask per token (default 20; -1: no cap)")
    model.add_argument("--watermark-config", type=watermark_config, default=None, help=WATERMARK_HELP)
    model.add_argument("--generation-config", default="auto", type=non_empty("pass 'auto', 'vllm' or a directory"),
                       help="sampling defaults for fields a request leaves out: 'auto' (the model's "
                            "generation_config.json, as vLLM), 'vllm' (the engine's own) or a directory")
    model.add_argument("--hf-overrides", type=hf_overrides, default=None,
                       help="config.json keys set over the model's, as a JSON object (vLLM's), e.g. "
                            "'{\"max_position_embeddings\": 4096}'")
    model.add_argument("--override-generation-config", type=override_generation_config, default=None,
                       help="sampling defaults set over --generation-config's, as a JSON object (vLLM's), e.g. "
                            "'{\"temperature\": 0.5, \"max_new_tokens\": 256}'")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=size_in(1), default=None,
                        help="the longest prompt + output, in tokens (default: the model's; units as vLLM: 32k, 32K)")
    engine.add_argument("--max-num-seqs", type=int_in(1), default=64, help="sequences per batch (default 64)")
    engine.add_argument("--max-num-batched-tokens", type=size_in(1), default=None,
                        help="tokens per step, prefill chunks included (units as vLLM: 8k, 8K)")
    engine.add_argument("--block-size", type=int_in(1), default=16)
    engine.add_argument("--kv-cache-memory-bytes", type=size_in(1), default=None,
                        help="the KV cache's size in bytes, instead of --gpu-memory-utilization's share (units as "
                             "vLLM: 8G = 8 * 2**30, 8g = 8e9)")
    engine.add_argument("--gpu-memory-utilization", type=float_in(0, 1, lo_open=True), default=0.9,
                        help="the share of the GPU's total memory the process may hold (weights, activations, CUDA "
                             "graphs, KV cache; default 0.9); start-up is refused when less is free, and unlike vLLM "
                             "memory other processes hold counts against it")
    engine.add_argument("--num-gpu-blocks-override", type=int_in(1), default=None,
                        help="the KV pool's size in blocks, instead of the one profiling gives (vLLM's flag)")
    engine.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto", help=KV_CACHE_DTYPE_HELP)
    engine.add_argument("--quantization", "-q", choices=["fp8"], default=None, help=QUANTIZATION_HELP)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of prompt blocks seen before (default on, as vLLM)")
    engine.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching",
                        help="the same as --no-enable-prefix-caching")
    engine.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default="fcfs",
                        help="fcfs (default): requests run in arrival order; priority: by each request's 'priority' "
                             "field (lower first, then arrival), a waiting request preempting running ones of a "
                             "lower priority")
    engine.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                        help="run every step eagerly: no CUDA graphs (slower; start-up is quicker and takes less memory)")
    engine.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    engine.add_argument("--tensor-parallel-size", "-tp", type=int_in(1), default=1,
                        help="ranks (GPUs, or CPU processes) sharing each layer (default 1)")
    engine.add_argument("--max-cudagraph-tokens", type=int_in(0), default=512,
                        help="the largest mixed or ragged step run on piecewise CUDA graphs (default 512; 0: such "
                             "steps run eagerly)")
    engine.add_argument("--cpu-matmul", choices=list(CPU_MATMULS), default="auto",
                        help="a CPU model's linears: 'auto' (the best of tandem's C builds the CPU runs), a build by "
                             "name, 'fbgemm' or 'torch'")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan each step while the device runs the last one (default: on for a GPU without a "
                             "draft model; with one, the host already works while the device drafts)")
    # vLLM's flags that ask for nothing here, taken as LLM() takes them (and refused where they ask for more)
    engine.add_argument("--trust-remote-code", action="store_true",
                        help="vLLM's flag, accepted: tandem runs no code from a checkpoint (its architectures are "
                             "its own)")
    engine.add_argument("--tokenizer-mode", default="auto", help="auto or hf (the model's Hugging Face tokenizer)")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM's flag: prompts are always chunked by --max-num-batched-tokens")
    engine.add_argument("--swap-space", type=float_in(0), default=None,
                        help="vLLM's flag, unused: a preemption recomputes the request")
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int_in(1), default=1,
                        help="vLLM's flag: 1 only (tandem splits a model by --tensor-parallel-size)")
    engine.add_argument("--distributed-executor-backend", default=None,
                        help="vLLM's flag: mp (tandem's ranks are processes), or uni with one rank")
    engine.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="vLLM's flag, accepted: tensor parallelism reduces through NCCL")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1: this machine only, where vLLM listens on "
                             "every interface; 0.0.0.0 for every interface, as in a container)")
    server.add_argument("--port", type=int_in(0, 65535), default=8000)
    server.add_argument("--root-path", default="", help="the path prefix a proxy serves the app under (ASGI root_path)")
    server.add_argument("--ssl-keyfile", default=None, type=non_empty("pass a key file"), help="serve HTTPS: the key")
    server.add_argument("--ssl-certfile", default=None, type=non_empty("pass a certificate file"),
                        help="serve HTTPS: the certificate (with --ssl-keyfile)")
    server.add_argument("--ssl-ca-certs", default=None, type=non_empty("pass a CA certificates file"),
                        help="with HTTPS: the CA certificates that client certificates are checked against")
    server.add_argument("--ssl-cert-reqs", default=0, type=int_in(0, 2),
                        help="with HTTPS: client certificates 0 not asked for (default), 1 checked if sent, 2 required "
                             "(mutual TLS; Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED; 1 and 2 need "
                             "--ssl-ca-certs)")
    server.add_argument("--allowed-origins", action="extend", default=None, type=name_list("an origin"),
                        help="browser origins allowed to call the API (CORS; repeatable, or vLLM's JSON list; '*' for "
                             "any; default none, where vLLM allows any)")
    server.add_argument("--allowed-methods", action="extend", default=None, type=name_list("a method"),
                        help="with --allowed-origins: the methods allowed (default any)")
    server.add_argument("--allowed-headers", action="extend", default=None, type=name_list("a header"),
                        help="with --allowed-origins: the request headers allowed (default any)")
    server.add_argument("--allow-credentials", action="store_true", help="with --allowed-origins: allow credentials")
    server.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name each token 'token_id:N' rather than by its text (as vLLM's flag: a token "
                             "that is only part of a character has no text of its own)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="completion and chat usage carry prompt_tokens_details.cached_tokens: the prompt tokens "
                             "the prefix cache served (as vLLM's flag)")
    server.add_argument("--max-queued-requests", type=int_in(0), default=256,
                        help="sequences allowed to wait for a batch slot before requests get 503 (default 256; "
                             "with --scheduling-policy priority, what waits ahead of a request counts, and the "
                             "latest unstarted requests of a lower priority are refused to make way)")
    server.add_argument("--shutdown-timeout", type=float_in(0), default=30.0,
                        help="seconds to let requests in flight finish on shutdown before aborting them")
    server.add_argument("--api-key", action="extend", nargs="+", default=None, type=non_empty("pass a key"),
                        help="the /v1 routes answer only requests with 'Authorization: Bearer KEY' (any of the keys: "
                             "several after one flag, as vLLM, or the flag repeated; default: the TANDEM_API_KEY "
                             "environment variable, else vLLM's VLLM_API_KEY, if set; else open)")
    server.add_argument("--chat-template", default=None, type=non_empty("pass a template file or text"),
                        help="the chat template to use instead of the tokenizer's: a Jinja file's path, or the "
                             "template's text")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="run chat templates sent in requests (a template is code; refused by default)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (the default with tools): the model decides whether to call '
                             "and --tool-call-parser finds the calls in its text")
    server.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                        help="how calls read in the model's text, with --enable-auto-tool-choice (hermes: "
                             "<tool_call>{...}</tool_call>, as Qwen2.5's template asks; llama3_json / "
                             "llama4_json: a reply of {\"name\": ..., \"parameters\": {...}} calls, as Llama 3.1's)")
    server.add_argument("--structured-outputs-config", type=structured_outputs_config, default=None,
                        help="vLLM's JSON object; '{\"enable_in_reasoning\": true}' holds constraints from the "
                             "first token, the thinking too")
    server.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="a reasoning model's <think> part goes to the reply's 'reasoning' field, and "
                             "structured outputs hold after it (as vLLM's --reasoning-parser)")
    server.add_argument("--enable-per-request-metrics", action="store_true",
                        help="responses carry vLLM's `metrics` object: time to first token, generation and queue "
                             "time, mean inter-token latency and tokens/s of the request (n = 1, one prompt)")
    server.add_argument("--per-request-spec-decode-metrics", choices=list(SPEC_DECODE_METRICS_LEVELS), default=None,
                        help="with a draft, responses carry the request's acceptance figures as vLLM's "
                             "metrics.speculative_decoding: 'summary' (counts, acceptance histograms) or 'detailed' "
                             "(and each round's accepted and drafted counts); default none")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with the usage chunk (and the metrics object), as if each request "
                             "set stream_options.include_usage")
    server.add_argument("--responses-store-size", type=int_in(0), default=0,
                        help="keep the last N /v1/responses responses (those not sent with store false), for "
                             "previous_response_id and GET / DELETE /v1/responses/{id}; default 0: none kept, and "
                             "previous_response_id is refused")
    server.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                        help="how messages' content reaches the chat template: detected from the template "
                             "(auto, the default, as vLLM), joined text (string) or a list of parts (openai)")
    server.add_argument("--response-role", default="assistant", type=non_empty("pass a role name"),
                        help="the role of chat replies when the request has add_generation_prompt (the default; "
                             "as vLLM's flag, default 'assistant')")
    server.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="log each request received: its prompt, token ids and sampling parameters (vLLM's flag; "
                             "default off)")
    server.add_argument("--disable-log-requests", action="store_false", dest="enable_log_requests",
                        help="the same as --no-enable-log-requests (vLLM's older flag)")
    server.add_argument("--max-log-len", type=int_in(0), default=None,
                        help="with --enable-log-requests: the characters of a prompt and the token ids logged "
                             "(default all)")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic speculative decoding line in the log (vLLM's flag; by default every 10 s "
                             "that verified drafts: acceptance, accepted and drafted tokens a second)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def name_list(what: str):
    """argparse type: one name, or vLLM's form, a JSON list of them ('["https://a.example"]')."""
    import json

    def parse(text: str) -> list[str]:
        if text.lstrip().startswith("["):
            try:
                names = json.loads(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list ({e}); pass {what}, or a JSON list "
                                                 "of them") from None
        else:
            names = [text]
        if not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise argparse.ArgumentTypeError(f"pass {what} (a non-empty string), or a JSON list of them")
        return names

    return parse


def check_listen_address(host: str, port: int) -> None:
    """Refuse a --host that names no address here, or a --port another process holds, before the
    model loads (uvicorn would find out only after it, with a message naming neither flag). The
    trial socket is closed again: a process that takes the port in between still makes uvicorn fail."""
    from tandem.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({e}); give one such as 127.0.0.1 "
                          "(this machine only) or 0.0.0.0 (every interface)") from None
    if port == 0:  # any free port: nothing to check
        return
    with socket.socket(family, kind, proto) as trial:
        trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            trial.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on --host {host} --port {port}: {e.strerror}; choose another --port "
                              "(or --host), or stop the process that holds it") from None


class _EncryptedKey(Exception):
    pass


def _ask_no_password():
    raise _EncryptedKey


def _check_tls_files(args: argparse.Namespace) -> None:
    """Load the HTTPS files now, not once the model is loaded: a file that is not PEM, or a key that
    is not its certificate's, is a ConfigError naming the flags (it was ssl.SSLError's traceback at
    the server's start). An encrypted key is left to uvicorn, which asks for its password."""
    import ssl

    from tandem.errors import ConfigError

    if args.ssl_keyfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=_ask_no_password)
    except _EncryptedKey:
        pass
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--ssl-certfile {args.ssl_certfile!r} and --ssl-keyfile {args.ssl_keyfile!r} are not a PEM "
                          f"certificate and its private key ({e}); give those files") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs {args.ssl_ca_certs!r} holds no PEM CA certificate ({e}); give such "
                              "a file") from None


def check_serve_args(args: argparse.Namespace) -> None:
    """Resolve the model to serve (vLLM's positional MODEL, or --model) into args.model, and refuse
    flag combinations that would be silently ignored (ranges are checked while parsing)."""
    from tandem.errors import ConfigError

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}; give it once")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ConfigError("no model to serve; give its path or name: tandem serve MODEL")
    draft_only = [("--num-speculative-tokens (-k)", args.num_speculative_tokens),
                  ("--draft-sample-method", args.draft_sample_method), ("--adaptive", args.adaptive),
                  ("--draft-quantization", args.draft_quantization),
                  ("--draft-vocab-size", args.draft_vocab_size), ("--draft-token-map", args.draft_token_map),
                  ("--rejection-sample-method", args.rejection_sample_method)]
    draft_flag_conflicts(args, draft_only)
    metrics = args.per_request_spec_decode_metrics
    if args.draft is None and args.speculative_config is None:
        for flag, value in draft_only + [("--per-request-spec-decode-metrics", None if metrics == "none" else metrics)]:
            if value is not None:
                raise ConfigError(f"{flag} needs a draft model; add --draft PATH (or --speculative-config) or drop "
                                  f"{flag.split()[0]}")
    cors_only = [("--allowed-methods", args.allowed_methods), ("--allowed-headers", args.allowed_headers),
                 ("--allow-credentials", args.allow_credentials or None)]
    for flag, value in cors_only:
        if value is not None and not args.allowed_origins:
            raise ConfigError(f"{flag} applies to CORS, which --allowed-origins turns on; add --allowed-origins ORIGIN "
                              f"or drop {flag}")
    if args.allow_credentials and "*" in args.allowed_origins:
        raise ConfigError("--allow-credentials with --allowed-origins '*' lets any site act with a user's credentials "
                          "(and browsers refuse it); name the origins")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile; give both or neither")
    if args.ssl_keyfile is None:
        for flag, value in (("--ssl-ca-certs", args.ssl_ca_certs), ("--ssl-cert-reqs", args.ssl_cert_reqs or None)):
            if value is not None:
                raise ConfigError(f"{flag} applies to HTTPS, which --ssl-keyfile and --ssl-certfile turn on; add them "
                                  f"or drop {flag}")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} checks client certificates against CA certificates; "
                          "give them with --ssl-ca-certs FILE")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag}: no file {path!r}; give the path of a PEM file")
    _check_tls_files(args)
    for variable in ("TANDEM_API_KEY", "VLLM_API_KEY"):  # vLLM's variable too: a key it guarded stays needed
        if args.api_key is None and os.environ.get(variable):
            args.api_key = [os.environ[variable]]
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)  # the text; a missing file fails here
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser to find the calls in the model's text; "
                          f"add --tool-call-parser {TOOL_CALL_PARSERS[0]}")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        raise ConfigError('--tool-call-parser is used only by tool_choice "auto"; add --enable-auto-tool-choice or drop '
                          "--tool-call-parser")
    check_listen_address(args.host, args.port)  # last: the flags' own mistakes are named first
