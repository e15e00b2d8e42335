"""Resume: a run stopped after layer k (an exception, Ctrl-C, SIGKILL) continues to the same bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantkit.flow import resume as resume_mod
from quantkit.cli import main
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.flow.resume import ResumeError, differences, run_dir

SMALL = ["calibration.num_samples=8", "calibration.seq_len=64"]
RECIPES = {
    "gptq": ("gptq-w4a16", ["stages.0.scheme.group_size=32", *SMALL]),
    "awq": ("awq-w4a16", ["stages.1.scheme.group_size=32", *SMALL]),
    # input scales from the mse observer over a random sample of each linear's inputs, and KV scales
    "fp8-static-kv": ("fp8-static-kv", [*SMALL, "stages.0.scheme.input_activations={strategy: tensor, observer: mse}",
                                         "stages.0.args.mse_samples=1024"]),
    # an online rotation before down_proj: the resumed run's config must still record the earlier layers'
    "r4": ("rotated-mxfp4", ["stages.0.args.down_proj_online=32", "stages.1.scheme=W8A16", *SMALL]),
}


def files(out: Path) -> dict:
    keep = ("model.safetensors", "config.json", "recipe.yaml")
    data = {name: (out / name).read_bytes() for name in keep}
    data["layers"] = json.loads((out / "quantkit.json").read_text())["layers"]
    return data


def stop_after(monkeypatch, layer: int, exc=KeyboardInterrupt):
    real = resume_mod.RunState.layer_done

    def layer_done(self, index, hidden, report):
        real(self, index, hidden, report)
        if index == layer:
            raise exc

    monkeypatch.setattr(resume_mod.RunState, "layer_done", layer_done)


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    """Uninterrupted outputs, per (arch, recipe)."""
    root = tmp_path_factory.mktemp("resume-ref")
    cache = {}

    def get(arch, key):
        if (arch, key) not in cache:
            out = root / f"{arch}-{key}"
            quantize(str(tiny_models[arch]), load_recipe(*RECIPES[key]), out, progress=False)
            cache[arch, key] = files(out)
        return cache[arch, key]

    return get


@pytest.mark.parametrize("arch,key", [("llama", "awq"), ("llama", "fp8-static-kv"), ("gemma3_text", "gptq"),
                                      ("llama", "r4")])
def test_stopped_then_resumed_equals_uninterrupted(arch, key, tiny_models, reference, tmp_path, monkeypatch):
    out = tmp_path / "q"
    said = []
    stop_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_models[arch]), load_recipe(*RECIPES[key]), out, progress=False, notify=said.append)
    assert not out.exists() and run_dir(out).is_dir()
    assert any("1 of 3 layer(s) finished" in s and "--resume" in s and "--restart" in s for s in said), said
    monkeypatch.undo()
    said.clear()
    quantize(str(tiny_models[arch]), load_recipe(*RECIPES[key]), out, progress=False, resume=True,
             notify=said.append)
    assert any("continuing at layer 1" in s for s in said), said
    assert files(out) == reference(arch, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # the finished run left nothing else


def test_killed_process_resumes_byte_for_byte(tiny_llama, reference, tmp_path):
    out = tmp_path / "q"
    name, overrides = RECIPES["gptq"]
    args = ["quantize", str(tiny_llama), "--recipe", name, *(a for o in overrides for a in ("--set", o)),
            "-o", str(out), "--no-progress"]
    script = f"""
import os, signal, sys
from quantkit.flow import resume
real = resume.RunState.layer_done
def layer_done(self, index, hidden, report):
    real(self, index, hidden, report)
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
resume.RunState.layer_done = layer_done
sys.argv = ["quantkit"] + {args!r}
from quantkit.cli import run
run()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == -9, proc.stderr
    assert not out.exists() and json.loads((run_dir(out) / "state.json").read_text())["finished"] == 2
    res = CliRunner().invoke(main, args)  # without --resume: refused, saying what to do
    assert res.exit_code == 2 and "--resume" in res.output and "--restart" in res.output
    res = CliRunner().invoke(main, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert files(out) == reference("llama", "gptq")
    assert not run_dir(out).exists()


def test_a_changed_recipe_or_source_is_refused(tiny_llama, tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    out = tmp_path / "q"
    stop_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(src), load_recipe(*RECIPES["gptq"]), out, progress=False)
    monkeypatch.undo()
    name, overrides = RECIPES["gptq"]
    with pytest.raises(ResumeError, match="the recipe .* changed"):
        quantize(str(src), load_recipe(name, [*overrides, "stages.0.args.dampening_frac=0.02"]), out,
                 progress=False, resume=True)
    with pytest.raises(ResumeError, match="calibration data changed"):
        quantize(str(src), load_recipe(name, [*overrides[:-1], "calibration.seq_len=48"]), out, progress=False,
                 resume=True)
    config = json.loads((src / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ResumeError, match="source file config.json changed"):
        quantize(str(src), load_recipe(*RECIPES["gptq"]), out, progress=False, resume=True)
    # --restart discards the stopped run and starts over
    said = []
    quantize(str(src), load_recipe(*RECIPES["gptq"]), out, progress=False, restart=True, notify=said.append)
    assert any("discarded the stopped run" in s for s in said) and out.is_dir() and not run_dir(out).exists()


def test_resume_without_a_stopped_run_starts_fresh(tiny_llama, tmp_path):
    said = []
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
             progress=False, resume=True, notify=said.append)
    assert any("no stopped run" in s for s in said) and (tmp_path / "q" / "model.safetensors").is_file()


def test_a_run_stopped_before_any_layer_keeps_nothing(tiny_llama, tmp_path, monkeypatch):
    import quantkit.flow.onload as onload

    def fail(self, index, layer):
        raise RuntimeError("boom")

    monkeypatch.setattr(onload.OnloadedModel, "load_layer", fail)
    with pytest.raises(RuntimeError):
        quantize(str(tiny_llama), load_recipe(*RECIPES["gptq"]), tmp_path / "q", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_differences_name_what_changed():
    base = {"quantkit_version": "1", "recipe_sha256": "a", "calibration": {"sha256": "x"}, "world_size": 1,
            "source_files": {"model.safetensors": {"bytes": 10, "header_sha256": "h"}}}
    assert differences(base, dict(base)) == []
    other = {**base, "world_size": 2, "recipe_sha256": "b",
             "source_files": {"model.safetensors": {"bytes": 11, "header_sha256": "h"}, "extra.safetensors": {}}}
    assert differences(base, other) == ["the recipe (or its --set overrides) changed",
                                        "source file extra.safetensors is new",
                                        "source file model.safetensors changed (size)",
                                        "world_size: 1 then, 2 now"]


def test_whole_mode_cannot_resume(tiny_llama, tmp_path):
    from quantkit.errors import QuantizationError

    with pytest.raises(QuantizationError, match="need --load layers"):
        quantize(str(tiny_llama), load_recipe("rtn-w4a16"), tmp_path / "q", load_mode="whole", resume=True)


def test_clean_lists_and_discards_a_stopped_run(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "q"
    stop_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_llama), load_recipe(*RECIPES["gptq"]), out, progress=False)
    res = CliRunner().invoke(main, ["clean", str(tmp_path), "--dry-run"])
    assert res.exit_code == 0 and "would remove" in res.output and "--resume" in res.output and ".q.run" in res.output
    assert run_dir(out).is_dir()
    res = CliRunner().invoke(main, ["clean", str(tmp_path)])
    assert res.exit_code == 0 and not run_dir(out).exists()


def test_a_run_with_widened_matmuls_resumes_only_widened(tiny_llama, tmp_path, monkeypatch):
    """Widened and native 16-bit kernels differ in their last bits: a run begun in one is not continued in the
    other (nor one begun before widening existed, whose manifest has no such entry)."""
    from quantkit.platform import compute

    out = tmp_path / "q"
    name, overrides = RECIPES["gptq"]
    recipe = load_recipe(name, [*overrides, "calibration.dtype=bfloat16"])
    monkeypatch.setattr(compute, "fast_16bit", lambda device, features=None, probe=None: ((), "test CPU, no fast bf16"))
    stop_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_llama), recipe, out, progress=False)
    manifest = json.loads((run_dir(out) / "manifest.json").read_text())
    assert manifest["wide_matmuls"] is True and manifest["compute_dtype"] == "bfloat16"
    monkeypatch.setattr(compute, "fast_16bit", lambda device, features=None, probe=None: ((torch.bfloat16,), "fast"))
    with pytest.raises(ResumeError, match="wide_matmuls: True then, None now"):
        quantize(str(tiny_llama), recipe, out, progress=False, resume=True)
    assert run_dir(out).is_dir() and not out.exists()
