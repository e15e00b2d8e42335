"""Our checkpoints read by readers we did not write: the compressed-tensors library and transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe

from helpers import sample_ids

ct = pytest.importorskip("compressed_tensors")

CASES = [("rtn-w4a16", ["stages.0.scheme.group_size=32"]), ("rtn-w4a16-asym", ["stages.0.scheme.group_size=64"]),
         ("rtn-w8a16", []),
         # low-bit presets: 3 and 5 bits straddle int32 words, 2 bits do not
         ("gptq-w3a16", ["stages.0.scheme.group_size=32", "calibration.num_samples=4", "calibration.seq_len=32"]),
         ("rtn-w4a16", ["stages.0.scheme=W2A16", "stages.0.scheme.group_size=32"]),
         ("rtn-w4a16", ["stages.0.scheme=W5A16", "stages.0.scheme.group_size=32"])]


def _case_id(case) -> str:
    name, overrides = case
    preset = [o.split("=")[1] for o in overrides if o.startswith("stages.0.scheme=")]
    return f"{name}-{preset[0]}" if preset else name


@pytest.fixture(scope="module", params=CASES, ids=[_case_id(c) for c in CASES])
def checkpoint(request, tiny_models, tmp_path_factory):
    name, overrides = request.param
    out = tmp_path_factory.mktemp("interop") / _case_id(request.param)
    return quantize(str(tiny_models["llama"]), load_recipe(name, overrides), out, progress=False).output


def test_compressed_tensors_decompresses_to_our_weights(checkpoint):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    ours = quantkit.load(checkpoint)
    checked = 0
    for name, module in ours.named_modules():
        if not hasattr(module, "weight_packed"):
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        assert torch.equal(theirs, module.dequantize(torch.bfloat16)), name
        checked += 1
    assert checked == 21


def test_transformers_loads_and_matches_our_runner(checkpoint, tokenizer, request):
    """transformers (through compressed-tensors) decompresses to plain Linear; logits must agree.

    Tolerance: atol 1e-5 in float32 -- both dequantize (q - z) * s exactly and run the same graph.
    """
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    if checkpoint.name == "rtn-w4a16-asym" and Version(transformers.__version__) > Version("5.17"):
        # transformers 5.25 sizes weight_zero_point unpacked ([out, groups]) while compressed-tensors
        # (and llm-compressor's checkpoints) store it packed along out; the library itself
        # decompresses our file correctly (test above). Upstream: llm-compressor issue #1618.
        # 5.17 loads it and matches (seen with compressed-tensors 0.20.1); releases between were not tried.
        seen_failing = Version(transformers.__version__) >= Version("5.25")
        request.applymarker(pytest.mark.xfail(strict=seen_failing, reason="transformers cannot load packed asym zero points"))

    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ours = quantkit.load(checkpoint, dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
