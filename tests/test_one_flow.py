"""One quantize flow: `quantkit quantize` (the CLI, layer by layer or whole) and `quantkit.quantize` +
`quantkit.save` (the Python API) write the same files, byte for byte. quantkit.json's measured figures
(time, memory, the moment it was made, the plan's budget from the memory free now) are the only
bytes allowed to differ, and `load` says how the run went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import quantkit
from quantkit.cli import main

SMALL = ["calibration.num_samples=4", "calibration.seq_len=32"]
MEASURED = ("created", "quantize_seconds", "timings", "peak_rss_bytes", "plan", "activations")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _settled(meta: bytes) -> dict:
    data = json.loads(meta)
    for key in MEASURED:
        assert key in data, key
        data.pop(key)
    data["device"].pop("peak_bytes")
    for row in data["layers"]:
        row.pop("seconds", None)
    return data


@pytest.mark.parametrize("recipe, overrides", [
    ("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
    ("gptq-w4a16", ["stages.0.scheme.group_size=32", *SMALL]),
    ("awq-w4a16-fp8kv", ["stages.1.scheme.group_size=32", *SMALL]),
])
@pytest.mark.parametrize("load", ["layers", "whole"])
def test_cli_and_python_api_write_the_same_files(tiny_llama, tmp_path, recipe, overrides, load):
    sets = [a for item in overrides for a in ("--set", item)]
    cli = CliRunner().invoke(main, ["quantize", str(tiny_llama), "--recipe", recipe, *sets, "-o", str(tmp_path / "cli"),
                                    "--load", load, "--device", "cpu", "--no-progress"])
    assert cli.exit_code == 0, cli.output
    model, _ = quantkit.quantize(tiny_llama, recipe, overrides=overrides, device="cpu")
    quantkit.save(model, tmp_path / "api")
    a, b = _files(tmp_path / "cli"), _files(tmp_path / "api")
    assert a.keys() == b.keys()
    assert any(name.endswith(".safetensors") for name in a)
    for name in a:
        if name != "quantkit.json":
            assert a[name] == b[name], name
    cli_meta, api_meta = _settled(a["quantkit.json"]), _settled(b["quantkit.json"])
    assert cli_meta.pop("load") == load and api_meta.pop("load") == "whole"
    assert cli_meta == api_meta
