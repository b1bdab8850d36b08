"""A GGUF file's header, read once and cached (GGUFHeader): its config completed as transformers takes it, its
tokenizer mended where transformers' reading of the file's vocabulary differs from llama.cpp's, its tensor table, and
the map from its tensors' names to the model's parameters (build.py builds the model over them).

The header takes seconds to read (the gguf package's parse of the metadata and vocabulary), so a later run reads it
from the cache under the file's path, size and time, transformers' version and HEADER_CACHE_VERSION.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import time

import numpy as np
import torch

from .. import NOTICE
from .blocks import (
    SUPPORTED,
)
from .conversions import Conversion, teach_own_tables
from .families import BY_ARCHITECTURE, FAMILIES, MODEL_OF, NO_FAMILY, READ_AS, WITH_EXPERTS
from .splits import GPT2_SPLITS, pre_tokenizer, sentencepiece_text
from .weights import FLOAT_TYPES, GGUFError, with_experts_stacked, with_gate_up_apart

logger = logging.getLogger("run_generation")

# Bump when what the header cache holds changes meaning (transformers' version is part of the key too).
HEADER_CACHE_VERSION = 13


@contextlib.contextmanager
def metadata_parsed_once(weights: bool = True):
    """Within this block, transformers parses each GGUF file once (seconds a parse; a config, a tokenizer and the
    weights would each parse it again) and builds gguf's tensor-name table once per architecture (it rebuilds it
    for every submodule it maps); later calls share them. `weights=False`: no weights will be read, so gguf's
    reader (its object per vocabulary entry: about 170 MB for a 49k vocabulary) is not kept for them. Its
    de-quantizing shows a progress bar only where the tool's loading detail is shown (--verbose)."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    read_as_their_likes()
    original, parsed = gguf_utils.load_gguf_checkpoint, {}
    reader_class, name_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}
    weights_map = gguf_utils.get_gguf_hf_weights_map

    def with_suffixes(hf_model, processor, *args, **kwargs):
        # (a parameter named without .weight, a mixture's 3-D experts or Gemma 4's layer_scalar, is the file's
        # tensor with it; transformers' loader would leave it at its initial value)
        if not args and kwargs.get("model_type") is None:
            kwargs["model_type"] = TENSOR_NAMES_OF.get(hf_model.config.model_type)
        names = weights_map(hf_model, processor, *args, **kwargs)
        return names | {f"{name}.weight": hf for name, hf in names.items()
                        if not name.endswith((".weight", ".bias")) and f"{name}.weight" not in names}

    def once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:  # weights are read as asked, never shared
            return original(path, return_tensors, *args, **kwargs)
        if path not in parsed:
            result = original(path, return_tensors=False)
            complete_config(path, result["config"])
            parsed[path] = result
        return copy.deepcopy(parsed[path])  # callers edit what they get

    def reader(path, mode="r"):  # read-only maps of an unchanged file: one serves every reading
        if mode != "r":
            return reader_class(path, mode)
        key = os.path.abspath(path)
        one = readers.get(key) or without_misread_keys(reader_class(path))
        if weights:
            readers[key] = one
        return one

    bar = gguf_utils.tqdm  # tqdm's own: transformers' switch for its bars does not reach it
    gguf_utils.load_gguf_checkpoint, gguf_utils.get_gguf_hf_weights_map = once, with_suffixes
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(name_map)
    gguf_utils.tqdm = functools.partial(bar, disable=not logger.isEnabledFor(logging.INFO))
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint, gguf.GGUFReader, gguf.get_tensor_name_map = original, reader_class, name_map
        gguf_utils.get_gguf_hf_weights_map = weights_map
        gguf_utils.tqdm = bar


# The names transformers' GGUF reading gives the config keys of these architectures.
CONFIG_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Model types whose tensors gguf's name table knows under another architecture's name (a mistral3 file's Ministral 3).
TENSOR_NAMES_OF = {"ministral3": "mistral3", "olmo3": "olmo2", "hunyuan_v1_dense": "hunyuan-dense",
                   "glm4_moe": "glm4moe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
                   "ernie4_5_moe": "ernie4_5-moe"}


# Architectures transformers' GGUF reading knows no config keys of, read as no other's: their keys (after "<arch>.")
# and the config fields they give, as transformers' GGUF_CONFIG_MAPPING holds an architecture's. Cohere's Command R
# and Aya (command-r) and Command R7B (cohere2).
COMMAND_R_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                  "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                  "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                  "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_epsilon": "layer_norm_eps",
                  "logit_scale": "logit_scale", "vocab_size": "vocab_size"}
# GLM-4.5's, 4.6's and 4.7's mixtures (glm4moe): llama's keys, its head size and the experts' (routed, shared, the
# dense layers before them, their groups, the weights' scale and normalization).
GLM4MOE_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                "attention.key_length": "head_dim", "vocab_size": "vocab_size", "expert_count": "n_routed_experts",
                "expert_used_count": "num_experts_per_tok", "expert_shared_count": "n_shared_experts",
                "expert_feed_forward_length": "moe_intermediate_size",
                "leading_dense_block_count": "first_k_dense_replace", "expert_group_count": "n_group",
                "expert_group_used_count": "topk_group", "expert_weights_scale": "routed_scaling_factor",
                "expert_weights_norm": "norm_topk_prob"}
# DeepSeek V2's and V3's (and the models of their layout: Kimi K2, GLM-4.7-Flash, ...): their latent attention's
# ranks and widths, the experts' keys (a value head's width the MLA one; its q/k head's the rest, complete_config).
DEEPSEEK2_KEYS = {**{key: field for key, field in GLM4MOE_KEYS.items() if key != "attention.key_length"},
                  "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
                  "rope.dimension_count": "qk_rope_head_dim"}
# ERNIE 4.5's mixtures (ERNIE-4.5-21B-A3B, 300B-A47B): llama's keys and the experts' (the dense layers before them
# and the step between mixture layers, the shared experts).
ERNIE_MOE_KEYS = {**{key: field for key, field in COMMAND_R_KEYS.items() if key not in ("logit_scale",
                                                                                       "attention.layer_norm_epsilon")},
                  "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim",
                  "expert_count": "moe_num_experts", "expert_used_count": "moe_k",
                  "expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_count": "moe_num_shared_experts",
                  "leading_dense_block_count": "moe_layer_start_index",
                  "interleave_moe_layer_step": "moe_layer_interval"}
OWN_KEYS = {"command-r": COMMAND_R_KEYS, "cohere2": {**COMMAND_R_KEYS, "attention.sliding_window": "sliding_window"},
            "glm4moe": GLM4MOE_KEYS, "deepseek2": DEEPSEEK2_KEYS, "ernie4_5-moe": ERNIE_MOE_KEYS}


@functools.cache
def latent_processor():
    """deepseek2's tensor processor: Qwen2-MoE's (a layer's ffn_{gate,up}_exps into one gate_up_proj), and the latent
    attention's kv_b_proj [heads x (not rotated + value), latent] in float values (what latent_attention.py takes
    apart by head): put back from the halves llama.cpp's converter splits it into, attn_k_b [heads, latent, not
    rotated] (transposed) and attn_v_b [heads, value, latent], or a file of 2024's attn_kv_b as it is."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, Qwen2MoeTensorProcessor

    class LatentProcessor(Qwen2MoeTensorProcessor):
        def process(self, weights, name, **kwargs):
            if name.endswith(".attn_kv_b.weight"):  # (the mapping's lookup fails on a probe: de-quantized)
                hf_name = kwargs["tensor_key_mapping"][name]
                kwargs["parsed_parameters"]["tensors"][hf_name] = torch.from_numpy(np.array(weights))
                return GGUFTensor(weights, None, {})
            half = next((half for half in ("k", "v") if name.endswith(f".attn_{half}_b.weight")), None)
            if half is None:
                return super().process(weights, name, **kwargs)
            hf_name, collected = kwargs["tensor_key_mapping"][name], kwargs["parsed_parameters"]["tensors"]
            values = torch.from_numpy(np.ascontiguousarray(weights.swapaxes(1, 2) if half == "k" else weights))
            heads, rows, latent = values.shape
            nope, value = self.config["qk_nope_head_dim"], self.config["v_head_dim"]
            if rows != (nope if half == "k" else value):
                raise ValueError(f"{rows} rows a head, where the config's {'k' if half == 'k' else 'v'} part has "
                                 f"{nope if half == 'k' else value}")
            if hf_name not in collected:
                collected[hf_name] = torch.zeros(heads * (nope + value), latent, dtype=values.dtype)
            joined = collected[hf_name].view(heads, nope + value, latent)
            (joined[:, :nope] if half == "k" else joined[:, nope:]).copy_(values)
            return GGUFTensor(weights, None, {})

    return LatentProcessor


# The tensor processors of architectures of OWN_KEYS, by name in transformers' table or made here.
OWN_PROCESSORS = {"glm4moe": "qwen2moe", "deepseek2": latent_processor, "ernie4_5-moe": "qwen2moe"}


def read_as_their_likes() -> None:
    """Teaches transformers' GGUF reading READ_AS's architectures (their config keys, fixed config values and tensor
    processor those of the architecture each is read as) and OWN_KEYS' (their keys; OWN_PROCESSORS' processors);
    idempotent."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    teach_own_tables()
    for architecture, keys in OWN_KEYS.items():
        GGUF_CONFIG_MAPPING.setdefault(architecture, keys)
        if architecture not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
            gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append(architecture)
        if architecture in OWN_PROCESSORS:
            own = OWN_PROCESSORS[architecture]
            processor = gguf_utils.TENSOR_PROCESSORS[own] if isinstance(own, str) else own()
            gguf_utils.TENSOR_PROCESSORS.setdefault(architecture, processor)
    for architecture, like in READ_AS.items():
        # (transformers' reading keys the config mapping of a mixture's architecture by its model type)
        GGUF_CONFIG_MAPPING.setdefault(architecture, GGUF_CONFIG_MAPPING[CONFIG_NAMES.get(like, like)])
        # its fixed values too (qwen3moe's normalized top-k weights, as llama.cpp's graph has them)
        if CONFIG_NAMES.get(like, like) in GGUF_CONFIG_DEFAULTS_MAPPING:
            GGUF_CONFIG_DEFAULTS_MAPPING.setdefault(architecture,
                                                    GGUF_CONFIG_DEFAULTS_MAPPING[CONFIG_NAMES.get(like, like)])
        if architecture not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
            gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append(architecture)
        if like in gguf_utils.TENSOR_PROCESSORS:  # (else transformers' plain one, as for `like`)
            gguf_utils.TENSOR_PROCESSORS.setdefault(architecture, gguf_utils.TENSOR_PROCESSORS[like])


# Keys transformers' reading takes a field's first part of (a string's length, a 1-element array) for a value and
# fails on: complete_config reads them instead.
MISREAD_KEYS = {"gpt-oss": "gpt-oss.rope.scaling."}


def without_misread_keys(reader):
    """gguf's `reader` with the fields of MISREAD_KEYS for its architecture dropped."""
    arch = reader.fields.get("general.architecture")
    prefix = MISREAD_KEYS.get(arch.contents() if arch is not None else None)
    if prefix is not None:
        for key in [key for key in reader.fields if key.startswith(prefix)]:
            del reader.fields[key]
    return reader


UNSPLIT_SAID = set()  # the files whose tokenizer.ggml.pre has no split here, said once
USER_DEFINED = 4  # llama.cpp's token type of a piece read whole (llama_token_type)


def mend_tokenizer(tokenizer, path: str, metadata: dict | None = None) -> None:
    """Cuts text as llama.cpp does where transformers' GGUF reading would not (rungen/gguf/splits.py): a byte-level
    BPE vocabulary by the split its file's tokenizer.ggml.pre names (SmolLM's file, the default model, splits each
    numeral on its own, as llama.cpp and SmolLM's own tokenizer.json do; other unknown values split as GPT-2, as
    transformers does); a SentencePiece one with the prefix space before each piece of text that llama.cpp puts.
    `metadata`: the file's, where the caller read it."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping
    from transformers.integrations.gguf.reader import read_gguf_metadata

    if metadata is None:
        metadata, _ = read_gguf_metadata(path)
    model, pre, backend = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre"), \
        tokenizer.backend_tokenizer
    pre_steps, normalizer_steps = _steps(backend.pre_tokenizer), _steps(backend.normalizer)
    if model == "gpt2" and pre not in gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS and "ByteLevel" in pre_steps:
        split = pre_tokenizer(pre)
        if split is not None:
            backend.pre_tokenizer = split
        elif pre is not None and pre not in GPT2_SPLITS and path not in UNSPLIT_SAID:
            UNSPLIT_SAID.add(path)  # once a run: the header's read mends the tokenizer and its class's pipeline
            logger.warning("%s: its tokenizer.ggml.pre %r has no split here: its text is split as GPT-2's, as "
                           "transformers splits it, which llama.cpp does not", os.path.basename(path), pre)
    elif model == "llama":
        # llama's builder (a Metaspace pre-tokenizer) and phi3's (a Prepend normalizer); not gemma's, which has
        # no prefix, as its files' add_space_prefix says
        if "Metaspace" in pre_steps or "Prepend" in normalizer_steps:
            backend.normalizer, backend.decoder = sentencepiece_text(
                metadata.get("tokenizer.ggml.add_space_prefix", True))
            backend.pre_tokenizer = None
        user_defined_runs(tokenizer, path)


def user_defined_runs(tokenizer, path: str) -> None:
    """A SentencePiece file's user-defined runs of spaces (Gemma's "  " to 31 spaces, stored with real spaces), read
    whole where they stand, as llama.cpp and sentencepiece read user-defined pieces: transformers' reading spells
    them with "\u2581" in the vocabulary, where it then no longer finds them to add whole."""
    from tokenizers import AddedToken
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(path, ("tokenizer.ggml.tokens",))
    vocab = tokenizer.get_vocab()
    runs = [token.replace(" ", "\u2581") for token, kind in zip(metadata["tokenizer.ggml.tokens"],
                                                                  metadata.get("tokenizer.ggml.token_type") or ())
            if kind == USER_DEFINED and " " in token and not token.strip() and token not in vocab]
    runs = [run for run in runs if run in vocab]
    if runs:  # matched in the text once its spaces are spelled so (normalized), the longest first
        tokenizer.add_tokens([AddedToken(run, normalized=True, special=False) for run in runs])


# The tokens that end a reply by their text, as llama.cpp's end-of-generation set (llama-vocab.cpp): a chat model's
# turn ends with one its file's eos is often not (Gemma's <end_of_turn>, Phi-3's <|end|>); the fill-in-the-middle
# pad, repository and file-separator tokens too.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                     "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                     "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
                     "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
                     "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")


def end_of_generation(metadata: dict, vocab: dict[str, int], eos) -> int | list[int] | None:
    """The ids that end a reply (the config's eos_token_id), as llama.cpp's set: the file's (its `metadata`) eos,
    eot, eom and fill-in-the-middle ids, and every token spelled as one of END_OF_GENERATION; the eos first, a list
    where there are several."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [metadata[f"tokenizer.ggml.{key}_token_id"] for key in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")
            if f"tokenizer.ggml.{key}_token_id" in metadata]
    ids += [vocab[text] for text in END_OF_GENERATION if text in vocab]
    size = metadata.get(f"{metadata['general.architecture']}.vocab_size")
    if size is not None:  # not a token transformers' conversion added past the file's vocabulary (<s> where none is)
        ids = [index for index in ids if index < size]
    text = {index: token for token, index in vocab.items()}
    spelled = {text.get(index) for index in ids}
    if {"<|return|>", "<|call|>"} <= spelled or {"<|calls|>", "<|flush|>"} <= spelled:
        ids = [index for index in ids if text.get(index) != "<|end|>"]  # gpt-oss's, Solar Open's: a message's end
    if "<|tool_response>" in spelled or "<|plamo:eos|>" in vocab:
        ids = [index for index in ids if text.get(index) != "</s>"]  # Gemma 4's and PLaMo's: a plain token
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else ids or None


def llama_cpp_reading(path: str, tokenizer, *configs) -> None:
    """Gives transformers' reading of the GGUF file at `path` what llama.cpp reads in it: text cut as llama.cpp cuts
    it (mend_tokenizer), and its end-of-generation set as each of `configs`' eos_token_id (a config, a model's
    generation config)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(path)
    mend_tokenizer(tokenizer, path, metadata)
    vocab = tokenizer.get_vocab()
    for config in configs:
        config.eos_token_id = end_of_generation(metadata, vocab, config.eos_token_id)


def _steps(part) -> list[str]:
    """The step types of a tokenizers normalizer or pre-tokenizer (its JSON: not the whole tokenizer's, which holds
    the vocabulary), a Sequence's flattened."""
    if part is None:
        return []

    def kinds(state):
        inner = state.get("normalizers") or state.get("pretokenizers")
        return [kind for step in inner for kind in kinds(step)] if inner else [state["type"]]

    return kinds(json.loads(part.__getstate__()))


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
    if key_length != value_length and arch != "deepseek2":
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
        rotated = int((_f32_values(path, factors) == 1.0).sum())
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
SCALED_ROTARIES = ("llama", "smollm3", "granite", "ernie4_5", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "qwen3vl",
                   "qwen3vlmoe", "exaone4", "arcee", "seed_oss", "apertus")


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
    factors = _f32_values(path, row).astype(np.float64) if row[1] == 0 else None
    theta = config.get("rope_theta") or metadata.get(f"{arch}.rope.freq_base", 10000.0)
    dim = metadata.get(f"{arch}.rope.dimension_count") or config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"])
    if factors is None or len(factors) != dim // 2:
        raise GGUFError(f"{path}: a rope_freqs tensor of {row[2]} values of type {row[1]}, where a llama3 rotary of "
                        f"heads of {dim} has {dim // 2} float32 factors")
    factor = float(factors.max())
    wavelengths = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    candidates = [LLAMA3_ROPE]
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
    (rope.dimension_count) over the head size."""
    _glm_rotary(metadata, config, "glm4")


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
    scores (expert_gating_func) is refused: transformers' computes those."""
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


def _deepseek2_config(path: str, metadata: dict, tensors, config: dict) -> None:
    """llama.cpp's deepseek2 files as DeepSeek's models: DeepseekV3Config where the router scores experts by a
    sigmoid (V3, R1, Kimi K2, GLM-4.7-Flash), DeepseekV2Config by a softmax (V2, V2.5, V2-Lite, Coder-V2; a file
    without expert_gating_func is V2's, as llama.cpp reads it, but GLM-4.7-Flash's by its layers and vocabulary);
    a head's widths from the MLA keys (key_length_mla: not rotated + rotated; value_length_mla), or for a file of
    the unsplit kv_b from key_length and value_length; q straight from the hidden state where the file has no
    attn_q_a; yarn's mscale and mscale_all_dim both yarn_log_multiplier / 0.1 (the converter's 0.1 times
    mscale_all_dim; the published configs set the two alike, and llama.cpp computes so); V2's groups by their best
    expert where there are several; the class's default token ids dropped where the file names none; the layers
    without a multi-token prediction block the converter writes as the last ones (not read)."""
    def key(name, default=None):
        return metadata.get(f"deepseek2.{name}", default)

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
                            "(deepseek2.rope.scaling.factor, original_context_length)")
    config["rope_parameters"] = rope
    _file_token_ids(config, "pad_token_id", "bos_token_id", "eos_token_id")


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


# What an architecture's files need read beyond transformers' reading and the families' rows (path, the metadata, the
# tensors' names, the config to complete).
ARCHITECTURE_CONFIGS = {"gemma4": _gemma4_config, "gpt-oss": _gpt_oss_config, "mistral3": _mistral3_config,
                        "olmo2": _olmo2_config, "exaone4": _exaone4_config, "glm4": _glm4_config,
                        "command-r": _cohere_config, "cohere2": _cohere_config, "seed_oss": _seed_oss_config,
                        "apertus": _apertus_config, "hunyuan-dense": _hunyuan_config,
                        "glm4moe": _glm4moe_config, "deepseek2": _deepseek2_config,
                        "ernie4_5-moe": _ernie4_5_moe_config}


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


# Model types whose router adds a correction to each expert's score to choose them (exp_probs_b), and where the
# router (the block's gate) holds it.
CORRECTED_ROUTERS = {"glm4_moe": "e_score_correction_bias", "deepseek_v3": "e_score_correction_bias",
                     "ernie4_5_moe": "moe_statics.e_score_correction_bias"}
# Model types whose latent attention's kv_b_proj llama.cpp's converter splits (attn_k_b, attn_v_b).
SPLIT_LATENTS = ("deepseek_v2", "deepseek_v3")


def with_expert_names(model_type: str, names: dict[str, str], tensors: set[str]) -> dict[str, str]:
    """gguf's name table `names` (GGUF name -> the model's parameter) with the expert tensors it does not map as
    llama.cpp writes them (`tensors`: the file's names, with_gate_up_apart's halves among them). gpt-oss's (gate, up
    and down apart, each with a bias; the table maps only down_proj): gate and up both to gate_up_proj, their biases
    to gate_up_proj_bias (build.py holds them as GGMLExperts, its gate rows then its up rows). Gemma 4's: gate and
    up in one tensor, which where it is read as its two halves maps to nothing, each half to gate_up_proj; the
    router's input scale (ffn_gate_inp.scale) and its scale of each expert's output, which the converter names
    ffn_down_exps.scale. GLM-4.5's and DeepSeek-V3's router's score correction (exp_probs_b.bias, the converter's
    name of e_score_correction_bias). And DeepSeek's latent attention's kv_b_proj as the converter splits it
    (attn_k_b, attn_v_b: latent_processor joins them)."""
    names, extra = dict(names), {}
    for name, hf in list(names.items()):
        if not name.endswith(".ffn_down_exps.weight"):
            continue
        layer, experts = name.removesuffix(".ffn_down_exps.weight"), hf.removesuffix(".down_proj")
        if model_type == "gpt_oss":
            for part in ("gate", "up"):
                extra[f"{layer}.ffn_{part}_exps.weight"] = f"{experts}.gate_up_proj"
                extra[f"{layer}.ffn_{part}_exps.bias"] = f"{experts}.gate_up_proj_bias"
            extra[f"{layer}.ffn_down_exps.bias"] = f"{experts}.down_proj_bias"
        if model_type == "gemma4_text":
            if f"{layer}.ffn_gate_exps.weight" in tensors:  # the halves, in blocks
                for fused in (f"{layer}.ffn_gate_up_exps", f"{layer}.ffn_gate_up_exps.weight"):
                    names.pop(fused, None)
                for part in ("gate", "up"):
                    extra[f"{layer}.ffn_{part}_exps.weight"] = f"{experts}.gate_up_proj"
            router = experts.removesuffix(".experts") + ".router"
            extra[f"{layer}.ffn_gate_inp.scale"] = f"{router}.scale"
            extra[f"{layer}.ffn_down_exps.scale"] = f"{router}.per_expert_scale"
        if model_type in CORRECTED_ROUTERS:
            block = experts.removesuffix(".experts")
            extra[f"{layer}.exp_probs_b.bias"] = f"{block}.gate.{CORRECTED_ROUTERS[model_type]}"
    if model_type in SPLIT_LATENTS:
        for name, hf in list(names.items()):
            if name.endswith(".attn_kv_b.weight") and name not in tensors:
                extra |= {name.replace("attn_kv_b", f"attn_{half}_b"): hf for half in ("k", "v")}
    return names | extra


def _f32_values(path: str, row: list) -> np.ndarray:
    """An F32 tensor's values, read from the file (`row`: tensor_table's)."""
    return np.fromfile(path, dtype="<f4", count=int(np.prod(row[2])), offset=row[4])


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
        factors[f"{kind}_factor"] = [float(x) for x in _f32_values(path, row)]
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    if f"{arch}.rope.scaling.attn_factor" in metadata:  # the cos/sin scale llama.cpp was given; transformers'
        scaling["attention_factor"] = float(metadata[f"{arch}.rope.scaling.attn_factor"])  # default is the same rule
    return scaling


# Header cache entries kept (a few MB each: the tokenizer's files); the least recently used go first.
MAX_CACHED_HEADERS = 32


def prune_cache(keep: str, limit: int = MAX_CACHED_HEADERS) -> None:
    """Removes the least recently used entries past `limit` (never `keep`, the one in use): a rewritten file or a
    new transformers leaves its old entries behind, which nothing would read again."""
    root = cache_root()
    try:
        entries = [entry for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith(".tmp-")]
    except OSError:
        return
    entries.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
    for entry in entries[limit:]:
        if entry.path != keep:
            shutil.rmtree(entry.path, ignore_errors=True)


def cache_root() -> str:
    """Where per-file header caches live: $XDG_CACHE_HOME/run_generation/gguf (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "run_generation", "gguf")


def type_name(code: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(code).name
    except ValueError:
        return f"type {code}"


class GGUFHeader:
    """A GGUF file's config, tokenizer and tensor table, from the cache or read (and cached) once.

    An entry is a directory keyed by the file's path, size, mtime and the versions above, renamed into place so a
    reader sees all of it or none; a changed file gets a new one, and the least recently used past
    MAX_CACHED_HEADERS are removed."""

    def __init__(self, path: str, blocks: bool = True):
        """`blocks`: the file runs in its blocks, so a type the kernels lack is refused before the slow conversions."""
        self.path, self.blocks = os.path.abspath(path), blocks
        try:
            stat = os.stat(self.path)
        except OSError as error:
            raise GGUFError(f"{path}: {error.strerror}") from None
        self.size = stat.st_size
        # By its metadata: importing transformers is most of a cached run's start-up.
        versions = HEADER_CACHE_VERSION, importlib.metadata.version("transformers")
        identity = "\0".join(str(part) for part in (self.path, stat.st_size, stat.st_mtime_ns, *versions))
        name = os.path.basename(self.path).removesuffix(".gguf")
        self.cache_dir = os.path.join(cache_root(), f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}")
        self.read_seconds = None  # set when the header was read from the file rather than the cache
        if not os.path.isfile(os.path.join(self.cache_dir, "tensors.json")):
            self._read_and_cache()
            prune_cache(self.cache_dir)
        else:
            with contextlib.suppress(OSError):
                os.utime(self.cache_dir)  # used now: the last the pruning removes
        with open(os.path.join(self.cache_dir, "tensors.json")) as f:
            table = json.load(f)
        self.architecture = table["architecture"]
        self.tensors = table["tensors"]  # [name, type code, numpy shape, numpy dtype, byte offset, bytes]
        check_whole(path, [(offset, nbytes) for *_, offset, nbytes in self.tensors])
        self.tensors = with_experts_stacked(path, self.tensors)  # (rows at offset -1: experts held a tensor each)
        self.tensors = with_gate_up_apart(self.tensors)  # (rows at offset -2: Gemma 4's experts' gate and up halves)

    @functools.cached_property
    def config(self):
        """transformers' config class of the architecture (AutoConfig: it imports that model's module)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.cache_dir)

    @functools.cached_property
    def tokenizer(self):
        """The own tokenizer (rungen/gguf/tokenizer.py) where it matches transformers', else transformers'."""
        from .tokenizer import GGUFTokenizer, own

        why = own(self.cache_dir)
        if why is None:
            return GGUFTokenizer(self.cache_dir)
        logger.info("transformers' tokenizer: %s", why)
        return self.transformers_tokenizer

    @functools.cached_property
    def transformers_tokenizer(self):
        """AutoTokenizer's tokenizer for the cached files (its fast class directly where named: a lighter import)."""
        with open(os.path.join(self.cache_dir, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
        if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(self.cache_dir)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cache_dir)
        mend_tokenizer(tokenizer, self.path)  # its class rebuilds the pipeline, without llama.cpp's cut
        return tokenizer

    def cached_weights_map(self) -> dict[str, str] | None:
        """weights_map()'s result where a run before cached it, else None."""
        path = os.path.join(self.cache_dir, "weights_map.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _read_and_cache(self):
        start = time.perf_counter()
        logger.log(NOTICE, "Reading the GGUF header of %s (once: later runs read it from the cache)",
                   os.path.basename(self.path))
        from transformers import AutoConfig, AutoTokenizer

        from .tokenizer import save_class_run

        directory, file = os.path.split(self.path)
        architecture, tensors = tensor_table(self.path)
        check_whole(self.path, [(offset, nbytes) for *_, offset, nbytes in tensors])
        unsupported = [(name, code) for name, code, *_ in tensors if code not in FLOAT_TYPES and code not in SUPPORTED]
        if unsupported and self.blocks:  # before the slow conversions: this file will not run here
            raise GGUFError(unsupported_message(self.path, *unsupported[0]))
        try:
            with metadata_parsed_once(weights=False):
                config = AutoConfig.from_pretrained(directory, gguf_file=file)
                tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
            llama_cpp_reading(self.path, tokenizer, config)
        except GGUFError:
            raise
        except Exception as error:  # transformers: ValueError for an architecture it cannot read, and others
            raise transformers_cannot_load(self.path, error) from None
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-")
        try:
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            save_class_run(tmp, functools.partial(mend_tokenizer, path=self.path))
            with open(os.path.join(tmp, "tensors.json"), "w") as f:
                json.dump({"architecture": architecture, "tensors": tensors}, f)
            try:
                os.replace(tmp, self.cache_dir)  # atomic: readers see the whole entry or none
            except OSError:
                pass  # another process wrote the same entry first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.read_seconds = time.perf_counter() - start
        logger.log(NOTICE, "Read the GGUF header in %.1f s (cached in %s)", self.read_seconds, self.cache_dir)


    def weights_map(self, model: torch.nn.Module, processor) -> dict[str, str]:
        """GGUF tensor name -> the model's parameter name (get_gguf_hf_weights_map); the cached one where a model
        was built from the file before (keep_weights_map)."""
        cached = self.cached_weights_map()
        if cached is not None:
            return cached
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if isinstance(processor, Conversion):  # transformers' conversion table names them
            return processor.weights_map(model, [row[0] for row in self.tensors])
        family = FAMILIES.get(model.config.model_type)
        # (a family llama.cpp writes under another's architecture, Mixtral's, has that architecture's names)
        architecture = family.architecture if family and family.model_type in WITH_EXPERTS.values() else None
        try:
            with metadata_parsed_once():  # its one build of gguf's name table, the names with .weight added
                names = gguf_utils.get_gguf_hf_weights_map(model, processor, model_type=architecture)
        except NotImplementedError as error:
            raise GGUFError(f"{self.path}: {first_line(error)}") from None
        return with_expert_names(model.config.model_type, names, {row[0] for row in self.tensors})

    def keep_weights_map(self, names: dict[str, str]) -> None:
        """Caches the weights map of a model built whole from the file, every tensor's shape checked: the own model
        (rungen/gguf/model.py) loads by it, checking none."""
        path = os.path.join(self.cache_dir, "weights_map.json")
        if os.path.isfile(path):
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".tmp-")
        except FileNotFoundError:  # another process pruned the entry (prune_cache) while this one loaded
            return
        with os.fdopen(fd, "w") as f:
            json.dump(names, f)
        os.replace(tmp, path)  # atomic: never read half-written


def tensor_table(path: str) -> tuple[str, list]:
    """(architecture, [[name, type code, numpy shape, numpy dtype, byte offset in the file, bytes], ...]): by
    transformers' reader, which skips the vocabulary (the gguf package's builds it object by object), else (a type
    transformers cannot size: Q5_0, Q5_1, MXFP4; a malformed file) by the gguf package's. Read once a process for
    the file as it is (a header's first reading asks for it twice)."""
    stat = os.stat(path)
    architecture, rows = _tensor_table(path, stat.st_size, stat.st_mtime_ns)
    return architecture, copy.deepcopy(rows)


@functools.lru_cache(maxsize=4)
def _tensor_table(path: str, size: int, mtime_ns: int) -> tuple[str, list]:
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        table = GgufHeader.from_file(path)
    except Exception:
        return _read_with_gguf(path)
    return table.architecture, [[t.name, t.ggml_type, *_numpy_layout(t.ggml_type, t.shape),
                                 table.data_start + t.offset, t.nbytes] for t in table.tensors]


def _read_with_gguf(path: str) -> tuple[str, list]:
    """(architecture, tensor table) by the gguf package's reader, which knows every ggml type."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    except Exception as error:  # the gguf package raises whatever a malformed file triggers
        raise GGUFError(f"{path}: not a readable GGUF file ({why_unreadable(path, error)})") from None
    return architecture, [[t.name, int(t.tensor_type), list(t.data.shape), t.data.dtype.str, int(t.data_offset),
                           int(t.data.nbytes)] for t in reader.tensors]


def _numpy_layout(code: int, shape) -> tuple[list[int], str]:
    """(shape, numpy dtype) the loader views a tensor's bytes as: values for F32/F16, uint8 rows otherwise."""
    from gguf import GGML_QUANT_SIZES

    if code in (0, 1):
        return list(shape), "<f4" if code == 0 else "<f2"
    block, size = GGML_QUANT_SIZES.get(code, (1, 1))  # BF16: (1, 2)
    return [*shape[:-1], shape[-1] // block * size], "|u1"


def unsupported_message(path: str, name: str, code: int) -> str:
    supported = ", ".join(t.name for t in SUPPORTED)
    return (f"{path}: tensor {name} is {type_name(code)}; quantized GGUF files run in {supported} blocks "
            f"(and F32/F16/BF16); --dequantize runs other types in float32")


def check_whole(path: str, tensors: list[tuple[int, int]]) -> None:
    """GGUFError where the file ends before its tensors (byte offset, bytes) do: a download or copy cut short."""
    end, size = max((offset + nbytes for offset, nbytes in tensors), default=0), os.path.getsize(path)
    if end > size:
        raise GGUFError(f"{path}: truncated (its tensors end at byte {end}, the file has {size}: an unfinished "
                        "download or copy?)")


def transformers_cannot_load(path: str, error: BaseException) -> GGUFError:
    """The one line for a GGUF file transformers' readers or classes failed on: a file cut short or unreadable says
    so, any other says transformers' reason."""
    if isinstance(error, GGUFError):  # complete_config's own line, raised within transformers' reading
        return error
    try:
        check_whole(path, [(offset, nbytes) for *_, offset, nbytes in tensor_table(path)[1]])
    except GGUFError as unreadable:  # a malformed header, or tensors past the file's end
        return unreadable
    return GGUFError(f"{path}: transformers cannot load it ({first_line(error)})")


def why_unreadable(path: str, error: BaseException) -> str:
    """What a header's reader tripped on, said as the user can act on it: no GGUF at all, or a header cut short
    or damaged (an unfinished download), with the reader's own words."""
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as unreadable:
        return first_line(unreadable)
    if magic != b"GGUF":
        return f"it starts with {magic!r}, not GGUF" if magic else "it is empty"
    return f"its header is cut short or damaged: {first_line(error)}"


# Files llama.cpp writes in a layout transformers' own loader does not read, by architecture (and a metadata key that
# marks them, None: every file), and what of them it misses.
TOOL_LOADER_ONLY = {"gpt-oss": (None, "gpt-oss file", "its experts' tensors"),
                    "gemma4": ("gemma4.expert_count", "Gemma 4 mixture of experts",
                               "its experts' gate and up in one tensor, the router's scales"),
                    "glm4moe": (None, "GLM-4.5 mixture (glm4moe) file",
                                "its router's score correction, its multi-token prediction layer"),
                    "deepseek2": (None, "DeepSeek V2/V3 (deepseek2) file",
                                  "its latent attention's kv_b split in two, its router's score correction"),
                    "ernie4_5-moe": (None, "ERNIE 4.5 mixture (ernie4_5-moe) file", "its router's score correction"),
                    "qwen3next": (None, "Qwen3-Next (qwen3next) file",
                                  "its fused projections, which its model takes split by rows")}


def refuse_transformers_loader(path: str) -> None:
    """GGUFError for a file of TOOL_LOADER_ONLY (--dequantize and --device_map load with transformers' loader)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        metadata = read_gguf_metadata(path)[0]
    except Exception:  # an unreadable file: transformers' reading says why, in its own line
        return
    key, kind, missed = TOOL_LOADER_ONLY.get(metadata.get("general.architecture"), (None, None, None))
    if kind is not None and (key is None or metadata.get(key)):
        raise GGUFError(f"{path}: transformers reads no {kind} as llama.cpp writes it ({missed}); it runs here in "
                        "its own blocks, without --dequantize or --device_map")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    unknown = re.match(r"Unknown gguf model_type: (\S+) in gguf-py", text)
    if unknown and unknown[1] in WITH_EXPERTS.values():  # read by this tool's loader, not by transformers'
        architecture = FAMILIES[unknown[1]].architecture
        return (f"transformers reads no {unknown[1]} file ({architecture}'s with experts, as llama.cpp writes it); "
                "it runs here in its own blocks, without --dequantize or --device_map")
    if unknown:  # transformers' advice (a newer gguf package) would not help: llama.cpp writes no such name
        return (f"its general.architecture {unknown[1]!r} is none the gguf package's name table knows, so "
                "transformers cannot map its tensors")
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def is_quantized(header: GGUFHeader) -> bool:
    """Whether any tensor of the file is in quantized blocks (not F32/F16/BF16)."""
    return any(code not in FLOAT_TYPES for _, code, *_ in header.tensors)
