"""Generation controls beyond the original script's flags: their flags and checks, a --generation_config file for
anything else GenerationConfig accepts, and the --assistant_model; all handed to transformers' generate()."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Iterator

from . import logger
from .errors import UsageError, one_line
from .generation import Settings, generation_kwargs

# --generation_config keys with a flag of their own: the file's value is checked and used as the flag's (flags win).
FILE_KEY_FLAGS = {
    "max_new_tokens": "length",
    "temperature": "temperature",
    "top_k": "k",
    "top_p": "p",
    "repetition_penalty": "repetition_penalty",
    "num_beams": "num_beams",
    "num_return_sequences": "num_return_sequences",
    "stop_strings": "stop_token",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "prompt_lookup_num_tokens": "prompt_lookup_num_tokens",
}
INT_KEYS = {"max_new_tokens", "top_k", "num_beams", "num_return_sequences", "no_repeat_ngram_size",
            "prompt_lookup_num_tokens"}
# Keys the tool sets itself (what generate returns decides what is printed), with what to use instead.
OWNED_KEYS = {
    "return_dict_in_generate": "the tool sets it",
    "output_scores": "use --logprobs",
    "output_logits": "use --logprobs",
    "output_attentions": "the tool prints no attentions",
    "output_hidden_states": "the tool prints no hidden states",
    "max_length": "use max_new_tokens or --length",
    "pad_token_id": "the tokenizer's pad token pads the batches",
}
METADATA_KEYS = {"transformers_version", "_from_model_config"}  # in every saved generation_config.json
# Keys that only an assistant model's drafting reads (ignored by generate() without one).
DRAFT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
              "assistant_lookbehind", "target_lookbehind")
# Decoding modes transformers 5 moved to hub repositories (custom_generate, trust_remote_code): the key, the values
# that leave the mode off, and the mode.
HUB_MODES = {"penalty_alpha": ((None, 0, 0.0), "contrastive search"),
             "num_beam_groups": ((None, 1), "group (diverse) beam search"),
             "diversity_penalty": ((None, 0, 0.0), "group (diverse) beam search"),
             "dola_layers": ((None,), "DoLa decoding")}
# Flags that act on generated text only: refused with --length 0 (scoring), where they would change nothing.
GENERATING_FLAGS = ("temperature", "k", "p", "repetition_penalty", "stop_token", "min_p", "typical_p",
                    "no_repeat_ngram_size", "jit")
# Samplers that generate() silently skips when their value is out of range: their own constructors check it.
LIBRARY_RANGE_CHECKS = {
    "epsilon_cutoff": ("EpsilonLogitsWarper", "epsilon"),
    "eta_cutoff": ("EtaLogitsWarper", "epsilon"),
    "top_h": ("TopHLogitsWarper", "top_h"),
}


@dataclasses.dataclass(frozen=True)
class GenerationFile:
    """A --generation_config file, read: values for flags (by flag name) and the other keys, for generate()."""

    path: str
    flags: dict
    extra: dict
    do_sample: bool | None = None  # false becomes --temperature 0 where the flag is not given


def add_control_arguments(parser: argparse.ArgumentParser) -> None:
    """The generation controls' flags, in a group of their own."""
    group = parser.add_argument_group("generation controls (README: Generation controls)")
    group.add_argument("--min_p", type=float, default=None,
                       help="min-p sampling: drop tokens below min_p x the top token's probability (0-1)")
    group.add_argument("--typical_p", type=float, default=None, help="locally typical sampling mass (0-1]")
    group.add_argument("--no_repeat_ngram_size", type=int, default=0,
                       help="never repeat an n-gram of this size, prompt included (0: off)")
    group.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="jsonl: each generated token's log-probability and the N most likely alternatives; "
                       "with --length 0, score the prompt instead (prompt_logprobs, perplexity)")
    group.add_argument("--prompt_lookup_num_tokens", type=int, default=None, metavar="N",
                       help="prompt lookup decoding: draft N tokens copied from the prompt (greedy text unchanged)")
    group.add_argument("--assistant_model", default=None, metavar="PATH",
                       help="assisted decoding with this smaller model of the same tokenizer (greedy text unchanged)")
    group.add_argument("--generation_config", default=None, metavar="FILE.json", type=read_generation_file,
                       help="any other GenerationConfig field; flags given explicitly win over the file")
    constrained = group.add_mutually_exclusive_group()
    constrained.add_argument("--json_schema", default=None, metavar="SCHEMA",
                             help="every sequence is JSON valid under this schema (a file, or the JSON itself)")
    constrained.add_argument("--regex", default=None, metavar="REGEX", help="every sequence matches this regex")
    constrained.add_argument("--grammar", default=None, metavar="FILE.gbnf",
                             help="every sequence is a sentence of this grammar (GBNF, as llama.cpp's)")


# --generation_config


@functools.cache
def generation_defaults():
    """GenerationConfig's defaults (its fields, and the values a file leaves as they are), built once."""
    from transformers import GenerationConfig

    return GenerationConfig()


def read_generation_config(path: str) -> dict:
    """The file's keys; UsageError when unreadable, not a JSON object, or with unknown or tool-owned keys."""
    where = f"--generation_config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except OSError as error:
        raise UsageError(f"{where}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{where}: not valid JSON ({getattr(error, 'msg', None) or error})") from error
    if not isinstance(values, dict):
        raise UsageError(f"{where}: must hold a JSON object of GenerationConfig fields")
    values = {key: value for key, value in values.items() if key not in METADATA_KEYS}
    known = {key for key in vars(generation_defaults()) if not key.startswith("_")} - METADATA_KEYS
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"{where}: unknown GenerationConfig key(s): {', '.join(unknown)}")
    for key in values:
        if key in OWNED_KEYS:
            raise UsageError(f"{where}: {key} cannot be set here ({OWNED_KEYS[key]})")
    for key, (off, mode) in HUB_MODES.items():
        if key in values and values[key] not in off:
            raise UsageError(f"{where}: {key} asks for {mode}, which transformers moved out of generate() to the hub "
                             "(custom_generate with remote code): not supported here")
    return values


def file_value(path: str, key: str, value: object) -> int | float | list[str]:
    """A file value for a key that has a flag, with the flag's type; UsageError otherwise."""
    if key == "stop_strings":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
            raise UsageError(f"--generation_config {path}: stop_strings must be a string or a list of non-empty "
                             "strings")
        return stops
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in INT_KEYS:
        if not number or value != int(value):
            raise UsageError(f"--generation_config {path}: {key} must be an integer, got {json.dumps(value)}")
        return int(value)
    if not number:
        raise UsageError(f"--generation_config {path}: {key} must be a number, got {json.dumps(value)}")
    return float(value)


def read_generation_file(path: str) -> GenerationFile:
    """--generation_config's file split into flag values and generate()'s other keys (`do_sample` apart: it
    decides --temperature only where that flag is not given)."""
    values = read_generation_config(path)
    flags = {flag: file_value(path, key, values.pop(key)) for key, flag in FILE_KEY_FLAGS.items() if key in values}
    do_sample = values.pop("do_sample", None)
    if do_sample is not None and not isinstance(do_sample, bool):
        raise UsageError(f"--generation_config {path}: do_sample must be true or false")
    return GenerationFile(path, flags, values, do_sample)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' library logger says errors only within: GenerationConfig's lenient validation logs findings the
    strict one then says in one line; the tracer (rungen/jit.py) reads properties that warn of what a step never
    uses."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def validate_generation_config(settings: Settings, path: str) -> None:
    """The generate() settings the flags and the file make, through GenerationConfig's strict validation
    (UsageError, before loading)."""
    import transformers.generation
    from transformers import GenerationConfig

    kwargs = generation_kwargs(settings)
    kwargs.pop("tokenizer", None)
    try:
        with quiet_transformers():
            GenerationConfig(**kwargs).validate(strict=True)
        for key, (warper, argument) in LIBRARY_RANGE_CHECKS.items():
            if kwargs.get(key) not in (None, 0):
                getattr(transformers.generation, warper)(**{argument: kwargs[key]})
    except (ValueError, TypeError) as error:
        raise UsageError(f"--generation_config {path}: {one_line(error)}") from error


# Checks of the new flags


def check_controls(args: argparse.Namespace, given: set[str] = frozenset()) -> None:
    """UsageError for the new flags' values and combinations (after the file has filled them; `given`: the flags
    the command line gave)."""
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise UsageError(f"--min_p must be in [0, 1], got {args.min_p}")
    if args.typical_p is not None and not 0 < args.typical_p <= 1:
        raise UsageError(f"--typical_p must be in (0, 1], got {args.typical_p}")
    if args.no_repeat_ngram_size < 0:
        raise UsageError(f"--no_repeat_ngram_size must be >= 0, got {args.no_repeat_ngram_size}")
    sampling_only = [f"--{name}" for name, on in (("k", "k" in given), ("p", "p" in given),
                                                  ("min_p", args.min_p is not None),
                                                  ("typical_p", args.typical_p is not None)) if on]
    if args.temperature == 0 and sampling_only:
        logger.warning("%s %s to sampling only (--temperature > 0); ignored", " and ".join(sampling_only),
                       "applies" if len(sampling_only) == 1 else "apply")
    if args.logprobs is not None:
        if args.logprobs < 0:
            raise UsageError(f"--logprobs must be >= 0, got {args.logprobs}")
        if args.output_format != "jsonl":
            raise UsageError("--logprobs needs --output_format jsonl (text output has nowhere to put them)")
    if args.length == 0 and args.logprobs is None:
        raise UsageError("--length 0 scores the prompts without generating: it needs --logprobs N and "
                         "--output_format jsonl")
    file = args.generation_config
    drafting = [key for key in DRAFT_KEYS if file is not None and key in file.extra
                and file.extra[key] != getattr(generation_defaults(), key)]
    if drafting and args.assistant_model is None:
        raise UsageError(f"--generation_config {file.path}: {drafting[0]} shapes an assistant model's drafts; it "
                         "needs --assistant_model")
    speculative = [name for name, on in (("--prompt_lookup_num_tokens", args.prompt_lookup_num_tokens is not None),
                                         ("--assistant_model", args.assistant_model is not None)) if on]
    if args.prompt_lookup_num_tokens is not None and args.prompt_lookup_num_tokens < 1:
        raise UsageError(f"--prompt_lookup_num_tokens must be >= 1, got {args.prompt_lookup_num_tokens}")
    if len(speculative) == 2:
        raise UsageError("--prompt_lookup_num_tokens and --assistant_model are two ways of drafting tokens: "
                         "choose one")
    if speculative and args.length != 0:
        if args.num_beams > 1:
            raise UsageError(f"{speculative[0]} works with greedy decoding or sampling, not beam search")
        if args.num_return_sequences > 1:
            raise UsageError(f"{speculative[0]} and --num_return_sequences {args.num_return_sequences}: assisted "
                             "generation makes one sequence per prompt (transformers')")
    constrained = args.json_schema is not None or args.regex is not None or args.grammar is not None
    if constrained and args.length == 0:
        raise UsageError("--json_schema, --regex and --grammar constrain generated text; --length 0 generates none")
    shaping = [f"--{name} {value}" for name, value in (("num_return_sequences", args.num_return_sequences),
                                                       ("num_beams", args.num_beams)) if value != 1]
    shaping += [f"--{name}" for name in GENERATING_FLAGS if name in given]
    if args.length == 0 and shaping + speculative:
        raise UsageError(f"{(shaping + speculative)[0]} applies to generated text; --length 0 scores the prompts "
                         "and generates none")
    if args.temperature == 0 and args.num_beams == 1 and args.num_return_sequences > 1:
        n = args.num_return_sequences
        raise UsageError(f"--num_return_sequences {n} at --temperature 0 would print one greedy sequence {n} times: "
                         f"sample (--temperature > 0) or search (--num_beams {n} or more)")


# --assistant_model


def load_assistant(path: str, loaded, *, dtype: str, device) -> object:
    """The --assistant_model, loaded as the main model is; its tokenizer must be the main model's."""
    from .loading import load

    expanded = os.path.expanduser(path)
    if expanded.startswith((".", "/", "~")) and not os.path.exists(expanded):
        raise UsageError(f"--assistant_model {path}: no such file or directory")
    try:
        assistant = load(path, device=device, dtype=dtype, own_model=False)  # generate() drafts with it
    except UsageError as error:  # (tm/x: "not a local model and not in the hub cache"): which flag says it
        raise UsageError(f"--assistant_model: {error}") from None
    if assistant.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise UsageError(f"--assistant_model {path}: its tokenizer differs from the model's; "
                         "assisted decoding needs the same vocabulary")
    return assistant.model
