"""LFM2's and LFM2-MoE's decoder layers over a GGUF file's blocks (transformers' Lfm2ForCausalLM,
Lfm2MoeForCausalLM), with their small steps taken in fewer calls on the CPU: a short convolution layer's decode step
between its products one native call (ShortConvStep: torch.ops.rungen_ggml.short_conv_step, csrc/ggml_shortconv.cpp;
the window shifted in place and its three taps summed, where transformers' PyTorch form runs a depthwise conv1d over
the window, 0.3 ms a layer of LFM2-1.2B's shape); an attention's q, k and v one product, q and k normalized per head
and rotated in one rope_split call, the native attend over a cache growing in place (NativeLfm2Attention); each
RMSNorm one rms_norm call; the MLP's w1 and w3 one product. A prompt (several positions) stays transformers'
convolution. The arithmetic is transformers' within float32 rounding (sums in another order).
"""

from __future__ import annotations

import functools

import torch

from .kernels import native_kernels
from .native_steps import JoinedAttention, join_attention, join_gated_mlp, native_layers

# (LFM2-MoE's layers are LFM2's, its MLPs after the first ones mixtures)
CONV_STEPS_MODELS = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
NORMS = ("Lfm2RMSNorm", "Lfm2MoeRMSNorm")  # weight times x / sqrt(mean(x^2) + eps), in float32
MLPS = ("Lfm2MLP", "Lfm2MoeMLP")  # w2(silu(w1(x)) * w3(x))
ATTENTIONS = ("Lfm2Attention", "Lfm2MoeAttention")
CONVOLUTIONS = ("Lfm2ShortConv", "Lfm2MoeShortConv")


class ShortConvStep(torch.nn.Module):
    """transformers' short convolution layer `module` (in_proj's B, C and x; a depthwise convolution of conv_L_cache
    taps; out_proj), a decode step (one position a row, its float32 window in the cache) one short_conv_step call
    between its products: C times the taps' sum over the window shifted in place to end with B * x; any other call
    the module's own forward."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.register_buffer("taps", module.conv.weight.detach().squeeze(1).float(), persistent=False)

    def forward(self, hidden_states: torch.Tensor, past_key_values=None, attention_mask=None, **kwargs):
        m = self.module
        window = past_key_values.get_conv_state(m.layer_idx) if past_key_values is not None else None
        if (hidden_states.shape[1] != 1 or window is None or past_key_values.is_recording_past(m.layer_idx)
                or m.conv.bias is not None or window.dtype != torch.float32 or not window.is_contiguous()
                or window.shape[-1] < self.taps.shape[-1] - 1):
            return m(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None:  # (transformers' apply_mask_to_padding_states)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        out = torch.ops.rungen_ggml.short_conv_step(window, m.in_proj(hidden_states[:, 0]), self.taps)
        return m.out_proj(out[:, None].to(hidden_states.dtype))


class NativeLfm2Attention(JoinedAttention):
    """LFM2's attention (Lfm2Attention): q, k and v one product, q and k normalized per head (its q_layernorm and
    k_layernorm, native by now) and rotated in one rope_split call; the cache, native_attention and out_proj."""

    @property
    def o_proj(self) -> torch.nn.Module:
        return self.attention.out_proj

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        a = self.attention
        q, k, v = torch.ops.rungen_ggml.rope_split(self.qkv(hidden_states), *position_embeddings, self.heads,
                                                   self.kv_heads, a.q_layernorm.weight, a.k_layernorm.weight,
                                                   a.q_layernorm.eps)
        return self.attended(hidden_states, q, k, v, attention_mask, past_key_values, None)


def install_conv_step(model: torch.nn.Module, name: str) -> None:
    """The short convolution layer at `name` as ShortConvStep."""
    model.set_submodule(name, ShortConvStep(model.get_submodule(name)))


def conv_steps(model: torch.nn.Module) -> bool:
    """Gives a model of CONV_STEPS_MODELS over blocks its layers' steps native (native_layers): NativeRMSNorm for
    each RMSNorm, NativeGatedMLP for each MLP, NativeLfm2Attention for each attention and ShortConvStep for each short
    convolution layer, where the native kernels are; returns whether. Its decode steps then one LayerLoop."""
    if not native_kernels() or type(model).__name__ not in CONV_STEPS_MODELS:
        return False
    native_layers(model, NORMS, {
        **dict.fromkeys(CONVOLUTIONS, install_conv_step),
        **dict.fromkeys(MLPS, functools.partial(join_gated_mlp, activation="silu", parts=("w1", "w3", "w2"))),
        **dict.fromkeys(ATTENTIONS, functools.partial(join_attention, kind=NativeLfm2Attention))})
    return True
