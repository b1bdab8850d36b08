"""The entries of transformers' kind of GGUF conversion table added here (OWN_TABLES), one an architecture
transformers' GGUF reading does not know: its config reader (the file's metadata and tensor names to a config dict,
as transformers' GGUF_CONFIG_ARCHS hold them; a ValueError for a file the model class cannot compute) and its tensor
table (the file's names to the model's, and what a converter does to them, as GGUF_ARCHS hold them). The renamings
several families share come first. conversions.py teaches them to transformers and reads them for the build.
"""

from __future__ import annotations

import torch


def _lfm2moe_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """LFM2-MoE's config (LFM2-8B-A1B, 24B-A2B): lfm2's, read by transformers' own table from the same keys, and the
    experts' (count, used, inner width, the dense layers first; the expert bias where the file has it). llama.cpp's
    graph normalizes the chosen weights and scales them by expert_weights_scale where set; a router not of sigmoid
    scores is refused."""
    from transformers.integrations.gguf.gguf_config_mapping import _lfm2_config

    gating = metadata.get("lfm2moe.expert_gating_func", 2)
    if gating != 2:
        raise ValueError(f"its router's gating function {gating} (expert_gating_func), where LFM2-MoE's scores "
                         "experts by a sigmoid (2)")
    config = _lfm2_config({key.replace("lfm2moe.", "lfm2.", 1): value for key, value in metadata.items()},
                          tensor_names)
    del config["block_auto_adjust_ff_dim"]  # (Lfm2MoeConfig's widths are the file's)
    config.update(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"],
                  num_experts=metadata["lfm2moe.expert_count"],
                  num_experts_per_tok=metadata["lfm2moe.expert_used_count"],
                  moe_intermediate_size=metadata["lfm2moe.expert_feed_forward_length"],
                  num_dense_layers=metadata.get("lfm2moe.leading_dense_block_count", 0), norm_topk_prob=True,
                  use_expert_bias=any(name.endswith(".exp_probs_b.bias") for name in tensor_names),
                  routed_scaling_factor=metadata.get("lfm2moe.expert_weights_scale", 1.0))
    return config


def _joined_experts(block: str) -> list:
    """A mixture's experts under `block`: ffn_down_exps as its experts' down_proj, ffn_gate_exps and ffn_up_exps
    joined into their gate_up_proj (gate rows first, as transformers' Experts modules hold them)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import ConcatenateRows

    return [WeightRenaming(r"\.ffn_down_exps\.weight", f".{block}.experts.down_proj"),
            WeightConverter(source_patterns=[r"\.ffn_gate_exps\.weight", r"\.ffn_up_exps\.weight"],
                            target_patterns=f".{block}.experts.gate_up_proj", operations=[ConcatenateRows(dim=1)])]


def _llama_attention(attention: str = "self_attn") -> list:
    """llama's attention tensors (attn_q, attn_k, attn_v, attn_output) as q_proj, k_proj, v_proj and o_proj under
    `attention`."""
    from transformers.core_model_loading import WeightRenaming

    return [WeightRenaming(rf"\.attn_{name}\.", f".{attention}.{part}_proj.")
            for name, part in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))]


def _gated_mlp(target: str, suffix: str = "") -> list:
    """A gated MLP's tensors (ffn_gate, ffn_up, ffn_down, each with `suffix`: "_shexp" a shared expert's) as gate_proj,
    up_proj and down_proj under `target`."""
    from transformers.core_model_loading import WeightRenaming

    return [WeightRenaming(rf"\.ffn_{part}{suffix}\.", f".{target}.{part}_proj.") for part in ("gate", "up", "down")]


def _lfm2moe(config) -> list:
    """LFM2-MoE's tensors: lfm2's, the router (ffn_gate_inp), the expert bias (exp_probs_b.bias) and the experts
    (ffn_gate_exps and ffn_up_exps joined into gate_up_proj, gate rows first, as Qwen3.5-MoE's)."""
    from transformers.core_model_loading import WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import _lfm2

    return _lfm2(config) + [
        WeightRenaming(r"\.ffn_gate_inp\.", ".feed_forward.gate."),
        WeightRenaming(r"\.exp_probs_b\.bias", ".feed_forward.expert_bias"),
        *_joined_experts("feed_forward")]


def _vocabulary(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config's vocabulary fields as transformers' own config readers set them: its size (`read_gguf_metadata`
    leaves the vocabulary as its length), tied embeddings where the file has no output.weight, the special ids (absent:
    None)."""
    return {"vocab_size": metadata["tokenizer.ggml.tokens"],
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id")}


def _llama_text(key, metadata: dict, tensor_names: tuple[str, ...], theta: float) -> dict:
    """llama's keys of a text model (`key(name, default)`: the file's under its architecture) as transformers' configs
    name them: the context, width, layers, heads (as many kv heads where the file does not say), the norms' epsilon, a
    plain rotary at the file's base (else `theta`), q/k/v biases where the file has them, the vocabulary's fields."""
    heads = key("attention.head_count")
    return {"max_position_embeddings": key("context_length"), "hidden_size": key("embedding_length"),
            "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
            "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base", theta)},
            "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
            **_vocabulary(metadata, tensor_names)}


def _llama_layers(head_norms: bool = False) -> list:
    """llama's renamings of a model's trunk, each layer's two norms (attn_norm, ffn_norm) and its attention; q's and
    k's norms (attn_q_norm, attn_k_norm) too where `head_norms`."""
    from transformers.core_model_loading import WeightRenaming

    norms = [WeightRenaming(rf"\.attn_{part}_norm\.", f".self_attn.{part}_norm.") for part in ("q", "k")]
    return [*_trunk(), WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
            WeightRenaming(r"\.ffn_norm\.", ".post_attention_layernorm."), *_llama_attention(),
            *(norms if head_norms else [])]


def _granite_multipliers(metadata: dict, architecture: str) -> dict:
    """Granite's multipliers from the keys Granite 3's row of the families reads them from (families.FAMILIES'
    extra_config_keys), under `architecture`; a key the file lacks left to the config class's 1."""
    from .families import FAMILIES

    return {field: metadata[f"{architecture}.{key}"] for key, field in FAMILIES["granite"].extra_config_keys
            if f"{architecture}.{key}" in metadata}


def _granitehybrid_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Granite 4.0 H's config (granite-4.0-h-micro, h-tiny, h-small: GraniteMoeHybridForCausalLM): Mamba-2 layers where
    a layer has no kv heads, attention without rotary (llama.cpp's converter writes every hybrid Granite so), Granite's
    multipliers, the experts (none: the shared MLP alone, of feed_forward_length) beside the shared MLP. A file whose
    attention rotates (Bamba's, by part of a head) is refused: GraniteMoeHybrid's attention does not."""
    key = lambda name: metadata[f"granitehybrid.{name}"]  # noqa: E731
    if metadata.get("granitehybrid.rope.scaling.finetuned"):
        raise ValueError("its attention rotates (rope.scaling.finetuned: Bamba's), where Granite 4.0 H's does not")
    kv_heads, hidden, inner = key("attention.head_count_kv"), key("embedding_length"), key("ssm.inner_size")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * key("block_count")
    experts, ssm_heads = metadata.get("granitehybrid.expert_count", 0), key("ssm.time_step_rank")
    if inner % hidden or inner % ssm_heads:
        raise ValueError(f"its Mamba-2 width {inner} is no multiple of its hidden size {hidden} and heads {ssm_heads}")
    return {
        "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
        "max_position_embeddings": key("context_length"), "hidden_size": hidden,
        "num_hidden_layers": key("block_count"), "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": max(kv_heads), "layer_types": ["attention" if heads else "mamba" for heads in kv_heads],
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "position_embedding_type": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": metadata.get("granitehybrid.rope.freq_base", 1e4)},
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        **_granite_multipliers(metadata, "granitehybrid"),
        "num_local_experts": experts, "num_experts_per_tok": key("expert_used_count") if experts else 0,
        "intermediate_size": key("feed_forward_length"),
        "shared_intermediate_size": key("expert_shared_feed_forward_length" if experts else "feed_forward_length"),
        "mamba_n_heads": ssm_heads, "mamba_n_groups": key("ssm.group_count"), "mamba_d_state": key("ssm.state_size"),
        "mamba_d_head": inner // ssm_heads, "mamba_d_conv": key("ssm.conv_kernel"), "mamba_expand": inner // hidden,
        "mamba_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensor_names),
        "mamba_proj_bias": any(name.endswith(".ssm_in.bias") for name in tensor_names),
        **_vocabulary(metadata, tensor_names),
    }


def _granitemoe_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Granite 3's mixtures' config (granite-3.0/3.1-1b-a400m, 3b-a800m: GraniteMoeForCausalLM; with a shared MLP,
    GraniteMoeSharedForCausalLM): llama's keys (feed_forward_length the experts' width), Granite's multipliers, the
    experts' count and those a token takes, the shared MLP's width. A rotary over part of a head is refused."""
    key = lambda name: metadata[f"granitemoe.{name}"]  # noqa: E731
    shared = any(name.endswith(".ffn_gate_shexp.weight") for name in tensor_names)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    if metadata.get("granitemoe.rope.dimension_count", hidden // heads) != hidden // heads:
        raise ValueError(f"its rotary turns {key('rope.dimension_count')} of a head's {hidden // heads} values, "
                         "where Granite's turns them all")
    config = {
        "model_type": "granitemoeshared" if shared else "granitemoe",
        "architectures": ["GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM"],
        "max_position_embeddings": key("context_length"), "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": metadata.get("granitemoe.attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_type": "default", "rope_theta": metadata.get("granitemoe.rope.freq_base", 1e4)},
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        **_granite_multipliers(metadata, "granitemoe"),
        "num_local_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        **_vocabulary(metadata, tensor_names),
    }
    if shared:
        config["shared_intermediate_size"] = key("expert_shared_feed_forward_length")
    return config


def _unpermuted(heads: int, rows: int) -> torch.Tensor:
    """The order of the rows llama.cpp's converter permuted for its interleaved rotary (LlamaModel.permute: each head's
    halves interleaved), back to the checkpoint's."""
    size = rows // heads
    return torch.arange(rows, device="cpu").view(heads, size // 2, 2).transpose(1, 2).reshape(-1)  # (not on meta)


def _trunk(embedding: str = "model.embed_tokens", norm: str = "model.norm") -> list:
    """The renamings of a model's trunk: the embedding, the head, the final norm (under the names given), the
    layers."""
    from transformers.core_model_loading import WeightRenaming

    return [WeightRenaming(r"^token_embd\.", f"{embedding}."), WeightRenaming(r"^output\.", "lm_head."),
            WeightRenaming(r"^output_norm\.", f"{norm}."), WeightRenaming(r"^blk\.", "model.layers.")]


def _mamba2_and_attention(config, mamba: str, attention: str, permuted: bool = True) -> list:
    """A Mamba-2 hybrid's tensors of its Mamba-2 layers (under `mamba`: A as -exp(A_log) and D a column each, the
    convolution squeezed, the gated norm a row a group, dt_bias as ssm_dt.bias) and its attention's (under
    `attention`: llama's names, q and k rows un-permuted from llama.cpp's rotary permutation where `permuted`)."""
    from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import LogNegate, PermuteRows, Unsqueeze

    class Flat(ConversionOps):
        """The tensor as one row (llama.cpp's converter writes A and D a column each, the gated norm a row a group)."""

        @torch.no_grad()
        def convert(self, input_dict: dict, source_patterns: list, target_patterns: list, **kwargs) -> dict:
            [tensor] = [value[0] if isinstance(value, list) else value for value in input_dict.values()]
            return {target_patterns[0]: tensor.reshape(-1)}

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [
        *_llama_attention(attention),
        WeightRenaming(r"\.ssm_in\.", f".{mamba}.in_proj."),
        WeightRenaming(r"\.ssm_out\.", f".{mamba}.out_proj."),
        WeightRenaming(r"\.ssm_conv1d\.bias", f".{mamba}.conv1d.bias"),
        WeightRenaming(r"\.ssm_dt\.bias", f".{mamba}.dt_bias"),
        WeightConverter(source_patterns=r"\.ssm_conv1d\.weight", target_patterns=f".{mamba}.conv1d.weight",
                        operations=[Unsqueeze(1)]),
        WeightConverter(source_patterns=r"\.ssm_a$", target_patterns=f".{mamba}.A_log",
                        operations=[LogNegate(), Flat()]),
        WeightConverter(source_patterns=r"\.ssm_d$", target_patterns=f".{mamba}.D", operations=[Flat()]),
        WeightConverter(source_patterns=r"\.ssm_norm\.weight", target_patterns=f".{mamba}.norm.weight",
                        operations=[Flat()]),
    ] + ([] if not permuted else [
        WeightConverter(source_patterns=f"{attention}.q_proj.weight", target_patterns=f"{attention}.q_proj.weight",
                        operations=[PermuteRows(_unpermuted(config.num_attention_heads,
                                                            config.num_attention_heads * head))]),
        WeightConverter(source_patterns=f"{attention}.k_proj.weight", target_patterns=f"{attention}.k_proj.weight",
                        operations=[PermuteRows(_unpermuted(config.num_key_value_heads,
                                                            config.num_key_value_heads * head))])])


def _granite(config) -> list:
    """Granite 4.0 H's and Granite 3's mixtures' tensors: the Mamba-2 layers' and the attention's
    (_mamba2_and_attention); the router, the experts (ffn_gate_exps and ffn_up_exps joined into gate_up_proj, gate
    rows first) and the shared MLP (its gate and up rows joined into input_linear: ffn_*_shexp, a dense model's
    ffn_*)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import ConcatenateRows

    shared = "_shexp" if getattr(config, "num_local_experts", 0) else ""
    return [
        *_trunk(),
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".post_attention_layernorm."),
        *_mamba2_and_attention(config, "mamba", "self_attn"),
        WeightRenaming(r"\.ffn_gate_inp\.", ".block_sparse_moe.router."),
        *_joined_experts("block_sparse_moe"),
        WeightRenaming(rf"\.ffn_down{shared}\.", ".shared_mlp.output_linear."),
        WeightConverter(source_patterns=[rf"\.ffn_gate{shared}\.weight", rf"\.ffn_up{shared}\.weight"],
                        target_patterns=".shared_mlp.input_linear.weight", operations=[ConcatenateRows(dim=0)])]


def _nemotron_h_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Nemotron-H's config (NVIDIA-Nemotron-Nano-9B-v2, 12B-v2, Nemotron-H 8B-56B: NemotronHForCausalLM): each
    layer's kind from its kv heads and MLP width (a Mamba-2 layer has neither), the ssm.* keys, the head size,
    attention without rotary (a file that says it rotates is refused), relu^2 MLPs."""
    key = lambda name: metadata[f"nemotron_h.{name}"]  # noqa: E731
    if metadata.get("nemotron_h.rope.scaling.finetuned"):
        raise ValueError("its attention rotates (rope.scaling.finetuned), where Nemotron-H's does not")
    kv_heads, widths, heads = key("attention.head_count_kv"), key("feed_forward_length"), key("ssm.time_step_rank")
    kinds = ["full_attention" if kv else "mlp" if width else "linear_attention" for kv, width in zip(kv_heads, widths)]
    return {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
        "max_position_embeddings": key("context_length"), "hidden_size": key("embedding_length"),
        "layers_block_type": kinds, "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": max(kv_heads), "head_dim": key("attention.key_length"),
        "intermediate_size": max(widths), "mlp_hidden_act": "relu2",
        "mlp_bias": any(name.endswith(".ffn_up.bias") for name in tensor_names),
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        "layer_norm_epsilon": key("attention.layer_norm_epsilon"),
        "ssm_state_size": key("ssm.state_size"), "mamba_num_heads": heads,
        "mamba_head_dim": key("ssm.inner_size") // heads, "n_groups": key("ssm.group_count"),
        "conv_kernel": key("ssm.conv_kernel"),
        "use_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensor_names),
        "mamba_proj_bias": any(name.endswith(".ssm_in.bias") for name in tensor_names),
        **_vocabulary(metadata, tensor_names),
    }


def _nemotron_h_moe_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Nemotron 3's config (NVIDIA-Nemotron-3-Nano-30B-A3B, Nemotron-3-Super-120B-A12B: NemotronHForCausalLM with
    mixtures): Nemotron-H's (_nemotron_h_config), a layer of an MLP width a mixture's layer, and the mixture's keys:
    the experts' count, those a token takes, their width, the shared expert's, the scores' sum normalized and scaled,
    the latent width where the file has one; the multi-token prediction block the converter writes as the last
    (nextn_predict_layers: not read) dropped. Groups of experts without the count a token takes of them are refused."""
    key = lambda name, default=None: metadata.get(f"nemotron_h_moe.{name}", default)  # noqa: E731
    nextn, groups = key("nextn_predict_layers", 0), key("expert_group_count", 1) or 1
    if groups > 1 and not key("expert_group_used_count"):
        raise ValueError(f"its experts are in {groups} groups (expert_group_count) without the count a token takes "
                         "of them (expert_group_used_count)")
    trunk = {name: value[:len(value) - nextn] if isinstance(value, list) and name.startswith("nemotron_h_moe.")
             else value for name, value in metadata.items()}
    config = _nemotron_h_config({name.replace("nemotron_h_moe.", "nemotron_h.", 1): value
                                 for name, value in trunk.items()}, tensor_names)
    config["layers_block_type"] = ["moe" if kind == "mlp" else kind for kind in config["layers_block_type"]]
    config.update(
        n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        moe_intermediate_size=key("expert_feed_forward_length"),
        moe_shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
        n_shared_experts=key("expert_shared_count", 1), norm_topk_prob=bool(key("expert_weights_norm", False)),
        routed_scaling_factor=key("expert_weights_scale", 1.0), n_group=groups,
        topk_group=key("expert_group_used_count", 1), moe_latent_size=key("moe_latent_size") or None,
        num_nextn_predict_layers=0)
    return config


def _nemotron_h(config) -> list:
    """Nemotron-H's tensors: each layer's one mixer (Mamba-2, attention, MLP: ffn_up and ffn_down, or Nemotron 3's
    mixture: the router and its correction, the experts' up and down (no gate), the shared expert, the latent
    projections) behind its norm (attn_norm), the Mamba-2 layers' and the attention's as _mamba2_and_attention reads
    them."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_trunk("model.embeddings", "model.norm_f"),
        WeightRenaming(r"\.attn_norm\.", ".norm."),
        WeightRenaming(r"\.ffn_up\.", ".mixer.up_proj."),
        WeightRenaming(r"\.ffn_down\.", ".mixer.down_proj."),
        WeightRenaming(r"\.ffn_gate_inp\.", ".mixer.gate."),
        WeightRenaming(r"\.exp_probs_b\.bias", ".mixer.gate.e_score_correction_bias"),
        WeightRenaming(r"\.ffn_up_exps\.weight", ".mixer.experts.up_proj"),
        WeightRenaming(r"\.ffn_down_exps\.weight", ".mixer.experts.down_proj"),
        WeightRenaming(r"\.ffn_up_shexp\.", ".mixer.shared_experts.up_proj."),
        WeightRenaming(r"\.ffn_down_shexp\.", ".mixer.shared_experts.down_proj."),
        WeightRenaming(r"\.ffn_latent_down\.", ".mixer.fc1_latent_proj."),
        WeightRenaming(r"\.ffn_latent_up\.", ".mixer.fc2_latent_proj."),
        *_mamba2_and_attention(config, "mixer", "mixer")]


def _falcon_h1_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Falcon-H1's config (Falcon-H1-0.5B to 34B, Falcon-H1R, Falcon-H1-Tiny: FalconH1ForCausalLM): every layer its
    attention and its Mamba-2 mixer side by side behind one norm, then its MLP; the ssm.* keys, the head size, the
    biases and the mixer's gated norm where the file has their tensors. Every multiplier 1: llama.cpp's converter
    multiplied Falcon-H1's (the embedding's, the head's, the attention's and mixer's inputs and outputs, the keys',
    the MLP's, the mixer's projections' by part) into the weights they scale, and its graph applies none; the
    mixer's gated norm (where its files have one) after the gate, as that graph normalizes. A file with its multipliers
    in keys (TII's fork's, before that converter) is refused: its weights are not multiplied."""
    key = lambda name: metadata[f"falcon-h1.{name}"]  # noqa: E731
    kept = sorted(name for name in metadata if name.startswith("falcon-h1.") and ("multiplier" in name
                                                                                 or name.endswith(".has_mup")))
    if kept:  # (TII's llama.cpp fork's files: the weights as trained, their multipliers in keys)
        raise ValueError(f"its multipliers are in keys ({kept[0]}), as TII's llama.cpp fork wrote Falcon-H1's files "
                         "before llama.cpp's converter multiplied them into the weights; convert the checkpoint again "
                         "with llama.cpp's convert_hf_to_gguf.py")
    hidden, heads, inner, ssm_heads = (key(name) for name in ("embedding_length", "attention.head_count",
                                                              "ssm.inner_size", "ssm.time_step_rank"))
    if inner % ssm_heads:
        raise ValueError(f"its Mamba-2 width {inner} is no multiple of its {ssm_heads} heads")
    return {
        "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
        "max_position_embeddings": key("context_length"), "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": metadata.get("falcon-h1.attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_type": "default", "rope_theta": metadata.get("falcon-h1.rope.freq_base", 1e4)},
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        "projectors_bias": any(name.endswith(".ssm_out.bias") for name in tensor_names),
        "mlp_bias": any(name.endswith(".ffn_up.bias") for name in tensor_names),
        "mamba_d_ssm": inner, "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads,
        "mamba_n_groups": key("ssm.group_count"), "mamba_d_state": key("ssm.state_size"),
        "mamba_d_conv": key("ssm.conv_kernel"),
        "mamba_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensor_names),
        "mamba_proj_bias": any(name.endswith(".ssm_in.bias") for name in tensor_names),
        "mamba_rms_norm": any(name.endswith(".ssm_norm.weight") for name in tensor_names),
        "mamba_norm_before_gate": False,
        **dict.fromkeys(("lm_head_multiplier", "embedding_multiplier", "key_multiplier", "attention_out_multiplier",
                         "attention_in_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"), 1.0),
        "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5,
        **_vocabulary(metadata, tensor_names),
    }


def _falcon_h1(config) -> list:
    """Falcon-H1's tensors: each layer's norm (attn_norm), attention and Mamba-2 mixer (_mamba2_and_attention; q and
    k as the checkpoint holds them: its rotary turns halves, and the converter permutes none), the MLP's norm
    (blk.N.ffn_norm, without .weight as the converter names it) and its gate, up and down."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_trunk(norm="model.final_layernorm"),
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ffn_norm(\.weight)?$", ".pre_ff_layernorm.weight"),  # (the converter writes no .weight)
        *_gated_mlp("feed_forward"),
        *_mamba2_and_attention(config, "mamba", "self_attn", permuted=False)]


def _olmoe_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """AI2's OLMoE config (OLMoE-1B-7B: OlmoeForCausalLM): llama's keys, q and k each normalized over all their heads,
    every layer's MLP a mixture of softmax-scored experts (feed_forward_length their width), their weights normalized
    where expert_weights_norm says (llama.cpp's converter writes no such key for OLMoE, and its graph then leaves them,
    as OLMoE's config does). A file whose q, k and v are clamped (attention.clamp_kqv) is refused: transformers'
    OLMoE clamps by its own config, which the file's reading would not give."""
    key = lambda name, default=None: metadata.get(f"olmoe.{name}", default)  # noqa: E731
    if key("attention.clamp_kqv"):
        raise ValueError(f"its q, k and v are clamped at {key('attention.clamp_kqv')} (attention.clamp_kqv)")
    return {
        "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], **_llama_text(key, metadata, tensor_names, 1e4),
        "intermediate_size": key("expert_feed_forward_length", key("feed_forward_length")),
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "norm_topk_prob": bool(key("expert_weights_norm", False)), "clip_qkv": None,
    }


def _olmoe(config) -> list:
    """OLMoE's tensors: llama's names (q and k as the checkpoint holds them: its rotary turns halves, and the converter
    permutes none), q's and k's norms over all their heads, the router (ffn_gate_inp), the experts (ffn_gate_exps and
    ffn_up_exps joined into gate_up_proj, gate rows first)."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_llama_layers(head_norms=True),
        WeightRenaming(r"\.ffn_gate_inp\.", ".mlp.gate."),
        *_joined_experts("mlp")]


def _afmoe_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Arcee's AFMoE config (Trinity-Nano, Trinity-Mini, Trinity-Large: AfmoeForCausalLM): llama's keys, every fourth
    layer full attention and without rotary, the others sliding (llama.cpp's pattern where the file names none),
    each attention's output gated (attn_gate) and its q and k normalized per head, the dense layers first, then
    mixtures of sigmoid-scored experts with a correction, normalized and scaled, beside shared ones; the embedding
    scaled by the square root of its width, as llama.cpp's graph scales it (muP). A file whose chosen experts' weights
    are not normalized (expert_weights_norm false or absent: llama.cpp then leaves them so, AFMoE's router always
    normalizes them), whose rotary turns part of a head or whose sliding layers rotate by another base is refused."""
    key = lambda name, default=None: metadata.get(f"afmoe.{name}", default)  # noqa: E731
    head = key("attention.key_length")
    if not key("expert_weights_norm"):
        raise ValueError("its chosen experts' weights are not normalized (afmoe.expert_weights_norm), where AFMoE's "
                         "router normalizes them")
    if key("rope.dimension_count", head) != head or key("rope.freq_base_swa", key("rope.freq_base")) != \
            key("rope.freq_base") or key("attention.sliding_window_pattern") not in (None, 4) or \
            not key("attention.sliding_window"):
        raise ValueError("its rotary or its sliding layers are not AFMoE's (a whole head turned, one base, a window, "
                         "every fourth layer full and without rotary)")
    if key("expert_gating_func", 2) != 2:
        raise ValueError(f"its router's gating function {key('expert_gating_func')} (expert_gating_func), where "
                         "AFMoE scores experts by a sigmoid (2)")
    layers = key("block_count")
    return {
        "model_type": "afmoe", "architectures": ["AfmoeForCausalLM"], **_llama_text(key, metadata, tensor_names, 1e4),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_dense_layers": key("leading_dense_block_count", 0), "head_dim": head,
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "num_shared_experts": key("expert_shared_count", 0), "route_scale": key("expert_weights_scale", 1.0),
        "global_attn_every_n_layers": 4, "sliding_window": key("attention.sliding_window"),
        "layer_types": ["full_attention" if (layer + 1) % 4 == 0 else "sliding_attention" for layer in range(layers)],
        "mup_enabled": True,
    }


def _afmoe(config) -> list:
    """AFMoE's tensors: the four norms of a layer (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm), the
    attention's q, k, v, output and gate and its per-head norms (q and k as the checkpoint holds them: its rotary turns
    halves, and the converter permutes none), the dense layers' MLP, a mixture's router and its correction
    (exp_probs_b.bias), the experts (ffn_gate_exps and ffn_up_exps joined into gate_up_proj, gate rows first) and the
    shared experts."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_trunk(),
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.post_attention_norm\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".pre_mlp_layernorm."),
        WeightRenaming(r"\.post_ffw_norm\.", ".post_mlp_layernorm."),
        *_llama_attention(),
        WeightRenaming(r"\.attn_gate\.", ".self_attn.gate_proj."),
        WeightRenaming(r"\.attn_q_norm\.", ".self_attn.q_norm."),
        WeightRenaming(r"\.attn_k_norm\.", ".self_attn.k_norm."),
        *_gated_mlp("mlp"),
        WeightRenaming(r"\.ffn_gate_inp\.", ".mlp.router.gate."),
        WeightRenaming(r"\.exp_probs_b\.bias", ".mlp.expert_bias"),
        *_gated_mlp("mlp.shared_experts", "_shexp"),
        *_joined_experts("mlp")]


# Llama 4's chunked attention (each position sees its chunk's earlier ones) and its rotary-free layers' query
# temperature (1 + attn_scale * log(1 + floor((position + 1) / floor_scale))): llama.cpp's constants (no key holds
# them). Below the chunk's last position both are plain causal attention.
LLAMA4_CHUNK, LLAMA4_NO_ROPE_STEP = 8192, 4


def _llama4_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Llama 4's config (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E: Llama4ForCausalLM): llama's keys, the
    dense layers' MLP as feed_forward_length and the experts' width as expert_feed_forward_length, every
    interleave_moe_layer_step-th layer a mixture (a sigmoid-scored expert a token beside a shared one), every fourth
    layer without rotary, the others' q and k L2-normalized after it unless the file has 128 experts (Maverick's: as
    llama.cpp decides, no key says), their queries' temperature tuned. Its layers read as full ones, which the
    engine's padded batch and slots hold: native_steps.NativeLlama4Attention attends within chunks itself; where
    transformers' attention runs them (no native kernels, --dequantize, a GPU) the context is cut before the first
    chunk's last position (loading.model_context), where chunks are plain attention. A file without experts
    (MobileLLM's, which llama.cpp refuses too) or with a sliding window key (not Llama 4's chunks) is refused."""
    key = lambda name, default=None: metadata.get(f"llama4.{name}", default)  # noqa: E731
    experts, layers, heads = key("expert_count", 0), key("block_count"), key("attention.head_count")
    if not experts:
        raise ValueError("it has no experts (expert_count), which Llama 4's layers have (llama.cpp refuses it too)")
    if key("attention.sliding_window") is not None:
        raise ValueError(f"its attention has a sliding window of {key('attention.sliding_window')} "
                         "(attention.sliding_window), where Llama 4's layers attend in chunks")
    step = key("interleave_moe_layer_step", 1)
    return {
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
        **_llama_text(key, metadata, tensor_names, 5e5),
        "intermediate_size": key("expert_feed_forward_length"), "intermediate_size_mlp": key("feed_forward_length"),
        "head_dim": key("attention.key_length", key("embedding_length") // heads),
        "num_local_experts": experts, "num_experts_per_tok": key("expert_used_count"),
        "interleave_moe_layer_step": step, "moe_layers": list(range(step - 1, layers, step)),
        "use_qk_norm": experts != 128, "no_rope_layer_interval": LLAMA4_NO_ROPE_STEP,
        "no_rope_layers": [int((layer + 1) % LLAMA4_NO_ROPE_STEP != 0) for layer in range(layers)],
        "layer_types": ["full_attention"] * layers, "attention_chunk_size": LLAMA4_CHUNK,
        "attn_temperature_tuning": True, "floor_scale": LLAMA4_CHUNK, "attn_scale": 0.1,
    }


def _llama4(config) -> list:
    """Llama 4's tensors: llama's names (q and k as the checkpoint holds them: its rotary turns pairs, as llama.cpp's
    does, and the converter permutes none), the dense layers' MLP, a mixture's router (ffn_gate_inp), shared expert
    and experts (ffn_gate_exps and ffn_up_exps joined into gate_up_proj, gate rows first, as llama4.py's form holds
    them; transposed for transformers' own model, whose Llama4TextExperts hold them so: --dequantize's)."""
    from transformers.core_model_loading import Transpose, WeightConverter, WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import ConcatenateRows

    transposed = Transpose(1, 2)
    return [
        *_llama_layers(),
        *_gated_mlp("feed_forward"),
        WeightRenaming(r"\.ffn_gate_inp\.", ".feed_forward.router."),
        *_gated_mlp("feed_forward.shared_expert", "_shexp"),
        WeightConverter(source_patterns=[r"\.ffn_down_exps\.weight"],
                        target_patterns=".feed_forward.experts.down_proj", operations=[transposed]),
        WeightConverter(source_patterns=[r"\.ffn_gate_exps\.weight", r"\.ffn_up_exps\.weight"],
                        target_patterns=".feed_forward.experts.gate_up_proj",
                        operations=[ConcatenateRows(dim=1), transposed])]


def _hy_v3_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Tencent's HY V3 config (Hy3: HYV3ForCausalLM): llama's keys with the head size, q and k normalized per head,
    a layer's MLP dense where the file has no router for it (the first, as published), else a mixture of
    sigmoid-scored experts chosen by those plus a correction, normalized and scaled (expert_weights_scale: its
    router_scaling_factor), beside shared experts; the multi-token prediction layers the converter appends
    (nextn_predict_layers: not read). A file whose router is not sigmoid-scored or whose weights are not normalized
    (HY V3's router always normalizes them) is refused."""
    key = lambda name, default=None: metadata.get(f"hy_v3.{name}", default)  # noqa: E731
    if key("expert_gating_func", 2) != 2 or not key("expert_weights_norm", True):
        raise ValueError("its router's gating function or its weights' normalization (expert_gating_func, "
                         "expert_weights_norm) is not HY V3's (a sigmoid, normalized)")
    layers = key("block_count") - key("nextn_predict_layers", 0)
    width = key("expert_feed_forward_length")
    return {
        "model_type": "hy_v3", "architectures": ["HYV3ForCausalLM"],
        **_llama_text(key, metadata, tensor_names, 11158840.0),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": width,
        "num_hidden_layers": layers, "head_dim": key("attention.key_length"),
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "num_shared_experts": key("expert_shared_feed_forward_length", width) // width,
        "router_scaling_factor": key("expert_weights_scale", 1.0),
        "mlp_layer_types": ["sparse" if f"blk.{layer}.ffn_gate_inp.weight" in tensor_names else "dense"
                            for layer in range(layers)],
    }


def _hy_v3(config) -> list:
    """HY V3's tensors: llama's names (q and k as the checkpoint holds them: its rotary turns halves), q's and k's
    per-head norms, the dense layers' MLP, a mixture's router and its correction (exp_probs_b, without .bias), the
    shared experts and the experts (ffn_gate_exps and ffn_up_exps joined into gate_up_proj, gate rows first)."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_llama_layers(head_norms=True),
        *_gated_mlp("mlp"),
        WeightRenaming(r"\.ffn_gate_inp\.", ".mlp.gate."),
        WeightRenaming(r"\.exp_probs_b$", ".mlp.e_score_correction_bias"),  # (its converter names it so)
        *_gated_mlp("mlp.shared_experts", "_shexp"),
        *_joined_experts("mlp")]


def _dots1_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """rednote's dots.llm1 config (Dots1ForCausalLM): Qwen3's attention (q and k normalized per head, its head size
    the file's key_length: the published 128 over a width of 4608 and 32 heads), the dense
    layers first (leading_dense_block_count), then DeepSeek-V3's mixtures: sigmoid-scored experts chosen with a
    correction within their groups, normalized where expert_weights_norm says, scaled, beside shared ones. A file
    whose router is not sigmoid-scored is refused."""
    key = lambda name, default=None: metadata.get(f"dots1.{name}", default)  # noqa: E731
    if key("expert_gating_func", 2) != 2:
        raise ValueError(f"its router's gating function {key('expert_gating_func')} (expert_gating_func), where "
                         "dots.llm1 scores experts by a sigmoid (2)")
    heads, layers = key("attention.head_count"), key("block_count")
    return {
        "model_type": "dots1", "architectures": ["Dots1ForCausalLM"], **_llama_text(key, metadata, tensor_names, 1e4),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "head_dim": key("attention.key_length", key("embedding_length") // heads),
        "n_routed_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "n_shared_experts": key("expert_shared_count", 1),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "n_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": key("expert_weights_scale", 1.0), "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
    }


def _dots1(config) -> list:
    """dots.llm1's tensors: llama's names (q and k as the checkpoint holds them), q's and k's per-head norms, the dense
    layers' MLP, a mixture's router and its correction (exp_probs_b.bias), the shared experts and the experts (joined
    into gate_up_proj, gate rows first)."""
    from transformers.core_model_loading import WeightRenaming

    return [
        *_llama_layers(head_norms=True),
        *_gated_mlp("mlp"),
        WeightRenaming(r"\.ffn_gate_inp\.", ".mlp.gate."),
        WeightRenaming(r"\.exp_probs_b\.bias", ".mlp.gate.e_score_correction_bias"),
        *_gated_mlp("mlp.shared_experts", "_shexp"),
        *_joined_experts("mlp")]


def _qwen3next_config(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """Qwen3-Next's config (Qwen3-Next-80B-A3B: qwen3next) as Qwen3.5's mixture's (Qwen3_5MoeTextConfig, whose model
    computes Qwen3-Next's: the same Gated DeltaNet, gated attention and experts, its fused projections split as
    _qwen3next splits them): transformers' qwen35moe reader over the same keys, the rotary's sections (none in the
    file) any of Qwen3.5's interleaved kind (a text's three position rows alike, every split turns it as one plain
    rotary), the recurrent layers where the file lists them, else every full_attention_interval-th layer full; the
    multi-token prediction block the converter writes last (nextn_predict_layers) not read. Dense MLP layers
    (mlp_only_layers, which no published model has) are refused: Qwen3.5's mixture has none."""
    from transformers.integrations.gguf.gguf_config_mapping import _qwen35moe_config

    key = lambda name, default=None: metadata.get(f"qwen3next.{name}", default)  # noqa: E731
    trunk = key("block_count") - key("nextn_predict_layers", 0)
    dense = [name for name in tensor_names if name.endswith(".ffn_gate.weight") and name.startswith("blk.")
             and int(name.split(".")[1]) < trunk]
    if dense:
        raise ValueError(f"its layer {dense[0].split('.')[1]} has a dense MLP (mlp_only_layers), where Qwen3.5's "
                         "mixture, the model it is read as, has experts in every layer")
    half = key("rope.dimension_count") // 2
    renamed = {name.replace("qwen3next.", "qwen35moe.", 1): value for name, value in metadata.items()}
    renamed["qwen35moe.rope.dimension_sections"] = [half - 2 * (half // 3), half // 3, half // 3, 0]
    renamed.setdefault("qwen35moe.full_attention_interval", 4)
    config = _qwen35moe_config(renamed, tensor_names)
    if key("attention.recurrent_layers") is not None:
        config["layer_types"] = ["linear_attention" if recurrent else "full_attention"
                                 for recurrent in key("attention.recurrent_layers")[:trunk]]
    return config


def _qwen3next(config) -> list:
    """Qwen3-Next's tensors into Qwen3.5's mixture: transformers' qwen35moe table without its value heads' reorder
    (llama.cpp's converter tiles Qwen3.5's, not Qwen3-Next's: they stay grouped by key head, as the model takes
    them); the two projections Qwen3-Next fuses split by rows: ssm_ba (each key head's b rows, then its a rows) into
    in_proj_b and in_proj_a, and a file of before the converter split its in_proj_qkvz (ssm_in: each key head's q, k,
    v and z rows) into in_proj_qkv (every head's q, then k, then v) and in_proj_z."""
    from transformers.core_model_loading import ConversionOps, WeightConverter
    from transformers.integrations.gguf.gguf_conversion_mapping import (
        TiledToGroupedInputs,
        TiledToGroupedRows,
        _qwen35moe,
    )

    class SplitRows(ConversionOps):
        """Each of the converter's targets its own rows of the one source tensor: `rows[i]` (indices) for target i
        (Conversion.split: build.py reads each target's rows of the blocks)."""

        def __init__(self, rows: list[torch.Tensor]):
            self.rows = rows

        @torch.no_grad()
        def convert(self, input_dict: dict, source_patterns: list, target_patterns: list, **kwargs) -> dict:
            [tensor] = [value[0] if isinstance(value, list) else value for value in input_dict.values()]
            return {target: tensor[rows.to(tensor.device)].contiguous()
                    for target, rows in zip(target_patterns, self.rows)}

    text = config.get_text_config()
    key_heads, value_heads = text.linear_num_key_heads, text.linear_num_value_heads
    key_dim, value_dim = text.linear_key_head_dim, text.linear_value_head_dim
    table = []
    for entry in _qwen35moe(config):  # (their value heads as the file holds them)
        if isinstance(entry, WeightConverter):
            operations = [op for op in entry.operations
                          if not isinstance(op, (TiledToGroupedRows, TiledToGroupedInputs))]
            if not operations:
                continue
            entry = WeightConverter(source_patterns=entry.source_patterns, target_patterns=entry.target_patterns,
                                    operations=operations)
        table.append(entry)
    per_key = value_heads // key_heads  # (a key head's value heads)
    ba = torch.arange(2 * value_heads, device="cpu").view(key_heads, 2, per_key)
    widths = [key_dim, key_dim, per_key * value_dim, per_key * value_dim]
    qkvz = torch.arange(key_heads * sum(widths), device="cpu").view(key_heads, sum(widths)).split(widths, dim=1)
    return table + [
        WeightConverter(source_patterns=r"\.ssm_ba\.weight",
                        target_patterns=[".linear_attn.in_proj_b.weight", ".linear_attn.in_proj_a.weight"],
                        operations=[SplitRows([ba[:, 0].reshape(-1), ba[:, 1].reshape(-1)])]),
        WeightConverter(source_patterns=r"\.ssm_in\.weight",
                        target_patterns=[".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight"],
                        operations=[SplitRows([torch.cat([part.reshape(-1) for part in qkvz[:3]]),
                                               qkvz[3].reshape(-1)])])]


# Architectures transformers' conversion table lacks, given entries of its kind here: (config reader, tensor table).
OWN_TABLES = {"lfm2moe": (_lfm2moe_config, _lfm2moe), "granitehybrid": (_granitehybrid_config, _granite),
              "granitemoe": (_granitemoe_config, _granite), "nemotron_h": (_nemotron_h_config, _nemotron_h),
              "nemotron_h_moe": (_nemotron_h_moe_config, _nemotron_h), "qwen3next": (_qwen3next_config, _qwen3next),
              "falcon-h1": (_falcon_h1_config, _falcon_h1), "afmoe": (_afmoe_config, _afmoe),
              "olmoe": (_olmoe_config, _olmoe), "llama4": (_llama4_config, _llama4),
              "hy_v3": (_hy_v3_config, _hy_v3), "dots1": (_dots1_config, _dots1)}
