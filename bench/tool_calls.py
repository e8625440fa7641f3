"""Tool calling through the OpenAI API, target-only and with the draft model.

    python bench/tool_calls.py           # CPU: the real Qwen2.5-Coder pair, 5 tasks, k = 0, 4

Each task is a chat request with the same four tools, one of which fits it. For each k in --ks
(0: target-only) a server (build_app with the hermes parser, in process) answers every task
greedily with each tool_choice: "auto" (the model decides and writes a <tool_call> block, which
the parser reads), "required" (the output held to a JSON array of calls) and the named function
(the output held to its arguments). Reported per configuration: how many replies called the
task's function with arguments that fit its schema, the completion tokens, tokens/s (completion
tokens over the requests' time, prefill included), the draft acceptance rate and mean acceptance
length, and the share of speculative replies identical to target-only's (call ids aside). Every
prompt (the same for all three choices) is prefilled once first, into the prefix cache, so
tokens/s is mostly decoding.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)

from bench.common import environment, print_results, write_json  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _function("get_weather", "Current weather of a city.",
              {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _function("search_code", "Search the repository's code.",
              {"query": {"type": "string"}, "language": {"type": "string"}, "max_results": {"type": "integer"}},
              ["query"]),
    _function("run_tests", "Run the test suite, or the tests under a path.",
              {"path": {"type": "string"}, "verbose": {"type": "boolean"}}, []),
    _function("convert_currency", "Convert an amount between currencies.",
              {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
              ["amount", "from_currency", "to_currency"]),
]
TASKS = [
    ("What's the weather like in Lisbon right now, in celsius?", "get_weather"),
    ("Find where the function parse_config is defined in our Python code.", "search_code"),
    ("Run the tests in tests/engine and show me verbose output.", "run_tests"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Is it raining in Tokyo?", "get_weather"),
]
MODES = ("auto", "required", "named")


def fits(call: dict, name: str) -> bool:
    """call names the function and its arguments parse, with the required fields and no unknown ones."""
    if call["function"]["name"] != name:
        return False
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    return isinstance(args, dict) and set(schema["required"]) <= set(args) <= set(schema["properties"])


def run(client, model: str, mode: str, tokens: int) -> list[dict]:
    rows = []
    for question, name in TASKS:
        choice = {"type": "function", "function": {"name": name}} if mode == "named" else mode
        body = {"model": model, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                "tool_choice": choice, "temperature": 0, "max_tokens": tokens}
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", json=body)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{mode}: {r.status_code} {r.text}")
        out = r.json()
        choice_out = out["choices"][0]
        calls = choice_out["message"]["tool_calls"]
        spec = (out.get("metrics") or {}).get("speculative_decoding") or {}
        rows.append(dict(seconds=seconds, tokens=out["usage"]["completion_tokens"],
                         reply=json.dumps(choice_out["message"], sort_keys=True),
                         calls=[c["function"] for c in calls], content=choice_out["message"]["content"],
                         finish=choice_out["finish_reason"], fits=bool(calls) and fits(calls[0], name),
                         drafts=spec.get("num_draft_tokens", 0), accepted=spec.get("num_accepted_draft_tokens", 0),
                         rounds=spec.get("num_spec_steps", 0)))
    return rows


def summarize(name: str, rows: list[dict], ref: list[dict] | None) -> dict:
    out = {"config": name, "right_call": f"{sum(r['fits'] for r in rows)}/{len(rows)}",
           "tokens": sum(r["tokens"] for r in rows),
           "tok_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)}
    drafts, rounds = sum(r["drafts"] for r in rows), sum(r["rounds"] for r in rows)
    if drafts:
        accepted = sum(r["accepted"] for r in rows)
        out.update(acceptance_rate=accepted / drafts, mean_acceptance_length=1 + accepted / rounds)
    if ref is not None:
        same = sum(_without_ids(a["reply"]) == _without_ids(b["reply"]) for a, b in zip(rows, ref))
        out["identical_to_target"] = same / len(rows)
    return out


def _without_ids(reply: str) -> str:
    message = json.loads(reply)
    for call in message["tool_calls"]:
        call.pop("id")
    return json.dumps(message, sort_keys=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--ks", default="0,4", help="draft lengths (0: target-only)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="bench/results/tool_calls.json")
    args = p.parse_args(argv)

    from fastapi.testclient import TestClient

    from tandem import LLM
    from tandem.server.api import build_app

    results, replies, ref = [], {}, {}
    for k in [int(x) for x in args.ks.split(",")]:
        spec = dict(model=args.draft, num_speculative_tokens=k) if k else None
        llm = LLM(args.target, dtype=args.dtype, device=args.device, max_model_len=2048, speculative_config=spec,
                  per_request_spec_decode_metrics="summary")
        with TestClient(build_app(llm, "bench", tool_call_parser="hermes")) as client:
            run(client, "bench", "named", 1)  # warm-up: the grammar tables, and every prompt in the prefix cache
            for mode in MODES:
                rows = run(client, "bench", mode, args.tokens)
                if not k:
                    ref[mode] = rows
                row = summarize(f"{'target-only' if not k else f'k={k}'}, {mode}", rows, ref.get(mode) if k else None)
                replies[row["config"]] = [dict(calls=r["calls"], content=r["content"], finish=r["finish"]) for r in rows]
                results.append(row)
        del llm
    cols = ["config", "right_call", "tokens", "tok_s", "acceptance_rate", "mean_acceptance_length",
            "identical_to_target"]
    print_results(cols, results)
    write_json(args.out, {"environment": environment(), "args": vars(args), "results": results, "replies": replies})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
