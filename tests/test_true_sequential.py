"""True-sequential quantization in one lock-step forward per layer (`calibration.lockstep`): each linear
group is calibrated on exactly what the finished quantized model feeds it, the batches pause and go on
in order on the caller's thread, failures end the pass with every parked forward unwound, and GPTQ's option
runs end to end."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch
from torch import nn

from quantkit.algorithms.rtn import RTN
from quantkit.calibration.lockstep import drive_in_lockstep, live_batches
from quantkit.errors import QuantizationError
from quantkit.core.registry import ALGORITHMS

from helpers import quantize_in_memory, sample_ids


class Chain(nn.Module):
    """x -> a -> relu -> b -> c, with a and b reading their own inputs (three groups)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return (self.c(self.b(torch.relu(self.a(x))) * scale),)


def test_every_batch_reaches_a_group_before_it_changes_and_outputs_keep_their_order():
    """The inputs are handed over in batch order, every forward and callback on the caller's thread (no
    thread of its own: a worker thread's OpenMP team slows the caller's solves)."""
    chain = Chain()
    threads = set()
    chain.a.register_forward_hook(lambda *a: threads.add(threading.get_ident()))
    xs = [torch.randn(3, 4) for _ in range(4)]
    kwargs = [{"scale": float(i + 1)} for i in range(4)]
    events, seen = [], {0: [], 1: [], 2: []}

    def on_input(g, x):
        events.append(("input", g))
        seen[g].append(x.clone())
        threads.add(threading.get_ident())

    def at_group(g):
        events.append(("quantize", g))
        threads.add(threading.get_ident())
        module = [chain.a, chain.b, chain.c][g]
        module.weight.data = module.weight.data.round()  # "quantized": the later groups must see it

    out = drive_in_lockstep(chain, xs, kwargs, [[chain.a], [chain.b], [chain.c]], on_input, at_group, outputs=[])
    assert threads == {threading.get_ident()}
    # all four batches give group g its input, then g is quantized, then the next group
    assert events == [e for g in range(3) for e in [("input", g)] * 4 + [("quantize", g)]]
    # the rounded model (what is left at the end) computes the same outputs, and feeds each group what it saw
    with torch.no_grad():
        for i, x in enumerate(xs):
            torch.testing.assert_close(out[i], chain(x, scale=kwargs[i]["scale"])[0], rtol=0, atol=0)
            torch.testing.assert_close(seen[1][i], torch.relu(chain.a(x)), rtol=0, atol=0)
            torch.testing.assert_close(seen[2][i], chain.b(torch.relu(chain.a(x))) * kwargs[i]["scale"], rtol=0, atol=0)
    assert not live_batches()


def test_a_group_shared_by_linears_is_one_stop():
    class Fork(nn.Module):
        def __init__(self):
            super().__init__()
            self.p, self.q = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.p(x) + self.q(x)

    fork, counts = Fork(), []
    drive_in_lockstep(fork, [torch.randn(2, 4)] * 3, [{}] * 3, [[fork.p, fork.q]], lambda g, x: counts.append(g),
                      lambda g: counts.append(("q", g)))
    assert counts == [0, 0, 0, ("q", 0)]


@pytest.mark.parametrize("where", ["forward", "at_group", "on_input"])
def test_a_failure_ends_the_pass_with_every_parked_forward_unwound(where):
    class Guarded(Chain):
        unwound: ClassVar[list] = []

        def forward(self, x, scale=1.0):
            try:
                return super().forward(x, scale)
            finally:
                self.unwound.append(scale)

    chain = Guarded()

    class Boom(RuntimeError):
        pass

    def on_input(g, x):
        if where == "on_input" and g == 1:
            raise Boom("on_input")

    def at_group(g):
        if where == "at_group" and g == 1:
            raise Boom("at_group")

    kwargs = [{}, {}, {"scale": "not a number"} if where == "forward" else {}]
    with pytest.raises((Boom, TypeError)):
        drive_in_lockstep(chain, [torch.randn(2, 4) for _ in range(3)], kwargs, [[chain.a], [chain.b], [chain.c]],
                          on_input, at_group, outputs=[])
    assert not live_batches()
    # every batch that began its forward left it through its finally block (parked ones unwound, not dropped)
    assert len(Guarded.unwound) == 3


def test_a_batch_reaching_a_quantized_group_late_is_an_error():
    """A layer whose batches take different paths cannot be followed by one pass: an error, not a group
    quantized without some batch's input."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, flip=False):
            return self.a(self.b(x)) if flip else self.b(self.a(x))

    m = Branchy()
    with pytest.raises(QuantizationError, match="order that differs between batches"):
        drive_in_lockstep(m, [torch.randn(2, 4)] * 2, [{}, {"flip": True}], [[m.a], [m.b]], lambda g, x: None,
                          lambda g: None, names=["a", "b"])
    assert not live_batches()


class RecordingTrueSequentialRTN(RTN):
    """RTN that needs calibration, runs true-sequential and records what each linear saw."""

    name = "recording-ts-rtn"
    needs_calibration = True
    seen: ClassVar[dict] = {}

    def true_sequential(self) -> bool:
        return True

    def observe(self, name, x):
        self.seen.setdefault(name, []).append(x.detach().clone())


if "recording-ts-rtn" not in ALGORITHMS:
    ALGORITHMS.add("recording-ts-rtn", RecordingTrueSequentialRTN)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_every_linear_calibrates_on_what_the_quantized_model_feeds_it(arch, tiny_models, tokenizer):
    """The defining property: every targeted linear of every layer saw exactly its input in the final
    model (all earlier linears, in this layer too, quantized), for every batch."""
    RecordingTrueSequentialRTN.seen.clear()
    batches = [sample_ids(tokenizer, 2, 24), sample_ids(tokenizer, 1, 20)]
    model, adapter, result, _, _ = quantize_in_memory(
        tiny_models[arch], "rtn-w4a16", ["stages.0.algorithm=recording-ts-rtn", "stages.0.scheme.group_size=32"],
        batches)
    names = [row["name"] for row in result.layers]
    assert len(names) == 7 * len(adapter.layers(model))
    expected: dict[str, list] = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: expected.setdefault(n, []).append(a[0].clone())) for n in names]
    with torch.no_grad():
        for b in batches:
            model(input_ids=b, use_cache=False)
    for h in handles:
        h.remove()
    for name in names:
        got = RecordingTrueSequentialRTN.seen[name]
        assert len(got) == len(batches), name
        for g, e in zip(got, expected[name]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)


def test_gptq_true_sequential_end_to_end(tiny_llama, tokenizer):
    """GPTQ's option: every linear quantized with a Hessian-weighted error below round-to-nearest's, and
    the Hessians come from the partly quantized layer (the codes differ from the float-layer run's)."""
    batches = [sample_ids(tokenizer, 2, 24), sample_ids(tokenizer, 2, 24)]
    base = ["stages.0.scheme.group_size=32"]
    _, _, ts, _, _ = quantize_in_memory(tiny_llama, "gptq-w4a16", base + ["stages.0.args.true_sequential=true"], batches)
    _, _, plain, _, _ = quantize_in_memory(tiny_llama, "gptq-w4a16", base + ["stages.0.args.true_sequential=false"],
                                           batches)
    rows = {r["name"]: r for r in ts.layers}
    assert len(rows) == len(plain.layers) == 21
    assert all(r["hessian_error_vs_rtn"] < 1.0 for r in rows.values()), rows
    assert "gptq: true-sequential forward" in ts.timings and "forward quantized layer (next inputs)" not in ts.timings
    # layer 0's q/k/v read the same inputs either way; its o_proj onwards do not
    plain_rows = {r["name"]: r for r in plain.layers}
    assert rows["model.layers.0.self_attn.q_proj"]["sqnr_db"] == plain_rows["model.layers.0.self_attn.q_proj"]["sqnr_db"]
    assert any(rows[n]["sqnr_db"] != plain_rows[n]["sqnr_db"] for n in rows if ".o_proj" in n or ".down_proj" in n)


def test_a_stage_changing_weights_after_a_true_sequential_one_is_refused(tiny_llama, tokenizer, tmp_path):
    """Its single forward makes the next layer's inputs: a later stage quantizing the same layer would
    leave them stale, so the recipe is refused, naming the stage and the fix."""
    recipe = tmp_path / "ts-then-rtn.yaml"
    recipe.write_text("""version: 1
name: ts-then-rtn
calibration: {dataset: sensesensibility, num_samples: 2, seq_len: 16}
stages:
  - algorithm: gptq
    scheme: {preset: W4A16, group_size: 32}
    targets: ["re:.*self_attn.*"]
    args: {true_sequential: true}
  - algorithm: rtn
    scheme: {preset: W4A16, group_size: 32}
    targets: ["re:.*mlp.*"]
""")
    with pytest.raises(QuantizationError, match="stage 0 \\(gptq\\) is true-sequential, but stage 1 \\(rtn\\)"):
        quantize_in_memory(tiny_llama, str(recipe), [], [sample_ids(tokenizer, 1, 16)])
    # the other way round (rtn first) is fine: the pass comes last in every layer
    text = recipe.read_text()
    gptq, rtn = text[text.index("  - algorithm: gptq"):text.index("  - algorithm: rtn")], text[text.index("  - algorithm: rtn"):]
    recipe.write_text(text[:text.index("  - algorithm: gptq")] + rtn + gptq)
    _, _, result, _, _ = quantize_in_memory(tiny_llama, str(recipe), [], [sample_ids(tokenizer, 1, 16)])
    assert len(result.layers) == 21
