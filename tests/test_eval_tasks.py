"""lm-eval adapter: its log-likelihoods are quantkit's token NLLs, its generations quantkit's runner's."""

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (quantkit[eval]); make install installs it")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

import quantkit  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.eval.likelihood import score  # noqa: E402
from quantkit.eval.ppl import window_nll  # noqa: E402
from quantkit.eval.tasks import QuantkitLM, shipped_config, task_list  # noqa: E402
from quantkit.runtime.generate import generate  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402

PAIRS = [("It is a truth universally acknowledged, that a single man", " in possession of a good fortune"),
         ("Emma Woodhouse, handsome, clever, and rich,", " seemed to unite"),
         ("She was the youngest", " of the two daughters"),
         ("", "Sir Walter Elliot, of Kellynch Hall")]


def instances(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def llama(tiny_llama, tokenizer):
    return quantkit.load(tiny_llama, dtype=torch.float32), tokenizer


def reference_logprob(model, ctx, cont):
    """Sum of log p(continuation) from transformers' own full logits, in float64."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
    pred = logp[len(ctx) - 1 :]
    target = torch.tensor(cont)
    return pred[torch.arange(len(cont)), target].sum().item(), bool((pred.argmax(-1) == target).all())


def test_loglikelihood_equals_the_models_own_token_logprobs(llama):
    model, tok = llama
    for batch in (1, 3):
        lm = QuantkitLM(model, tok, batch_size=batch)
        got = lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)
        for (ctx, cont), (ll, greedy) in zip(PAIRS, got):
            c, k = lm._encode_pair(ctx, cont) if ctx else ([lm.prefix_token_id], lm.tok_encode(cont, False))
            ref, ref_greedy = reference_logprob(model, c, k)
            assert ll == pytest.approx(ref, rel=1e-5, abs=1e-4) and greedy == ref_greedy
            assert ll < 0


def test_a_greedy_continuation_is_reported_greedy(llama):
    model, tok = llama
    ctx = tok.encode("It is a truth universally", add_special_tokens=False)
    out = generate(model, tok, ctx, SamplingParams(max_new_tokens=3, ignore_eos=True))
    (ll, greedy), = score(model, [(ctx, out.token_ids)], max_length=64)
    assert greedy and ll < 0


def test_rolling_loglikelihood_is_minus_quantkits_token_nll(llama):
    model, tok = llama
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition"
    lm = QuantkitLM(model, tok, max_length=256)
    (ll,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    ids = torch.tensor([[lm.prefix_token_id] + tok.encode(text, add_special_tokens=False)])
    nll, n = window_nll(model, ids)  # quantkit's perplexity evaluator on the same tokens
    assert ll == pytest.approx(-nll, rel=1e-5) and n == ids.shape[1] - 1


def test_rolling_over_many_windows_matches_full_logits(llama):
    model, tok = llama
    text = " ".join(["It is a truth universally acknowledged, that a single man in possession"] * 6)
    tokens = tok.encode(text, add_special_tokens=False)
    for batch in (1, 2):
        lm = QuantkitLM(model, tok, batch_size=batch, max_length=16)
        (ll,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, lm.prefix_token_id, 16, 1)]
        assert len(windows) > 3
        expected = sum(reference_logprob(model, c, k)[0] for c, k in windows)
        assert ll == pytest.approx(expected, rel=1e-5)


def test_generate_until_is_the_runner_with_stop_strings(llama):
    model, tok = llama
    lm = QuantkitLM(model, tok, batch_size=2)
    args = [("It is a truth universally", {"until": ["."], "max_gen_toks": 12, "do_sample": False}),
            ("Emma Woodhouse, handsome,", {"until": [",", "\n"], "max_gen_toks": 6}),
            ("She was", {"until": "e", "max_gen_toks": 5})]
    got = lm.generate_until(instances("generate_until", args), disable_tqdm=True)
    for (ctx, kw), text in zip(args, got):
        until = [kw["until"]] if isinstance(kw["until"], str) else kw["until"]
        want = generate(model, tok, tok.encode(ctx, add_special_tokens=False),
                        SamplingParams(max_new_tokens=kw["max_gen_toks"], stop=tuple(until))).text
        assert text == want and not any(s in text for s in until)


def test_gemma_contexts_start_with_bos(tiny_models, tokenizer):
    model = quantkit.load(tiny_models["gemma3_text"], dtype=torch.float32)
    lm = QuantkitLM(model, tokenizer, add_bos=True)
    assert lm.prefix_token_id == tokenizer.bos_token_id
    assert lm.tok_encode("She was")[0] == tokenizer.bos_token_id
    assert lm.tok_encode("She was", add_special_tokens=False)[0] != tokenizer.bos_token_id


def test_shipped_tasks_resolve_their_data_next_to_the_yaml():
    config = shipped_config("austen_cloze")
    path = config["dataset_kwargs"]["data_files"]["test"]
    assert path.startswith("/") and path.endswith("austen_cloze.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 200 and all(r["choices"][r["label"]] and len(r["choices"]) == 4 for r in rows)
    names = [t["task"] if isinstance(t, dict) else t for t in task_list(["austen", "hellaswag"])]
    assert names == ["austen_cloze", "austen_next_word", "austen_ppl", "hellaswag"]


def test_cli_runs_the_shipped_tasks_offline(tiny_llama, tmp_path):
    out = tmp_path / "t.json"
    res = CliRunner().invoke(main, ["eval", "tasks", str(tiny_llama), "--tasks", "austen", "--limit", "4",
                                    "--batch-size", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "austen_cloze" in res.output and "exact_match" in res.output and "word_perplexity" in res.output
    data = json.loads(out.read_text())["results"]
    assert 0.0 <= data["austen_cloze"]["acc,none"] <= 1.0
    assert data["austen_ppl"]["word_perplexity,none"] > 1.0


def test_an_unknown_task_is_refused_before_the_model_loads(tiny_llama, monkeypatch):
    import lm_eval.tasks

    import quantkit.checkpoints.loader as loader

    class Index:  # lm-eval's own index of ~15k tasks takes seconds to build: a stand-in with one
        def __init__(self, **kwargs):
            self.all_tasks = ["hellaswag"]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before the tasks were checked"))
    res = CliRunner().invoke(main, ["eval", "tasks", str(tiny_llama), "--tasks", "austen_clozee,hellaswag"])
    assert res.exit_code == 2 and "unknown task(s) austen_clozee:" in res.output and "hellaswag" not in \
        res.output.split("unknown task(s)")[1].split(":")[0]
