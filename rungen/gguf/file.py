"""A GGUF file's header, read once and cached (GGUFHeader): its config completed as transformers takes it
(configs.py), its tokenizer mended where transformers' reading of the file's vocabulary differs from llama.cpp's, its
tensor table (table.py), and the map from its tensors' names to the model's parameters (build.py builds the model
over them).

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
import shutil
import tempfile
import time

import numpy as np
import torch

from .. import NOTICE
from .blocks import SUPPORTED
from .configs import complete_config, complete_converted
from .conversions import Conversion, teach_own_tables
from .families import FAMILIES, READ_AS, WITH_EXPERTS
from .splits import GPT2_SPLITS, pre_tokenizer, sentencepiece_text
from .table import check_whole, first_line, tensor_table
from .weights import FLOAT_TYPES, GGUFError, with_experts_stacked, with_gate_up_apart

logger = logging.getLogger("run_generation")

# Bump when what the header cache holds changes meaning (transformers' version is part of the key too).
HEADER_CACHE_VERSION = 15


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
                   "mistral4": "mistral4",
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
            "glm4moe": GLM4MOE_KEYS, "deepseek2": DEEPSEEK2_KEYS, "mistral4": DEEPSEEK2_KEYS,
            "ernie4_5-moe": ERNIE_MOE_KEYS}


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
OWN_PROCESSORS = {"glm4moe": "qwen2moe", "deepseek2": latent_processor, "mistral4": latent_processor,
                  "ernie4_5-moe": "qwen2moe"}


# Text models whose causal LM transformers' auto classes do not name (their checkpoints hold them inside a
# vision-language model: Mistral 4's in Mistral3ForConditionalGeneration), which a file of their text model is.
TEXT_MODELS = {"mistral4": "Mistral4ForCausalLM"}


def register_text_models() -> None:
    """Names TEXT_MODELS' causal LMs to transformers' auto classes (idempotent)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, model_class in TEXT_MODELS.items():
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(model_type, model_class)


def read_as_their_likes() -> None:
    """Teaches transformers' GGUF reading READ_AS's architectures (their config keys, fixed config values and tensor
    processor those of the architecture each is read as) and OWN_KEYS' (their keys; OWN_PROCESSORS' processors);
    idempotent."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    teach_own_tables()
    register_text_models()
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
# The tokenizer.ggml.pre values of a byte-level BPE vocabulary that llama.cpp starts with BOS where the file has no
# tokenizer.ggml.add_bos_token (src/llama-vocab.cpp: Llama 3's split and those alike, Tekken's, Chameleon's).
BOS_FIRST = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
             "tekken", "chameleon"}
USER_DEFINED = 4  # llama.cpp's token type of a piece read whole (llama_token_type)


def mend_tokenizer(tokenizer, path: str, metadata: dict | None = None) -> None:
    """Cuts text as llama.cpp does where transformers' GGUF reading would not (rungen/gguf/splits.py): a byte-level
    BPE vocabulary by the split its file's tokenizer.ggml.pre names (SmolLM's file, the default model, splits each
    numeral on its own, as llama.cpp and SmolLM's own tokenizer.json do; other unknown values split as GPT-2, as
    transformers does), starting with BOS where llama.cpp does for a file that does not say (BOS_FIRST); a
    SentencePiece one with the prefix space before each piece of text that llama.cpp puts. `metadata`: the file's,
    where the caller read it."""
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
    if model == "gpt2" and pre in BOS_FIRST and "tokenizer.ggml.add_bos_token" not in metadata \
            and tokenizer.bos_token is not None:
        tokenizer.add_bos_token = True
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


# Model types whose router adds a correction to each expert's score to choose them (exp_probs_b), and where the
# router (the block's gate) holds it.
CORRECTED_ROUTERS = {"glm4_moe": "e_score_correction_bias", "deepseek_v3": "e_score_correction_bias",
                     "ernie4_5_moe": "moe_statics.e_score_correction_bias"}
# Model types whose latent attention's kv_b_proj llama.cpp's converter splits (attn_k_b, attn_v_b).
SPLIT_LATENTS = ("deepseek_v2", "deepseek_v3", "mistral4")


def with_expert_names(model_type: str, names: dict[str, str], tensors: set[str]) -> dict[str, str]:
    """gguf's name table `names` (GGUF name -> the model's parameter) with the expert tensors it does not map as
    llama.cpp writes them (`tensors`: the file's names, with_gate_up_apart's halves among them). gpt-oss's (gate, up
    and down apart, each with a bias; the table maps only down_proj): gate and up both to gate_up_proj, their biases
    to gate_up_proj_bias (build.py holds them as GGMLExperts, its gate rows then its up rows). Gemma 4's and
    Mistral 4's: gate and up in one tensor, which where it is read as its two halves maps to nothing, each half to
    gate_up_proj; Gemma 4's
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
        if model_type in ("gemma4_text", "mistral4") and f"{layer}.ffn_gate_exps.weight" in tensors:
            for fused in (f"{layer}.ffn_gate_up_exps", f"{layer}.ffn_gate_up_exps.weight"):  # the halves, in blocks
                names.pop(fused, None)
            for part in ("gate", "up"):
                extra[f"{layer}.ffn_{part}_exps.weight"] = f"{experts}.gate_up_proj"
        if model_type == "gemma4_text":
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

        config = AutoConfig.from_pretrained(self.cache_dir)
        if config.model_type in TEXT_MODELS:
            register_text_models()
        return config

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
            complete_converted(self.path, config)
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


def unsupported_message(path: str, name: str, code: int) -> str:
    supported = ", ".join(t.name for t in SUPPORTED)
    return (f"{path}: tensor {name} is {type_name(code)}; quantized GGUF files run in {supported} blocks "
            f"(and F32/F16/BF16); --dequantize runs other types in float32")


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


# Files llama.cpp writes in a layout transformers' own loader does not read, by architecture (and a metadata key that
# marks them, None: every file), and what of them it misses.
TOOL_LOADER_ONLY = {"gpt-oss": (None, "gpt-oss file", "its experts' tensors"),
                    "gemma4": ("gemma4.expert_count", "Gemma 4 mixture of experts",
                               "its experts' gate and up in one tensor, the router's scales"),
                    "glm4moe": (None, "GLM-4.5 mixture (glm4moe) file",
                                "its router's score correction, its multi-token prediction layer"),
                    "deepseek2": (None, "DeepSeek V2/V3 (deepseek2) file",
                                  "its latent attention's kv_b split in two, its router's score correction"),
                    "mistral4": (None, "Mistral 4 (mistral4) file",
                                 "its latent attention's kv_b split in two, its experts' gate and up in one tensor"),
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


def is_quantized(header: GGUFHeader) -> bool:
    """Whether any tensor of the file is in quantized blocks (not F32/F16/BF16)."""
    return any(code not in FLOAT_TYPES for _, code, *_ in header.tensors)
