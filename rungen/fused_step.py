"""The engine's decode step over the slots in fused layers: on a GPU a step's launches are its cost (a bfloat16
llama layer under transformers' modules launches ~45 kernels for 7 matrix products, ~0.1 ms a layer past what its
weights' bytes need on an H200), so a layer here launches 9:

    add_rms_norm -> q/k/v product -> rotary_into_slots -> attention -> o product
    add_rms_norm -> gate/up product -> silu_mul -> down product

the q/k/v and gate/up weights concatenated (their modules keep views of the one weight: nothing held twice), the small
operators as one kernel each (rungen/step_kernels.py), and attention over the slots with each key/value head's query
heads together (no copy of the keys and values per query head, as transformers' masked attention makes; on a GPU
split over a long slot's positions). The families are rows of one table (a mixture's layer calls its MoE block whole
after the second norm); a layer whose products are codes (--quantize, a GGUF file's) has them concatenated by their
own class where the three share a form, else called one by one. The same arithmetic as transformers' layers, in the
same dtype and order; on a GPU the step is checked once against transformers' own (decode_step) and gives way to it
where they disagree.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from .slots import AttentionMask, SlotCache, decode_step
from .step_kernels import TORCH, triton_kernels

logger = logging.getLogger("run_generation")

FUSED_STEP_ENV = "RUN_GENERATION_FUSED_STEP"  # 0: transformers' layers on a GPU too; 1: the fused step on the CPU too
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm", "Qwen2MoeRMSNorm",
         "Qwen3MoeRMSNorm", "MixtralRMSNorm", "SmolLM3RMSNorm")
# The fused step's logits within this share of transformers' (the difference's L2 norm over theirs): float32's
# rounding, or half precision's (bfloat16's own logits part from float32's by 1.3-2.9 % on 16 random layers of the
# 135M, 1B and 1.7B shapes; a broken kernel's by their whole size)
AGREE = {torch.float32: 1e-3, torch.float64: 1e-6}
AGREE_HALF = 0.15


@dataclass(frozen=True)
class Family:
    """Where a family's layer keeps its parts: the q/k/v projections (one name: fused already), the gate/up ones, and
    whether each head's queries and keys are normed before the rotary embedding (Qwen3)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    qk_norm: bool = False


FAMILIES = {"llama": Family(), "mistral": Family(), "qwen2": Family(), "qwen3": Family(qk_norm=True),
            "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
            # mixtures of experts: their attention is llama's, qwen2's or qwen3's; a layer's mixture block (router,
            # experts, a shared expert) is transformers' module, called as it is
            "qwen2_moe": Family(), "qwen3_moe": Family(qk_norm=True), "mixtral": Family(),
            # llama's, every fourth layer without rotary (its attention's use_rope)
            "smollm3": Family()}


def wanted(device: torch.device) -> bool:
    """On a CUDA GPU unless RUN_GENERATION_FUSED_STEP=0; elsewhere where it is 1."""
    setting = os.environ.get(FUSED_STEP_ENV)
    return setting == "1" if device.type != "cuda" else setting != "0"


def why_not(model: torch.nn.Module) -> str | None:
    """Why `model`'s layers cannot take the fused step, or None."""
    config = model.config.get_text_config(decoder=True)
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"no fused layers for {config.model_type}"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(config, 'hidden_act', None)}"
    if AttentionMask(config).window is not None:
        return f"a sliding window of {config.sliding_window} (the fused attention reads every position)"
    if any(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
           for module in model.modules()):
        return "its forward is hooked (accelerate's offload, or a hook of the caller's, which the step would skip)"
    if len({parameter.device for parameter in model.parameters()}) > 1:
        return "its weights are on more than one device"
    decoder = model.get_decoder()
    parts = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if not all(hasattr(layer, part) for layer in decoder.layers for part in parts):
        return "its layers are not transformers' own"
    norms = [decoder.norm] + [norm for layer in decoder.layers
                              for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    if family.qk_norm:
        norms += [norm for layer in decoder.layers for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    if any(type(norm).__name__ not in NORMS or norm.weight.dtype != model.dtype for norm in norms):
        return "a norm of another form"
    for layer in decoder.layers:
        for name in family.qkv:
            if not hasattr(layer.self_attn, name):
                return f"no {name}"
        for name in () if mixture(layer.mlp) else family.gate_up:
            if not hasattr(layer.mlp, name):
                return f"no {name}"
    return None


def mixture(mlp: torch.nn.Module) -> bool:
    """Whether a layer's MLP is a mixture of experts' block (transformers' sparse block: a router and experts)."""
    return hasattr(mlp, "experts")


def concatenated(modules: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer whose output is the modules' outputs side by side, its weight (and bias) the one the modules now
    hold views of (layers of codes: their class's own concatenated()); None where they are not plain linear layers
    of one dtype and device, or codes of one form."""
    if len({type(module) for module in modules}) == 1 and hasattr(modules[0], "concatenated"):
        return modules[0].concatenated(modules)  # a layer of codes: its own layout (rungen/int4.py, rungen/int8.py)
    if any(type(module) is not torch.nn.Linear for module in modules):
        return None
    weights, biases = [module.weight for module in modules], [module.bias for module in modules]
    if len({(weight.dtype, weight.device, weight.shape[1]) for weight in weights}) > 1 or \
            len({bias is None for bias in biases}) > 1:
        return None
    one = torch.nn.Linear(weights[0].shape[1], sum(weight.shape[0] for weight in weights), bias=biases[0] is not None,
                          device="meta")
    with torch.no_grad():
        one.weight = torch.nn.Parameter(torch.cat(weights), requires_grad=False)
        if biases[0] is not None:
            one.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
    start = 0
    for module in modules:  # each module reads its rows of the one weight (a prompt's pass runs them)
        end = start + module.weight.shape[0]
        module.weight = torch.nn.Parameter(one.weight[start:end], requires_grad=False)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(one.bias[start:end], requires_grad=False)
        start = end
    return one


class Projections:
    """A layer's projections of one input side by side (q/k/v, or gate/up): one product where they concatenate,
    else each module's own; call -> their outputs, views of one tensor or tensors of their own."""

    def __init__(self, owner: torch.nn.Module, names: tuple[str, ...], sizes: tuple[int, ...]):
        self.modules = [getattr(owner, name) for name in names]
        self.sizes = sizes
        self.one = self.modules[0] if len(self.modules) == 1 else concatenated(self.modules)  # (Phi-3's: one)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.one is not None:
            return self.one(x).split(self.sizes, dim=-1)
        return tuple(module(x) for module in self.modules)


@dataclass
class Layer:
    input_norm: torch.nn.Module
    qkv: Projections
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    scaling: float
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: Projections | None  # None: a mixture's layer, whose MLP is `down`, its block called whole
    down: torch.nn.Module
    rotates: bool = True  # (SmolLM3's every fourth layer: no rotary)


class FusedStep:
    """decode_step's signature and result over fused layers (module docstring); `kernels`: step_kernels' operators
    (Triton's on a GPU where it imports, else torch's)."""

    def __init__(self, model: torch.nn.Module, kernels: dict):
        config = model.config.get_text_config(decoder=True)
        family = FAMILIES[config.model_type]
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.ops, self.eps = kernels, config.rms_norm_eps
        self.checked = False
        self.plain = False  # transformers' step instead: the fused one disagreed with it
        decoder = model.get_decoder()
        self.decoder = decoder
        q, kv = self.heads * self.head_size, self.kv_heads * self.head_size
        self.layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if mixture(mlp):
                gate_up, down = None, mlp
            else:
                width = mlp.down_proj.in_features if hasattr(mlp.down_proj, "in_features") else \
                    config.intermediate_size
                gate_up, down = Projections(mlp, family.gate_up, (width, width)), mlp.down_proj
            self.layers.append(Layer(
                layer.input_layernorm, Projections(attention, family.qkv, (q, kv, kv)),
                attention.q_norm.weight if family.qk_norm else None,
                attention.k_norm.weight if family.qk_norm else None, attention.scaling, attention.o_proj,
                layer.post_attention_layernorm, gate_up, down, bool(getattr(attention, "use_rope", True))))

    def __call__(self, model: torch.nn.Module, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor,
                 length: int) -> torch.Tensor:
        if self.plain:
            return decode_step(model, cache, tokens, positions, length)
        if not self.checked and tokens.is_cuda:
            return self.check(model, cache, tokens, positions, length)
        return self.step(model, cache, tokens, positions, length)

    def step(self, model, cache, tokens, positions, length):
        rows, ops, residual = tokens.shape[0], self.ops, None
        hidden = model.get_input_embeddings()(tokens).reshape(rows, -1)
        mask = None  # (SDPA's: Triton's attention reads each row's position instead, and the step needs no other)
        if ops["needs_mask"]:
            filled = cache.prepare(positions, length)
            mask = torch.zeros(filled.shape, dtype=hidden.dtype, device=hidden.device)
            mask.masked_fill_(~filled, -torch.inf)
        cos, sin = self.decoder.rotary_emb(hidden[:, None], positions[:, None])
        rotations = {True: (cos[:, 0], sin[:, 0])}
        if not all(layer.rotates for layer in self.layers):  # cos 1 and sin 0: q and k as they are
            rotations[False] = (torch.ones_like(rotations[True][0]), torch.zeros_like(rotations[True][1]))
        for number, layer in enumerate(self.layers):
            normed, residual = ops["add_rms_norm"](hidden, residual, layer.input_norm.weight, self.eps)
            q, k, v = layer.qkv(normed)
            keys, values = cache.keys[number], cache.values[number]
            query = ops["rotary_into_slots"](q, k, v, *rotations[layer.rotates], keys, values, positions, layer.q_norm,
                                             layer.k_norm, self.eps)
            attended = ops["decode_attention"](query, keys, values, positions, length, mask, layer.scaling)
            hidden = layer.o_proj(attended.reshape(rows, self.heads * self.head_size))
            normed, residual = ops["add_rms_norm"](hidden, residual, layer.post_norm.weight, self.eps)
            if layer.gate_up is None:  # a mixture's block: [rows, 1, hidden] in and out
                hidden = layer.down(normed[:, None]).reshape(rows, -1)
            else:
                gate, up = layer.gate_up(normed)
                hidden = layer.down(ops["silu_mul"](gate, up))
        normed, _ = ops["add_rms_norm"](hidden, residual, self.decoder.norm.weight, self.eps)
        return model.get_output_embeddings()(normed).float()

    def check(self, model, cache, tokens, positions, length):
        """The first step on a GPU: transformers' step, then the fused one over the same slots (each writes the
        same positions); the fused step serves from now on if their logits agree, else transformers' does. Triton's
        kernels failing or disagreeing (a GPU or build Triton cannot compile for) leave torch's operators in their
        place first."""
        expected = decode_step(model, cache, tokens, positions, length)
        why = self.disagreement(model, cache, tokens, positions, length, expected)
        if why is not None and self.ops is not TORCH:
            logger.warning("the fused decode step's Triton kernels give way to torch's operators: %s", why)
            self.ops = TORCH
            why = self.disagreement(model, cache, tokens, positions, length, expected)
        if why is not None:
            logger.warning("the fused decode step gives way to transformers' layers: %s", why)
            self.plain = True
            decode_step(model, cache, tokens, positions, length)  # its own keys/values in the slots again
        self.checked = True
        return expected

    def disagreement(self, model, cache, tokens, positions, length, expected) -> str | None:
        """How the fused step's logits part from `expected` (transformers' layers'), or None where they agree."""
        try:
            got = self.step(model, cache, tokens, positions, length)
        except Exception as error:  # any failure: the caller takes another way
            return f"failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        gap = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
        agree = AGREE.get(self.decoder.norm.weight.dtype, AGREE_HALF)  # (the norms' dtype: the activations')
        return None if gap <= agree else f"its logits part from transformers' layers' by {gap:.3g} of their norm"


def fused(step) -> bool:
    """Whether `step` is a fused step that has not given way to transformers' layers."""
    return isinstance(step, FusedStep) and not step.plain


def for_model(model: torch.nn.Module, device: torch.device) -> FusedStep | None:
    """The fused step for `model` where it is wanted and its family has one (its projections concatenated now, once),
    else None: transformers' layers step."""
    if not wanted(device):
        return None
    fused = getattr(model, "rungen_fused_step", None)
    if fused is not None:
        return fused
    why = why_not(model)
    if why is not None:
        logger.info("decode steps through transformers' layers: %s", why)
        return None
    kernels = (triton_kernels() if device.type == "cuda" else None) or TORCH
    try:
        fused = FusedStep(model, kernels)
    except Exception as error:  # (a layer concatenated before the failure still computes what it did: views)
        if isinstance(error, torch.OutOfMemoryError):
            raise
        logger.warning("decode steps through transformers' layers: the fused ones failed to build (%s: %s)",
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return None
    model.rungen_fused_step = fused
    return fused
