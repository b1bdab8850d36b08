"""The operators of a decode step between its matrix products as one kernel each on a GPU (Triton), with torch's
operators beside them where Triton is missing and as their reference: a step of the engine's fused layers
(rungen/fused_step.py) launches these instead of transformers' ~38 kernels a layer.

- add_rms_norm: the residual add and the next RMSNorm (transformers' 8 kernels);
- rotary_into_slots: q/k norms (Qwen3), the rotary embedding of queries and keys, and the keys' and values' writes
  into the slots (10 to 16 kernels, and two index_put);
- decode_attention: each row's query heads over its slot up to its position, a key/value head's query heads
  together (SDPA under a mask, with transformers' copies of the keys and values a query head); on a GPU split over
  the positions where a slot is long (flash decoding), so that one row's long context fills the GPU;
- silu_mul: the MLP's activation times its up projection (2 kernels).

Each computes transformers' arithmetic in its order: float32 inside, rounded to the activations' dtype wherever
transformers' operators round (a norm's output before its weight, each product of the rotary before their sum), so
the kernels part from torch's operators only where a sum's order does (a norm's mean of squares, attention's softmax).
"""

from __future__ import annotations

import functools

import torch

# -- torch's operators: the reference, and the step's form where Triton is missing ---------------------------------

def rms_norm_torch(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, over the last dimension."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(norm(residual + x) * weight, residual + x); residual None: x is the residual stream itself."""
    hidden = x if residual is None else residual + x
    return rms_norm_torch(hidden, weight, eps), hidden


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [rows, heads, head size] with cos/sin [rows, rotary size]: the first
    `rotary size` of each head rotated (as halves), the rest passed through (Phi-3's partial rotary)."""
    width = cos.shape[-1]
    turned, kept = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    turned = turned * cos[:, None] + rotated * sin[:, None]
    return torch.cat((turned, kept), dim=-1) if kept.shape[-1] else turned


def rotary_into_slots_torch(q, k, v, cos, sin, keys, values, positions, q_norm=None, k_norm=None, eps=0.0):
    """Queries [rows, heads, head size] rotated; keys (normed, rotated) and values written at each row's position
    of slots 0..rows-1 (keys/values [slots, kv heads, capacity, head size]). q, k, v: [rows, heads * head size]."""
    rows, size = q.shape[0], keys.shape[-1]
    q, k, v = q.reshape(rows, -1, size), k.reshape(rows, -1, size), v.reshape(rows, -1, size)
    if q_norm is not None:
        q, k = rms_norm_torch(q, q_norm, eps), rms_norm_torch(k, k_norm, eps)
    q, k = rotate_torch(q, cos, sin), rotate_torch(k, cos, sin)
    slot = torch.arange(rows, device=q.device)
    keys[slot, :, positions] = k.to(keys.dtype)
    values[slot, :, positions] = v.to(values.dtype)
    return q


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def decode_attention_torch(query, keys, values, positions, length, mask, scale):
    """Each row's query heads [rows, heads, size] over the first `length` positions of its slot (keys/values [slots,
    kv heads, capacity, size]) under `mask` [rows, 1, 1, length] (0 where a position is the row's, -inf past it):
    SDPA with each key/value head's query heads as its queries (query head h = j * group + g reads key/value head j,
    as transformers' repeat_kv pairs them, with no copy of the keys and values a query head)."""
    rows, heads, size = query.shape
    kv_heads = keys.shape[1]
    attended = torch.nn.functional.scaled_dot_product_attention(
        query.view(rows, kv_heads, heads // kv_heads, size), keys[:rows, :, :length], values[:rows, :, :length],
        attn_mask=mask, scale=scale)
    return attended.reshape(rows, heads, size)


TORCH = dict(add_rms_norm=add_rms_norm_torch, rotary_into_slots=rotary_into_slots_torch, silu_mul=silu_mul_torch,
             decode_attention=decode_attention_torch, needs_mask=True)


@functools.cache
def triton_kernels() -> dict | None:
    """The three operators as Triton kernels (rungen/step_triton.py: TORCH's signatures), or None where Triton does
    not import."""
    try:
        from . import step_triton
    except Exception:  # any failure: torch's operators serve
        return None
    return dict(add_rms_norm=step_triton.add_rms_norm, rotary_into_slots=step_triton.rotary_into_slots,
                silu_mul=step_triton.silu_mul, decode_attention=step_triton.decode_attention, needs_mask=False)
