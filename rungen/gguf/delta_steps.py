"""Qwen3.5's decoder layers over a GGUF file's blocks (transformers' Qwen3_5ForCausalLM and its mixture's), with their
small steps taken in fewer calls on the CPU: a Gated DeltaNet layer's four products of its input one product, its
decode step after them one native call (DeltaNetStep: torch.ops.rungen_ggml.delta_step, csrc/ggml_delta.cpp, its
output written in the order out_proj's columns keep in the file); a gated attention's q (beside each head's output
gate), k and v one product, q and k normalized and rotated in one rope_split call, the native attend over a cache
growing in place (NativeGatedAttention); each RMSNorm one rms_norm call; a dense gated MLP's gate and up one
product. transformers' forms of the linear attention's step (its PyTorch fallbacks of the short convolution and the
delta rule, which flash-linear-attention and causal-conv1d replace on a GPU) cost a decode step about as much as its
products: the convolution of one position a depthwise conv1d call, the state's update and read broadcast products
over it, some 25 calls a layer. A prompt (several positions) is one native call too (delta_scan: each head's state
a position at a time, as the decode step takes them), where transformers' chunked form takes some hundred operations
a chunk (Qwen3-Next-80B-A3B's shape: 25 ms a layer for 512 positions against about 330). The arithmetic is
transformers' within float32 rounding (sums in another order).
"""

from __future__ import annotations

import functools
import sys

import torch

from ..host_memory import release_freed_memory
from .blocks import GGMLLinear, join
from .conversions import InputPermuted
from .kernels import native_kernels
from .native_steps import JoinedAttention, join_attention, join_gated_mlp, native_layers, scan_inputs

DELTA_STEPS_MODELS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
GATED_MLPS = ("Qwen3_5MLP",)  # (the mixture's shared expert: in its block's one native call, experts.py)
DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
# Their RMSNorms: x / sqrt(mean(x^2) + eps) times (1 + weight), in float32 (a DeltaNet's gated one: its step's).
NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")
ATTENTIONS = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


class NativeGatedAttention(JoinedAttention):
    """Qwen3.5's gated attention (Qwen3_5Attention) over blocks: q (each head's beside its output gate), k and v one
    product; q and k normalized per head and rotated (partial rotary: the cos and sin the model hands cover each
    head's first quarter) in one rope_split call; the cache and native_attention; the output times sigmoid of the
    gate, then o_proj."""

    def __init__(self, attention: torch.nn.Module, qkv: torch.nn.Module):
        super().__init__(attention, qkv)
        self.queries = self.heads * attention.head_dim

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        batch, tokens, _ = hidden_states.shape
        qkv = self.qkv(hidden_states)
        query_gate = qkv[..., :2 * self.queries].view(batch, tokens, self.heads, 2, a.head_dim)
        q, k, v = torch.ops.rungen_ggml.rope_split(
            torch.cat([query_gate[..., 0, :].reshape(batch, tokens, -1), qkv[..., 2 * self.queries:]], dim=-1),
            *position_embeddings, self.heads, self.kv_heads, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, None,
                             gate=query_gate[..., 1, :].reshape(batch, tokens, -1))


# A Gated DeltaNet layer's products of its input, in the order DeltaNetStep joins them.
IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class GivenOutput(torch.nn.Module):
    """In place of one of a module's products: returns the output its owner computed for the module's next call."""

    def __init__(self):
        super().__init__()
        self.output = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, self.output = self.output, None
        if output is None:
            raise RuntimeError("a joined product's part was called without its output given")
        return output


class DeltaNetStep(torch.nn.Module):
    """transformers' Gated DeltaNet layer `module` (its products, convolution weights, decay and norm), a decode step
    (one position a row, its float32 states in the cache) after its products one delta_step call: the convolution of
    the new position, the delta rule's read and update of each value head's state in place, the gated norm; any
    other call the module's own forward. Where its four products of the input are blocks they are one product
    (`in_proj`), whose parts the module's own forward is given (GivenOutput in their place)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.register_buffer("conv", module.conv1d.weight.detach().squeeze(1).float(), persistent=False)
        self.register_buffer("decay", -module.A_log.detach().float().exp(), persistent=False)
        self.register_buffer("norm_weight", module.norm.weight.detach().float(), persistent=False)
        parts = [getattr(module, name) for name in IN_PROJECTIONS]
        self.in_proj = join(parts) if all(type(part) is GGMLLinear for part in parts) else None
        self.widths = [part.out_features for part in parts]
        if self.in_proj is not None:  # (the separate blocks go: their pages are given back by the caller)
            for name in IN_PROJECTIONS:
                setattr(module, name, GivenOutput())
        # transformers' masking of a padded row's positions, as the module's forward applies it
        self.masked = sys.modules[type(module).__module__].apply_mask_to_padding_states
        # out_proj's columns in the file's order (InputPermuted gathers its input): delta_step writes its output so
        permuted = isinstance(module.out_proj, InputPermuted)
        self.register_buffer("scatter", torch.argsort(module.out_proj.gather) if permuted else None,
                             persistent=False)

    @property
    def out_proj(self) -> torch.nn.Module:
        """What takes delta_step's output: out_proj, or the layer under its gather where delta_step scatters."""
        return self.module.out_proj if self.scatter is None else self.module.out_proj.layer

    def products(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The layer's four products of `x` (IN_PROJECTIONS' order)."""
        if self.in_proj is None:
            return [getattr(self.module, name)(x) for name in IN_PROJECTIONS]
        return list(self.in_proj(x).split(self.widths, dim=-1))

    def prompt(self, hidden_states: torch.Tensor, cache_params, attention_mask) -> torch.Tensor:
        """Several positions after the layer's products in one delta_scan call, each head's state a position at a
        time (the decode step's arithmetic: the state a prompt leaves is the one decoding it token by token would),
        where transformers' chunked form takes some hundred operations a chunk and its convolution a depthwise
        conv1d; the cache's window and state taken and given back as the module's own forward does."""
        m = self.module
        hidden_states = self.masked(hidden_states, attention_mask)
        batch, positions, _ = hidden_states.shape
        qkv, z, b, a = self.products(hidden_states)
        qkv, state = scan_inputs(cache_params, m.layer_idx, qkv, m.conv_kernel_size,
                                 (batch, m.num_v_heads, m.head_k_dim, m.head_v_dim))
        out = torch.ops.rungen_ggml.delta_scan(qkv, positions, self.conv, state, a, b, z, self.decay, m.dt_bias,
                                               self.norm_weight, m.num_k_heads, m.layer_norm_epsilon, self.scatter)
        if cache_params is not None:
            cache_params.update_recurrent_state(state, m.layer_idx)
        return self.out_proj(out.to(hidden_states.dtype))

    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
        m = self.module
        layer = m.layer_idx
        if (hidden_states.shape[1] > 1 and m.conv1d.bias is None and kwargs.get("cu_seq_lens_q") is None
                and hidden_states.device.type == "cpu"):  # (packed sequences: the module's own form)
            return self.prompt(hidden_states, cache_params, attention_mask)
        window = cache_params.get_conv_state(layer) if cache_params is not None else None
        state = cache_params.get_recurrent_state(layer) if cache_params is not None else None
        if (hidden_states.shape[1] != 1 or window is None or state is None or cache_params.is_recording_past(layer)
                or m.conv1d.bias is not None or window.dtype != torch.float32 or state.dtype != torch.float32
                or not (window.is_contiguous() and state.is_contiguous())):
            if self.in_proj is None:
                return m(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
            for name, output in zip(IN_PROJECTIONS, self.products(self.masked(hidden_states, attention_mask))):
                getattr(m, name).output = output
            try:
                return m(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
            finally:  # (none left held where the forward stopped early)
                for name in IN_PROJECTIONS:
                    getattr(m, name).output = None
        hidden_states = self.masked(hidden_states, attention_mask)
        qkv, z, b, a = self.products(hidden_states[:, 0])
        out = torch.ops.rungen_ggml.delta_step(window, qkv, self.conv, state, a, b, z, self.decay, m.dt_bias,
                                               self.norm_weight, m.num_k_heads, m.layer_norm_epsilon, self.scatter)
        return self.out_proj(out.reshape(hidden_states.shape[0], 1, -1).to(hidden_states.dtype))


def install_delta_step(model: torch.nn.Module, name: str) -> None:
    """The Gated DeltaNet layer at `name` as DeltaNetStep (its joined products' old blocks given back)."""
    model.set_submodule(name, DeltaNetStep(model.get_submodule(name)))
    release_freed_memory()


def delta_steps(model: torch.nn.Module) -> bool:
    """Gives a model of DELTA_STEPS_MODELS over blocks its layers' steps native (native_layers): NativeRMSNorm for
    each RMSNorm, NativeGatedMLP for each dense gated MLP, NativeGatedAttention for each attention and DeltaNetStep
    for each Gated DeltaNet layer, where the native kernels are; returns whether. Its decode steps then one
    LayerLoop."""
    if not native_kernels() or type(model).__name__ not in DELTA_STEPS_MODELS:
        return False
    activation = model.config.get_text_config(decoder=True).hidden_act
    native_layers(model, NORMS, {
        **dict.fromkeys(DELTA_NETS, install_delta_step),
        **dict.fromkeys(GATED_MLPS, functools.partial(join_gated_mlp, activation=activation)),
        **dict.fromkeys(ATTENTIONS, functools.partial(join_attention, kind=NativeGatedAttention))}, norm_offset=1.0)
    return True
