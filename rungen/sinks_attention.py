"""gpt-oss's attention (a learned sink logit a head, which takes a share of the softmax and gives no value) without
transformers' eager attention's scores of every query against every key: a prompt of n tokens held [heads, n, n]
of them (a 30,000-token prompt 115 GB in bfloat16), so a long prompt ran out of GPU memory. A prompt's queries go
to torch's scaled_dot_product_attention (its memory-efficient kernels on a GPU: no scores held) with the sink as one
more key: each query gains a dimension holding its head's sink and that key 1 / scale there (the other keys 0), so
the key's score is the sink and its value, zeros, adds nothing. A decode step's one query a row multiplies each key
and value head's queries together, its keys read once (eager attention copies them for each query head).
"""

from __future__ import annotations

import torch

SINKS_ATTENTION = "rungen_sinks"
PAD = 8  # dimensions added to each head (the sink's, and zeros: head sizes in multiples of 8 for the kernels)


def sinks_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' attention interface for gpt-oss (module.sinks [heads]): query [rows, heads, queries, size], key
    and value [rows, kv heads, keys, size], attention_mask boolean [rows, 1, queries, keys] (True: seen) or None
    (causal, the queries the last of the keys); (output [rows, queries, heads, size], None)."""
    rows, heads, queries, size = query.shape
    keys, groups = key.shape[2], heads // key.shape[1]
    if queries == 1:
        seen = seen_keys(attention_mask, queries, keys, query.device)
        return decode_attention(module.sinks, query, key, value, seen, scaling, groups), None
    # The sink as key 0: a query's extra dimension its head's sink, key 0's 1 / scale (gpt-oss's 8: exact), value 0
    # zeros; its score the sink as the model holds it.
    extra = query.new_zeros(rows, heads, queries, PAD)
    extra[..., 0] = module.sinks.to(query.dtype)[None, :, None]
    sink_key = key.new_zeros(rows, key.shape[1], 1, size + PAD)
    sink_key[..., size] = 1 / scaling
    key = torch.cat([sink_key, torch.nn.functional.pad(key, (0, PAD))], dim=2)
    value = torch.nn.functional.pad(value, (0, PAD, 1, 0))
    # (each key and value head spread over its query heads: the kernels that take a mask take no groups)
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    query = torch.cat([query, extra], dim=-1)
    if attention_mask is None and queries == keys:
        # A whole prompt alone: causal without a mask (flash attention on a GPU), a query of zeros put first so that
        # query i + 1 sees keys 0..i + 1, the sink and the prompt's 0..i; its row dropped.
        query = torch.nn.functional.pad(query, (0, 0, 1, 0))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        out = out[:, :, 1:]
    else:
        seen = seen_keys(attention_mask, queries, keys, query.device)
        seen = torch.cat([seen.new_ones(*seen.shape[:-1], 1), seen], dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=seen, scale=scaling)
    return out[..., :size].transpose(1, 2).contiguous(), None


def seen_keys(attention_mask, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The mask as booleans [rows or 1, 1, queries, keys]: an additive one's 0s, or causal where there is none (the
    queries the last of the keys)."""
    if attention_mask is None:
        at = torch.arange(keys, device=device)
        return (at[None, :] <= at[keys - queries:, None])[None, None]
    if attention_mask.dtype != torch.bool:
        return attention_mask[..., :keys] > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask[..., :keys]


def decode_attention(sinks: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     seen: torch.Tensor, scaling: float, groups: int) -> torch.Tensor:
    """A step's attention, each key and value head's query heads together (no copy of the keys a query head); the
    softmax in float32 over the keys and the sink."""
    rows, heads, queries, size = query.shape
    scores = torch.matmul(query.reshape(rows, heads // groups, groups * queries, size), key.transpose(2, 3))
    scores = scores.float().view(rows, heads, queries, -1) * scaling
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(rows, heads, queries, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(value.dtype)
    out = torch.matmul(probs.reshape(rows, heads // groups, groups * queries, -1), value)
    return out.view(rows, heads, queries, size).transpose(1, 2).contiguous()


def use_sinks_attention(model: torch.nn.Module) -> bool:
    """Gives a gpt-oss model on transformers' eager attention sinks_attention (with sdpa's boolean masks); returns
    whether it did."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) != "gpt_oss" or getattr(text, "_attn_implementation", None) != "eager":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SINKS_ATTENTION, sinks_attention)
    AttentionMaskInterface.register(SINKS_ATTENTION, sdpa_mask)
    model.config._attn_implementation = SINKS_ATTENTION
    return True
