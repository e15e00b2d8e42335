"""Task accuracy through lm-eval-harness: quantkit's runner as an lm-eval model, and `quantkit eval tasks`.

`QuantkitLM` answers lm-eval's three request kinds with quantkit's own code: loglikelihood and
loglikelihood_rolling through `eval.likelihood.score`, generate_until through the runner
(`runtime.generate.generate_batch`: its sampler, stop strings and KV cache). lm-eval is an optional
dependency (`pip install 'quantkit[eval]'`); this module imports it at the top, so import it only
where lm-eval is wanted.

Tasks: the ones shipped in evals/tasks/ (lm-eval YAML over local jsonl, built from *Persuasion*;
`austen` names all three) are read here and handed to lm-eval as configs with their data files
resolved next to the YAML, so they run offline and from any directory. Any other name is lm-eval's
own (hellaswag, arc_easy, ...), whose data lm-eval fetches from the hub: that works where the hub
is reachable. `--include-path DIR` adds a directory of the user's own YAML tasks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import lm_eval
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError
from quantkit.eval.likelihood import score
from quantkit.platform.paths import EVAL_TASKS_DIR

log = logging.getLogger(__name__)

SHIPPED_GROUPS = {"austen": ["austen_cloze", "austen_next_word", "austen_ppl"]}
DEFAULT_MAX_LENGTH = 2048  # tokens per request when the model's context is longer


class TaskError(QuantkitError):
    """An lm-eval task that cannot be found or run."""


class QuantkitLM(TemplateLM):
    """A loaded quantkit model (`quantkit.load`) as an lm-eval model."""

    def __init__(self, model, tokenizer, batch_size: int = 1, max_length: Optional[int] = None,
                 add_bos: bool = False, kv_cache_dtype: Optional[str] = None):
        super().__init__()
        from quantkit.runtime.request import context_limit

        self.model, self.tokenizer = model, tokenizer
        self.batch_size = batch_size
        self._max_length = max_length or min(context_limit(model), DEFAULT_MAX_LENGTH)
        self.add_bos = add_bos and tokenizer.bos_token_id is not None
        self.kv_cache_dtype = kv_cache_dtype

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and every rolling window) starts from: BOS where the family needs it."""
        if self.add_bos or self.tokenizer.eos_token_id is None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=False)
        if self.add_bos and add_special_tokens is not False and (not ids or ids[0] != self.tokenizer.bos_token_id):
            ids = [self.tokenizer.bos_token_id] + ids
        return ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = score(self.model, [(ctx, cont) for _, ctx, cont in requests], self.max_length, self.batch_size)
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
            total = sum(ll for ll, _ in score(self.model, windows, self.max_length, self.batch_size))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from quantkit.runtime.generate import generate_batch
        from quantkit.runtime.sampling import SamplingParams

        out: list = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature if sample else 0.0,
                                    top_p=float(kwargs.pop("top_p", 1.0)), top_k=int(kwargs.pop("top_k", 0) or 0),
                                    stop=tuple(s for s in until if s))
            if kwargs:
                log.warning("generate_until: ignoring generation arguments %s", sorted(kwargs))
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            groups.setdefault(params, []).append((i, ids))
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for params, items in groups.items():
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                done = generate_batch(self.model, self.tokenizer, [ids for _, ids in chunk], params,
                                      kv_cache_dtype=self.kv_cache_dtype)
                for (i, _), completion in zip(chunk, done):
                    out[i] = completion.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, completion.text)
                bar.update(len(chunk))
        bar.close()
        return out


def shipped_tasks() -> dict[str, Path]:
    return {p.stem: p for p in sorted(EVAL_TASKS_DIR.glob("*.yaml"))}


def shipped_config(name: str) -> dict:
    """A shipped task's YAML as an lm-eval config dict, its data files made absolute."""
    path = shipped_tasks()[name]
    config = yaml.safe_load(path.read_text())
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        config["dataset_kwargs"]["data_files"] = {k: str((path.parent / v).resolve()) for k, v in files.items()}
    return config


def task_list(names: list[str]) -> list:
    """Shipped names (and groups) as configs, everything else as lm-eval task names."""
    shipped = shipped_tasks()
    out: list = []
    for name in names:
        for n in SHIPPED_GROUPS.get(name, [name]):
            out.append(shipped_config(n) if n in shipped else n)
    return out


def run(model_spec: str, tasks: list[str], limit: Optional[float] = None, batch_size: int = 1,
        num_fewshot: Optional[int] = None, dtype: str = "auto", device: str = "cpu", offload: str = "none",
        include_path: Optional[Path] = None, max_length: Optional[int] = None, seed: int = 0,
        kv_cache_dtype: Optional[str] = None, verbosity: Optional[str] = None) -> dict:
    """lm-eval's results dict (`results`, `configs`, `versions`, ...) for `model_spec` on `tasks`."""
    from lm_eval.tasks import TaskManager

    from quantkit.formats import model_config
    from quantkit.formats.checkpoint import read_config
    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.plugins.catalog import needs_bos
    from quantkit.checkpoints.loader import load, load_tokenizer

    if not tasks:
        raise TaskError("no task given; pass --tasks NAME[,NAME] (shipped: "
                        f"{', '.join([*SHIPPED_GROUPS, *shipped_tasks()])})")
    ours = set(shipped_tasks()) | set(SHIPPED_GROUPS)
    # lm-eval's own index of ~15k tasks takes seconds to build: only when a task is not ours
    manager = TaskManager(verbosity=verbosity, include_path=str(include_path) if include_path else None,
                          include_defaults=not set(tasks) <= ours)
    known = set(manager.all_tasks) | ours
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise TaskError(f"unknown task(s) {', '.join(unknown)}: not shipped with quantkit "
                        f"({', '.join([*SHIPPED_GROUPS, *shipped_tasks()])}) nor known to lm-eval "
                        f"{lm_eval.__version__}; list lm-eval's with `lm-eval ls tasks`, or give --include-path DIR")
    path = resolve_model(model_spec)
    raw = read_config(path)
    if max_length is not None:
        model_config.check_length(max_length, raw, model_spec, "--max-length", "use --max-length {limit} or less")
    add_bos = needs_bos(raw.get("model_type", "?"))
    model = load(path, dtype=dtype, device=device, offload=offload)
    lm = QuantkitLM(model, load_tokenizer(path), batch_size, max_length, add_bos, kv_cache_dtype)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=task_list(tasks), task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, bootstrap_iters=1000, log_samples=False,
                                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed, verbosity=verbosity)
    except ConnectionError as exc:
        raise TaskError(f"lm-eval could not fetch a task's data ({exc}); hub tasks need the Hugging Face hub "
                        "(this machine is offline); the shipped tasks (austen) run offline") from exc
    results["quantkit"] = {"model": model_spec, "path": str(path), "compute": model.quantkit_compute.describe(),
                           "device": str(model.quantkit_device.device), "max_length": lm.max_length,
                           "add_bos": lm.add_bos}
    return results
