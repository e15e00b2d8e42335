"""Layer-by-layer onloading (`quantkit.flow.onload`): the files equal whole-model quantization's, byte for byte,
for every kind of stage and architecture; shards stream; memory does not grow with depth; an
interrupted run leaves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe

from conftest import make_tiny_model
from helpers import sample_ids
from test_moe import N_EXPERTS, _save_tiny_moe

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["calibration.num_samples=4", "calibration.seq_len=32", "calibration.batch_size=2"]
RECIPES = {
    "rtn": ("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
    "gptq": ("gptq-w4a16", ["stages.0.scheme.group_size=32"] + SMALL),
    "gptq-two-pass": ("gptq-w4a16", ["stages.0.scheme.group_size=32", "stages.0.args.true_sequential=false"] + SMALL),
    "awq": ("awq-w4a16", ["stages.1.scheme.group_size=32"] + SMALL),
    "fp8-static-kv": ("fp8-static-kv", SMALL),  # fp8 stage with static input scales, then the kv_cache stage
    "gptq-fp8": ("gptq-fp8-dynamic", SMALL),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer, tiny_models):
    root = tmp_path_factory.mktemp("onload")
    return {
        **{a: tiny_models[a] for a in ("llama", "qwen3", "gemma3_text")},
        "qwen2": make_tiny_model("qwen2", root / "qwen2", tokenizer),
        "qwen3_moe": _save_tiny_moe(root / "moe", tokenizer, "qwen3_moe", intermediate_size=96, moe_intermediate_size=32,
                                    num_experts=N_EXPERTS, mlp_only_layers=[1]),
        "mixtral": _save_tiny_moe(root / "mixtral", tokenizer, "mixtral", intermediate_size=32, num_local_experts=N_EXPERTS),
    }


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "quantkit.json"}


def _both(source, recipe, overrides, tmp_path, **kw):
    whole = quantize(str(source), load_recipe(recipe, overrides), tmp_path / "whole", progress=False, load_mode="whole", **kw)
    layers = quantize(str(source), load_recipe(recipe, overrides), tmp_path / "layers", progress=False, **kw)
    return whole, layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_onloaded_files_equal_whole_model_files(arch, kind, sources, tmp_path):
    if arch in ("qwen3_moe", "mixtral") and kind == "fp8-static-kv":
        pytest.skip("covered by the dense architectures (the MoE experts take the same path as any linear)")
    recipe, overrides = RECIPES[kind]
    whole, layers = _both(sources[arch], recipe, overrides, tmp_path)
    a, b = _files(whole.output), _files(layers.output)
    assert a.keys() == b.keys() and any(n.endswith(".safetensors") for n in a)
    for name in a:
        assert a[name] == b[name], f"{name} differs"
    assert json.loads((layers.output / "quantkit.json").read_text())["load"] == "layers"
    assert [r["name"] for r in whole.result.layers] == [r["name"] for r in layers.result.layers]


@pytest.mark.parametrize("kind", ["rtn", "awq"])
def test_a_narrower_compute_dtype_writes_what_it_did_not_change_as_stored(kind, sources, tmp_path):
    """bf16 asked for on a float32 checkpoint (as QUANTKIT_COMPUTE_DTYPE=bfloat16 or the bf16 policy of an
    AVX-512 machine would run a float32 model) rounds every weight for calibration. The tensors no stage
    changed (embeddings, norms, the MoE router, the head) are still written as the source stored them, the
    same bytes whole-model and onloaded, and the API's save writes the same checkpoint."""
    from safetensors.torch import load_file

    recipe, overrides = RECIPES[kind]
    overrides = [*overrides, "calibration.dtype=bfloat16"]
    source = sources["mixtral"]  # float32, random norms and router
    whole, layers = _both(source, recipe, overrides, tmp_path)
    assert "narrower than the checkpoint's float32" in whole.compute.describe()
    a, b = _files(whole.output), _files(layers.output)
    assert a.keys() == b.keys() and all(a[n] == b[n] for n in a)
    model, _ = quantkit.quantize(source, recipe, overrides=overrides)
    saved = quantkit.save(model, tmp_path / "api")
    assert load_file(saved / "model.safetensors").keys() == load_file(whole.output / "model.safetensors").keys()
    assert (saved / "model.safetensors").read_bytes() == a["model.safetensors"]

    src, out = load_file(source / "model.safetensors"), load_file(whole.output / "model.safetensors")
    kept = [k for k in out if k in src]  # every tensor that is not a quantized linear's
    assert kept and all(out[k].dtype == torch.float32 for k in kept)
    folded = {k for k in kept if not torch.equal(out[k], src[k])}
    # RTN changes none of them; AWQ folds its scales into the norms before the linears it scales, and the
    # router, which reads the scaled norm's output too, takes their inverse
    changed_by_awq = {k for k in kept if k.endswith(("layernorm.weight", "block_sparse_moe.gate.weight"))}
    assert folded == (set() if kind == "rtn" else changed_by_awq)
    for k in folded:  # what a stage changed is written from the model (bf16 values), not from the source
        assert torch.equal(out[k], out[k].to(torch.bfloat16).float())
    assert any("gate.weight" in k for k in kept) and "model.embed_tokens.weight" in kept


def test_sharded_output_streams_and_loads(sources, tmp_path, tokenizer):
    whole, layers = _both(sources["llama"], *RECIPES["gptq"], tmp_path, max_shard_bytes=20_000)
    a, b = _files(whole.output), _files(layers.output)
    shards = [n for n in b if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) > 3 and "model.safetensors.index.json" in b and a == b
    index = json.loads(b["model.safetensors.index.json"])
    assert set(index["weight_map"].values()) == set(shards)
    ids = sample_ids(tokenizer, 1, 16)
    with torch.no_grad():
        got = quantkit.load(layers.output, dtype=torch.float32)(input_ids=ids).logits
        ref = quantkit.load(whole.output, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(got, ref)


def test_interrupted_onloaded_run_leaves_nothing(sources, tmp_path, monkeypatch):
    import quantkit.flow.onload as onload

    out = tmp_path / "q"
    quantize(str(sources["llama"]), load_recipe(*RECIPES["rtn"]), out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = onload.OnloadedModel.finish_layer

    def stop_at_layer_1(self, index, layer):
        if index == 1:
            raise KeyboardInterrupt
        real(self, index, layer)

    monkeypatch.setattr(onload.OnloadedModel, "finish_layer", stop_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(sources["llama"]), load_recipe("rtn-w8a16"), out, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the existing output is untouched
    with pytest.raises(KeyboardInterrupt):
        quantize(str(sources["llama"]), load_recipe("rtn-w8a16"), tmp_path / "new", progress=False)
    # nothing at the new path and no half-written output; what stays is each stopped run's resumable state
    # (layer 0 finished: `quantkit.flow.resume`, tested in test_resume.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new.run", ".q.run", "q"]


PEAK = """
import sys
from quantkit.platform.memory import PeakSampler, live_heap_bytes
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
recipe = load_recipe("gptq-w4a16", ["calibration.num_samples=2", "calibration.seq_len=32"])
before = live_heap_bytes()
with PeakSampler() as peak:
    quantize(sys.argv[1], recipe, sys.argv[2], progress=False, load_mode=sys.argv[3], max_shard_bytes=1_000_000)
print(peak.peak - before, file=sys.stderr)
print(peak.peak - before)
"""


def _wide_model(path: Path, layers: int, tokenizer) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1536,
                               num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.skipif(__import__("quantkit.platform.memory").platform.memory.live_heap_bytes() is None, reason="needs glibc's mallinfo2")
def test_peak_memory_does_not_grow_with_depth(tmp_path, tokenizer):
    """Peak live allocated bytes (glibc's malloc accounting, sampled every 2 ms in a thread: every CPU tensor
    is malloc'd) of a quantize job, for the same model with 2 and with 6 decoder layers of 5.9 MB (bf16)
    each, computed in float32 (so whole-model loading holds allocated copies, not views of the mapped file):
    whole-model loading grows with depth (so the check can see growth); onloading stays within a margin of
    a quarter of that growth. Shards of 1 MB, so the shard being filled (1.5 MB of output per layer
    here) is flushed every layer and what is measured is only what depends on depth."""
    runs = {}
    for n in (2, 6):  # the four jobs run side by side (each process measures its own heap), one thread each
        src = _wide_model(tmp_path / f"m{n}", n, tokenizer)
        for mode in ("whole", "layers"):
            runs[n, mode] = subprocess.Popen(
                [sys.executable, "-c", PEAK, str(src), str(tmp_path / f"q{n}{mode}"), mode], cwd=ROOT, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin", "QUANTKIT_COMPUTE_DTYPE": "float32",
                     "OMP_NUM_THREADS": "1"})
    peaks = {}
    for key, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        peaks[key] = int(out.split()[-1])
    print("peak live bytes above the start:", peaks)
    whole_growth = peaks[6, "whole"] - peaks[2, "whole"]
    onload_growth = peaks[6, "layers"] - peaks[2, "layers"]
    assert whole_growth > 25e6, peaks  # 4 more layers of 11.8 MB in float32 (measured here: 35 MB)
    assert onload_growth < 0.25 * whole_growth, peaks


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_source_is_a_clear_error(damage, sources, tmp_path):
    """The onloaded job reads the source with its own reader: a truncated file or a broken header is named."""
    import shutil

    from quantkit.errors import CheckpointError

    src = tmp_path / "src"
    shutil.copytree(sources["llama"], src)
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        quantize(str(src), load_recipe(*RECIPES["rtn"]), tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()


def test_lazy_reads_equal_safetensors_reads(sources):
    from safetensors import safe_open

    from quantkit.formats.lazy import LazyCheckpoint

    for arch in ("llama", "qwen3_moe"):
        path = sources[arch] / "model.safetensors"
        lazy = LazyCheckpoint(sources[arch])
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            assert sorted(lazy.keys()) == sorted(keys)
            for k in keys:
                t = lazy.get(k)
                assert t.dtype == f.get_tensor(k).dtype and torch.equal(t, f.get_tensor(k))


def test_lazy_pieces_cover_each_tensor_in_bounded_reads(sources):
    """The NaN/Inf pass reads big tensors in pieces: they concatenate to the tensor, none is larger than asked."""
    from quantkit.checkpoints.finite import find_nonfinite
    from quantkit.formats.lazy import LazyCheckpoint

    lazy = LazyCheckpoint(sources["llama"])
    pieces: dict[str, list[torch.Tensor]] = {}
    for key, piece in lazy.pieces(max_bytes=1000):
        assert piece.ndim == 1 and piece.numel() * piece.element_size() <= 1000
        pieces.setdefault(key, []).append(piece)
    assert sorted(pieces) == sorted(lazy.keys()) and max(len(p) for p in pieces.values()) > 10
    for key, parts in pieces.items():
        assert torch.equal(torch.cat(parts), lazy.get(key).reshape(-1)), key
    # a non-finite value in one piece is counted against the whole tensor
    a, b = torch.ones(6), torch.tensor([1.0, float("nan"), float("inf")])
    assert find_nonfinite([("w", a), ("w", b), ("v", a)]) == [("w", 2, 9)]
