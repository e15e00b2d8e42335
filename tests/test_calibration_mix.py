"""The shipped calibration mix and evaluation set (provenance, disjointness, chat rendering), calibration from the
mix (shares, held-back windows), self-generated calibration, the per-domain check and per-language eval rows."""

import copy
import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantkit.calibration import mix
from quantkit.cli import main as cli
from quantkit.errors import CalibrationDataError
from quantkit.flow import domain_check, self_calibration
from quantkit.flow.recipe import load_recipe
from quantkit.flow.sources import calibration_batches, held_back_windows, mix_windows

LANGUAGES = {"en", "zh", "ja", "de", "fr", "es"}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _manifest(name):
    return json.loads(mix.collections()[name].read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["mix-v1", "eval-v1"])
def test_manifest_provenance_and_hashes(name):
    raw, coll = _manifest(name), mix.load_collection(name)
    assert raw["role"] == ("calibration" if name == "mix-v1" else "evaluation")
    assert {p.language for p in coll.parts} >= LANGUAGES | {"code", "multi"}
    assert {p.domain for p in coll.parts} == {"prose", "technical", "code", "chat"}
    for entry, part in zip(raw["parts"], coll.parts):
        assert hashlib.sha256(part.path.read_bytes()).hexdigest() == entry["sha256"] == part.sha256
        assert part.path.stat().st_size == entry["bytes"]
        source = entry["source"]
        assert source["package"] and source["license"] in ("GPL-2+", "PSF-2.0", "public domain") and source["version"]
        assert entry["documents"]
    if name == "mix-v1":
        assert sum(p.weight for p in coll.parts) == pytest.approx(1.0)
        assert all(p.weight > 0 for p in coll.parts)


def _paragraphs(part):
    if part.kind == "chat":
        return {m["content"] for d in mix.dialogues(part) for m in d if len(m["content"]) >= 40}
    return {p.strip() for p in mix.read_part(part).split("\n\n") if len(p.strip()) >= 40}


def test_evaluation_set_is_disjoint_from_the_mix():
    cal, ev = _manifest("mix-v1"), _manifest("eval-v1")
    cal_docs = {d["sha256"] for p in cal["parts"] for d in p["documents"] if "sha256" in d}
    ev_docs = {d["sha256"] for p in ev["parts"] for d in p["documents"] if "sha256" in d}
    assert cal_docs and ev_docs and not cal_docs & ev_docs
    names = lambda m: {(p["name"], d["document"]) for p in m["parts"] for d in p["documents"]}  # noqa: E731
    assert not names(cal) & names(ev)
    cal_paras = set().union(*(_paragraphs(p) for p in mix.load_collection("mix-v1").parts))
    for part in mix.load_collection("eval-v1").parts:
        shared = _paragraphs(part) & cal_paras
        assert not shared, (part.name, sorted(shared)[:2])


def test_parts_are_the_language_they_name():
    cjk = lambda s: sum("\u3040" <= c <= "\u9fff" for c in s) / max(len(s), 1)  # noqa: E731
    for name in ("mix-v1", "eval-v1"):
        coll = mix.load_collection(name)
        assert cjk(mix.read_part(coll.part("manual-zh"))) > 0.3 and cjk(mix.read_part(coll.part("manual-ja"))) > 0.3
        assert cjk(mix.read_part(coll.part("manual-de"))) == 0
        assert " der " in mix.read_part(coll.part("manual-de")) and " les " in mix.read_part(coll.part("manual-fr"))
        assert "def " in mix.read_part(coll.part("code-python"))
        langs = {json.loads(line)["language"] for line in coll.part("chat").path.read_text().splitlines()}
        assert langs == {"en", "zh", "ja", "de", "fr"}


def test_changed_part_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cal"
    shutil.copytree(mix.collections()["mix-v1"].parent, root / "mix-v1")
    shutil.copy(mix.CALIBRATION_DIR / "sensesensibility.txt", root / "sensesensibility.txt")
    monkeypatch.setattr(mix, "CALIBRATION_DIR", root)
    part = mix.load_collection("mix-v1").part("manual-de")
    assert mix.read_part(part)
    part.path.write_text(part.path.read_text() + "x")
    with pytest.raises(CalibrationDataError, match="manual-de.txt is not the file its manifest records"):
        mix.read_part(part)


def test_dialogues_through_the_chat_template(tokenizer):
    part = mix.load_collection("mix-v1").part("chat")
    first = mix.dialogues(part)[0]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
    plain, note = mix.part_text(part, tokenizer)
    assert note and "no chat template" in note
    assert plain.startswith(f"User: {first[0]['content']}\n\nAssistant: {first[1]['content'][:40]}")
    tok = copy.deepcopy(tokenizer)  # (the session's tokenizer keeps having no template)
    tok.chat_template = TEMPLATE
    text, note = mix.part_text(part, tok)
    assert note is None
    assert text.startswith(f"<|user|>{first[0]['content']}</s><|assistant|>{first[1]['content']}</s><|user|>")
    assert text.count("<|user|>") == 2 * len(mix.dialogues(part))


def test_allocation_and_shares():
    assert mix.allocate({"a": 0.5, "b": 0.3, "c": 0.2}, 7) == {"a": 4, "b": 2, "c": 1}
    assert mix.allocate({"a": 0.5, "b": 0.5, "c": 0.0}, 3) == {"a": 2, "b": 1, "c": 0}
    coll = mix.load_collection("mix-v1")
    counts = mix.allocate(mix.weights(coll), 64)
    assert sum(counts.values()) == 64 and all(c >= 4 for c in counts.values())
    assert mix.weights(coll, {"manual-zh": 3, "prose-en": 1}) == {**{n: 0.0 for n in coll.names()},
                                                                   "manual-zh": 0.75, "prose-en": 0.25}
    with pytest.raises(CalibrationDataError, match="calibration.mix names klingon"):
        mix.weights(coll, {"klingon": 1})
    with pytest.raises(CalibrationDataError, match="weight 0"):
        mix.weights(coll, {"chat": 0})


def test_calibration_windows_from_the_mix_and_held_back(tiny_llama, tokenizer):
    recipe = load_recipe("gptq-w4a16", ["calibration.num_samples=18", "calibration.seq_len=64",
                                        "calibration.batch_size=5"])
    batches = calibration_batches(tiny_llama, recipe, False, tokenizer)
    assert [b.shape for b in batches] == [(5, 64)] * 3 + [(3, 64)]
    per_part = mix_windows(recipe.calibration, tokenizer, None)
    expect = mix.allocate(mix.weights(mix.load_collection("mix-v1")), 18)
    assert {k: v.shape[0] for k, v in per_part.items()} == {k: c for k, c in expect.items() if c}
    assert torch.equal(torch.cat(list(per_part.values())), torch.cat(batches))
    held = held_back_windows(tiny_llama, recipe, False, tokenizer)
    assert set(held) == set(mix.load_collection("mix-v1").names()) and all(h.shape == (2, 64) for h in held.values())
    for name, windows in per_part.items():  # never a calibration window
        assert not any(torch.equal(w, c) for w in held[name] for c in windows)
    # shares: only the parts named get windows
    zh = load_recipe("gptq-w4a16", ["calibration.num_samples=4", "calibration.seq_len=64",
                                    "calibration.mix={manual-zh: 1}"])
    assert list(mix_windows(zh.calibration, tokenizer, None)) == ["manual-zh"]
    # a mix share for a dataset that is not a mix is refused
    bad = load_recipe("gptq-w4a16", ["calibration.dataset=emma", "calibration.mix={manual-zh: 1}"])
    with pytest.raises(Exception, match="calibration.mix sets shares"):
        calibration_batches(tiny_llama, bad, False, tokenizer)


def test_self_generation_is_reproducible(tiny_llama, tokenizer):
    from quantkit.checkpoints.loader import load

    model = load(tiny_llama, dtype=torch.float32)
    a = self_calibration.generate_windows(model, tokenizer, 5, 160, seed=0, bos=1)
    b = self_calibration.generate_windows(model, tokenizer, 5, 160, seed=0, bos=1)
    c = self_calibration.generate_windows(model, tokenizer, 5, 160, seed=1, bos=1)
    assert a.shape == (5, 160) and torch.equal(a, b) and not torch.equal(a, c)
    seeds = self_calibration.seed_order(5)
    for i in range(5):
        prompt = self_calibration.seed_ids(seeds[i], tokenizer, 1)
        assert a[i, : len(prompt)].tolist() == prompt and prompt[0] == 1
    # one window alone is the same window (its seed is its own, whatever else is in the batch)
    alone = self_calibration.generate_windows(model, tokenizer, 1, 160, seed=0, bos=1)
    assert torch.equal(alone[0], a[0])
    with pytest.raises(CalibrationDataError, match="leaves no room after a seed prompt"):
        self_calibration.generate_windows(model, tokenizer, 2, 8, seed=0, bos=None)


def test_self_seeds_follow_the_mix():
    from quantkit.calibration.mix import allocate, load_collection, weights

    shares = weights(load_collection("mix-v1"))
    seeds = self_calibration.seeds()
    assert {s["share"] for s in seeds} == set(shares)  # every part of the mix has a seed, every seed a part
    for n in (1, 7, 18, 64, 100):
        order = self_calibration.seed_order(n)
        counts = Counter(s["share"] for s in order)
        # within one window of the mix's own split, and any prefix is the same windows (num_samples-independent)
        assert all(abs(counts[p] - k) <= 1 for p, k in allocate(shares, n).items()), (n, counts)
        assert order == self_calibration.seed_order(100)[:n]
    first = self_calibration.seed_order(64)
    for part in shares:  # a part's seeds taken in turn
        mine = [s for s in seeds if s["share"] == part]
        used = [s for s in first if s["share"] == part]
        assert used == [mine[i % len(mine)] for i in range(len(used))]
    assert [s["share"] for s in self_calibration.seed_order(3)] == ["prose-en", "chat", "code-python"]
    bad = [{"share": "prose-xx", "prompt": "x", "chat": False}]
    with pytest.raises(CalibrationDataError, match="prose-xx"):
        self_calibration.seed_order(2, bad)


def test_rtn_counterpart():
    gptq = domain_check.rtn_counterpart(load_recipe("gptq-w4a16"))
    assert [s.algorithm for s in gptq.stages] == ["rtn"]
    assert gptq.resolved[0].scheme == load_recipe("rtn-w4a16").resolved[0].scheme
    awq = domain_check.rtn_counterpart(load_recipe("awq-w4a16-fp8kv"))
    assert [s.algorithm for s in awq.stages] == ["rtn"]
    q4 = domain_check.rtn_counterpart(load_recipe("gptq-q4_0"))
    assert q4.resolved[0].scheme.short() == load_recipe("gptq-q4_0").resolved[0].scheme.short()
    assert not domain_check.is_calibrated(load_recipe("rtn-w4a16")) and not domain_check.is_calibrated(gptq)
    assert domain_check.is_calibrated(load_recipe("gptq-w4a16")) and domain_check.is_calibrated(load_recipe("awq-w4a16"))


def test_warning_names_the_worse_parts():
    rows = [{"part": "prose-en", "kld": 0.01, "kld_rtn": 0.02}, {"part": "manual-zh", "kld": 0.05, "kld_rtn": 0.03}]
    message = domain_check.warning(rows, load_recipe("gptq-w4a16"))
    assert message.startswith("WARNING: gptq-w4a16 is worse than round-to-nearest on manual-zh (KLD 0.0500 against "
                              "0.0300)") and "prose-en" not in message
    assert domain_check.warning(rows[:1], load_recipe("gptq-w4a16")) is None


def test_quantize_checks_each_domain_and_warns_last(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "q"
    args = ["quantize", str(tiny_llama), "--recipe", "gptq-w4a16", "-o", str(out), "--no-progress",
            "--set", "calibration.num_samples=9", "--set", "calibration.seq_len=64",
            "--set", "stages.gptq.scheme.group_size=32"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "quantkit.json").read_text())["domain_check"]
    assert [r["part"] for r in rows] == mix.load_collection("mix-v1").names()
    assert all(r["windows"] == 2 and r["kld"] > 0 and r["kld_rtn"] > 0 for r in rows)
    assert "domain check (KLD on held-back calibration windows" in res.output
    # a part made worse than round-to-nearest: named in a warning, the last line of the run
    real = domain_check.compare

    def worse(models, held):
        got = real(models, held)
        got[2]["kld"] = got[2]["kld_rtn"] * 2
        return got

    monkeypatch.setattr(domain_check, "compare", worse)
    res = CliRunner().invoke(cli, args + ["--overwrite"])
    assert res.exit_code == 0, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith(f"WARNING: gptq-w4a16 is worse than round-to-nearest on {rows[2]['part']}"), last
    # no check when asked for none
    res = CliRunner().invoke(cli, args + ["--overwrite", "--set", "calibration.check_samples=0"])
    assert "domain_check" not in json.loads((out / "quantkit.json").read_text()) and "WARNING" not in res.output


def test_eval_prints_a_row_per_language_and_domain(tiny_llama, tmp_path):
    q = tmp_path / "rtn"
    res = CliRunner().invoke(cli, ["quantize", str(tiny_llama), "--recipe", "rtn-w4a16", "-o", str(q), "--no-progress",
                                   "--set", "stages.rtn.scheme.group_size=32"])
    assert res.exit_code == 0, res.output
    js = tmp_path / "e.json"
    res = CliRunner().invoke(cli, ["eval", str(q), "--original", str(tiny_llama), "--seq-len", "64", "--max-windows",
                                   "2", "--dtype", "float32", "--no-progress", "--json", str(js)])
    assert res.exit_code == 0, res.output
    names = mix.load_collection("eval-v1").names()
    table = res.output[res.output.index("per language and domain"):]
    for name in names:
        assert f"\n{name} " in table
    data = json.loads(js.read_text())
    facts = {d["name"]: (d["language"], d["domain"], d["windows"]) for d in data["protocol"]["datasets"]}
    assert facts["manual-zh"] == ("zh", "technical", 2) and facts["chat"] == ("multi", "chat", 2)
    klds = {r["dataset"]: r["kld_mean"] for r in data["results"] if r["role"] == "checkpoint"}
    worst = max(klds, key=klds.get)
    assert f"worst for {q}: {worst} (KLD {klds[worst]:.4f}" in res.output
    # one part alone, by its set's name
    res = CliRunner().invoke(cli, ["eval", str(q), "--original", str(tiny_llama), "--seq-len", "64", "--dataset",
                                   "eval-v1/manual-ja", "--no-progress"])
    assert res.exit_code == 0 and "[manual-ja]" in res.output and "per language" not in res.output


@pytest.mark.slow
def test_smollm2_gptq_on_the_mix_beats_rounding_on_every_domain(smollm2):
    """Real model: GPTQ calibrated on the mix (16 x 256 tokens) is closer to the original than round-to-nearest
    on held-back windows of every language and domain; the dialogues went through SmolLM2's chat template."""
    import quantkit

    notes = []
    _, record = quantkit.quantize(str(smollm2), "gptq-w4a16", overrides=["stages.0.scheme.group_size=64"],
                                  num_samples=16, seq_len=256, notify=notes.append)
    assert not any("no chat template" in n for n in notes)
    rows = record.domain_check
    assert [r["part"] for r in rows] == mix.load_collection("mix-v1").names()
    for r in rows:
        assert 0 < r["kld"] < r["kld_rtn"], r
    assert record.domain_warning is None


def test_counterpart_takes_the_runs_activation_scales(tiny_llama, tmp_path, monkeypatch):
    """NVFP4 W4A4: the round-to-nearest counterpart takes the run's activation global scales (from the model in
    memory or from its checkpoint) and then reads no calibration data; its weights are round-to-nearest's as
    calibrated; a recipe with AWQ gives none (its scales are for rescaled inputs)."""
    from quantkit.flow import job, sources
    from quantkit.flow.job import Options, run

    small = ["calibration.num_samples=4", "calibration.seq_len=32", "calibration.check_samples=0"]
    recipe = load_recipe("gptq-w4a16", [*small, "stages.0.scheme=NVFP4"])  # GPTQ alone onto NVFP4 W4A4
    ours, _ = run(str(tiny_llama), recipe, Options(dtype=torch.float32))
    scales = domain_check.run_scales(recipe, ours, None, tiny_llama)
    assert scales and all(name.endswith("_proj") and s.numel() == 1 for name, s in scales.items())
    run(str(tiny_llama), recipe, Options(output=tmp_path / "q", dtype=torch.float32))
    from_disk = domain_check.run_scales(recipe, None, tmp_path / "q", tiny_llama)
    assert from_disk.keys() == scales.keys()
    assert domain_check.run_scales(load_recipe("awq-w4a16"), ours, None, tiny_llama) is None
    assert domain_check.run_scales(load_recipe("nvfp4"), ours, None, tiny_llama) is None  # the shipped one has AWQ

    counterpart = domain_check.rtn_counterpart(recipe)
    calibrated, _ = run(str(tiny_llama), counterpart, Options(dtype=torch.float32))

    def no_data(*args, **kwargs):
        raise AssertionError("the counterpart read calibration data")

    monkeypatch.setattr(job, "calibration_batches", no_data)
    monkeypatch.setattr(sources, "calibration_batches", no_data)
    given, _ = run(str(tiny_llama), counterpart, Options(dtype=torch.float32, input_scales=scales))
    got = dict(given.named_buffers())
    for name, scale in scales.items():
        assert torch.equal(got[f"{name}.input_global_scale"], scale)
    mine, theirs = given.state_dict(), calibrated.state_dict()
    weights = [k for k in mine if not k.endswith("input_global_scale")]
    assert weights and all(torch.equal(mine[k], theirs[k]) for k in weights)
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine if k.endswith("input_global_scale"))
