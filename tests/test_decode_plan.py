"""The decode plan (`runtime.decode_plan`): its choice for every combination of measured figures (faked
timings), its cache (machine, torch version, layer kind), measuring again, the loader's use of it, and
the rule it serves: no kernel narrower than the compute dtype unless chosen and said, so a model
quantized in memory and the same model reloaded compute the same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import quantkit
from quantkit.kernels import cpu_int4, native
from quantkit.platform import compute
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.runtime import decode_plan
from quantkit.runtime.decode_plan import CHUNK_TOKENS, Candidate, KindInfo, LayerKind, Route
from quantkit.quant.schemes import QuantScheme

from helpers import sample_ids

F32, BF16 = torch.float32, torch.bfloat16
HEAD = LayerKind("dense", 512, 64)
INT4 = LayerKind("int4", 128, 64, "int4 sym g32 bfloat16 scales")


@pytest.fixture(autouse=True)
def _native_int4(monkeypatch):
    """The decision tests below see the routes of a CPU without quantkit's native int4 GEMV unless a test
    turns it on (`native_on`): the figures they fake do not depend on this machine."""
    monkeypatch.setattr(cpu_int4, "native_reason", lambda: "off in this test")


def native_on(monkeypatch):
    monkeypatch.setattr(cpu_int4, "native_reason", lambda: None)


def _kinds(*kinds: LayerKind) -> dict[LayerKind, KindInfo]:
    return {k: KindInfo(1 if k.family == "dense" else 10, lambda rows: None) for k in kinds}


class FakeTimer:
    """Seconds from a table keyed by (family, route key, tokens); remembers what it was asked."""

    def __init__(self, table: dict):
        self.table, self.asked, self.kinds = table, [], set()

    def __call__(self, kind, info, route, tokens):
        self.asked.append((kind.family, route.key(), tokens))
        self.kinds.add(kind)
        return self.table[kind.family, route.key(), tokens]


def _table(dense_f32=10.0, dense_bf16=10.0, op_f32=100.0, op_bf16=1.0, op_narrow=1.0, dq_f32=50.0, dq_bf16=50.0,
           chunks=None):
    """One-token figures (and, per chunk, op vs dequantize figures for every int4 route)."""
    t = {("dense", "gemv float32", 1): dense_f32, ("dense", "gemv bfloat16", 1): dense_bf16,
         ("int4", "int4-op float32", 1): op_f32, ("int4", "int4-op bfloat16", 1): op_bf16,
         ("int4", "int4-op bfloat16 from float32", 1): op_narrow,
         ("int4", "dequant float32", 1): dq_f32, ("int4", "dequant bfloat16", 1): dq_bf16}
    for tokens in CHUNK_TOKENS:
        op, dq = (chunks or {}).get(tokens, (1.0, 2.0))
        for key in ("int4-op float32", "int4-op bfloat16", "int4-op bfloat16 from float32"):
            t["int4", key, tokens] = op
        for key in ("dequant float32", "dequant bfloat16"):
            t["int4", key, tokens] = dq
    return t


def _choose(table, dtypes=(F32, BF16), narrowing=True, tmp_path=None, kinds=(HEAD, INT4), **kw):
    timer = FakeTimer(table)
    cache = (tmp_path / "probe.json") if tmp_path else None
    if cache is None:  # every figure measured afresh, nothing cached
        kw.setdefault("remeasure", True)
    plan = decode_plan.choose(_kinds(*kinds), dtypes, narrowing=narrowing, timer=timer, cache_file=cache, **kw)
    return plan, timer


# -- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("figures, expected", [
    (dict(), Candidate(BF16, BF16)),                                   # bf16 op fast, dense at parity
    (dict(dense_bf16=30.0, op_bf16=1.0, op_narrow=1.0, op_f32=1.0), Candidate(F32, F32)),  # exact f32 wins
    (dict(dense_bf16=30.0, op_narrow=1.0, op_f32=100.0), Candidate(F32, BF16)),  # narrowed: 20 vs 30+10
    # narrowed 20 against exact bf16 22: faster, but not by NARROW_MIN_GAIN (20 x 1.1 = 22) -> the exact plan
    (dict(dense_bf16=12.0, op_bf16=1.0, op_narrow=1.0), Candidate(BF16, BF16)),
    (dict(dense_bf16=12.0, op_bf16=1.0, op_narrow=0.9), Candidate(F32, BF16)),  # 19 x 1.1 < 22: narrowed
])
def test_the_fastest_plan_wins_and_narrowing_needs_a_clear_margin(figures, expected, tmp_path):
    plan, _ = _choose(_table(**figures))
    assert plan.choice == expected
    best_exact = min(s for c, s in plan.step_seconds.items() if not c.narrowed)
    if expected.narrowed:
        assert plan.step_seconds[expected] * decode_plan.NARROW_MIN_GAIN < best_exact
        assert "float32 (int4 layers' activations in bfloat16)" in plan.describe()
    else:
        assert plan.step_seconds[expected] == best_exact
    # the estimate: the head once, the int4 kind 10 times, each by its fastest route under the candidate
    assert plan.step_seconds[Candidate(BF16, BF16)] == pytest.approx(
        _table(**figures)["dense", "gemv bfloat16", 1]
        + 10 * min(_table(**figures)["int4", k, 1] for k in ("int4-op bfloat16", "dequant bfloat16")))


def test_no_narrowing_when_the_dtype_was_asked_for_or_a_float32_checkpoint_allows_only_float32():
    fast_narrow = _table(dense_bf16=30.0, op_narrow=1.0, op_f32=100.0)
    asked, _ = _choose(fast_narrow, dtypes=(F32,), narrowing=False)
    assert asked.choice == Candidate(F32, F32) and set(asked.step_seconds) == {Candidate(F32, F32)}
    assert asked.routes[INT4] == Route("dequant", F32)  # the exact float32 op (100) loses to dequantizing (50)
    f32_ckpt, timer = _choose(fast_narrow, dtypes=(F32,))
    assert f32_ckpt.choice == Candidate(F32, BF16)  # a float32 checkpoint: bf16 is only offered narrowed, and said
    assert not any("bfloat16" in key and "from" not in key for _, key, _ in timer.asked)


def test_a_model_without_int4_layers_is_never_narrowed():
    plan, _ = _choose(_table(dense_bf16=30.0), kinds=(HEAD,))
    assert set(plan.step_seconds) == {Candidate(F32, F32), Candidate(BF16, BF16)}
    assert plan.choice == Candidate(F32, F32) and plan.op_tokens == {}


@pytest.mark.parametrize("chunks, op_wins_at_one, limit, timed", [
    ({16: (1, 2), 64: (3, 2)}, True, 32, [16, 32, 64]),      # the op loses at 64: prompts up to 32 tokens on it
    ({16: (1, 2), 32: (3, 2)}, True, 16, [16, 32]),          # loses at 32: up to 16
    ({16: (3, 2)}, True, 1, [16]),                            # loses at the first chunk: one token only
    ({}, True, CHUNK_TOKENS[-1], list(CHUNK_TOKENS)),        # wins at every chunk
    ({}, False, 0, []),                                       # dequantizing wins at one token: never the op
])
def test_prompt_lengths_that_run_the_int4_op_come_from_the_chunk_timings(chunks, op_wins_at_one, limit, timed):
    op = 1.0 if op_wins_at_one else 60.0
    table = _table(chunks=chunks, op_bf16=op, op_narrow=op, dq_f32=80.0)
    plan, timer = _choose(table)
    assert plan.choice == Candidate(BF16, BF16)
    assert plan.op_tokens == {INT4: limit}
    assert plan.routes[INT4].kernel == ("int4-op" if op_wins_at_one else "dequant")
    assert sorted({t for fam, _, t in timer.asked if fam == "int4" and t > 1}) == timed


def test_the_table_marks_what_runs():
    plan, _ = _choose(_table(chunks={64: (3, 2)}))
    rows = {tuple(c.strip() for c in row.strip("|").split("|")) for row in plan.table()[2:]}
    assert ("int4 128x64 int4 sym g32 bfloat16 scales", "10", "int4-op bfloat16", "16", "1000000", "yes") in rows
    assert ("int4 128x64 int4 sym g32 bfloat16 scales", "10", "dequant bfloat16", "64", "2000000", "yes") in rows
    assert ("dense 512x64", "1", "gemv float32", "1", "10000000", "") in rows


def test_the_native_one_token_gemv_is_a_route_where_it_runs_and_wins_only_when_faster(monkeypatch):
    native_on(monkeypatch)
    assert [r.kernel for r in decode_plan.routes(INT4, Candidate(BF16, BF16))] == ["int4-op", "dequant", "native"]
    assert [r.kernel for r in decode_plan.routes(INT4, Candidate(F32, F32))] == ["int4-op", "dequant"]  # bf16 only
    table = {**_table(dense_f32=30.0, chunks={64: (3, 2)}), ("int4", "native bfloat16", 1): 0.5,
             ("int4", "native bfloat16 from float32", 1): 0.5}
    plan, _ = _choose(table)
    assert plan.choice == Candidate(BF16, BF16) and plan.routes[INT4] == Route("native", BF16, BF16)
    assert plan.op_tokens[INT4] == 32  # prompts: still the op up to the chunk it wins (the native GEMV is one token)
    rows = {tuple(c.strip() for c in row.strip("|").split("|")) for row in plan.table()[2:]}
    assert ("int4 128x64 int4 sym g32 bfloat16 scales", "10", "native bfloat16", "1", "500000", "yes") in rows
    assert ("int4 128x64 int4 sym g32 bfloat16 scales", "10", "int4-op bfloat16", "1", "1000000", "") in rows
    assert ("int4 128x64 int4 sym g32 bfloat16 scales", "10", "int4-op bfloat16", "16", "1000000", "yes") in rows
    slower = {**table, ("int4", "native bfloat16", 1): 2.0, ("int4", "native bfloat16 from float32", 1): 2.0}
    assert _choose(slower)[0].routes[INT4] == Route("int4-op", BF16, BF16)


# -- the cache ------------------------------------------------------------------------------------


def test_figures_are_cached_per_machine_torch_version_and_kind(tmp_path, monkeypatch):
    table = _table()
    first, timer = _choose(table, tmp_path=tmp_path)
    assert timer.asked
    cached = json.loads((tmp_path / "probe.json").read_text())
    assert len(cached) == len(timer.asked)
    key = next(k for k in cached if "int4-op bfloat16|1 tokens" in k)
    assert key.startswith("decode int4 128x64 int4 sym g32 bfloat16 scales|") and key.endswith(compute._machine_key())
    assert f"torch {torch.__version__}" in key
    again, timer2 = _choose(table, tmp_path=tmp_path)
    assert timer2.asked == [] and again.choice == first.choice and again.op_tokens == first.op_tokens
    # another kind is measured; the known one is not
    other = LayerKind("int4", 256, 64, "int4 sym g32 bfloat16 scales")
    _, timer3 = _choose(table, tmp_path=tmp_path, kinds=(HEAD, INT4, other))
    assert timer3.kinds == {other}
    # another machine (or torch version: both are in the key) measures everything again
    monkeypatch.setattr(compute, "_machine_key", lambda: "x86_64|Another CPU|torch 0.0")
    _, timer4 = _choose(table, tmp_path=tmp_path)
    assert len(timer4.asked) == len(timer.asked)


def test_remeasure_times_everything_again_and_replaces_the_cache(tmp_path):
    _choose(_table(), tmp_path=tmp_path)
    slower = {k: v * 3 for k, v in _table().items()}
    plan, timer = _choose(slower, tmp_path=tmp_path, remeasure=True)
    assert timer.asked and plan.figures[INT4, Route("int4-op", BF16, BF16), 1] == 3.0
    again, timer2 = _choose(_table(), tmp_path=tmp_path)
    assert timer2.asked == [] and again.figures[INT4, Route("int4-op", BF16, BF16), 1] == 3.0


def test_a_damaged_figure_is_measured_again(tmp_path):
    _choose(_table(), tmp_path=tmp_path)
    cache = tmp_path / "probe.json"
    entries = json.loads(cache.read_text())
    key = next(k for k in entries if "int4-op bfloat16|1 tokens" in k)
    cache.write_text(json.dumps({**entries, key: "fast"}))
    _, timer = _choose(_table(), tmp_path=tmp_path)
    assert timer.asked == [("int4", "int4-op bfloat16", 1)]


def test_the_real_timer_measures_a_same_kind_module_by_each_route():
    """The default timer on a small int4 kind: every route runs and gives a positive time (no speed asserted)."""
    scheme = QuantScheme(num_bits=4, group_size=32)
    kinds = decode_plan.layer_kinds([PackedIntLinear(64, 128, False, scheme, BF16), nn.Linear(64, 96, bias=False)])
    assert {k.family for k in kinds} == {"int4", "dense"}
    int4 = next(k for k in kinds if k.family == "int4")
    for route in decode_plan.routes(int4, Candidate(F32, BF16)) + decode_plan.routes(int4, Candidate(BF16, BF16)):
        assert decode_plan.measure(int4, kinds[int4], route, 1) > 0
    dense = next(k for k in kinds if k.family == "dense")
    assert decode_plan.measure(dense, kinds[dense], Route("gemv", BF16), 4) > 0


# -- the loader -----------------------------------------------------------------------------------


@pytest.fixture
def w4_checkpoint(tiny_llama, tmp_path_factory):
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    out = tmp_path_factory.mktemp("w4") / "q"
    return quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), out,
                    progress=False).output


def _fake_plan(monkeypatch, table):
    real = decode_plan.choose
    monkeypatch.setattr(decode_plan, "choose", lambda kinds, dtypes, **kw: real(
        kinds, dtypes, **{**kw, "timer": FakeTimer(table), "remeasure": True, "cache_file": None}))


def test_loading_for_decode_follows_the_plan_and_says_why(w4_checkpoint, monkeypatch):
    monkeypatch.delenv(compute.ENV, raising=False)
    _fake_plan(monkeypatch, _table(dense_bf16=30.0, op_narrow=1.0, op_f32=100.0, chunks={64: (3, 2)}))
    model = quantkit.load(w4_checkpoint, workload="decode")
    assert model.dtype == F32 and model.quantkit_decode_plan.choice == Candidate(F32, BF16)
    line = model.quantkit_compute.describe()
    assert "decode plan measured here" in line and line.endswith("float32 (int4 layers' activations in bfloat16)")
    linears = [m for m in model.modules() if isinstance(m, PackedIntLinear)]
    assert linears and {(m.op_dtype, m.op_tokens, m.kernel) for m in linears} == {(BF16, 32, "cpu")}
    # the batch workload (eval) plans nothing: the op in the input's dtype, as a model quantized in memory has it
    batch = quantkit.load(w4_checkpoint)
    assert batch.quantkit_decode_plan is None
    assert {(m.op_dtype, m.op_tokens) for m in batch.modules() if isinstance(m, PackedIntLinear)} == {(None, 160)}


def test_a_dtype_asked_for_keeps_its_dtype_and_exact_kernels(w4_checkpoint, monkeypatch):
    _fake_plan(monkeypatch, _table(dense_bf16=30.0, op_narrow=1.0, op_f32=100.0))
    model = quantkit.load(w4_checkpoint, dtype="float32", workload="decode")
    assert model.dtype == F32 and model.quantkit_decode_plan.choice == Candidate(F32, F32)
    assert "dtype=float32" in model.quantkit_compute.describe()
    # the exact float32 op (100) loses to dequantizing (50): no repacked copy, the dequantize path
    assert {(m.op_tokens, m.kernel) for m in model.modules() if isinstance(m, PackedIntLinear)} == {(0, "torch")}


def test_a_model_too_big_for_float32_is_planned_in_its_own_dtype_only(w4_checkpoint, monkeypatch):
    from quantkit.checkpoints import loader

    monkeypatch.delenv(compute.ENV, raising=False)
    monkeypatch.setattr(loader, "_fits_in_float32", lambda path: False)
    _fake_plan(monkeypatch, _table(dense_bf16=30.0, op_narrow=1.0, op_f32=100.0))
    model = quantkit.load(w4_checkpoint, workload="decode")
    assert model.dtype == BF16 and set(model.quantkit_decode_plan.step_seconds) == {Candidate(BF16, BF16)}


def _mapped_from(path, tensor) -> bool:
    """Whether `tensor`'s memory lies in a mapping of a file under `path` (/proc/self/maps)."""
    ptr = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        start, end = (int(v, 16) for v in span.split("-"))
        if start <= ptr < end:
            return bool(rest) and rest[-1].startswith(str(path))
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_model_loaded_to_decode_owns_its_weights(tiny_llama):
    """Eval's batch workload reads weights from the mapped checkpoint; decode copies them into its own memory."""
    batch = quantkit.load(tiny_llama, dtype=BF16)
    decode = quantkit.load(tiny_llama, dtype=BF16, workload="decode")
    name = "model.layers.0.mlp.down_proj.weight"
    weights = [dict(m.named_parameters())[name] for m in (batch, decode)]
    assert _mapped_from(tiny_llama, weights[0]) and not _mapped_from(tiny_llama, weights[1])
    assert torch.equal(weights[0], weights[1])


def test_doctor_prints_the_table(w4_checkpoint, monkeypatch):
    from click.testing import CliRunner

    from quantkit.cli import main

    _fake_plan(monkeypatch, _table())
    result = CliRunner().invoke(main, ["doctor", str(w4_checkpoint), "--no-bandwidth"])
    assert result.exit_code == 0, result.output
    assert "capability" in result.output and "decode plan measured here" in result.output
    assert "| layer kind | count | route | tokens | us per call | used |" in result.output
    assert "int4 prompts:" in result.output
    # what the native kernels can do here (this module's tests see no native int4 GEMV: `_native_int4`)
    line = next(row for row in result.output.splitlines() if row.startswith("native CPU kernels:"))
    assert ("not in use" in line) if native.module() is None else \
        line.startswith("native CPU kernels: bf16 GEMV; no int4 GEMV (off in this test)")


# -- in memory and reloaded: the same kernels, the same logits ------------------------------------


@pytest.mark.parametrize("recipe, overrides", [
    ("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
    ("rtn-w8a16", []),
    ("fp8-dynamic", []),
])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("policy", ["native", "AVX2"])
def test_a_model_reloaded_computes_what_it_computed_in_memory(tiny_llama, tokenizer, tmp_path, monkeypatch,
                                                              recipe, overrides, dtype, policy):
    """Also with the policy choosing as on an AVX2 CPU (bf16 then runs its GEMMs widened, in memory and reloaded)."""
    monkeypatch.delenv("QUANTKIT_KERNEL", raising=False)
    if policy == "AVX2":
        monkeypatch.setattr(compute, "cpu_features", lambda: compute.CpuFeatures("AVX2", True))
    source = quantkit.load(tiny_llama, dtype=dtype)
    model, _ = quantkit.quantize(source, recipe, overrides=overrides, tokenizer=tokenizer, dtype=dtype)
    ids = sample_ids(tokenizer, 2, 20)
    with torch.no_grad():
        before = model(ids).logits
    path = quantkit.save(model, tmp_path / "q")
    # the kernels chosen automatically, as in memory; a float32 checkpoint with the dtype chosen automatically too
    # (a bf16 one may be computed in float32 on some CPUs, so it is asked for)
    reloaded = quantkit.load(path, dtype=None if dtype == F32 else dtype)
    with torch.no_grad():
        after = reloaded(ids).logits
    assert after.dtype == before.dtype == dtype
    assert torch.equal(after, before)


def test_a_16_bit_dense_figure_is_kept_per_gemv_implementation(tmp_path, monkeypatch):
    """The dense GEMV a figure timed is the one the one-token probe chose: another choice (e.g. the native
    GEMV built or turned off) is timed again; a native build's figures carry its build key."""
    monkeypatch.setattr(compute, "gemv_impl", lambda dtype: "mv")
    monkeypatch.setattr(native, "build_id", lambda flags=native.FLAGS: "build-a")
    _, timer = _choose(_table(), tmp_path=tmp_path)
    keys = json.loads((tmp_path / "probe.json").read_text())
    assert any(k.startswith("decode dense 512x64|gemv bfloat16 by mv|1 tokens|") for k in keys)
    monkeypatch.setattr(compute, "gemv_impl", lambda dtype: "native")
    _, again = _choose(_table(), tmp_path=tmp_path)
    assert ("dense", "gemv bfloat16", 1) in again.asked and ("dense", "gemv float32", 1) not in again.asked
    keys = json.loads((tmp_path / "probe.json").read_text())
    assert any(k.startswith("decode dense 512x64|gemv bfloat16 by native|") and k.endswith("|native build-a")
               for k in keys)
