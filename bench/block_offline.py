"""Block verification against the one-at-a-time test on the real Qwen2.5-Coder pair, like for like (CPU).

    python bench/block_offline.py                     # k = 4, 10 prompts, 48-token contexts every 6 tokens
    python bench/block_offline.py --k 6 --blocks 3

Measured in the engine, the two tests sample different outputs, so their drafts meet different
contexts and the counts differ by more than the tests do. Here both judge the same draft blocks:
for each prompt, a target-only sampled continuation (temperature 1) gives the contexts; at every
--stride tokens along it the draft samples --blocks blocks of k tokens (temperature 1, no
truncation), the target scores each block in one forward, and each test's expected number of
accepted drafts is computed exactly from the two models' distributions (no uniforms drawn):
standard sum_i prod_(j <= i) min(1, p_j(x_j) / q_j(x_j)); block sum_i i h_i prod_(j > i) (1 - h_j),
with h from the running ratio and the residual mass (tandem/spec/rejection.py). Models in
float32 through transformers, as the tests' references.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)
import torch  # noqa: E402

from bench.common import environment, print_table, write_json  # noqa: E402
from bench.real_pair import DRAFT, TARGET, prompt_ids  # noqa: E402

NEUTRAL = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


def expected_accepted(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """p [k+1, V], q [k, V] probabilities (float64), x [k] the drafts -> (standard, block) E[accepted]."""
    k = x.shape[0]
    r = p[torch.arange(k), x] / q[torch.arange(k), x]
    standard = float(torch.cumprod(r.clamp(max=1.0), 0).sum())
    ratios, h = [1.0], []
    for i in range(1, k + 1):
        ratios.append(min(1.0, ratios[-1] * float(r[i - 1])))
        if i < k:
            rho = float((ratios[i] * p[i] - q[i]).clamp(min=0).sum())
            h.append(rho / (rho + 1 - ratios[i]) if rho + 1 - ratios[i] > 0 else 1.0)
        else:
            h.append(ratios[k])
    block = 0.0
    for i in range(1, k + 1):
        later = 1.0
        for j in range(i + 1, k + 1):
            later *= 1 - h[j - 1]
        block += i * h[i - 1] * later
    return standard, block


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=5, help="prompts per class")
    p.add_argument("--tokens", type=int, default=48, help="the target's continuation per prompt (the contexts)")
    p.add_argument("--stride", type=int, default=6, help="a context every STRIDE tokens along it")
    p.add_argument("--blocks", type=int, default=2, help="draft blocks sampled per context")
    p.add_argument("--out", default="bench/results/block_offline.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.models.hub import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(TARGET, torch.bfloat16))
    target = AutoModelForCausalLM.from_pretrained(resolve_model(TARGET, torch.bfloat16), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(resolve_model(DRAFT, torch.bfloat16), dtype=torch.float32).eval()
    results = {"env": environment(), "config": vars(args), "classes": {}}
    torch.manual_seed(0)
    for cls, ids in prompt_ids(tok, args.prompts):
        with torch.no_grad():
            ctx_all = target.generate(torch.tensor([ids]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                      pad_token_id=0, **NEUTRAL)[0]
            for t in range(0, args.tokens, args.stride):
                ctx = ctx_all[: len(ids) + t][None]
                for _ in range(args.blocks):
                    out = draft.generate(ctx, max_new_tokens=args.k, min_new_tokens=args.k, pad_token_id=0,
                                         output_logits=True, return_dict_in_generate=True, **NEUTRAL)
                    x = out.sequences[0, ctx.shape[1]:]
                    q = torch.stack(out.logits)[:, 0].double().softmax(-1)  # [k, V]
                    logits = target(torch.cat([ctx, x[None]], 1)).logits[0, ctx.shape[1] - 1:]  # [k+1, V]
                    s, b = expected_accepted(logits.double().softmax(-1), q, x)
                    results["classes"].setdefault(cls, []).append((s, b))
        print(cls, len(results["classes"][cls]), flush=True)
    rows = []
    for cls, pairs in results["classes"].items():
        s = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
        b = torch.tensor([c for _, c in pairs], dtype=torch.float64)
        d = b - s
        rows.append((cls, len(pairs), f"{s.mean():.3f}", f"{b.mean():.3f}", f"{d.mean():+.3f} +- {d.std() / len(d) ** 0.5:.3f}",
                     f"{float((d >= -1e-9).double().mean()):.2f}"))
        results[cls] = dict(blocks=len(pairs), standard=float(s.mean()), block=float(b.mean()),
                            gain=float(d.mean()), gain_se=float(d.std() / len(d) ** 0.5))
    write_json(args.out, results)
    print_table([f"k = {args.k}", "draft blocks", "standard E[accepted]", "block E[accepted]", "gain (+- se)",
                 "blocks with block >= standard"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
