"""transformers' RMSNorm layers as torch's rms_norm: one kernel on a GPU (CUDA's fused RMSNorm) where the module
runs seven (to float32, pow, mean, add, rsqrt, mul, back), twice or four times a layer in every decode step.
An experiment, RUN_GENERATION_FUSED_NORMS=1, until a GPU measures it (benchmarks/gpu.py's "engine, fused norms").

The same arithmetic in the same order: the input normalised in float32, rounded to its dtype, then times the weight
(torch's composite on the CPU runs transformers' very operators, so there the output is the same to the bit; CUDA's
kernel sums the squares in an order of its own)."""

from __future__ import annotations

import os
import types

import torch

FUSED_NORMS_ENV = "RUN_GENERATION_FUSED_NORMS"
# The classes whose forward is LlamaRMSNorm's (weight * normalised.to(dtype)); Gemma's (1 + weight, in float32) is not.
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")


def fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed


def fuse_norms(model: torch.nn.Module) -> int:
    """The model's RMSNorm layers of NORMS run through torch's rms_norm; returns how many."""
    fused = 0
    for module in model.modules():
        if type(module).__name__ in NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(fused_forward, module)
            fused += 1
    return fused


def unfuse_norms(model: torch.nn.Module) -> None:
    """Their own forward again (a benchmark's next row)."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is fused_forward:
            del module.forward


def wanted() -> bool:
    return os.environ.get(FUSED_NORMS_ENV) == "1"
