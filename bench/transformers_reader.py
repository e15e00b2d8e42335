"""quantkit's checkpoints read by a reader we did not write: transformers with compressed-tensors' own code.

Usage: python bench/transformers_reader.py CKPT [CKPT ...] [--windows 4] [--seq-len 512]

For each compressed-tensors checkpoint: the float32 perplexity on emma (evals/PROTOCOL.md windows) of the model
as `quantkit.load` runs it, and of the model as `transformers.AutoModelForCausalLM.from_pretrained` builds it
through compressed-tensors (its decompressors, and its forward wrappers for quantized activations), in a separate
process that imports nothing of quantkit's loader. Both score the same token windows with the same function
(`quantkit.eval.ppl.perplexity`). Prints one row per checkpoint: both perplexities and their ratio, or why
transformers could not run it. Exits 1 when a weight-only checkpoint's perplexities differ by more than --tolerance.

What transformers 5.25 with compressed-tensors 0.20 runs on a CPU (measured 2026-12-07): its compressed modules
fail in the forward for every format tried (pack-quantized and nvfp4: "'Linear' object has no attribute 'weight'";
int-quantized and mxfp8: a matmul of float32 with int8 / float8 codes), so the model is loaded with
`CompressedTensorsConfig(dequantize=True)`: every weight decompressed by compressed-tensors (in the scales' dtype),
no activation quantization at all. Rows of schemes that quantize activations therefore compare weights only and
are marked; and the dequantizing loader applies one config group's scheme to every dense linear, so a checkpoint
with several groups (SmolLM2's 576-wide layers at group 64 beside group 128) cannot be read that way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def windows_for(ckpt: str, windows: int, seq_len: int):
    from quantkit.calibration.data import load_text
    from quantkit.eval.ppl_table import prepare

    return prepare(ckpt, load_text("emma"), seq_len, windows, min_tokens=1)


def transformers_ppl(ckpt: str, windows: int, seq_len: int) -> dict:
    """Run in a child process: the checkpoint as transformers + compressed-tensors build it, scored."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from quantkit.eval.ppl import perplexity

    prepared = windows_for(ckpt, windows, seq_len)
    # dequantize=True: compressed-tensors decompresses every weight at load (its compressed Linear does not
    # run on CPU in this release: its forward asks for a `weight` the packed module lacks)
    quantized = "quantization_config" in json.loads((Path(ckpt) / "config.json").read_text())
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map="cpu", **extra)
    model.eval()
    res = perplexity(model, prepared.ids, seq_len, windows, prepared.bos)
    return {"ppl": res.ppl}


def quantkit_ppl(ckpt: str, windows: int, seq_len: int) -> float:
    from quantkit.calibration.data import load_text
    from quantkit.eval.ppl_table import evaluate_one

    prepared = windows_for(ckpt, windows, seq_len)
    return evaluate_one(ckpt, load_text("emma"), seq_len, windows, progress=False, prepared=prepared)["ppl"]


def machine() -> str:
    from quantkit.platform.compute import machine_summary

    return machine_summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=0.005, help="largest relative perplexity difference")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(transformers_ppl(args.child, args.windows, args.seq_len)))
        return
    print(machine(), flush=True)
    import transformers
    import compressed_tensors

    print(f"transformers {transformers.__version__}, compressed-tensors {compressed_tensors.__version__}; "
          f"float32, emma {args.windows} x {args.seq_len}", flush=True)
    print("| checkpoint | format | quantkit ppl | transformers ppl | ratio | compared |")
    print("|---|---|---|---|---|---|")
    off = 0
    for ckpt in args.checkpoints:
        config = json.loads((Path(ckpt) / "config.json").read_text()).get("quantization_config") or {}
        fmt = config.get("format", "-")
        acts = any(g.get("input_activations") for g in (config.get("config_groups") or {}).values())
        ours = quantkit_ppl(ckpt, args.windows, args.seq_len)
        proc = subprocess.run([sys.executable, __file__, "--child", ckpt, "--windows", str(args.windows),
                               "--seq-len", str(args.seq_len)], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"rc {proc.returncode}"])[-1][:160]
            print(f"| {ckpt} | {fmt} | {ours:.3f} | cannot run: {why} | - | - |", flush=True)
            continue
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        ratio = theirs["ppl"] / ours
        off += not acts and abs(ratio - 1) > args.tolerance
        what = "weights only (transformers quantizes no activations)" if acts else "the model"
        print(f"| {ckpt} | {fmt} | {ours:.3f} | {theirs['ppl']:.3f} | {ratio:.4f} | {what} |", flush=True)
    sys.exit(1 if off else 0)


if __name__ == "__main__":
    main()
