"""The per-domain check at the end of a calibrated run: no regression hidden by an average.

A calibrated stage (GPTQ, AWQ) fits its choices to the calibration text; on a language or domain that text
lacks it can do worse than plain round-to-nearest (English-only GPTQ on Chinese text did). After such a run
the quantized model and a round-to-nearest copy of the same scheme (`rtn_counterpart`: every GPTQ stage made
RTN, AWQ's scaling dropped; static activation scales taken from the run, `run_scales`, so that it needs no
second calibration pass) are compared with the original on windows of each calibration part that
calibration did not use (`flow.sources.held_back_windows`): KL(original || model) per part. Any part where the
calibrated model's KLD is above round-to-nearest's is named in a warning; the rows go to the record and so to quantkit.json
(`domain_check`). A layer-by-layer run's check reads every model from disk a layer at a time, so it stays within
the run's memory.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.flow.recipe import Recipe, validate_recipe

CALIBRATED = ("gptq", "awq")
SCALE_NAMES = ("input_scale", "input_global_scale")  # a quantized linear's static activation scales
# every 4th position of each held-back window is scored (the models run on all of them): at Gemma-3's 262144-entry
# vocabulary the head and divergences were most of the check's time
CHECK_STRIDE = 4
MEMORY_SHARE = 0.6  # the three models must fit in this share of the available memory, else the check is skipped


def is_calibrated(recipe: Recipe) -> bool:
    return any(s.algorithm in CALIBRATED for s in recipe.stages)


def rtn_counterpart(recipe: Recipe) -> Recipe:
    """The recipe with round-to-nearest in place of its calibrated stages: GPTQ becomes RTN with the same scheme
    (activation order dropped; the fp8 stage for FP8 schemes), AWQ's scaling stage goes (the RTN stage after it stays), KV-cache stages go."""
    raw = recipe.model_dump(exclude_none=True)
    stages = []
    for stage, resolved in zip(raw["stages"], recipe.resolved):
        if stage["algorithm"] in ("awq", "kv_cache"):
            continue
        if stage["algorithm"] == "gptq":
            scheme = stage.get("scheme")
            if isinstance(scheme, dict):
                scheme = {k: v for k, v in scheme.items() if k != "actorder"}
            fp8 = resolved.scheme is not None and resolved.scheme.is_fp8  # FP8's nearest: the fp8 stage
            stage = {"algorithm": "fp8" if fp8 else "rtn", "scheme": scheme, "targets": stage.get("targets", ["Linear"]),
                     "ignore": stage.get("ignore", [])}
        stages.append(stage)
    raw = {**raw, "name": f"{recipe.name} (round-to-nearest counterpart)", "stages": stages}
    return validate_recipe(copy.deepcopy(raw), f"{recipe.name} round-to-nearest counterpart")


def run_scales(recipe: Recipe, quantized: Optional[nn.Module], output: Optional[Path],
               source: Path) -> Optional[dict[str, torch.Tensor]]:
    """The run's static activation scales {linear: scale} (NVFP4's activation global scales, static int8 / FP8
    input scales) for its round-to-nearest counterpart to take instead of calibrating its own: from the model in
    memory, else from the written checkpoint. None when there are none, when the recipe rescales inputs in a stage
    the counterpart drops (AWQ: its scales are for x / s), or when a name is not a linear of the source."""
    if any(s.algorithm == "awq" for s in recipe.stages):
        return None
    if quantized is not None:
        scales = {n.rsplit(".", 1)[0]: b.detach().clone() for n, b in quantized.named_buffers()
                  if n.rsplit(".", 1)[-1] in SCALE_NAMES}
    else:
        scales = _checkpoint_tensors(output, lambda key: key.rsplit(".", 1)[-1] in SCALE_NAMES)
    weights = set(_checkpoint_keys(source))
    if not scales or any(f"{name}.weight" not in weights for name in scales):
        return None
    return scales


def _checkpoint_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            keys.extend(h.keys())
    return keys


def _checkpoint_tensors(path: Optional[Path], wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")) if path is not None else ():
        with safe_open(str(f), "pt") as h:
            out.update({k.rsplit(".", 1)[0]: h.get_tensor(k) for k in h.keys() if wanted(k)})
    return out


def compare(models: list[nn.Module], held_back: dict[str, torch.Tensor]) -> list[dict]:
    """Per part: KLD of models[1] (the calibrated one) and models[2] (round-to-nearest) against models[0]."""
    from quantkit.eval.compare import Text, score

    texts = [Text(name, hashlib.sha256(w.numpy().tobytes()).hexdigest(), w.flatten(), w)
             for name, w in held_back.items()]
    tallies, _ = score(models, texts, batch_size=max(w.shape[0] for w in held_back.values()),  # a part per forward
                       stride=CHECK_STRIDE)
    rows = []
    for text, per_model in zip(texts, tallies):
        ours, rtn = per_model[1].summary(), per_model[2].summary()
        rows.append({"part": text.name, "windows": int(text.windows.shape[0]), "kld": ours["kld_mean"],
                     "kld_rtn": rtn["kld_mean"], "top1_pct": ours["top1_pct"], "top1_pct_rtn": rtn["top1_pct"]})
    return rows


def format_rows(rows: list[dict]) -> str:
    cells = ", ".join(f"{r['part']} {r['kld']:.4f}/{r['kld_rtn']:.4f}" for r in rows)
    return f"domain check (KLD on held-back calibration windows, this recipe / round-to-nearest): {cells}"


def worse_than_rtn(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kld"] > r["kld_rtn"]]


def warning(rows: list[dict], recipe: Recipe) -> Optional[str]:
    worse = worse_than_rtn(rows)
    if not worse:
        return None
    names = ", ".join(f"{r['part']} (KLD {r['kld']:.4f} against {r['kld_rtn']:.4f})" for r in worse)
    return (f"WARNING: {recipe.name} is worse than round-to-nearest on {names}: the calibration data under-serves "
            "these; calibrate on a mix that holds them (calibration.dataset: mix-v1, calibration.mix: to weight "
            "them), or use the rtn recipe of this scheme for those users")


def fits(models_bytes: int) -> bool:
    from quantkit.platform.memory import available_memory

    available = available_memory()
    return not available or 3 * models_bytes <= MEMORY_SHARE * available


def run_check(source: Optional[Path], quantized: Optional[nn.Module], output: Optional[Path], recipe: Recipe,
              held_back: dict[str, torch.Tensor], dtype: torch.dtype, notify: Callable[[str], None],
              quantize: Callable[[object, Recipe, Optional[Path]], Optional[nn.Module]],
              layers: bool = False) -> tuple[Optional[list[dict]], Optional[str]]:
    """(the check's rows or None when it cannot run (said why), the warning or None); the warning is notified too.

    quantize(model or source, recipe, output, scales): the flow's run, for the round-to-nearest copy (in memory when
    output is None; `scales`: the run's static activation scales, `run_scales`, or None to calibrate them). layers: the run went layer by layer, so the check holds one decoder layer at a time as well: the
    original, the written checkpoint and a round-to-nearest copy written beside it (removed after) are read
    from disk layer by layer as they run (`runtime.offload`)."""
    from quantkit.checkpoints.loader import load

    if source is None or not held_back or (quantized is None and output is None):
        notify("domain check skipped: it needs the source checkpoint on disk and held-back calibration windows")
        return None, None
    weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    if not layers and not fits(weights * (2 if dtype == torch.float32 else 1)):
        notify(f"domain check skipped: the original, the quantized and a round-to-nearest model (~{3 * weights / 1e9:.1f}"
               " GB) would not fit in memory; run quantkit eval on the checkpoint instead")
        return None, None
    offload = "disk" if layers else "none"
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.rtn-" if output else "quantkit-rtn-",
                                     dir=output.parent if output else None) as tmp:
        scales = run_scales(recipe, quantized, output, source)
        if layers:
            quantize(source, rtn_counterpart(recipe), Path(tmp) / "rtn", scales)
            rtn = load(Path(tmp) / "rtn", dtype=dtype, offload="disk")
        else:
            rtn = quantize(load(source, dtype=dtype), rtn_counterpart(recipe), None, scales)
        original = load(source, dtype=dtype, offload=offload)
        ours = quantized if quantized is not None else load(output, dtype=dtype, offload=offload)
        rows = compare([original, ours, rtn], held_back)  # (no_grad inside: inference tensors would stay in `ours`)
        del original, ours, rtn
    notify(format_rows(rows))
    message = warning(rows, recipe)
    if message:
        notify(message)
    return rows, message


def rewrite_file(path: Path, text: str) -> None:
    """Replace a file that the run wrote (quantkit.json, now with the check's rows) atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
