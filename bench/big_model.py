"""A Llama-3-8B-shaped checkpoint with random weights, and the memory and time of quantizing it.

Usage: python bench/big_model.py write DIR [--layers 32] [--tokenizer DIR]   # ~16 GB of bf16, shard by shard
       python bench/big_model.py quantize DIR RECIPE [--set k=v ...] [--load layers|whole|model-free] [-o OUT]
Shapes: hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 KV heads, vocab 128256 (Llama-3-8B).
The tokenizer is SmolLM2's (its ids fit the vocabulary), for calibration text: the demo model's, or the
tokenizer files of `--tokenizer DIR` (where the demo model cannot be fetched, e.g. the lent GPU machine).
`quantize` prints the CPU line, wall time by phase, peak resident memory and peak live allocated bytes
(glibc's accounting, sampled every 2 ms), and the checkpoint size. `--load model-free` runs the tensor-by-tensor
path (`flow/model_free.py`) and first times one plain read of the source's tensors (the page cache dropped
before each where this user may write /proc/sys/vm/drop_caches; said either way) for the ratio to disk speed.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def write(out: Path, layers: int, shard_gb: float, tokenizer: Path | None = None) -> None:
    import torch
    from transformers import AutoConfig

    from quantkit.formats.checkpoint import ShardWriter
    from quantkit.checkpoints.demo import fetch

    out.mkdir(parents=True, exist_ok=False)
    config = AutoConfig.for_model("llama", num_hidden_layers=layers, dtype="bfloat16", **SHAPE)
    config.save_pretrained(out)
    tok = tokenizer or fetch("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tok / name, out / name)
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):  # weight-like values: ~N(0, 0.02), one tensor at a time
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    writer = ShardWriter(out, int(shard_gb * 1e9))
    writer.add("model.embed_tokens.weight", rand(SHAPE["vocab_size"], h))
    for li in range(layers):
        p = f"model.layers.{li}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            writer.add(p + name + ".weight", rand(*shape))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            writer.add(p + norm + ".weight", torch.ones(h, dtype=torch.bfloat16))
        print(f"layer {li + 1}/{layers} written", flush=True)
    writer.add("model.norm.weight", torch.ones(h, dtype=torch.bfloat16))
    writer.add("lm_head.weight", rand(SHAPE["vocab_size"], h))
    files = writer.close()
    print(f"wrote {out}: {sum(f.stat().st_size for f in files) / 1e9:.2f} GB in {len(files)} files")


def quantize(src: Path, recipe_name: str, overrides: list[str], load_mode: str, out: Path, live: bool,
             device: str) -> None:
    from quantkit.platform import compute
    from quantkit.platform.memory import PeakSampler, live_heap_bytes
    from quantkit.flow.job import quantize as run
    from quantkit.flow.recipe import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    print(compute.machine_summary())
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"source {src}: {size / 1e9:.2f} GB; recipe {recipe.name} {' '.join(overrides) or ''}; load {load_mode}")
    if load_mode == "model-free":
        model_free(src, recipe, out, size)
        return
    base = live_heap_bytes() or 0
    start = time.perf_counter()
    with PeakSampler(0.005, live=live, where=True) as peak:  # live: glibc's accounting too (slows the job a little)
        report = run(str(src), recipe, out, overwrite=True, progress=False, load_mode=load_mode, device=device,
                     notify=lambda line: print(line, flush=True))
    wall = time.perf_counter() - start
    print(f"quantize: {report.compute.describe()}")
    print(f"wall time {wall:.1f} s (pipeline {report.result.seconds:.1f} s)")
    for phase, seconds in report.result.timings.items():
        print(f"  {phase:<42} {seconds:8.1f} s")
    out_size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    live_line = f"; peak live allocations {(peak.peak - base) / 1e9:.2f} GB above the start" if live else ""
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f} GB (sampled {peak.peak_rss / 1e9:.2f} GB, "
          f"{peak.file_at_peak / 1e9:.2f} GB of it file-backed)"
          f"{live_line}")
    print(f"peak reached in: {peak.peak_where or '(unknown)'}")
    print(report.closing_line())
    print(f"checkpoint {out_size / 1e9:.2f} GB ({out_size / size:.3f} of the source)")
    meta = json.loads((Path(out) / "quantkit.json").read_text())
    print(f"{len(meta['layers'])} linears quantized")


def _drop_caches() -> str:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped"
    except OSError:
        return "page cache NOT dropped (no permission)"


def model_free(src: Path, recipe, out: Path, size: int) -> None:
    from quantkit.flow.model_free import quantize_model_free
    from quantkit.formats.lazy import LazyCheckpoint
    from quantkit.platform.memory import PeakSampler

    note = _drop_caches()
    start = time.perf_counter()
    for _ in LazyCheckpoint(src).pieces():  # 64 MB at a time, as the model-free job copies what it keeps
        pass
    read = time.perf_counter() - start
    print(f"one read of every tensor: {read:.1f} s ({size / read / 1e9:.2f} GB/s; {note})")
    note = _drop_caches()
    start = time.perf_counter()
    with PeakSampler(0.005, live=False, where=False) as peak:
        quantize_model_free(src, recipe, out, overwrite=True, notify=print)
    wall = time.perf_counter() - start
    out_size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(f"model-free quantize: {wall:.1f} s = {wall / read:.2f}x the read ({note}); peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f} GB (sampled {peak.peak_rss / 1e9:.2f} GB,"
          f" {peak.file_at_peak / 1e9:.2f} GB of it file-backed); checkpoint {out_size / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--layers", type=int, default=32)
    w.add_argument("--shard-gb", type=float, default=5.0)
    w.add_argument("--tokenizer", type=Path, default=None, help="a directory with SmolLM2's tokenizer files")
    q = sub.add_parser("quantize")
    q.add_argument("dir", type=Path)
    q.add_argument("recipe")
    q.add_argument("--set", dest="overrides", action="append", default=[])
    q.add_argument("--load", default="layers", choices=["layers", "whole", "model-free"])
    q.add_argument("-o", "--output", type=Path, default=None)
    q.add_argument("--live", action="store_true", help="Also sample glibc's live allocated bytes (every 5 ms).")
    q.add_argument("--device", default="auto")
    args = parser.parse_args()
    if args.cmd == "write":
        write(args.dir, args.layers, args.shard_gb, args.tokenizer)
    else:
        quantize(args.dir, args.recipe, args.overrides, args.load, args.output or args.dir.with_name(args.dir.name + "-q"),
                 args.live, args.device)


if __name__ == "__main__":
    main()
