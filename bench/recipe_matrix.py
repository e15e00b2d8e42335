"""Every shipped recipe on real models under both compute-dtype policies: does it run, how long, what quality.

Usage: python bench/recipe_matrix.py [MODEL ...] [--setups native,avx2] [--recipes a,b] [--samples 16]
           [--seq-len 256] [--windows 4] [--eval-seq-len 512] [--work DIR]

Each (model, setup, recipe) is one `quantkit quantize` process. Setups: `native` (this machine as it is,
the policy choosing the compute dtype), `avx2` (an AVX2-only CPU imitated on this one:
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, so torch's kernels, and oneDNN's bf16 GEMMs, are
those of an AVX2 CPU; the policy's probe then finds bf16 slow and chooses float32, as on such a CPU),
or a dtype name (`float32`, `bfloat16`: QUANTKIT_COMPUTE_DTYPE forced), or `avx2+DTYPE` for both. The compute dtype each run
chose, and why, is read back from its quantkit.json. The recipes run as shipped except for a smaller calibration set
(`--samples` x `--seq-len`, the same for every run) so that the whole matrix fits one sitting. Then one
`quantkit eval compare` pass per (model, policy) scores all its checkpoints against the original in
float32 (the same scoring for both policies, so the two columns compare the checkpoints, not the scorer);
checkpoints with FP8 KV-cache scales are scored in a second pass through their FP8 cache.
With `--generate N`, each checkpoint also generates N greedy tokens from one prompt (`quantkit generate`), and the
table shows the start of the text (a failed or empty generation counts as a failed run).
Prints the CPU line, one table per model and the largest perplexity gap between the policies; exits 1
if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_line() -> str:
    from quantkit.platform.compute import machine_summary

    return machine_summary()


IMITATE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def setup_env(setup: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("QUANTKIT_COMPUTE_DTYPE", *IMITATE_AVX2)}
    env["HF_HUB_OFFLINE"] = "1"
    for part in setup.split("+"):  # e.g. avx2+bfloat16: AVX2 imitated and bf16 forced
        if part == "avx2":
            env.update(IMITATE_AVX2)
        elif part != "native":
            env["QUANTKIT_COMPUTE_DTYPE"] = part
    return env


def extra_overrides(recipe: str, awq_grid: int) -> list[str]:
    from quantkit.flow.recipe import load_recipe

    if awq_grid and any(s.algorithm == "awq" for s in load_recipe(recipe).stages):
        return [f"stages.awq.args.n_grid={awq_grid}"]
    return []


def quantize(model: str, recipe: str, policy: str, out: Path, samples: int, seq_len: int,
             extra: list[str], reuse: bool = False) -> tuple[bool, float, str]:
    env = setup_env(policy)
    if reuse and (out / "quantkit.json").is_file():  # a finished run of an earlier invocation
        meta = json.loads((out / "quantkit.json").read_text())
        return True, float(meta["quantize_seconds"]), f"{meta['compute']['dtype']} (reused: {meta['compute']['reason']})"
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "--recipe", recipe, "-o", str(out), "--overwrite",
           "--no-progress", "--set", f"calibration.num_samples={samples}", "--set", f"calibration.seq_len={seq_len}"]
    for item in extra:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (out.parent / f"{recipe}.log").write_text(log)
    if proc.returncode != 0:
        return False, took, log.strip().splitlines()[-1] if log.strip() else f"rc {proc.returncode}"
    meta = json.loads((out / "quantkit.json").read_text())
    dtype = str(meta["compute"]["dtype"])
    if policy in ("float32", "bfloat16", "float16") and dtype != policy:
        return False, took, f"ran in {dtype}, not {policy}"
    return True, took, f"{dtype} ({meta['compute']['reason']})"


PER_PASS = 6
PROMPT = "It is a truth universally acknowledged that"


def generate(ckpt: Path, tokens: int) -> tuple[bool, str]:
    """(whether `quantkit generate` ran and produced text, the text or the error's last line)."""
    cmd = [sys.executable, "-m", "quantkit", "generate", str(ckpt), PROMPT, "--max-new-tokens", str(tokens)]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    text = proc.stdout.strip()
    if proc.returncode != 0 or not text:
        return False, (proc.stderr.strip().splitlines() or [f"rc {proc.returncode}"])[-1]
    return True, " ".join(text.split())


def has_kv_scales(ckpt: Path) -> bool:
    """Whether a checkpoint carries calibrated FP8 KV-cache scales (compressed-tensors' kv_cache_scheme)."""
    config = json.loads((ckpt / "config.json").read_text())
    return bool((config.get("quantization_config") or {}).get("kv_cache_scheme"))


def score(original: str, ckpts: list[Path], windows: int, seq_len: int, json_out: Path) -> dict[str, dict]:
    """`quantkit eval compare` passes of at most PER_PASS checkpoints: those without KV-cache scales, then
    those with them under `--kv-cache-dtype fp8` (they attend through their FP8 cache, as served; the
    original stays the 16-bit reference in both)."""
    rows = {}
    by_kv: dict[bool, list[Path]] = {False: [], True: []}  # without FP8 KV-cache scales first
    for c in ckpts:
        by_kv[has_kv_scales(c)].append(c)
    # at most PER_PASS checkpoints a pass: eval compare holds every model it scores in memory at once
    passes = [(kv, group[i : i + PER_PASS]) for kv, group in by_kv.items() for i in range(0, len(group), PER_PASS)]
    for n, (kv, group) in enumerate(passes):
        out = json_out.with_name(f"{json_out.stem}-{n}{'-fp8kv' if kv else ''}{json_out.suffix}")
        cmd = [sys.executable, "-m", "quantkit", "eval", "compare", *map(str, group), "--original", original,
               "--dataset", "emma", "--max-windows", str(windows), "--seq-len", str(seq_len), "--dtype", "float32",
               "--no-progress", "--json", str(out)] + (["--kv-cache-dtype", "fp8"] if kv else [])
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"eval compare failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        data = json.loads(out.read_text())
        rows.update({row["model"]: {**row, "fp8_kv": kv and row["role"] == "checkpoint"}
                     for row in data["results"] if row.get("dataset", "emma") == "emma"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--setups", default="native,avx2")
    parser.add_argument("--recipes", default="", help="comma-separated; default every shipped recipe")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--work", type=Path, default=Path("/tmp/recipe-matrix"))
    parser.add_argument("--reuse", action="store_true",
                        help="keep finished outputs of an earlier invocation (their time: quantkit.json's quantize_seconds)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also generate N greedy tokens from each checkpoint (shown in the table)")
    parser.add_argument("--awq-grid", type=int, default=0,
                        help="n_grid for recipes with an awq stage (default: as shipped, 20); fewer is faster")
    args = parser.parse_args()

    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.flow.recipe import available_recipes

    recipes = args.recipes.split(",") if args.recipes else sorted(available_recipes())
    policies = args.setups.split(",")
    print(cpu_line(), flush=True)
    for setup in policies:
        line = subprocess.run([sys.executable, "-c", "from quantkit.platform import compute; import torch; "
                               "print(compute.machine_summary()); print(compute.choose(torch.bfloat16).describe())"],
                              env=setup_env(setup), capture_output=True, text=True, check=True).stdout.strip()
        print(f"setup {setup}: " + line.replace("\n", "; "), flush=True)
    print(f"calibration {args.samples} x {args.seq_len} tokens"
          + (f"; AWQ stages with n_grid {args.awq_grid}" if args.awq_grid else "")
          + f"; scored float32 on emma {args.windows} x {args.eval_seq_len}", flush=True)
    failed = 0
    for model in args.models:
        source = str(resolve_model(model))
        results: dict[tuple[str, str], tuple[bool, float, str]] = {}
        scores: dict[str, dict] = {}
        texts: dict[tuple[str, str], str] = {}
        for policy in policies:
            work = args.work / model / policy
            work.mkdir(parents=True, exist_ok=True)
            done = []
            for recipe in recipes:
                out = work / recipe
                ok, took, info = quantize(source, recipe, policy, out, args.samples, args.seq_len,
                                          extra_overrides(recipe, args.awq_grid), args.reuse)
                results[policy, recipe] = (ok, took, info)
                print(f"{model} {policy} {recipe}: {'ok' if ok else 'FAILED'} {took:.1f} s {info}", flush=True)
                if ok and args.generate:
                    generated, text = generate(out, args.generate)
                    texts[policy, recipe] = text if generated else f"FAILED: {text}"
                    print(f"  generate: {'ok' if generated else 'FAILED'}: {text[:200]}", flush=True)
                    failed += not generated
                if ok:
                    done.append(out)
                else:
                    failed += 1
            if done:
                scores[policy] = score(source, done, args.windows, args.eval_seq_len, work / "eval.json")
        base = next(iter(scores.values()), {}).get(source)
        print(f"\n{model} (original ppl {base['ppl']:.3f})" if base else f"\n{model}")
        dtypes = {p: sorted({r[2].split()[0] for (q, _), r in results.items() if q == p and r[0]}) for p in policies}
        head = " | ".join(f"{p} ({'/'.join(dtypes[p])}) s | ppl | KLD" + (" | text" if args.generate else "")
                          for p in policies)
        print(f"| recipe | {head} |")
        print("|---" * (1 + (4 if args.generate else 3) * len(policies)) + "|")
        gap = (0.0, "")
        for recipe in recipes:
            cells = []
            ppls = []
            for policy in policies:
                ok, took, info = results[policy, recipe]
                row = scores.get(policy, {}).get(str(args.work / model / policy / recipe)) if ok else None
                text = [texts.get((policy, recipe), "-")[:60].replace("|", "/")] if args.generate else []
                if row is None:
                    cells += [f"{took:.0f}", "FAILED" if not ok else "-", "-", *text]
                    continue
                ppls.append(row["ppl"])
                cells += [f"{took:.0f}", f"{row['ppl']:.3f}", f"{row.get('kld_mean', float('nan')):.4f}", *text]
            if len(ppls) == 2 and abs(ppls[0] / ppls[1] - 1) > gap[0]:
                gap = (abs(ppls[0] / ppls[1] - 1), recipe)
            kv = any(r.get("fp8_kv") for r in (scores.get(p, {}).get(str(args.work / model / p / recipe)) or {}
                                               for p in policies))
            print(f"| {recipe}{' (FP8 KV cache)' if kv else ''} | " + " | ".join(cells) + " |")
        if gap[1]:
            print(f"largest perplexity gap between the setups: {100 * gap[0]:.2f}% ({gap[1]})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
