"""Every decoder layer of a model in one native call (rungen_ggml.decoder_stack): the layers' tensors in its order
(StackWeights, StackMixtures) and the call over a cache's buffers (NativeStack), which the own model (model.py) calls
directly and decoder.py's DecoderStack installs as transformers' inner model's forward.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..kvcache import full_attention, growing, growing_like
from .blocks import GGMLLinear, GGMLParts
from .experts import NativeMixture


def native_parts(fused: GGMLLinear | GGMLParts, count: int | None = None) -> tuple[list, list]:
    """([blocks], [codes]) of a fused product's parts as the native calls take them, padded with zero-row parts
    to `count` when given."""
    parts = list(fused.parts) if isinstance(fused, GGMLParts) else [fused]
    blocks, codes = [p.blocks for p in parts], [p.code for p in parts]
    if count is not None:
        if len(parts) > count:
            raise ValueError(f"a fused product of {len(parts)} parts; the native stack takes {count}")
        blocks += [parts[0].blocks[:0]] * (count - len(parts))
        codes += [parts[0].code] * (count - len(parts))
    return blocks, codes


def fields_in_order(record) -> tuple:
    """A dataclass's fields as they are (dataclasses.astuple would copy each tensor), in their order."""
    return tuple(getattr(record, field.name) for field in dataclasses.fields(record))


# Parts a layer's q/k/v and gate/up products take in rungen_ggml.decoder_stack (its QKV_PARTS, GATE_UP_PARTS).
QKV_PARTS, GATE_UP_PARTS = 3, 2


@dataclasses.dataclass
class StackWeights:
    """The decoder layers' tensors in rungen_ggml.decoder_stack's order, each a list a layer."""

    input_norms: list
    qkv: list
    qkv_biases: list
    q_norms: list
    k_norms: list
    o: list
    mlp_norms: list
    gate_up: list
    down: list
    codes: list  # a layer's: its q/k/v parts', o's, its gate/up parts', down's

    @classmethod
    def of(cls, input_norms: list, qkv: list, q_norms: list, k_norms: list, o: list, mlp_norms: list, gate_up: list,
           down: list) -> StackWeights:
        """gate_up and down None for a layer without a dense MLP (a mixture's without a shared expert): parts of no
        rows, which cost nothing."""
        qkv_parts = [native_parts(product, QKV_PARTS) for product in qkv]
        gate_up_parts = [native_parts(product, GATE_UP_PARTS) if product is not None
                         else ([out.blocks[:0]] * GATE_UP_PARTS, [out.code] * GATE_UP_PARTS)
                         for product, out in zip(gate_up, o)]
        down_parts = [(product.blocks, product.code) if product is not None else (out.blocks[:0], out.code)
                      for product, out in zip(down, o)]
        return cls(input_norms, [b for blocks, _ in qkv_parts for b in blocks], [p.bias for p in qkv], q_norms,
                   k_norms, [p.blocks for p in o], mlp_norms, [b for blocks, _ in gate_up_parts for b in blocks],
                   [blocks for blocks, _ in down_parts],
                   [code for (_, qkv_codes), out, (_, gate_up_codes), (_, down_code)
                    in zip(qkv_parts, o, gate_up_parts, down_parts)
                    for code in (*qkv_codes, out.code, *gate_up_codes, down_code)])

    def args(self) -> tuple:
        """The fields in decoder_stack's order."""
        return fields_in_order(self)


# Stacks a mixture's layer passes rungen_ggml.decoder_stack (its EXPERT_PARTS): gate/up's parts, then down.
EXPERT_PARTS = GATE_UP_PARTS + 1


@dataclasses.dataclass
class StackMixtures:
    """The mixtures' tensors in rungen_ggml.decoder_stack's order (routers, experts, expert_qtypes, shared_gates,
    top_k, norm_topk); every list empty where no layer is a mixture. A dense layer passes None and empty stacks;
    a mixture's shared expert comes as its layer's gate/up and down (StackWeights)."""

    routers: list
    experts: list
    expert_codes: list
    shared_gates: list
    top_k: int = 0
    norm_topk: bool = False

    @classmethod
    def of(cls, mixtures: list[NativeMixture | None]) -> StackMixtures:
        present = [mixture for mixture in mixtures if mixture is not None]
        if not present:
            return cls([], [], [], [])
        empty = torch.empty(0, dtype=torch.uint8)
        routers, experts, codes, gates = [], [], [], []
        for mixture in mixtures:
            routers.append(None if mixture is None else mixture.router)
            gates.append(None if mixture is None else mixture.shared_gate)
            if mixture is None:
                experts += [empty] * EXPERT_PARTS
                codes += [0] * EXPERT_PARTS
                continue
            *gate_up, down = mixture.experts
            *gate_up_codes, down_code = mixture.expert_codes
            missing = GATE_UP_PARTS - len(gate_up)
            experts += [*gate_up, *[gate_up[0][:, :0]] * missing, down]
            codes += [*gate_up_codes, *[gate_up_codes[0]] * missing, down_code]
        return cls(routers, experts, codes, gates, present[0].top_k, present[0].norm_topk)

    def args(self) -> tuple:
        """The fields in decoder_stack's order."""
        return fields_in_order(self)


class NativeStack:
    """Every decoder layer of a model in one native call (rungen_ggml.decoder_stack), writing keys and values
    straight into a cache's GrowingLayer buffers."""

    def __init__(self, weights: StackWeights, eps: float, scale: float, heads: int, kv_heads: int, head_dim: int,
                 out_norms: tuple[list, list] = ([], []), windows: list[int] = (), softcap: float = 0.0,
                 gelu: bool = False, mixtures: StackMixtures | None = None, rotary: list[int] = (),
                 residual_scale: float = 1.0):
        """eps: every norm's; scale: the attention scores'. gemma's additions (defaults for llama): out_norms,
        windows (0: none), softcap (0: none), gelu; its norm weights come as 1 + weight. mixtures: the layers'
        mixtures of experts (none by default); rotary: whether each layer rotates q and k (SmolLM3's every fourth
        does not; empty: all do); residual_scale: what the attention's and the MLP's outputs are multiplied by
        before each residual sum (Granite's residual_multiplier)."""
        self.weights, self.eps, self.scale = weights, eps, scale
        self.weight_args = weights.args()  # once: a step passes them as they are
        self.mixture_args = (mixtures or StackMixtures([], [], [], [])).args()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.out_norms, self.windows = (list(out_norms[0]), list(out_norms[1])), list(windows)
        self.softcap, self.gelu, self.rotary = float(softcap), bool(gelu), list(rotary)
        self.residual_scale = float(residual_scale)
        # (weakref to the cache, its keys' addresses, positions held, least room_until): lets a step skip reserve().
        self.last = None

    @property
    def num_layers(self) -> int:
        return len(self.weights.input_norms)

    def takes(self, cache) -> bool:
        """Whether the stack can run on `cache`: one full-attention layer (transformers' or a GrowingLayer) per
        decoder layer."""
        layers = getattr(cache, "layers", None)
        return bool(layers) and len(layers) == self.num_layers and all(
            full_attention(layer) for layer in layers)

    def __call__(self, hidden: torch.Tensor, cache, mask: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, local: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The hidden states after the last layer, the cache extended; None (nothing done) when the cache's layers
        hold different lengths. `mask`: None for causal; `local`: windowed layers' cos/sin where they differ."""
        layers = cache.layers
        for index, layer in enumerate(layers):
            if not growing(layer):  # generate()'s own cache: moved into buffers with room
                grown = growing_like(layer)
                if layer.get_seq_length():
                    grown.update(layer.keys, layer.values)
                layers[index] = grown
        batch, tokens = hidden.shape[:2]
        length = layers[0].get_seq_length()
        last = self.last
        if (last is not None and last[0]() is cache and last[2] == length and length + tokens <= last[3]
                and [layer.keys.data_ptr() for layer in layers] == last[1]):
            buffers = [layer.buffers for layer in layers]  # as this call left them, with room enough
        else:
            shape = hidden.new_empty((batch, self.kv_heads, tokens, self.head_dim))  # the new states' shape
            buffers = [layer.reserve(shape, shape) for layer in layers]
            if any(layer.get_seq_length() != length for layer in layers):
                return None
        # A sliding layer's buffers start at the first position it holds (kvcache.SlidingLayer)
        dropped = [getattr(layer, "dropped", 0) for layer in layers] if self.windows else []
        hidden, keys, values = torch.ops.rungen_ggml.decoder_stack(
            hidden, cos, sin, mask, *self.weight_args, self.eps, self.heads, self.kv_heads, self.scale,
            [k for k, _ in buffers], [v for _, v in buffers], length, *self.out_norms, self.windows,
            *(local or (None, None)), self.softcap, self.gelu, *self.mixture_args, self.rotary, dropped,
            self.residual_scale)
        for layer, k, v in zip(layers, keys, values):
            layer.keys, layer.values = k, v
        self.last = (weakref.ref(cache), [k.data_ptr() for k in keys], length + tokens,
                     min(layer.room_until() for layer in layers))
        return hidden
