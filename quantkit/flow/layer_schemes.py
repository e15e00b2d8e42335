"""Model-bound scheme resolution, in one place: the scheme each targeted linear gets once the model's shapes
are known. A recipe's group size that does not divide a layer's inputs falls back to the largest of
FALLBACK_GROUP_SIZES that does (a size given by --set is an error instead); Q4_K_M is llama.cpp's
per-tensor mixture of ggml grids."""

from __future__ import annotations

import math
from functools import reduce

from torch import nn

from quantkit.errors import QuantizationError
from quantkit.plugins.catalog import checkpoint_namer
from quantkit.quant.schemes import PRESETS, QuantScheme, resolve_scheme


def layer_schemes(model: nn.Module, names: list[str], scheme: QuantScheme, stage: int,
                  explicit: bool) -> tuple[dict[str, QuantScheme], dict[str, QuantScheme]]:
    """(the linears whose group size falls back, each with its scheme; a mixture's scheme per linear)."""
    if scheme.grid == "q4_k_m":
        return {}, _ggml_mixture(model, names, stage)
    return fit_group_size({n: model.get_submodule(n).in_features for n in names}, scheme, stage, explicit), {}


FALLBACK_GROUP_SIZES = (64, 32)  # for a layer a recipe's default group size does not divide, the largest that does


def fit_group_size(sizes: dict[str, int], scheme: QuantScheme, stage: int, explicit: bool) -> dict[str, QuantScheme]:
    """The linears (name: in_features) whose in_features the group size does not divide, each with the scheme it
    gets instead: the largest of FALLBACK_GROUP_SIZES that divides it. A group size given by --set
    (`explicit`), or a layer no fallback fits, is an error naming the layer and the sizes that fit."""
    if scheme.strategy != "group":
        return {}
    bad = [n for n, k in sizes.items() if k % scheme.group_size]
    if not bad:
        return {}
    fitting = {n: next((g for g in FALLBACK_GROUP_SIZES if g < scheme.group_size and sizes[n] % g == 0), None)
               for n in bad}
    if not explicit and all(fitting.values()):
        return {n: scheme.model_copy(update={"group_size": g}) for n, g in fitting.items()}
    common = reduce(math.gcd, sizes.values())
    fits = [g for g in (16, 32, 64, 128, 256) if common % g == 0]
    raise QuantizationError(
        f"group_size {scheme.group_size} does not divide in_features {sizes[bad[0]]} of layer {bad[0]}"
        + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        + f"; group sizes that divide every targeted layer: {', '.join(map(str, fits)) or 'none (use strategy channel)'}"
        + f" -- e.g. --set stages.{stage}.scheme.group_size={fits[-1] if fits else 64}"
    )


def _ggml_mixture(model: nn.Module, names: list[str], stage: int) -> dict[str, QuantScheme]:
    """Each linear's ggml grid under llama.cpp's Q4_K_M rule (`quantkit.gguf.mixture`: Q4_K, Q6_K on the
    layers it picks for attn_v / ffn_down, its fallbacks Q5_0 / Q8_0 where a row is not whole super-blocks)."""
    from quantkit.gguf import metadata, mixture

    config = model.config
    namer = metadata.tensor_namer(config.model_type, config.num_hidden_layers)
    ckpt = checkpoint_namer(model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = {}
    for name in names:
        linear = model.get_submodule(name)
        gname = namer(ckpt(name) + ".weight")
        if gname is None:
            raise QuantizationError(f"stage {stage}: {name} has no GGUF tensor name for {config.model_type}; "
                                    f"add it to stages.{stage}.ignore")
        kind = mixture.tensor_type(gname, (linear.out_features, linear.in_features), "Q4_K_M", tied,
                                   config.num_hidden_layers)
        if kind not in PRESETS:
            raise QuantizationError(f"stage {stage}: {name} ({linear.in_features} inputs) has no Q4_K_M type "
                                    f"(llama.cpp keeps it {kind}); add it to stages.{stage}.ignore")
        out[name] = resolve_scheme(kind, {})
    return out
