"""A checkpoint with random weights in the shape of another: its config and tokenizer, seeded weights.

Usage: python bench/random_model.py LIKE OUT [--layers N] [--dtype bfloat16] [--seed 0]

For machines the real weights cannot reach (the lent GPU machine takes 64 MiB from here; SmolLM2's
weights are 270 MB): `bench/gpu_carry.sh` carries SmolLM2's config and tokenizer, and this builds a
model of its shape there, for wall time and memory (not quality: a random model's perplexity is ~5e4).
Weights are transformers' own initialisation (normal, std = the config's initializer_range) under
`--seed`, so two runs write the same tensors; `--layers` keeps the first N decoder layers.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write(like: Path, out: Path, layers: int | None = None, dtype: str = "bfloat16", seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if out.exists():
        raise SystemExit(f"{out} exists; remove it or choose another directory")
    config = AutoConfig.from_pretrained(like)  # never trust_remote_code: a known architecture only
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out.mkdir(parents=True)
    model.save_pretrained(out)  # safetensors
    for name in TOKENIZER_FILES:
        if (like / name).is_file():
            shutil.copy2(like / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {config.model_type}, {config.num_hidden_layers} layers, {params / 1e6:.1f}M parameters "
          f"({dtype}, seed {seed})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("like", type=Path, help="a model directory: its config.json (and tokenizer files)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.like, args.out, args.layers, args.dtype, args.seed)


if __name__ == "__main__":
    main()
