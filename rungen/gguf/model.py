"""The own causal LM of a GGUF file of the families' table (rungen/gguf/families.py): embedding, one NativeStack call
for every layer, final norm and head, without importing transformers' model classes.

It computes the same function as transformers' model of the file fused by decoder.py, in the same order (the same
bits: tests/test_gguf_model.py), built straight from the header cache. What only transformers' model has (generate()'s
beam search and other generate()-only controls, --jit, the torch fallback, longrope) loads that model instead
(rungen/loading.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..host_memory import release_freed_memory
from ..kvcache import new_cache
from .blocks import (
    SUPPORTED,
    CastEmbedding,
    CastLinear,
    GGMLEmbedding,
    GGMLLinear,
    interleavable,
    weights_per_row,
)
from .decoder import ACTIVATIONS
from .experts import PARTS, NativeMixture, build_experts
from .families import BY_ARCHITECTURE, FAMILIES, NO_FAMILY, READ_AS
from .kernels import native_kernels
from .stack import NativeStack, StackMixtures, StackWeights
from .weights import GGUFError, WeightReader, unpermuted_order

# Rotary types whose frequencies are fixed at load (transformers' dynamic and longrope ones change with the length).
ROPE_TYPES = ("default", "linear", "llama3")
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
HEAD_NORMS = ("q_norm", "k_norm")  # read where the file has them


class Config:
    """The header cache's config.json as attributes, so a run need not import transformers' config classes."""

    dtype = None  # as PretrainedConfig's default: a file's config.json names none

    def __init__(self, fields: dict):
        self.fields = fields
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.fields)

    def get_text_config(self, decoder: bool = False) -> Config:
        return self


@dataclasses.dataclass
class GenerationDefaults:
    """The special-token ids of a generation_config, as GenerationConfig.from_model_config gives them."""

    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None


@dataclasses.dataclass
class CausalLMOutput:
    """What the engine and the scoring read of transformers' CausalLMOutputWithPast."""

    logits: torch.Tensor
    past_key_values: object = None


def read_config(cache_dir: str) -> Config:
    with open(os.path.join(cache_dir, "config.json")) as f:
        return Config(json.load(f))


def refusal(config: Config, header, weights_map: dict | None) -> str | None:
    """Why this model code cannot run the file (it then loads through transformers' classes), or None."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"its family {config.model_type} has no own model code"
    if weights_map is None:
        return "its weights map is not cached yet"
    if not native_kernels():
        return "the native kernels are not available"
    if activation(config) not in ACTIVATIONS:
        return f"its MLP's activation is {activation(config)}"
    if any(kind not in ("full_attention", "sliding_attention") for kind in getattr(config, "layer_types", None) or ()):
        return "some of its layers attend neither to every key nor in a sliding window"
    for layer_type, rope in rope_types(config).items():
        allowed = ROPE_TYPES if layer_type is None else ("default", "linear")  # what rotary_frequencies computes
        if rope.get("rope_type", "default") not in allowed:
            return f"its rotary embedding is {rope.get('rope_type')}"
        if rope.get("partial_rotary_factor", 1.0) != 1.0 and rope.get("rope_type", "default") != "default":
            return f"its rotary embedding is {rope.get('rope_type')} over part of each head"
    codes = {name: code for name, code, *_ in header.tensors}
    wanted = family.products()
    products = {gguf for gguf, hf in weights_map.items() if hf.endswith(tuple("." + name for name in wanted))}
    if len(products) != len(wanted) * config.num_hidden_layers:
        return "its file holds other layer weights"
    out_norms = tuple(f".{name}.weight" for name in (family.mlp_norm, family.attention_out_norm, family.mlp_out_norm))
    if family.out_norms and len({hf for hf in weights_map.values() if hf.endswith(out_norms)}) != len(
            out_norms) * config.num_hidden_layers:
        return "its file lacks some of gemma's layer norms"
    if any(codes.get(name) not in SUPPORTED for name in products):
        return "some of its layer weights are not in quantized blocks"
    if family.mixture:
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            return "some of its layers have a dense MLP"
        parts = [*PARTS, *(("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
                           if getattr(config, "shared_expert_intermediate_size", 0) else ())]
        if any(codes.get(f"blk.{index}.{part}.weight") not in SUPPORTED
               for index in range(config.num_hidden_layers) for part in parts):
            return "some of its experts are not in quantized blocks"
    if any(hf.endswith(".bias") and not hf.endswith(QKV_BIASES)
           for hf in weights_map.values()):
        return "some of its products have biases"
    return None


def activation(config: Config) -> str | None:
    """The MLP's activation as transformers' config names it (gemma's config: hidden_activation)."""
    return getattr(config, FAMILIES[config.model_type].activation, None)


def rope_types(config: Config) -> dict:
    """{layer type: its rope parameters} (gemma3's), else {None: the rope parameters}."""
    rope = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return {kind: params or {} for kind, params in rope.items()}
    return {None: rope}


def layer_windows(config: Config) -> list[int]:
    """Each decoder layer's sliding window (0: it attends to every key), as transformers' attention reads it."""
    window = getattr(config, "sliding_window", None) or 0
    layers = config.num_hidden_layers
    if not window:
        return [0] * layers
    if FAMILIES[config.model_type].window_on_every_layer:
        return [window] * layers
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [window if kind == "sliding_attention" else 0 for kind in kinds]


class GGUFCausalLM(torch.nn.Module):
    """A llama-shaped causal LM over a GGUF file's blocks, with what the tool reads of a transformers model
    (forward, config, generation_config, embeddings, dtype, device)."""

    cache_grows_in_place = True  # rungen.kvcache.new_cache gives it GrowingLayers, which the stack writes into
    own_cache = True  # in rungen.kvcache's Cache, not transformers' DynamicCache
    cache_reads_float16 = True  # its native stack writes and reads float16 keys and values (rungen.kvcache.own_dtype)

    def __init__(self, config: Config, embed_tokens: torch.nn.Module, stack: NativeStack,
                 norm: torch.Tensor, lm_head: torch.nn.Module, gguf_path: str):
        super().__init__()
        self.config, self.gguf_path = config, gguf_path
        self.generation_config = GenerationDefaults(**{name: getattr(config, name, None) for name in (
            "bos_token_id", "eos_token_id", "pad_token_id")})
        self.embed_tokens, self.lm_head, self.stack = embed_tokens, lm_head, stack
        self.register_buffer("norm_weight", norm, persistent=False)
        self.norm_eps = config.rms_norm_eps
        # The rotation of every layer, or of the full-attention ones with the sliding ones' beside it (gemma3).
        kinds = rope_types(config)
        self.rotary = rotary_frequencies(config, "full_attention" if "full_attention" in kinds else next(iter(kinds)))
        self.local_rotary = rotary_frequencies(config, "sliding_attention") if (
            "sliding_attention" in kinds and "full_attention" in kinds) else None
        # gemma's embedding scale, as transformers holds it (a float32 tensor), and its final logits' soft cap.
        self.family = family = FAMILIES[config.model_type]
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32) if (
            family.embedding_scaled) else None
        self.final_softcap = getattr(config, "final_logit_softcapping", None) if family.soft_caps else None
        # Granite's embedding multiplier and logits' divisor (None: none).
        self.embedding_multiplier, self.logits_scaling = (getattr(config, name) if family.multipliers else None
                                                          for name in ("embedding_multiplier", "logits_scaling"))

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window (0: none; empty: no layer has one): rungen.kvcache's SlidingLayers."""
        return self.stack.windows

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def can_generate(self) -> bool:
        return False  # generate() is transformers' model's: rungen/loading.py loads it where it is needed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool | None = None,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """Logits of `input_ids` [batch, tokens] after what `past_key_values` (new_cache's, extended in place)
        holds; `attention_mask` [batch, held + tokens] marks left padding; `logits_to_keep`: the last ones (0: all)."""
        cache = past_key_values if past_key_values is not None else new_cache(self)
        hidden = self.final_hidden_states(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:  # Gemma2ForCausalLM's order of operations
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.logits_scaling is not None:  # GraniteForCausalLM's
            logits = logits / self.logits_scaling
        return CausalLMOutput(logits=logits, past_key_values=None if use_cache is False else cache)

    def final_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                            position_ids: torch.Tensor | None = None, past_key_values=None) -> torch.Tensor:
        """forward without the head: the final norm's output [batch, tokens, hidden], for embeddings."""
        cache = past_key_values if past_key_values is not None else new_cache(self)
        if not self.stack.takes(cache):
            raise ValueError("this model's cache holds one full-attention layer per decoder layer "
                             "(rungen.kvcache.new_cache)")
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale.to(hidden.dtype)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        tokens = hidden.shape[1]
        length = cache.layers[0].get_seq_length()
        if position_ids is None:
            position_ids = (torch.arange(tokens, device=hidden.device) + length).unsqueeze(0)
        # No padding: the native attention's causal default, which visits only the keys up to each query.
        mask = None if attention_mask is None or bool(attention_mask.all()) else \
            padded_causal_mask(attention_mask, length, tokens)
        if mask is not None and self.family.additive_mask:
            # gemma2's additive mask, as transformers' eager attention: padding queries' logits match it too.
            mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
        cos, sin = rotary_cos_sin(*self.rotary, position_ids)
        local = None if self.local_rotary is None else rotary_cos_sin(*self.local_rotary, position_ids)
        hidden = self.stack(hidden, cache, mask, cos, sin, local)
        if hidden is None:
            raise ValueError("the cache's layers hold different lengths")
        return rms_norm(hidden, self.norm_weight, self.norm_eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward in its order of operations (gemma's with 1 + weight as `weight`)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def rotary_frequencies(config: Config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scale) as LlamaRotaryEmbedding computes them at init, of `layer_type`'s
    parameters where the config holds one set a layer type (gemma3's)."""
    rope = rope_types(config)[layer_type]
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default" or layer_type is not None:
        base = rope["rope_theta"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))  # phi3's partial rotary: the first dim values
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        if rope_type == "linear":  # transformers' linear scaling, in its order: the default frequencies / factor
            inv_freq /= rope["factor"]
        return inv_freq, 1.0
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](PretrainedConfig.from_dict(config.to_dict()))


def rotary_cos_sin(inv_freq: torch.Tensor, scaling: float, position_ids: torch.Tensor):
    """cos, sin [batch, tokens, head_dim] of `position_ids` [batch, tokens]: LlamaRotaryEmbedding's forward."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def padded_causal_mask(attention_mask: torch.Tensor, length: int, tokens: int) -> torch.Tensor:
    """create_causal_mask's boolean mask [batch, 1, tokens, length + tokens] for a left-padded batch (sdpa's form)."""
    keys = torch.arange(length + tokens, device=attention_mask.device)
    queries = torch.arange(length, length + tokens, device=attention_mask.device)
    causal = keys[None, :] <= queries[:, None]
    return (causal[None] & attention_mask.bool()[:, None, :])[:, None]


def norm_weight(weight: torch.Tensor, family) -> torch.Tensor:
    """A norm's weight as the native steps take it (gemma's 1 + weight), computed as transformers' model does from
    the stored value minus the offset, for the same bits."""
    weight = weight.to(torch.float32)
    return (weight - family.norm_offset) + family.norm_offset if family.norm_offset else weight


def mixture_layer(reader: WeightReader, config: Config, index: int) -> NativeMixture:
    """Layer `index`'s mixture of experts: its router, its experts in their blocks (as build_model reads them) and
    Qwen2-MoE's shared expert, with its gate."""
    prefix = f"model.layers.{index}.mlp."
    parts = {name: reader.table[f"blk.{index}.{tensor}.weight"] for tensor, name in PARTS.items()}
    router = reader.float_tensor(reader.tensor(prefix + "gate.weight")).to(torch.float32)
    # (the experts' count as the router scores them: Qwen3-MoE's config.json names it num_local_experts)
    family = FAMILIES[config.model_type]
    count, inner, hidden = router.shape[0], getattr(config, family.expert_size), config.hidden_size
    experts = build_experts(reader, parts, (count, 2 * inner, hidden), (count, hidden, inner), torch.nn.SiLU())
    shared = shared_gate = None
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = tuple(reader.linear(reader.tensor(f"{prefix}shared_expert.{name}.weight"))
                       for name in ("gate_proj", "up_proj", "down_proj"))
        shared_gate = reader.float_tensor(reader.tensor(prefix + "shared_expert_gate.weight")).to(torch.float32)
    normalized = config.norm_topk_prob if family.top_k_normalized is None else family.top_k_normalized
    return NativeMixture(router, config.num_experts_per_tok, normalized, experts, shared, shared_gate)


def build(header, config: Config, weights_map: dict) -> GGUFCausalLM:
    """The own model of `header`'s file (refusal() said it can), its weights loaded as build_model loads them for
    the fused layers."""
    from gguf import GGMLQuantizationType

    family = FAMILIES[config.model_type]
    reader = WeightReader(header.path, header.tensors, weights_map)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    # as transformers' processor keys it (an architecture read as another's: that one's processor)
    permute = BY_ARCHITECTURE.get(READ_AS.get(header.architecture, header.architecture), NO_FAMILY).permuted_qk

    tied = getattr(config, "tie_word_embeddings", False) and reader.tensor("lm_head.weight", required=False) is None
    embedding = reader.tensor("model.embed_tokens.weight")
    if embedding.code in SUPPORTED:
        qtype = GGMLQuantizationType(embedding.code)
        interleave = tied and interleavable(qtype, embedding.shape[0])
        in_features = weights_per_row(qtype, embedding.shape[-1])
        embed_tokens = GGMLEmbedding(reader.rows(embedding, interleave), qtype, in_features, torch.float32, None,
                                     interleaved=interleave)
        head = GGMLLinear(embed_tokens.blocks, qtype, in_features, interleaved=interleave) if tied else None
    else:
        weight = reader.float_tensor(embedding)
        embed_tokens = CastEmbedding(weight, torch.float32)
        head = CastLinear(weight, None) if tied else None
    if head is None:
        entry = reader.tensor("lm_head.weight")
        head = reader.linear(entry) if entry.code in SUPPORTED else CastLinear(reader.float_tensor(entry), None)

    def norm(hf_name: str) -> torch.Tensor:
        return norm_weight(reader.float_tensor(reader.tensor(hf_name)), family)

    norms, mlp_norms, qkv, o, gate_up, down, q_norms, k_norms, mixtures = ([] for _ in range(9))
    attention_out_norms, mlp_out_norms = [], []
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        norms.append(norm(prefix + "input_layernorm.weight"))
        mlp_norms.append(norm(f"{prefix}{family.mlp_norm}.weight"))
        if family.out_norms:
            attention_out_norms.append(norm(f"{prefix}{family.attention_out_norm}.weight"))
            mlp_out_norms.append(norm(f"{prefix}{family.mlp_out_norm}.weight"))
        qkv_tensors = [reader.tensor(f"{prefix}self_attn.{name}.weight") for name in family.qkv]
        if len(qkv_tensors) == 1:  # joined in the file: one product, as it is
            fused_qkv = reader.linear(qkv_tensors[0])
        else:
            biases = [reader.tensor(f"{prefix}self_attn.{name}.bias", required=False) for name in family.qkv]
            orders = [unpermuted_order(tensor.shape[0], n) if permute else None
                      for tensor, n in zip(qkv_tensors, (heads, kv_heads))] + [None]
            fused_qkv = reader.joined(qkv_tensors, orders, [None if b is None else reader.float_tensor(b).to(
                torch.float32) for b in biases])
        if family.mixture:  # the stack takes a shared expert (Qwen2-MoE's) where a dense layer has its MLP
            mixtures.append(mixture_layer(reader, config, index))
            fused_gate_up, down_product = mixtures[-1].shared_gate_up, mixtures[-1].shared_down
        else:
            gate_up_tensors = [reader.tensor(f"{prefix}mlp.{name}.weight") for name in family.gate_up]
            fused_gate_up = reader.linear(gate_up_tensors[0]) if len(gate_up_tensors) == 1 else reader.joined(
                gate_up_tensors, [None, None], [None, None])
            down_product = reader.linear(reader.tensor(prefix + "mlp.down_proj.weight"))
        if fused_qkv is None or (fused_gate_up is None and not family.mixture):
            raise GGUFError(f"{header.path}: layer {index}'s products take inputs of different widths")
        qkv.append(fused_qkv)
        gate_up.append(fused_gate_up)
        o.append(reader.linear(reader.tensor(prefix + "self_attn.o_proj.weight")))
        down.append(down_product)
        head_norms = [reader.tensor(f"{prefix}self_attn.{name}.weight", required=False) for name in HEAD_NORMS]
        q_norms.append(None if head_norms[0] is None else norm_weight(reader.float_tensor(head_norms[0]), family))
        k_norms.append(None if head_norms[1] is None else norm_weight(reader.float_tensor(head_norms[1]), family))
        release_freed_memory()
    weights = StackWeights.of(norms, qkv, q_norms, k_norms, o, mlp_norms, gate_up, down)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # gemma-2-27b's query_pre_attn_scalar is hidden / heads, not the head size; Granite's scale is its own.
    scale = getattr(config, family.score_scalar) ** -0.5 if family.score_scalar else head_dim ** -0.5
    if family.multipliers:
        scale = config.attention_multiplier
    windows = layer_windows(config)
    rotary = [int(bool(rotates)) for rotates in getattr(config, "no_rope_layers", None) or ()]  # (SmolLM3's: 0 none)
    stack = NativeStack(weights, config.rms_norm_eps, scale, heads, kv_heads, head_dim,
                        (attention_out_norms, mlp_out_norms), windows if any(windows) else [],
                        (getattr(config, "attn_logit_softcapping", None) or 0.0) if family.soft_caps else 0.0,
                        activation(config) == "gelu_pytorch_tanh", StackMixtures.of(mixtures),
                        [] if all(rotary) else rotary,
                        config.residual_multiplier if family.multipliers else 1.0)
    model = GGUFCausalLM(config, embed_tokens, stack, norm("model.norm.weight"), head, header.path)
    return model.eval()
