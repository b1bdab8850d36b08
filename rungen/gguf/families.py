"""The model families the GGUF runtime computes, one row each: what a family differs in from llama's decoder
(pre-norm rotary attention, then a gated MLP). A row names where transformers' layer holds each part (decoder.py),
the parts' weights in a file (model.py) and what the metadata adds to the config (configs.py). Below the table: the
architectures whose files are read as another's (READ_AS, MODEL_OF).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's row: where llama's defaults hold, a field keeps its default."""

    model_type: str  # config.model_type: the table's key
    architecture: str  # the GGUF file's general.architecture
    layer_class: str  # transformers' decoder layer, the reference FusedDecoderLayer fuses

    # The projections whose rows make the q/k/v and gate/up products, in order (one name: held joined).
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    # The attention's per-head RMS norms of q and k, applied before the rotation.
    head_norms: tuple[str, str] | None = None
    activation: str = "hidden_act"
    # The norm before the MLP, and those of the attention's and the MLP's outputs before each residual sum.
    mlp_norm: str = "post_attention_layernorm"
    attention_out_norm: str | None = None
    mlp_out_norm: str | None = None
    # What a norm multiplies by is this plus its weight (gemma's RMSNorm: 1 + weight).
    norm_offset: float = 0.0
    # llama.cpp's converter permutes q/k rows for its interleaved rotary; transformers' tensor processor un-permutes.
    permuted_qk: bool = False
    # config.sliding_window applies to every layer (else to config.layer_types' sliding_attention ones).
    window_on_every_layer: bool = False
    # The embedding's rows times sqrt(hidden).
    embedding_scaled: bool = False
    # config.attn_logit_softcapping / final_logit_softcapping cap the scores / logits where set.
    soft_caps: bool = False
    # The config field whose ** -0.5 scales the scores (None: the head size's).
    score_scalar: str | None = None
    # Granite's multipliers, as transformers' GraniteConfig names them: the embedding's, each residual branch's, the
    # scores' scale itself (in place of score_scalar's), and the logits' divisor.
    multipliers: bool = False
    # transformers attends eagerly, under the additive form of a padded batch's mask.
    additive_mask: bool = False
    # The MLP is a mixture of experts (experts.py: its experts in their blocks, the block in one native call), its
    # parts in the file as llama.cpp's ffn_{gate,up,down}_exps and ffn_gate_inp (Qwen2-MoE's shared expert beside).
    mixture: bool = False
    # The config field of an expert's inner size, and whether a token's top-k weights are divided by their sum
    # (None: as config.norm_topk_prob says).
    expert_size: str = "moe_intermediate_size"
    top_k_normalized: bool | None = None

    # What transformers' GGUF reading leaves out of the config, read from the metadata: head_dim from key_length.
    head_dim_from_key_length: bool = False
    # config fields from other keys: (key after "<arch>.", field).
    extra_config_keys: tuple[tuple[str, str], ...] = ()
    # The largest model's layer count: it scales its scores by hidden / heads (no key says so).
    big_model_layers: int | None = None
    # A linear rope scaling from <arch>.rope.scaling.*.
    rope_scaling_from_metadata: bool = False
    # A partial rotary from <arch>.rope.dimension_count, longrope from the rope_factors_long/short tensors.
    partial_and_long_rope: bool = False

    @property
    def out_norms(self) -> bool:
        """Whether the attention's and the MLP's outputs are normalized before their residual sums."""
        return self.attention_out_norm is not None

    def products(self) -> tuple[str, ...]:
        """The layer's product weights, as the HF names of its weights end: q/k/v, o, gate/up, down (a mixture's:
        q/k/v, o)."""
        mlp = () if self.mixture else (*(f"mlp.{name}.weight" for name in self.gate_up), "mlp.down_proj.weight")
        return (*(f"self_attn.{name}.weight" for name in self.qkv), "self_attn.o_proj.weight", *mlp)


GEMMA = dict(activation="hidden_activation", mlp_norm="pre_feedforward_layernorm",
             attention_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm",
             norm_offset=1.0, embedding_scaled=True, soft_caps=True, score_scalar="query_pre_attn_scalar")

# Differences the config carries (windows, q/k/v biases, partial rotary, longrope, gemma3's local rope) need no field.
FAMILIES = {family.model_type: family for family in (
    Family("llama", "llama", "LlamaDecoderLayer", permuted_qk=True),
    Family("qwen2", "qwen2", "Qwen2DecoderLayer", head_dim_from_key_length=True),
    Family("qwen3", "qwen3", "Qwen3DecoderLayer", head_norms=("q_norm", "k_norm"), head_dim_from_key_length=True),
    Family("qwen2_moe", "qwen2moe", "Qwen2MoeDecoderLayer", head_dim_from_key_length=True, mixture=True,
           extra_config_keys=(("expert_feed_forward_length", "moe_intermediate_size"),
                              ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"))),
    Family("qwen3_moe", "qwen3moe", "Qwen3MoeDecoderLayer", head_norms=("q_norm", "k_norm"),
           head_dim_from_key_length=True, mixture=True,
           extra_config_keys=(("expert_feed_forward_length", "moe_intermediate_size"),)),
    # llama.cpp writes Mixtral's files as llama's with experts (WITH_EXPERTS); its router always normalizes.
    Family("mixtral", "llama", "MixtralDecoderLayer", permuted_qk=True, mixture=True, expert_size="intermediate_size",
           top_k_normalized=True),
    Family("phi3", "phi3", "Phi3DecoderLayer", qkv=("qkv_proj",), gate_up=("gate_up_proj",),
           window_on_every_layer=True, head_dim_from_key_length=True, partial_and_long_rope=True),
    Family("gemma2", "gemma2", "Gemma2DecoderLayer", additive_mask=True, big_model_layers=46,
           extra_config_keys=(("attn_logit_softcapping", "attn_logit_softcapping"),
                              ("final_logit_softcapping", "final_logit_softcapping")), **GEMMA),
    Family("gemma3_text", "gemma3", "Gemma3DecoderLayer", head_norms=("q_norm", "k_norm"), big_model_layers=62,
           rope_scaling_from_metadata=True, **GEMMA),
    # SmolLM3: llama's, every fourth layer without rotary (config.no_rope_layers; file.py reads the file as llama's).
    Family("smollm3", "smollm3", "SmolLM3DecoderLayer", permuted_qk=True),
    # Gemma (1): gemma's embedding scale, 1 + weight norms and GELU-tanh gate, without Gemma 2's output norms and caps.
    Family("gemma", "gemma", "GemmaDecoderLayer", norm_offset=1.0, embedding_scaled=True),
    # Granite 3: llama's with multipliers (file.py reads the file as llama's, then these keys).
    Family("granite", "granite", "GraniteDecoderLayer", permuted_qk=True, multipliers=True,
           extra_config_keys=(("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                              ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"))),
)}
# Architectures transformers' GGUF reading does not know, whose files llama.cpp writes with another's keys, tensor
# names and q/k layout: read as that one (its config keys, fixed values and tensor processor; the own model
# un-permutes q/k as it does) into the class of the model each was written from, with what complete_config
# adds. smollm3 (every fourth layer without rotary, SmolLM3Config's default) and granite (its multipliers, by the
# families' row) as llama's; mistral3 as llama's into Ministral 3's text model, or llama's where it has no rotary
# scaling (Mistral Small 3.x's); gemma (1) as gemma2's (norms stored as 1 + weight); olmo2, exaone4 and glm4 with
# llama's keys and their rows as the checkpoint's (qwen3's) into OLMo 2's or, with a window, OLMo 3's, EXAONE 4's and
# GLM-4's (its partial rotary from rope.dimension_count); arcee (AFM-4.5B: llama's layers with a ReLU^2 MLP of up and
# down alone) as llama's into Arcee's; seed_oss (Seed-OSS-36B) with qwen2's keys and q/k/v biases into Seed-OSS's;
# apertus (Apertus 8B, 70B) with llama's keys and its rows as the checkpoint's into Apertus's (its xIELU from keys);
# hunyuan-dense (Hunyuan 0.5B-7B) likewise into Hunyuan's, its NTK alpha already in the file's rope base.
READ_AS = {"smollm3": "llama", "granite": "llama", "mistral3": "llama", "olmo2": "qwen3", "gemma": "gemma2",
           "exaone4": "qwen3", "glm4": "qwen3", "arcee": "llama", "seed_oss": "qwen2", "apertus": "qwen3",
           "hunyuan-dense": "qwen3"}
# Architectures whose (text) model computes another's, read as that one into its model: Qwen3-VL's decoder is Qwen3's
# and Qwen2-VL's and Qwen2.5-VL's (qwen2vl, Qwen2.5-Omni's thinker too) Qwen2's (a text prompt's positions, the same
# on each axis of their MRoPE, rotate as the one axis does; Qwen3-VL's deepstack adds only to image tokens; the vision
# towers come in llama.cpp's separate mmproj files, not read), and
# ERNIE 4.5's dense model is llama's over its q/k rows un-permuted (its checkpoint's rows, which its converter
# leaves as they are, rotate pairwise as llama.cpp's permuted llama rows do: un-permuted, by halves, as llama's).
MODEL_OF = {"qwen3vl": "qwen3", "qwen3vlmoe": "qwen3moe", "qwen2vl": "qwen2", "ernie4_5": "llama"}
READ_AS.update(MODEL_OF)
# The family of a file of this architecture whose layers have experts (<arch>.expert_count): transformers reads
# it as the architecture's dense model.
WITH_EXPERTS = {"llama": "mixtral"}
BY_LAYER_CLASS = {family.layer_class: family for family in FAMILIES.values()}
BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES.values()
                   if family.model_type not in WITH_EXPERTS.values()}
# What a file of another architecture gets from its metadata: nothing beyond transformers' reading.
NO_FAMILY = Family("", "", "")
