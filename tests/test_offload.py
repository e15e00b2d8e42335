"""Disk offload for eval and generate (`quantkit.runtime.offload`): the decoder layers stay in the
checkpoint and load one at a time, with results equal to the whole-model load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.cli import main
from quantkit.errors import CheckpointError
from quantkit.eval.ppl import perplexity
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.runtime import offload
from quantkit.runtime.generate import generate
from quantkit.checkpoints.loader import load_tokenizer
from quantkit.runtime.sampling import SamplingParams

from helpers import sample_ids

SMALL = ["calibration.num_samples=4", "calibration.seq_len=32", "calibration.batch_size=2"]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    q = {name: quantize(str(tiny_models["llama"]), load_recipe(recipe, overrides), root / name, progress=False).output
         for name, recipe, overrides in [("w4a16", "rtn-w4a16-asym", ["stages.0.scheme.group_size=32"]),
                                         ("fp8-kv", "fp8-static-kv", SMALL)]}
    return {"llama": tiny_models["llama"], "gemma3": tiny_models["gemma3_text"], **q}


@pytest.mark.parametrize("name", ["llama", "gemma3", "w4a16", "fp8-kv"])
def test_offloaded_logits_equal_whole_model(name, checkpoints, tokenizer):
    whole = quantkit.load(checkpoints[name], dtype=torch.float32)
    off = quantkit.load(checkpoints[name], dtype=torch.float32, offload="disk")
    assert off.quantkit_offload.offloaded and not whole.quantkit_offload.offloaded
    layers = off.config.num_hidden_layers
    meta_before = sum(t.is_meta for t in off.state_dict().values())
    assert meta_before > 0
    ids = sample_ids(tokenizer, 2, 24)
    with torch.no_grad():
        assert torch.equal(whole(input_ids=ids).logits, off(input_ids=ids).logits)
    assert off.quantkit_offloader.loads == layers  # each layer read once per forward
    assert sum(t.is_meta for t in off.state_dict().values()) == meta_before  # and emptied again
    assert all(getattr(m, "_prepared", None) is None and getattr(m, "_dense", None) is None for m in off.modules())


def test_offloaded_perplexity_through_the_fp8_kv_cache(checkpoints, tokenizer):
    from conftest import AUSTEN

    ids = torch.tensor(tokenizer(AUSTEN.read_text()[:4000], add_special_tokens=False)["input_ids"])
    runs = [perplexity(quantkit.load(checkpoints["fp8-kv"], dtype=torch.float32, offload=mode), ids, seq_len=64,
                       max_windows=3, kv_cache_dtype="fp8") for mode in ("none", "disk")]
    assert runs[0].nll == runs[1].nll and runs[0].tokens == runs[1].tokens


@pytest.mark.parametrize("name", ["llama", "w4a16"])
def test_offloaded_generate_makes_the_same_tokens(name, checkpoints, tokenizer):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = sample_ids(tokenizer, 1, 10)[0].tolist()
    got = [generate(quantkit.load(checkpoints[name], dtype=torch.float32, offload=mode), load_tokenizer(checkpoints[name]),
                    prompt, params).token_ids for mode in ("none", "disk")]
    assert got[0] == got[1] and len(got[0]) == 8


def test_cli_offload_disk_for_eval_and_generate(checkpoints, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["generate", str(checkpoints["w4a16"]), "Elizabeth", "-n", "4", "--offload", "disk",
                               "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert "offload disk: asked for" in res.output
    out = tmp_path / "ppl.json"
    for mode in ("none", "disk"):
        res = runner.invoke(main, ["eval", "ppl", str(checkpoints["w4a16"]), "--seq-len", "64", "--max-windows", "2",
                                   "--no-progress", "--offload", mode, "--json", str(out.with_name(f"{mode}.json"))])
        assert res.exit_code == 0, res.output
    rows = [json.loads(out.with_name(f"{m}.json").read_text())["results"][0] for m in ("none", "disk")]
    assert rows[0]["nll"] == rows[1]["nll"] and rows[1]["offload"] == "disk"


def test_auto_offloads_only_what_does_not_fit():
    fits = offload.choose("auto", model_bytes=7 * 10**9, available=10 * 10**9)
    assert not fits.offloaded and "fits in memory" in fits.reason
    big = offload.choose("auto", model_bytes=9 * 10**9, available=10 * 10**9)
    assert big.offloaded
    assert big.describe() == ("offload disk: the model takes 9.00 GB, more than 80% of the 10.00 GB available: its "
                              "layers load from disk one at a time (slower; --offload none to load it whole)")
    assert not offload.choose("none", 10**9, 10**10).offloaded and offload.choose("disk", 1, 10**12).offloaded
    # loading whole what cannot fit even with the swap could only end in an OOM kill: an error naming the fix
    with pytest.raises(offload.OffloadError, match=r"the model takes 1000.00 GB in memory, more than the 0.00 GB "
                                                   r"available .* --offload auto \(or disk\)"):
        offload.choose("none", 10**12, 1)
    with pytest.raises(offload.OffloadError, match=r"--offload 'ram': use one of none, disk, auto"):
        offload.choose("ram", 1)
    assert [offload.mode_of(m) for m in (None, " Disk ", "AUTO")] == ["none", "disk", "auto"]


def test_a_bad_offload_mode_is_refused_before_the_model_is_read(checkpoints, monkeypatch):
    from quantkit.checkpoints import loader

    monkeypatch.setattr(loader, "_fits_in_float32", lambda path: pytest.fail("read the model first"))
    with pytest.raises(offload.OffloadError, match=r"--offload 'ram': use one of none, disk, auto"):
        quantkit.load(checkpoints["llama"], offload="RAM")


def test_loading_whole_what_cannot_fit_is_an_error_naming_the_model_and_the_fix(checkpoints, monkeypatch):
    monkeypatch.setattr(offload, "available_memory", lambda: 1000)
    monkeypatch.setattr(offload, "free_swap", lambda: 0)
    res = CliRunner().invoke(main, ["eval", "ppl", str(checkpoints["llama"]), "--seq-len", "64", "--max-windows", "2",
                                    "--no-progress", "--offload", "none"])
    assert res.exit_code != 0 and res.exception is not None
    message = str(res.output) + str(res.exception)
    assert str(checkpoints["llama"]) in message and "--offload auto (or disk)" in message, message
    assert "or --dtype bfloat16 keeps its weights as stored, in half the memory" in message  # ppl: float32
    res = CliRunner().invoke(main, ["eval", "ppl", str(checkpoints["llama"]), "--seq-len", "64", "--max-windows", "2",
                                    "--no-progress", "--offload", "auto"])
    assert res.exit_code == 0 and "offload disk" in res.output, res.output


def test_quantize_whole_of_what_cannot_fit_names_its_own_fix(checkpoints, tmp_path, monkeypatch):
    from quantkit.errors import QuantizationError

    monkeypatch.setattr(offload, "available_memory", lambda: 1000)
    monkeypatch.setattr(offload, "free_swap", lambda: 0)
    with pytest.raises(QuantizationError, match=r"--load whole: .*the model takes .* GB in memory, more than the 0.00 "
                                                r"GB available .*; --load layers \(the default\) holds one decoder"):
        quantize(str(checkpoints["llama"]), load_recipe("rtn-w4a16"), tmp_path / "q", progress=False,
                 load_mode="whole", memory_check=False)
    assert not (tmp_path / "q").exists()


def test_in_memory_bytes_counts_the_compute_dtype(checkpoints):
    from quantkit.formats.lazy import LazyCheckpoint

    ckpt = LazyCheckpoint(checkpoints["llama"])  # a bf16 checkpoint
    stored = sum(t.numel() * t.element_size() for t in load_file(checkpoints["llama"] / "model.safetensors").values())
    assert offload.in_memory_bytes(ckpt, torch.bfloat16, lambda owner: False) == stored
    assert offload.in_memory_bytes(ckpt, torch.float32, lambda owner: False) == 2 * stored


def test_damaged_layer_is_reported_at_load_not_at_the_first_forward(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:, :8].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model.layers.1.mlp.up_proj.weight.*"
                                              r"shapes that differ from the config: model.layers.0.self_attn.q_proj"):
        quantkit.load(bad, dtype=torch.float32, offload="disk")
