"""The OpenAI API's request fields, checked, and its response bodies.

`parse_completion` / `parse_chat` turn a request body (parsed JSON) into a `Parsed` request: the
sampling parameters, what to tokenize, whether to stream. Every check names its field: a wrong
body raises `BadRequest(message, param)`, which the server answers with HTTP 400 and OpenAI's
error body (`error_body`). Fields the engine cannot honour (n > 1, logprobs, echo, best_of) are
refused the same way rather than ignored. Unknown fields are ignored, as OpenAI-compatible servers do.
Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions and the rest of the
context for chat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from quantkit.runtime.sampling import SamplingParams

ROLES = ("system", "user", "assistant", "developer", "tool")


class BadRequest(ValueError):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Parsed:
    model: str
    prompt: Union[str, list[int], None]  # completions: text or token ids
    messages: Optional[list[dict]]  # chat
    max_tokens: Optional[int]  # None: the rest of the context (chat)
    sampling: dict  # SamplingParams fields except max_new_tokens
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, low=None, high=None, low_open=False, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, not {type(value).__name__}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"'{name}' must be {'>' if low_open else '>='} {low} (got {value})", name)
    if high is not None and value > high:
        raise BadRequest(f"'{name}' must be <= {high} (got {value})", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, not {type(value).__name__}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > 4:
        raise BadRequest(f"'stop' takes at most 4 strings (got {len(stops)})", "stop")
    if any(not s for s in stops):
        raise BadRequest("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _unsupported(body: dict) -> None:
    for name, neutral in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None), ("top_logprobs", None),
                          ("suffix", None), ("tools", None), ("response_format", None)):
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logprobs" and value is False):
            raise BadRequest(f"'{name}' = {value!r} is not supported by this server (only {neutral!r})", name)


def _common(body: Any, max_tokens_names: tuple[str, ...], default_max: Optional[int]) -> tuple[str, Optional[int], dict, bool, bool]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: the name /v1/models lists" if model is None
                         else f"'model' must be a string, not {type(model).__name__}", "model")
    _unsupported(body)
    max_tokens = default_max
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, None, low=1, integer=True)
    top_k = _number(body, "top_k", 0, low=-1, integer=True)
    sampling = dict(
        temperature=_number(body, "temperature", 1.0, low=0),
        top_p=_number(body, "top_p", 1.0, low=0, high=1, low_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=_number(body, "min_p", 0.0, low=0, high=1),
        presence_penalty=_number(body, "presence_penalty", 0.0, low=-2, high=2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2, high=2),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, low=0, low_open=True),
        seed=_number(body, "seed", None, integer=True),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    return model, max_tokens, sampling, stream, include_usage


def parse_completion(body: Any) -> Parsed:
    model, max_tokens, sampling, stream, usage = _common(body, ("max_tokens",), 16)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of those "
                             "(one prompt per request)", "prompt")
    elif not isinstance(prompt, str):
        raise BadRequest(f"'prompt' must be a string or a list of token ids, not {type(prompt).__name__}", "prompt")
    elif not prompt:
        raise BadRequest("'prompt' must not be empty", "prompt")
    return Parsed(model, prompt, None, max_tokens, sampling, stream, usage)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: Any) -> Parsed:
    model, max_tokens, sampling, stream, usage = _common(body, ("max_tokens", "max_completion_tokens"), None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)} (got {role!r})",
                             f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    return Parsed(model, None, out, max_tokens, sampling, stream, usage)


def sampling_params(parsed: Parsed, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_new_tokens=max_tokens, **parsed.sampling)
    except ValueError as exc:  # the checks above cover the fields; this names what slipped through
        raise BadRequest(str(exc)) from None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": use}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}], "usage": use}


def chunk(rid: str, model: str, chat: bool, text: Optional[str], finish: Optional[str], first: bool = False,
          use: Optional[dict] = None) -> dict:
    """One streamed chunk: a text delta, the finish (text None), or the usage alone (use given)."""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    if use is not None:
        body.update(choices=[], usage=use)
        return body
    if chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    body["choices"] = [choice]
    return body
