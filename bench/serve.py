"""Serving benchmark: N concurrent clients over HTTP against `quantkit serve` (or any OpenAI-compatible server,
e.g. llama.cpp's llama-server), prompts from the Austen novels.

Usage:
  python bench/serve.py throughput MODEL [--clients 1,4,16,32] [--dtype auto] [--max-tokens 128] [--url URL]
  python bench/serve.py prefix MODEL [--system-tokens 1000]
  python bench/serve.py kv MODEL [--kv-cache-gb 0.05]
  python bench/serve.py llama-server MODEL.gguf [--clients 1,16]    (quantkit and llama-server on the same file)

throughput: each of N clients sends requests one after another (streamed /v1/completions, greedy, end
tokens ignored so every request decodes --max-tokens tokens); prompts are Austen excerpts whose lengths are
log-uniform in [32, 512] tokens, the same sequence for every run. Per level: output tokens/s over the
wall time, TTFT and TPOT percentiles (TTFT: request sent -> first text; TPOT: (last - first) / (tokens - 1)).
prefix: one client; a shared system prompt of --system-tokens tokens then a short question: TTFT of the
first request per system prompt (a prefix-cache miss) against the next (a hit), medians over 3 prompts.
kv: in process, no HTTP: requests with log-uniform prompt lengths in [32, 2048] tokens, 64 new tokens each,
all queued at once on an engine with a fixed KV budget: the most requests running at once, against how many
contiguous caches of the longest request (and of the model's context) the same budget holds.
llama-server: the throughput run at each --clients level against `quantkit serve FILE` and then against
llama.cpp's `llama-server -m FILE` (--llama-server BIN; as many slots as clients), with their ratios.
Every figure is printed with the CPU model and torch's CPU capability. The servers bind to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
AUSTEN = [ROOT.parent / "shared" / "corpora" / "austen" / n for n in ("emma.txt", "persuasion.txt")]
LLAMA_SERVER = Path(os.environ.get("LLAMACPP_HOME", Path.home() / ".cache" / "llamacpp")) / "bin" / "llama-server"


def machine() -> str:
    import torch

    model = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                  if l.startswith("model name")), platform.processor())
    return f"{model}, capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, torch {torch.__version__}"


def austen_text() -> str:
    for path in AUSTEN:
        if path.exists():
            return path.read_text(encoding="utf-8")
    return (ROOT / "calibration_data" / "prideprejudice.txt").read_text(encoding="utf-8")


def prompts(tokenizer, count: int, low: int, high: int, seed: int = 0) -> list[str]:
    """`count` Austen excerpts with token lengths log-uniform in [low, high] (decoded back to text)."""
    ids = tokenizer(austen_text()[:400_000])["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        start = rng.randrange(0, len(ids) - n)
        out.append(tokenizer.decode(ids[start : start + n]))
    return out


# --- an async streaming client ---------------------------------------------------------------------------------


async def one_request(host: str, port: int, body: dict) -> dict:
    """Send one streamed completion; (ttft, tpot, tokens) from its server-sent events."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    sent = time.perf_counter()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    first = last = None
    pieces, usage = 0, None
    status = (await reader.readline()).decode()
    if " 200 " not in status:
        raise RuntimeError(f"server answered {status.strip()}: {(await reader.read()).decode()[:300]}")
    while (line := await reader.readline()) != b"":
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            text = event["choices"][0].get("text", "") if event.get("choices") else ""
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                pieces += 1
        elif line == b"data: [DONE]":
            break
    writer.close()
    tokens = usage["completion_tokens"] if usage else pieces
    return {"ttft": (first or time.perf_counter()) - sent,
            "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else float("nan"), "tokens": tokens}


async def load_level(url: str, model: str, texts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    queue = list(texts[: clients * per_client])
    results = []

    async def client(k: int):
        for j in range(per_client):
            body = {"model": model, "prompt": queue[k * per_client + j], "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            results.append(await one_request(host, int(port), body))

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall = time.perf_counter() - start
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    return {"clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "tok_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
            "ttft_p50": q(ttft, 50), "ttft_p90": q(ttft, 90), "tpot_p50": q(tpot, 50) if tpot else float("nan"),
            "tpot_p90": q(tpot, 90) if tpot else float("nan")}


def print_level(label: str, r: dict, base: float) -> None:
    print(f"{label:<34} {r['clients']:>3} clients {r['requests']:>3} req  {r['tok_s']:7.1f} tok/s ({r['tok_s'] / base:4.1f}x)  "
          f"TTFT p50 {r['ttft_p50'] * 1e3:6.0f} p90 {r['ttft_p90'] * 1e3:6.0f} ms  "
          f"TPOT p50 {r['tpot_p50'] * 1e3:5.1f} p90 {r['tpot_p90'] * 1e3:5.1f} ms", flush=True)


# --- servers ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def start_quantkit(model: str, args, extra=()) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "quantkit", "serve", model, "--port", str(port), "--dtype", args.dtype, "--device", args.device,
           "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(max(32, max(args.clients))),
           "--max-waiting", "256", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.log, "a"))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    name = json.load(urllib.request.urlopen(f"{url}/v1/models"))["data"][0]["id"]
    return proc, url, name


def start_llama_server(gguf: str, clients: int, context: int, binary: Path, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(clients),
           "-c", str(context * clients), "-t", str(os.cpu_count()), "--cont-batching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "a"))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_levels(url: str, name: str, texts: list[str], args, label: str) -> list[dict]:
    out = []
    for n in args.clients:
        per_client = max(1, args.requests // n) if n < args.requests else 1
        asyncio.run(load_level(url, name, texts[:1], 1, 1, 8))  # warm-up (not counted)
        r = asyncio.run(load_level(url, name, texts, n, per_client, args.max_tokens))
        out.append(r)
        print_level(label, r, out[0]["tok_s"])
    return out


# --- modes -------------------------------------------------------------------------------------------------------


def throughput(args) -> None:
    from quantkit.checkpoints.loader import load_tokenizer

    texts = prompts(load_tokenizer(args.model), 256, 32, 512)
    print(f"# serve throughput: {args.model}, dtype {args.dtype}, {args.max_tokens} new tokens per request; {machine()}")
    if args.url:
        name = json.load(urllib.request.urlopen(f"{args.url}/v1/models"))["data"][0]["id"]
        run_levels(args.url, name, texts, args, "server " + args.url)
        return
    proc, url, name = start_quantkit(args.model, args)
    try:
        run_levels(url, name, texts, args, f"quantkit {Path(args.model).name} {args.dtype}")
    finally:
        stop(proc)


def prefix(args) -> None:
    from quantkit.checkpoints.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    systems = prompts(tok, 3, args.system_tokens, args.system_tokens + 1, seed=7)
    print(f"# prefix cache: {args.model}, shared prompt {args.system_tokens} tokens; {machine()}")
    proc, url, name = start_quantkit(args.model, args)
    host, port = url.removeprefix("http://").split(":")
    miss, hit = [], []
    try:
        for i, system in enumerate(systems):
            for j, question in enumerate(("\n\nWho is speaking here?", "\n\nWhere does this take place?")):
                body = {"model": name, "prompt": system + question, "max_tokens": 8, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                r = asyncio.run(one_request(host, int(port), body))
                (miss if j == 0 else hit).append(r["ttft"])
    finally:
        stop(proc)
    m, h = statistics.median(miss), statistics.median(hit)
    print(f"TTFT miss {m * 1e3:.0f} ms (median of {len(miss)}), hit {h * 1e3:.0f} ms: {m / h:.1f}x faster")


def kv(args) -> None:
    from quantkit.checkpoints.loader import load, load_tokenizer
    from quantkit.engine.engine import Engine, EngineConfig
    from quantkit.engine.kv_pool import KVShape, element_bytes
    from quantkit.runtime.sampling import SamplingParams

    model = load(args.model, dtype=args.dtype, device=args.device, workload="decode")
    tok = load_tokenizer(args.model)
    rng = random.Random(1)
    ids = tok(austen_text()[:600_000])["input_ids"]
    engine = Engine(model, tok, EngineConfig(kv_cache_gb=args.kv_cache_gb, max_num_seqs=256, max_batched_tokens=512))
    high = min(2048, engine.limit - 64)
    lengths = [int(math.exp(rng.uniform(math.log(32), math.log(high)))) for _ in range(args.kv_requests)]
    reqs = [ids[s : s + n] for n in lengths for s in [rng.randrange(0, len(ids) - n)]]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for r in reqs:
        engine.add(r, params)
    peak = 0
    while engine.has_work:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    per_token = KVShape.of(model).bytes_per_token(element_bytes(engine.pool.dtype, None))
    budget = engine.pool.nbytes
    longest = max(lengths) + 64
    static_longest = budget // (longest * per_token)
    static_context = budget // (engine.limit * per_token)
    print(f"# KV memory: {args.model}, budget {budget / 2**20:.1f} MiB ({engine.capacity_tokens} tokens), "
          f"{len(reqs)} requests, prompts log-uniform 32-{high} tokens (mean {statistics.mean(lengths):.0f}), 64 new; {machine()}")
    print(f"paged: up to {peak} requests at once ({engine.scheduler.preemptions} preemptions); contiguous caches of "
          f"the longest request ({longest} tokens): {static_longest} ({peak / max(static_longest, 1):.1f}x); of the "
          f"model's context ({engine.limit}): {static_context}")


def llama_server(args) -> None:
    from quantkit.checkpoints.loader import load_tokenizer

    texts = prompts(load_tokenizer(args.model), 256, 32, 512)
    print(f"# quantkit serve vs llama-server on {args.model}, {args.max_tokens} new tokens per request; {machine()}")
    ours, theirs = {}, {}
    proc, url, name = start_quantkit(args.model, args)
    try:
        for r in run_levels(url, name, texts, args, "quantkit serve"):
            ours[r["clients"]] = r
    finally:
        stop(proc)
    for n in args.clients:
        proc, url = start_llama_server(args.model, n, 512 + args.max_tokens + 64, Path(args.llama_server), args.log)
        try:
            asyncio.run(load_level(url, "x", texts[:1], 1, 1, 8))
            per_client = max(1, args.requests // n) if n < args.requests else 1
            r = asyncio.run(load_level(url, "x", texts, n, per_client, args.max_tokens))
            theirs[n] = r
            print_level("llama-server", r, theirs[args.clients[0]]["tok_s"])
        finally:
            stop(proc)
    for n in args.clients:
        print(f"{n:>3} clients: quantkit/llama-server throughput {ours[n]['tok_s'] / theirs[n]['tok_s']:.2f}x, "
              f"TTFT p50 {ours[n]['ttft_p50'] / theirs[n]['ttft_p50']:.2f}x (lower is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "prefix", "kv", "llama-server"])
    parser.add_argument("model")
    parser.add_argument("--clients", default="1,4,16,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=8, help="Requests per level at least (each client sends "
                        "requests // clients, at least one).")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="Where quantkit serve runs the model (cpu, cuda, auto).")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--kv-requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--url", help="throughput: measure this running server instead of starting quantkit serve")
    parser.add_argument("--llama-server", default=str(LLAMA_SERVER))
    parser.add_argument("--log", default="/tmp/bench-serve.log", help="The servers' stderr.")
    args = parser.parse_args()
    {"throughput": throughput, "prefix": prefix, "kv": kv, "llama-server": llama_server}[args.mode](args)


if __name__ == "__main__":
    main()
