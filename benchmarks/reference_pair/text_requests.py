"""Requests that carry a text: extraction and reading tasks around passages the target wrote.

Why: MT-Bench's weakest category for draft v4 is extraction (0.335 agreement): a long text in
the prompt and a request to pull facts out of it, rate it or reshape it. The self-instruct
requests are one short sentence each and carry no text. Here the passages are the target's
own earlier answers (a gen_data.py data directory), and the instructions are ours; a request
that shares six words in a row with an evaluation prompt is dropped, as in self_instruct.py.

Usage (light: only the tokenizer runs; then gen_data.py --prompts-file answers them):
  python -m benchmarks.reference_pair.text_requests --target ~/.cache/vllm_saguaro/target \
      --data /tmp/rp_work/data3 --out /tmp/rp_work/text_requests.jsonl --n 1000
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ONE_TEXT = [
    "Extract the names of all people, places and organizations in the text below. Return them as JSON "
    "with the keys \"people\", \"places\" and \"organizations\".",
    "Summarize the following text in two sentences.",
    "Read the passage below and list its three most important points.",
    "Identify the main topic of this text and give five keywords for it.",
    "Find every number or date in the following text and say what it refers to.",
    "Rewrite the following paragraph so that a ten-year-old can understand it.",
    "Turn the text below into a bulleted list of facts.",
    "What is the tone of the following text? Support your answer with a short quote from it.",
    "Give the following passage a title and a one-line summary.",
    "Check the following text for claims that might be wrong or unclear, and explain why.",
    "Pick out the key terms in the passage below and define each one in a few words.",
    "Write three quiz questions, with their answers, based on the following text.",
    "Is the following text a story, a news report, an opinion, instructions or an explanation? Say why.",
    "Return a JSON object with the fields \"title\", \"summary\" and \"keywords\" for the text below.",
    "Shorten the following text to under 50 words without losing its meaning.",
    "Quote the single most important sentence of the following text and explain your choice.",
    "Rate how clear the following text is, from 1 to 10, and suggest one improvement.",
    "List every action or step described in the text below, in order.",
    "Extract the facts from this text as a table with two columns: subject and fact.",
    "Write a reply to the author of the following text, agreeing or disagreeing with one point.",
]
MANY_TEXTS = [
    "Rate each text from 1 to 5 for how informative it is. Return the ratings as a JSON array.",
    "Assign each text to one of these categories: Science, History, Arts, Everyday life, Technology. "
    "Answer with one line per text.",
    "Write a one-sentence summary of each text.",
    "Which of these texts is the most useful to a reader, and why? Answer briefly.",
    "Make a table with two columns, the number of the text and its main subject.",
    "What do these texts have in common, and how do they differ?",
    "For each text, list the people and places it mentions, or write \"none\".",
]


def passages(data_dirs: list[str], target: str, min_chars: int = 160, max_chars: int = 700) -> list[str]:
    """The target's answers in these data directories, cut at the last full sentence."""
    from transformers import AutoTokenizer

    from benchmarks.reference_pair.distill import load_shards

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    for d in data_dirs:
        for seq in load_shards(d):
            text = tok.decode(seq["gen_ids"].tolist(), skip_special_tokens=True).strip()[:max_chars]
            cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind(".") if text.endswith(".") else -1)
            if cut + 1 >= min_chars:
                out.append(text[: cut + 1])
    return out


def text_requests(texts: list[str], n: int, seed: int = 0, banned: set | None = None) -> list[dict]:
    """n chat requests (prompts.py's format), each around one text or a numbered set of 2-4."""
    from benchmarks.reference_pair.self_instruct import shingles

    r = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 4 * n:
        tries += 1
        if r.random() < 0.7:
            instr, text = r.choice(ONE_TEXT), r.choice(texts)
            body = f"{instr}\n\n{text}" if r.random() < 0.6 else f"Text: \"{text}\"\n\n{instr}"
        else:
            k = r.randint(2, 4)
            parts = [re.split(r"(?<=[.!?])\s", t, maxsplit=2)[:2] for t in r.sample(texts, k)]
            items = "\n".join(f"{i + 1}. {' '.join(p)}" for i, p in enumerate(parts))
            body = f"Here are {k} short texts.\n\n{items}\n\n{r.choice(MANY_TEXTS)}"
        if banned and shingles(body) & banned:
            continue
        out.append({"kind": "text_extraction", "chat": True, "text": body})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="its tokenizer decodes the passages")
    ap.add_argument("--data", required=True, nargs="+", help="gen_data.py output directories")
    ap.add_argument("--out", required=True, help="JSONL of prompt dicts, for gen_data.py --prompts-file")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from benchmarks.reference_pair.self_instruct import eval_shingles

    texts = passages(args.data, args.target)
    reqs = text_requests(texts, args.n, args.seed, eval_shingles())
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in reqs))
    print(f"wrote {len(reqs)} requests around {len(texts)} passages to {args.out}")


if __name__ == "__main__":
    main()
