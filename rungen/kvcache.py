"""A key/value cache that grows in place: GrowingLayer writes a step into spare room at the end of its buffers
(a quarter of the length, MIN_ROOM to MAX_ROOM positions) instead of torch.cat's copy of the whole cache, and hands
out strided views, which only models that read them in place (`cache_grows_in_place`) get from new_cache. The own
model gets the project's Cache, transformers' models a DynamicCache (transformers is imported only then).

Sliding-window layers get full-attention layers too: the mask applies the window, so every layer is one
[batch, heads, length, dim] pair the engine can pad, merge and trim; the cost is memory (docs/server.md).
"""

from __future__ import annotations

import functools
import sys

import torch

MIN_ROOM, MAX_ROOM = 32, 512  # positions a row


class Growing:
    """GrowingLayer's growing over a base with DynamicLayer's attributes: update writes into spare room."""

    def __init__(self):
        super().__init__()
        self.buffers = None  # (keys, values) [batch, heads, capacity, dim]; self.keys/values view their start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length, new = self.get_seq_length(), key_states.shape[-2]
        keys, values = self.reserve(key_states, value_states)
        keys[..., length:length + new, :].copy_(key_states)
        values[..., length:length + new, :].copy_(value_states)
        self.keys, self.values = keys[..., :length + new, :], values[..., :length + new, :]
        return self.keys, self.values

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The buffers (keys, values), holding the layer's states at their start, with room for states of the given
        shapes, moved into larger ones if need be."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._writable(key_states, value_states, length + new):
            room = min(MAX_ROOM, max(MIN_ROOM, (length + new) // 4))
            buffers = []
            for held, states in ((self.keys, key_states), (self.values, value_states)):
                buffer = states.new_empty((*states.shape[:-2], length + new + room, states.shape[-1]))
                if length:
                    buffer[..., :length, :].copy_(held)
                buffers.append(buffer)
            self.buffers = tuple(buffers)
        return self.buffers

    def _writable(self, key_states, value_states, needed: int) -> bool:
        """Whether the buffers hold self.keys/values at their start, fit the new states, and have `needed` room."""
        if self.buffers is None:
            return False
        keys, values = self.buffers
        if keys.shape[-2] < needed or keys.shape[:-2] != key_states.shape[:-2] or keys.dtype != key_states.dtype:
            return False
        held = self.keys.numel() == 0 or (self.keys.data_ptr() == keys.data_ptr()
                                          and self.values.data_ptr() == values.data_ptr()
                                          and self.keys.stride() == keys.stride())
        return held and values.shape == keys.shape[:-1] + value_states.shape[-1:]

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, length: int):
        """A layer that holds the first `length` positions of these buffers and grows into the rest."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.buffers = (keys, values)
        layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]
        return layer

    def reset(self) -> None:
        self.buffers = None
        super().reset()


class Layer:
    """What the own cache and the engine use of transformers' DynamicLayer: keys and values [batch, heads, length,
    dim]."""

    is_sliding = False

    def __init__(self):
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        return self.keys.shape[-2]

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -`tokens_to_remove` positions (a negative count, as DynamicLayer.crop takes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self.keys = self.keys[..., :tokens_to_remove, :]
            self.values = self.values[..., :tokens_to_remove, :]


class GrowingLayer(Growing, Layer):
    """A full-attention layer of the own Cache whose update writes into spare room instead of concatenating."""


class Cache:
    """The own model's cache: one GrowingLayer per decoder layer, with what the tool uses of DynamicCache."""

    def __init__(self, layers: list):
        self.layers = layers

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -`tokens_to_remove` positions of every layer (a negative count, as DynamicCache.crop)."""
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)


@functools.cache
def transformers_layer() -> type:
    """GrowingLayer for transformers' DynamicCache: the same growing on its DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    return type("GrowingDynamicLayer", (Growing, DynamicLayer), {"__doc__": GrowingLayer.__doc__})


def growing(layer) -> bool:
    """Whether `layer` grows in place (a GrowingLayer, in the own cache or in transformers')."""
    return isinstance(layer, Growing)


def full_attention(layer) -> bool:
    """Whether `layer` is a plain full-attention layer: growing, or exactly transformers' DynamicLayer."""
    if growing(layer):
        return True
    cache_utils = sys.modules.get("transformers.cache_utils")  # not imported: the layer cannot be one of its
    return cache_utils is not None and type(layer) is cache_utils.DynamicLayer


def growing_like(layer):
    """A new empty growing layer of the kind `layer`'s cache holds (the own one, or transformers')."""
    return GrowingLayer() if isinstance(layer, Layer) else transformers_layer()()


def dummy(layer) -> bool:
    """Whether `layer` is transformers' DummyLayer: no keys and values of its own (Gemma 4 E2B/E4B's last layers
    read an earlier layer's)."""
    return type(layer).__name__ == "DummyLayer"


def holding(cache) -> list:
    """The cache's layers that hold keys and values: all but DummyLayers."""
    return [layer for layer in cache.layers if not dummy(layer)]


def new_cache(model: torch.nn.Module, layers=None, buffers=None):
    """A cache for `model`, filled with `layers` ([(keys, values)] per layer) when given: the own Cache, or a
    DynamicCache with sliding layers as full-attention ones (growing where `cache_grows_in_place`). `buffers`,
    whose starts hold `layers`: a growing cache takes them over instead of copying (the caller gives them up)."""
    if getattr(model, "own_cache", False):
        grown = GrowingLayer
        cache = Cache([GrowingLayer() for _ in range(model.config.num_hidden_layers)])
    else:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

        cache = DynamicCache(config=model.config)
        kinds, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        grown = transformers_layer()
        full = grown if getattr(model, "cache_grows_in_place", False) else DynamicLayer
        cache.layers = [full() if type(layer) is DynamicLayer or kind == "sliding_attention" and not dummy(layer)
                        else layer for layer, kind in zip(cache.layers, kinds, strict=True)]
    if buffers is not None and len(buffers) == len(cache.layers) and all(
            type(layer) is grown for layer in cache.layers):
        length = layers[0][0].shape[-2]
        cache.layers = [grown.holding(keys, values, length) for keys, values in buffers]
        return cache
    for layer, (keys, values) in zip(holding(cache), layers or []):
        layer.update(keys, values)
    return cache
