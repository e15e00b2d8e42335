"""Builds the shipped lm-eval tasks over Jane Austen's *Persuasion* (held out from calibration).

Deterministic (seeded): running it again writes the same files. Three tasks:
- austen_cloze (multiple_choice): a passage that stops before the last word of a sentence; pick
  that word among four (three distractors drawn from words of the novel of similar frequency).
- austen_next_word (generate_until): the same kind of passage; generate the missing word.
- austen_ppl (loglikelihood_rolling): whole paragraphs, scored as word / byte perplexity.

    python evals/tasks/make_austen_tasks.py
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "data" / "persuasion.txt"
SEED = 20261201
N_CLOZE, N_GEN, N_PPL = 200, 100, 24


def sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", paragraph) if s.strip()]


def candidates(paragraphs: list[str]) -> list[tuple[str, str]]:
    """(context, last word) for sentences that end in a plain word and a full stop."""
    out = []
    for p in paragraphs:
        sents = sentences(p)
        for i, s in enumerate(sents):
            m = re.fullmatch(r"(.*\S)\s+([A-Za-z]{4,})\.", s)
            if not m or len(s.split()) < 8:
                continue
            before = " ".join(sents[max(0, i - 2) : i])
            out.append(((before + " " if before else "") + m.group(1), m.group(2)))
    return out


def main() -> None:
    text = TEXT.read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 20]
    words = collections.Counter(w for w in re.findall(r"[A-Za-z]{4,}", text))
    rng = random.Random(SEED)
    items = candidates(paragraphs)
    rng.shuffle(items)
    vocab = sorted(w for w, c in words.items() if c >= 5 and w.islower())
    cloze, gen = [], []
    for context, answer in items[:N_CLOZE]:
        pool = [w for w in vocab if w.lower() != answer.lower()]
        choices = rng.sample(pool, 3) + [answer]
        rng.shuffle(choices)
        cloze.append({"context": context, "choices": choices, "label": choices.index(answer)})
    for context, answer in items[N_CLOZE : N_CLOZE + N_GEN]:
        gen.append({"context": context, "answer": answer})
    long = [p for p in paragraphs if 600 <= len(p) <= 3000]
    ppl = [{"text": p} for p in rng.sample(long, N_PPL)]
    for name, rows in (("austen_cloze", cloze), ("austen_next_word", gen), ("austen_ppl", ppl)):
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} items")


if __name__ == "__main__":
    main()
