"""The decode step of a model on transformers' layers over blocks with their steps native (Qwen3.5's, LFM2's and
Granite's: delta_steps.py, conv_steps.py, granite_steps.py; EXAONE 4's, OLMo 2's and 3's, Ministral 3's, gpt-oss's,
GLM-4.5's: native_steps.py) as a plain loop over its layers' parts, installed as the inner model's forward
(LayerLoop): each part's own forward, called in the order transformers' decoder layer calls it, without the layers'
and the modules' call machinery (3-7 % of a step: docs/gguf.md). The same functions in the same order: the same bits
as the layers one by one. Families are rows of LOOPS. What it does not cover (a prompt, hidden states or attention
maps asked for, no cache, tracing, positions of a vision grid) goes to transformers' forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Loop:
    """What one family's decoder layers call, by attribute: the attention (`attention`) or a recurrent mixer
    (`recurrent`, its cache given as `cache_keyword`), the norms before the mixer and before the MLP (`pre_norms`)
    or after each (`post_norms`: OLMo 2's, EXAONE 4's), the MLP and an MLP beside it (`shared_mlp`: Granite's, the
    two outputs summed; a layer may lack either), the model's final norm and rotary (None where the model has none);
    `sections`: the rotary takes positions as [3, batch, tokens] (Qwen3.5's sections); `mixture`: the model's output
    carries router logits (None here); `embedding_scale` and `residual_scale`: the inner model's and each layer's
    multipliers of the embedding and of each branch before its residual sum (Granite's); `one_mixer`: a layer holds
    one part under `attention`, the attention, a recurrent mixer, an MLP or a mixture by the layer's kind, behind its
    one norm (Nemotron-H's); `embedding`: the inner model's embedding; `parallel`: a layer's recurrent mixer beside its
    attention, both reading the norm's output, their outputs summed (Falcon-H1's); `mup`: the embedding times the
    square root of its width where the config's mup_enabled says (AFMoE's)."""

    attention: str = "self_attn"
    recurrent: str | None = None
    cache_keyword: str = "past_key_values"
    pre_norms: tuple[str, str] | None = None
    post_norms: tuple[str, str] | None = None
    mlp: str = "mlp"
    shared_mlp: str | None = None
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    sections: bool = False
    mixture: bool = False
    embedding_scale: str | None = None
    residual_scale: str | None = None
    one_mixer: bool = False
    embedding: str = "embed_tokens"
    parallel: bool = False
    mup: bool = False


PRE = dict(pre_norms=("input_layernorm", "post_attention_layernorm"))
POST = dict(post_norms=("post_attention_layernorm", "post_feedforward_layernorm"))
QWEN35 = dict(PRE, recurrent="linear_attn", cache_keyword="cache_params", sections=True)
GRANITE = dict(PRE, mlp="block_sparse_moe", shared_mlp="shared_mlp", mixture=True,
               embedding_scale="embedding_multiplier", residual_scale="residual_multiplier")
# transformers' inner models whose decode step LayerLoop takes, by class name.
LOOPS = {
    "Qwen3_5TextModel": Loop(**QWEN35),
    "Qwen3_5MoeTextModel": Loop(**QWEN35, mixture=True),
    "Lfm2Model": Loop(recurrent="conv", pre_norms=("operator_norm", "ffn_norm"), mlp="feed_forward",
                      final_norm="embedding_norm"),
    "Lfm2MoeModel": Loop(recurrent="conv", pre_norms=("operator_norm", "ffn_norm"), mlp="feed_forward",
                         final_norm="embedding_norm", rotary="pos_emb", mixture=True),
    "Exaone4Model": Loop(**POST),
    "Olmo2Model": Loop(**POST),
    "Olmo3Model": Loop(**POST),
    "Ministral3Model": Loop(**PRE),
    "GptOssModel": Loop(**PRE, mixture=True),
    "Glm4MoeModel": Loop(**PRE, mixture=True),
    "GraniteMoeHybridModel": Loop(**GRANITE, recurrent="mamba", cache_keyword="cache_params"),
    "GraniteMoeModel": Loop(**GRANITE),
    "GraniteMoeSharedModel": Loop(**GRANITE),
    "NemotronHModel": Loop(attention="mixer", mlp="mixer", pre_norms=("norm", "norm"), cache_keyword="cache_params",
                           final_norm="norm_f", one_mixer=True, embedding="embeddings", mixture=True),
    "OlmoeModel": Loop(**PRE, mixture=True),
    "AfmoeModel": Loop(pre_norms=("input_layernorm", "pre_mlp_layernorm"), mixture=True, mup=True,
                       post_norms=("post_attention_layernorm", "post_mlp_layernorm")),
    "Llama4TextModel": Loop(**PRE, mlp="feed_forward", mixture=True),
    "MiniMaxM2Model": Loop(**PRE, mixture=True),
    "HYV3Model": Loop(**PRE, mixture=True),
    "Dots1Model": Loop(**PRE, mixture=True),
    "FalconH1Model": Loop(recurrent="mamba", cache_keyword="cache_params", pre_norms=("input_layernorm",
                          "pre_ff_layernorm"), mlp="feed_forward", final_norm="final_layernorm",
                          embedding_scale="embedding_multiplier", parallel=True),
}
# The multipliers of a layer's branches (Falcon-H1's), which the loop takes only at 1.
UNIT_MULTIPLIERS = ("attention_in_multiplier", "ssm_out_multiplier", "attn_out_multiplier")
# The parts whose forwards the loop calls directly (none needs a module hook).
PARTS = ("NativeRMSNorm", "NativeGatedAttention", "NativeLfm2Attention", "NativeExaone4Attention",
         "NativeOlmoAttention", "NativeMinistral3Attention", "NativeGptOssAttention", "DeltaNetStep", "ShortConvStep",
         "NativeGatedMLP", "MixtureInOneCall", "NativeGlm4MoeAttention", "Glm4MoeMoE",
         "Lfm2MoeSparseMoeBlock", "MambaStep", "NativeGraniteAttention", "NemotronHMLP", "NemotronHMoE",
         "NativeAfmoeAttention", "AfmoeSparseMoeBlock", "NativeLlama4Attention", "Llama4Mixture",
         "MiniMaxM2SparseMoeBlock", "HYV3MoE", "Dots1MoE")
# The masks transformers' models give each kind of layer (where a batch is padded); others take none in a step.
MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
         "hybrid": "create_causal_mask"}


def layer_kinds(config) -> list[str]:
    """Each layer's kind as the model builds its masks by: the config's layer_types, else every layer sliding where
    the config has a window (Ministral 3's), else full."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    return ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * \
        config.num_hidden_layers


class LayerLoop:
    """An inner model's forward (`original`) with its decode steps as one loop over its layers' parts."""

    def __init__(self, inner: torch.nn.Module, loop: Loop):
        self.inner, self.original, self.loop = inner, inner.forward, loop
        self.kinds = layer_kinds(inner.config)
        # each layer's (mixer, whether it is the attention, its norms before and after the mixer and the MLP, its MLPs
        # (the outputs summed), its branches' multiplier, the recurrent mixer beside its attention or None)
        self.layers = []
        for kind, layer in zip(self.kinds, inner.layers):
            if loop.one_mixer:  # (its one part by its kind, behind its norm)
                mixer, norm = getattr(layer, loop.attention), getattr(layer, loop.pre_norms[0])
                self.layers.append((None, False, None, norm, None, None, [mixer], None, None) if kind in ("mlp", "moe")
                                   else (mixer, kind == "full_attention", norm, None, None, None, [], None, None))
                continue
            attention = getattr(layer, loop.attention, None)
            pre, post = ([getattr(layer, name) for name in names] if names else [None, None]
                         for names in (loop.pre_norms, loop.post_norms))
            mlps = [mlp for mlp in (getattr(layer, loop.mlp, None), getattr(layer, loop.shared_mlp or "", None))
                    if mlp is not None]
            self.layers.append((attention if attention is not None else getattr(layer, loop.recurrent),
                                attention is not None, *pre, *post, mlps,
                                getattr(layer, loop.residual_scale) if loop.residual_scale else None,
                                getattr(layer, loop.recurrent) if loop.parallel else None))
        self.embedding_scale = getattr(inner, loop.embedding_scale) if loop.embedding_scale else None
        if loop.mup and getattr(inner.config, "mup_enabled", False):
            self.embedding_scale = inner.config.hidden_size ** 0.5
        # the rotary's positions by layer kind (OLMo 3's: one a kind), else one for all; none (Granite 4.0 H's)
        self.rotary = getattr(inner, loop.rotary, None)
        self.rotary_kinds = self.rotary is not None and \
            "layer_type" in inspect.signature(self.rotary.forward).parameters

    @classmethod
    def install(cls, model: torch.nn.Module) -> bool:
        """Takes `model`'s decode steps where its inner model is of LOOPS and every layer's parts are of PARTS;
        returns whether it did."""
        inner = getattr(model, "model", None)
        loop = LOOPS.get(type(inner).__name__)
        if loop is None or len(inner.layers) != inner.config.num_hidden_layers:
            return False
        names = (loop.pre_norms or ()) + (loop.post_norms or ())
        mlps = (loop.mlp, loop.shared_mlp) if loop.shared_mlp else (loop.mlp,)
        for layer in inner.layers:
            mixer = getattr(layer, loop.attention, None)
            mixer = mixer if mixer is not None or loop.recurrent is None else getattr(layer, loop.recurrent, None)
            parts = [mixer, *(getattr(layer, name) for name in names)]
            parts += [getattr(layer, loop.recurrent, None)] if loop.parallel else []
            held = [getattr(layer, name, None) for name in mlps]
            if any(type(part).__name__ not in PARTS for part in parts) or not any(held) \
                    or any(mlp is not None and type(mlp).__name__ not in PARTS for mlp in held) \
                    or any(getattr(layer, name, 1.0) != 1.0 for name in UNIT_MULTIPLIERS):
                return False
        if type(getattr(inner, loop.final_norm)).__name__ not in PARTS:
            return False
        inner.forward = cls(inner, loop)  # an instance attribute: Module.__call__ finds it before the method
        return True

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        import transformers.masking_utils as masks
        from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

        inner, loop, cache = self.inner, self.loop, past_key_values
        tokens = (input_ids if inputs_embeds is None else inputs_embeds).shape[1] \
            if (input_ids is None) != (inputs_embeds is None) else 0
        if (tokens != 1 or cache is None or use_cache is False or torch.jit.is_tracing()
                or any(value for value in kwargs.values())
                or (position_ids is not None and position_ids.dim() != 2)):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = getattr(inner, loop.embedding)(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        if position_ids is None:
            position_ids = (torch.arange(1, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        rotary = position_ids[None].expand(3, *position_ids.shape) if loop.sections else position_ids
        if self.rotary_kinds:
            rotations = {kind: self.rotary(hidden, rotary, kind) for kind in set(self.kinds)}
        else:
            rotations = dict.fromkeys(set(self.kinds), self.rotary and self.rotary(hidden, rotary))
        # No padding: no masks (the native attend's causal default, the window each attention passes); a recurrent
        # layer's step takes none.
        layer_masks = dict.fromkeys(set(self.kinds))
        if attention_mask is not None and not bool(attention_mask.all()):
            for kind in layer_masks.keys() & MASKS.keys():
                layer_masks[kind] = getattr(masks, MASKS[kind])(
                    config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=cache,
                    position_ids=position_ids)
        for kind, (mixer, attends, pre_mixer, pre_mlp, post_mixer, post_mlp, mlps, scale, beside) in zip(
                self.kinds, self.layers):
            if mixer is not None:  # (a Nemotron-H MLP or mixture layer has none)
                x = hidden if pre_mixer is None else pre_mixer.forward(hidden)
                if attends:
                    out, _ = mixer.forward(x, position_embeddings=rotations[kind], attention_mask=layer_masks[kind],
                                           position_ids=position_ids, past_key_values=cache)
                else:
                    out = mixer.forward(x, attention_mask=None, **{loop.cache_keyword: cache})
                if beside is not None:  # (the mixer's output first, as Falcon-H1's layer sums them)
                    out = beside.forward(x, attention_mask=None, **{loop.cache_keyword: cache}) + out
                out = out if post_mixer is None else post_mixer.forward(out)
                hidden = hidden + (out if scale is None else out * scale)
            if not mlps:  # (a Nemotron-H mixer's layer: no MLP)
                continue
            x = hidden if pre_mlp is None else pre_mlp.forward(hidden)
            out = None
            for mlp in mlps:  # (Granite's mixture, then its shared MLP: summed in the order its layer sums them)
                part = mlp.forward(x)
                part = part[0] if isinstance(part, tuple) else part
                out = part if out is None else out + part
            out = out if post_mlp is None else post_mlp.forward(out)
            hidden = hidden + (out if scale is None else out * scale)
        output = MoeModelOutputWithPast if loop.mixture else BaseModelOutputWithPast
        return output(last_hidden_state=getattr(inner, loop.final_norm).forward(hidden), past_key_values=cache)
