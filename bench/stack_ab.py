"""The native decode stack on and off, alternating in one process (QUANTKIT_NATIVE_STACK, read per generate).

Usage: python bench/stack_ab.py [MODEL:TOKENIZER:TOKENS ...] [--repeats 6]
Default models: SmolLM2-135M and Gemma-3-270m (bf16) and the W4A16 checkpoints of bench/RESULTS.md
(/tmp/qk/sm-rtn-g64, /tmp/qk/gemma-rtn). Each generate decodes TOKENS tokens greedily from one prompt; the
setups alternate --repeats times and the median decode tokens/s of each is printed with their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT = ("smollm2-135m:smollm2-135m:64", "/tmp/qk/sm-rtn-g64:smollm2-135m:64",
           "gemma3-270m:gemma3-270m:32", "/tmp/qk/gemma-rtn:gemma3-270m:32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(DEFAULT))
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    from quantkit.checkpoints.loader import load, load_tokenizer
    from quantkit.platform import compute
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    print(compute.machine_summary())
    for spec in args.models:
        name, tok_name, tokens = spec.rsplit(":", 2)
        model, tok = load(name, workload="decode"), load_tokenizer(tok_name)
        ids = tok("The history of the English novel")["input_ids"]
        params = SamplingParams(max_new_tokens=int(tokens), ignore_eos=True)
        generate(model, tok, ids, params)  # warm-up: probes, fusing, the native build
        speeds: dict[str, list[float]] = {"0": [], "1": []}
        for _ in range(args.repeats):
            for flag in speeds:
                os.environ["QUANTKIT_NATIVE_STACK"] = flag
                speeds[flag].append(generate(model, tok, ids, params).decode_tokens_per_second)
        off, on = statistics.median(speeds["0"]), statistics.median(speeds["1"])
        print(f"{name}: stack off {off:.1f} tok/s, on {on:.1f} tok/s, on / off {on / off:.2f}x")
        del model


if __name__ == "__main__":
    main()
