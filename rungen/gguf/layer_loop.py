"""A hybrid model's decode step (Qwen3.5's, LFM2's: transformers' layers over blocks with their steps native,
delta_steps.py and conv_steps.py) as a plain loop over its layers' parts, installed as the inner model's forward
(LayerLoop): each part's own forward, called in the order transformers' decoder layer calls it, without the layers'
and the modules' call machinery (about 3 ms of a 25 ms step of Qwen3.5-0.8B's shape). The same functions in the
same order: the same bits as the layers one by one. What it does not cover (a prompt, hidden states or attention
maps asked for, no cache, tracing, positions of a vision grid) goes to transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Loop:
    """What one family's decoder layers call, by attribute: the attention (`attention`) or the recurrent mixer
    (`recurrent`, its cache given as `cache_keyword`), the norms before the mixer and before the MLP, the MLP, the
    model's final norm; `sections`: the rotary takes positions as [3, batch, tokens] (Qwen3.5's sections);
    `mixture`: the model's output carries router logits (None here)."""

    attention: str
    recurrent: str
    cache_keyword: str
    norms: tuple[str, str]
    mlp: str
    final_norm: str
    sections: bool = False
    mixture: bool = False


QWEN35 = dict(attention="self_attn", recurrent="linear_attn", cache_keyword="cache_params",
              norms=("input_layernorm", "post_attention_layernorm"), mlp="mlp", final_norm="norm", sections=True)
# transformers' inner models whose decode step LayerLoop takes, by class name.
LOOPS = {
    "Qwen3_5TextModel": Loop(**QWEN35),
    "Qwen3_5MoeTextModel": Loop(**QWEN35, mixture=True),
    "Lfm2Model": Loop(attention="self_attn", recurrent="conv", cache_keyword="past_key_values",
                      norms=("operator_norm", "ffn_norm"), mlp="feed_forward", final_norm="embedding_norm"),
}
# The parts whose forwards the loop calls directly (none needs a module hook).
PARTS = ("NativeRMSNorm", "NativeGatedAttention", "NativeLfm2Attention", "DeltaNetStep", "ShortConvStep",
         "NativeGatedMLP", "MixtureInOneCall")


class LayerLoop:
    """An inner model's forward (`original`) with its decode steps as one loop over its layers' parts."""

    def __init__(self, inner: torch.nn.Module, loop: Loop):
        self.inner, self.original, self.loop = inner, inner.forward, loop
        self.layers = [(getattr(layer, loop.attention, None), getattr(layer, loop.recurrent, None),
                        *(getattr(layer, name) for name in (*loop.norms, loop.mlp))) for layer in inner.layers]

    @classmethod
    def install(cls, model: torch.nn.Module) -> bool:
        """Takes `model`'s decode steps where its inner model is of LOOPS and every layer's parts are of PARTS;
        returns whether it did."""
        inner = getattr(model, "model", None)
        loop = LOOPS.get(type(inner).__name__)
        if loop is None or len(inner.layers) != inner.config.num_hidden_layers or not all(
                type(part).__name__ in PARTS for layer in inner.layers
                for part in (getattr(layer, loop.attention, None) or getattr(layer, loop.recurrent),
                             *(getattr(layer, name) for name in (*loop.norms, loop.mlp)))):
            return False
        if type(getattr(inner, loop.final_norm)).__name__ not in PARTS:
            return False
        inner.forward = cls(inner, loop)  # an instance attribute: Module.__call__ finds it before the method
        return True

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

        inner, loop, cache = self.inner, self.loop, past_key_values
        tokens = (input_ids if inputs_embeds is None else inputs_embeds).shape[1] \
            if (input_ids is None) != (inputs_embeds is None) else 0
        if (tokens != 1 or cache is None or use_cache is False or torch.jit.is_tracing()
                or any(value for value in kwargs.values())
                or (position_ids is not None and position_ids.dim() != 2)):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = inner.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = (torch.arange(1, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        rotary = position_ids[None].expand(3, *position_ids.shape) if loop.sections else position_ids
        position_embeddings = inner.rotary_emb(hidden, rotary)
        mask = None  # (no padding: the native attend's causal default; a recurrent layer's step takes no mask)
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      past_key_values=cache, position_ids=position_ids)
        recurrent_cache = {loop.cache_keyword: cache}
        for attention, recurrent, mixer_norm, mlp_norm, mlp in self.layers:
            if attention is not None:
                out, _ = attention.forward(mixer_norm.forward(hidden), position_embeddings, mask,
                                           past_key_values=cache)
            else:
                out = recurrent.forward(mixer_norm.forward(hidden), attention_mask=None, **recurrent_cache)
            hidden = hidden + out
            out = mlp.forward(mlp_norm.forward(hidden))
            hidden = hidden + (out[0] if isinstance(out, tuple) else out)
        output = MoeModelOutputWithPast if loop.mixture else BaseModelOutputWithPast
        return output(last_hidden_state=getattr(inner, loop.final_norm).forward(hidden), past_key_values=cache)
