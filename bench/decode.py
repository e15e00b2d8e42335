"""Decode speed of the runner, measured back to back in one process.

Usage: python bench/decode.py BASELINE [MODEL ...] [--prompt TEXT] [-n 128] [--runs 5]
                              [--hf] [--draft DRAFT_MODEL [--num-draft-tokens 4]] [--device cpu|cuda[:N]]
Each run generates n tokens greedily from the same prompt (end tokens ignored, so every run
decodes n tokens); runs alternate between the setups and the median TTFT and decode tokens/s of
each is printed with the ratio to the first row's, and as a fraction of its memory-bandwidth
roofline: bandwidth / weight bytes read per token (every linear's stored weight and the head, in the
bytes the kernels read), with the read bandwidth measured here (a sum over a 1 GB buffer). quantkit's
models load as `quantkit generate` loads them (the decode workload's dtype choice). --hf adds
transformers' `generate` on the baseline model (same prompt, greedy, KV cache; a copy loaded apart)
in the dtype quantkit's batch policy picks for it and, when that is 16-bit, in float32 too (the
target compares with the faster); --draft adds speculative decoding of the baseline with that draft
(acceptance rate printed). --device runs every setup there (default cpu; on CUDA the read bandwidth is
measured on the device, and run 0, not counted, also runs the Triton kernels' autotuning).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# the CPU features each --policy-as stands for
POLICY_AS = {"AVX2": lambda cls: cls("AVX2", True),
             "AMX": lambda cls: cls("AVX512", True, avx512_bf16=True, amx_tile=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompt", default="The history of the English novel")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hf", action="store_true", help="Also time transformers' generate on the first model.")
    parser.add_argument("--draft", help="Also time speculative decoding of the first model with this draft.")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto: where every setup runs.")
    parser.add_argument("--policy-as", choices=sorted(POLICY_AS), help="Let the compute policy choose as it would "
                        "on this kind of CPU (the hardware is still this one): AVX2 = no fast bf16, AMX = bf16 "
                        "without a probe (an AVX-512 Xeon with avx512_bf16 and AMX).")
    args = parser.parse_args()
    if args.policy_as:
        from quantkit.platform import compute

        compute.cpu_features = lambda: POLICY_AS[args.policy_as](compute.CpuFeatures)

    from quantkit.platform import devices
    from quantkit.runtime.generate import generate
    from quantkit.checkpoints.loader import load, load_tokenizer
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.runtime.speculative import speculative_generate

    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    tok = load_tokenizer(args.models[0])
    ids = tok(args.prompt)["input_ids"]
    device = devices.resolve(args.device, "--device").device
    models = {name: load(name, workload="decode", device=device) for name in args.models}
    setups = {f"quantkit {name}": (lambda m=m: _ours(generate, m, tok, ids, params)) for name, m in models.items()}
    base = models[args.models[0]]
    hf_rows = {}
    if args.hf:  # its own copies: quantkit's decode re-lays out the weights of the models it runs
        import torch

        # the batch policy's dtype (bf16 where GEMMs are fast), as transformers loads it
        batch = load(args.models[0], device=device)
        for dtype in dict.fromkeys([batch.dtype, torch.float32]):
            hf_model = batch if dtype == batch.dtype else load(args.models[0], dtype=dtype, device=device)
            name = f"transformers generate {args.models[0]} ({str(dtype).removeprefix('torch.')})"
            hf_rows[name] = hf_model
            setups[name] = lambda m=hf_model: _hf(m, ids, args.max_new_tokens)
    if args.draft:
        draft = load(args.draft, workload="decode", device=device)
        setups[f"quantkit {args.models[0]} + draft {args.draft}"] = \
            lambda: _spec(speculative_generate, base, draft, tok, ids, params, args.num_draft_tokens)
    results: dict[str, list] = {name: [] for name in setups}
    for run in range(args.runs + 1):  # run 0 warms up
        for name, fn in setups.items():
            r = fn()
            if run:
                results[name].append(r)
    from quantkit.platform import compute

    print(compute.machine_summary())
    print("; ".join(dict.fromkeys(f"{n}: {m.quantkit_compute.describe()}" for n, m in models.items())))
    shown = args.prompt if len(args.prompt) <= 80 else args.prompt[:77] + "..."
    print(f"prompt {shown!r} ({len(ids)} tokens), "
          f"{args.max_new_tokens} new tokens, greedy, median of {args.runs} alternating runs")
    from quantkit.kernels.roofline import read_bandwidth

    bandwidth = read_bandwidth(device)
    per_token = {f"quantkit {n}": _bytes_per_token(m) for n, m in models.items()}
    for name, m in hf_rows.items():
        per_token[name] = _bytes_per_token(m)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s on {device} (sum over a 1 GB float32 buffer, best of 6)")
    print("| setup | decode tok/s | vs first row | weight MB/token | roofline tok/s | of roofline | TTFT ms | tokens | draft acceptance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    first = None
    for name, rs in results.items():
        tps = statistics.median(r[0] for r in rs)
        first = first or tps
        ttft = statistics.median(r[1] for r in rs) * 1e3
        acc = statistics.median(r[3] for r in rs) if rs[0][3] is not None else None
        b = per_token.get(name)
        roof = f"{b / 1e6:.0f} | {bandwidth / b:.0f} | {tps / (bandwidth / b):.0%}" if b else "- | - | -"
        print(f"| {name} | {tps:.1f} | {tps / first:.2f}x | {roof} | {ttft:.0f} | {rs[0][2]} | "
              f"{'-' if acc is None else f'{acc:.0%}'} |")
    if hf_rows:
        fastest = max(hf_rows, key=lambda n: statistics.median(r[0] for r in results[n]))
        print(f"quantkit {args.models[0]} / the faster transformers row ({fastest}): "
              f"{first / statistics.median(r[0] for r in results[fastest]):.2f}x (target: at least 1.2x)")


def _bytes_per_token(model) -> int:
    """Bytes a decode step reads from weights: every linear's stored weight tensors (packed codes and
    scales for quantized ones), the LM head among them (tied or not); embeddings read one row (ignored).
    (Until 2026-12-03 a tied head was counted twice: SmolLM2's 538 MB read as 651.)"""
    from torch import nn

    emb = model.get_input_embeddings()
    total = 0
    for module in model.modules():
        if module is emb:
            continue
        if isinstance(module, nn.Linear) or hasattr(module, "weight_packed") or hasattr(module, "weight_scale"):
            total += sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return total  # the head is a linear (tied or not): counted once above


def _ours(generate, model, tok, ids, params):
    c = generate(model, tok, ids, params)
    return c.decode_tokens_per_second, c.ttft_seconds, len(c.token_ids), None


def _spec(speculative_generate, model, draft, tok, ids, params, k):
    c, stats = speculative_generate(model, draft, tok, ids, params, k)
    return c.decode_tokens_per_second, c.ttft_seconds, len(c.token_ids), stats.acceptance_rate


def _hf(model, ids, n):
    """transformers' generate; TTFT from a 1-token run, decode rate from the rest (same process)."""
    import torch
    from transformers import GenerationConfig

    x = torch.tensor([ids], device=next(model.parameters()).device)
    cfg = GenerationConfig(max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    model.generate(x, generation_config=cfg)
    ttft = time.perf_counter() - t
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    out = model.generate(x, generation_config=cfg)
    total = time.perf_counter() - t
    generated = out.shape[1] - len(ids)
    return (generated - 1) / max(total - ttft, 1e-9), ttft, generated, None


if __name__ == "__main__":
    main()
