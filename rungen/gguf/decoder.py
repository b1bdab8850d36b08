"""Decoder layers over GGUF blocks in a few native operators a step (llama's and the families of
rungen/gguf/families.py), in place of transformers' dozens (docs/kernels.md).

FusedDecoderLayer does one product for q/k/v and one for gate/up (GGMLParts where block types differ) and the
native rms_norm, rope_split, silu_mul/gelu_tanh_mul and attend between them (a mixture's MLP: NativeMixture's one
call); the cache and masks stay transformers', so generate() works unchanged. A model whose layers are all in blocks
and alike runs them as one NativeStack call a step (stack.py; DecoderStack installs it). The arithmetic differs
from transformers' only in summation order and fused multiply-adds (tests/unit/test_decoder.py); attend visits each
query's keys in order, so a sequence gets the same bits alone and left-padded in a batch, which torch's attention
kernels do not promise.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch

from ..host_memory import release_freed_memory
from .blocks import GGMLLinear, GGMLParts, join, native_products
from .experts import NativeMixture
from .families import BY_LAYER_CLASS
from .kernels import native_kernels
from .stack import GATE_UP_PARTS, QKV_PARTS, NativeStack, StackMixtures, StackWeights, native_parts

# FusedDecoderLayer's attributes that hold norms (None where a family has no such norm).
NORMS = ("input_layernorm", "mlp_norm", "attention_out_norm", "mlp_out_norm", "q_norm", "k_norm")
# The weights FusedDecoderLayer concatenates (q/k/v, gate/up), by the endings of their parameter names.
FUSED_WEIGHTS = tuple(sorted({f".{name}.weight" for family in BY_LAYER_CLASS.values()
                              for group in (family.qkv, family.gate_up) if len(group) > 1 for name in group}))


class FusedDecoderLayer(torch.nn.Module):
    """A LlamaDecoderLayer (or a layer of another family of the table) with fused q/k/v and gate/up products over
    GGUF blocks."""

    def __init__(self, layer: torch.nn.Module, qkv: GGMLLinear | GGMLParts, gate_up: GGMLLinear | GGMLParts | None):
        super().__init__()
        family = BY_LAYER_CLASS[type(layer).__name__]
        attention, config = layer.self_attn, layer.self_attn.config
        self.qkv, self.o_proj = qkv, attention.o_proj
        # A mixture's MLP (gate_up None) stays transformers' module, which the native kernels compute in one call
        # where they can (mixture: within float32 rounding of the module).
        self.mlp = layer.mlp if gate_up is None else None
        self.mixture = NativeMixture.of(layer.mlp) if gate_up is None else None
        self.gate_up, self.down_proj = gate_up, None if gate_up is None else layer.mlp.down_proj
        self.qkv_parts = native_parts(qkv)
        self.gate_up_parts = native_parts(gate_up) if gate_up is not None else ([], [])
        self.activation = getattr(config, family.activation)
        self.input_layernorm, self.mlp_norm = layer.input_layernorm, getattr(layer, family.mlp_norm)
        self.attention_out_norm, self.mlp_out_norm = (None if name is None else getattr(layer, name)
                                                      for name in (family.attention_out_norm, family.mlp_out_norm))
        self.q_norm, self.k_norm = (getattr(attention, name) for name in family.head_norms) if family.head_norms \
            else (None, None)
        # (weight, epsilon) by attribute name (names survive a deep copy); gemma's weight as 1 + weight, once.
        self.native_norms = {name: (norm.weight.detach() + family.norm_offset if family.norm_offset else norm.weight,
                                    norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)
                             for name in NORMS if (norm := getattr(self, name)) is not None}
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        # What transformers' attention interface reads from the module it is given.
        self.config, self.layer_idx, self.is_causal = config, attention.layer_idx, True
        self.num_key_value_groups, self.scaling = attention.num_key_value_groups, attention.scaling
        self.sliding_window = getattr(config if family.window_on_every_layer else attention, "sliding_window", None)
        self.rotates = bool(getattr(attention, "use_rope", True))  # (SmolLM3's every fourth layer: no rotary)
        self.softcap = getattr(attention, "attn_logit_softcapping", None)
        self.residual = getattr(layer, "residual_multiplier", 1.0)  # (Granite's: each branch's output times it)
        # The family's own eager attention (gemma2's soft-caps the logits).
        self.eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        # in_blocks: can be one of a NativeStack's layers (a dense MLP in blocks, or a native mixture); two_calls:
        # also llama-plain and dense, so two native calls.
        self.in_blocks = (self.mlp is None or self.mixture is not None) and all(
            isinstance(p, GGMLLinear) and p.bias is None for p in (self.o_proj, self.down_proj) if p is not None)
        self.two_calls = self.in_blocks and self.mlp is None and self.sliding_window is None and (
            self.softcap is None and self.activation == "silu" and self.attention_out_norm is None
            and self.mlp_out_norm is None and self.residual == 1.0)

    @classmethod
    def fuse(cls, layer: torch.nn.Module) -> FusedDecoderLayer | None:
        """The fused layer, or None when `layer` is not one this class computes (another architecture, an
        activation without a native step, projections not all in blocks)."""
        family = BY_LAYER_CLASS.get(type(layer).__name__)
        if family is None or getattr(layer.self_attn.config, family.activation, None) not in ACTIVATIONS:
            return None
        attention, mlp = layer.self_attn, layer.mlp
        parts = ([getattr(attention, name) for name in family.qkv],
                 [] if family.mixture else [getattr(mlp, name) for name in family.gate_up])
        if not all(isinstance(p, GGMLLinear) for group in parts for p in group):
            return None
        if any(p.bias is not None for p in parts[1]) or getattr(attention.o_proj, "bias", None) is not None:
            return None
        qkv, gate_up = (group[0] if len(group) == 1 else join(group) if group else None for group in parts)
        if qkv is None or (gate_up is None and not family.mixture):
            return None
        return cls(layer, qkv, gate_up)

    def norm_args(self, name: str) -> tuple:
        """(weight, epsilon) of the norm held as attribute `name`, for the native ops; (None, 0.0) for none."""
        return self.native_norms.get(name, (None, 0.0))

    def head_norm_args(self) -> tuple:
        """The native ops' (q_norm, k_norm, norm_eps): the per-head norms' weights, or None for families without."""
        (q, eps), (k, _) = self.norm_args("q_norm"), self.norm_args("k_norm")
        return q, k, eps

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        native = native_kernels()
        if native and self.two_calls:
            return self._two_calls(hidden_states, attention_mask, past_key_values, position_embeddings)
        batch, tokens, _ = hidden_states.shape
        x = self._norm(hidden_states, "input_layernorm", native)
        cos, sin = position_embeddings if self.rotates else unrotated(position_embeddings)
        qkv = product(self.qkv, x, native)
        if native:
            q, k, v = torch.ops.rungen_ggml.rope_split(qkv, cos, sin, self.heads, self.kv_heads,
                                                       *self.head_norm_args())
        else:
            q, k, v = rope_split(qkv, cos, sin, self.heads, self.kv_heads, self.q_norm, self.k_norm)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if native:
            # The same bits with or without padding; the kernel applies the window and soft cap too (0: none).
            attended = torch.ops.rungen_ggml.attend(q, k, v, attention_mask, self.scaling, self.softcap or 0.0,
                                                    self.sliding_window or 0)
        else:
            attended = self._attention(q, k, v, attention_mask, kwargs).reshape(batch, tokens, -1)
        out = product(self.o_proj, attended, native)
        if self.attention_out_norm is not None:
            out = self._norm(out, "attention_out_norm", native)
        hidden_states = hidden_states + self._scaled(out)
        x = self._norm(hidden_states, "mlp_norm", native)
        if self.mlp is not None:
            out = self.mixture(x) if native and self.mixture is not None and native_products() else self.mlp(x)
        else:
            out = product(self.down_proj, ACTIVATIONS[self.activation](product(self.gate_up, x, native), native),
                          native)
        if self.mlp_out_norm is not None:
            out = self._norm(out, "mlp_out_norm", native)
        return hidden_states + self._scaled(out)

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A branch's output as its residual sum takes it (Granite's times residual_multiplier)."""
        return out if self.residual == 1.0 else out * self.residual

    def _norm(self, x: torch.Tensor, name: str, native: bool) -> torch.Tensor:
        """RMSNorm of x by the norm held as attribute `name`."""
        return torch.ops.rungen_ggml.rms_norm(x, *self.norm_args(name)) if native else getattr(self, name)(x)

    def _two_calls(self, hidden_states, attention_mask, past_key_values, position_embeddings):
        """forward's arithmetic, in the same order, as rungen_ggml's attention_in and attention_out_mlp."""
        ops = torch.ops.rungen_ggml
        cos, sin = position_embeddings if self.rotates else unrotated(position_embeddings)
        qkv, o, down = self.qkv, self.o_proj, self.down_proj
        q, k, v = ops.attention_in(hidden_states, *self.norm_args("input_layernorm"), *self.qkv_parts,
                                   qkv.bias, cos, sin, self.heads, self.kv_heads, *self.head_norm_args())
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        return ops.attention_out_mlp(hidden_states, q, k, v, attention_mask, self.scaling, o.blocks, o.code,
                                     *self.norm_args("mlp_norm"), *self.gate_up_parts, down.blocks, down.code)

    def _attention(self, q, k, v, attention_mask, kwargs):
        """transformers' attention interface of the model's implementation (sdpa, eager, ...)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                       self.eager or eager_attention_forward)
        if self.sliding_window is not None:
            kwargs = dict(kwargs, sliding_window=self.sliding_window)
        if self.softcap is not None:
            kwargs = dict(kwargs, softcap=self.softcap)
        return attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)[0]


def product(layer: torch.nn.Module, x: torch.Tensor, native: bool) -> torch.Tensor:
    """layer(x); a GGMLLinear's (GGMLParts') product called directly, skipping the module call's overhead."""
    if not native or not isinstance(layer, (GGMLLinear, GGMLParts)):
        return layer(x)
    y = layer._matmul(x.reshape(-1, layer.in_features))
    y = y.view(*x.shape[:-1], layer.out_features)
    return y if layer.bias is None else y + layer.bias


def fusable(model: torch.nn.Module) -> bool:
    """Whether `model`'s decoder layers are of a kind FusedDecoderLayer computes, in float32 (the kernels' dtype)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and type(layers[0]).__name__ in BY_LAYER_CLASS and model.dtype == torch.float32


def fuse_decoder_layers(model: torch.nn.Module) -> int:
    """Fuses every decoder layer of `model` it can (a DecoderStack when all are); returns how many."""
    if not fusable(model):
        return 0
    layers, replaced = model.model.layers, 0
    for index in range(len(layers)):
        fused = FusedDecoderLayer.fuse(layers[index])
        if fused is not None:
            layers[index] = fused  # the separate q/k/v and gate/up leave with the layer
            replaced += 1
            release_freed_memory()
    if not DecoderStack.install(model) and replaced == len(layers) and all(layer.mlp is not None for layer in layers):
        # A mixture's fused layers read keys and values in place (the native attend takes strided views): its cache
        # grows into buffers with room (rungen.kvcache.new_cache), where a DynamicCache copies itself every step.
        model.cache_grows_in_place = True
        model.cache_reads_float16 = native_kernels()  # (the torch fallback's attention reads float32)
    return replaced


def native_stack(layers: list[FusedDecoderLayer]) -> NativeStack:
    """The stack of these fused layers (all in blocks, alike: see DecoderStack.install)."""
    first = layers[0]
    mixtures = [layer.mixture for layer in layers]
    # A mixture's layer passes its shared expert (if any) where a dense layer passes its MLP.
    mlps = [(layer.gate_up, layer.down_proj) if mixture is None else (mixture.shared_gate_up, mixture.shared_down)
            for layer, mixture in zip(layers, mixtures)]
    weights = StackWeights.of([layer.norm_args("input_layernorm")[0] for layer in layers],
                              [layer.qkv for layer in layers], [layer.head_norm_args()[0] for layer in layers],
                              [layer.head_norm_args()[1] for layer in layers], [layer.o_proj for layer in layers],
                              [layer.norm_args("mlp_norm")[0] for layer in layers],
                              [gate_up for gate_up, _ in mlps], [down for _, down in mlps])
    head_dim = first.qkv.out_features // (first.heads + 2 * first.kv_heads)
    out_norms = tuple([layer.norm_args(name)[0] for layer in layers]
                      if any(layer.norm_args(name)[0] is not None for layer in layers) else []
                      for name in ("attention_out_norm", "mlp_out_norm"))
    windows = [layer.sliding_window or 0 for layer in layers]
    rotary = [int(layer.rotates) for layer in layers]
    return NativeStack(weights, first.norm_args("input_layernorm")[1], first.scaling, first.heads, first.kv_heads,
                       head_dim, out_norms, windows if any(windows) else [], first.softcap or 0.0,
                       first.activation == "gelu_pytorch_tanh", StackMixtures.of(mixtures),
                       [] if all(rotary) else rotary, first.residual)


class DecoderStack:
    """A NativeStack installed as a transformers model's inner forward: the same functions in the same order (the
    same bits) as the layers one by one. What it does not cover (attention maps or hidden states, no cache or
    another kind, --jit's tracing, the torch fallback) goes to transformers' forward over the same fused layers."""

    def __init__(self, inner: torch.nn.Module, layers: list[FusedDecoderLayer]):
        self.inner, self.original = inner, inner.forward
        self.stack = native_stack(layers)
        self.embedding_multiplier = getattr(inner, "embedding_multiplier", None)  # (GraniteModel's)
        # gemma3's (full, sliding) layer types to ask the rotary embedding for, else None (one rotation).
        self.rotary_types = None
        if "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters:
            kinds = set(inner.config.layer_types)
            self.rotary_types = ("full_attention" if "full_attention" in kinds else "sliding_attention",
                                 "sliding_attention" if "sliding_attention" in kinds else None)

    @classmethod
    def install(cls, model: torch.nn.Module) -> bool:
        """Runs `model`'s decoder layers as one stack when all are FusedDecoderLayers in blocks and alike (windows
        may differ); returns whether it did."""
        inner = model.model
        layers = list(inner.layers)
        if not layers or len(layers) != model.config.num_hidden_layers or not all(
                isinstance(layer, FusedDecoderLayer) and layer.in_blocks
                and len(layer.qkv_parts[0]) <= QKV_PARTS and len(layer.gate_up_parts[0]) <= GATE_UP_PARTS
                for layer in layers):
            return False
        first = layers[0]
        routings = {(layer.mixture.top_k, layer.mixture.norm_topk) for layer in layers if layer.mixture is not None}
        # The stack takes one epsilon for every norm, one routing for every mixture.
        if len(routings) > 1 or any(
               (layer.heads, layer.kv_heads, layer.scaling, layer.activation, layer.softcap, layer.residual)
               != (first.heads, first.kv_heads, first.scaling, first.activation, first.softcap, first.residual)
               or (layer.q_norm is None) != (first.q_norm is None)
               or {eps for _, eps in layer.native_norms.values()} != {first.norm_args("input_layernorm")[1]}
               for layer in layers):
            return False
        inner.forward = cls(inner, layers)  # an instance attribute: Module.__call__ finds it before the method
        model.cache_grows_in_place = True  # rungen.kvcache.new_cache gives it GrowingLayers
        model.cache_reads_float16 = native_kernels()  # (the torch fallback's attention reads float32)
        return True

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

        inner, cache = self.inner, past_key_values
        use_cache = inner.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=inner.config)
        if (not use_cache or not native_kernels() or torch.jit.is_tracing()
                or (input_ids is None) == (inputs_embeds is None)
                or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
                or kwargs.get("output_router_logits")
                or not self.stack.takes(cache)):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        embedded = inner.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = embedded if self.embedding_multiplier is None else embedded * self.embedding_multiplier
        tokens = hidden.shape[1]
        length = cache.layers[0].get_seq_length()
        if position_ids is None:
            position_ids = (torch.arange(tokens, device=hidden.device) + length).unsqueeze(0)
        if attention_mask is None or bool(attention_mask.all()):
            # No padding: the native causal default visits only the keys it needs.
            mask = None
        else:
            mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      past_key_values=cache, position_ids=position_ids)
        local = None
        if self.rotary_types is None:
            cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        else:
            cos, sin = inner.rotary_emb(hidden, position_ids, self.rotary_types[0])
            if self.rotary_types[1] is not None:
                local = inner.rotary_emb(hidden, position_ids, self.rotary_types[1])
        out = self.stack(hidden, cache, mask, cos, sin, local)
        if out is None:  # layers cut differently: one by one
            return self.original(input_ids=None, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=embedded, use_cache=use_cache, **kwargs)
        # (a mixture's model returns its router logits too, None here: its causal LM reads the field)
        output = MoeModelOutputWithPast if self.stack.mixture_args[0] else BaseModelOutputWithPast
        return output(last_hidden_state=inner.norm(out), past_key_values=cache)


@contextlib.contextmanager
def products_one_by_one(model: torch.nn.Module):
    """Within it, `model`'s fused layers take each product through its GGMLLinear module (whose _matmul a caller
    may replace), not the native layer and stack calls."""
    inner = model.model
    stack = inner.__dict__.get("forward")
    layers = [layer for layer in inner.layers if isinstance(layer, FusedDecoderLayer)]
    saved = [layer.two_calls for layer in layers]
    try:
        if isinstance(stack, DecoderStack):
            inner.forward = stack.original
        for layer in layers:
            layer.two_calls = False
        yield model
    finally:
        for layer, two_calls in zip(layers, saved):
            layer.two_calls = two_calls
        if isinstance(stack, DecoderStack):
            inner.forward = stack


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               q_norm: torch.nn.Module | None = None, k_norm: torch.nn.Module | None = None):
    """q [b, heads, t, d], k and v [b, kv_heads, t, d] of the fused product, q and k normalized per head when
    given, then rotated as apply_rotary_pos_emb does: the native rope_split on torch's operators."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as apply_partial

    batch, tokens, features = qkv.shape
    head_dim = features // (heads + 2 * kv_heads)
    heads_all = qkv.view(batch, tokens, heads + 2 * kv_heads, head_dim)
    if cos.shape[-1] != head_dim:
        apply_rotary_pos_emb = apply_partial
    q, k, v = heads_all.split([heads, kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2).contiguous()


def unrotated(position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos 1 and sin 0 in position_embeddings' shapes: a layer without rotary (x * 1 - y * 0: x as it is)."""
    cos, sin = position_embeddings
    return torch.ones_like(cos), torch.zeros_like(sin)


def silu_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up product (gate first)."""
    if native:
        return torch.ops.rungen_ggml.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:
    """gelu(gate) * up with GELU's tanh approximation (gemma's gelu_pytorch_tanh) of the fused gate/up product."""
    if native:
        return torch.ops.rungen_ggml.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# The MLP activations FusedDecoderLayer computes, by the name transformers' configs give them.
ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
