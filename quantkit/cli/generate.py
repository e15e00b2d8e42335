"""`quantkit generate` and `quantkit chat`: stream text from any checkpoint quantkit can load."""

from __future__ import annotations

import functools
import sys

import click

DEFAULT_PROMPT = "It is a truth universally acknowledged"


def sampling_options(f):
    """The sampler's options, shared by generate and chat (order of application: see runtime.sampling)."""
    options = [
        click.option("-n", "--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1)),
        click.option("-t", "--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True)),
        click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1)),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                     help="Multiplicative, over prompt and output tokens; 1 = off."),
        click.option("--presence-penalty", default=0.0, show_default=True, type=click.FloatRange(-2, 2),
                     help="Additive, output tokens (OpenAI's range)."),
        click.option("--frequency-penalty", default=0.0, show_default=True, type=click.FloatRange(-2, 2),
                     help="Additive, per occurrence (OpenAI's range)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past end tokens."),
        click.option("--seed", default=0, show_default=True, type=int),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
                     help="fp8: keep the KV cache on the FP8 grid with the checkpoint's k/v scales (1.0 where absent)."),
        click.option("--draft", help="Speculative decoding: a draft MODEL (same tokenizer), e.g. the W4A16 version."),
        click.option("--num-draft-tokens", default=4, show_default=True, type=click.IntRange(min=1)),
        click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
                     help="Compute dtype; auto: bf16 only where this machine computes it fast, one token at a time "
                          "included, else float32."),
        click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
                     help="Where the model runs; auto takes CUDA when present (and says so)."),
        click.option("--offload", default="auto", show_default=True, type=click.Choice(["auto", "none", "disk"]),
                     help="disk: keep the decoder layers on disk and load each as it runs (for models that do not "
                          "fit; much slower); auto: only when the model would not fit in memory (said so)."),
    ]
    return functools.reduce(lambda acc, opt: opt(acc), reversed(options), f)


def _params(opts: dict):
    from quantkit.runtime.sampling import SamplingParams

    try:
        return SamplingParams(max_new_tokens=opts["max_new_tokens"], temperature=opts["temperature"], top_k=opts["top_k"],
                              top_p=opts["top_p"], min_p=opts["min_p"], repetition_penalty=opts["repetition_penalty"],
                              presence_penalty=opts["presence_penalty"], frequency_penalty=opts["frequency_penalty"],
                              seed=opts["seed"], stop=tuple(opts["stop"]), ignore_eos=opts["ignore_eos"])
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class Runner:
    """A loaded model (and optional draft) that generates with the CLI's options and prints metrics."""

    def __init__(self, model_spec, opts: dict, params=None):
        from quantkit.checkpoints.loader import load, load_tokenizer

        params = params or _params(opts)  # bad options fail before minutes of loading
        from quantkit.platform.devices import resolve

        device = resolve(opts.get("device", "cpu")).device  # a missing device fails before anything loads
        if opts.get("draft"):
            _check_draft(model_spec, opts["draft"])  # from configs and tokenizers: before any weights load
        offload = opts.get("offload", "none")
        self.model = load(model_spec, dtype=opts.get("dtype"), device=device, offload=offload, workload="decode")
        self.tokenizer = load_tokenizer(model_spec)
        self.draft = load(opts["draft"], dtype=opts.get("dtype"), device=device, offload=offload, workload="decode") \
            if opts.get("draft") else None
        lines = dict.fromkeys(m.quantkit_compute.describe() for m in (self.model, self.draft) if m is not None)
        if self.model.quantkit_device.is_accelerator:
            click.echo(self.model.quantkit_device.describe(), err=True)
        for m in (self.model, self.draft):
            if m is not None and m.quantkit_offload.offloaded:
                click.echo(f"{m.quantkit_source}: {m.quantkit_offload.describe()}", err=True)
        for line in lines:  # once per distinct choice
            click.echo(line, err=True)
        self.opts, self.params = opts, params
        self.kv = None if opts["kv_cache_dtype"] == "auto" else opts["kv_cache_dtype"]

    def run(self, ids: list[int]):
        from quantkit.runtime.generate import generate
        from quantkit.runtime.speculative import speculative_generate

        echo = lambda s: click.echo(s, nl=False)  # noqa: E731
        stats = None
        if self.draft is not None:
            result, stats = speculative_generate(self.model, self.draft, self.tokenizer, ids, self.params,
                                                 self.opts["num_draft_tokens"], on_text=echo, kv_cache_dtype=self.kv)
        else:
            result = generate(self.model, self.tokenizer, ids, self.params, on_text=echo, kv_cache_dtype=self.kv)
        click.echo()
        extra = f", draft acceptance {stats.acceptance_rate:.0%}" if stats else ""
        tps = result.decode_tokens_per_second
        tpot = f"TPOT {1e3 / tps:.1f} ms ({tps:.1f} tok/s)" if tps == tps else "TPOT -"  # nan: one token only
        click.echo(f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}, TTFT {result.ttft_seconds * 1e3:.0f} ms "
                   f"({result.prompt_tokens} prompt tokens), {tpot}{extra}]", err=True)
        return result


def _check_draft(model_spec, draft_spec) -> None:
    """Refuse a draft that cannot propose tokens for the model: another vocabulary, or another tokenizer."""
    from quantkit.errors import IncompatibleModelsError
    from quantkit.formats.checkpoint import read_config
    from quantkit.formats.model_config import text_fields
    from quantkit.checkpoints.loader import load_tokenizer
    from quantkit.checkpoints.resolve import resolve_model

    paths = [resolve_model(None if s is None else str(s)) for s in (model_spec, draft_spec)]
    vocab = [text_fields(read_config(p))["vocab_size"] for p in paths]
    if vocab[0] != vocab[1]:
        raise IncompatibleModelsError(f"--draft {draft_spec}: its vocabulary has {vocab[1]} tokens and the model's "
                                      f"{vocab[0]}; a draft must share the model's tokenizer (e.g. a quantized copy "
                                      "of the same model)")
    tokens = [load_tokenizer(p).get_vocab() for p in paths]
    if tokens[0] != tokens[1]:
        raise IncompatibleModelsError(f"--draft {draft_spec}: its tokenizer maps text to other token ids than the "
                                      "model's; a draft must share the model's tokenizer")


def _check_model_not_prompt(spec: str) -> None:
    """`quantkit generate "Once upon a time"`: one argument that names no model is reported as a
    prompt given without a model, not as a missing directory."""
    from quantkit.errors import ModelNotFoundError
    from quantkit.checkpoints.resolve import DEFAULT_MODEL, resolve_model

    try:
        resolve_model(spec)
    except ModelNotFoundError as exc:
        if " " in spec.strip() or not any(c in spec for c in "/.~"):
            raise ModelNotFoundError(
                f"{spec!r} is not a model (no such directory, demo model or hub id); to use it as the prompt, "
                f"name the model first: quantkit generate {DEFAULT_MODEL} {spec!r}") from exc
        raise


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    from quantkit.runtime.chat import NoChatTemplateError, chat_prompt_ids

    try:
        return chat_prompt_ids(tokenizer, messages)
    except NoChatTemplateError:
        raise click.UsageError("this model's tokenizer has no chat template; use `quantkit generate` with a plain "
                               "prompt") from None


@click.command("generate")
@click.argument("model", required=False)
@click.argument("prompt", required=False)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@sampling_options
def command(model, prompt, chat, **opts):
    """Generate a continuation of PROMPT with MODEL (default smollm2-135m), streamed to the terminal.

    \b
    Examples:
      quantkit generate ./smollm2-w4 "It is a truth universally acknowledged"
      quantkit generate smollm2-135m "Write a haiku about tea" --chat -t 0.7 --top-p 0.9 --stop "\\n\\n"
      quantkit generate smollm2-135m "Once upon a time" --draft ./smollm2-w4
    """
    params = _params(opts)
    if prompt is not None and not prompt.strip():
        raise click.BadParameter("the prompt is empty; give some text, or leave PROMPT out for the default "
                                 f"({DEFAULT_PROMPT!r})", param_hint="PROMPT")
    if prompt is None and model is not None:
        _check_model_not_prompt(model)
    runner = Runner(model, opts, params)
    prompt = prompt if prompt is not None else DEFAULT_PROMPT
    if chat:
        ids = chat_ids(runner.tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = runner.tokenizer(prompt)["input_ids"]
        click.echo(prompt, nl=False)
    runner.run(list(ids))


@click.command("chat")
@click.argument("model", required=False)
@click.option("--system", help="A system message at the start of the conversation.")
@sampling_options
def chat_command(model, system, **opts):
    """Talk to MODEL (default smollm2-135m) with its chat template; the conversation is kept.

    Type a message and press Enter; an empty line or /exit ends, /reset forgets the history.
    """
    if sys.stdin is None or sys.stdin.closed:  # (`0<&-`): before the model loads, not at the first prompt
        raise click.UsageError("chat reads your messages from standard input, which is closed; run it in a "
                               "terminal, or pipe the messages in, or use `quantkit generate MODEL PROMPT --chat`")
    runner = Runner(model, opts, _params(opts))
    messages = [{"role": "system", "content": system}] if system else []
    chat_ids(runner.tokenizer, [{"role": "user", "content": "hi"}])  # fail now if there is no template
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.Abort):
            break
        except RuntimeError as exc:  # input() once standard input went away mid-conversation: its end
            if "stdin" not in str(exc):
                raise
            break
        if line.strip() in ("", "/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line})
        click.echo("model> ", nl=False)
        result = runner.run(chat_ids(runner.tokenizer, messages))
        messages.append({"role": "assistant", "content": result.text})
