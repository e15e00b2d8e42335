"""How much perplexity moves between equally good FP8 roundings of the same weights: the noise
floor under which two FP8 quantizers (or a quantizer and a reference figure) cannot be told apart.

Usage: python bench/rounding_noise.py CHECKPOINT [--seeds 3] [--first-seed 0] [--fraction 0.03] [--windows 16]
                                              [--no-double-rounding]
CHECKPOINT is a float-quantized (FP8) checkpoint written by quantkit; its source model is read from
its quantkit.json. Each seed writes a copy in which `fraction` of the weight codes, picked at random
among near-ties (|w / s - midpoint| < 2^-7 |w / s|), are rounded to their other neighbour instead of
the nearest one, and scores it with the perplexity protocol (evals/PROTOCOL.md). A variant whose
codes follow compressed-tensors' arithmetic (w / s computed in the weight dtype, then rounded to
e4m3: a double rounding) is scored too. Prints one row per variant and the spread.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from here (to extend an earlier run)")
    parser.add_argument("--no-double-rounding", action="store_true", help="skip the weight-dtype division variant")
    parser.add_argument("--fraction", type=float, default=0.03)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dataset", default="emma")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    from quantkit.calibration.data import load_text
    from quantkit.eval.ppl_table import evaluate_one
    from quantkit.checkpoints.resolve import resolve_model

    meta = json.loads((args.checkpoint / "quantkit.json").read_text())
    source = resolve_model(meta["source"])
    original = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        original.update(load_file(str(f)))
    tensors = load_file(str(args.checkpoint / "model.safetensors"))
    text = load_text(args.dataset)
    rows = [("nearest (as written)", evaluate_one(str(args.checkpoint), text, args.seq_len, args.windows, False)["ppl"], 0.0)]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    variants = [] if args.no_double_rounding else [("weight-dtype division", None)]
    variants += [(f"random near-tie flips, seed {s}", s) for s in seeds]
    with tempfile.TemporaryDirectory(prefix="quantkit-noise-") as tmp:
        for name, seed in variants:
            out = Path(tmp) / "variant"
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(args.checkpoint, out)
            changed = total = 0
            new_tensors = dict(tensors)
            for key, q in tensors.items():
                if q.dtype != torch.float8_e4m3fn or not key.endswith(".weight"):
                    continue
                scale = tensors[key[: -len("weight")] + "weight_scale"]
                if scale.numel() != q.shape[0]:
                    raise SystemExit(f"{key}: only per-channel or per-tensor scales are supported here")
                new = _variant(q, original[key], scale, seed, args.fraction)
                changed += int((new.view(torch.uint8) != q.view(torch.uint8)).sum())
                total += q.numel()
                new_tensors[key] = new
            save_file(new_tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            ppl = evaluate_one(str(out), text, args.seq_len, args.windows, False)["ppl"]
            rows.append((name, ppl, changed / total))
            print(f"  {name}: ppl {ppl:.3f} ({changed / total:.2%} of codes changed)", flush=True)
    print(f"checkpoint {args.checkpoint} (source {source}); {args.dataset} {args.windows} x {args.seq_len}")
    print("| variant | ppl | codes changed |")
    print("| --- | --- | --- |")
    for name, ppl, frac in rows:
        print(f"| {name} | {ppl:.3f} | {frac:.2%} |")
    random_ppl = [r[1] for r in rows if r[0].startswith("random")] + [rows[0][1]]
    if len(random_ppl) > 2:
        print(f"nearest + random variants: mean {statistics.mean(random_ppl):.3f}, "
              f"sd {statistics.stdev(random_ppl):.3f}, range {max(random_ppl) - min(random_ppl):.3f}")


def _variant(q, w, scale, seed, fraction):
    """Codes of one variant: compressed-tensors' double rounding (seed None) or random near-tie flips."""
    import torch

    s = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)
    if seed is None:
        return (w / s.to(w.dtype)).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    t = w.float() / s.float()
    near = q.float()
    code = q.view(torch.uint8)
    mag, sign = code & 0x7F, code & 0x80
    other = sign | torch.where(near.abs() < t.abs(), mag + 1, mag - 1).clamp(0, 0x7E)
    other_value = other.view(torch.float8_e4m3fn).float()
    band = ((t - (near + other_value) / 2).abs() < t.abs() * 2.0**-7) & (other_value != near)
    p = min(1.0, fraction * q.numel() / max(int(band.sum()), 1))
    flip = band & (torch.rand(t.shape, generator=torch.Generator().manual_seed(seed)) < p)
    return torch.where(flip, other, code).view(torch.float8_e4m3fn)


if __name__ == "__main__":
    main()
