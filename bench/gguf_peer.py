"""GGUF against llama.cpp itself: quantkit's calibrated GGUF files vs `llama-quantize` (with and without
an importance matrix from `llama-imatrix`), all scored by `llama-perplexity` on emma.txt with
`--kl-divergence` against the f16 GGUF that llama.cpp's own `convert_hf_to_gguf.py` makes.

Both sides calibrate on the same 64 x 512 tokens: quantkit's calibration windows (the recipes' default,
mix-v1), decoded to text for `llama-imatrix -c 512 --chunks 64`. Every protocol (`--protocols`, CTX x
CHUNKS) scores every file; each quantkit row also shows its increase in perplexity and its KLD as a share
of its llama.cpp peer's (the same file type with the importance matrix; Q8_0 has none). Needs llama.cpp's
tools (`bash ../shared/tools/build-llamacpp.sh`; LLAMACPP_HOME, default ~/.cache/llamacpp).

    python bench/gguf_peer.py smollm2-135m --work /tmp/ggbench   # both protocols: 40 x 512 and 16 x 2048
    python bench/gguf_peer.py smollm2-135m --kinds Q4_K_M --recipes gptq-q4_k_m   # one file type only
    python bench/gguf_peer.py smollm2-135m --reuse-llamacpp --recipes 'gptq-q4_0,gptq-q4_0@stages.0.args.dampening_frac=0.05'
                                            # a recipe with overrides (--set KEY=VALUE each, '@'-separated)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("LLAMACPP_HOME", Path.home() / ".cache" / "llamacpp"))
EMMA = ROOT / "evals" / "data" / "emma.txt"


def run(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - start


def calibration_text(model: Path, out: Path) -> None:
    """quantkit's calibration windows for the recipe, decoded (one per line)."""
    from quantkit.plugins.catalog import adapter_for
    from quantkit.formats.checkpoint import read_config
    from quantkit.flow.sources import calibration_batches
    from quantkit.flow.recipe import load_recipe
    from quantkit.checkpoints.loader import load_tokenizer

    recipe = load_recipe("gptq-q4_0")
    adapter = adapter_for(read_config(model)["model_type"])
    batches = calibration_batches(model, recipe, adapter.needs_bos)
    tok = load_tokenizer(model)
    rows = [r for b in batches for r in b.tolist()]
    if adapter.needs_bos:
        rows = [r[1:] for r in rows]
    out.write_text("\n".join(tok.decode(r) for r in rows) + "\n", encoding="utf-8")


def score(L: Path, gguf: Path, base_logits: Path, chunks: int, ctx: int, log: Path) -> dict:
    """llama-perplexity's KLD statistics of one file. llama.cpp's log thread is never joined, so a run that
    succeeds can lose its closing lines (the statistics): such a run is repeated (at most 3 runs in all)."""
    num = r"([0-9.eE+-]+)"
    for _ in range(3):
        run([str(L / "llama-perplexity"), "-m", str(gguf), "-f", str(EMMA), "-c", str(ctx), "--chunks", str(chunks),
             "-t", str(os.cpu_count()), "--kl-divergence-base", str(base_logits), "--kl-divergence"], log)
        text = log.read_text(errors="replace")

        def find(label):
            m = re.search(label + r"\s*:\s*" + num, text)
            return float(m.group(1)) if m else None

        row = {"ppl": find(r"Mean PPL\(Q\)"), "ppl_base": find(r"Mean PPL\(base\)"), "kld": find(r"Mean    KLD"),
               "kld_99": find(r"99\.0%   KLD"), "top1": find(r"Same top p"), "bytes": gguf.stat().st_size}
        if None not in (row["ppl"], row["ppl_base"], row["kld"], row["top1"]):
            return row
    sys.exit(f"llama-perplexity printed no KLD statistics for {gguf} in 3 runs; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="demo model name or checkpoint directory")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ggbench"))
    ap.add_argument("--protocols", default="512x40,2048x16",
                    help="llama-perplexity protocols scored, CTXxCHUNKS each (emma.txt windows of CTX tokens)")
    ap.add_argument("--recipes", default="gptq-q4_0,awq-q4_0,gptq-q4_k_m,gptq-q8_0,gptq-q4_1")
    ap.add_argument("--kinds", default="Q4_0,Q4_K_M,Q8_0,Q4_1", help="llama-quantize file types to compare with")
    ap.add_argument("--reuse-llamacpp", action="store_true",
                    help="keep llama.cpp's files (and their times) from an earlier run in --work; all are scored again")
    args = ap.parse_args()
    from quantkit.checkpoints.resolve import resolve_model

    L = HOME / "bin"
    if not (L / "llama-perplexity").is_file():
        sys.exit(f"llama.cpp's tools are not in {L}: bash ../shared/tools/build-llamacpp.sh")
    model = resolve_model(args.model)
    w = args.work / model.name
    w.mkdir(parents=True, exist_ok=True)
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} threads; model {model}")
    f16 = w / "f16.gguf"
    if not f16.exists():
        run([sys.executable, str(HOME / "src" / "convert_hf_to_gguf.py"), str(model), "--outtype", "f16",
             "--outfile", str(f16)], w / "convert.log")
    calib = w / "calibration.txt"
    calibration_text(model, calib)
    times, files = {}, {}
    saved = w / "llamacpp-times.json"
    if args.reuse_llamacpp and saved.is_file():
        times = json.loads(saved.read_text())
        files = {name: w / f"llamacpp-{name.split()[1]}{'-imatrix' if 'imatrix' in name else ''}.gguf"
                 for name in times if name.startswith("llama.cpp ")}
    else:
        _llamacpp(L, f16, calib, w, times, files, args.kinds.split(","))
        saved.write_text(json.dumps(times, indent=2))
    _quantkit(args, model, w, times, files)
    _report(args, L, f16, w, times, files)


def _llamacpp(L: Path, f16: Path, calib: Path, w: Path, times: dict, files: dict, kinds: list[str]) -> None:
    times["llama-imatrix"] = run([str(L / "llama-imatrix"), "-m", str(f16), "-f", str(calib), "-c", "512",
                                  "--chunks", "64", "-t", str(os.cpu_count()), "-o", str(w / "imatrix.gguf")],
                                 w / "imatrix.log")
    for kind in kinds:
        for imatrix in (False, True):
            if kind == "Q8_0" and imatrix:
                continue  # llama.cpp's Q8_0 ignores the importance matrix
            name = f"llama.cpp {kind}" + (" + imatrix" if imatrix else "")
            out = w / f"llamacpp-{kind}{'-imatrix' if imatrix else ''}.gguf"
            cmd = [str(L / "llama-quantize")] + (["--imatrix", str(w / "imatrix.gguf")] if imatrix else []) + \
                  [str(f16), str(out), kind, str(os.cpu_count())]
            times[name] = run(cmd, w / f"{out.stem}.log") + (times["llama-imatrix"] if imatrix else 0.0)
            files[name] = out


def _variant(spec: str) -> tuple[str, list[str], str]:
    """'RECIPE[@KEY=VALUE@KEY=VALUE...]' -> (the recipe, its --set arguments, a file-name tag)."""
    recipe, *sets = spec.split("@")
    pairs = [s.partition("=") for s in sets]  # each tagged by its key's last part and its value
    tag = "-".join([recipe, *(re.sub(r"[^A-Za-z0-9._]+", "_", f"{k.rsplit('.', 1)[-1]}_{v}") for k, _, v in pairs)])
    return recipe, [a for s in sets for a in ("--set", s)], tag


def _quantkit(args, model: Path, w: Path, times: dict, files: dict) -> None:
    for spec in args.recipes.split(","):
        recipe, sets, tag = _variant(spec)
        ckpt = w / f"quantkit-{tag}"
        t = run([sys.executable, "-m", "quantkit", "quantize", str(model), "--recipe", recipe, "-o", str(ckpt),
                 "--overwrite", *sets], w / f"{tag}.log")
        out = w / f"quantkit-{tag}.gguf"
        t += run([sys.executable, "-m", "quantkit", "export", "gguf", str(ckpt), "-o", str(out), "--overwrite"],
                 w / f"{tag}-export.log")
        times[f"quantkit {spec}"] = t
        files[f"quantkit {spec}"] = out


def _report(args, L: Path, f16: Path, w: Path, times: dict, files: dict) -> None:
    out = {}
    for protocol in args.protocols.split(","):
        ctx, chunks = (int(v) for v in protocol.split("x"))
        out[protocol] = _score_protocol(L, f16, w, times, files, ctx, chunks)
    (w / "results.json").write_text(json.dumps(out, indent=2))


def _peer_of(name: str) -> Optional[str]:
    """The llama.cpp row a quantkit recipe is held against (its file type with the importance matrix)."""
    recipe = name.split("@", 1)[0]
    kind = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "q4_1": "Q4_1"}.get(recipe.rsplit("-", 1)[-1])
    if kind is None:
        return None
    return f"llama.cpp {kind}" + ("" if kind == "Q8_0" else " + imatrix")


def _score_protocol(L: Path, f16: Path, w: Path, times: dict, files: dict, ctx: int, chunks: int) -> dict:
    base = w / "f16.logits"
    run([str(L / "llama-perplexity"), "-m", str(f16), "-f", str(EMMA), "-c", str(ctx), "--chunks",
         str(chunks), "-t", str(os.cpu_count()), "--kl-divergence-base", str(base)], w / "f16-ppl.log")
    rows = {}
    for name, path in files.items():
        rows[name] = score(L, path, base, chunks, ctx, w / f"{path.stem}-{ctx}-ppl.log")
        rows[name]["seconds"] = round(times[name], 1)
    base.unlink()
    ppl0 = next(iter(rows.values()))["ppl_base"]
    print(f"\nllama-perplexity, emma.txt, {chunks} x {ctx} tokens; KLD vs f16 ({ppl0:.4f}); "
          f"cpu {torch.backends.cpu.get_cpu_capability()}, {platform_line()}")
    print("| file | size MB | PPL | ΔPPL | mean KLD | same top-1 % | ΔPPL / peer's | KLD / peer's | time s |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        peer = rows.get(_peer_of(name)) if name.startswith("quantkit ") else None
        ratio = f"{(r['ppl'] - ppl0) / (peer['ppl'] - ppl0):.2f}x" if peer and peer["ppl"] != ppl0 else "-"
        kratio = f"{r['kld'] / peer['kld']:.2f}x" if peer and peer["kld"] else "-"
        print(f"| {name} | {r['bytes'] / 1e6:.2f} | {r['ppl']:.4f} | {r['ppl'] - ppl0:+.4f} | {r['kld']:.5f} | "
              f"{r['top1']:.2f} | {ratio} | {kratio} | {r['seconds']} |")
    return rows


def platform_line() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu model unknown"


if __name__ == "__main__":
    main()
