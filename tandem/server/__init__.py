"""OpenAI-compatible HTTP server: protocol (pydantic models), async_engine (the engine loop thread),
api (FastAPI app and `run_server`), metrics (Prometheus).

`add_serve_args` only touches argparse, so the CLI can build its parser without importing FastAPI;
`tandem.server.api.run_server(args)` then serves.
"""
from __future__ import annotations

import argparse

DEFAULT_K = 4


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `tandem serve` flags to parser (a subparser); run_server(args) reads them."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", required=True, help="target model path or name")
    model.add_argument("--draft", default=None, help="draft model path or name (enables speculative decoding)")
    model.add_argument("--num-speculative-tokens", "-k", type=int, default=DEFAULT_K,
                       help=f"drafts per step with --draft (default {DEFAULT_K})")
    model.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy")
    model.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    model.add_argument("--served-model-name", action="append", default=None,
                       help="name clients use for the model (repeatable; default: --model)")
    model.add_argument("--dtype", default="auto")
    model.add_argument("--device", default="auto")
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                       help="returned logprobs: the model's (default, as vLLM) or the sampled distribution's")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default 64)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--no-prefix-caching", action="store_true")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--max-queued-requests", type=int, default=256,
                        help="sequences allowed to wait for a batch slot before requests get 503 (default 256)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let requests in flight finish on shutdown before aborting them")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser
