"""Self-instruct: the target writes the user requests of the third data round.

Why: draft v3 agrees with the target on about 0.50 of held-out tokens of our templated chat
mix but on 0.38 of MT-Bench's, in every MT-Bench category alike. Templates give few shapes of
question; the target itself, continuing a numbered list of requests, writes open and varied
ones in its own words. A raw list works where a chat instruction does not: asked in chat to
"write a new request", the 135M target answers some request instead.

Usage (both cores; a few minutes for a few thousand requests):
  VLLM_CPU_OMP_THREADS_BIND=0-1 python -m benchmarks.reference_pair.self_instruct \
      --target ~/.cache/vllm_saguaro/target --out /tmp/rp_work/requests.jsonl --n 3000
then `gen_data.py --prompts-file /tmp/rp_work/requests.jsonl` answers them.
Requests that share six words in a row with an evaluation prompt are dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

# Seed requests per MT-Bench category: our own, none is (or paraphrases) an MT-Bench question.
SEEDS = {
    "writing": ["Write a short poem about the first snow of winter.",
                "Draft a friendly email inviting my team to a picnic next Friday.",
                "Write a product description for a reusable water bottle.",
                "Write a story about a lighthouse keeper who finds a message in a bottle.",
                "Write a speech for my sister's graduation. Keep it under 200 words."],
    "roleplay": ["Pretend you are a museum guide and show me around the dinosaur hall.",
                 "Act as a grumpy cat and tell me about your day.",
                 "You are a detective in 1920s London. Describe the crime scene you just walked into.",
                 "Imagine you are a tour guide on the Moon. Welcome the new visitors.",
                 "Play the role of a coach giving a pep talk before the final game."],
    "reasoning": ["If some cats are black and all black things are visible at night, are some cats visible at night?",
                  "A farmer has 12 sheep and all but 5 run away. How many are left?",
                  "Which weighs more, a kilogram of feathers or a kilogram of iron? Explain.",
                  "Three boxes are labeled wrongly. How can you fix the labels by opening only one box?",
                  "If today is Tuesday, what day will it be in 100 days?"],
    "math": ["What is the sum of the first 20 odd numbers?",
             "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
             "Solve the equation 5x - 7 = 18.",
             "What is the probability of getting two heads when flipping two coins?",
             "Find the area of a circle with a radius of 6 cm."],
    "coding": ["Write a Python function that counts the vowels in a string.",
               "How do I read a CSV file in JavaScript?",
               "Explain what a hash map is and when to use one.",
               "Write a SQL query that finds the five most recent orders.",
               "Fix the bug in a function that should return the largest number in a list."],
    "extraction": ["Extract all the dates from the following text and list them in order.",
                   "Read this recipe and list the ingredients with their amounts as a table.",
                   "From the following paragraph, find the names of all the cities mentioned.",
                   "Summarize the following customer review in one sentence and rate it from 1 to 5.",
                   "Return the product names and prices in this text as JSON."],
    "stem": ["How do vaccines train the immune system?",
             "Explain how a solar panel turns light into electricity.",
             "What is the difference between weather and climate?",
             "Why does ice float on water?",
             "How does a computer store numbers in binary?"],
    "humanities": ["What were the main causes of the fall of the Roman Empire?",
                   "How did the printing press change society in Europe?",
                   "Discuss the role of music in ancient Greek culture.",
                   "What can we learn from the philosophy of the Stoics today?",
                   "Compare the economies of two countries of your choice."],
}
LABELS = {"writing": "writing", "roleplay": "role-play", "reasoning": "reasoning puzzles", "math": "math",
          "coding": "programming", "extraction": "extracting information from a text",
          "stem": "science and technology", "humanities": "history, society and the arts"}


def list_prompt(category: str, topic: str, examples: list[str]) -> str:
    """A numbered list of requests that the target continues with one more."""
    lines = "\n".join(f"{i + 1}. {e}" for i, e in enumerate(examples))
    return (f"Here are some requests that people sent to an AI assistant. Category: {LABELS[category]}. "
            f"Topic: {topic}.\n\n{lines}\n{len(examples) + 1}.")


def clean_request(text: str) -> str | None:
    """The request the target wrote, or None when it is too short, too long or unfinished."""
    text = " ".join(text.split())
    if not 12 <= len(text) <= 400 or not re.search(r"[A-Za-z]{3}", text) or text[-1] not in ".?!":
        return None
    return text


def shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def eval_shingles() -> set[tuple[str, ...]]:
    """Six-word shingles of every evaluation prompt (MT-Bench questions, HumanEval prompts)."""
    from benchmarks.prompts import humaneval_prompts, mt_bench_questions

    out: set[tuple[str, ...]] = set()
    for t in mt_bench_questions() + humaneval_prompts():
        out |= shingles(t)
    return out


def parse_weights(spec: str | None) -> dict[str, float] | None:
    """'writing=2,math=0.5' -> a weight per category (unnamed ones weigh 1); None: uniform."""
    if not spec:
        return None
    w = dict.fromkeys(SEEDS, 1.0)
    for part in spec.split(","):
        name, sep, val = part.partition("=")
        name = name.strip()
        if not sep or name not in SEEDS:
            raise ValueError(f"bad category weight {part!r}: want NAME=WEIGHT, NAME one of {', '.join(SEEDS)}")
        try:
            w[name] = float(val)
        except ValueError:
            raise ValueError(f"weight of {name} must be a number, got {val!r}") from None
        if not (math.isfinite(w[name]) and w[name] >= 0):
            raise ValueError(f"weight of {name} must be finite and >= 0, got {val}")
    if sum(w.values()) <= 0:
        raise ValueError("category weights are all zero")
    return w


def generate_requests(llm, n: int, seed: int = 0, rounds: int = 3, temperature: float = 0.9,
                      say=print, weights: dict[str, float] | None = None) -> list[dict]:
    """n requests as prompt dicts (prompts.py's format), written by the target in `rounds`
    rounds; from the second round on, one example of each list is an earlier generated one.
    `weights` tilts the mix of categories toward the ones the draft agrees on least."""
    from vllm import SamplingParams

    from benchmarks.reference_pair.prompts import CONSTRAINTS, FOLLOW_UPS, TOPICS

    r = random.Random(seed)
    banned = eval_shingles()
    pool = {c: [] for c in SEEDS}
    seen = {q.lower() for qs in SEEDS.values() for q in qs}  # a copied seed is no new request
    out: list[dict] = []
    cats = list(SEEDS)
    cat_weights = [weights[c] for c in cats] if weights else None
    sp = SamplingParams(temperature=temperature, max_tokens=64, stop=["\n"], seed=None)
    for rnd in range(rounds):
        want = (n - len(out)) // (rounds - rnd)
        asks = []
        for _ in range(int(want * 1.6) + 8):  # some are rejected
            # (uniform draws keep r.choice: the documented earlier rounds reproduce)
            c = r.choices(cats, cat_weights)[0] if cat_weights else r.choice(cats)
            # (in the first round the third seed may repeat one of the two: kept as it is, so
            # that the documented third-round data reproduces)
            ex = r.sample(SEEDS[c], 2) + ([r.choice(pool[c])] if pool[c] else r.sample(SEEDS[c], 1))
            r.shuffle(ex)
            asks.append((c, list_prompt(c, r.choice(TOPICS), ex)))
        outs = llm.generate([a for _, a in asks], sp, use_tqdm=False)
        kept = 0
        for (c, _), o in zip(asks, outs):
            q = clean_request(o.outputs[0].text)
            if q is None or q.lower() in seen or shingles(q) & banned or kept >= want:
                continue
            seen.add(q.lower())
            pool[c].append(q)
            kept += 1
            x = r.random()  # some MT-Bench-like structure: a constraint or a second part
            text = q + (" " + r.choice(CONSTRAINTS) if x < 0.25 else " " + r.choice(FOLLOW_UPS) if x < 0.35 else "")
            out.append({"kind": f"self_{c}", "chat": True, "text": text})
        say(f"round {rnd + 1}: kept {kept} of {len(asks)} requests; {len(out)} in all")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True, help="JSONL of prompt dicts, for gen_data.py --prompts-file")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", help="category weights, e.g. writing=2,math=0.5 (others 1; default uniform)")
    args = ap.parse_args()
    try:
        weights = parse_weights(args.weights)
    except ValueError as e:
        ap.error(str(e))

    from vllm import LLM

    t0 = time.time()
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=512, max_num_seqs=256, seed=args.seed)
    reqs = generate_requests(llm, args.n, args.seed, args.rounds, args.temperature,
                             say=lambda m: print(f"{m} ({time.time() - t0:.0f}s)", flush=True), weights=weights)
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in reqs))
    print(f"wrote {len(reqs)} requests to {args.out}")


if __name__ == "__main__":
    main()
