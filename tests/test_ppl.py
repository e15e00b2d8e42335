"""Perplexity: windows, BOS handling, and agreement with transformers' own loss."""

import math

import pytest
import torch

import quantkit
from quantkit.errors import CalibrationDataError
from quantkit.eval import ppl as ppl_mod
from quantkit.eval.ppl import perplexity, windows


def test_windows_cut_and_bos():
    ids = torch.arange(10, 110)
    w = windows(ids, 10, None, None)
    assert w.shape == (10, 10) and torch.equal(w[1], torch.arange(20, 30))
    wb = windows(ids, 10, 3, bos_id=1)
    assert wb.shape == (3, 10) and (wb[:, 0] == 1).all() and torch.equal(wb[1, 1:], torch.arange(19, 28))
    with pytest.raises(CalibrationDataError, match="fewer than one window"):
        windows(torch.arange(5), 10, None, None)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_ppl_equals_exp_of_transformers_loss(arch, tiny_models, tokenizer, monkeypatch):
    model = quantkit.load(tiny_models[arch], dtype=torch.float32)
    text = (tiny_models[arch] / "tokenizer.json").read_text()[:20000]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(ppl_mod, "LOGIT_CHUNK", 7)  # exercise the chunked LM head
    res = perplexity(model, ids, seq_len=32, max_windows=5, bos_id=1)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows(ids, 32, 5, 1)]
    assert res.windows == 5 and res.tokens == 5 * 31
    assert res.ppl == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)
    assert 100 < res.ppl < 2000  # a random model over a 512-token vocabulary
