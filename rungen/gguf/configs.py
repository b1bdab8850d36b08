"""What a GGUF file's metadata says of its model, as transformers' config takes it (complete_config): what
transformers' reading leaves out or reads otherwise, by the families' rows and, where an architecture needs more, by
its reader in ARCHITECTURE_CONFIGS (path, the metadata, the tensors' names, the config to complete). A new
architecture's keys go here: a row in families.py where they are a known kind, a reader where not."""

from __future__ import annotations

import numpy as np

from .families import BY_ARCHITECTURE, FAMILIES, MODEL_OF, NO_FAMILY, READ_AS, WITH_EXPERTS
from .table import f32_values, tensor_table
from .weights import GGUFError


def complete_config(path: str, config: dict) -> None:
    """Fills in `config` (load_gguf_checkpoint's dict, in place) what transformers' reading leaves out of the
    file's metadata; GGUFError for a model transformers' classes cannot compute."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, tensors = read_gguf_metadata(path)
    arch = metadata["general.architecture"]
    family = BY_ARCHITECTURE.get(arch) or BY_ARCHITECTURE.get(READ_AS.get(arch), NO_FAMILY)
    if arch in MODEL_OF:
        config["model_type"] = family.model_type
    if arch in WITH_EXPERTS and metadata.get(f"{arch}.expert_count"):  # Mixtral's: transformers reads a dense llama
        family = FAMILIES[WITH_EXPERTS[arch]]
        if f"{arch}.expert_used_count" not in metadata:
            raise GGUFError(f"{path}: experts in every layer (expert_count) but no count of those a token takes "
                            f"({arch}.expert_used_count)")
        config.update(model_type=family.model_type, num_local_experts=metadata[f"{arch}.expert_count"],
                      num_experts_per_tok=metadata[f"{arch}.expert_used_count"])
    key_length = metadata.get(f"{arch}.attention.key_length")
    value_length = metadata.get(f"{arch}.attention.value_length", key_length)
    if key_length is not None and family.head_dim_from_key_length:
        config["head_dim"] = key_length
    # one head_dim for queries, keys and values in every transformers class here (DeepSeek's latent attention's
    # key_length and value_length are its latent's: _deepseek2_config reads its heads' widths)
    if key_length != value_length and arch not in ("deepseek2", "mistral4"):
        raise GGUFError(f"{path}: keys of {key_length} and values of {value_length} values a head "
                        "(attention.key_length/value_length): transformers' attention takes one head size")
    experts, used = config.get("num_experts") or config.get("num_local_experts"), config.get("num_experts_per_tok")
    if experts and used is not None and not 0 < used <= experts:
        raise GGUFError(f"{path}: {used} experts a token (expert_used_count) of {experts} (expert_count)")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if heads and hidden else None)
    for key, field in family.extra_config_keys:
        if f"{arch}.{key}" in metadata:
            config[field] = metadata[f"{arch}.{key}"]
    if family.big_model_layers and head_dim:
        # No key holds it: llama.cpp uses hidden / heads for the largest models (known by layer count), else head_dim.
        big = metadata.get(f"{arch}.block_count") == family.big_model_layers
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    if family.rope_scaling_from_metadata and metadata.get(f"{arch}.rope.scaling.type", "none") != "none":
        # gemma3 4B-27B scale their global layers' rotation linearly; transformers' reading drops it.
        kind = metadata[f"{arch}.rope.scaling.type"]
        if kind != "linear":
            raise GGUFError(f"{path}: its rotary embedding is scaled by {kind!r}, which this tool does not read "
                            "from a gemma3 GGUF file")
        config["rope_scaling"] = {"rope_type": "linear", "factor": metadata[f"{arch}.rope.scaling.factor"]}
    if arch in READ_AS:  # (its config class's default padding token is its published model's, maybe past this file's)
        config.setdefault("pad_token_id", None)
    if arch in ARCHITECTURE_CONFIGS:
        ARCHITECTURE_CONFIGS[arch](path, metadata, tensors, config)
    if arch in SCALED_ROTARIES:
        _scaled_rope(path, arch, metadata, config, tensors)
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if family.partial_and_long_rope:
        # Phi-4-mini rotates part of each head; transformers' reading drops the count.
        if rotary is not None and head_dim and rotary != head_dim:
            config["partial_rotary_factor"] = rotary / head_dim
        if any(name.startswith("rope_factors_") for name in tensors):
            # The 128k variants' longrope factors, which transformers' GGUF reading drops.
            config["rope_scaling"] = _longrope(path, arch, metadata)
            config["original_max_position_embeddings"] = config["rope_scaling"]["original_max_position_embeddings"]


def _gemma4_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """What llama.cpp's converter writes of Gemma 4's config and transformers' reading leaves at Gemma4TextConfig's
    defaults (one published model's): the sliding layers' head size, which layers slide, how many last layers
    reuse earlier keys and values, the per-layer embedding's width and rows, both rotaries, the full layers' kv heads
    (their keys as values where they have no value projection), the shared layers' double-wide MLP, the logits' cap."""

    def key(name, default=None):
        return metadata.get(f"gemma4.{name}", default)

    if key("expert_count"):  # 26B-A4B's: a mixture beside each layer's dense MLP
        absent = [name for name in ("expert_used_count", "expert_feed_forward_length") if key(name) is None]
        if absent:
            raise GGUFError(f"{path}: a Gemma 4 mixture of experts without gemma4.{absent[0]}")
        config.update(enable_moe_block=True, num_experts=key("expert_count"), top_k_experts=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"))
    pattern = key("attention.sliding_window_pattern")
    layers = config["num_hidden_layers"]
    if isinstance(pattern, list) and len(pattern) == layers:
        config["layer_types"] = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    kinds = config.get("layer_types") or []
    config["head_dim"] = key("attention.key_length_swa", config.get("head_dim"))
    config["global_head_dim"] = key("attention.key_length", config.get("global_head_dim"))
    config["num_kv_shared_layers"] = key("attention.shared_kv_layers", 0)
    heads_kv = key("attention.head_count_kv")
    if isinstance(heads_kv, list):  # the sliding layers' count, and the full layers' where it differs
        config["num_key_value_heads"] = heads_kv[kinds.index("sliding_attention")]
        config["num_global_key_value_heads"] = heads_kv[kinds.index("full_attention")]
    full_values = [f"blk.{i}.attn_v.weight" in tensors for i, kind in enumerate(kinds) if kind == "full_attention"]
    config["attention_k_eq_v"] = bool(full_values) and not any(full_values)
    widths = key("feed_forward_length")
    if isinstance(widths, list):
        config["intermediate_size"] = widths[0]
        config["use_double_wide_mlp"] = widths[-1] == 2 * widths[0]
    table = {row[0]: row for row in tensor_table(path)[1]}
    per_layer = key("embedding_length_per_layer_input", 0)
    config["hidden_size_per_layer_input"] = per_layer
    if per_layer and "per_layer_token_embd.weight" in table:
        config["vocab_size_per_layer_input"] = table["per_layer_token_embd.weight"][2][0]
    rope = config.get("rope_parameters") or {}
    full_rope = {**rope.get("full_attention", {"rope_type": "proportional"}),
                 "rope_theta": key("rope.freq_base", 1_000_000.0)}
    factors = table.get("rope_freqs.weight")
    if factors is not None and factors[1] == 0:  # 1 for each rotated pair, 1e30 for the rest
        rotated = int((f32_values(path, factors) == 1.0).sum())
        full_rope["partial_rotary_factor"] = 2 * rotated / config["global_head_dim"]
    config["rope_parameters"] = {"sliding_attention": {**rope.get("sliding_attention", {"rope_type": "default"}),
                                                       "rope_theta": key("rope.freq_base_swa", 10_000.0)},
                                 "full_attention": full_rope}
    if key("final_logit_softcapping"):
        config["final_logit_softcapping"] = key("final_logit_softcapping")


def _gpt_oss_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """What llama.cpp's converter writes of gpt-oss's config and transformers' reading leaves at GptOssConfig's
    defaults (gpt-oss-20b's) or misreads (MISREAD_KEYS): the head size, the sliding window, the yarn rotary. The
    window's layers (every other, the first sliding) and the clamped SwiGLU's constants are llama.cpp's fixed ones,
    GptOssConfig's defaults too."""

    def key(name, default=None):
        return metadata.get(f"gpt-oss.{name}", default)

    config["head_dim"] = key("attention.key_length", config.get("head_dim"))
    config["sliding_window"] = key("attention.sliding_window", config.get("sliding_window"))
    theta = key("rope.freq_base", 150000.0)
    yarn = _yarn(path, "gpt-oss", metadata, theta, "gpt-oss's is yarn")
    # gpt-oss's own config keeps yarn's ramp unrounded (truncate false); llama.cpp's rotary rounds its ends
    config.pop("rope_theta", None)
    config["rope_parameters"] = dict(yarn, truncate=False) if yarn else {"rope_type": "default", "rope_theta": theta}


def _mistral3_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's mistral3 files as the model they were written from: Ministral 3's (its yarn rotary, and its
    queries' temperature past the original context, llama 4's scaling: attention.temperature_scale) Ministral3's
    text model; one without either (Mistral Small 3.x as llama.cpp converts it now) llama's."""

    def key(name, default=None):
        return metadata.get(f"mistral3.{name}", default)

    temperature = key("attention.temperature_scale")
    theta = config.get("rope_theta", key("rope.freq_base"))
    rope = _yarn(path, "mistral3", metadata, theta, "Ministral 3's is yarn")
    if rope is None and temperature is None:
        config["model_type"] = "llama"  # (its rope_theta as read)
        return
    config.pop("rope_theta", None)
    if rope is None:
        raise GGUFError(f"{path}: a mistral3 file with a query temperature (attention.temperature_scale) and no yarn "
                        "rotary, whose original context the temperature counts positions by")
    config.update(model_type="ministral3", rope_parameters=dict(rope, llama_4_scaling_beta=temperature or 0.0))


# The llama3 rotary's low and high frequency factors and original context of every published model with one (Llama
# 3.1-3.3 and the models made from them): llama.cpp's converter keeps them in no key, only in rope_freqs' factors.
LLAMA3_ROPE = (1.0, 4.0, 8192)
# The architectures whose scaled rotary llama.cpp writes as rope_freqs (llama3's) or rope.scaling.* (linear, yarn:
# Qwen's long-context settings) and transformers' reading drops (mistral3's, olmo2's and gpt-oss's own readings
# take theirs; gemma3's, phi3's are the families' rows').
SCALED_ROTARIES = ("llama", "smollm3", "granite", "ernie4_5", "qwen2", "qwen2vl", "qwen3", "qwen2moe", "qwen3moe",
                   "qwen3vl", "qwen3vlmoe", "exaone4", "arcee", "seed_oss", "apertus", "llama4")


def complete_converted(path: str, config) -> None:
    """What the config (a PretrainedConfig) of an architecture transformers reads by a conversion table (OWN_TABLES':
    from the keys alone, without complete_config) needs from the file's tensors: its scaled rotary (Llama 4's
    rope_freqs); nothing for other architectures."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from .conversions import converted

    metadata, tensors = read_gguf_metadata(path)
    arch = metadata["general.architecture"]
    if converted(arch) and arch in SCALED_ROTARIES:
        fields = {"rope_parameters": config.rope_parameters}
        _scaled_rope(path, arch, metadata, fields, tensors)
        config.rope_parameters = fields["rope_parameters"]


def _scaled_rope(path: str, arch: str, metadata: dict, config: dict, tensors) -> None:
    """A file's scaled rotary, which transformers' reading drops (its model would rotate by the plain frequencies):
    llama3's from the rope_freqs tensor, a linear one (DeepSeek Coder's: positions / 4) or yarn (Qwen's for long
    contexts) from rope.scaling.*; another scaling type is refused."""
    if "rope_freqs.weight" in tensors:
        _llama3_rope(path, arch, metadata, config)
        return
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    theta = config.get("rope_theta") or metadata.get(f"{arch}.rope.freq_base", 10000.0)
    if kind == "linear":
        factor = metadata.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise GGUFError(f"{path}: a linearly scaled rotary without its factor ({arch}.rope.scaling.factor)")
        config.pop("rope_theta", None)
        config["rope_parameters"] = dict(rope_type="linear", rope_theta=theta, factor=factor)
    elif kind != "none":
        rope = _yarn(path, arch, metadata, theta, "its architecture's: llama3, linear or yarn")
        config.pop("rope_theta", None)
        config["rope_parameters"] = rope


def _llama3_rope(path: str, arch: str, metadata: dict, config: dict) -> None:
    """A llama file's rope_freqs tensor as the llama3 rotary whose frequency factors it holds (llama.cpp divides each
    frequency by its factor; transformers' reading drops the tensor and would rotate by the plain frequencies, another
    function): the factor its largest, the rest LLAMA3_ROPE's where those give its factors, else fitted to its
    medium frequencies; a tensor no llama3 rotary gives is refused."""
    row = {row[0]: row for row in tensor_table(path)[1]}["rope_freqs.weight"]
    factors = f32_values(path, row).astype(np.float64) if row[1] == 0 else None
    theta = config.get("rope_theta") or metadata.get(f"{arch}.rope.freq_base", 10000.0)
    dim = metadata.get(f"{arch}.rope.dimension_count") or config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"])
    if factors is None or len(factors) != dim // 2:
        raise GGUFError(f"{path}: a rope_freqs tensor of {row[2]} values of type {row[1]}, where a llama3 rotary of "
                        f"heads of {dim} has {dim // 2} float32 factors")
    factor = float(factors.max())
    wavelengths = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    candidates = [LLAMA3_ROPE, (1.0, 1.0, LLAMA3_ROPE[2])]  # (Llama 4 Scout's: a step at the original context)
    medium = (factors > 1) & (factors < factor)
    if medium.sum() >= 2:  # the smooth ramp between: 1 / factor_i = (1 - s_i) / factor + s_i, s_i linear in 1 / wl_i
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, low = np.polyfit(smooth, LLAMA3_ROPE[2] / wavelengths[medium], 1)
        candidates.append((float(low), float(low + slope), LLAMA3_ROPE[2]))
    for low, high, old in candidates:
        if np.allclose(_llama3_factors(wavelengths, factor, low, high, old), factors, rtol=1e-5, atol=0):
            config.pop("rope_theta", None)
            config["rope_parameters"] = dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=low,
                                             high_freq_factor=high, original_max_position_embeddings=old)
            return
    raise GGUFError(f"{path}: its rope_freqs tensor holds frequency factors no llama3 rotary gives (the only kind "
                    "this tool reads from it)")


def _llama3_factors(wavelengths: np.ndarray, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """The frequency factors llama.cpp's converter writes of a llama3 rotary (LlamaModel.generate_extra_tensors)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # (low == high: a step, no ramp between)
        smooth = (old / wavelengths - low) / (high - low)
        return np.where(wavelengths < old / high, 1.0, np.where(wavelengths > old / low, factor,
                                                                1 / ((1 - smooth) / factor + smooth)))


def _layer_types(pattern, layers: int, every: int = 4) -> list[str]:
    """Each layer's type from llama.cpp's attention.sliding_window_pattern: a layer slides where the file's list (one
    bool a layer) says so, else (no list, or not one a layer) all but every `every`-th layer, llama.cpp's default."""
    if not (isinstance(pattern, list) and len(pattern) == layers):
        pattern = [(index + 1) % every != 0 for index in range(layers)]
    return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]


def _file_token_ids(config: dict, *fields: str) -> None:
    """The token ids `fields` none where the file names none: the config class's defaults are its published
    vocabulary's, maybe past this file's."""
    for field in fields:
        config.setdefault(field, None)


def _olmo2_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's olmo2 files as the model they were written from: OLMo 2's, or where they have a sliding window
    OLMo 3's (its layers sliding by attention.sliding_window_pattern; its full layers' rotary yarn where the file
    says so, the sliding layers' the plain one at rope.freq_base_swa or the same base, as llama.cpp turns them)."""

    def key(name, default=None):
        return metadata.get(f"olmo2.{name}", default)

    theta = config.pop("rope_theta", key("rope.freq_base"))
    rope = _yarn(path, "olmo2", metadata, theta, "OLMo 3's is yarn")
    window, pattern = key("attention.sliding_window"), key("attention.sliding_window_pattern")
    if not window:
        config.update(model_type="olmo2", rope_parameters=rope or {"rope_type": "default", "rope_theta": theta})
        return
    config.update(model_type="olmo3", sliding_window=window,
                  layer_types=_layer_types(pattern, config["num_hidden_layers"]),
                  rope_parameters={"full_attention": rope or {"rope_type": "default", "rope_theta": theta},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": key("rope.freq_base_swa", theta)}})


def _exaone4_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's exaone4 files as EXAONE 4's: its sliding layers by attention.sliding_window_pattern (every fourth
    full where it has none) where the file has a window (32B's: its full layers then without rotary, as the model
    computes them), else every layer full (1.2B's; Exaone4Config's default window would make its layers slide)."""
    window = metadata.get("exaone4.attention.sliding_window")
    layers = config["num_hidden_layers"]
    pattern = metadata.get("exaone4.attention.sliding_window_pattern")
    config.update(sliding_window=window or None, sliding_window_pattern=4 if window else 0,
                  layer_types=_layer_types(pattern, layers) if window else ["full_attention"] * layers)


def _cohere_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's command-r and cohere2 files as Cohere's models: CohereConfig (Command R+'s q and k layer norms per
    head where the file has them) or Cohere2Config (three layers in four sliding, by attention.sliding_window_pattern
    where the file has one, llama.cpp's default else; the full ones without rotary, as both compute them); their
    classes' default token ids (the published vocabulary's) dropped where the file names none."""
    arch = metadata["general.architecture"]
    theta = config.pop("rope_theta", metadata.get(f"{arch}.rope.freq_base", 10000.0))
    config.update(rope_parameters={"rope_type": "default", "rope_theta": theta})
    _file_token_ids(config, "pad_token_id", "bos_token_id", "eos_token_id")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if rotary is not None and heads and hidden and rotary != hidden // heads:
        raise GGUFError(f"{path}: {rotary} of each head's {hidden // heads} values rotated (rope.dimension_count), "
                        "where Cohere's models rotate them all")
    if arch == "command-r":
        config.update(model_type="cohere", use_qk_norm="blk.0.attn_q_norm.weight" in tensors)
        return
    pattern = metadata.get("cohere2.attention.sliding_window_pattern", 4)
    every = pattern if isinstance(pattern, int) else 4  # (llama.cpp's key: a list a layer, or every n-th layer full)
    config["layer_types"] = _layer_types(pattern, config["num_hidden_layers"], every)


def _seed_oss_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """Seed-OSS's biases as its file holds them (q/k/v's, the output's), which SeedOssConfig's defaults (the published
    model's) would otherwise decide; its class's default token ids dropped where the file names none."""
    config.update(attention_bias="blk.0.attn_q.bias" in tensors,
                  attention_out_bias="blk.0.attn_output.bias" in tensors)
    _file_token_ids(config, "bos_token_id", "eos_token_id")


XIELU_PARTS = ("alpha_p", "alpha_n", "beta", "eps")


def _apertus_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """Apertus's xIELU, which llama.cpp's converter keeps in keys, a value a layer (xielu.alpha_p, alpha_n, beta,
    eps: its parameters as the checkpoint holds them, before their softplus), as config.xielu for the build
    (build.py sets each layer's activation from it); its class's default token ids dropped where the file names
    none."""
    layers = config["num_hidden_layers"]
    values = {part: metadata.get(f"xielu.{part}") for part in XIELU_PARTS}
    wrong = [part for part, value in values.items() if not (isinstance(value, list) and len(value) == layers)]
    if wrong:
        raise GGUFError(f"{path}: an apertus file without {layers} values of xielu.{wrong[0]} (its activation's, a "
                        "layer each)")
    config["xielu"] = {part: [float(number) for number in value] for part, value in values.items()}
    _file_token_ids(config, "bos_token_id", "eos_token_id")


def _hunyuan_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's hunyuan-dense files as Hunyuan's dense model (HunYuanDenseV1Config): its NTK rotary of a fixed
    alpha is the plain one at the base the converter wrote (base * alpha^(dim / (dim - 2)), as transformers computes
    it), so the file's base and no alpha; another scaling refused; its class's default token ids dropped where the
    file names none."""
    kind = metadata.get("hunyuan-dense.rope.scaling.type", "none")
    if kind != "none":
        raise GGUFError(f"{path}: a hunyuan-dense file whose rotary embedding is scaled by {kind!r}, which this tool "
                        "does not read (llama.cpp's converter folds Hunyuan's NTK alpha into the base)")
    theta = config.pop("rope_theta", metadata.get("hunyuan-dense.rope.freq_base", 10000.0))
    config.update(model_type="hunyuan_v1_dense", rope_parameters={"rope_type": "default", "rope_theta": theta})
    _file_token_ids(config, "bos_token_id", "eos_token_id", "eod_token_id")


def _glm4_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """GLM-4-0414's partial rotary (half of each head), which transformers' reading drops: the rotated share of a head
    (rope.dimension_count) over the head size. A file of GLM-4.1V's text model is refused (_glm_vision)."""
    _glm_vision(path, metadata, "glm4")
    _glm_rotary(metadata, config, "glm4")


def _glm_vision(path: str, metadata: dict, arch: str) -> None:
    """GGUFError for a GLM-4.1V or GLM-4.5V text model's file (its M-RoPE's rope.dimension_sections): llama.cpp's
    converter reorders each head's rotated q and k rows for its M-RoPE kernel (normal_to_neox), which GLM-4's and
    GLM-4.5's models, that these files would be read into, do not turn so."""
    if metadata.get(f"{arch}.rope.dimension_sections") is not None:
        raise GGUFError(f"{path}: a GLM-4.1V/4.5V text model's file ({arch}.rope.dimension_sections): its q and k "
                        "rows are reordered for llama.cpp's M-RoPE, which this tool does not read")


def _glm_rotary(metadata: dict, config: dict, arch: str) -> None:
    """GLM's rotary of part of each head as rope parameters: the rotated share (rope.dimension_count) over the head
    size (half where the file does not say), at the file's base."""
    rotary, head_dim = metadata.get(f"{arch}.rope.dimension_count"), config.get("head_dim")
    theta = config.pop("rope_theta", metadata.get(f"{arch}.rope.freq_base", 10000.0))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                                 "partial_rotary_factor": rotary / head_dim if rotary and head_dim else 0.5}


def _glm4moe_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's glm4moe files as GLM-4.5's model (Glm4MoeConfig): the layers without the multi-token prediction
    block the converter writes as the last ones (nextn_predict_layers: not read), half of each head rotated
    (rope.dimension_count over the head size), q/k/v biases and q/k norms where the file has them, the class's
    default token ids (the published vocabulary's) dropped where the file names none; a router not of sigmoid
    scores (expert_gating_func) is refused: transformers' computes those; a GLM-4.5V text model's file too
    (_glm_vision)."""
    _glm_vision(path, metadata, "glm4moe")
    gating = metadata.get("glm4moe.expert_gating_func", 2)
    if gating != 2:  # (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)
        raise GGUFError(f"{path}: its router's gating function {gating} (expert_gating_func), where GLM-4.5's model "
                        "scores experts by a sigmoid (2)")
    config["model_type"] = "glm4_moe"
    config["num_hidden_layers"] -= metadata.get("glm4moe.nextn_predict_layers", 0)
    _glm_rotary(metadata, config, "glm4moe")
    config.update(attention_bias="blk.0.attn_q.bias" in tensors, use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
                  tie_word_embeddings="output.weight" not in tensors)
    _file_token_ids(config, "pad_token_id", "bos_token_id", "eos_token_id")


def _deepseek2_config(path: str, metadata: dict, tensors, config: dict, arch: str = "deepseek2") -> None:
    """llama.cpp's deepseek2 files as DeepSeek's models: DeepseekV3Config where the router scores experts by a
    sigmoid (V3, R1, Kimi K2, GLM-4.7-Flash), DeepseekV2Config by a softmax (V2, V2.5, V2-Lite, Coder-V2; a file
    without expert_gating_func is V2's, as llama.cpp reads it, but GLM-4.7-Flash's by its layers and vocabulary);
    a head's widths from the MLA keys (key_length_mla: not rotated + rotated; value_length_mla), or for a file of
    the unsplit kv_b from key_length and value_length; q straight from the hidden state where the file has no
    attn_q_a; yarn's mscale and mscale_all_dim both yarn_log_multiplier / 0.1 (the converter's 0.1 times
    mscale_all_dim; the published configs set the two alike, and llama.cpp computes so); V2's groups by their best
    expert where there are several; the queries' temperature where the file has one (Mistral Large 3's:
    attention.temperature_scale and _length, as config attributes the latent attention reads); the class's default
    token ids dropped where the file names none; the layers without a multi-token prediction block the converter
    writes as the last ones (not read). `arch`: the keys' architecture (mistral4's are deepseek2's)."""
    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)

    layers, vocabulary = key("block_count"), key("vocab_size", config.get("vocab_size"))
    gating = key("expert_gating_func", 2 if layers in (47, 48) and vocabulary == 154880 else 1)
    if gating not in (1, 2):  # (llama.cpp's softmax and sigmoid)
        raise GGUFError(f"{path}: its router's gating function {gating} (expert_gating_func), where DeepSeek's "
                        "models score experts by a softmax (1) or a sigmoid (2)")
    config["model_type"] = "deepseek_v3" if gating == 2 else "deepseek_v2"
    config["num_hidden_layers"] -= key("nextn_predict_layers", 0)
    rotated, value = config.get("qk_rope_head_dim", 64), key("attention.value_length_mla")
    whole = key("attention.key_length_mla") or key("attention.key_length")
    if whole is None or whole <= rotated:
        raise GGUFError(f"{path}: no key and query width a head beyond the {rotated} rotated "
                        "(attention.key_length_mla)")
    config.update(qk_nope_head_dim=whole - rotated, v_head_dim=value or key("attention.value_length"),
                  num_key_value_heads=config["num_attention_heads"], attention_bias=False,
                  tie_word_embeddings="output.weight" not in tensors, norm_topk_prob=bool(key("expert_weights_norm")),
                  routed_scaling_factor=key("expert_weights_scale", 1.0))
    if "blk.0.attn_q_a.weight" not in tensors:
        config["q_lora_rank"] = None
    if gating == 1:
        config["topk_method"] = "group_limited_greedy" if config.get("n_group", 1) > 1 else "greedy"
    theta = config.pop("rope_theta", key("rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    if key("rope.scaling.type", "none") not in ("none", "yarn"):
        raise GGUFError(f"{path}: its rotary embedding is scaled by {key('rope.scaling.type')!r}, where DeepSeek's "
                        "models scale it by yarn")
    if key("rope.scaling.type") == "yarn":
        mscale = key("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        rope.update(rope_type="yarn", factor=key("rope.scaling.factor"), mscale=mscale, mscale_all_dim=mscale,
                    original_max_position_embeddings=key("rope.scaling.original_context_length"),
                    beta_fast=key("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=key("rope.scaling.yarn_beta_slow", 1.0))
        if None in rope.values():
            raise GGUFError(f"{path}: a yarn rotary without its factor or original context length "
                            f"({arch}.rope.scaling.factor, original_context_length)")
    config["rope_parameters"] = rope
    scale, length = key("attention.temperature_scale"), key("attention.temperature_length")
    if scale:  # (Mistral Large 3's: llama 4's temperature of its queries, which llama.cpp's deepseek2 graph applies)
        if not length:
            raise GGUFError(f"{path}: a query temperature ({scale}, attention.temperature_scale) without the "
                            "positions it steps by (attention.temperature_length)")
        config.update(attn_temperature_scale=scale, attn_temperature_length=length)
    _file_token_ids(config, "pad_token_id", "bos_token_id", "eos_token_id")


def _mistral4_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's mistral4 files (Mistral 4: deepseek2's keys and tensors, its experts' gate and up in one tensor)
    as Mistral 4's text model (Mistral4Config): DeepSeek's latent attention as _deepseek2_config reads it, pairs
    turned (rope_interleave), a router of softmax scores (a file naming a sigmoid is refused), and llama 4's
    temperature of the queries past yarn's original context by the file's attention.temperature_scale, else its
    class's 0.1 (its published value: llama.cpp's converter writes none of a Mistral 4 checkpoint, and llama.cpp's
    graph then applies none, another function past that context)."""
    _deepseek2_config(path, metadata, tensors, config, "mistral4")
    if config.pop("model_type") != "deepseek_v2":
        raise GGUFError(f"{path}: its router's gating function {metadata.get('mistral4.expert_gating_func')} "
                        "(expert_gating_func), where Mistral 4 scores experts by a softmax (1)")
    rope, beta = config["rope_parameters"], config.pop("attn_temperature_scale", None)
    config.pop("attn_temperature_length", None)
    rope.update(llama_4_scaling_beta=0.1 if beta is None else beta,
                partial_rotary_factor=config["qk_rope_head_dim"] / (config["qk_rope_head_dim"]
                                                                    + config["qk_nope_head_dim"]))
    config.pop("topk_method", None)
    config.update(model_type="mistral4", rope_interleave=True)


def _ernie4_5_moe_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's ernie4_5-moe files as ERNIE 4.5's mixture (Ernie4_5_MoeConfig): mixtures from the first layer
    after the dense ones to the last, every interleave_moe_layer_step-th; q/k/v biases where the file has them;
    the shared experts as wide as their count times an expert's (the model's rule: a file whose
    expert_shared_feed_forward_length says otherwise is refused); the class's default token ids dropped where the
    file names none."""
    def key(name, default=None):
        return metadata.get(f"ernie4_5-moe.{name}", default)

    shared, width = config.get("moe_num_shared_experts", 0), key("expert_shared_feed_forward_length")
    if shared and width is not None and width != shared * config["moe_intermediate_size"]:
        raise GGUFError(f"{path}: shared experts {width} wide (expert_shared_feed_forward_length), where ERNIE 4.5's "
                        f"model makes them {shared} x {config['moe_intermediate_size']}")
    theta = config.pop("rope_theta", key("rope.freq_base", 10000.0))
    config.update(model_type="ernie4_5_moe", rope_parameters={"rope_type": "default", "rope_theta": theta},
                  moe_layer_end_index=config["num_hidden_layers"] - 1, use_bias="blk.0.attn_q.bias" in tensors,
                  tie_word_embeddings="output.weight" not in tensors)
    _file_token_ids(config, "pad_token_id", "bos_token_id", "eos_token_id")


def _minimax_m2_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's minimax-m2 files as transformers reads them (MiniMaxM2Config), whose router scores experts by a
    sigmoid: a file whose expert_gating_func says otherwise is refused (none: its converter writes the published
    config's scoring_func, sigmoid)."""
    gating = metadata.get("minimax-m2.expert_gating_func", 2)
    if gating != 2:
        raise GGUFError(f"{path}: its router's gating function {gating} (minimax-m2.expert_gating_func), where "
                        "MiniMax-M2's scores experts by a sigmoid (2)")


# What an architecture's files need read beyond transformers' reading and the families' rows (path, the metadata, the
# tensors' names, the config to complete).
ARCHITECTURE_CONFIGS = {"gemma4": _gemma4_config, "gpt-oss": _gpt_oss_config, "mistral3": _mistral3_config,
                        "olmo2": _olmo2_config, "exaone4": _exaone4_config, "glm4": _glm4_config,
                        "command-r": _cohere_config, "cohere2": _cohere_config, "seed_oss": _seed_oss_config,
                        "apertus": _apertus_config, "hunyuan-dense": _hunyuan_config,
                        "glm4moe": _glm4moe_config, "deepseek2": _deepseek2_config,
                        "ernie4_5-moe": _ernie4_5_moe_config, "minimax-m2": _minimax_m2_config,
                        "mistral4": _mistral4_config}


def _yarn(path: str, arch: str, metadata: dict, theta: float, known: str) -> dict | None:
    """The file's yarn rotary as transformers' rope parameters (None: no scaling; another type is refused): its
    factor, original context and betas; its attention factor as llama.cpp computes it (mscale 1, mscale_all_dim
    yarn_log_multiplier where set, else transformers' and llama.cpp's default 0.1 ln(factor) + 1)."""

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)

    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise GGUFError(f"{path}: a {arch} file whose rotary embedding is scaled by {kind!r}, which this tool does "
                        f"not read ({known})")
    rope = dict(rope_type="yarn", rope_theta=theta, factor=key("rope.scaling.factor"),
                original_max_position_embeddings=key("rope.scaling.original_context_length"),
                beta_fast=key("rope.scaling.yarn_beta_fast", 32.0), beta_slow=key("rope.scaling.yarn_beta_slow", 1.0))
    if None in rope.values():
        raise GGUFError(f"{path}: a yarn rotary without its factor or original context length "
                        f"({arch}.rope.scaling.factor, original_context_length)")
    if key("rope.scaling.yarn_log_multiplier"):
        rope.update(mscale=1.0, mscale_all_dim=key("rope.scaling.yarn_log_multiplier"))
    return rope


def _longrope(path: str, arch: str, metadata: dict) -> dict:
    """transformers' longrope rope_scaling of the file's rope_factors_long/short tensors and rope.scaling keys."""
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    tensors = {row[0]: row for row in tensor_table(path)[1]}
    factors = {}
    for kind in ("long", "short"):
        row = tensors.get(f"rope_factors_{kind}.weight")
        if row is None or row[1] != 0 or original is None:
            raise GGUFError(f"{path}: its longrope scaling needs rope_factors_long/short (F32) and "
                            f"{arch}.rope.scaling.original_context_length, which it does not all have")
        factors[f"{kind}_factor"] = [float(x) for x in f32_values(path, row)]
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    if f"{arch}.rope.scaling.attn_factor" in metadata:  # the cos/sin scale llama.cpp was given; transformers'
        scaling["attention_factor"] = float(metadata[f"{arch}.rope.scaling.attn_factor"])  # default is the same rule
    return scaling


