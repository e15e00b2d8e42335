"""Text sources (shipped names, local .txt/.jsonl/.parquet, hub datasets) and seeded token chunks."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from quantkit.errors import CalibrationDataError
from quantkit.platform.paths import CALIBRATION_DIR, EVAL_DATA_DIR

LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def shipped_texts() -> dict[str, Path]:
    """Texts shipped with quantkit, by name: calibration_data/*.txt and evals/data/*.txt."""
    return {p.stem: p for d in (CALIBRATION_DIR, EVAL_DATA_DIR) for p in sorted(d.glob("*.txt"))}


def read_text_file(path: Path, encoding: str = "utf-8") -> str:
    """A text file's contents; binary data, an unknown encoding or a decoding error is a clear error
    naming the file (and the byte offset) and the fix."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CalibrationDataError(f"text file {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    if b"\x00" in data[:65536] and not encoding.lower().replace("-", "").startswith(("utf16", "utf32")):
        at = data.index(b"\x00")
        raise CalibrationDataError(f"text file {str(path)!r} holds binary data (a NUL byte at offset {at}), not text; "
                                   "pass a plain-text file")
    try:
        return data.decode(encoding)
    except LookupError:
        raise CalibrationDataError(f"text file {str(path)!r}: unknown encoding {encoding!r}; use e.g. utf-8, "
                                   "latin-1, cp1252") from None
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 4]
        raise CalibrationDataError(
            f"text file {str(path)!r} is not valid {encoding}: byte {exc.start} ({bad!r}) cannot be decoded; "
            f"give its encoding (--encoding, or calibration.encoding in a recipe; e.g. latin-1 or cp1252) "
            f"or convert it to UTF-8 (iconv -f latin1 -t utf-8)") from None


def load_text(dataset: str, text_column: str = "text", encoding: str = "utf-8") -> str:
    """All text of a dataset, documents joined by blank lines; `encoding` applies to .txt files."""
    shipped = shipped_texts()
    if dataset in shipped:
        return read_text_file(shipped[dataset])
    path = Path(dataset).expanduser()
    if path.exists():
        if path.suffix not in LOCAL_SUFFIXES:
            raise CalibrationDataError(
                f"dataset file {dataset!r}: unsupported type {path.suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
            )
        if path.suffix == ".txt":
            return read_text_file(path, encoding)
        return _join_column(_load_datasets(LOCAL_SUFFIXES[path.suffix], {"data_files": str(path)}, dataset), text_column, dataset)
    if dataset.startswith((".", "/", "~")) or Path(dataset).suffix in LOCAL_SUFFIXES:
        raise CalibrationDataError(f"dataset file {dataset!r} does not exist (shipped texts: {', '.join(shipped)})")
    return _join_column(_load_datasets(dataset, {}, dataset), text_column, dataset)


def _load_datasets(builder: str, kwargs: dict, label: str):
    try:
        import datasets

        return datasets.load_dataset(builder, split="train", **kwargs)
    except Exception as exc:
        raise CalibrationDataError(
            f"dataset {label!r} could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"pass a local .txt/.jsonl/.parquet file or a shipped text ({', '.join(shipped_texts())})"
        ) from exc


def _join_column(ds, column: str, label: str) -> str:
    if column not in ds.column_names:
        raise CalibrationDataError(
            f"dataset {label!r} has no column {column!r} (columns: {', '.join(ds.column_names)}); "
            "set calibration.text_column"
        )
    return "\n\n".join(str(t) for t in ds[column] if t)


TOKENIZED_KEEP = 16  # texts whose ids this process keeps (a novel is ~1-2 MB of int64 ids)
_tokenized: "OrderedDict[tuple[str, str], torch.Tensor]" = OrderedDict()


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of `text` without special tokens. [n] int64

    A whole novel is tokenized to choose calibration windows from it (the windows depend on its length),
    which took 1.2 s of a 1.9 s tiny-model job here: the ids of the last few texts are kept per process,
    keyed by the text and the fast tokenizer's full serialized state (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens), so the same text through an equal tokenizer gives the same ids without
    encoding it again. Tokenizers without that state (slow, Python ones) are not cached."""
    key = _tokenized_key(tokenizer, text)
    if key is not None and key in _tokenized:
        _tokenized.move_to_end(key)
        return _tokenized[key].clone()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if key is not None:
        _tokenized[key] = ids.clone()
        while len(_tokenized) > TOKENIZED_KEEP:
            _tokenized.popitem(last=False)
    return ids


def _tokenized_key(tokenizer, text: str) -> Optional[tuple[str, str]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        state = backend.to_str()
    except Exception:  # noqa: BLE001  (a tokenizer that cannot serialize itself is simply not cached)
        return None
    state = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}\n{state}"
    return (hashlib.sha256(state.encode("utf-8")).hexdigest(),
            hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())


def make_chunks(
    ids: torch.Tensor, num_samples: int, seq_len: int, seed: int, bos_id: Optional[int] = None, label: str = "text",
    skip: int = 0,
) -> torch.Tensor:
    """`num_samples` non-overlapping windows of `seq_len` tokens, chosen by a seeded permutation.

    With `bos_id`, each window is BOS followed by seq_len - 1 text tokens. skip: the windows after the first
    `skip` of the same permutation (held-back windows: disjoint from those `skip=0` gives). Returns
    [num_samples, seq_len].
    """
    body = seq_len - (1 if bos_id is not None else 0)
    available = ids.numel() // body
    if available < skip + num_samples:
        raise CalibrationDataError(
            f"calibration text {label!r} has {ids.numel()} tokens, enough for {available} chunks of "
            f"{seq_len} tokens, but {skip + num_samples} were asked for ({(skip + num_samples) * body} tokens); "
            "lower calibration.num_samples or calibration.seq_len, or use a longer text"
        )
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randperm(available, generator=gen)[skip : skip + num_samples].sort().values
    chunks = ids[: available * body].reshape(available, body)[picks]  # [num_samples, body]
    if bos_id is not None:
        chunks = torch.cat([torch.full((num_samples, 1), bos_id, dtype=torch.long), chunks], dim=1)
    return chunks
