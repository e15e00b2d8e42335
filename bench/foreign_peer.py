"""GPTQ / AWQ checkpoints read by quantkit against the reader transformers uses for them (GPTQModel).

Usage: python bench/foreign_peer.py CKPT [CKPT ...] --peer-python /path/to/gptqmodel-venv/bin/python
           [--windows 4] [--compare-with CT_CKPT]
Set up the peer once (GPTQModel asks for a newer torch than quantkit pins; it runs on 2.13 installed without
its dependency check, after one patch for 2-core machines):
  python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install --no-deps gptqmodel==7.7.0 optimum \\
    && V/bin/pip install transformers==<quantkit's> accelerate safetensors threadpoolctl packaging device-smi logbar \\
       tokenicer pypcre defuser protobuf pillow requests
  sed -i 's/"model_loader:cpu": 2,/"model_loader:cpu": 1,/' V/lib/python3*/site-packages/gptqmodel/__init__.py

For each checkpoint: every quantized linear's weight as GPTQModel dequantizes it (its CPU kernels' own
`dequantize_weight`, fp16) against quantkit's dequantized weight rounded to fp16 (count of linears equal to the
bit); the two models' logits on one sequence; quantkit's float32 perplexity on emma (evals/PROTOCOL.md windows of
512) of the checkpoint and, with --compare-with, of the compressed-tensors checkpoint it was made from.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TOKENS = [[1, 504, 3458, 282, 260, 3984, 3285, 314, 2458, 30, 2149, 17, 198, 504, 314]]


def peer_dump(ckpt: str, out: str) -> None:
    """Run in the peer's venv: load through transformers + GPTQModel, save dequantized weights and logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, device_map="cpu", dtype=torch.float16)
    weights = {}
    for name, module in model.named_modules():
        if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
            weights[name] = module.dequantize_weight().t().contiguous().to(torch.float16)
    with torch.no_grad():
        weights["__logits__"] = model(torch.tensor(TOKENS)).logits.float()[0].contiguous()
    save_file(weights, out)
    print(f"peer: {len(weights) - 1} quantized linears ({type(module).__name__} among them)")


def machine() -> str:
    import torch

    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor())
    return f"{name}, capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def compare(ckpt: Path, peer_python: str, windows: int) -> dict:
    import torch
    from safetensors.torch import load_file

    import quantkit
    from quantkit.calibration.data import load_text
    from quantkit.eval.ppl_table import evaluate_one

    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "peer.safetensors"
        subprocess.run([peer_python, __file__, "--peer-dump", str(ckpt), str(dump)], check=True)
        theirs = load_file(str(dump))
    model = quantkit.load(ckpt, dtype=torch.float32)
    equal, worst = 0, 0.0
    names = [k for k in theirs if k != "__logits__"]
    for name in names:
        ours = model.get_submodule(name).dequantize(torch.float32).to(torch.float16)
        equal += int(torch.equal(ours, theirs[name]))
        worst = max(worst, (ours.float() - theirs[name].float()).abs().max().item())
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits[0]
    rel = ((logits - theirs["__logits__"]).norm() / logits.norm()).item()
    ppl = evaluate_one(str(ckpt), load_text("emma"), seq_len=512, max_windows=windows, progress=False)["ppl"]
    return {"linears": len(names), "equal": equal, "max_diff": worst, "logits_rel": rel, "ppl": ppl}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-dump":
        peer_dump(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--peer-python", required=True)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--compare-with", type=Path, default=None, help="the compressed-tensors checkpoint they came from")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if args.compare_with is not None:
        from quantkit.calibration.data import load_text
        from quantkit.eval.ppl_table import evaluate_one

        ppl = evaluate_one(str(args.compare_with), load_text("emma"), seq_len=512, max_windows=args.windows,
                           progress=False)["ppl"]
        print(f"{args.compare_with}: emma {args.windows} x 512 ppl {ppl:.6f} (compressed-tensors, quantkit)")
    for ckpt in args.checkpoints:
        r = compare(ckpt, args.peer_python, args.windows)
        print(f"{ckpt}: {r['equal']}/{r['linears']} linears equal to GPTQModel's fp16 dequantization (max diff "
              f"{r['max_diff']:.3g}); logits rel. diff {r['logits_rel']:.2e} (GPTQModel fp16 vs quantkit float32); "
              f"emma {args.windows} x 512 ppl {r['ppl']:.6f} (quantkit)")


if __name__ == "__main__":
    main()
