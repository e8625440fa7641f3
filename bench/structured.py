"""Structured outputs beside free generation, target-only and with the draft model.

    python bench/structured.py                  # CPU: the real Qwen2.5-Coder pair, 5 JSON tasks, k = 0, 4
    python bench/structured.py --device cuda --load-format dummy --compact \\
        --target DIR --draft DIR                # GPU: a step's cost on random weights (real shapes and tokenizer)

Each task is a chat request with a JSON schema. For each k in --ks (0: target-only) the same
greedy requests run one at a time, free and then constrained by their schema (stopping at EOS or
--tokens); with a draft, constrained a second time with the drafts proposed free of the grammar
(vLLM's way; grammar-aware drafting switched off on the engine, for this A/B only). Reported per configuration: tokens/s (prefill included), decode tokens/s and ms per
decode step (a decode step, or a draft round and its verification; from the first token to the
last), the draft acceptance rate and mean acceptance length, the share of
outputs that parse as JSON and fit the schema (free outputs: the JSON inside a ``` fence when
there is one), and the share of speculative outputs equal to target-only's in the same mode.
On random weights (--load-format dummy) only the step times mean anything: the drafts of a
random model rarely fit a grammar. --compact disables JSON's free whitespace, which a random
model would pad with until --tokens.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)

from bench.common import environment, print_results, write_json  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
_STR = {"type": "string", "maxLength": 40}
TASKS = [
    ("Extract the person from this sentence as JSON with name, age and city: "
     "'Maria Lopez, 34, moved from Madrid to Lisbon last year.'",
     {"type": "object", "properties": {"name": _STR, "age": {"type": "integer"}, "city": _STR},
      "required": ["name", "age", "city"]}),
    ("Describe the Python function `def add(a, b): return a + b` as a JSON object with its name, "
     "the number of arguments and what it returns.",
     {"type": "object", "properties": {"name": _STR, "num_args": {"type": "integer"}, "returns": _STR},
      "required": ["name", "num_args", "returns"]}),
    ("List three prime numbers below 20 as JSON, in a field named primes.",
     {"type": "object", "properties": {"primes": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
      "required": ["primes"]}),
    ("Classify the sentiment of 'The update broke my build again.' Reply in JSON with a label "
     "(positive, negative or neutral) and a confidence between 0 and 1.",
     {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["label", "confidence"]}),
    ("Name a Python package for parsing TOML files and describe it in one line, as JSON with the "
     "fields package and description.",
     {"type": "object", "properties": {"package": _STR, "description": _STR}, "required": ["package", "description"]}),
]


def fits(text: str, schema: dict) -> bool:
    """text (or the JSON inside its first ``` fence) parses, with the schema's required fields and types."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return False
    if not isinstance(value, dict) or not set(schema["required"]) <= set(value):
        return False
    kinds = {"string": str, "integer": int, "number": (int, float), "array": list}
    return all(isinstance(value[k], kinds[s["type"]]) if "type" in s else value[k] in s["enum"]
               for k, s in schema["properties"].items() if k in value)


def run(llm, prompts, tokens: int, constrained: bool, compact: bool) -> list[dict]:
    from tandem import SamplingParams, StructuredOutputsParams

    rows = []
    for i, (ids, schema) in enumerate(prompts):
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact) if constrained else None
        params = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=so)
        if i == 0:  # warm-up (and the tokenizer's grammar tables on first use)
            llm.generate({"prompt_token_ids": ids}, params.clone(max_tokens=8), use_tqdm=False)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        m, seq = out.metrics, out.outputs[0]
        # decode: the steps after the prefill's first token (each a decode step, or a draft round and its
        # verification), timed from that token to the last
        rows.append(dict(seconds=seconds, tokens=len(seq.token_ids), token_ids=seq.token_ids, text=seq.text,
                         decode_seconds=m.last_token_time - m.first_token_time,
                         decode_steps=m.num_draft_rounds or len(seq.token_ids) - 1, drafts=m.num_draft_tokens,
                         accepted=m.num_accepted_tokens, rounds=m.num_draft_rounds, fits=fits(seq.text, schema)))
    return rows


def summarize(name: str, rows: list[dict], ref: list[dict] | None) -> dict:
    decode_seconds = sum(r["decode_seconds"] for r in rows)
    out = {"config": name, "tok_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
           "decode_tok_s": sum(r["tokens"] - 1 for r in rows) / decode_seconds,
           "ms_per_step": 1e3 * decode_seconds / sum(r["decode_steps"] for r in rows),
           "tokens": sum(r["tokens"] for r in rows), "fits_schema": sum(r["fits"] for r in rows) / len(rows)}
    drafts, rounds = sum(r["drafts"] for r in rows), sum(r["rounds"] for r in rows)
    if drafts:
        accepted = sum(r["accepted"] for r in rows)
        out.update(acceptance_rate=accepted / drafts, mean_acceptance_length=1 + accepted / rounds)
    if ref is not None:
        out["identical_to_target"] = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows, ref)) / len(rows)
    out["texts"] = [r["text"] for r in rows]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--ks", default="0,4", help="draft lengths (0: target-only)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--tasks", type=int, default=len(TASKS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--compact", action="store_true", help="JSON without free whitespace (disable_any_whitespace)")
    p.add_argument("--out", default="bench/results/structured.json")
    args = p.parse_args(argv)

    from tandem import LLM

    results, texts = [], {}
    prompts, ref = None, {}
    for k in [int(x) for x in args.ks.split(",")]:
        spec = dict(model=args.draft, num_speculative_tokens=k, draft_load_format=args.load_format) if k else None
        llm = LLM(args.target, dtype=args.dtype, device=args.device, load_format=args.load_format,
                  max_model_len=1024, speculative_config=spec)
        if prompts is None:
            tok = llm.tokenizer
            prompts = [(tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False).input_ids, s)
                       for q, s in TASKS[: args.tasks]]
        modes = ["free", "constrained"] + (["constrained, free drafts"] if k else [])
        for mode in modes:
            if mode == "constrained, free drafts":  # as vLLM: drafts proposed without the grammar (A/B only)
                llm.engine.grammar_drafting = None
            rows = run(llm, prompts, args.tokens, mode != "free", args.compact)
            if not k:
                ref[mode] = rows
            ref_rows = ref.get("free" if mode == "free" else "constrained") if k else None
            row = summarize(f"{'target-only' if not k else f'k={k}'}, {mode}", rows, ref_rows)
            texts[row["config"]] = row.pop("texts")
            results.append(row)
        del llm
    cols = ["config", "tok_s", "decode_tok_s", "ms_per_step", "tokens", "acceptance_rate", "mean_acceptance_length", "fits_schema",
            "identical_to_target"]
    print_results(cols, results)
    write_json(args.out, {"environment": environment(), "args": vars(args), "results": results, "texts": texts})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
