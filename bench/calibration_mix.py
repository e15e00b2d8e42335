"""Calibration data against quality per language and domain (issue 48's benchmark).

For each recipe (default gptq-w4a16, awq-w4a16, gptq-q4_0) and each calibration (the shipped mix `mix-v1`,
English-only `sensesensibility`, self-generated `self`), quantize MODEL with `quantkit quantize`; quantize the
round-to-nearest baselines (rtn-w4a16, and rtn on Q4_0's grid when gptq-q4_0 is run); then one `quantkit eval`
pass of them all against the original on every part of the evaluation set eval-v1, and the checks:

- every calibrated recipe with the mix has a lower KLD than rtn-w4a16 on every part;
- on English prose the mix keeps at least 95% of the English-only calibration's KLD advantage over rtn-w4a16;
- self-generated calibration is within 10% of the mix's KLD on average over the parts.

    python bench/calibration_mix.py gemma3-270m --out /tmp/b48/gemma
    python bench/calibration_mix.py smollm2-135m --out /tmp/b48/smollm2 --recipes gptq-w4a16

Checkpoints already in --out are reused (a stopped run continues). Prints the CPU capability and model.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

QK = [sys.executable, "-m", "quantkit"]
RTN = {"w4a16": ("rtn-w4a16", []), "q4_0": ("rtn-w4a16", ["--set", "stages.rtn.scheme=Q4_0"])}


def cpu_line() -> str:
    import torch

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    return f"CPU {model}; torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}"


def quantize(model: str, recipe: str, out: Path, extra: list[str], log: Path) -> float:
    """Quantize unless out already holds a finished checkpoint; seconds taken (0 when reused)."""
    if (out / "quantkit.json").is_file():
        return 0.0
    cmd = QK + ["quantize", model, "--recipe", recipe, "-o", str(out), "--overwrite", "--no-progress", *extra]
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def scheme_of(recipe: str) -> str:
    return "q4_0" if "q4_0" in recipe else "w4a16"


def build(args) -> dict[str, Path]:
    out, log = args.out, args.out / "quantize.log"
    out.mkdir(parents=True, exist_ok=True)
    ckpts = {}
    for scheme in dict.fromkeys(scheme_of(r) for r in args.recipes):
        name = f"rtn-{scheme}"
        ckpts[name] = out / name
        quantize(args.model, RTN[scheme][0], ckpts[name], RTN[scheme][1], log)
    for recipe in args.recipes:
        for cal in args.calibrations:
            name = f"{recipe}-{cal}"
            ckpts[name] = out / name
            check = [] if cal == "sensesensibility" else ["--set", "calibration.check_samples=0"]
            seconds = quantize(args.model, recipe, ckpts[name], ["--set", f"calibration.dataset={cal}", *check], log)
            if seconds:
                print(f"{name}: quantized in {seconds:.0f} s", flush=True)
    return ckpts


def evaluate(args, ckpts: dict[str, Path]) -> dict:
    path = args.out / f"eval-{args.seq_len}x{args.max_windows}.json"
    if not path.is_file():
        cmd = QK + ["eval", *[str(p) for p in ckpts.values()], "--original", args.model, "--dataset", "eval-v1",
                    "--seq-len", str(args.seq_len), "--max-windows", str(args.max_windows), "--json", str(path),
                    "--no-progress"]
        subprocess.run(cmd, check=True)
    return json.loads(path.read_text())


def tables(args, ckpts: dict[str, Path], ev: dict) -> bool:
    rows = ev["results"]
    parts = [d["name"] for d in ev["protocol"]["datasets"]]
    kld = {(Path(r["model"]).name, r["dataset"]): r["kld_mean"] for r in rows if r["role"] == "checkpoint"}
    names = list(ckpts)
    print("\nKLD mean per part (eval-v1, " + f"{args.seq_len}-token windows, {args.max_windows} per part)")
    print(f"{'checkpoint':<30}" + "".join(f"{p:>12}" for p in parts) + f"{'mean':>10}")
    for n in names:
        vals = [kld[(n, p)] for p in parts]
        print(f"{n:<30}" + "".join(f"{v:12.4f}" for v in vals) + f"{sum(vals) / len(vals):10.4f}")
    ok = True
    print("\nchecks")
    for recipe in args.recipes:
        rtn = "rtn-w4a16"
        if "mix-v1" in args.calibrations:
            worse = [p for p in parts if kld[(f"{recipe}-mix-v1", p)] >= kld[(rtn, p)]]
            ok &= not worse
            print(f"  {recipe} mix-v1 below {rtn} on every part: {'PASS' if not worse else 'FAIL ' + ', '.join(worse)}")
            own = f"rtn-{scheme_of(recipe)}"
            if own != rtn:
                worse_own = [p for p in parts if kld[(f"{recipe}-mix-v1", p)] >= kld[(own, p)]]
                print(f"  {recipe} mix-v1 below {own} on every part (reported): "
                      f"{'yes' if not worse_own else 'no: ' + ', '.join(worse_own)}")
        if {"mix-v1", "sensesensibility"} <= set(args.calibrations):
            base = kld[(rtn, "prose-en")]
            adv_mix, adv_en = base - kld[(f"{recipe}-mix-v1", "prose-en")], base - kld[(f"{recipe}-sensesensibility",
                                                                                          "prose-en")]
            share = adv_mix / adv_en if adv_en > 0 else float("nan")
            good = share >= 0.95
            ok &= good
            print(f"  {recipe} prose-en: mix keeps {100 * share:.1f}% of English-only's advantage over {rtn} "
                  f"({adv_mix:.4f} of {adv_en:.4f}; goal >= 95%): {'PASS' if good else 'FAIL'}")
            worse_en = [p for p in parts if kld[(f"{recipe}-sensesensibility", p)] >= kld[(rtn, p)]]
            print(f"  {recipe} English-only worse than {rtn} on: {', '.join(worse_en) or 'none'}")
        if {"mix-v1", "self"} <= set(args.calibrations):
            m = sum(kld[(f"{recipe}-mix-v1", p)] for p in parts) / len(parts)
            s = sum(kld[(f"{recipe}-self", p)] for p in parts) / len(parts)
            good = s <= 1.10 * m
            ok &= good
            print(f"  {recipe} self-generated mean KLD {s:.4f} against the mix's {m:.4f} ({100 * (s / m - 1):+.1f}%; "
                  f"goal within 10%): {'PASS' if good else 'FAIL'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipes", default="gptq-w4a16,awq-w4a16,gptq-q4_0")
    parser.add_argument("--calibrations", default="mix-v1,sensesensibility,self")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--max-windows", type=int, default=4)
    args = parser.parse_args()
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.calibrations = [c for c in args.calibrations.split(",") if c]
    print(cpu_line(), f"model {args.model}", flush=True)
    ckpts = build(args)
    ev = evaluate(args, ckpts)
    print("all checks pass" if tables(args, ckpts, ev) else "some checks fail")


if __name__ == "__main__":
    main()
