"""Calibration data: sources, deterministic non-overlapping chunks, clear errors."""

import json

import pytest
import torch

from quantkit.calibration.data import load_text, make_chunks, shipped_texts, tokenize
from quantkit.errors import CalibrationDataError


def test_shipped_texts_present():
    names = shipped_texts()
    assert {"sensesensibility", "prideprejudice", "emma", "persuasion"} <= set(names)
    assert "Elinor" in load_text("sensesensibility")


def test_chunks_deterministic_and_non_overlapping():
    ids = torch.arange(10_000)
    a = make_chunks(ids, 8, 100, seed=0)
    b = make_chunks(ids, 8, 100, seed=0)
    c = make_chunks(ids, 8, 100, seed=1)
    assert a.shape == (8, 100) and torch.equal(a, b) and not torch.equal(a, c)
    starts = a[:, 0]
    assert (starts % 100 == 0).all() and len(set(starts.tolist())) == 8
    assert all(torch.equal(row, torch.arange(row[0], row[0] + 100)) for row in a)


def test_chunks_with_bos():
    chunks = make_chunks(torch.arange(5, 1000), 4, 50, seed=0, bos_id=1)
    assert chunks.shape == (4, 50) and (chunks[:, 0] == 1).all() and (chunks[:, 1:] >= 5).all()


def test_short_text_error_names_both_numbers():
    with pytest.raises(CalibrationDataError) as exc:
        make_chunks(torch.arange(1000), 64, 512, seed=0, label="tiny.txt")
    msg = str(exc.value)
    assert "1000 tokens" in msg and "64 were asked for" in msg and "32768" in msg and "tiny.txt" in msg


def test_local_txt_jsonl_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    assert load_text(str(tmp_path / "a.txt")) == "plain text"
    rows = [{"text": "first doc"}, {"text": "second doc"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text(str(tmp_path / "a.jsonl")) == "first doc\n\nsecond doc"
    import datasets

    datasets.Dataset.from_list([{"body": "x y"}, {"body": "z"}]).to_parquet(str(tmp_path / "a.parquet"))
    assert load_text(str(tmp_path / "a.parquet"), text_column="body") == "x y\n\nz"
    with pytest.raises(CalibrationDataError, match="no column 'text'.*columns: body"):
        load_text(str(tmp_path / "a.parquet"))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(CalibrationDataError, match="does not exist"):
        load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(CalibrationDataError, match="unsupported type '.csv'"):
        load_text(str(tmp_path / "x.csv"))


def test_hub_dataset_offline_is_clear():
    with pytest.raises(CalibrationDataError, match="could not be loaded"):
        load_text("someorg/some-dataset-that-is-not-here")


def test_tokenize_adds_no_special_tokens(tokenizer):
    ids = tokenize(tokenizer, "Hello there")
    assert tokenizer.bos_token_id not in ids.tolist() and ids.dtype == torch.long


def test_tokenize_keeps_ids_per_text_and_tokenizer_state(tokenizer):
    """The per-process cache of tokenized texts gives the ids a fresh encoding gives, is keyed by the text
    and the tokenizer's whole state (an added token changes the ids, and so the key), and hands out copies."""
    import copy

    from quantkit.calibration import data

    data._tokenized.clear()
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    fresh = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    first = data.tokenize(tokenizer, text)
    assert torch.equal(first, fresh) and len(data._tokenized) == 1
    first[0] = -1  # a caller changing its ids changes nothing kept
    assert torch.equal(data.tokenize(tokenizer, text), fresh) and len(data._tokenized) == 1
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["universally"])
    got = data.tokenize(other, text)
    assert len(data._tokenized) == 2 and not torch.equal(got, fresh)
    assert torch.equal(got, torch.tensor(other(text, add_special_tokens=False)["input_ids"]))
    assert torch.equal(data.tokenize(tokenizer, text + " "), torch.tensor(tokenizer(text + " ", add_special_tokens=False)["input_ids"]))
    assert len(data._tokenized) == 3
