"""The bench/ scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: a script named
like an installed package (bench/kernels.py against `kernels`, which transformers imports while building
a model) would be imported in its place and break every bench script that loads a model. Also the pieces
of bench/gpu.sh that run without a GPU (the random model, the checkpoint comparison) and the recipe matrix's
setups."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_an_installed_module():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "big_model" in names and "decode" in names
    # looked up with bench/ off the path (whatever the runner put on it): any found would be shadowed by the script
    path = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    shadowing = [n for n in names if n in sys.builtin_module_names
                 or importlib.machinery.PathFinder.find_spec(n, path) is not None]
    assert shadowing == [], f"bench scripts named like installed modules: {shadowing}; rename them"


def test_a_bench_script_builds_a_transformers_model(tmp_path):
    # what broke: bench/big_model.py building its config under bench/ on the path
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from transformers import AutoConfig, AutoModelForCausalLM; "
            "c = AutoConfig.for_model('llama', hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
            "num_attention_heads=2, num_key_value_heads=1, vocab_size=64); "
            "print(type(AutoModelForCausalLM.from_config(c)).__name__)")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, cwd=tmp_path,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "LlamaForCausalLM"


def test_the_recipe_matrix_setups_combine(monkeypatch):
    matrix = _script("recipe_matrix")
    monkeypatch.setenv("QUANTKIT_COMPUTE_DTYPE", "float16")  # the caller's own setting never leaks into a setup
    native, avx2, bf16, both = (matrix.setup_env(s) for s in ("native", "avx2", "bfloat16", "avx2+bfloat16"))
    assert "QUANTKIT_COMPUTE_DTYPE" not in native and "ATEN_CPU_CAPABILITY" not in native
    assert avx2["ATEN_CPU_CAPABILITY"] == "avx2" and "QUANTKIT_COMPUTE_DTYPE" not in avx2
    assert bf16["QUANTKIT_COMPUTE_DTYPE"] == "bfloat16" and "ONEDNN_MAX_CPU_ISA" not in bf16
    assert both["QUANTKIT_COMPUTE_DTYPE"] == "bfloat16" and both["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_model_and_checkpoint_comparison(tiny_llama, tmp_path, capsys):
    # what bench/gpu.sh runs on a lent GPU machine: a random model in another's shape (twice: the same
    # tensors), fewer layers on request, and the tensor-by-tensor comparison it holds CUDA against CPU with
    random_model, compare = _script("random_model"), _script("compare_checkpoints")
    a = random_model.write(tiny_llama, tmp_path / "a", seed=0)
    b = random_model.write(tiny_llama, tmp_path / "b", seed=0)
    c = random_model.write(tiny_llama, tmp_path / "c", seed=1)
    short = random_model.write(tiny_llama, tmp_path / "short", layers=1)
    assert (a / "tokenizer.json").is_file() and (a / "config.json").is_file()
    identical, differing, same_layout = compare.compare(a, b)
    assert differing == 0 and same_layout and identical > 5
    identical, differing, same_layout = compare.compare(a, c)
    assert same_layout and differing > 0 and "max |a - b|" in capsys.readouterr().out
    assert not compare.compare(a, short)[2]  # the second layer's tensors are missing: layouts differ
    with pytest.raises(SystemExit, match="exists"):
        random_model.write(tiny_llama, a)


def test_checkpoint_comparison_reports_changed_codes(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    compare = _script("compare_checkpoints")
    codes = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    for name, t in (("x", codes), ("y", codes.clone())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    y = codes.clone()
    y[0, :2] += 1  # 2 of 64 codes
    save_file({"w": codes, "s": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "x" / "model.safetensors")
    save_file({"w": y, "s": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "y" / "model.safetensors")
    assert compare.compare(tmp_path / "x", tmp_path / "y") == (1, 1, True)
    assert "w: 3.125% of codes differ" in capsys.readouterr().out


def test_decode_bench_runs_on_the_device_asked_for(tiny_llama, monkeypatch, capsys):
    # bench/gpu.sh's warm decode figures: every setup on --device, the read bandwidth measured there
    decode = _script("decode")
    run = ["decode.py", str(tiny_llama), "--hf", "--runs", "1", "-n", "4"]
    monkeypatch.setattr(sys, "argv", run + ["--device", "cpu"])
    decode.main()
    out = capsys.readouterr().out
    assert "GB/s on cpu" in out and "| quantkit " in out and "| transformers generate " in out
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", run + ["--device", "cuda"])
    from quantkit.platform.devices import DeviceError

    with pytest.raises(DeviceError, match="--device cuda"):
        decode.main()
    assert "| quantkit " not in capsys.readouterr().out


def test_gpu_check_refuses_an_unknown_part(tmp_path):
    # QUANTKIT_GPU_PART splits the check into two calls of a lent machine; a typo must not run a different part
    out = subprocess.run(["bash", str(BENCH / "gpu.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "QUANTKIT_GPU_PART": "kernels"})
    assert out.returncode == 2 and "QUANTKIT_GPU_PART=kernels: use all, tests, steps or serve" in out.stdout
    assert not (tmp_path / "gpu.log").exists()


def test_serve_bench_measures_throughput_and_kv(tiny_llama):
    """bench/serve.py against `quantkit serve` on the tiny model (a real server on 127.0.0.1, 1 and 2 clients,
    four tokens each) and its in-process KV comparison: figures printed with the CPU beside them."""
    run = lambda *a: subprocess.run([sys.executable, str(BENCH / "serve.py"), *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    out = run("throughput", str(tiny_llama), "--clients", "1,2", "--requests", "2", "--max-tokens", "4",
              "--kv-cache-gb", "0.01", "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [l for l in out.stdout.splitlines() if " clients " in l]
    assert len(rows) == 2 and "capability" in out.stdout and all("tok/s" in r for r in rows)
    out = run("kv", str(tiny_llama), "--kv-cache-gb", "0.0005", "--kv-requests", "12", "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "paged: up to" in out.stdout and "contiguous caches of the longest request" in out.stdout


def test_gguf_peer_recipe_variants_and_their_peers():
    """'RECIPE@KEY=VALUE...' runs the recipe with those overrides under its own file names, held against the same
    llama.cpp file type as the recipe itself."""
    peer = _script("gguf_peer")
    recipe, sets, tag = peer._variant("gptq-q4_0@stages.0.args.dampening_frac=0.05@calibration.check_samples=0")
    assert (recipe, sets) == ("gptq-q4_0", ["--set", "stages.0.args.dampening_frac=0.05",
                                            "--set", "calibration.check_samples=0"])
    assert tag == "gptq-q4_0-dampening_frac_0.05-check_samples_0"
    assert peer._variant("awq-q4_0") == ("awq-q4_0", [], "awq-q4_0")
    assert peer._peer_of("quantkit gptq-q4_0@stages.0.args.dampening_frac=0.05") == "llama.cpp Q4_0 + imatrix"
    assert peer._peer_of("quantkit gptq-q8_0") == "llama.cpp Q8_0"
    assert peer._peer_of("quantkit gptq-w4a16") is None
