"""Speculative decoding: batch-1 greedy decode with n-gram drafts against without.

Two engines on the default model in this one process, float32, greedy:
plain decoding (the baseline) and ``speculative="ngram"``. Each prompt runs
on both, alternating which goes first, so the machine's drift hits both
alike. Two tasks:

- grounded: the chat model is asked to repeat a passage of this repository's
  own docs word for word (what extraction, quoting and editing look like);
- chat: open-ended questions, where the output rarely repeats the prompt.

Speed is output tokens over wall time of ``generate`` (prefill included, as a
user sees it) and over the decode phase alone (first token to last). The
outputs must be token for token identical. Acceptance is the engine's own
``accepted / draft`` token count.

    python benchmarks/speculative.py [--k 4] [--max-tokens 128] [--out PATH]

Writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from _server import vm_hwm_mb, vm_rss_mb  # the script's folder

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "speculative.json"

CHAT_QUESTIONS = [
    "What makes a good breakfast?",
    "Describe a walk through a forest in autumn.",
    "Why do people enjoy music?",
    "Give me some tips for learning to cook.",
    "What would you pack for a week at the beach?",
    "Explain how a bicycle works.",
]


def passages(count: int) -> list[str]:
    """Plain-prose paragraphs of 250-700 characters from the repo's docs."""
    found: list[str] = []
    for doc in ("docs/architecture.md", "README.md", "docs/metrics.md", "benchmarks/serving.md"):
        text = (ROOT / doc).read_text()
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 250 <= len(para) <= 700 and not para.startswith(("|", "#", "```", "-", "*")):
                found.append(para)
    if len(found) < count:
        raise SystemExit(f"only {len(found)} passages found in the docs, need {count}")
    return found[:count]


def run_one(llm, ids: list[int], params) -> dict:  # noqa: ANN001
    start = time.perf_counter()
    out = llm.generate([ids], params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    m = out.metrics
    tokens = out.outputs[0].token_ids
    return {
        "tokens": tokens,
        "wall_s": wall,
        "decode_s": max(m.finish_time - m.first_token_time, 1e-9),
    }


def run_task(plain, spec, prompts: list[list[int]], params) -> dict:  # noqa: ANN001
    sched = spec.engine.scheduler
    drafted0, accepted0, steps0 = sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens, sched.spec_num_drafts
    totals = {"plain": [0, 0.0, 0.0], "spec": [0, 0.0, 0.0]}  # tokens, wall, decode
    identical = 0
    for i, ids in enumerate(prompts):
        order = [("plain", plain), ("spec", spec)] if i % 2 == 0 else [("spec", spec), ("plain", plain)]
        results = {}
        for name, llm in order:
            r = run_one(llm, ids, params)
            results[name] = r
            t = totals[name]
            t[0] += len(r["tokens"])
            t[1] += r["wall_s"]
            # Decode-phase rate counts the tokens after the first.
            t[2] += r["decode_s"]
        identical += results["plain"]["tokens"] == results["spec"]["tokens"]
    drafted = sched.spec_num_draft_tokens - drafted0
    accepted = sched.spec_num_accepted_tokens - accepted0
    steps = sched.spec_num_drafts - steps0

    def rate(name: str, phase: int) -> float:
        tokens = totals[name][0] - (len(prompts) if phase == 2 else 0)
        return tokens / totals[name][phase]

    return {
        "prompts": len(prompts),
        "identical_outputs": identical,
        "output_tokens": totals["plain"][0],
        "plain_tok_s": rate("plain", 1),
        "spec_tok_s": rate("spec", 1),
        "speedup": rate("spec", 1) / rate("plain", 1),
        "plain_decode_tok_s": rate("plain", 2),
        "spec_decode_tok_s": rate("spec", 2),
        "decode_speedup": rate("spec", 2) / rate("plain", 2),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_verify": accepted / steps if steps else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()

    from inferd import LLM, SamplingParams

    rss0 = vm_rss_mb(os.getpid())
    plain = LLM(dtype="float32", kv_cache_memory_gb=1.0)
    rss_plain = vm_rss_mb(os.getpid())
    spec = LLM(dtype="float32", kv_cache_memory_gb=1.0, speculative="ngram", num_speculative_tokens=a.k)
    rss_spec = vm_rss_mb(os.getpid())
    tok = plain.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    grounded = [chat(f"Repeat the following text word for word.\n\n{p}") for p in passages(a.num_prompts)]
    open_chat = [chat(q) for q in CHAT_QUESTIONS[: a.num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (plain, spec):
        llm.generate([grounded[0]], warm, use_tqdm=False)

    g = run_task(plain, spec, grounded, params)
    c = run_task(plain, spec, open_chat, params)
    result = {
        "benchmark": "speculative",
        "workload": f"batch 1, greedy, float32, max_tokens {a.max_tokens}, n-gram drafts k={a.k}; "
        f"grounded: repeat a passage of the repo's docs ({len(grounded)} prompts); chat: open questions ({len(open_chat)})",
        "speedup": g["speedup"],
        "decode_speedup": g["decode_speedup"],
        "chat_speedup": c["speedup"],
        "chat_decode_speedup": c["decode_speedup"],
        "acceptance_rate": g["acceptance_rate"],
        "chat_acceptance_rate": c["acceptance_rate"],
        "identical_outputs": g["identical_outputs"] + c["identical_outputs"],
        "total_prompts": g["prompts"] + c["prompts"],
        "grounded": g,
        "chat": c,
        "rss_mb": {"start": rss0, "after_plain_engine": rss_plain, "after_spec_engine": rss_spec},
        "peak_rss_mb": vm_hwm_mb(os.getpid()),
        "command": "python benchmarks/speculative.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} nproc={os.cpu_count()}",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"grounded: {g['plain_tok_s']:.1f} -> {g['spec_tok_s']:.1f} tok/s ({g['speedup']:.2f}x, decode "
        f"{g['decode_speedup']:.2f}x), acceptance {g['acceptance_rate']:.0%}; chat: {c['speedup']:.2f}x "
        f"(acceptance {c['acceptance_rate']:.0%}); identical {result['identical_outputs']}/{result['total_prompts']}; "
        f"peak RSS {result['peak_rss_mb']:.0f} MB"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
