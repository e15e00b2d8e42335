"""`quantkit report`: its files, sections and plots, and its checks before any evaluation."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (quantkit[eval])")

from quantkit.cli import main  # noqa: E402
from quantkit.eval import plots  # noqa: E402
from quantkit.eval.report import REPORT_FILES, first_divergence  # noqa: E402
from quantkit.flow.job import quantize  # noqa: E402
from quantkit.flow.recipe import load_recipe  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_png(path, min_width=600):
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= min_width and im.size[1] >= 300
        assert len(set(im.convert("L").getdata())) > 16  # something is drawn, not a blank canvas


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [7]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early
    assert first_divergence([1, 2], [1, 2, 9]) == 2


def test_layer_values_by_decoder_index():
    layers = [{"name": "model.layers.0.q", "sqnr_db": 10.0, "hessian_error_vs_rtn": 0.5},
              {"name": "model.layers.0.k", "sqnr_db": 12.0, "hessian_error_vs_rtn": 0.7},
              {"name": "model.layers.1.q", "sqnr_db": 20.0, "awq_error_vs_unscaled": 0.9},
              {"name": "lm_head", "sqnr_db": 5.0}]
    assert plots.by_layer(layers, "sqnr_db") == {0: [10.0, 12.0], 1: [20.0]}
    assert plots.by_layer(layers, "output_error") == {0: [0.5, 0.7], 1: [0.9]}


def test_plots_are_valid_pngs(tmp_path):
    layers = {"a": [{"name": f"model.layers.{i}.q", "sqnr_db": 18 + i % 3, "algorithm": "rtn"} for i in range(6)],
              "b": [{"name": f"model.layers.{i}.q", "sqnr_db": 16 + i % 2, "algorithm": "gptq",
                     "hessian_error_vs_rtn": 0.3} for i in range(6)]}
    assert_png(plots.per_layer_error(layers, tmp_path / "l.png"))
    points = [{"name": "orig", "bits_per_weight": 16.0, "ppl": 20.0, "kld_mean": None},
              {"name": "w4", "bits_per_weight": 4.5, "ppl": 25.0, "kld_mean": 0.2},
              {"name": "w8", "bits_per_weight": 8.5, "ppl": 20.1, "kld_mean": 0.004}]
    assert_png(plots.size_vs_quality(points, "emma", tmp_path / "s.png"))


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    small = ["calibration.num_samples=8", "calibration.seq_len=64"]
    rtn, gptq = root / "rtn", root / "gptq"
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), rtn, progress=False)
    quantize(str(tiny_llama), load_recipe("gptq-w4a16", ["stages.0.scheme.group_size=32", *small]), gptq,
             progress=False)
    return rtn, gptq


def test_report_files_and_sections(tiny_llama, checkpoints, tmp_path):
    out = tmp_path / "report"
    res = run("report", *checkpoints, "-o", out, "--seq-len", 32, "--max-windows", 4, "--max-new-tokens", 6,
              "--dtype", "float32", "--no-progress", "--prompt", "It is a truth", "--prompt", "Emma was")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == sorted([*REPORT_FILES, "quantkit.json"])
    md = (out / "report.md").read_text()
    for section in ("# quantkit report: 2 checkpoint(s) of llama", "## Summary", "## Protocol", "## Plots",
                    "## Checkpoints", "## Greedy generations side by side", "Prompt: *It is a truth*",
                    "![Per-layer weight SQNR](per_layer_error.png)", "mean KLD over texts", "worst text",
                    "## Per language and domain", "| manual-zh | zh | technical |", "| chat | multi | chat |",
                    "bits/weight", "rtn-w4a16", "gptq-w4a16", "(original)", "departs at"):
        assert section in md, section
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<table>") == 5 and 'src="size_vs_quality.png"' in html
    for png in ("per_layer_error.png", "size_vs_quality.png"):
        assert_png(out / png)
    data = json.loads((out / "report.json").read_text())
    ckpts = data["checkpoints"]
    assert [c["role"] for c in ckpts] == ["original", "checkpoint", "checkpoint"]
    # bf16 weights plus the safetensors header
    assert 16.0 < ckpts[0]["bits_per_weight"] < 16.5 and ckpts[1]["bits_per_weight"] < ckpts[0]["bits_per_weight"]
    assert ckpts[2]["recipe"] == "gptq-w4a16" and ckpts[2]["layers"]
    assert len(data["generations"]) == 2 and data["generations"][0]["rows"][0]["diverges_at"] is None

    # again into the same directory: refused without --overwrite, before any evaluation
    res = run("report", *checkpoints, "-o", out)
    assert res.exit_code == 2 and "already exists" in res.output
    # from saved eval results, replacing the earlier report
    evaluation = tmp_path / "eval.json"
    evaluation.write_text(json.dumps(data["eval"]))
    res = run("report", *checkpoints, "-o", out, "--overwrite", "--eval-json", evaluation, "--prompt", "")
    assert res.exit_code == 0, res.output
    assert "Prompt:" not in (out / "report.md").read_text()
    # results of other models are refused
    res = run("report", checkpoints[0], "-o", tmp_path / "r2", "--eval-json", evaluation, "--prompt", "")
    assert res.exit_code == 2 and "run `quantkit eval` on the same models" in res.output
    assert not (tmp_path / "r2").exists()


def test_report_output_checked_before_evaluating(checkpoints, tmp_path, monkeypatch):
    import quantkit.eval.compare as compare

    monkeypatch.setattr(compare, "evaluate", lambda *a, **k: pytest.fail("evaluated before the output was checked"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    res = run("report", *checkpoints, "-o", taken, "--overwrite")
    assert res.exit_code == 2 and "not a quantkit output" in res.output and (taken / "notes.txt").exists()
