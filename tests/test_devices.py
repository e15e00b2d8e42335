"""`--device` (quantkit.platform.devices): resolving auto|cpu|cuda[:N]|mps, errors for devices that are missing,
and a pipeline that makes every tensor on its inputs' device (so a layer sent to CUDA computes there).

Without a GPU the CUDA runs skip; `bench/gpu.sh` runs them where the device tool lends one."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import quantkit
import quantkit.flow.job as quantize_job
from quantkit.platform import devices
from quantkit.cli import main
from quantkit.platform.devices import DeviceError, resolve, to_device
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe

HAS_CUDA = torch.cuda.is_available()
SMALL = ["calibration.num_samples=4", "calibration.seq_len=32", "calibration.batch_size=2"]
RECIPES = {  # every kind of stage: rtn, gptq (act-order too), awq (+gptq), fp8 with static inputs, kv cache
    "rtn-w4a16": ["stages.0.scheme.group_size=32"],
    "gptq-w4a16-asym": ["stages.0.scheme.group_size=32", "stages.0.scheme.actorder=static"] + SMALL,
    "awq-gptq-w4a16": ["stages.1.scheme.group_size=32"] + SMALL,
    "awq-w4a16-fp8kv": ["stages.1.scheme.group_size=32"] + SMALL,
    "fp8-static-kv": SMALL,
    "gptq-fp8-dynamic": SMALL,
}


def test_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("cpu").device == torch.device("cpu") and not resolve("cpu").is_accelerator
    auto = resolve("auto")
    assert auto.device == torch.device("cpu") and "no CUDA" in auto.reason
    assert resolve(None).device == torch.device("cpu")
    assert resolve(torch.device("cpu")).device.type == "cpu"


def test_auto_takes_cuda_when_present_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")
    auto = resolve("auto")
    assert auto.device == torch.device("cuda", 0) and auto.is_accelerator
    assert auto.describe() == "device cuda:0 (auto: CUDA Fake GPU 0)"
    assert resolve("cuda:1").device == torch.device("cuda", 1)
    assert resolve("CUDA").device == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve("cuda:2")


@pytest.mark.parametrize("spec, message", [
    ("cuda", r"--device cuda: no CUDA device here: .*use --device cpu"),
    ("cuda:1", r"--device cuda:1: no CUDA device here"),
    ("mps", r"--device mps: MPS is not available"),
    ("tpu", r"--device tpu names no device; use one of auto\|cpu\|cuda\[:N\]\|mps"),
    ("gpu0", r"names no device"),
    ("meta", r"quantkit runs on auto\|cpu\|cuda\[:N\]\|mps, not meta"),
])
def test_missing_or_unknown_devices_are_errors(spec, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=message):
        resolve(spec)


def test_cpu_only_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError, match=r"CPU-only build"):
        resolve("cuda")


def test_to_device_moves_nested_tensors():
    t = torch.ones(2)
    out = to_device({"a": (t, [t, 3]), "b": "x", "c": None}, torch.device("cpu"))
    assert out["a"][0] is t and out["a"][1][1] == 3 and out["b"] == "x" and out["c"] is None
    meta = to_device({"a": (t, [t])}, torch.device("meta"))
    assert meta["a"][0].is_meta and meta["a"][1][0].is_meta


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_pipeline_makes_tensors_on_its_inputs_device(arch, recipe, tiny_models, tmp_path, monkeypatch):
    """With torch's default device set to meta while the pipeline runs on the CPU, any tensor made
    without device= lands on meta, and mixing it with the layer's tensors fails: this is how a layer
    sent to CUDA would break. The files must equal a plain run's."""
    real = quantize_job.quantize_model

    def on_meta_by_default(*args, **kwargs):
        torch.set_default_device("meta")
        try:
            return real(*args, **kwargs)
        finally:
            torch.set_default_device(None)

    plain = quantize(str(tiny_models[arch]), load_recipe(recipe, RECIPES[recipe]), tmp_path / "plain", progress=False,
                     device="cpu")
    import quantkit.flow.write as write_mod

    monkeypatch.setattr(quantize_job, "quantize_model", on_meta_by_default)
    monkeypatch.setattr(write_mod, "quantize_model", on_meta_by_default)  # the layer-by-layer run's pipeline
    probed = quantize(str(tiny_models[arch]), load_recipe(recipe, RECIPES[recipe]), tmp_path / "probed", progress=False,
                      device="cpu")
    for f in sorted(plain.output.glob("*.safetensors")):
        assert f.read_bytes() == (probed.output / f.name).read_bytes()


def test_quantize_records_the_device(tiny_llama, tmp_path):
    report = quantize(str(tiny_llama), load_recipe("rtn-w4a16", RECIPES["rtn-w4a16"]), tmp_path / "q", progress=False,
                      device="cpu")
    meta = json.loads((report.output / "quantkit.json").read_text())
    assert meta["device"]["device"] == "cpu" and meta["compute"]["device"] == "cpu"
    assert report.peak_device_bytes == 0 and "on cpu" not in report.closing_line()


@pytest.mark.parametrize("command", [
    ["quantize", "{model}", "--recipe", "rtn-w4a16", "-o", "{out}", "--device", "cuda"],
    ["eval", "ppl", "{model}", "--device", "cuda"],
    ["generate", "{model}", "hello", "--device", "cuda"],
    ["chat", "{model}", "--device", "cuda"],
])
@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: cuda is not missing")
def test_cli_refuses_a_missing_device_and_writes_nothing(command, tiny_llama, tmp_path):
    out = tmp_path / "out"
    args = [a.format(model=tiny_llama, out=out) for a in command]
    result = CliRunner().invoke(main, args, input="hi\n\n")
    assert result.exit_code == 2, result.output
    assert "--device cuda: no CUDA device here" in result.output and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.iterdir())


def test_load_device_is_checked_and_recorded(tiny_llama, monkeypatch):
    model = quantkit.load(tiny_llama, dtype=torch.float32, device="cpu")
    assert model.quantkit_device.device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"^device='cuda:0': no CUDA device here.*use device='cpu'"):
        quantkit.load(tiny_llama, device="cuda:0")


# -- on a GPU (bench/gpu.sh) -----------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (bench/gpu.sh runs this where one is lent)")
@pytest.mark.parametrize("recipe", ["rtn-w4a16", "gptq-w4a16-asym", "awq-gptq-w4a16", "fp8-static-kv"])
def test_quantize_on_cuda_matches_cpu_quality(recipe, tiny_models, tmp_path):
    """Only the layer at work goes to the GPU: the model comes back on the CPU, the device's peak is
    recorded, and the per-linear SQNR is the CPU run's within 0.5 dB (other kernels, other rounding)."""
    src = str(tiny_models["llama"])
    cpu = quantize(src, load_recipe(recipe, RECIPES[recipe]), tmp_path / "cpu", progress=False, device="cpu")
    gpu = quantize(src, load_recipe(recipe, RECIPES[recipe]), tmp_path / "gpu", progress=False, device="cuda")
    assert gpu.device.device.type == "cuda" and gpu.peak_device_bytes > 0
    meta = json.loads((gpu.output / "quantkit.json").read_text())
    assert meta["device"]["device"].startswith("cuda") and meta["device"]["peak_bytes"] > 0
    sq_cpu = {r["name"]: r["sqnr_db"] for r in cpu.result.layers}
    for row in gpu.result.layers:
        assert abs(row["sqnr_db"] - sq_cpu[row["name"]]) < 0.5, row
    model = quantkit.load(gpu.output, dtype=torch.float32, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids.cuda()).logits
    assert logits.device.type == "cuda" and torch.isfinite(logits).all()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (bench/gpu.sh runs this where one is lent)")
def test_generate_and_eval_on_cuda(tiny_llama):
    result = CliRunner().invoke(main, ["generate", str(tiny_llama), "hello", "-n", "4", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "device cuda:0" in result.output
    result = CliRunner().invoke(main, ["eval", "ppl", str(tiny_llama), "--device", "cuda", "--seq-len", "64",
                                       "--max-windows", "2", "--no-progress"])
    assert result.exit_code == 0, result.output


def test_peak_memory_is_zero_off_cuda():
    assert devices.peak_memory_bytes(torch.device("cpu")) == 0
