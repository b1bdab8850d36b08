"""Every flag, its default and its checks, and the generation Settings the flags make; the Namespace goes no
further than main()."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from . import PROG, logger
from .controls import FILE_KEY_FLAGS, add_control_arguments, check_controls, validate_generation_config
from .errors import UsageError
from .generation import FLAG_NAMES, Settings, stop_strings
from .loading import DTYPES, MODEL_CLASSES, check_model_type, is_gguf

_UNSET = object()  # marks the flags a command line leaves out, so that a --generation_config file can fill them


class Parser(argparse.ArgumentParser):
    """argparse's parser with its errors one line, as the tool's others are, not a usage block."""

    def error(self, message):
        raise UsageError(message)


# Flags of float type: NaN and the infinities parse as floats, and pass every range check written with < and >.
FLOAT_FLAGS = ("temperature", "repetition_penalty", "p", "min_p", "typical_p", "shutdown_grace")
SEED_RANGE = (0, 2**32 - 1)  # numpy's, which transformers' set_seed seeds too


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every flag, with its default and help."""
    parser = Parser(prog=PROG, description="Conditional text generation with causal language models.")
    parser.add_argument(
        "--model_type",
        default=None,
        type=check_model_type,
        help="Model type: " + ", ".join(MODEL_CLASSES) + ", or any causal LM type. Default: from config.json.",
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="Local directory, hub id, or .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--prompt", default=None, help="Default: lines of stdin, or a session in a terminal.")
    parser.add_argument("--length", type=int, default=20,
                        help="Number of new tokens (default: 20; negative: up to the context; 0: score the prompts).")
    parser.add_argument(
        "--stop_token", "--stop", action="append", default=None, metavar="TEXT",
        help="Text at which generation stops (repeat for several: the earliest one cuts)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0,
        help="1.0 (the default) has no effect, lower tends toward greedy; 0 is greedy"
    )
    parser.add_argument(
        "--repetition_penalty", type=float, default=1.0, help="primarily useful for CTRL model; in that case, use 1.2 "
        "(default: %(default)s)"
    )
    parser.add_argument("--k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--p", type=float, default=0.9, help="top-p (nucleus) sampling (default: 0.9)")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams")
    add_control_arguments(parser)
    parser.add_argument("--prefix", default="", help="Text added prior to input.")
    parser.add_argument("--padding_text", default="", help="Deprecated, the use of `--prefix` is preferred.")
    parser.add_argument("--xlm_language", default="", help="Optional language when used with the XLM model.")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Wrap each prompt in the tokenizer's chat template. Default: on in a terminal session when the "
        "tokenizer has one, off for --prompt and piped prompts.",
    )
    parser.add_argument("--system", default=None, help="A system message for chat-template prompts and sessions.")
    parser.add_argument(
        "--chat_template_kwargs", default=None, type=template_kwargs, metavar="JSON",
        help='The chat template\'s own variables, a JSON object: {"enable_thinking": false} turns Qwen3\'s thinking '
        "off. With --serve, each request's defaults (its chat_template_kwargs and reasoning_effort win).",
    )
    parser.add_argument(
        "--thinking_budget", default=None, type=int, metavar="N",
        help="A thinking model's replies think at most N tokens: then the block is closed for the model, which "
        "answers (the server's thinking_token_budget).",
    )
    parser.add_argument(
        "--tools", default=None, metavar="FILE.json",
        help='Tools the model may call in a terminal session: OpenAI function tools, a JSON list or {"tools", '
        '"tool_choice", "parallel_tool_calls"}; the session prints each call the model would make.',
    )
    parser.add_argument("--seed", type=int, default=42, help="random seed for initialization (default: 42)")
    parser.add_argument("--use_cpu", action="store_true", help="Use the CPU even when an accelerator is available.")
    parser.add_argument("--num_return_sequences", type=int, default=1, help="The number of samples to generate "
                        "(default: %(default)s).")
    parser.add_argument("--fp16", action="store_true", help="Shorthand for --dtype float16.")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's dtype")
    parser.add_argument("--jit", action="store_true", help="Trace the decoding step with torch.jit.")
    parser.add_argument(
        "--quantize", choices=["int8", "int4"], default=None,
        help="Weight-only quantization of the linear layers (CPU and CUDA; README: --quantize). Default: none, exact.",
    )
    parser.add_argument(
        "--dequantize", action="store_true",
        help="Run a GGUF file in float32, de-quantized on loading (default: in its own quantized blocks).",
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "--verbose", action="store_true",
        help="Also show the arguments, the device, loading detail and bars (with --serve: a line per request).",
    )
    shown.add_argument(
        "--quiet", action="store_true",
        help="Nothing on stderr but warnings and errors: no figures, no first-run progress (default: one line).",
    )
    # Models larger than one device: accelerate's big-model loading.
    parser.add_argument("--device_map", default=None, help='e.g. "auto": spread the model over GPUs, CPU and disk.')
    parser.add_argument(
        "--max_memory", nargs="+", default=None, metavar="DEVICE=SIZE",
        help="with --device_map, e.g. 0=10GiB cpu=30GiB",
    )
    # Batches of prompts from stdin, and machine-readable output.
    parser.add_argument("--whole_stdin", action="store_true", help="Read all of stdin as one prompt.")
    parser.add_argument("--input_format", choices=["text", "jsonl"], default="text",
                        help="stdin: a prompt a line (text, the default), or a JSON object a line (docs/usage.md)")
    parser.add_argument("--output_format", choices=["text", "jsonl"], default="text",
                        help="the original script's text blocks (the default), or a JSON object a sequence")
    parser.add_argument("--batch_size", type=int, default=16, help="Prompts generated together (default: 16).")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Print tokens as they come (one prompt, one sequence). Default: on when stdout is a terminal.",
    )
    add_serve_arguments(parser)
    return parser


# --- --serve (rungen/server.py) ---
# Flags that shape one run's prompts, output or sampling: with --serve each request carries its own.
SERVE_REFUSED = ("prompt", "stream", "output_format", "input_format", "whole_stdin", "batch_size", "length",
                 "temperature", "k", "p", "repetition_penalty", "num_beams", "num_return_sequences", "stop_token",
                 "chat", "system", "prefix", "padding_text", "xlm_language", "min_p", "typical_p",
                 "no_repeat_ngram_size", "logprobs", "prompt_lookup_num_tokens", "assistant_model",
                 "generation_config", "json_schema", "regex", "grammar", "tools", "thinking_budget")
# Where "each request sets its own" is not why
SERVE_REFUSED_WHY = {"batch_size": "it batches requests as they come, up to --max_batch",
                     **dict.fromkeys(("prompt", "input_format", "whole_stdin"), "prompts come in requests"),
                     "output_format": "it answers in JSON"}
SERVE_ONLY = ("host", "port", "api_key", "max_queue", "max_batch", "max_cache_tokens", "prefix_cache_mb",
              "cors_origins", "shutdown_grace")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """--serve and the server's own settings, in a group of their own."""
    group = parser.add_argument_group("OpenAI-compatible server (docs/server.md)")
    group.add_argument("--serve", action="store_true", help="Serve the model over HTTP until stopped.")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: loopback only).")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    group.add_argument("--api_key", default=None, type=Secret,
                       help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on all routes but /health "
                       "($RUN_GENERATION_API_KEY)")
    group.add_argument("--max_queue", type=int, default=64, help="Requests waiting beyond it get 503 + Retry-After "
                       "(default: %(default)s).")
    group.add_argument("--max_batch", type=int, default=16,
                       help="Sequences decoded together at most (default: %(default)s).")
    group.add_argument("--max_cache_tokens", type=int, default=65536,
                       help="Key/value positions the batch's cache may hold (rows x longest prompt+max_tokens; "
                       "default: %(default)s).")
    group.add_argument("--prefix_cache_mb", type=int, default=256,
                       help="Memory for finished sequences' keys/values, reused by requests that start the same "
                       "way: a conversation's next turn, a shared system prompt (0: off; default: %(default)s).")
    group.add_argument("--cors_origins", nargs="+", default=None, metavar="ORIGIN", help="Allow these CORS origins.")
    group.add_argument("--shutdown_grace", type=float, default=30.0,
                       help="Seconds running requests get to finish on SIGTERM/Ctrl-C before they are cut "
                       "(default: %(default)s).")


class Secret(str):
    """A string that logs as *** (main() logs the parsed flags, and --api_key is among them)."""

    def __repr__(self):
        return "'***'"


def serve_options(args: argparse.Namespace):
    """The --serve flags as rungen.server's ServeOptions (the key from $RUN_GENERATION_API_KEY when no flag)."""
    import os

    import torch

    from .server import API_KEY_ENV, ServeOptions  # FastAPI: only when serving

    model_id = os.path.basename(os.path.normpath(args.model_name_or_path)) if args.model_name_or_path \
        else "SmolLM2-135M-Instruct"
    return ServeOptions(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        model_id=model_id, max_queue=args.max_queue, max_batch=args.max_batch,
                        max_cache_tokens=args.max_cache_tokens, prefix_cache_mb=args.prefix_cache_mb,
                        cors_origins=tuple(args.cors_origins or ()), grace=args.shutdown_grace,
                        max_n=min(16, args.max_batch), threads=torch.get_num_threads(),
                        template_kwargs=args.chat_template_kwargs or {})


def check_serve(args: argparse.Namespace, given: set[str]) -> None:
    """With --serve: UsageError for a flag that belongs to single runs (`given`: the flags the command line
    gave), or a server setting out of range."""
    if not args.serve:
        for dest in SERVE_ONLY:
            if dest in given:
                raise UsageError(f"--{dest} is a server setting: it needs --serve")
        return
    for dest in SERVE_REFUSED:
        if dest in given:  # whatever the value: --temperature 0 would set nothing either
            why = SERVE_REFUSED_WHY.get(dest, "each request sets its own")
            raise UsageError(f"--{dest} does not apply to --serve: {why} (see docs/server.md)")
    for dest, low in (("port", 0), ("max_queue", 0), ("max_batch", 1), ("max_cache_tokens", 1),
                      ("prefix_cache_mb", 0), ("shutdown_grace", 0)):
        if getattr(args, dest) < low:
            raise UsageError(f"--{dest} must be >= {low}, got {getattr(args, dest)}")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
# --- end --serve ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, each of its declared type, checked (UsageError); a --generation_config file fills those left out
    (--fp16 is --dtype float16, --padding_text is --prefix)."""
    parser = build_parser()
    defaults = vars(parser.parse_args([]))
    # argparse fills a default only where the namespace has no value: a flag still _UNSET was not given.
    start = {name: None if default is None else _UNSET for name, default in defaults.items()}
    parsed = vars(parser.parse_args(argv, namespace=argparse.Namespace(**start)))
    given = {name for name, value in parsed.items() if value is not _UNSET and value is not None}
    values = {name: defaults[name] if value is _UNSET else value for name, value in parsed.items()}
    for action in parser._actions:  # argparse gives `--temperature=--` the value [] without converting it
        if (type(action) is argparse._StoreAction and action.nargs is None
                and isinstance(values.get(action.dest), list)):
            kind = "a number" if action.type in (int, float) else "a value"
            raise UsageError(f"{action.option_strings[0]} needs {kind}, got {values[action.dest]!r}")
    file = values["generation_config"]
    if file is not None:
        for flag in FILE_KEY_FLAGS.values():
            if flag in file.flags and flag not in given:
                values[flag] = file.flags[flag]
        if file.do_sample is not None and "temperature" not in given:
            if not file.do_sample:
                values["temperature"] = 0  # the tool's spelling of greedy
            elif values["temperature"] == 0:
                raise UsageError(f"--generation_config {file.path}: do_sample is true but temperature is 0")
    if values["fp16"]:
        if "dtype" in given and values["dtype"] != "float16":
            raise UsageError(f"--fp16 is --dtype float16; with --dtype {values['dtype']} choose one")
        values["dtype"] = "float16"
    if values["padding_text"]:
        if values["prefix"]:
            raise UsageError("--padding_text is the original script's name for --prefix; choose one")
        values["prefix"] = values["padding_text"]
        logger.warning("--padding_text is deprecated; use --prefix")
    args = argparse.Namespace(**values)
    for name in FLOAT_FLAGS:  # from the command line or a --generation_config file
        if values[name] is not None and not math.isfinite(values[name]):
            raise UsageError(f"--{name} must be a finite number, got {values[name]}")
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise UsageError(f"--seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {args.seed}")
    check_serve(args, given)
    if args.tools is not None:
        args.tools = read_tools_file(args.tools)
    settings = settings_from_args(args)
    settings.check()
    check_controls(args, given)
    if file is not None:
        validate_generation_config(settings, file.path)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    check_inputs(args, given)
    if args.dequantize and args.model_name_or_path and not is_gguf(os.path.expanduser(args.model_name_or_path)):
        raise UsageError("--dequantize applies to GGUF files (and the default model); this checkpoint is not one")
    if args.quantize and args.device_map:
        raise UsageError("--quantize needs the whole model in memory on one device; it cannot be combined with "
                         "--device_map")
    if args.device_map:
        check_device_map(args.device_map)
    if args.max_memory:
        if not args.device_map:
            raise UsageError("--max_memory needs --device_map")
        max_memory_map(args.max_memory)
    return args


def check_inputs(args: argparse.Namespace, given: set[str]) -> None:
    """UsageError for input flags a run would not read: stdin's format beside --prompt, --whole_stdin's one prompt
    as jsonl lines, piped prompts' flags in a session, --system with prompts no chat template wraps."""
    if args.prompt is not None and {"input_format", "whole_stdin"} & given:
        flag = "--input_format" if "input_format" in given else "--whole_stdin"
        raise UsageError(f"{flag} is how stdin is read; with --prompt stdin is not read")
    if args.whole_stdin and args.input_format == "jsonl":
        raise UsageError("--whole_stdin reads stdin as one text prompt; jsonl is one prompt a line: choose one")
    session = args.prompt is None and sys.stdin is not None and sys.stdin.isatty()  # main()'s test
    if session and not args.serve:  # what only piped prompts do: a session would drop it
        for flag, value, does in (("input_format", "jsonl", "is how piped stdin is read"),
                                  ("whole_stdin", True, "is how piped stdin is read"),
                                  ("output_format", "jsonl", "is for piped prompts: a session prints its replies as "
                                                             "text (/save writes the conversation as JSON)")):
            if getattr(args, flag) == value:
                raise UsageError(f"--{flag}{'' if value is True else ' ' + value} {does}; with a terminal on stdin "
                                 "a session starts: pipe the prompts in")
        if args.num_return_sequences > 1:
            raise UsageError("--num_return_sequences: a session gives one reply per prompt; pipe the prompts in for "
                             "several")
        if "batch_size" in given:
            raise UsageError("--batch_size: a session replies to one prompt at a time; pipe the prompts in to batch "
                             "them")
    if args.thinking_budget is not None and args.thinking_budget < 0:
        raise UsageError(f"--thinking_budget must be >= 0, got {args.thinking_budget}")
    for flag, what in (("system", "system message"), ("chat_template_kwargs", "variables"),
                       ("thinking_budget", "thinking cap")):
        if getattr(args, flag) is None:
            continue
        if args.chat is False and args.input_format == "text":  # jsonl conversations go through it all the same
            raise UsageError(f"--{flag} is the chat template's {what}; --no-chat leaves prompts unwrapped")
        if args.chat is None and not args.serve and args.input_format == "text" and not session:
            raise UsageError(f"--{flag} is the chat template's {what}: add --chat to wrap these prompts in it")


def check_template_flags(args: argparse.Namespace, prompts: list) -> None:
    """UsageError for --system or --chat_template_kwargs where no prompt read goes through the template (jsonl
    "prompt" lines without --chat), as check_inputs does for text prompts; for --prefix where every line is a
    conversation (which takes none)."""
    if args.prefix and prompts and all(prompt.messages is not None for prompt in prompts):
        raise UsageError("--prefix goes before text prompts, and every line is a conversation (which gets none); put "
                         "it in the messages")
    if args.chat or not prompts or any(prompt.messages is not None for prompt in prompts):
        return
    for flag in ("system", "chat_template_kwargs", "thinking_budget"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} is for the chat template, and no line is a conversation: add --chat to wrap "
                             "these prompts in it")


def template_kwargs(text: str) -> dict:
    """--chat_template_kwargs' JSON object (argparse's type: its error is the flag's one line)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('a JSON object of the template\'s variables: {"enable_thinking": false}')
    return value


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's


def accelerators_here() -> tuple[str | None, int]:
    """(the accelerator's device type, how many) torch sees: (None, 0) on a CPU-only machine."""
    import torch

    if not torch.accelerator.is_available():
        return None, 0
    return torch.accelerator.current_accelerator().type, torch.accelerator.device_count()


def accelerators_seen(kind: str | None, count: int) -> str:
    """What torch sees, for an error message."""
    return f"torch sees {count} {kind} device(s)" if kind else "torch sees no accelerator"


def check_device_map(value: str) -> None:
    """--device_map: one of accelerate's strategies, or a device this machine has (UsageError otherwise)."""
    if value in DEVICE_MAP_STRATEGIES:
        return
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise UsageError(f"--device_map {value}: takes {', '.join(DEVICE_MAP_STRATEGIES)} or a device (cpu, "
                         "cuda:0...)") from None
    kind, count = accelerators_here()
    if device.type != "cpu" and (device.type != kind or (device.index or 0) >= count):
        raise UsageError(f"--device_map {value}: no such device here ({accelerators_seen(kind, count)})")


def read_tools_file(path: str) -> dict:
    """--tools FILE.json as a request's tool fields, checked as the server checks them (UsageError)."""
    from .tools import ToolError, read_tool_request

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--tools {path}: {getattr(error, 'strerror', None) or error}") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"--tools {path}: not valid JSON ({error.msg})") from error
    fields = {"tools": value} if isinstance(value, list) else value
    if not isinstance(fields, dict) or set(fields) - {"tools", "tool_choice", "parallel_tool_calls"}:
        raise UsageError(f'--tools {path}: a list of tools, or an object with "tools", "tool_choice" and '
                         '"parallel_tool_calls"')
    try:
        if read_tool_request(fields) is None:
            raise ToolError("no tools", "tools")
    except ToolError as error:
        raise UsageError(f"--tools {path}: {error}") from error
    return fields


def max_memory_map(items: list[str] | None) -> dict | None:
    """--max_memory's DEVICE=SIZE items as accelerate's {device: size} (a GPU index as an int, bytes as an int);
    a device or size accelerate would refuse deep in loading is a UsageError here."""
    if not items:
        return None
    from accelerate.utils import convert_file_size_to_int

    memory = {}
    for item in items:
        key, _, size = item.partition("=")
        if not _ or not (key.isdigit() or key in ("cpu", "disk", "mps")):
            raise UsageError(f"--max_memory {item}: takes DEVICE=SIZE items, DEVICE a GPU's index, cpu, disk or mps, "
                             "e.g. 0=10GiB cpu=30GiB")
        if not size.isdigit():
            try:
                convert_file_size_to_int(size)
            except ValueError:
                raise UsageError(f"--max_memory {item}: SIZE is bytes or a number with a unit, e.g. 10GiB or 500MB "
                                 "(items apart: 0=10GiB cpu=30GiB)") from None
        memory[int(key) if key.isdigit() else key] = int(size) if size.isdigit() else size
    kind, count = accelerators_here()
    for key in memory:
        if isinstance(key, int) and key >= count:
            raise UsageError(f"--max_memory {key}=...: no GPU {key} here ({accelerators_seen(kind, count)})")
    return memory


def settings_from_args(args: argparse.Namespace, context: int = 0) -> Settings:
    """The generation Settings the flags make, --length clamped to `context` (0: unknown); --chat's None is off
    here (a session decides it for itself)."""
    stops = stop_strings(args.stop_token)
    fields = {field.name for field in dataclasses.fields(Settings)} - {"constraint", "generation_config", "stop_token",
                                                                        "chat"}
    settings = Settings(
        **{name: getattr(args, FLAG_NAMES.get(name, name)) for name in fields},
        stop_token=None if not stops else stops[0] if len(stops) == 1 else stops,
        chat=bool(args.chat),
        generation_config=args.generation_config.extra if args.generation_config is not None else {},
    )
    return settings.fit_context(context)
