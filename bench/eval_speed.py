"""Evaluation throughput: `quantkit eval` against transformers' own float32 forward on the same windows.

Usage: python bench/eval_speed.py MODEL [--dataset emma] [--seq-len 2048] [--windows 4]
                                  [--batch-sizes 1,4] [--policy-as AVX2]
Rows, run back to back in one process on the same windows (load time excluded):
  transformers fp32   AutoModelForCausalLM(dtype=float32)(input_ids, labels): loss per window
  quantkit fp32       quantkit's evaluator, float32 (the protocol)
  quantkit auto bN    quantkit's evaluator in the machine's fast dtype, N windows per forward
Each setup is warmed up on one window first (untimed), then timed --repeats times, the setups
alternating; each prints its median tokens/s, its ratio to the transformers row, perplexity and its
difference from the float32 protocol's. --policy-as AVX2 makes the compute policy choose as on an AVX2-only CPU
(float32), the hardware staying this one.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dataset", default="emma")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--policy-as", choices=["AVX2"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from quantkit.platform import compute

    if args.policy_as:
        compute.cpu_features = lambda: compute.CpuFeatures(args.policy_as, True)
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.compare import prepare
    from quantkit.checkpoints.resolve import resolve_model

    print(compute.machine_summary() + (f" (policy as {args.policy_as})" if args.policy_as else ""))
    path = resolve_model(args.model)
    _, (text,), bos = prepare(args.model, [], [args.dataset], args.seq_len, args.windows)
    wins = text.windows
    tokens = wins.shape[0] * (args.seq_len - 1)
    print(f"{args.model}: {wins.shape[0]} windows of {args.seq_len} tokens of {args.dataset}, BOS {bos is not None}")

    import statistics

    from quantkit.eval.compare import score
    from quantkit.checkpoints.loader import load

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()

    def transformers_run(windows):
        start, losses = time.perf_counter(), []
        with torch.no_grad():
            for w in windows:
                losses.append(hf(input_ids=w[None], labels=w[None]).loss.item())
        return time.perf_counter() - start, math.exp(sum(losses) / len(losses)), "float32"

    def quantkit_run(model, batch):
        def go(windows):
            t = dataclasses.replace(text, windows=windows)
            start = time.perf_counter()
            (tallies,), _ = score([model], [t], batch)
            return time.perf_counter() - start, tallies[0].ppl, model.quantkit_compute.name
        return go

    import dataclasses

    setups = {"transformers fp32": transformers_run}
    models = {"float32": load(path, dtype="float32"), "auto": load(path, dtype="auto")}
    setups["quantkit fp32 b1"] = quantkit_run(models["float32"], 1)
    for b in args.batch_sizes.split(","):
        setups[f"quantkit auto b{b}"] = quantkit_run(models["auto"], int(b))
    for run in setups.values():
        run(wins[:1])  # warm-up
    times = {name: [] for name in setups}
    results = {}
    for _ in range(args.repeats):
        for name, run in setups.items():
            seconds, ppl, dtype = run(wins)
            times[name].append(seconds)
            results[name] = (ppl, dtype)
    rows = [(name, statistics.median(times[name]), *results[name]) for name in setups]
    hf_s = rows[0][1]
    protocol = rows[1][2]
    print(f"{'setup':<20} {'compute':>9} {'seconds':>8} {'(range)':>13} {'tokens/s':>9} {'x transformers':>14} "
          f"{'ppl':>10} {'vs fp32 protocol':>16}")
    for name, seconds, ppl, dtype in rows:
        spread = f"{min(times[name]):.1f}-{max(times[name]):.1f}"
        print(f"{name:<20} {dtype:>9} {seconds:8.1f} {spread:>13} {tokens / seconds:9.0f} {hf_s / seconds:13.2f}x "
              f"{ppl:10.4f} {100 * (ppl / protocol - 1):+15.3f}%")


if __name__ == "__main__":
    main()
