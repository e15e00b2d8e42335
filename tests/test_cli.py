"""The command line, through click's test runner: happy paths and clear errors (exit code 2)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import main


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def test_help_has_examples_for_every_command(run):
    for cmd in (["quantize"], ["eval", "ppl"], ["generate"], ["recipes"], ["plugins"], ["convert", "gguf"], ["models", "fetch"]):
        res = run(*cmd, "--help")
        assert res.exit_code == 0 and ("Example" in res.output), cmd


def test_quantize_eval_generate(run, tiny_llama, tmp_path):
    out = tmp_path / "q"
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "--set", "stages.0.scheme.group_size=32", "-o", out, "--no-progress")
    assert res.exit_code == 0, res.output
    assert "Quantized 21 linear layers" in res.output and f"Wrote {out}" in res.output
    res = run("eval", "ppl", tiny_llama, out, "--seq-len", "64", "--max-windows", "2", "--json", tmp_path / "p.json", "--no-progress")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["model"] for r in data["results"]] == [str(tiny_llama), str(out)]
    assert data["results"][0]["delta"] == 0 and data["results"][1]["tokens"] == 2 * 63
    assert "(baseline)" in res.output
    res = run("generate", out, "It is", "-n", "5")
    assert res.exit_code == 0 and res.stdout.startswith("It is")  # the compute dtype line goes to stderr


def test_baseline_option_goes_first(run, tiny_llama, tmp_path):
    res = run("eval", "ppl", tiny_llama, "--baseline", tiny_llama, "--seq-len", "32", "--max-windows", "4", "--no-progress")
    assert res.exit_code == 0 and res.output.count(str(tiny_llama)) == 1


def test_recipes_and_plugins(run):
    res = run("recipes")
    assert "rtn-w4a16" in res.output and "rtn-w8a16" in res.output
    res = run("recipes", "show", "rtn-w4a16")
    assert "group_size: 128" in res.output
    res = run("plugins")
    assert "rtn" in res.output and "pack-quantized" in res.output and "gemma3_text" in res.output


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["quantize", "/no/such/model", "--recipe", "rtn-w4a16"], "model path '/no/such/model' does not exist"),
        (["quantize", "Qwen/Qwen3-4B", "--recipe", "rtn-w4a16"], "offline"),
        (["quantize", "--recipe", "nope"], "unknown recipe 'nope'"),
        (["eval", "ppl", "/no/such/model"], "does not exist"),
        (["generate", "./missing-dir"], "does not exist"),
        (["models", "fetch", "gpt-5"], "unknown demo model 'gpt-5'"),
        (["convert", "gguf", "/no/file.gguf", "-o", "/tmp/x"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(run, args, fragment):
    res = run(*args)
    assert res.exit_code == 2 and fragment in res.output and "Traceback" not in res.output


def test_existing_output_and_bad_group_size(run, tiny_llama, tmp_path):
    (tmp_path / "taken").mkdir()
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", tmp_path / "taken")
    assert res.exit_code == 2 and "already exists; pass --overwrite" in res.output
    # a group size given with --set that does not divide a layer stays an error (without --set: a fallback)
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "--set", "stages.0.scheme.group_size=128",
              "-o", tmp_path / "new")
    assert res.exit_code == 2 and "does not divide in_features 64 of layer model.layers.0.self_attn.q_proj" in res.output
    assert not (tmp_path / "new").exists()


def test_eval_short_text(run, tiny_llama, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("Too short.")
    res = run("eval", "ppl", tiny_llama, "--dataset", f, "--seq-len", "64")
    assert res.exit_code == 2 and "fewer than one window of 64" in res.output


def test_quantize_reports_peak_memory_and_where_the_time_went(run, tiny_llama, tmp_path):
    out = tmp_path / "q"
    res = run("quantize", tiny_llama, "--recipe", "gptq-w4a16", "--set", "stages.0.scheme.group_size=32",
              "--set", "calibration.num_samples=2", "--set", "calibration.seq_len=32", "-o", out, "--no-progress")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("Peak memory"))
    assert " GB resident; time: " in line and "gptq: " in line
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["peak_rss_bytes"] > 1e8 and meta["load"] == "layers"
    assert {"load layer", "gptq: true-sequential forward", "gptq: quantize", "write layer"} <= set(meta["timings"])
    assert all(v >= 0 for v in meta["timings"].values())


def test_the_demos_quantize_options_are_valid(tiny_llama, tmp_path):
    """`make demo` quantizes with the Makefile's DEMO_SMALL overrides: they must stay valid for the awq-w4a16
    recipe (run here on the tiny model, at group 32)."""
    import re
    import shlex

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    block = re.search(r"^DEMO_SMALL := (.*?)(?<!\\)\n", makefile, re.S | re.M).group(1).replace("\\\n", " ")
    args = shlex.split(block) + ["--set", "calibration.seq_len=64"]  # the tiny model's text is short
    res = CliRunner().invoke(main, ["quantize", str(tiny_llama), "--recipe", "awq-w4a16", "--set",
                                    "stages.rtn.scheme.group_size=32", *args, "-o", str(tmp_path / "q"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "calibration.num_samples=16" in block and "stages.awq.args.n_grid=10" in block
