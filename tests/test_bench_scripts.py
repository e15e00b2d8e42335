"""The bench/ scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: a script named
like an installed package (bench/kernels.py against `kernels`, which transformers imports while building
a model) would be imported in its place and break every bench script that loads a model."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

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
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_matrix_script", BENCH / "recipe_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    monkeypatch.setenv("QUANTKIT_COMPUTE_DTYPE", "float16")  # the caller's own setting never leaks into a setup
    native, avx2, bf16, both = (matrix.setup_env(s) for s in ("native", "avx2", "bfloat16", "avx2+bfloat16"))
    assert "QUANTKIT_COMPUTE_DTYPE" not in native and "ATEN_CPU_CAPABILITY" not in native
    assert avx2["ATEN_CPU_CAPABILITY"] == "avx2" and "QUANTKIT_COMPUTE_DTYPE" not in avx2
    assert bf16["QUANTKIT_COMPUTE_DTYPE"] == "bfloat16" and "ONEDNN_MAX_CPU_ISA" not in bf16
    assert both["QUANTKIT_COMPUTE_DTYPE"] == "bfloat16" and both["ONEDNN_MAX_CPU_ISA"] == "AVX2"
