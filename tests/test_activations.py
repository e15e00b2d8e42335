"""Calibration activations within a memory budget (`quantkit.calibration.activations`): the batches
beyond it wait on disk, the results are byte-identical, the bytes held never pass the budget, and
the scratch directory is gone after the run, finished or not."""

from __future__ import annotations

import json

import pytest
import torch

import quantkit.flow.pipeline as pipeline
from quantkit.checkpoints.atomic import find_work_dirs
from quantkit.calibration.activations import Activations, Budget
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe

SMALL = ["calibration.num_samples=8", "calibration.seq_len=32", "calibration.batch_size=2"]  # 4 batches


def _batches(n=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 5, 8, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_spilled_batches_read_back_exactly(tmp_path, dtype):
    batches = _batches(dtype=dtype)
    one = batches[0].numel() * batches[0].element_size()
    acts = Activations(Budget(limit=one), tmp_path)  # the first in memory, three on disk
    for b in batches:
        acts.append(b)
    assert len(acts) == 4 and acts.spilled == 3 and len(list(tmp_path.iterdir())) == 3
    assert acts.budget.held == one and acts.budget.spilled_bytes == 3 * one
    for got, want in zip(acts, batches):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(acts[2], batches[2])
    assert len(list(tmp_path.iterdir())) == 3  # reading keeps them


def test_drain_releases_and_next_layer_shares_the_budget(tmp_path):
    batches = _batches()
    one = batches[0].numel() * batches[0].element_size()
    acts = Activations(Budget(limit=2 * one), tmp_path)
    for b in batches:
        acts.append(b)
    nxt = acts.successor()
    for h in acts.drain():  # like the forward to the next layer: each input released as its output is made
        nxt.append(h * 2)
        assert acts.budget.held <= 2 * one
    assert acts.budget.peak <= 2 * one
    assert [torch.equal(a, b * 2) for a, b in zip(nxt, batches)] == [True] * 4
    with pytest.raises(IndexError, match="already consumed"):
        acts[0]
    nxt.clear()
    assert acts.budget.held == 0 and not list(tmp_path.iterdir())


def test_no_spill_directory_is_an_error_not_a_silent_overrun():
    acts = Activations(Budget(limit=10))
    with pytest.raises(RuntimeError, match="no spill directory"):
        acts.append(torch.zeros(100))


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


@pytest.mark.parametrize("recipe, overrides", [
    ("gptq-w4a16", ["stages.0.scheme.group_size=32"]),
    ("awq-w4a16-fp8kv", ["stages.1.scheme.group_size=32"]),
])
def test_quantize_with_activations_on_disk_writes_the_same_files(recipe, overrides, tiny_llama, tmp_path):
    plain = quantize(str(tiny_llama), load_recipe(recipe, overrides + SMALL), tmp_path / "plain", progress=False)
    lines = []
    spilled = quantize(str(tiny_llama), load_recipe(recipe, overrides + SMALL), tmp_path / "spilled", progress=False,
                       activation_budget_bytes=10_000, notify=lines.append)  # one batch of 2 x 32 x 64 in bf16
    assert _files(plain.output) == _files(spilled.output)
    meta = json.loads((spilled.output / "quantkit.json").read_text())["activations"]
    assert meta["budget_bytes"] == 10_000 and meta["peak_bytes"] <= 10_000 and meta["spilled_bytes"] > 0
    assert any("above the 0.00 GB budget" in line and "wait on disk" in line for line in lines)
    assert not find_work_dirs(tmp_path)  # the scratch directory is gone
    none = json.loads((plain.output / "quantkit.json").read_text())["activations"]
    assert none["spilled_bytes"] == 0


@pytest.mark.parametrize("mode", ["two-pass", "true-sequential"])
def test_interrupted_run_removes_its_scratch_directory(mode, tiny_llama, tmp_path, monkeypatch):
    """Stopped in the second layer's forward (two-pass), or in the middle of its lock-step pass, at the second
    group's solve, with the batches' threads parked (true-sequential)."""
    calls = []
    if mode == "two-pass":
        def stop(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the second layer's forward: activations are on disk by now
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        real, target = pipeline.run_layer, "run_layer"
    else:
        def stop(layer, hidden, kwargs, groups, on_input, at_group, **kw):
            calls.append(1)
            solves = []

            def interrupted(g):
                solves.append(g)
                if len(calls) == 2 and len(solves) == 2:
                    raise KeyboardInterrupt
                return at_group(g)

            return real(layer, hidden, kwargs, groups, on_input, interrupted, **kw)

        real, target = pipeline.drive_in_lockstep, "drive_in_lockstep"
    monkeypatch.setattr(pipeline, target, stop)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_llama), load_recipe("gptq-w4a16", ["stages.0.scheme.group_size=32",
                                                            f"stages.0.args.true_sequential={mode != 'two-pass'}"]
                                              + SMALL),
                 tmp_path / "out", progress=False, activation_budget_bytes=0)
    if mode != "two-pass":
        from quantkit.calibration.lockstep import live_batches

        assert live_batches() == 0  # every batch's forward unwound
    assert len(calls) == 2
    # the scratch directory is gone; what stays is the stopped run's resumable state (`quantkit.flow.resume`)
    assert not (tmp_path / "out").exists() and [w.kind for w in find_work_dirs(tmp_path)] == ["run"]
