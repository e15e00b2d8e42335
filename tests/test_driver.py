"""The layer driver (`quantkit.calibration.driver`): hooks, early stop, cache keyword, outputs."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calibration.driver import drive_layer, without_cache


class Layer(nn.Module):
    """A decoder-layer-shaped module: two linears in a row, and a cache it updates when given one."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls: list[dict] = []

    def forward(self, hidden, past_key_values=None, use_cache=None, scale=1.0):
        self.calls.append({"cache": past_key_values, "use_cache": use_cache, "scale": scale})
        h = self.a(hidden) * scale
        if past_key_values is not None:
            past_key_values.update(h, h, 0)
        return (self.b(h),)


def test_outputs_hooks_and_batches():
    torch.manual_seed(0)
    layer = Layer()
    hidden = [torch.randn(2, 3, 4), torch.randn(1, 3, 4)]
    kwargs = [{"scale": 2.0, "use_cache": False}, {"scale": 0.5, "use_cache": False}]
    seen_a, after_b, told = [], [], []
    outs = drive_layer(layer, hidden, kwargs, pre_hooks=[(layer.a, lambda m, args: seen_a.append(args[0].shape[0]))],
                       hooks=[(layer.b, lambda m, args, kw, out: after_b.append(out.shape[0]))],
                       before_batch=lambda i, h: told.append((i, h.shape[0])), outputs=[])
    assert seen_a == [2, 1] and after_b == [2, 1] and told == [(0, 2), (1, 1)]
    with torch.no_grad():
        assert all(torch.equal(o, layer(h, **kw)[0]) for o, h, kw in zip(outs, hidden, kwargs))
    assert not layer.a._forward_pre_hooks and not layer.b._forward_hooks  # every hook removed
    assert drive_layer(layer, hidden, kwargs) is None  # nothing kept unless asked


def test_early_stop_skips_what_follows():
    layer = Layer()
    ran_b = []
    layer.b.register_forward_pre_hook(lambda m, args: ran_b.append(1))
    seen = []
    drive_layer(layer, [torch.randn(1, 2, 4)] * 3, [{}] * 3, pre_hooks=[(layer.a, lambda m, a: seen.append(1))],
                stop_when_seen=[layer.a])
    assert seen == [1, 1, 1] and ran_b == []  # b never ran: each batch stopped once a had its input


def test_a_cache_replaces_the_captured_cache_arguments():
    class Observer:
        def __init__(self):
            self.updates = 0

        def update(self, k, v, idx, *args, **kwargs):
            self.updates += 1
            return k, v

    layer, observer = Layer(), Observer()
    drive_layer(layer, [torch.randn(1, 2, 4)] * 2, [without_cache({"past_key_values": "stale", "scale": 3.0})] * 2,
                cache=observer)
    assert observer.updates == 2
    assert layer.calls == [{"cache": observer, "use_cache": None, "scale": 3.0}] * 2


def test_without_cache():
    assert without_cache({"cache": 1, "past_key_values": 2, "past_key_value": 3, "mask": 4}) == {"mask": 4,
                                                                                                   "use_cache": False}
