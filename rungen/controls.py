"""Generation controls beyond the seed's flags (issue 12): their flags and checks, a --generation_config
file for anything else GenerationConfig accepts, and the --assistant_model. Everything here hands
its values to transformers' own generate(); nothing re-implements a sampler or a decoding loop."""

import argparse
import contextlib
import json
import os

from . import fail, logger

# --generation_config keys that have a flag of their own: a value from the file becomes that flag's value
# (unless the flag is given explicitly: flags win), so it is checked and used exactly as the flag is.
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
# Samplers that generate() silently skips when their value is out of range: their own constructors check it.
LIBRARY_RANGE_CHECKS = {
    "epsilon_cutoff": ("EpsilonLogitsWarper", "epsilon"),
    "eta_cutoff": ("EtaLogitsWarper", "epsilon"),
    "top_h": ("TopHLogitsWarper", "top_h"),
}
# Generation modes that transformers runs one sequence at a time ("assisted generate is only supported
# for batch_size = 1"): the tool then generates its batches prompt by prompt.
ONE_AT_A_TIME_KEYS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


class GenerationError(ValueError):
    """generate() refused the settings (e.g. a --generation_config value only the library checks)."""


def add_control_arguments(parser):
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
    group.add_argument("--generation_config", default=None, metavar="FILE.json",
                       help="any other GenerationConfig field; flags given explicitly win over the file")
    constrained = group.add_mutually_exclusive_group()
    constrained.add_argument("--json_schema", default=None, metavar="SCHEMA",
                             help="every sequence is JSON valid under this schema (a file, or the JSON itself)")
    constrained.add_argument("--regex", default=None, metavar="REGEX", help="every sequence matches this regex")
    constrained.add_argument("--grammar", default=None, metavar="FILE.gbnf",
                             help="every sequence is a sentence of this grammar (GBNF, as llama.cpp's)")


#
# --generation_config
#


def explicit_flags(parser, argv):
    """The destinations of the flags the command line gives (not their defaults). Re-parses argv with
    every default suppressed; the parser is not used again afterwards."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def read_generation_config(path):
    """The file's keys, or a one-line error: not readable, not a JSON object, unknown or tool-owned keys."""
    from transformers import GenerationConfig

    where = f"--generation_config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except OSError as error:
        fail(f"{where}: {error.strerror or error}")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        fail(f"{where}: not valid JSON ({getattr(error, 'msg', None) or error})")
    if not isinstance(values, dict):
        fail(f"{where}: must hold a JSON object of GenerationConfig fields")
    values = {key: value for key, value in values.items() if key not in METADATA_KEYS}
    known = {key for key in vars(GenerationConfig()) if not key.startswith("_")} - METADATA_KEYS
    unknown = sorted(set(values) - known)
    if unknown:
        fail(f"{where}: unknown GenerationConfig key(s): {', '.join(unknown)}")
    for key in values:
        if key in OWNED_KEYS:
            fail(f"{where}: {key} cannot be set here ({OWNED_KEYS[key]})")
    return values


def file_value(path, key, value):
    """A file value for a key that has a flag, with the flag's type, or a one-line error."""
    if key == "stop_strings":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
            fail(f"--generation_config {path}: stop_strings must be a string or a list of non-empty strings")
        return stops[0] if len(stops) == 1 else tuple(stops)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in INT_KEYS:
        if not number or value != int(value):
            fail(f"--generation_config {path}: {key} must be an integer, got {json.dumps(value)}")
        return int(value)
    if not number:
        fail(f"--generation_config {path}: {key} must be a number, got {json.dumps(value)}")
    return float(value)


def apply_generation_config(args, parser, argv):
    """Reads --generation_config: keys with a flag fill the flags not given on the command line; the rest
    go to generate() as they are (args.generation_config becomes that dict, args.generation_config_file
    the path). Also normalises --stop_token (one: a string, as before; several: a tuple)."""
    stops = [stop for stop in args.stop_token or () if stop]
    args.stop_token = None if not stops else stops[0] if len(stops) == 1 else tuple(stops)
    path = args.generation_config_file = args.generation_config
    args.generation_config = {}
    if path is None:
        return
    values = read_generation_config(path)
    given = explicit_flags(parser, argv)
    for key, flag in FILE_KEY_FLAGS.items():
        if key in values:
            value = file_value(path, key, values.pop(key))
            if flag not in given:
                setattr(args, flag, value)
    if "do_sample" in values:
        do_sample = values.pop("do_sample")
        if not isinstance(do_sample, bool):
            fail(f"--generation_config {path}: do_sample must be true or false")
        if "temperature" not in given:
            if not do_sample:
                args.temperature = 0  # the tool's spelling of greedy
            elif args.temperature == 0:
                fail(f"--generation_config {path}: do_sample is true but temperature is 0")
    args.generation_config = values


def one_line(error):
    """An exception's message on one line (GenerationConfig's are several: a heading, '- `key`: ...' items
    and a closing note)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    items = [line[2:] for line in lines if line.startswith("- ")]
    return " ".join(items or lines[:1]) or type(error).__name__


@contextlib.contextmanager
def quiet_transformers():
    """GenerationConfig logs its lenient validation's findings; the strict one then says it in one line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def validate_generation_config(args):
    """The whole set of generate() settings the flags and the file make, through GenerationConfig's own
    strict validation: an invalid value or a conflicting combination is a one-line error, before loading."""
    import transformers.generation
    from transformers import GenerationConfig

    from .generation import Settings, generation_kwargs

    kwargs = generation_kwargs(Settings.from_args(args, 0), argparse.Namespace(pad_token_id=None))
    kwargs.pop("tokenizer", None)
    try:
        with quiet_transformers():
            GenerationConfig(**kwargs).validate(strict=True)
        for key, (warper, argument) in LIBRARY_RANGE_CHECKS.items():
            if kwargs.get(key) not in (None, 0):
                getattr(transformers.generation, warper)(**{argument: kwargs[key]})
    except (ValueError, TypeError) as error:
        fail(f"--generation_config {args.generation_config_file}: {one_line(error)}")


#
# Checks of the new flags
#


def check_controls(args):
    """One-line errors for the new flags' values and combinations (after the file has filled them)."""
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        fail(f"--min_p must be in [0, 1], got {args.min_p}")
    if args.typical_p is not None and not 0 < args.typical_p <= 1:
        fail(f"--typical_p must be in (0, 1], got {args.typical_p}")
    if args.no_repeat_ngram_size < 0:
        fail(f"--no_repeat_ngram_size must be >= 0, got {args.no_repeat_ngram_size}")
    if args.temperature == 0 and (args.min_p is not None or args.typical_p is not None):
        logger.warning("--min_p and --typical_p apply to sampling only (--temperature > 0); ignored")
    if args.logprobs is not None:
        if args.logprobs < 0:
            fail(f"--logprobs must be >= 0, got {args.logprobs}")
        if args.output_format != "jsonl":
            fail("--logprobs needs --output_format jsonl (text output has nowhere to put them)")
    if args.length == 0 and args.logprobs is None:
        fail("--length 0 scores the prompts without generating: it needs --logprobs N and --output_format jsonl")
    speculative = [name for name, on in (("--prompt_lookup_num_tokens", args.prompt_lookup_num_tokens is not None),
                                         ("--assistant_model", args.assistant_model is not None)) if on]
    if args.prompt_lookup_num_tokens is not None and args.prompt_lookup_num_tokens < 1:
        fail(f"--prompt_lookup_num_tokens must be >= 1, got {args.prompt_lookup_num_tokens}")
    if len(speculative) == 2:
        fail("--prompt_lookup_num_tokens and --assistant_model are two ways of drafting tokens: choose one")
    if speculative and args.length != 0:
        if args.num_beams > 1:
            fail(f"{speculative[0]} works with greedy decoding or sampling, not beam search")
        if args.num_return_sequences > 1:
            fail(f"{speculative[0]} generates one sequence per prompt (transformers' assisted generation)")
    if args.generation_config_file is not None:
        validate_generation_config(args)
    args.constraint_source = None
    if args.json_schema is not None or args.regex is not None or args.grammar is not None:
        from .constrain import ConstraintError, read_constraint  # xgrammar: only when asked for

        if args.length == 0:
            fail("--json_schema, --regex and --grammar constrain generated text; --length 0 generates none")
        try:
            args.constraint_source = read_constraint(args)
        except ConstraintError as error:
            fail(str(error))


#
# --assistant_model
#


def load_assistant(args, loaded, device):
    """The draft model of --assistant_model, loaded as the main model is (type and dtype inferred) and
    placed where the inputs go. Its tokenizer must be the main model's: same vocabulary, same ids."""
    from .loading import load

    path = os.path.expanduser(args.assistant_model)
    if path.startswith((".", "/", "~")) and not os.path.exists(path):
        fail(f"--assistant_model {args.assistant_model}: no such file or directory")
    options = argparse.Namespace(model_name_or_path=args.assistant_model, model_type=None, dtype=args.dtype,
                                 device_map=None, max_memory=None)
    assistant = load(options, device if args.device_map is None else loaded.input_device)
    if assistant.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        fail(f"--assistant_model {args.assistant_model}: its tokenizer differs from the model's; "
             "assisted decoding needs the same vocabulary")
    return assistant.model
