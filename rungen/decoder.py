"""Llama-family decoder layers over GGUF blocks, in a few operators a step.

transformers' LlamaDecoderLayer runs about 80 torch operators a token (the norms' casts and reductions,
rotate_half's slices and concatenations, three separate q/k/v products, ...), each 3-5 µs of dispatch on a
CPU: at one token a step of a small model they cost more than its matmuls. FusedDecoderLayer computes the
same function with one product for q/k/v and one for gate/up (their rows concatenated once, at load), and
the native kernels' rms_norm, rope_split, silu_mul and attend for what lies between. The key/value cache and
the attention masks stay transformers' (Cache.update, the mask the model passes in), so generate() and
everything built on it work unchanged; a sliding-window layer attends through transformers' attention
interface.

The float arithmetic differs from transformers' only in summation order and fused multiply-adds:
tests/unit/test_decoder.py holds it to transformers' own layer within float32 rounding. The attention visits
each query's keys in order and skips the masked ones, so a sequence gets the same bits alone and left-padded
in a batch, which torch's attention kernels do not promise.
"""

from __future__ import annotations

import torch

from .ggml import GGMLLinear, concat, native_kernels

# Decoder layers whose forward is LlamaDecoderLayer's: pre-norm attention with rotary q/k, then a SiLU-gated
# MLP (mistral and qwen2 add a sliding window, passed to the attention as they pass it; qwen2 q/k/v biases).
FUSABLE = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
# The weights FusedDecoderLayer concatenates (q/k/v, gate/up), by the endings of their parameter names.
FUSED_WEIGHTS = tuple(f".{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))


class FusedDecoderLayer(torch.nn.Module):
    """A LlamaDecoderLayer (or a same-shaped one) with fused q/k/v and gate/up products over GGUF blocks."""

    def __init__(self, layer: torch.nn.Module, qkv: GGMLLinear, gate_up: GGMLLinear):
        super().__init__()
        attention, config = layer.self_attn, layer.self_attn.config
        self.qkv, self.o_proj = qkv, attention.o_proj
        self.gate_up, self.down_proj = gate_up, layer.mlp.down_proj
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        # What transformers' attention interface reads from the module it is given.
        self.config, self.layer_idx, self.is_causal = config, attention.layer_idx, True
        self.num_key_value_groups, self.scaling = attention.num_key_value_groups, attention.scaling
        self.sliding_window = getattr(attention, "sliding_window", None)
        if self.sliding_window is None and type(layer).__name__ == "MistralDecoderLayer":
            self.sliding_window = getattr(config, "sliding_window", None)
        # Every product in blocks, no bias but q/k/v's, full attention: the layer runs as two native calls.
        self.two_calls = self.sliding_window is None and all(
            isinstance(p, GGMLLinear) and p.bias is None for p in (self.o_proj, self.down_proj))

    @classmethod
    def fuse(cls, layer: torch.nn.Module) -> FusedDecoderLayer | None:
        """The fused layer, or None when `layer` is not one this class computes (another architecture, an
        activation other than SiLU, projections in different block types)."""
        if type(layer).__name__ not in FUSABLE or getattr(layer.self_attn.config, "hidden_act", None) != "silu":
            return None
        attention, mlp = layer.self_attn, layer.mlp
        parts = [attention.q_proj, attention.k_proj, attention.v_proj], [mlp.gate_proj, mlp.up_proj]
        if not all(isinstance(p, GGMLLinear) for group in parts for p in group):
            return None
        if any(p.bias is not None for p in parts[1]) or getattr(attention.o_proj, "bias", None) is not None:
            return None
        qkv, gate_up = concat(parts[0]), concat(parts[1])
        if qkv is None or gate_up is None:
            return None
        return cls(layer, qkv, gate_up)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        native = native_kernels()
        if native and self.two_calls:
            return self._two_calls(hidden_states, attention_mask, past_key_values, position_embeddings)
        batch, tokens, _ = hidden_states.shape
        x = rms_norm(hidden_states, self.input_layernorm, native)
        cos, sin = position_embeddings
        q, k, v = rope_split(product(self.qkv, x, native), cos, sin, self.heads, self.kv_heads, native)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if native and self.sliding_window is None:
            # One call, and the same bits with or without padding beside the sequence (torch's kernels block
            # the keys differently once padding shifts them): a greedy text is the same alone and in a batch.
            attended = torch.ops.rungen_ggml.attend(q, k, v, attention_mask, self.scaling)
        else:
            attended = self._attention(q, k, v, attention_mask, kwargs).reshape(batch, tokens, -1)
        hidden_states = hidden_states + product(self.o_proj, attended, native)
        x = rms_norm(hidden_states, self.post_attention_layernorm, native)
        return hidden_states + product(self.down_proj, silu_mul(product(self.gate_up, x, native), native), native)

    def _two_calls(self, hidden_states, attention_mask, past_key_values, position_embeddings):
        """forward's arithmetic, in the same order, as rungen_ggml's attention_in and attention_out_mlp."""
        ops, (cos, sin) = torch.ops.rungen_ggml, position_embeddings
        qkv, gate_up, o, down = self.qkv, self.gate_up, self.o_proj, self.down_proj
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        q, k, v = ops.attention_in(hidden_states, norm1.weight, norm1.variance_epsilon, qkv.blocks, qkv.qtype,
                                   qkv.bias, cos, sin, self.heads, self.kv_heads)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        return ops.attention_out_mlp(hidden_states, q, k, v, attention_mask, self.scaling, o.blocks, o.qtype,
                                     norm2.weight, norm2.variance_epsilon, gate_up.blocks, gate_up.qtype,
                                     down.blocks, down.qtype)

    def _attention(self, q, k, v, attention_mask, kwargs):
        """transformers' attention interface of the model's implementation (sdpa, eager, ...)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        if self.sliding_window is not None:
            kwargs = dict(kwargs, sliding_window=self.sliding_window)
        return attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)[0]


def product(layer: torch.nn.Module, x: torch.Tensor, native: bool) -> torch.Tensor:
    """layer(x); for a GGMLLinear with the native kernels, its product called directly (a module call and
    its reshapes cost more than the operator's own work at one token)."""
    if not native or not isinstance(layer, GGMLLinear):
        return layer(x)
    y = layer._matmul(x.reshape(-1, layer.in_features))
    y = y.view(*x.shape[:-1], layer.out_features)
    return y if layer.bias is None else y + layer.bias


def fusable(model: torch.nn.Module) -> bool:
    """Whether `model`'s decoder layers are of a kind FusedDecoderLayer computes, in float32 (the native
    kernels' steps compute in float32); a layer's own weights decide the rest (FusedDecoderLayer.fuse)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and type(layers[0]).__name__ in FUSABLE and model.dtype == torch.float32


def fuse_decoder_layers(model: torch.nn.Module) -> int:
    """Replaces every decoder layer of `model` that FusedDecoderLayer computes; returns how many it replaced."""
    if not fusable(model):
        return 0
    layers, replaced = model.model.layers, 0
    for index, layer in enumerate(layers):
        fused = FusedDecoderLayer.fuse(layer)
        if fused is not None:
            layers[index] = fused
            replaced += 1
    return replaced


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, native: bool) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x, by `norm`'s weight and epsilon."""
    if native:
        return torch.ops.rungen_ggml.rms_norm(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, native: bool):
    """q [b, heads, t, d], k and v [b, kv_heads, t, d] of the fused product [b, t, (heads + 2 kv_heads) d],
    q and k rotated as transformers' apply_rotary_pos_emb rotates them."""
    if native:
        return torch.ops.rungen_ggml.rope_split(qkv, cos, sin, heads, kv_heads)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, tokens, features = qkv.shape
    heads_all = qkv.view(batch, tokens, heads + 2 * kv_heads, features // (heads + 2 * kv_heads)).transpose(1, 2)
    q, k, v = heads_all.split([heads, kv_heads, kv_heads], dim=1)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v.contiguous()


def silu_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up product (gate first)."""
    if native:
        return torch.ops.rungen_ggml.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
