"""`quantkit eval`: KL divergence and top-1 agreement against the original, several texts in one pass."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import quantkit
from quantkit.cli import main
from quantkit.errors import CalibrationDataError, CheckpointError, ContextLengthError
from quantkit.eval import compare as compare_mod
from quantkit.eval.compare import evaluate, find_original, window_count
from quantkit.eval.divergence import Tally, kl_divergence, log_probs, percentile, token_nll, top1_same
from quantkit.eval.ppl import perplexity, windows
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---- the maths ---------------------------------------------------------------------------------

def test_kld_of_a_known_pair():
    # P = (1/4, 3/4), Q = (1/2, 1/2): KL(P||Q) = 1/4 ln(1/2) + 3/4 ln(3/2)
    p = torch.tensor([[math.log(0.25), math.log(0.75)]])
    q = torch.tensor([[math.log(0.5), math.log(0.5)]])
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(log_probs(p), log_probs(q)).item() == pytest.approx(expected, rel=1e-6)
    assert kl_divergence(log_probs(q), log_probs(p)).item() == pytest.approx(
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75), rel=1e-6)  # not symmetric
    assert kl_divergence(log_probs(p), log_probs(p)).item() == 0.0


def test_kld_nll_top1_match_float64_definitions():
    torch.manual_seed(0)
    ref_logits = torch.randn(50, 300) * 3
    logits = ref_logits + torch.randn(50, 300)  # a perturbed copy: some top-1s agree, some not
    targets = torch.randint(0, 300, (50,))
    ref, cand = log_probs(ref_logits), log_probs(logits)
    p64, q64 = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl64 = (p64.exp() * (p64 - q64)).sum(-1)
    assert torch.allclose(kl_divergence(ref, cand).double(), kl64, rtol=1e-4, atol=1e-6)
    assert torch.allclose(token_nll(cand, targets).double(), -q64[torch.arange(50), targets], atol=1e-5)
    same = top1_same(ref, cand)
    assert torch.equal(same, ref_logits.argmax(-1) == logits.argmax(-1)) and 0 < same.sum() < 50


def test_softcap_applies_before_the_softmax():
    x = torch.tensor([[10.0, 0.0, -10.0]])
    assert torch.allclose(log_probs(x, softcap=5.0), torch.log_softmax(torch.tanh(x / 5) * 5, -1))


def test_percentile_is_numpys_linear_interpolation():
    v = torch.rand(1001, generator=torch.Generator().manual_seed(1))
    for q in (0.0, 50.0, 99.0, 100.0):
        assert percentile(v, q) == pytest.approx(float(np.percentile(v.numpy().astype(np.float64), q)), rel=1e-12)
    assert percentile(torch.tensor([1.0, 2.0, 3.0, 4.0]), 99) == pytest.approx(3.97)


def test_tally_sums_over_chunks():
    t = Tally()
    t.add(torch.tensor([1.0, 2.0]), torch.tensor([0.1, 0.3]), torch.tensor([True, False]))
    t.add(torch.tensor([3.0]), torch.tensor([0.2]), torch.tensor([True]))
    s = t.summary()
    assert s["tokens"] == 3 and s["nll"] == pytest.approx(2.0) and s["ppl"] == pytest.approx(math.exp(2.0))
    assert s["kld_mean"] == pytest.approx(0.2) and s["kld_max"] == pytest.approx(0.3)
    assert s["top1_pct"] == pytest.approx(200 / 3)


def test_window_count_from_max_windows_and_max_tokens():
    assert window_count(100, None, None) is None
    assert window_count(100, 16, None) == 16
    assert window_count(100, 16, 550) == 5
    assert window_count(100, None, 550) == 5
    with pytest.raises(CalibrationDataError, match="less than one window"):
        window_count(100, None, 50)


# ---- against the models ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rtn_llama(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("evq") / "rtn"
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), out, progress=False)
    return out


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from quantkit.calibration.data import load_text

    root = tmp_path_factory.mktemp("evtext")
    a, b = root / "a.txt", root / "b.txt"
    a.write_text(load_text("emma")[:6000])
    b.write_text(load_text("persuasion")[:6000])
    return str(a), str(b)


def test_a_model_against_itself_has_zero_kld_and_full_agreement(tiny_llama, tmp_path, texts):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    res = evaluate(str(tiny_llama), [str(copy)], list(texts), seq_len=32, max_windows=4, dtype="float32")
    cand = [r for r in res.rows if r["role"] == "checkpoint"]
    assert len(cand) == 2 and {r["dataset"] for r in cand} == set(texts)
    for r in cand:
        assert r["kld_mean"] == 0.0 and r["kld_max"] == 0.0 and r["top1_pct"] == 100.0 and r["delta_ppl"] == 0.0


def test_ppl_equals_the_float32_evaluator_and_kld_the_full_logits(tiny_llama, rtn_llama, texts, tokenizer,
                                                                 monkeypatch):
    from quantkit.calibration.data import load_text, tokenize

    monkeypatch.setattr(compare_mod, "LOGIT_ELEMENTS", 512 * 7)  # 7 positions per chunk, across windows
    res = evaluate(str(tiny_llama), [str(rtn_llama)], list(texts), seq_len=32, max_windows=5, batch_size=2,
                   dtype="float32")
    ref_model = quantkit.load(tiny_llama, dtype=torch.float32)
    model = quantkit.load(rtn_llama, dtype=torch.float32)
    for name in texts:
        ids = tokenize(tokenizer, load_text(name))
        rows = {r["role"]: r for r in res.rows if r["dataset"] == name}
        assert rows["original"]["ppl"] == pytest.approx(perplexity(ref_model, ids, 32, 5).ppl, rel=1e-6)
        assert rows["checkpoint"]["ppl"] == pytest.approx(perplexity(model, ids, 32, 5).ppl, rel=1e-6)
        # KLD and top-1 from transformers' whole-window logits in float64
        w = windows(ids, 32, 5, None)
        with torch.no_grad():
            p = ref_model(input_ids=w).logits[:, :-1].double().log_softmax(-1)
            q = model(input_ids=w).logits[:, :-1].double().log_softmax(-1)
        kl = (p.exp() * (p - q)).sum(-1).flatten()
        same = (p.argmax(-1) == q.argmax(-1)).double().mean().item() * 100
        assert rows["checkpoint"]["kld_mean"] == pytest.approx(kl.mean().item(), rel=1e-3)
        assert rows["checkpoint"]["kld_p99"] == pytest.approx(float(np.percentile(kl.numpy(), 99)), rel=1e-3)
        assert rows["checkpoint"]["kld_mean"] > 1e-4 and rows["checkpoint"]["top1_pct"] == pytest.approx(same)
    assert [d["scored_tokens"] for d in res.protocol["datasets"]] == [5 * 31, 5 * 31]
    assert all(len(d["sha256"]) == 64 for d in res.protocol["datasets"]) and res.protocol["bos"] is False


def test_a_stride_scores_every_nth_position_of_each_window(tiny_llama, rtn_llama, tokenizer, monkeypatch):
    """score(stride=4) gives the stride-1 per-position values at positions 3, 7, ... of each window."""
    from quantkit.calibration.data import load_text, tokenize
    from quantkit.eval.compare import Text, score

    monkeypatch.setattr(compare_mod, "LOGIT_ELEMENTS", 512 * 5)  # chunks that cut across windows
    ids = tokenize(tokenizer, load_text("emma"))
    w = windows(ids, 32, 3, None)  # [3, 32]
    models = [quantkit.load(tiny_llama, dtype=torch.float32), quantkit.load(rtn_llama, dtype=torch.float32)]
    text = [Text("emma", "0" * 64, w.flatten(), w)]
    (full,), _ = score(models, text, batch_size=2)
    (sampled,), _ = score(models, text, batch_size=2, stride=4)
    expected = full[1].kld_values().reshape(3, 31)[:, 3::4].reshape(-1)
    assert expected.numel() == 3 * 7 and sampled[1].kld_values().numel() == 3 * 7
    torch.testing.assert_close(sampled[1].kld_values(), expected, rtol=1e-4, atol=2e-6)  # other chunks: float rounding
    assert float(expected.min()) > 0  # a real difference is being sampled, not zeros


def test_bos_windows_for_gemma(tiny_models, tmp_path, texts):
    copy = tmp_path / "g"
    shutil.copytree(tiny_models["gemma3_text"], copy)
    res = evaluate(str(tiny_models["gemma3_text"]), [str(copy)], [texts[0]], seq_len=32, max_windows=4,
                   dtype="float32")
    assert res.protocol["bos"] is True and res.protocol["bos_id"] == 1
    assert res.rows[1]["kld_mean"] == 0.0


def test_fp8_kv_cache_applies_to_the_checkpoints_not_the_reference(tiny_llama, tmp_path, texts, tokenizer):
    """--kv-cache-dtype fp8: the original stays the 16-bit reference (its row as without the flag), the
    checkpoint attends through its FP8 cache (its perplexity that of `eval ppl --kv-cache-dtype fp8`),
    so a KV-cache-only checkpoint, whose weights equal the original's, shows its divergence."""
    from quantkit.calibration.data import load_text, tokenize

    out = tmp_path / "kv"
    quantize(str(tiny_llama), load_recipe("fp8-kv", ["calibration.num_samples=6", "calibration.seq_len=32"]), out,
             progress=False)
    kw = dict(seq_len=32, max_windows=4, dtype="float32")
    plain = evaluate(str(tiny_llama), [str(out)], [texts[0]], **kw)
    fp8 = evaluate(str(tiny_llama), [str(out)], [texts[0]], kv_cache_dtype="fp8", **kw)
    assert plain.rows[1]["kld_mean"] == 0.0  # same weights, 16-bit cache: the same model
    assert fp8.rows[0]["ppl"] == plain.rows[0]["ppl"] and fp8.rows[0]["role"] == "original"
    assert fp8.rows[1]["kld_mean"] > 0 and fp8.rows[1]["ppl"] != plain.rows[1]["ppl"]
    ids = tokenize(tokenizer, load_text(texts[0]))
    ref = perplexity(quantkit.load(out, dtype=torch.float32), ids, 32, 4, kv_cache_dtype="fp8")
    assert fp8.rows[1]["ppl"] == pytest.approx(ref.ppl, rel=1e-6)
    assert fp8.protocol["kv_cache_dtype"].startswith("fp8")


def test_cli_default_subcommand_json_and_recorded_original(tiny_llama, rtn_llama, tmp_path, texts):
    out = tmp_path / "e.json"
    res = run("eval", rtn_llama, "--dataset", ",".join(texts), "--seq-len", 32, "--max-windows", 4, "--json", out,
              "--no-progress", "--dtype", "float32")
    assert res.exit_code == 0, res.output
    assert "recorded in" in res.output and "KLD p99" in res.output and "(original)" in res.output
    data = json.loads(out.read_text())
    assert data["protocol"]["seq_len"] == 32 and len(data["results"]) == 4
    assert data["models"][0]["role"] == "original" and Path(data["models"][0]["path"]).resolve() == tiny_llama.resolve()
    assert data["results"][1]["kld_mean"] > 0 and 0 <= data["results"][1]["top1_pct"] <= 100
    # `eval ppl` is still its own command
    res = run("eval", "ppl", tiny_llama, "--seq-len", 32, "--max-windows", 4, "--no-progress")
    assert res.exit_code == 0 and "KLD" not in res.output and "(baseline)" in res.output, res.output


def test_find_original():
    assert find_original(["a", "b"], "o") == ("o", ["a", "b"], "--original")
    assert find_original(["o", "a"])[:2] == ("o", ["a"])
    with pytest.raises(CheckpointError, match="--original"):
        find_original(["only"])


# ---- bad input: refused before any weights are read ---------------------------------------------

def test_bad_comparisons_are_refused_early(tiny_llama, rtn_llama, tmp_path, texts, tokenizer, monkeypatch):
    import quantkit.checkpoints.loader as loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("weights read before the checks"))
    with pytest.raises(CheckpointError, match="same model"):
        evaluate(str(tiny_llama), [str(tiny_llama)], [texts[0]], seq_len=32)
    with pytest.raises(CalibrationDataError, match="same text twice"):
        evaluate(str(tiny_llama), [str(rtn_llama)], [texts[0], texts[0]], seq_len=32)
    with pytest.raises(ContextLengthError, match="longer than the context"):
        evaluate(str(tiny_llama), [str(rtn_llama)], [texts[0]], seq_len=4096)
    with pytest.raises(CalibrationDataError, match="less than one window"):
        evaluate(str(tiny_llama), [str(rtn_llama)], [texts[0]], seq_len=32, max_tokens=20)
    # a checkpoint with another tokenizer (same vocabulary size, other ids)
    other = tmp_path / "other"
    shutil.copytree(rtn_llama, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    used = tokenizer(open(texts[0]).read()[:200], add_special_tokens=False)["input_ids"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[used[0]], by_id[next(i for i in used if i != used[0])]  # two tokens the text uses
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match="tokenizes .* differently"):
        evaluate(str(tiny_llama), [str(other)], [texts[0]], seq_len=32)
    # another vocabulary
    with pytest.raises(CheckpointError, match="vocabulary"):
        bigger = tmp_path / "bigger"
        shutil.copytree(tiny_llama, bigger)
        cfg = json.loads((bigger / "config.json").read_text())
        cfg["vocab_size"] += 1
        (bigger / "config.json").write_text(json.dumps(cfg))
        evaluate(str(tiny_llama), [str(bigger)], [texts[0]], seq_len=32)
    monkeypatch.setattr(compare_mod, "MEMORY_SHARE", 1e-9)
    with pytest.raises(CheckpointError, match="evaluate fewer checkpoints"):
        evaluate(str(tiny_llama), [str(rtn_llama)], [texts[0]], seq_len=32)
