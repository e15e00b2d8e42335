"""quantkit.platform.transformers_compat: the cache keyword read from the forward's signature (transformers renamed
`past_key_values` to `cache` within 5.x; a cache under a name the forward does not take is silently ignored)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.platform.transformers_compat import cache_keyword, cache_kwargs


class _New(nn.Module):
    def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
        return cache


class _Old(nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


class _Neither(nn.Module):
    def forward(self, input_ids, **kwargs):
        return kwargs


def _renamed(fn):  # like transformers' deprecate_kwarg: a wrapper that keeps the signature through functools.wraps
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class _Decorated(nn.Module):
    @_renamed
    def forward(self, input_ids, cache=None, **kwargs):
        return cache


def test_the_keyword_each_signature_takes():
    assert cache_keyword(_New()) == "cache" and cache_keyword(_Old()) == "past_key_values"
    assert cache_keyword(_Decorated()) == "cache"
    marker = object()
    for module in (_New(), _Old(), _Decorated()):
        assert module(None, **cache_kwargs(module, marker)) is marker  # the cache reaches the forward


def test_a_forward_without_a_cache_is_an_error_not_a_guess():
    with pytest.raises(TypeError, match="_Neither.forward takes no cache"):
        cache_keyword(_Neither())


def test_a_wrapped_instance_forward_does_not_hide_the_class_signature():
    module = _Old()
    inner = module.forward
    module.forward = lambda *a, **k: inner(*a, **k)  # as a forward wrapper would (*args, **kwargs)
    assert cache_keyword(module) == "past_key_values"


def test_the_installed_transformers_models_name_their_cache():
    config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    for module in (model, model.model, model.model.layers[0]):
        assert cache_keyword(module) in ("cache", "past_key_values")
    # the keyword found is the one that fills the cache: a second call sees the first one's tokens
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(model.model, cache))
    assert cache.get_seq_length() == 3
