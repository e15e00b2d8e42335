"""`quantkit serve`: the OpenAI API through the official `openai` client (chat, completion, streaming) and raw
HTTP for the error cases; disconnects, the waiting bound, /metrics, SIGTERM; W4A16, FP8 and GGUF checkpoints.
Every server binds to 127.0.0.1 on a free port, and every load is bounded in count and time."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from quantkit.checkpoints.loader import load, load_tokenizer
from quantkit.engine.engine import Engine, EngineConfig
from quantkit.engine.loop import Busy, EngineLoop
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.serve.app import build_app

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@contextlib.contextmanager
def serving(model, tokenizer, name="tiny", config=EngineConfig(num_blocks=256, block_size=4), max_waiting=64):
    """A server on 127.0.0.1 (a free port) in a thread; yields (base url, engine loop); stopped on exit."""
    loop = EngineLoop(Engine(model, tokenizer, config), max_waiting).start()
    server = uvicorn.Server(uvicorn.Config(build_app(loop, tokenizer, name), host="127.0.0.1", port=0,
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        loop.drain(timeout=0)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model = load(tiny_llama, dtype="float32")
    tokenizer = load_tokenizer(tiny_llama)
    tokenizer.chat_template = TEMPLATE
    return model, tokenizer


@pytest.fixture(scope="module")
def server(tiny):
    with serving(*tiny) as (url, loop):
        yield url, loop


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url, path, body, raw=False):
    """(status, parsed JSON body) of a POST; body is sent as given when raw (bytes), else as JSON."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body if raw else json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else None


def test_completion_stream_and_chat_through_the_openai_client(server, tiny):
    url, _ = server
    model, tokenizer = tiny
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "It is a truth universally acknowledged"
    expected = generate(model, tokenizer, tokenizer(prompt)["input_ids"],
                        SamplingParams(max_new_tokens=12, ignore_eos=True))
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.prompt_tokens, 12)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Who was Emma?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert text == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert chat.usage.prompt_tokens == len(ids)
    # the second identical chat found its prompt's full blocks in the prefix cache
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 4 * 4 > 0


def test_sse_wire_format_ends_with_done(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "Emma", "max_tokens": 5,
                                                        "stream": True, "temperature": 0}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [
    (b"{not json", "raw", None, "not valid JSON"),
    ({"prompt": "x"}, "/v1/completions", "model", "'model' is required"),
    ({"model": "other", "prompt": "x"}, "/v1/completions", "model", "not served here"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, "/v1/completions", "max_tokens", "integer"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "/v1/completions", "max_tokens", ">= 1"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 600}, "/v1/completions", "max_tokens", "context of 512"),
    ({"model": "tiny", "prompt": "x " * 600, "max_tokens": 5}, "/v1/completions", "prompt", "context"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, "/v1/completions", "temperature", ">= 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "/v1/completions", "top_p", "> 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "/v1/completions", "top_p", "<= 1"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, "/v1/completions", "stream", "true or false"),
    ({"model": "tiny", "prompt": "x", "stop": [1, 2]}, "/v1/completions", "stop", "strings"),
    ({"model": "tiny", "prompt": 42}, "/v1/completions", "prompt", "string"),
    ({"model": "tiny", "prompt": "x", "n": 2}, "/v1/completions", "n", "not supported"),
    ({"model": "tiny"}, "/v1/chat/completions", "messages", "required"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "/v1/chat/completions",
     "messages[0].role", "must be one of"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "/v1/chat/completions",
     "messages[0].content", "string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "/v1/chat/completions", "max_completion_tokens", ">= 1"),
]


@pytest.mark.parametrize("body,path,param,message", BAD, ids=[f"{b[1]}:{b[2]}:{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_naming_the_field(server, body, path, param, message):
    url, loop = server
    status, reply = _post(url, "/v1/completions" if path == "raw" else path, body, raw=path == "raw")
    assert status == 400, reply
    assert reply["error"]["param"] == param and message in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    assert not loop.engine.sequences  # nothing was queued


def test_unknown_route_is_a_json_404(server):
    url, _ = server
    status, reply = _post(url, "/v1/embeddings", {"model": "tiny"})
    assert status == 404 and "/v1/embeddings" in reply["error"]["message"]


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_return(server):
    url, loop = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "Emma", "max_tokens": 400,
                                                        "stream": True, "ignore_eos": True}))
    resp = conn.getresponse()
    resp.fp.readline()  # the first event arrived: the request is running
    aborted_before = loop.engine.metrics.finished["abort"]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while loop.engine.sequences or loop.engine.metrics.finished["abort"] == aborted_before:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.05)
    time.sleep(0.1)
    loop.engine.allocator.check_idle()


def test_metrics_in_prometheus_text(server):
    url, _ = server
    _client(url).completions.create(model="tiny", prompt="Emma", max_tokens=3, temperature=0)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    for name in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate"):
        assert f"quantkit_{name}" in values
    assert values["quantkit_kv_blocks_free"] + values["quantkit_kv_blocks_used"] == 256
    assert values["quantkit_time_to_first_token_seconds_count"] >= 1
    assert values['quantkit_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["quantkit_time_to_first_token_seconds_count"]


def test_more_waiting_than_allowed_is_503_at_once(tiny):
    loop = EngineLoop(Engine(*tiny, EngineConfig(num_blocks=64, block_size=4)), max_waiting=2)  # not started
    import asyncio

    event_loop = asyncio.new_event_loop()
    for i in range(2):
        loop.submit(f"r{i}", [5, 6, 7], SamplingParams(max_new_tokens=2), event_loop)
    with pytest.raises(Busy, match="--max-waiting 2"):
        loop.submit("r2", [5, 6, 7], SamplingParams(max_new_tokens=2), event_loop)
    event_loop.close()
    with serving(*tiny, max_waiting=0) as (url, _):
        status, reply = _post(url, "/v1/completions", {"model": "tiny", "prompt": "Emma", "max_tokens": 3})
        assert status == 503 and reply["error"]["code"] == "too_many_waiting"


@pytest.mark.parametrize("recipe", ["rtn-w4a16", "fp8-dynamic", "gptq-q4_0"])
def test_quantized_checkpoints_are_served(tiny_llama, tmp_path, recipe):
    """W4A16 and FP8 compressed-tensors checkpoints and a GGUF file answer the openai client, streaming, with
    the tokens `generate` gives on the same loaded model."""
    from quantkit.checkpoints.to_gguf import export_gguf
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    out = tmp_path / recipe
    quantize(str(tiny_llama), load_recipe(recipe, ["calibration.num_samples=4", "calibration.seq_len=32"]
                                          if "gptq" in recipe else []), out, progress=False)
    path = export_gguf(out, tmp_path / "model.gguf", tokenizer_pre="default").path if "q4_0" in recipe else out
    model, tokenizer = load(str(path), dtype="float32"), load_tokenizer(str(path))
    ids = tokenizer("Mr. Darcy")["input_ids"]
    expected = generate(model, tokenizer, ids, SamplingParams(max_new_tokens=8, ignore_eos=True))
    with serving(model, tokenizer, "q") as (url, _):
        stream = _client(url).completions.create(model="q", prompt="Mr. Darcy", max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == expected.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_running(port: int, worker: threading.Thread) -> None:
    """Poll /metrics until the engine reports a running request (the worker's), so a signal sent next finds
    it in flight; fails if the worker ends first."""
    deadline = time.monotonic() + 60
    while worker.is_alive() and time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        if "quantkit_requests_running 1" in text:
            return
        time.sleep(0.005)
    raise AssertionError("the request never showed as running before it ended")


def test_sigterm_finishes_running_requests_and_exits_0(tiny_llama, tmp_path):
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(tiny_llama), "--port", str(port),
                             "--dtype", "float32", "--kv-cache-gb", "0.01", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/health") is None:
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        result = {}
        body = {"model": tiny_llama.name, "prompt": "Emma", "max_tokens": 400, "ignore_eos": True}
        worker = threading.Thread(target=lambda: result.update(reply=_post(url, "/v1/completions", body)))
        worker.start()
        _wait_until_running(port, worker)
        proc.send_signal(signal.SIGTERM)
        worker.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        # uvicorn logs a whole (non-streamed) response when it is sent: after "Shutting down" means the request
        # was still running when the signal arrived, and it was finished rather than dropped
        assert log.index("Shutting down") < log.index('"POST /v1/completions'), log
        status, reply = result["reply"]
        assert status == 200 and reply["usage"]["completion_tokens"] == 400  # finished, not cut off
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_real_w4a16_model_serves_eight_streams_equal_to_generate(smollm2_rtn64):
    """SmolLM2 W4A16 (float32 compute): eight concurrent streamed completions through the openai client, each
    equal to `generate` on its prompt alone; then a chat answer."""
    from concurrent.futures import ThreadPoolExecutor

    from quantkit.calibration.data import load_text

    model, tokenizer = load(smollm2_rtn64, dtype="float32", workload="decode"), load_tokenizer(smollm2_rtn64)
    text = load_text("emma")
    prompts = [text[i * 1500 : i * 1500 + 200 + 150 * i] for i in range(8)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = [generate(model, tokenizer, tokenizer(p)["input_ids"], params).text for p in prompts]
    with serving(model, tokenizer, "smollm2-w4", EngineConfig(kv_cache_gb=0.1, max_batched_tokens=128)) as (url, loop):
        client = _client(url)

        def one(prompt):
            stream = client.completions.create(model="smollm2-w4", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in stream)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, prompts)) == expected
        chat = client.chat.completions.create(model="smollm2-w4", messages=[{"role": "user", "content": "Who was Emma?"}],
                                              max_tokens=12, temperature=0)
        assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens <= 12
        time.sleep(0.1)
        loop.engine.allocator.check_idle()
