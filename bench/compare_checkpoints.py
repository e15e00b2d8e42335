"""Two checkpoints compared tensor by tensor: which are identical to the bit, and how far the others are.

Usage: python bench/compare_checkpoints.py A B [--require-identical]

Prints one line per differing tensor (float: max |a - b| and the share of elements that differ; integer
codes: the share of elements that differ) and a summary line; the config and quantization_config are
compared too. Exit status 1 when the key sets or shapes differ, or (with --require-identical) when any
tensor differs. Used by bench/gpu.sh to hold a quantize on CUDA against the same quantize on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _tensors(path: Path) -> dict:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no .safetensors files")
    handles = {}
    for f in files:
        h = safe_open(str(f), framework="pt")
        for key in h.keys():
            handles[key] = h
    return handles


def compare(a: Path, b: Path) -> tuple[int, int, bool]:
    """(identical tensors, differing tensors, whether the layouts match)."""
    ta, tb = _tensors(a), _tensors(b)
    same_layout = set(ta) == set(tb)
    if not same_layout:
        only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
        print(f"keys only in {a}: {only_a[:8]}; only in {b}: {only_b[:8]}")
    qa = json.loads((a / "config.json").read_text()).get("quantization_config")
    qb = json.loads((b / "config.json").read_text()).get("quantization_config")
    if qa != qb:
        print("quantization_config differs")
        same_layout = False
    identical = differing = 0
    for key in sorted(set(ta) & set(tb)):
        x, y = ta[key].get_tensor(key), tb[key].get_tensor(key)
        if x.shape != y.shape or x.dtype != y.dtype:
            print(f"{key}: {tuple(x.shape)} {x.dtype} against {tuple(y.shape)} {y.dtype}")
            same_layout, differing = False, differing + 1
            continue
        if x.view(-1).view(_bits(x.dtype)).equal(y.view(-1).view(_bits(y.dtype))):
            identical += 1
            continue
        differing += 1
        unequal = (x != y).float().mean().item()
        if x.is_floating_point():
            diff = (x.float() - y.float()).abs().max().item()
            print(f"{key}: max |a - b| {diff:.3g}, {100 * unequal:.3f}% of elements differ")
        else:
            print(f"{key}: {100 * unequal:.3f}% of codes differ")
    print(f"{identical} tensors identical to the bit, {differing} differ ({a} against {b})")
    return identical, differing, same_layout


def _bits(dtype):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--require-identical", action="store_true")
    args = parser.parse_args()
    _, differing, same_layout = compare(args.a, args.b)
    sys.exit(0 if same_layout and not (args.require_identical and differing) else 1)


if __name__ == "__main__":
    main()
