"""Every input checked where it enters (issue 49): ranges, config.json fields, lengths against the
model's context, non-finite weights wherever a model is loaded, comparisons of like with like, a
closed standard input, and no stack trace from the CLI for anything else. Each class holds the
reported cases and two or more of our own; every case failed (a traceback, a silent wrong answer or
an unclear message) before the checks existed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.cli import INTERNAL_ERROR, main
from quantkit.errors import ContextLengthError, IncompatibleModelsError

from helpers import sample_ids
from test_bad_input import copy_model, poison

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(res, *fragments: str) -> None:
    """Exit 2, every fragment in the message, no stack trace."""
    assert res.exit_code == 2, res.output
    for fragment in fragments:
        assert fragment in res.output, res.output
    assert "Traceback" not in res.output


# -- ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit, words", [
    ("-1", "use a fraction in (0, 1) or a whole number"),   # reported: reached lm-eval as a traceback
    ("1.5", "use a fraction in (0, 1) or a whole number"),  # ours: neither a fraction nor a count
    ("0", "use a fraction in (0, 1) or a whole number"),    # ours: no documents
    ("many", "is not a number"),
])
def test_eval_tasks_limit_is_a_fraction_or_a_count(tiny_llama, limit, words, monkeypatch):
    from quantkit.checkpoints import loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before --limit was checked"))
    refused(run("eval", "tasks", tiny_llama, "--tasks", "austen", "--limit", limit), "--limit", words)


@pytest.mark.parametrize("option", ["--presence-penalty", "--frequency-penalty"])
def test_additive_penalties_stay_in_openais_range(tiny_llama, option, monkeypatch):
    """A penalty of 1e308 ended a generation after two tokens as a normal stop (exit 0)."""
    from quantkit.checkpoints import loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before the option was checked"))
    refused(run("generate", tiny_llama, "hi", option, "1e308"), option, "-2<=x<=2")
    from quantkit.runtime.sampling import SamplingParams

    with pytest.raises(ValueError, match="presence_penalty must be in \\[-2, 2\\]"):
        SamplingParams(presence_penalty=3.0)


# -- config.json fields ---------------------------------------------------------------------------


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.update(hidden_size="five hundred"), "hidden_size is 'five hundred'; it must be a positive whole"),
    (lambda c: {k: c.pop(k) for k in list(c) if k not in ("model_type", "num_hidden_layers")},
     "hidden_size, num_attention_heads, vocab_size are missing"),  # reported: a 6.33B plan from Llama's defaults
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (lambda c: c.update(vocab_size=-5), "vocab_size is -5"),
    (lambda c: c.update(max_position_embeddings="4k"), "max_position_embeddings is '4k'"),
    (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers is True"),
    (lambda c: c.pop("intermediate_size"), "intermediate_size is missing"),
])
@pytest.mark.parametrize("command", ["plan", "generate", "eval"])
def test_config_fields_are_checked_before_use(tiny_llama, tmp_path, edit, words, command):
    bad = copy_model(tiny_llama, tmp_path / "bad", config=edit)
    args = {"plan": ["plan", bad, "--recipe", "rtn-w4a16"], "generate": ["generate", bad, "hi", "-n", "2"],
            "eval": ["eval", "ppl", bad, "--seq-len", "64", "--max-windows", "2"]}[command]
    refused(run(*args), words, str(bad / "config.json"))


def test_a_config_that_is_not_an_object_is_refused(tiny_llama, tmp_path):
    bad = copy_model(tiny_llama, tmp_path / "bad")
    (bad / "config.json").write_text("[1, 2, 3]")
    refused(run("plan", bad, "--recipe", "rtn-w4a16"), "expected a JSON object", "got list")


# -- lengths against the model's context ----------------------------------------------------------


def test_calibration_longer_than_the_context_is_refused(tiny_llama, tmp_path, tokenizer):
    """Reported: calibration.seq_len past the context calibrated on without a word."""
    seq = ["--set", "calibration.seq_len=513"]  # the tiny model's context is 512
    refused(run("quantize", tiny_llama, "--recipe", "gptq-w4a16", *seq, "-o", tmp_path / "q", "--no-progress"),
            "calibration.seq_len 513 is longer than the context", "(512 tokens)", "calibration.seq_len=512 or less")
    assert not (tmp_path / "q").exists()
    # ours: the plan says so too, and the Python API, for a recipe's length and for batches given as token ids
    refused(run("plan", tiny_llama, "--recipe", "gptq-w4a16", *seq), "calibration.seq_len 513")
    with pytest.raises(ContextLengthError, match="calibration.seq_len 600"):
        quantkit.quantize(str(tiny_llama), "gptq-w4a16", seq_len=600, num_samples=2)
    with pytest.raises(ContextLengthError, match="batches= of 520 is longer"):
        quantkit.quantize(str(tiny_llama), "gptq-w4a16", batches=[torch.zeros(1, 520, dtype=torch.long)])
    # a recipe without calibration has no length to check
    assert run("plan", tiny_llama, "--recipe", "rtn-w4a16", *seq).exit_code == 0


def test_eval_tasks_max_length_past_the_context_is_refused(tiny_llama, monkeypatch):
    from quantkit.checkpoints import loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before --max-length was checked"))
    refused(run("eval", "tasks", tiny_llama, "--tasks", "austen", "--max-length", "4096"),
            "--max-length 4096 is longer than the context", "--max-length 512 or less")


# -- non-finite weights, wherever a model is loaded -----------------------------------------------


def _poisoned_checkpoint(tiny_llama, tmp_path, key: str, value: float) -> Path:
    return copy_model(tiny_llama, tmp_path / "bad", poison(value, key))


@pytest.mark.parametrize("key", ["model.layers.1.mlp.down_proj.weight_scale", "model.norm.weight"])
def test_generate_refuses_nan_in_a_checkpoint(w4_checkpoint, tmp_path, key):
    """Reported: NaN in a weight_scale generated text anyway. Ours: NaN in a norm weight."""
    bad = Path(str(tmp_path / "bad"))
    import shutil

    shutil.copytree(w4_checkpoint, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors[key].view(-1)[:2] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    for args in (["generate", bad, "hi", "-n", "2"], ["eval", "ppl", bad, "--seq-len", "64", "--max-windows", "2"],
                 ["report", bad, "--original", w4_checkpoint, "-o", tmp_path / "r", "--seq-len", "64",
                  "--max-windows", "2"]):
        refused(run(*args), "NaN/Inf values in 1 tensor(s)", f"{key} (2 of", "the checkpoint is damaged")
    assert not (tmp_path / "r").exists()


def test_inf_in_an_fp8_scale_is_refused_naming_it(tiny_llama, tmp_path):
    """Ours: an FP8 checkpoint whose weight_scale holds Inf (eval would have printed a NaN row)."""
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    out = quantize(str(tiny_llama), load_recipe("fp8-dynamic"), tmp_path / "fp8", progress=False).output
    tensors = load_file(out / "model.safetensors")
    key = "model.layers.0.self_attn.o_proj.weight_scale"
    tensors[key].view(-1)[0] = float("inf")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(quantkit.errors.CheckpointError, match=f"{key} \\(1 of"):
        quantkit.load(out)
    refused(run("generate", out, "hi", "-n", "2"), key)


def test_quantize_still_offers_to_zero_a_non_finite_source(tiny_llama, tmp_path):
    bad = copy_model(tiny_llama, tmp_path / "bad", poison(float("nan")))
    res = run("quantize", bad, "--recipe", "rtn-w4a16", "-o", tmp_path / "q", "--zero-nonfinite", "--no-progress")
    assert res.exit_code == 0 and "replaced NaN/Inf with 0" in res.output, res.output


# -- like with like ---------------------------------------------------------------------------------


def _retokenized(tiny_llama, tmp_path, swap: bool) -> Path:
    """A copy whose tokenizer maps two frequent pieces to each other's ids (same vocabulary size)."""
    other = copy_model(tiny_llama, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "Ġthe", "Ġto"
    if swap:
        vocab[a], vocab[b] = vocab[b], vocab[a]
    else:  # another tokenizer: one merge fewer
        tok["model"]["merges"] = tok["model"]["merges"][:-50]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    return other


def test_eval_ppl_prints_no_delta_between_different_tokenizations(tiny_models, tmp_path):
    """Reported: a "+17320%" delta between two models that tokenize the text differently. Ours: a model that
    prepends BOS (Gemma) against one that does not, with the same tokenizer."""
    out = tmp_path / "p.json"
    res = run("eval", "ppl", tiny_models["llama"], tiny_models["gemma3_text"], "--seq-len", "64", "--max-windows", "2",
              "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    assert "n/a *" in res.output and "one prepends BOS, the other not" in res.output
    assert not re.search(r"[+-]\d+\.\d+%", res.output)  # no percentage printed
    row = json.loads(out.read_text())["results"][1]
    assert row["delta"] is None and row["delta_pct"] is None and "not comparable" in row["delta_note"]


def test_eval_ppl_no_delta_for_another_tokenizer(tiny_llama, tmp_path):
    other = _retokenized(tiny_llama, tmp_path, swap=False)
    res = run("eval", "ppl", tiny_llama, other, "--seq-len", "64", "--max-windows", "2", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "tokenizes the text differently" in res.output and "tokens against" in res.output
    same = run("eval", "ppl", tiny_llama, copy_model(tiny_llama, tmp_path / "same"), "--seq-len", "64",
               "--max-windows", "2", "--no-progress")
    assert "n/a" not in same.output and "+0.000" in same.output  # the same tokens: a delta, of zero


@pytest.mark.parametrize("which", ["vocabulary", "tokenizer"])
def test_a_draft_that_does_not_share_the_tokenizer_is_refused_before_loading(tiny_models, tiny_llama, tmp_path,
                                                                            monkeypatch, which):
    """Reported: the right message for another vocabulary, but as a traceback after the prompt was echoed. Ours:
    the same vocabulary size with other ids."""
    from quantkit.checkpoints import loader

    draft = tiny_models["qwen3"] if which == "vocabulary" else _retokenized(tiny_llama, tmp_path, swap=True)
    if which == "vocabulary":
        draft = copy_model(draft, tmp_path / "d", config=lambda c: c.update(vocab_size=c["vocab_size"] + 64))
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before the draft was checked"))
    res = run("generate", tiny_llama, "hello there", "--draft", draft)
    refused(res, f"--draft {draft}", "share the model's tokenizer")
    assert "hello there" not in res.output


def test_speculative_generate_names_the_mismatch(tiny_llama, tiny_models, tokenizer):
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.runtime.speculative import speculative_generate

    model = quantkit.load(tiny_llama, dtype=torch.float32)
    other = quantkit.load(tiny_models["qwen3"], dtype=torch.float32)
    other.resize_token_embeddings(other.config.vocab_size + 64)
    with pytest.raises(IncompatibleModelsError, match="vocabulary differs"):
        speculative_generate(model, other, tokenizer, sample_ids(tokenizer, 1, 5)[0].tolist(), SamplingParams(), 2)


# -- standard input closed --------------------------------------------------------------------------


def _cli(*args, stdin_closed: bool, timeout: int = 120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "quantkit", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=None if stdin_closed else subprocess.DEVNULL,
                          preexec_fn=(lambda: os.close(0)) if stdin_closed else None)


def test_chat_with_standard_input_closed_is_refused_before_loading(tiny_llama):
    """Reported: `chat 0<&-` raised RuntimeError (input(): lost sys.stdin) from the first prompt."""
    res = _cli("chat", tiny_llama, stdin_closed=True)
    assert res.returncode == 2 and "standard input, which is closed" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "compute" not in res.stderr  # nothing loaded


def test_generate_needs_no_standard_input(tiny_llama):
    """Ours: generate reads nothing from standard input, closed or empty."""
    for closed in (True, False):
        res = _cli("generate", tiny_llama, "hi", "-n", "3", stdin_closed=closed)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_chat_ends_cleanly_when_input_goes_away_mid_conversation(tiny_llama, monkeypatch):
    """Ours: standard input lost after the chat began (input() raises RuntimeError): the chat ends, exit 0."""
    monkeypatch.setattr("click.prompt", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("input(): lost sys.stdin")))
    from quantkit.cli import generate as gen

    monkeypatch.setattr(gen, "chat_ids", lambda tok, messages: [1, 2])
    res = CliRunner().invoke(main, ["chat", str(tiny_llama), "-n", "2"])
    assert res.exit_code == 0 and res.exception is None, res.output


# -- no stack traces --------------------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_and_a_saved_report(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    from quantkit.cli import plugins

    def broken(*a, **k):
        raise RuntimeError("something quantkit did not foresee")

    monkeypatch.setattr(plugins.command, "callback", broken)
    res = CliRunner().invoke(main, ["plugins"])
    assert res.exit_code == INTERNAL_ERROR == 70
    assert "Internal error: RuntimeError: something quantkit did not foresee" in res.output
    assert "Traceback" not in res.output
    (report,) = (tmp_path / "cache" / "crash-reports").iterdir()
    assert str(report) in res.output
    text = report.read_text()
    assert "Traceback" in text and "something quantkit did not foresee" in text and "quantkit" in text


# -- smaller messages -------------------------------------------------------------------------------


def test_an_empty_recipe_file_says_it_is_empty(tiny_llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# nothing yet\n")
    refused(run("quantize", tiny_llama, "--recipe", recipe, "-o", tmp_path / "q"), "the file is empty")


def test_clean_names_a_mistyped_directory(tmp_path):
    res = run("clean", tmp_path / "no-such-dir")
    assert res.exit_code == 2 and "does not exist" in res.output, res.output


def test_a_failed_cache_fill_leaves_no_lock_file(tmp_path):
    from quantkit.platform.paths import cache_entry_lock

    entry = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with cache_entry_lock(entry):
            raise RuntimeError("conversion failed")
    assert list(tmp_path.iterdir()) == []
    with cache_entry_lock(entry):  # a fill that succeeds keeps its lock file beside the entry, as before
        entry.mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "entry.lock"]


@pytest.fixture
def w4_checkpoint(tiny_llama, tmp_path_factory):
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    out = tmp_path_factory.mktemp("w4") / "q"
    return quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), out,
                    progress=False).output
