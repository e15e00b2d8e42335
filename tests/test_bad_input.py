"""Bad input, case by case: a clear error with exit code 2 (or the documented safe behaviour), and
nothing lost or left behind. New cases join the CASES table (or get a test below it).

Each case prepares a scene in tmp_path, runs the CLI in-process and checks the exit code, a
fragment of the message, and what must (still) be on disk afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(*args, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args], catch_exceptions=False)


def copy_model(src: Path, dst: Path, edit: Optional[Callable[[dict], None]] = None,
               config: Optional[Callable[[dict], None]] = None) -> Path:
    shutil.copytree(src, dst)
    if edit:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def poison(value: float, key: str = "model.layers.1.mlp.down_proj.weight"):
    def edit(tensors):
        tensors[key][0, :3] = value
    return edit


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@dataclass
class Case:
    """args use {model}, {tmp}, {file}... placeholders filled from the scene the setup returns."""

    id: str
    args: list[str]
    fragment: str  # in the output
    setup: Callable[[Path, Path], dict] = lambda tmp, model: {}
    code: int = 2
    unchanged: list[str] = field(default_factory=list)  # scene keys whose files must be byte-identical after


def _files(tmp: Path, model: Path) -> dict:
    d = tmp / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "quantkit.json").write_text('{"quantkit_version": "0.1.0"}')
    return {"dir": d}


def _cwd_scene(tmp: Path, model: Path) -> dict:
    work = tmp / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    os.chdir(work)
    return {"work": work}


def _home_scene(tmp: Path, model: Path) -> dict:
    home = tmp / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine")
    os.environ["HOME"] = str(home)
    return {"home": home}


def _latin1(tmp: Path, model: Path) -> dict:
    f = tmp / "cal.txt"
    f.write_bytes(("Émma Woodhouse, handsome, clever, and rich. " * 400).encode("latin-1"))
    return {"file": f}


def _binary(tmp: Path, model: Path) -> dict:
    f = tmp / "cal.txt"
    f.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)
    return {"file": f}


def _bool_recipe(tmp: Path, model: Path) -> dict:
    f = tmp / "r.yaml"
    f.write_text("version: 1\nname: b\nstages:\n  - algorithm: rtn\n    scheme: {preset: W4A16, group_size: true}\n")
    return {"file": f}


def _unknown_type(tmp: Path, model: Path) -> dict:
    return {"bad": copy_model(model, tmp / "bad", config=lambda c: c.update(model_type="frobnicator"))}


def _nan_model(tmp: Path, model: Path) -> dict:
    return {"bad": copy_model(model, tmp / "bad", poison(float("nan")))}


def _inf_model(tmp: Path, model: Path) -> dict:
    return {"bad": copy_model(model, tmp / "bad", poison(float("inf")))}


def _a_file(tmp: Path, model: Path) -> dict:
    f = tmp / "out.bin"
    f.write_text("not a directory")
    return {"file": f}


Q = ["quantize", "{model}", "--recipe", "rtn-w4a16", "--no-progress"]
CASES = [
    # --overwrite: never what quantkit did not write
    Case("overwrite-cwd", Q + ["-o", ".", "--overwrite"], "it is the current directory", _cwd_scene, unchanged=["work"]),
    Case("overwrite-parent-of-cwd", Q + ["-o", "..", "--overwrite"], "the current directory or a parent of it",
         _cwd_scene, unchanged=["work"]),
    Case("overwrite-home", Q + ["-o", "~", "--overwrite"], "it is your home directory", _home_scene, unchanged=["home"]),
    Case("overwrite-source", Q + ["-o", "{model}", "--overwrite"], "the source model", unchanged=["model"]),
    Case("overwrite-foreign-files", Q + ["-o", "{dir}", "--overwrite"], "which quantkit did not write",
         _files, unchanged=["dir"]),
    Case("overwrite-a-file", Q + ["-o", "{file}", "--overwrite"], "is a file, not a directory", _a_file,
         unchanged=["file"]),
    # non-finite source weights
    Case("nan-weight", ["quantize", "{bad}", "--recipe", "rtn-w4a16", "-o", "{tmp}/q"],
         "model.layers.1.mlp.down_proj.weight (3 of", _nan_model),
    Case("inf-weight", ["quantize", "{bad}", "--recipe", "rtn-w4a16", "-o", "{tmp}/q"], "NaN/Inf values", _inf_model),
    # recipes: booleans are not numbers
    Case("bool-group-size-recipe", ["quantize", "{model}", "--recipe", "{file}", "-o", "{tmp}/q"],
         "group_size: expected a number, got true", _bool_recipe),
    Case("bool-group-size-set", Q + ["--set", "stages.0.scheme.group_size=true", "-o", "{tmp}/q"],
         "group_size: expected a number, got true"),
    Case("bool-algorithm-arg", ["quantize", "{model}", "--recipe", "gptq-w4a16", "--set", "stages.0.args.block_size=yes",
                                "-o", "{tmp}/q"], "block_size: expected a number, got true"),
    # text input
    Case("calibration-not-utf8", ["quantize", "{model}", "--recipe", "gptq-w4a16", "--set", "calibration.dataset={file}",
                                  "-o", "{tmp}/q"], "is not valid utf-8: byte 0", _latin1),
    Case("eval-not-utf8", ["eval", "ppl", "{model}", "--dataset", "{file}", "--seq-len", "32"],
         "--encoding", _latin1),
    Case("calibration-binary", ["quantize", "{model}", "--recipe", "gptq-w4a16", "--set", "calibration.dataset={file}",
                                "-o", "{tmp}/q"], "holds binary data", _binary),
    Case("unknown-encoding", ["eval", "ppl", "{model}", "--dataset", "{file}", "--encoding", "klingon"],
         "unknown encoding 'klingon'", _latin1),
    # eval
    Case("eval-seven-tokens", ["eval", "ppl", "{model}", "--seq-len", "8", "--max-windows", "1"],
         "only 7 tokens of the text would be scored"),
    Case("eval-one-token", ["eval", "ppl", "{model}", "--seq-len", "2", "--max-windows", "1"],
         "only 1 tokens of the text would be scored"),
    Case("eval-seq-len-past-context", ["eval", "ppl", "{model}", "--seq-len", "4096"],
         "longer than the context of"),
    Case("eval-json-missing-dir", ["eval", "ppl", "{model}", "--json", "{tmp}/no/such/dir/p.json"], "does not exist"),
    # generate
    Case("generate-empty-prompt", ["generate", "{model}", ""], "the prompt is empty"),
    Case("generate-blank-prompt", ["generate", "{model}", "   "], "the prompt is empty"),
    Case("generate-unknown-model-type", ["generate", "{bad}", "hello"], "model_type 'frobnicator'", _unknown_type),
    Case("generate-prompt-without-model", ["generate", "Once upon a time"],
         "'Once upon a time' is not a model"),
    Case("generate-empty-stop", ["generate", "{model}", "hi", "--stop", ""], "stop strings must be non-empty"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", os.environ.get("HOME", str(tmp_path)))
    model = copy_model(tiny_llama, tmp_path / "model")
    scene = {"model": model, "tmp": tmp_path, **case.setup(tmp_path, model)}
    before = {k: tree(scene[k]) if scene[k].is_dir() else scene[k].read_bytes() for k in case.unchanged}
    args = [a.format(**scene) for a in case.args]
    res = run(*args)
    assert res.exit_code == case.code, res.output
    assert case.fragment in res.output, res.output
    assert "Traceback" not in res.output
    for k, was in before.items():
        now = tree(scene[k]) if scene[k].is_dir() else scene[k].read_bytes()
        assert now == was, f"{k} changed"
    assert not (tmp_path / "q").exists()
    assert not list(tmp_path.glob(".*.tmp-*")), "a work directory was left behind"


# -- cases with more to check -------------------------------------------------------------------


def test_zero_nonfinite_is_loud_and_recorded(tiny_llama, tmp_path):
    bad = copy_model(tiny_llama, tmp_path / "bad", poison(float("nan")))
    res = run("quantize", bad, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--zero-nonfinite", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "WARNING: --zero-nonfinite: replaced NaN/Inf with 0 in 1 tensor(s)" in res.output
    meta = json.loads((tmp_path / "q" / "quantkit.json").read_text())
    assert meta["zeroed_nonfinite"] == ["model.layers.1.mlp.down_proj.weight"]
    assert all(torch.isfinite(t.float()).all() for t in load_file(tmp_path / "q" / "model.safetensors").values())


def test_nonfinite_scales_are_refused_before_writing(tiny_llama, tmp_path, monkeypatch):
    """Whatever produced them, NaN/Inf in the tensors to write stop the export, naming them."""
    import quantkit.quant.intq as intq

    real = intq.rtn

    def broken(w, scheme, scale_dtype):
        qw = real(w, scheme, scale_dtype)
        qw.scale[0, 0] = float("inf")
        return qw

    monkeypatch.setattr("quantkit.algorithms.rtn.rtn", broken)
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 2 and "weight_scale (1 of" in res.output and "nothing was written" in res.output
    assert list(tmp_path.iterdir()) == []


def test_nan_perplexity_is_an_error_and_null_in_json(tiny_llama, tmp_path, monkeypatch):
    # NaN/Inf in a checkpoint's tensors are refused at load (tests/test_input_checks.py); logits may still
    # overflow in a narrower dtype: the second model's likelihood is made NaN here, as such a model's would be
    import dataclasses

    import quantkit.eval.ppl_table as table

    bad = copy_model(tiny_llama, tmp_path / "bad")
    real = table.perplexity

    def nan_for_the_second(model, *a, **k):
        res = real(model, *a, **k)
        return dataclasses.replace(res, nll=float("nan"), ppl=float("nan")) \
            if str(model.quantkit_source) == str(bad) else res

    monkeypatch.setattr(table, "perplexity", nan_for_the_second)
    out = tmp_path / "p.json"
    res = run("eval", "ppl", tiny_llama, bad, "--seq-len", "64", "--max-windows", "2", "--json", out, "--no-progress")
    assert res.exit_code == 2 and "ERROR" in res.output and "non-finite perplexity" in res.output
    # strict JSON: a NaN constant would not parse in most readers
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} written"))
    assert data["results"][0]["ppl"] > 0 and data["results"][1]["ppl"] is None
    assert "non-finite" in data["results"][1]["error"]


def test_a_bad_second_model_fails_before_the_first_is_scored(tiny_llama, tmp_path, monkeypatch):
    import quantkit.eval.ppl_table as report

    monkeypatch.setattr(report, "perplexity", lambda *a, **k: pytest.fail("scored before every model was checked"))
    res = run("eval", "ppl", tiny_llama, tmp_path / "missing", "--seq-len", "32", "--max-windows", "4")
    assert res.exit_code == 2 and "does not exist" in res.output


def test_generation_options_fail_before_the_model_loads(tiny_llama, monkeypatch):
    import quantkit.checkpoints.loader as loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before the options were checked"))
    res = run("generate", tiny_llama, "hi", "--stop", "")
    assert res.exit_code == 2 and "stop strings must be non-empty" in res.output


def test_json_path_is_checked_before_the_evaluation(tiny_llama, tmp_path, monkeypatch):
    import quantkit.eval.ppl_table as report

    monkeypatch.setattr(report, "evaluate_many", lambda *a, **k: pytest.fail("evaluated before --json was checked"))
    res = run("eval", "ppl", tiny_llama, "--json", tmp_path / "missing" / "p.json")
    assert res.exit_code == 2 and "does not exist" in res.output


def test_encoding_option_reads_the_file(tiny_llama, tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes(("Émma Woodhouse, handsome, clever, and rich. " * 200).encode("latin-1"))
    res = run("eval", "ppl", tiny_llama, "--dataset", f, "--encoding", "latin-1", "--seq-len", "64", "--max-windows", "2",
              "--no-progress")
    assert res.exit_code == 0, res.output
    res = run("quantize", tiny_llama, "--recipe", "gptq-w4a16", "--set", f"calibration.dataset={f}",
              "--set", "calibration.encoding=latin-1", "--set", "calibration.num_samples=2",
              "--set", "calibration.seq_len=32", "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 0, res.output


def test_default_group_size_falls_back_per_layer(tmp_path, tokenizer):
    """The README's first command: rtn-w4a16 (group 128) on a model with 192-wide inputs (576 for SmolLM2)
    works: those layers get group 64, the rest keep 128, printed and recorded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantkit

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=192, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    src = tmp_path / "m192"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(src)
    tokenizer.save_pretrained(src)
    res = run("quantize", src, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "group_size 128 does not divide the inputs of 12 linear(s)" in res.output and "group_size 64" in res.output
    meta = json.loads((tmp_path / "q" / "quantkit.json").read_text())
    fallen = {r["name"] for r in meta["group_size_fallbacks"]}
    assert len(fallen) == 12 and not any("down_proj" in n for n in fallen)
    assert all(r["group_size"] == 64 and r["recipe_group_size"] == 128 for r in meta["group_size_fallbacks"])
    model = quantkit.load(tmp_path / "q", dtype=torch.float32)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.scheme.group_size == 64 and layer.mlp.down_proj.scheme.group_size == 128
    assert layer.self_attn.q_proj.weight_scale.shape == (192, 3) and layer.mlp.down_proj.weight_scale.shape == (192, 2)
    # the same with GPTQ: the fallback layers are solved with their own scheme
    res = run("quantize", src, "--recipe", "gptq-w4a16", "--set", "calibration.num_samples=4",
              "--set", "calibration.seq_len=32", "-o", tmp_path / "g", "--no-progress")
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "g" / "quantkit.json").read_text())["layers"]
    assert {r["name"] for r in rows if r["scheme"] == "int4 sym g64 actorder"} == fallen
    assert {r["scheme"] for r in rows} == {"int4 sym g64 actorder", "int4 sym g128 actorder"}
    assert all(r["hessian_error_vs_rtn"] <= 1.0 for r in rows)


def test_recipe_yaml_states_the_overrides(tiny_llama, tmp_path):
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "--set", "stages.0.scheme.group_size=32",
              "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 0, res.output
    text = (tmp_path / "q" / "recipe.yaml").read_text()
    assert text.startswith("# recipe rtn-w4a16 with these overrides applied:\n# --set stages.0.scheme.group_size=32\n")
    assert json.loads((tmp_path / "q" / "quantkit.json").read_text())["overrides"] == ["stages.0.scheme.group_size=32"]
    from quantkit.flow.recipe import load_recipe

    assert load_recipe(str(tmp_path / "q" / "recipe.yaml")).stages[0].scheme.group_size == 32  # still a recipe


def test_auto_map_is_dropped_unless_remote_code_is_trusted(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "remote",
                     config=lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}))
    (src / "modeling_x.py").write_text("raise SystemExit('never run')\n")
    res = run("quantize", src, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "dropped auto_map" in res.output and "--trust-remote-code" in res.output
    assert "auto_map" not in json.loads((tmp_path / "q" / "config.json").read_text())
    assert not (tmp_path / "q" / "modeling_x.py").exists()
    res = run("quantize", src, "--recipe", "rtn-w4a16", "-o", tmp_path / "k", "--no-progress", "--trust-remote-code")
    assert res.exit_code == 0, res.output
    assert "auto_map" in json.loads((tmp_path / "k" / "config.json").read_text())
    assert (tmp_path / "k" / "modeling_x.py").is_file()


# -- the output's filesystem --------------------------------------------------------------------


def _mount_tmpfs(where: Path, options: str):
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()})")


def test_read_only_filesystem_fails_before_the_work(tiny_llama, tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "size=1m,ro")
    try:
        res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", ro / "q", "--no-progress")
    finally:
        subprocess.run(["umount", str(ro)])
    assert res.exit_code == 2 and "cannot write in" in res.output and "Read-only file system" in res.output
    assert "Quantized" not in res.output


def test_full_disk_fails_before_the_work_with_the_numbers(tiny_llama, tmp_path):
    small = tmp_path / "small"
    _mount_tmpfs(small, "size=64k")
    try:
        res = run("quantize", tiny_llama, "--recipe", "rtn-w8a16", "-o", small / "q", "--no-progress")
        left = list(small.iterdir())
    finally:
        subprocess.run(["umount", str(small)])
    assert res.exit_code == 2 and "the checkpoint needs about" in res.output and "GB free" in res.output
    assert left == []


def test_disk_full_while_writing_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    """The space estimate can be beaten (another writer): ENOSPC during the write is a clear error too."""
    import errno

    import quantkit.formats.checkpoint as checkpoint

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_copy_range", full)
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--no-progress")
    assert res.exit_code == 2 and "No space left on device" in res.output and "nothing was written" in res.output
    assert list(tmp_path.iterdir()) == []


def test_immutable_directory_fails_before_the_work(tiny_llama, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not supported here")
    try:
        res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", locked / "q", "--no-progress")
    finally:
        subprocess.run(["chattr", "-i", str(locked)])
    assert res.exit_code == 2 and "cannot write in" in res.output


# -- leftovers of killed runs -------------------------------------------------------------------

KILLED_EXPORT = """
import os, signal, sys
from pathlib import Path
from quantkit.checkpoints.atomic import atomic_output_dir
with atomic_output_dir(Path(sys.argv[1])) as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 100000)
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
"""


def _killed_export(out: Path, sig: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(out), sig], cwd=ROOT, capture_output=True)


def test_sigkill_leftovers_are_removed_by_the_next_run_and_said(tiny_llama, tmp_path):
    out = tmp_path / "q"
    _killed_export(out, "SIGKILL")
    assert len(list(tmp_path.glob(".q.tmp-*"))) == 1 and not out.exists()
    res = run("quantize", tiny_llama, "--recipe", "rtn-w4a16", "-o", out, "--no-progress")
    assert res.exit_code == 0, res.output
    assert "removed " in res.output and "left by a process that is gone" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    code = ("import sys; sys.argv = ['quantkit']; from quantkit.cli import _terminate_cleanly; _terminate_cleanly()\n"
            + KILLED_EXPORT.replace("sys.argv[1]", "sys.argv_out").replace("sys.argv[2]", "'SIGTERM'"))
    code = code.replace("sys.argv = ['quantkit']", f"sys.argv_out = {str(tmp_path / 'q')!r}")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert res.returncode == 143, res.stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_main_in_another_program_leaves_its_sigterm_alone(tiny_llama):
    """Only the quantkit program (`quantkit.cli.run`) turns SIGTERM into an unwinding exit; a host that
    calls `main` in its own process (this test runner) keeps its handler."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert run("plugins").exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_clean_lists_removes_and_leaves_running_ones(tmp_path):
    from quantkit.checkpoints.atomic import WORK_MARKER, atomic_output_dir

    _killed_export(tmp_path / "a", "SIGKILL")
    (tmp_path / "notes.tmp-keep").mkdir()  # not hidden: not ours
    with atomic_output_dir(tmp_path / "b") as live:  # this process is alive: its work directory stays
        assert (live / WORK_MARKER).is_file()
        res = run("clean", tmp_path, "--dry-run")
        assert res.exit_code == 0 and "would remove" in res.output and "left alone" in res.output
        assert len(list(tmp_path.glob(".a.tmp-*"))) == 1
        res = run("clean", tmp_path)
        assert res.exit_code == 0 and "removed" in res.output
        assert list(tmp_path.glob(".a.tmp-*")) == [] and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "notes.tmp-keep"]
    assert run("clean", tmp_path).output.strip() == "no work directories left by stopped runs"


def test_a_replaced_output_stranded_by_a_crash_is_restored(tmp_path):
    from quantkit.checkpoints.atomic import WORK_MARKER

    old = tmp_path / ".q.old-abc123"
    (old / "previous").mkdir(parents=True)
    (old / "previous" / "quantkit.json").write_text('{"quantkit_version": "0.1.0"}')
    (old / WORK_MARKER).write_text(json.dumps({"pid": 2 ** 22 + 7, "process_start": "1"}))  # no such process
    res = run("clean", tmp_path)
    assert res.exit_code == 0 and "restored" in res.output
    assert (tmp_path / "q" / "quantkit.json").is_file() and not old.exists()
