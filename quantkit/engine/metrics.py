"""The engine's counters and histograms, and their Prometheus text exposition (format 0.0.4).

Gauges are read from the engine when rendered (requests running and waiting, KV blocks used,
free and cached); counters and histograms (TTFT, TPOT, end-to-end latency) are kept here.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """Counters and histograms, updated by the engine thread and read by the server's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def request_done(self, reason: str, prompt_tokens: int, output_tokens: int, ttft: float, tpot: float,
                     latency: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            if reason != "abort" and output_tokens > 0:
                self.ttft.observe(ttft)
                self.latency.observe(latency)
            if output_tokens > 1:
                self.tpot.observe(tpot)

    def render(self, gauges: dict[str, tuple[str, float]], prefix: str = "quantkit") -> str:
        """Prometheus text: the gauges given (name -> (help, value)), then the counters and histograms."""
        lines = []
        for name, (text, value) in gauges.items():
            lines += [f"# HELP {prefix}_{name} {text}", f"# TYPE {prefix}_{name} gauge", f"{prefix}_{name} {value}"]
        with self.lock:
            lines += [f"# HELP {prefix}_requests_finished_total Requests ended, by finish reason.",
                      f"# TYPE {prefix}_requests_finished_total counter"]
            lines += [f'{prefix}_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            for name, value, text in (("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of ended requests."),
                                      ("generation_tokens_total", self.generation_tokens, "Tokens generated.")):
                lines += [f"# HELP {prefix}_{name} {text}", f"# TYPE {prefix}_{name} counter", f"{prefix}_{name} {value}"]
            for name, hist, text in (("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                                     ("time_per_output_token_seconds", self.tpot, "Mean gap between output tokens."),
                                     ("request_latency_seconds", self.latency, "Arrival to last token.")):
                lines += [f"# HELP {prefix}_{name} {text}", f"# TYPE {prefix}_{name} histogram"]
                lines += hist.lines(f"{prefix}_{name}")
        return "\n".join(lines) + "\n"
