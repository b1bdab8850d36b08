"""Granite's decoder layers over a GGUF file's blocks (transformers' GraniteMoeHybridForCausalLM: Granite 4.0 H's;
GraniteMoeForCausalLM and GraniteMoeSharedForCausalLM: Granite 3's mixtures; NemotronHForCausalLM: Nemotron-H's, one
mixer a layer; FalconH1ForCausalLM: Falcon-H1's, a Mamba-2 mixer beside each attention), with their small steps taken
in fewer calls on the CPU: a Mamba-2 layer's decode step between its two
products one native call (MambaStep: torch.ops.rungen_ggml.mamba_step, csrc/ggml_mamba.cpp); the shared MLP's gate and
up product (one already: the file's two tensors joined) then its activation one call (NativeGatedMLP); each RMSNorm
one rms_norm call; the attention's q, k and v one product, q and k rotated in one rope_split call
(NativeGraniteAttention), the native attend over a cache growing in place (the mixture's one call: experts.py).
transformers' PyTorch forms of a Mamba-2 step (the fallbacks of causal-conv1d and mamba-ssm, which a GPU takes
instead) cost a decode step about a third of its time: the convolution of one position a depthwise conv1d call, the
state's update and read broadcast products and a batched product over it, some 40 calls a layer. A prompt (several
positions) is one native call between the products too (mamba_scan: each head's state a position at a time, as the
decode step takes them), where transformers' chunked form takes some fifty operations. The arithmetic is
transformers' within float32 rounding (sums in another order).
"""

from __future__ import annotations

import functools
import sys

import torch

from .blocks import GGMLLinear, GGMLParts
from .experts import silu
from .kernels import native_kernels
from .native_steps import (
    NativeGatedMLP,
    NativeGraniteAttention,
    join_attention,
    join_gated_mlp,
    native_layers,
    scan_inputs,
)

GRANITE_MODELS = ("GraniteMoeHybridForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
                  "NemotronHForCausalLM", "FalconH1ForCausalLM")
# x / sqrt(mean(x^2) + eps) times weight, in float32
NORMS = ("GraniteMoeHybridRMSNorm", "GraniteMoeRMSNorm", "GraniteMoeSharedRMSNorm", "NemotronHRMSNorm",
         "FalconH1RMSNorm")
MAMBAS = ("GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer")
ATTENTIONS = ("GraniteMoeHybridAttention", "GraniteMoeAttention", "GraniteMoeSharedAttention", "NemotronHAttention")
# act(input_linear's first half) times its second, then output_linear
SHARED_MLPS = ("GraniteMoeHybridMLP", "GraniteMoeSharedMLP")


class MambaStep(torch.nn.Module):
    """transformers' Mamba-2 layer `module` (its products, convolution, A, D and gated norm; Falcon-H1's mixer
    without its norm: the gate alone), a decode step (one position a row, its float32 window and state in the cache)
    between its products one mamba_step call: the convolution of the new position, each head's state updated and read
    in place, the gated norm; any other call the module's own forward."""

    @staticmethod
    def takes(module: torch.nn.Module) -> bool:
        """Whether the layer computes what MambaStep does: Falcon-H1's mixer where its multipliers are 1 (as
        llama.cpp's files hold it: multiplied into the weights) and its norm, where it has one, after the gate."""
        mup = getattr(module, "mup_vector", None)
        return getattr(module, "ssm_in_multiplier", 1.0) == 1.0 and (mup is None or bool((mup == 1).all())) and \
            not getattr(module.norm, "norm_before_gate", False)

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.register_buffer("conv", module.conv1d.weight.detach().squeeze(1).float(), persistent=False)
        bias = module.conv1d.bias
        self.register_buffer("conv_bias", None if bias is None else bias.detach().float(), persistent=False)
        self.register_buffer("a", -module.A_log.detach().float().exp(), persistent=False)
        self.widths = [module.intermediate_size, module.conv_dim, module.num_heads]
        # the gated norm's weight and epsilon (none: the output times silu of the gate alone)
        self.norm = getattr(module.norm, "weight", None)
        self.eps = getattr(module.norm, "variance_epsilon", 0.0)
        # transformers' masking of a padded row's positions, as the module's forward applies it
        self.masked = sys.modules[type(module).__module__].apply_mask_to_padding_states

    def prompt(self, hidden_states: torch.Tensor, cache_params, attention_mask) -> torch.Tensor:
        """Several positions between the layer's products in one mamba_scan call, each head's state a position at a
        time (the decode step's arithmetic, the time step held to the module's limit as transformers' chunked form
        holds it), where that form takes some fifty operations; the cache's window and state taken and given back
        as the module's own forward does."""
        m = self.module
        hidden_states = self.masked(hidden_states, attention_mask)
        batch, positions, _ = hidden_states.shape
        z, xbc, dt = m.in_proj(hidden_states).split(self.widths, dim=-1)
        xbc, state = scan_inputs(cache_params, m.layer_idx, xbc, m.conv_kernel_size,
                                 (batch, m.num_heads, m.head_dim, m.ssm_state_size))
        out = torch.ops.rungen_ggml.mamba_scan(xbc, positions, self.conv, self.conv_bias, state, dt, m.dt_bias,
                                               self.a, m.D, z, self.norm, m.n_groups, self.eps,
                                               float(m.time_step_limit[0]), attention_mask)
        if cache_params is not None:
            cache_params.update_recurrent_state(state, m.layer_idx)
        return m.out_proj(out.to(hidden_states.dtype))

    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
        m = self.module
        layer = m.layer_idx
        if (hidden_states.shape[1] > 1 and hidden_states.device.type == "cpu" and m.activation == "silu"
                and kwargs.get("cu_seq_lens_q") is None and tuple(m.time_step_limit)[1] == float("inf")
                and m.in_proj.out_features == sum(self.widths)
                and (attention_mask is None or attention_mask.shape == hidden_states.shape[:2])):
            return self.prompt(hidden_states, cache_params, attention_mask)
        window = cache_params.get_conv_state(layer, state_idx=0) if cache_params is not None else None
        state = cache_params.get_recurrent_state(layer, state_idx=0) if cache_params is not None else None
        if (hidden_states.shape[1] != 1 or window is None or state is None or cache_params.is_recording_past(layer)
                or m.activation != "silu" or window.dtype != torch.float32 or state.dtype != torch.float32
                or window.shape[-1] != m.conv_kernel_size or not (window.is_contiguous() and state.is_contiguous())):
            return m(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        hidden_states = self.masked(hidden_states, attention_mask)
        z, xbc, dt = m.in_proj(hidden_states[:, 0]).split(self.widths, dim=-1)
        out = torch.ops.rungen_ggml.mamba_step(window, xbc, self.conv, self.conv_bias, state, dt, m.dt_bias, self.a,
                                               m.D, z, self.norm, m.n_groups, self.eps)
        return m.out_proj(out.reshape(hidden_states.shape[0], 1, -1).to(hidden_states.dtype))


def install_mamba_step(model: torch.nn.Module, name: str) -> None:
    """The Mamba-2 layer at `name` as MambaStep where it takes it."""
    if MambaStep.takes(model.get_submodule(name)):
        model.set_submodule(name, MambaStep(model.get_submodule(name)))


def falcon_attention(model: torch.nn.Module, name: str) -> None:
    """Falcon-H1's attention at `name` as NativeGraniteAttention where its keys' multiplier is 1 (a file's: the
    converter multiplied it into k's weights)."""
    if model.get_submodule(name).key_multiplier == 1.0:
        join_attention(model, name, kind=NativeGraniteAttention)


def falcon_mlp(model: torch.nn.Module, name: str) -> None:
    """Falcon-H1's MLP at `name` as NativeGatedMLP where its gate's and down's multipliers are 1 (a file's)."""
    module = model.get_submodule(name)
    if (module.gate_multiplier, module.down_multiplier) == (1.0, 1.0) and silu(module.act_fn):
        join_gated_mlp(model, name, activation="silu")


def native_shared_mlp(model: torch.nn.Module, name: str) -> None:
    """Granite's shared MLP at `name` as NativeGatedMLP where its joined gate and up are one product of blocks and its
    activation SiLU; else left as it is."""
    module = model.get_submodule(name)
    if type(module.input_linear) in (GGMLLinear, GGMLParts) and silu(module.activation):
        model.set_submodule(name, NativeGatedMLP(module.input_linear, module.output_linear, "silu"))


def granite_steps(model: torch.nn.Module) -> bool:
    """Gives a model of GRANITE_MODELS over blocks its layers' steps native (native_layers): NativeRMSNorm for each
    RMSNorm, MambaStep for each Mamba-2 layer, NativeGatedMLP for each shared MLP, NativeGraniteAttention for each
    attention, where the native kernels are; returns whether. Its decode steps then one LayerLoop."""
    if not native_kernels() or type(model).__name__ not in GRANITE_MODELS:
        return False
    native_layers(model, NORMS, {**dict.fromkeys(MAMBAS, install_mamba_step),
                                 **dict.fromkeys(SHARED_MLPS, native_shared_mlp),
                                 **dict.fromkeys(ATTENTIONS, functools.partial(join_attention,
                                                                               kind=NativeGraniteAttention)),
                                 "FalconH1Attention": falcon_attention, "FalconH1MLP": falcon_mlp})
    return True
