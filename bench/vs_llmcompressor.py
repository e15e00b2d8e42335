"""quantkit against llm-compressor 0.14, back to back on this machine, the same model, data and scheme.

Usage: python bench/vs_llmcompressor.py MODEL ALGO --peer-python /path/to/llmc-venv/bin/python
           [--group 64] [--peer-dtypes bfloat16,float32] [--windows 8] [--keep DIR]
           [--variant OVERRIDES ...]   (quantkit runs, each with comma-separated --set overrides; '' = the recipe;
                                        '@RECIPE_FILE,OVERRIDES': another recipe, e.g. an added stage)
Set up the peer once:  python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install llmcompressor==0.14.0.1

Both calibrate on the same tokens (the recipe's: quantkit's own chunks, handed to llm-compressor as a
tokenized dataset). ALGO gptq / awq: W4A16 symmetric with the same group size (gptq: static act-order;
awq: duo scaling both, then round-to-nearest); w8a8-smoothquant (SmoothQuant with the recipe's alpha,
then GPTQ to W8A8), w8a8-dynamic (round to nearest W8A8), w4afp8 (quantkit: AWQ + GPTQ; the peer: its GPTQ, static act-order), nvfp4a16 and mxfp8
(round to nearest), nvfp4 and mxfp4 (GPTQ, static act-order): the compressed-tensors presets of those names,
--group ignored. Times are each job's load + calibrate +
save, measured inside its process (interpreter start and imports excluded for both). Quality is
quantkit's float32 perplexity protocol on emma (evals/PROTOCOL.md) for the original and every output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PEER = Path(__file__).with_name("llmc_peer.py")
# recipe, index of the stage with the scheme, whether --group applies
RECIPES = {"gptq": ("gptq-w4a16", 0, True), "awq": ("awq-w4a16", 1, True), "w8a8-smoothquant": ("w8a8-smoothquant", 1, False),
           "w8a8-dynamic": ("w8a8-dynamic", 0, False), "w4afp8": ("w4afp8", 1, False),
           "nvfp4a16": ("nvfp4a16", 0, False), "nvfp4": ("nvfp4", 0, False), "mxfp4": ("mxfp4", 0, False),
           "mxfp8": ("mxfp8", 0, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("algo", choices=list(RECIPES))
    parser.add_argument("--peer-python", required=True)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--peer-dtypes", default="bfloat16,float32")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--keep", type=Path, help="Keep the checkpoints here (default: a temporary directory).")
    parser.add_argument("--variant", action="append", default=None,
                        help="A quantkit run with these comma-separated overrides (repeatable; '' = the recipe as is), "
                             "e.g. --variant '' --variant stages.0.args.true_sequential=true")
    args = parser.parse_args()

    from quantkit.platform import compute
    from quantkit.calibration.data import load_text
    from quantkit.eval.ppl_table import evaluate_one
    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.flow.sources import calibration_batches
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe
    from quantkit.plugins.catalog import needs_bos as family_needs_bos
    from quantkit.formats.checkpoint import read_config

    source = resolve_model(args.model)
    name, stage, grouped = RECIPES[args.algo]
    base_sets = [f"stages.{stage}.scheme.group_size={args.group}"] if grouped else []
    recipe = load_recipe(name, base_sets)
    alpha = recipe.stages[0].args.get("alpha", 0.5) if args.algo == "w8a8-smoothquant" else 0.5
    needs_bos = family_needs_bos(read_config(source)["model_type"])
    from quantkit.plugins.catalog import algorithm

    # these recipes' stages need data exactly when their algorithm always does (no static-FP8 stage here)
    calibrates = any(algorithm(s.algorithm).needs_calibration for s in recipe.stages)
    # a data-free recipe: the peer's oneshot still takes a dataset (its W8A8 preset uses none of it)
    data_recipe = recipe if calibrates else load_recipe("gptq-w4a16")
    tokens = [row.tolist() for batch in calibration_batches(source, data_recipe, needs_bos) for row in batch]
    print(compute.machine_summary())
    what = f"W4A16 group {args.group}" if grouped else name
    calib = (f"{len(tokens)} x {len(tokens[0])} calibration tokens of {recipe.calibration.dataset}"
             if calibrates else "data-free")
    print(f"model {source.name}; {args.algo} {what}; {calib}")

    root = args.keep or Path(tempfile.mkdtemp(prefix="vs-llmc-"))
    root.mkdir(parents=True, exist_ok=True)
    token_file = root / "tokens.json"
    token_file.write_text(json.dumps(tokens))

    rows = []
    for vi, variant in enumerate(args.variant or [""]):
        sets = [o for o in variant.split(",") if o]
        recipe_ref = sets.pop(0)[1:] if sets and sets[0].startswith("@") else name  # '@FILE,...': another recipe
        start = time.perf_counter()
        report = quantize(str(source), load_recipe(recipe_ref, [*base_sets, *sets] if recipe_ref == name else sets),
                          root / f"quantkit-{vi}", overwrite=True, progress=False)
        rows.append({"tool": "quantkit", "dtype": report.compute.name, "seconds": time.perf_counter() - start,
                     "path": report.output, "variant": variant or "recipe as is"})
    for dtype in args.peer_dtypes.split(","):
        out = root / f"llmc-{dtype}"
        cmd = [args.peer_python, str(PEER), "--model", str(source), "--tokens", str(token_file), "--algo", args.algo,
               "--group", str(args.group), "--dtype", dtype, "--out", str(out), "--alpha", str(alpha)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            raise SystemExit(f"llm-compressor ({dtype}) failed with exit code {proc.returncode}")
        peer = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append({"tool": "llm-compressor 0.14", "dtype": dtype, "seconds": peer["total_s"], "path": out,
                     "detail": peer})

    text = load_text("emma")
    base = evaluate_one(str(source), text, args.seq_len, args.windows, False)
    for row in rows:
        row["ppl"] = evaluate_one(str(row["path"]), text, args.seq_len, args.windows, False)["ppl"]
    fastest_peer = min(r["seconds"] for r in rows if r["tool"] != "quantkit")
    best_peer_ppl = min(r["ppl"] for r in rows if r["tool"] != "quantkit")
    print(f"perplexity: float32, {args.windows} x {args.seq_len} tokens of emma; original {base['ppl']:.3f}")
    print(f"{'tool':<20} {'compute':<9} {'wall s':>8} {'vs fastest peer':>16} {'ppl':>8} {'delta':>8}  variant")
    for r in rows:
        print(f"{r['tool']:<20} {r['dtype']:<9} {r['seconds']:8.1f} {r['seconds'] / fastest_peer:15.2f}x "
              f"{r['ppl']:8.3f} {r['ppl'] - base['ppl']:+8.3f}  {r.get('variant', '')}")
    for qk in (r for r in rows if r["tool"] == "quantkit"):
        print(f"quantkit ({qk['variant']}) time / fastest llm-compressor: {qk['seconds'] / fastest_peer:.2f}; "
              f"ppl delta {qk['ppl'] - base['ppl']:+.3f} vs best llm-compressor {best_peer_ppl - base['ppl']:+.3f}")
    for r in (r for r in rows if r["tool"] != "quantkit"):
        d = r["detail"]
        print(f"  llm-compressor {r['dtype']}: load {d['load_s']:.1f} s, oneshot {d['oneshot_s']:.1f} s, "
              f"save {d['save_s']:.1f} s (torch {d['torch']}, {d['threads']} threads)")


if __name__ == "__main__":
    main()
