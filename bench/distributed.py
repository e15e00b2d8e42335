"""Data-parallel quantize with N gloo ranks (one thread each) against one process with N threads.

Usage: python bench/distributed.py MODEL RECIPE [--nproc 2] [--set KEY=VALUE ...] [--out DIR]
Both run back to back on this machine on the same data; prints each wall time, the ratio, and how
the outputs compare (identical files, or the share of equal int4 codes and the largest difference).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("recipe")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dist-bench"))
    args = parser.parse_args()
    from safetensors.torch import load_file

    from quantkit.platform import compute
    from quantkit.quant.packing import unpack_int32

    print(compute.machine_summary())
    args.out.mkdir(parents=True, exist_ok=True)
    base = ["quantize", args.model, "--recipe", args.recipe, *(a for s in args.sets for a in ("--set", s)),
            "--no-progress"]
    runs = {}
    for name, extra, threads in (("1 process", [], args.nproc), (f"{args.nproc} gloo ranks", ["--nproc", str(args.nproc)], 1)):
        out = args.out / name.replace(" ", "-")
        shutil.rmtree(out, ignore_errors=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        env.pop("WORLD_SIZE", None)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "quantkit", *base, "-o", str(out), *extra], env=env,
                             capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-3000:])
        runs[name] = (time.perf_counter() - t0, out)
        print(f"{name:<16} ({threads} thread(s) each) {runs[name][0]:8.1f} s")
    (t1, a_dir), (t2, b_dir) = runs.values()
    print(f"ratio {t2 / t1:.2f}x the single process's time")
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    if (a_dir / "model.safetensors").read_bytes() == (b_dir / "model.safetensors").read_bytes():
        print("outputs: identical model.safetensors")
        return
    same = total = worst = 0
    for k in a:
        if k.endswith("weight_packed"):
            n = int(a[k.replace("weight_packed", "weight_shape")][1])
            ca, cb = unpack_int32(a[k], 4, n), unpack_int32(b[k], 4, n)
            same += int((ca == cb).sum())
            total += ca.numel()
            worst = max(worst, int((ca.int() - cb.int()).abs().max()))
    scale_diff = max(float(((a[k].float() - b[k].float()).abs() / a[k].float().abs().clamp_min(1e-12)).max())
                     for k in a if k.endswith("weight_scale"))
    print(f"outputs: {same / max(total, 1):.4%} of int4 codes equal, largest code difference {worst}, "
          f"largest relative scale difference {scale_diff:.2e}")


if __name__ == "__main__":
    main()
