"""DeepSeek's multi-head latent attention (transformers' DeepseekV2Attention and DeepseekV3Attention: V2, V3, R1, Kimi
K2, GLM-4.7-Flash; Mistral4Attention) over its cache of latents without expanding them: transformers' attention
caches each position's normalized latent and rotated key, then at every step puts the whole cache through kv_b_proj
(a head's keys and values for every position: V2-Lite at 4096 positions some 8.6 GFLOP a layer and token). Here
kv_b's k part is taken into the query instead (a head's query times its k rows: a query over the latent) and its v
part applied after the attention (absorption, as llama.cpp and DeepSeek's own inference compute it): one key head of
the latent and rotated key for every query head, the same function within float32 rounding. A file with a queries'
temperature (Mistral Large 3's) has its queries times 1 + scale * log(1 + floor(position / length)) here, as
llama.cpp's graph has them (transformers' DeepSeek attention has none: where it runs such a file, the context stops
before `length`, loading.model_context); Mistral 4's, as its attention does, by its rotary's llama 4 beta.
"""

from __future__ import annotations

import sys

import torch

# transformers' attentions AbsorbedLatentAttention computes.
LATENT_ATTENTIONS = ("DeepseekV2Attention", "DeepseekV3Attention", "Mistral4Attention")


class AbsorbedLatentAttention(torch.nn.Module):
    """A DeepSeek attention of LATENT_ATTENTIONS over its latent cache (transformers' own layout: the latent as the
    keys, the rotated key as the values), kv_b_proj's k rows taken into the query and its v rows applied after."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.attention = attention
        heads, nope, value = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
        up = attention.kv_b_proj.weight.detach().view(heads, nope + value, attention.kv_lora_rank)
        self.k_up, self.v_up = up[:, :nope], up[:, nope:]  # [heads, not rotated, latent], [heads, value, latent]
        attention.kv_b_proj = None  # (its weight is k_up's and v_up's)
        config = attention.config  # (the queries' temperature: its scale and the positions it steps by, or None)
        self.temperature = (config.attn_temperature_scale, config.attn_temperature_length) if getattr(
            config, "attn_temperature_scale", None) else None
        rope = config.rope_parameters
        if type(attention).__name__ == "Mistral4Attention" and rope.get("llama_4_scaling_beta"):  # (its own)
            self.temperature = (rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"])

    @property
    def modeling(self):
        """The attention's modeling module (its rotary functions): looked up, not held (a model copies whole)."""
        return sys.modules[type(self.attention).__module__]

    def rotated(self, q: torch.Tensor, k: torch.Tensor, position_embeddings):
        """q's and k's rotated parts turned as the model's attention turns them."""
        a, modeling = self.attention, self.modeling
        if isinstance(position_embeddings, torch.Tensor):  # V2's: complex frequencies
            return modeling.apply_rotary_emb(q, k, position_embeddings.to(q.device))
        if a.config.rope_interleave:
            return modeling.apply_rotary_pos_emb_interleave(q, k, *position_embeddings)
        return modeling.apply_rotary_pos_emb(q, k, *position_embeddings)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        a = self.attention
        batch, tokens = hidden_states.shape[:-1]
        if a.q_lora_rank is None:
            q = a.q_proj(hidden_states)
        else:
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hidden_states)))
        q_nope, q_rot = q.view(batch, tokens, -1, a.qk_head_dim).transpose(1, 2).split(
            [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rot = a.kv_a_proj_with_mqa(hidden_states).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = a.kv_a_layernorm(latent).view(batch, 1, tokens, a.kv_lora_rank)
        q_rot, k_rot = self.rotated(q_rot, k_rot.view(batch, 1, tokens, a.qk_rope_head_dim), position_embeddings)
        if past_key_values is not None:
            latent, k_rot = past_key_values.update(latent, k_rot, a.layer_idx)
        query = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, self.k_up.to(q_nope.dtype)), q_rot], dim=-1)
        positions = kwargs.get("position_ids")
        if self.temperature is not None and positions is not None and int(positions.max()) >= self.temperature[1]:
            scale, length = self.temperature
            tuned = torch.log1p(torch.floor(positions.float() / length)) * scale + 1  # [rows or 1, tokens]
            query = query * tuned[:, None, :, None].to(query.dtype)
        heads, positions = query.shape[1], latent.shape[2]
        # every head's queries against the one key head: [batch, 1, heads x tokens, latent + rotated]
        query = query.reshape(batch, 1, heads * tokens, -1)
        key, value = torch.cat([latent, k_rot.to(latent.dtype)], dim=-1).to(query.dtype), latent.to(query.dtype)
        mask = attention_mask
        if mask is None and tokens > 1:  # (causal, the new positions after the cached ones)
            mask = torch.ones(tokens, positions, dtype=torch.bool, device=query.device).tril(positions - tokens)[None]
        if mask is not None:  # each head's rows the same
            mask = mask.reshape(-1, 1, tokens, positions)
            mask = mask[:, :, None].expand(-1, -1, heads, -1, -1).reshape(mask.shape[0], 1, heads * tokens, positions)
            mask = mask if mask.dtype == torch.bool else mask.to(query.dtype)
        if tokens == 1:  # (a step's scores are few: plain products, twice as fast as the fused kernel here)
            scores = (query @ key.transpose(-1, -2)) * a.scaling
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            out = torch.softmax(scores, dim=-1) @ value
        else:
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=a.scaling)
        out = out.view(batch, heads, tokens, -1)
        out = torch.einsum("bhtr,hvr->bthv", out, self.v_up.to(out.dtype)).reshape(batch, tokens, -1)
        return a.o_proj(out), None


def absorb_latents(model: torch.nn.Module) -> None:
    """Each DeepSeek attention of `model` (LATENT_ATTENTIONS) whose kv_b_proj is a float weight as
    AbsorbedLatentAttention; the model then computes its queries' temperature (attends_positions) where every one
    is."""
    names = [name for name, module in model.named_modules() if type(module).__name__ in LATENT_ATTENTIONS]
    for name in names:
        attention = model.get_submodule(name)
        if isinstance(getattr(attention.kv_b_proj, "weight", None), torch.Tensor) \
                and attention.kv_b_proj.weight.dtype.is_floating_point:
            model.set_submodule(name, AbsorbedLatentAttention(attention))
    if names and getattr(model.config, "attn_temperature_scale", None):
        model.attends_positions = all(isinstance(model.get_submodule(name), AbsorbedLatentAttention)
                                      for name in names)
