"""A key/value cache that grows in place: GrowingLayer writes a step into spare room at the end of its buffers
(a quarter of the length, MIN_ROOM to MAX_ROOM positions) instead of torch.cat's copy of the whole cache, and hands
out strided views, which only models that read them in place (`cache_grows_in_place`) get from new_cache. The own
model gets the project's Cache, its keys and values in float16 (the native stack rounds them as it writes them and
widens them as it reads them: half the bytes of float32), transformers' models a DynamicCache in their dtype
(float16 too where their attention is the native one: `cache_reads_float16`; transformers is imported only then).

Sliding-window layers are full-attention layers too (the mask applies the window), so every layer is one [batch,
heads, length, dim] pair the engine can pad, merge and trim. The own model's (its native stack reads a layer from
any position on) let go of the positions their window no longer reaches: a SlidingLayer holds the last ones only.
Transformers' models hold every position (docs/server.md).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

MIN_ROOM, MAX_ROOM = 32, 512  # positions a row
RINGS_ENV = "RUN_GENERATION_RINGS"  # 0: the sliding layers hold every position (fixed slots: not a ring)
KV_FLOAT32_ENV = "RUN_GENERATION_KV_FLOAT32"  # 1: the own model's cache in float32, not float16


def own_dtype() -> torch.dtype:
    """The own model's keys and values: float16 (half float32's bytes; llama.cpp's cache holds them so), or float32
    where RUN_GENERATION_KV_FLOAT32=1 (the bits of transformers' float32 cache)."""
    return torch.float32 if os.environ.get(KV_FLOAT32_ENV) == "1" else torch.float16


class Growing:
    """GrowingLayer's growing over a base with DynamicLayer's attributes: update writes into spare room."""

    def __init__(self, dtype: torch.dtype | None = None):
        """dtype: what the buffers hold (the states converted as they are written); None: the states' own."""
        super().__init__()
        self.buffers = None  # (keys, values) [batch, heads, capacity, dim]; self.keys/values view their start
        self.held_dtype = dtype

    def held(self) -> int:
        """The positions the buffers hold (a SlidingLayer's last ones of its length)."""
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.reserve(key_states, value_states)
        length, new = self.held(), key_states.shape[-2]  # (after reserve: a SlidingLayer's may let go of some)
        keys[..., length:length + new, :].copy_(key_states)
        values[..., length:length + new, :].copy_(value_states)
        self.keys, self.values = keys[..., :length + new, :], values[..., :length + new, :]
        return self.keys, self.values

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The buffers (keys, values), holding the layer's states at their start, with room for states of the given
        shapes, moved into larger ones if need be."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.held(), key_states.shape[-2]
        if not self._writable(key_states, value_states, length + new):
            room = min(MAX_ROOM, max(MIN_ROOM, (length + new) // 4))
            buffers = []
            for held, states in ((self.keys, key_states), (self.values, value_states)):
                buffer = states.new_empty((*states.shape[:-2], length + new + room, states.shape[-1]),
                                          dtype=self.held_dtype or states.dtype)
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
        if (keys.shape[-2] < needed or keys.shape[:-2] != key_states.shape[:-2]
                or keys.dtype != (self.held_dtype or key_states.dtype)):
            return False
        held = self.keys.numel() == 0 or (self.keys.data_ptr() == keys.data_ptr()
                                          and self.values.data_ptr() == values.data_ptr()
                                          and self.keys.stride() == keys.stride())
        return held and values.shape == keys.shape[:-1] + value_states.shape[-1:]

    def room_until(self) -> int:
        """The length up to which the layer takes states with no reserve() (its buffers' room)."""
        return self.buffers[0].shape[-2] if self.buffers is not None else 0

    def take(self, keys: torch.Tensor, values: torch.Tensor, held: int):
        """Holds the first `held` positions of these buffers and grows into the rest (the caller gives them up)."""
        self.lazy_initialization(keys, values)
        self.buffers = (keys, values)
        self.keys, self.values = keys[..., :held, :], values[..., :held, :]

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
        self.dtype, self.device = getattr(self, "held_dtype", None) or key_states.dtype, key_states.device
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


class SlidingLayer(GrowingLayer):
    """A sliding-window layer of the own Cache that lets go of the positions its window no longer reaches: its
    keys/values are the last ones of its length, `dropped` positions before them. It keeps the window and MIN_ROOM
    more (a row's last token fed by a step run ahead, a step run again), and lets go a stride of positions at once,
    into smaller buffers: one copy of the window a stride of steps. The native stack reads it from position
    `dropped` on; the engine's merge and trim keep it so."""

    def __init__(self, window: int, dtype: torch.dtype | None = None):
        super().__init__(dtype)
        self.window, self.dropped = window, 0
        self.keep = window - 1 + MIN_ROOM  # the positions it never lets go of
        self.stride = min(MAX_ROOM, max(MIN_ROOM, window // 4))

    def get_seq_length(self) -> int:
        return self.dropped + self.held()

    def room_until(self) -> int:
        # (reserve lets go of a stride where the length reaches the window's keep and a stride past `dropped`)
        return self.dropped + min(super().room_until(), self.keep + self.stride)

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor):
        held = self.held()
        if held - self.keep >= self.stride:
            buffers = []
            for kept in (self.keys, self.values):
                buffer = kept.new_empty((*kept.shape[:-2], self.keep + key_states.shape[-2] + self.stride,
                                         kept.shape[-1]))
                buffer[..., : self.keep, :].copy_(kept[..., held - self.keep:, :])
                buffers.append(buffer)
            self.take(*buffers, self.keep)
            self.dropped += held - self.keep
        return super().reserve(key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        """As Layer.crop; a ValueError where the positions kept would not reach back a window from the new end."""
        length = self.get_seq_length() + tokens_to_remove
        if self.dropped > max(0, length - self.window + 1):
            raise ValueError(f"a sliding layer that let go of its first {self.dropped} positions cannot go back to "
                             f"{length}")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self.dropped = 0
        super().reset()


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


@functools.cache
def transformers_hybrid_layer() -> type:
    """GrowingLayer's growing on transformers' hybrid layer (LinearAttentionAndFullAttentionLayer: Falcon-H1's),
    its recurrent states kept as that layer keeps them."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    return type("GrowingHybridLayer", (Growing, LinearAttentionAndFullAttentionLayer),
                {"__doc__": GrowingLayer.__doc__})


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
    return GrowingLayer(own_dtype()) if isinstance(layer, Layer) else transformers_layer()()


def dummy(layer) -> bool:
    """Whether `layer` is transformers' DummyLayer: no keys and values of its own (Gemma 4 E2B/E4B's last layers
    read an earlier layer's)."""
    return type(layer).__name__ == "DummyLayer"


@functools.cache
def _class_names(kind: type) -> frozenset[str]:
    """The names of the classes a cache layer's type is one of (its MRO), read once a type: every step asks."""
    return frozenset(base.__name__ for base in kind.__mro__)


def recurrent(layer) -> bool:
    """Whether `layer` is transformers' LinearAttentionLayer of one state: a row's window of the last positions'
    convolution inputs and (Qwen3.5's Gated DeltaNet layers; not LFM2's short convolutions) its recurrent state; no
    keys and values, but where it is a hybrid layer's (Falcon-H1's, its attention beside its Mamba-2 mixer)."""
    return "LinearAttentionLayer" in _class_names(type(layer)) and layer.number_of_states == 1


def hybrid(layer) -> bool:
    """Whether `layer` holds keys and values beside a recurrent state (transformers' LinearAttentionAndFullAttention
    Layer: Falcon-H1's)."""
    return recurrent(layer) and "DynamicLayer" in _class_names(type(layer))


def holding(cache) -> list:
    """The cache's layers that hold keys and values: all but DummyLayers and recurrent ones (a hybrid one's too)."""
    return [layer for layer in cache.layers if not dummy(layer) and (not recurrent(layer) or hybrid(layer))]


def layers_of(cache):
    """[(keys, values)] of each layer that holds them (holding)."""
    return [(layer.keys, layer.values) for layer in holding(cache)]


def states_of(cache) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """[(convolution window, recurrent state)] of each recurrent layer of `cache`, a row each (None: one it keeps
    none of)."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers if recurrent(layer)]


def each_state(states, function) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """`function` of each of states_of's tensors (None stays None)."""
    return [tuple(None if part is None else function(part) for part in state) for state in states]


def put_states(cache, states) -> None:
    """Gives the recurrent layers of a new `cache` their rows' `states` (states_of's), as after a prompt's pass."""
    for layer, (window, state) in zip([layer for layer in cache.layers if recurrent(layer)], states, strict=True):
        layer.lazy_initialization(conv_states=window, recurrent_states=state,
                                  conv_kernel_size=None if window is None else window.shape[-1])
        for held, given in ((layer.conv_states[0], window), (layer.recurrent_states[0], state)):
            if given is not None:
                held.copy_(given)
        layer.has_previous_state[0] = True  # (the next pass reads the window)


def sliding_windows(model: torch.nn.Module) -> list[int]:
    """Each layer's window where the own model's sliding layers let go of what it no longer reaches (0: a layer of
    every position); none where RUN_GENERATION_RINGS=0."""
    windows = list(getattr(model, "windows", ()) or ()) if getattr(model, "own_cache", False) else []
    if not windows or os.environ.get(RINGS_ENV, "1") == "0":
        return [0] * model.config.num_hidden_layers
    return windows


def fill(layer, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """layer.update(keys, values) into an empty layer standing for `length` positions: a SlidingLayer's last ones."""
    layer.update(keys, values)
    stand_for(layer, keys.shape[-2], length)


def stand_for(layer, held: int, length: int) -> None:
    """Makes a layer holding `held` positions stand for `length`: a SlidingLayer's last ones (raises for another)."""
    if held != length:
        if not isinstance(layer, SlidingLayer):
            raise ValueError(f"a layer of every position takes all {length} of them, not {held}")
        layer.dropped = length - held


def new_cache(model: torch.nn.Module, layers=None, buffers=None, length: int | None = None):
    """A cache for `model`, filled with `layers` ([(keys, values)] per layer) when given: the own Cache (its sliding
    layers SlidingLayers), or a DynamicCache with sliding layers as full-attention ones (growing where
    `cache_grows_in_place`); in own_dtype() where `cache_reads_float16` (the model's attention is the native
    attend: the own model's, a GGUF file's on transformers' layers). `buffers`, whose starts hold `layers`: a growing
    cache takes them over instead of copying (the caller gives them up). `length`: the positions `layers` stand
    for (a sliding layer may hold the last ones only; default: the first layer's)."""
    dtype = own_dtype() if getattr(model, "cache_reads_float16", False) else None  # (None: the states' own)
    if getattr(model, "own_cache", False):
        grown = GrowingLayer  # (SlidingLayer is one)
        cache = Cache([SlidingLayer(window, dtype) if window else GrowingLayer(dtype)
                       for window in sliding_windows(model)])
    else:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

        cache = DynamicCache(config=model.config)
        kinds, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        grown = transformers_layer()
        grows = getattr(model, "cache_grows_in_place", False)
        full = functools.partial(grown, dtype) if grows else DynamicLayer
        cache.layers = [full() if type(layer) is DynamicLayer or kind == "sliding_attention" and not dummy(layer)
                        else transformers_hybrid_layer()(dtype) if grows and kind == "hybrid" else layer
                        for layer, kind in zip(cache.layers, kinds, strict=True)]
    if not layers:
        return cache
    length = layers[0][0].shape[-2] if length is None else length
    if buffers is not None and len(buffers) == len(cache.layers) and all(
            isinstance(layer, grown) for layer in cache.layers):
        for layer, (keys, values), (held, _) in zip(cache.layers, buffers, layers):
            layer.take(keys, values, held.shape[-2])
            stand_for(layer, held.shape[-2], length)
        return cache
    for layer, (keys, values) in zip(holding(cache), layers):
        fill(layer, keys, values, length)
    return cache
