"""transformers' own decoder layers over a GGUF file's blocks, for the families FusedDecoderLayer does not take
(gpt-oss's, Gemma 4's, OLMo 2's and 3's, OLMoE's, Ministral 3's, EXAONE 4's, GLM-4.5's, AFMoE's, Llama 4's,
MiniMax-M2's, HY V3's), with their small steps on the native kernels on the CPU: the attention (native_attention,
over a cache growing in place; q/k/v one product, their rotation (Gemma 4's, EXAONE 4's, GLM-4.5's, AFMoE's, Llama
4's and HY V3's: and per-head norms; OLMo's and MiniMax-M2's norms over all heads before it) one rope_split call),
each RMSNorm one rms_norm call, a gated MLP's gate and up one product and its activation one call. The arithmetic is
transformers' within float32 rounding (a norm's 1 / sqrt where Gemma 4 takes pow(-0.5), sums in another order).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..host_memory import release_freed_memory
from .blocks import GGMLLinear, join
from .decoder import ACTIVATIONS, unrotated
from .kernels import native_kernels
from .layer_loop import LayerLoop

# The attention interface name transformers' layers find native_attention under (and the eager masks it takes).
NATIVE_ATTENTION = "rungen_attend"

# The models of transformers' layers over blocks whose small steps this module takes.
NATIVE_STEPS_MODELS = ("GptOssForCausalLM", "Gemma4ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                       "Ministral3ForCausalLM", "Exaone4ForCausalLM", "Glm4MoeForCausalLM", "AfmoeForCausalLM",
                       "OlmoeForCausalLM", "Llama4ForCausalLM", "MiniMaxM2ForCausalLM", "HYV3ForCausalLM",
                       "Dots1ForCausalLM")
# Their RMSNorm classes: x / sqrt(mean(x^2) + eps) times the weight (none: 1), in float32.
NORMS = ("GptOssRMSNorm", "Gemma4RMSNorm", "Olmo2RMSNorm", "Olmo3RMSNorm", "Ministral3RMSNorm", "Exaone4RMSNorm",
         "Glm4MoeRMSNorm", "AfmoeRMSNorm", "OlmoeRMSNorm", "Llama4TextRMSNorm", "MiniMaxM2RMSNorm", "HYV3RMSNorm",
         "Dots1RMSNorm")
# Their dense gated MLPs: down(act(gate(x)) * up(x)) (GLM-4.5's, AFMoE's and Llama 4's: their dense layers' and
# shared experts).
GATED_MLPS = ("Gemma4TextMLP", "Olmo2MLP", "Olmo3MLP", "Ministral3MLP", "Exaone4MLP", "Glm4MoeMLP", "AfmoeMLP",
              "Llama4TextMLP", "HYV3MLP", "Dots1MLP")
# Their attention NativeGemma4Attention computes (the others': JOINED_ATTENTIONS, below).
GEMMA4_ATTENTIONS = ("Gemma4TextAttention",)


def native_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float, dropout: float = 0.0, sliding_window: int | None = None, softcap=None,
                     s_aux=None, **kwargs):
    """transformers' attention interface as the native attend computes it: the keys and values read where they lie
    (a cache growing in place hands out views), grouped heads without repeat_kv's copies (8 of each key for
    gpt-oss's 64 heads over 8), each head's sink logit (gpt-oss's `s_aux`) in its softmax; (output [b, t, heads *
    dim], None) as the eager interface returns them."""
    out = torch.ops.rungen_ggml.attend(query, key, value, attention_mask, scaling, softcap or 0.0,
                                       sliding_window or 0, s_aux)
    return out.to(query.dtype), None


class NativeRMSNorm(torch.nn.Module):
    """An RMSNorm of NORMS as one rms_norm call (a norm without a weight, Gemma 4's v_norm and router norm: ones)."""

    def __init__(self, weight: torch.Tensor | None, eps: float):
        super().__init__()
        self.register_buffer("weight", None if weight is None else weight.detach().float(), persistent=False)
        self.eps, self.ones = eps, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None:  # (made once a width: setdefault's argument would be made at every call)
            weight = self.ones.get(x.shape[-1])
            if weight is None:
                weight = self.ones[x.shape[-1]] = torch.ones(x.shape[-1])
        return torch.ops.rungen_ggml.rms_norm(x, weight, self.eps).to(x.dtype)


class NativeGatedMLP(torch.nn.Module):
    """A gated MLP of GATED_MLPS over blocks: gate and up one product (their rows joined), the activation of the
    product one call, then down."""

    def __init__(self, gate_up: torch.nn.Module, down_proj: torch.nn.Module, activation: str):
        super().__init__()
        self.gate_up, self.down_proj, self.activation = gate_up, down_proj, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_up(x), True))


class NativeGemma4Attention(torch.nn.Module):
    """Gemma 4's attention (Gemma4TextAttention) over blocks: q, k and v one product (`qkv`; a full layer without
    v_proj takes its keys as values, before their norm), q and k normalized per head and rotated in one rope_split
    call, v normalized per head (no weight) in one rms_norm, then the cache, native_attention and o_proj as the
    module does; a layer reusing an earlier layer's keys and values (E2B/E4B's last ones) computes its q alone."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module | None):
        super().__init__()
        self.attention, self.qkv = attention, qkv
        self.heads = attention.config.num_attention_heads
        self.kv_heads = 0 if attention.is_kv_shared_layer else attention.k_proj.out_features // attention.head_dim
        self.keys_as_values = not attention.is_kv_shared_layer and attention.v_proj is None
        if qkv is not None:  # the separate products leave: their rows are qkv's
            attention.q_proj = attention.k_proj = attention.v_proj = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, shared_kv_states,
                past_key_values=None, **kwargs):
        a, ops = self.attention, torch.ops.rungen_ggml
        cos, sin = position_embeddings
        q_norm = a.q_norm.weight
        if a.is_kv_shared_layer:
            q, _, _ = ops.rope_split(a.q_proj(hidden_states), cos, sin, self.heads, 0, q_norm, None, a.q_norm.eps)
            key_states, value_states = shared_kv_states[a.layer_type]
        else:
            qkv = self.qkv(hidden_states)
            if self.keys_as_values:
                qkv = torch.cat([qkv, qkv[..., -self.kv_heads * a.head_dim:]], dim=-1)
            q, key_states, v = ops.rope_split(qkv, cos, sin, self.heads, self.kv_heads, q_norm, a.k_norm.weight,
                                              a.q_norm.eps)
            value_states = a.v_norm(v)
            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, a.layer_idx)
        if a.store_full_length_kv:
            shared_kv_states[a.layer_type] = key_states, value_states
        out, _ = native_attention(a, q, key_states, value_states, attention_mask, a.scaling,
                                  sliding_window=a.sliding_window)
        return a.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class JoinedAttention(torch.nn.Module):
    """An attention over blocks whose q, k and v are one product (`qkv`; the module's separate products leave): a
    subclass computes q, k and v; `attended` takes them through the cache, native_attention and o_proj as the
    module does."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module):
        super().__init__()
        self.attention, self.qkv = attention, qkv
        self.heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads
        attention.q_proj = attention.k_proj = attention.v_proj = None  # (their rows are qkv's)

    @property
    def o_proj(self) -> torch.nn.Module:
        """The module's output projection (a family naming it otherwise: its subclass says)."""
        return self.attention.o_proj

    def attended(self, hidden_states, q, key_states, value_states, attention_mask, past_key_values, sliding_window,
                 s_aux=None, gate=None):
        """(o_proj's output, None); `gate`: the attention's output times sigmoid(gate) before o_proj."""
        a = self.attention
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, a.layer_idx)
        out, _ = native_attention(a, q, key_states, value_states, attention_mask, a.scaling,
                                  sliding_window=sliding_window, s_aux=s_aux)
        out = out.reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate)), None


class NativeGptOssAttention(JoinedAttention):
    """gpt-oss's attention (GptOssAttention): q, k and v (with their biases) rotated in one rope_split call (gpt-oss
    rotates each head's first half against its second, rope_split's rotate_half, by cos/sin of half a head: given
    twice), each head's sink logit in the attention."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        cos, sin = (torch.cat([half, half], dim=-1) for half in position_embeddings)
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), cos, sin, self.heads, self.kv_heads)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, a.sliding_window, a.sinks)


class NativeOlmoAttention(JoinedAttention):
    """OLMo 2's, 3's, OLMoE's and MiniMax-M2's attention (Olmo2Attention, Olmo3Attention, OlmoeAttention,
    MiniMaxM2Attention): q and k each normalized over all their heads (the module's norms, native by now), then the
    three split and q and k rotated in one rope_split call (MiniMax-M2's first half of each head: the model's cos and
    sin as wide); OLMo 3's sliding layers with their window."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module):
        super().__init__(attention, qkv)
        self.widths = [self.heads * attention.head_dim] + [self.kv_heads * attention.head_dim] * 2

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        q, k, v = self.qkv(hidden_states).split(self.widths, dim=-1)
        q, k, v = torch.ops.rungen_ggml.rope_split(torch.cat([a.q_norm(q), a.k_norm(k), v], dim=-1),
                                                   *position_embeddings, self.heads, self.kv_heads)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values,
                             getattr(a, "sliding_window", None))


class NativeMinistral3Attention(JoinedAttention):
    """Ministral 3's attention (Ministral3Attention): q, k and v split and q and k rotated (its yarn's cos and sin,
    as the model hands them) in one rope_split call, q times llama 4's temperature at each position (transformers'
    get_llama_4_attn_scale: 1 within the original context)."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module):
        super().__init__(attention, qkv)
        from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

        self.temperature = get_llama_4_attn_scale

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, position_ids,
                past_key_values=None, **kwargs):
        a, rope = self.attention, self.attention.config.rope_parameters
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), *position_embeddings, self.heads,
                                                   self.kv_heads)
        q = q * self.temperature(position_ids, rope.get("llama_4_scaling_beta"),
                                 rope.get("original_max_position_embeddings")).to(q.dtype)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values,
                             getattr(a.config, "sliding_window", None))


class NativeExaone4Attention(JoinedAttention):
    """EXAONE 4's attention (Exaone4Attention), HY V3's and dots.llm1's (HYV3Attention, Dots1Attention: every layer
    rotating, none sliding): q, k and v split, q and k normalized per head and rotated in one rope_split call (a full
    layer beside sliding ones turned by cos 1 and sin 0: no rotary, as the module skips it); a sliding layer's
    window."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module):
        super().__init__(attention, qkv)
        self.sliding = getattr(attention, "is_sliding", False)
        self.rotates = getattr(attention, "sliding_window", None) is None or self.sliding

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        cos, sin = position_embeddings if self.rotates else unrotated(position_embeddings)
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), cos, sin, self.heads, self.kv_heads,
                                                   a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values,
                             a.sliding_window if self.sliding else None)


class NativeAfmoeAttention(JoinedAttention):
    """AFMoE's attention (AfmoeAttention): EXAONE 4's (q, k and v split, q and k normalized per head and, in a
    sliding layer, rotated in one rope_split call; a full layer turned by cos 1 and sin 0: no rotary, as the module
    skips it; a sliding layer's window), its output times the sigmoid of its gate's product before o_proj."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        cos, sin = position_embeddings if a.is_local_attention else unrotated(position_embeddings)
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), cos, sin, self.heads, self.kv_heads,
                                                   a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, a.sliding_window,
                             gate=a.gate_proj(hidden_states))


class NativeGlm4MoeAttention(JoinedAttention):
    """GLM-4.5's attention (Glm4MoeAttention): q, k and v (with their biases) split, q and k normalized per head where
    the model has those norms and the first part of each head rotated by halves (the model's cos and sin as wide as
    that part) in one rope_split call."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        norms = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.use_qk_norm else ()
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), *position_embeddings, self.heads,
                                                   self.kv_heads, *norms)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, None)


class NativeGraniteAttention(JoinedAttention):
    """Granite's attention (GraniteMoeAttention, GraniteMoeSharedAttention; GraniteMoeHybridAttention without
    rotary): q, k and v split and q and k rotated in one rope_split call (no rotary: by cos 1 and sin 0), the scores
    scaled by the module's scaling (attention_multiplier)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        qkv = self.qkv(hidden_states)
        if position_embeddings is None:
            still = qkv.new_ones(*qkv.shape[:-1], self.attention.head_dim)
            position_embeddings = still, torch.zeros_like(still)
        q, k, v = torch.ops.rungen_ggml.rope_split(qkv, *position_embeddings, self.heads, self.kv_heads)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, None)


class QueryPositions:
    """The positions of the tokens a forward of a model's inner model takes [rows or 1, tokens] (position_ids, else
    after the cache's, as its forward counts them), kept for its attentions (Llama 4's chunks and temperature): a
    forward pre-hook of the inner model."""

    def __init__(self):
        self.value, self.last = None, 0  # (the positions, and the largest of them: read a layer, found once)

    def __call__(self, module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            tokens = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
            cache = kwargs.get("past_key_values")
            positions = (torch.arange(tokens) + (cache.get_seq_length() if cache is not None else 0))[None]
        self.value, self.last = positions, int(positions.max())


class NativeLlama4Attention(JoinedAttention):
    """Llama 4's attention (Llama4TextAttention): q, k and v split and, in a layer with rotary, q and k L2-normalized
    per head where the model says (use_qk_norm) and rotated in one rope_split call. Its rotary turns each pair of a
    head's values as a complex number, which is rope_split's rotation by halves of the head's values gathered evens
    first, then odds (q and k gathered alike: their products unchanged; a norm before the turn the same as after it,
    which keeps each pair's length). A layer without rotary: by cos 1 and sin 0, no norm, no gather, its queries
    times the temperature 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)) where tuned; a layer with
    rotary attends within its chunk of attention_chunk_size positions (the config's layers all read as full ones, so
    that the engine's batches hold them): both from the queries' positions (`positions`, QueryPositions), the keys'
    counted back from each row's last (its cache's keys end at its last query), and nothing changed before the first
    chunk's last position."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module, positions: QueryPositions):
        super().__init__(attention, qkv)
        dim, rotates, config = attention.head_dim, bool(attention.use_rope), attention.config
        pairs = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
        heads = (self.heads + self.kv_heads) if rotates else 0  # (q's and k's heads, then v's columns as they are)
        self.order = None if not rotates else torch.cat(
            [(head * dim + pairs) for head in range(heads)] + [torch.arange(heads * dim, qkv.out_features)])
        self.norms = rotates and bool(getattr(config, "use_qk_norm", False))
        self.ones, self.positions = torch.ones(dim), positions
        self.chunk = config.attention_chunk_size if rotates else None
        self.temperature = None if rotates or not config.attn_temperature_tuning else (
            config.floor_scale, config.attn_scale)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        qkv = self.qkv(hidden_states)
        if self.order is None:
            cos, sin = unrotated((qkv.new_ones(*qkv.shape[:-1], a.head_dim),) * 2)
        else:
            qkv = qkv.index_select(-1, self.order)
            freqs = position_embeddings.to(torch.complex64)
            cos, sin = (torch.cat([part, part], dim=-1).to(qkv.dtype) for part in (freqs.real, freqs.imag))
        norms = (self.ones, self.ones, a.qk_norm.eps) if self.norms else ()
        q, k, v = torch.ops.rungen_ggml.rope_split(qkv, cos, sin, self.heads, self.kv_heads, *norms)
        positions = self.positions.value.to(q.device)
        if self.temperature is not None and self.positions.last + 1 >= self.temperature[0]:
            floor_scale, scale = self.temperature
            tuned = torch.log1p(torch.floor((positions.float() + 1) / floor_scale)) * scale + 1
            q = q * tuned[:, None, :, None].to(q.dtype)  # ([rows, heads, tokens, head])
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, a.layer_idx)
        if self.chunk is not None and self.positions.last >= self.chunk:
            attention_mask = self.chunked(attention_mask, positions, k.shape[-2], q.dtype)
        out, _ = native_attention(a, q, k, v, attention_mask, a.scaling)
        return a.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    def chunked(self, mask, positions: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """`mask` (additive [rows, 1, queries, keys], None: causal) with the keys before each query's chunk out."""
        held = positions[:, -1:] - (keys - 1 - torch.arange(keys, device=positions.device))  # [rows, keys]
        out = (held[:, None, :] < (positions // self.chunk * self.chunk)[:, :, None])[:, None]
        if mask is None:
            out = out | (held[:, None, None, :] > positions[:, None, :, None])
            return torch.zeros(out.shape, dtype=dtype, device=positions.device).masked_fill_(
                out, torch.finfo(dtype).min)
        return mask.masked_fill(out, torch.finfo(mask.dtype).min)


# transformers' attentions whose q, k and v products the native steps join, and the class computing each.
JOINED_ATTENTIONS = {"GptOssAttention": NativeGptOssAttention, "Olmo2Attention": NativeOlmoAttention,
                     "Olmo3Attention": NativeOlmoAttention, "OlmoeAttention": NativeOlmoAttention,
                     "Ministral3Attention": NativeMinistral3Attention, "Exaone4Attention": NativeExaone4Attention,
                     "Glm4MoeAttention": NativeGlm4MoeAttention, "AfmoeAttention": NativeAfmoeAttention,
                     "MiniMaxM2Attention": NativeOlmoAttention, "HYV3Attention": NativeExaone4Attention,
                     "Dots1Attention": NativeExaone4Attention}


class GpuKernelHints(logging.Filter):
    """Drops transformers' hint that a CUDA kernel package (causal-conv1d, flash-linear-attention, mamba-ssm) is
    missing: on the CPU its PyTorch forms are what runs Qwen3.5's, LFM2's and Granite 4.0 H's recurrent layers (a
    decode step of the first two native)."""

    LOGGER = "transformers.integrations.hub_kernels"
    MESSAGE = "is falling back to its reference PyTorch implementation"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.MESSAGE not in record.getMessage()

    @classmethod
    def quiet(cls) -> None:
        """Adds the filter to transformers' logger (once)."""
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(existing, cls) for existing in logger.filters):
            logger.addFilter(cls())


def scan_inputs(cache_params, layer: int, products: torch.Tensor, kernel: int,
                state_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A recurrent layer's prompt scan's inputs (delta_steps.py's and granite_steps.py's): its convolution's inputs,
    the products [batch, positions, channels] after the cache's window as the module's own forward takes them
    (update_conv_state, which keeps the new window), and a float32 copy of the layer's state (zeros where the cache
    holds none, or without a cache), which the scan updates and the caller gives back (update_recurrent_state)."""
    state = None
    if cache_params is not None:
        state = cache_params.get_recurrent_state(layer, state_idx=0)
        products = cache_params.update_conv_state(products.transpose(1, 2), layer,
                                                  conv_kernel_size=kernel).transpose(1, 2)
    return products, torch.zeros(state_shape) if state is None else state.float().clone()


def attend_natively(model: torch.nn.Module) -> None:
    """Gives transformers' layers of `model` native_attention (under NATIVE_ATTENTION, with eager masks) and a cache
    that grows in place, in float16 (what the native attend reads in place)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NATIVE_ATTENTION, native_attention)
    AttentionMaskInterface.register(NATIVE_ATTENTION, eager_mask)
    model.config._attn_implementation = NATIVE_ATTENTION
    model.cache_grows_in_place = True
    model.cache_reads_float16 = True


def native_norms(model: torch.nn.Module, classes: tuple[str, ...], offset: float = 0.0) -> None:
    """Each RMSNorm of `classes` in `model` as NativeRMSNorm, its weight plus `offset` (Qwen3.5's 1 + weight, once;
    a norm without a weight: ones)."""
    for name in [name for name, module in model.named_modules() if type(module).__name__ in classes]:
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if weight is not None and offset:
            weight = offset + weight.detach().float()
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        model.set_submodule(name, NativeRMSNorm(weight, eps))


def join_attention(model: torch.nn.Module, name: str, kind: type[JoinedAttention]) -> None:
    """The attention at `name` in `model` as `kind` over one product of its q, k and v where they are blocks join
    takes (the separate blocks' pages given back before the caller's next join); else left as it is."""
    module = model.get_submodule(name)
    parts = [module.q_proj, module.k_proj, module.v_proj]
    qkv = join(parts) if all(type(part) is GGMLLinear for part in parts) else None
    if qkv is not None:
        model.set_submodule(name, kind(module, qkv))
    del module, parts
    release_freed_memory()


def join_gated_mlp(model: torch.nn.Module, name: str, activation: str,
                   parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """The dense gated MLP at `name` in `model` (its gate, up and down products named `parts`) as NativeGatedMLP
    where its gate and up are blocks join takes (the separate blocks' pages given back before the caller's next
    join); else left as it is."""
    module = model.get_submodule(name)
    gate, up, down = (getattr(module, part) for part in parts)
    if activation not in ACTIVATIONS or not all(type(part) is GGMLLinear for part in (gate, up)):
        return
    gate_up = join([gate, up])
    if gate_up is not None:
        model.set_submodule(name, NativeGatedMLP(gate_up, down, activation))
        del module, gate, up
        release_freed_memory()


def native_layers(model: torch.nn.Module, norms: tuple[str, ...], replacers: dict, norm_offset: float = 0.0) -> None:
    """Gives transformers' layers of `model` native_attention and a cache growing in place, each RMSNorm of `norms`
    NativeRMSNorm (native_norms, its weight plus `norm_offset`), then each module whose class name is a key of
    `replacers` to that function (model, name) in module order (the attentions read their q and k norms' weights as
    these hold them), and its decode steps to one LayerLoop where the family has a row of layer_loop.LOOPS. A module
    at a time, by name: a list of the modules would keep every replaced one's blocks until the end, where a joined
    product's old blocks go, their pages given back, before the next is joined."""
    attend_natively(model)
    native_norms(model, norms, norm_offset)
    for name in [name for name, module in model.named_modules() if type(module).__name__ in replacers]:
        replacers[type(model.get_submodule(name)).__name__](model, name)
    LayerLoop.install(model)


def gemma4_attention(model: torch.nn.Module, name: str) -> None:
    """Gemma 4's attention at `name` as NativeGemma4Attention where its q (and, in a layer of its own keys, k and v:
    one product) are blocks; else left as it is."""
    module = model.get_submodule(name)
    shared = module.is_kv_shared_layer
    parts = [module.q_proj] if shared else [p for p in (module.q_proj, module.k_proj, module.v_proj) if p]
    qkv = None if shared or not all(type(part) is GGMLLinear for part in parts) else join(parts)
    if type(module.q_proj) is GGMLLinear and (shared or qkv is not None):
        model.set_submodule(name, NativeGemma4Attention(module, qkv))
    del module, parts
    release_freed_memory()


def steps_natively(model: torch.nn.Module) -> bool:
    """Gives a model of NATIVE_STEPS_MODELS its layers' steps native (native_layers): its norms NativeRMSNorm, its
    gated MLPs and attentions over blocks NativeGatedMLP and NativeGemma4Attention or JOINED_ATTENTIONS' class, where
    the native kernels are; returns whether. Its decode steps then one LayerLoop (Gemma 4's layers have no row)."""
    if not native_kernels() or type(model).__name__ not in NATIVE_STEPS_MODELS:
        return False
    text = model.config.get_text_config(decoder=True)
    activation = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)
    llama4 = {}
    if type(model).__name__ == "Llama4ForCausalLM":  # (its attentions read the queries' positions)
        positions = QueryPositions()
        model.model.register_forward_pre_hook(positions, with_kwargs=True)
        llama4 = {"Llama4TextAttention": functools.partial(
            join_attention, kind=functools.partial(NativeLlama4Attention, positions=positions))}
    native_layers(model, NORMS, {
        **dict.fromkeys(GATED_MLPS, functools.partial(join_gated_mlp, activation=activation)),
        **dict.fromkeys(GEMMA4_ATTENTIONS, gemma4_attention),
        **{name: functools.partial(join_attention, kind=kind) for name, kind in JOINED_ATTENTIONS.items()}, **llama4})
    # (Llama 4's: its chunks and temperature attended where every attention is native, its context then the file's)
    model.attends_positions = bool(llama4) and all(
        isinstance(layer.self_attn, NativeLlama4Attention) for layer in model.model.layers)
    return True
