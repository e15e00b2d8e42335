"""`quantkit serve`'s process: load the model, start the engine thread, run the HTTP API under uvicorn.

Starlette + uvicorn: a small, well-kept ASGI stack whose streaming responses notice a client that
goes away (the stream is cancelled, and the request aborted). SIGTERM or Ctrl-C: uvicorn stops
accepting connections and waits up to `shutdown_timeout` seconds for the open ones (running
requests finish in that time); then the engine aborts whatever is left and the process exits 0.
Binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Optional

from quantkit.engine.engine import Engine, EngineConfig
from quantkit.engine.loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 64
    shutdown_timeout: float = 30.0
    log_level: str = "info"


def make_loop(model, tokenizer, config: EngineConfig, max_waiting: int) -> EngineLoop:
    return EngineLoop(Engine(model, tokenizer, config), max_waiting)


def run(model, tokenizer, model_name: str, config: EngineConfig, options: ServeOptions,
        on_ready: Optional[callable] = None) -> bool:
    """Serve until SIGTERM / SIGINT; returns whether every request in flight at the end finished by itself."""
    import uvicorn

    from quantkit.serve.app import build_app

    loop = make_loop(model, tokenizer, config, options.max_waiting).start()
    result = {"clean": True}

    def shutdown():
        result["clean"] = loop.drain(timeout=1.0)

    app = build_app(loop, tokenizer, model_name, on_shutdown=shutdown)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            loop.draining = True  # /health says so and new requests get 503 while the open ones finish
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                                   timeout_graceful_shutdown=options.shutdown_timeout, lifespan="on"))
    # uvicorn re-raises the signal it caught once it has shut down; with these handlers in place that is a
    # no-op, so a graceful stop exits 0 instead of dying by the signal
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_ready is not None:
            on_ready()
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not loop._stop.is_set():
            loop.drain(timeout=0)
    return result["clean"]
