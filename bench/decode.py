"""Decode speed of the runner on two checkpoints, measured back to back in one process.

Usage: python bench/decode.py BASELINE MODEL [MODEL ...] [--prompt TEXT] [-n 128] [--runs 5]
Each run generates n tokens greedily from the same prompt (EOS ignored, so every run decodes n
tokens); runs alternate between the models and the median decode tokens/s of each is printed
with its ratio to the baseline's. Prefill time (TTFT) is reported beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompt", default="The history of the English novel")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import torch

    from quantkit.runtime.generate import SamplingConfig, generate
    from quantkit.runtime.loader import load, load_tokenizer

    loaded = [(name, load(name), load_tokenizer(name)) for name in args.models]
    for _, model, _ in loaded:
        model.generation_config.eos_token_id = None
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    results: dict[str, list] = {name: [] for name, _, _ in loaded}
    for run in range(args.runs + 1):  # run 0 warms up (first-call allocations, kernel repacks)
        for name, model, tok in loaded:
            ids = tok(args.prompt)["input_ids"]
            eos = tok.eos_token_id
            tok.eos_token_id = None  # decode every token: equal work for every model
            try:
                g = generate(model, tok, list(ids), cfg)
            finally:
                tok.eos_token_id = eos
            if run:
                results[name].append((g.decode_tokens_per_second, g.prefill_seconds, len(g.token_ids)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompt {args.prompt!r}, "
          f"{args.max_new_tokens} new tokens, median of {args.runs} alternating runs")
    base = statistics.median(r[0] for r in results[args.models[0]])
    print("| model | decode tok/s | vs baseline | prefill (TTFT) ms | tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.models:
        tps = statistics.median(r[0] for r in results[name])
        ttft = statistics.median(r[1] for r in results[name]) * 1e3
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {ttft:.0f} | {results[name][0][2]} |")


if __name__ == "__main__":
    main()
