"""Every flag, its default and its validation. Values come out checked and normalised, so later
stages never re-interpret them (--fp16 is --dtype float16, --padding_text is --prefix)."""

import argparse

from . import PROG, fail, logger
from .controls import add_control_arguments, apply_generation_config, check_controls
from .loading import DTYPES, MODEL_CLASSES, check_model_type


def build_parser():
    parser = argparse.ArgumentParser(prog=PROG, description="Conditional text generation with causal language models.")
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
    parser.add_argument("--prompt", default=None, help="Default: lines of stdin, or a session in a terminal.")
    parser.add_argument("--length", type=int, default=20, help="Number of new tokens.")
    parser.add_argument(
        "--stop_token", "--stop", action="append", default=None, metavar="TEXT",
        help="Text at which generation stops (repeat for several: the earliest one cuts)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="1.0 has no effect, lower tends toward greedy; 0 is greedy"
    )
    parser.add_argument(
        "--repetition_penalty", type=float, default=1.0, help="primarily useful for CTRL model; in that case, use 1.2"
    )
    parser.add_argument("--k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--p", type=float, default=0.9, help="top-p (nucleus) sampling")
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
        "tokenizer has one, off for piped prompts.",
    )
    parser.add_argument("--system", default=None, help="A system message for chat-template prompts and sessions.")
    parser.add_argument("--seed", type=int, default=42, help="random seed for initialization")
    parser.add_argument("--use_cpu", action="store_true", help="Use the CPU even when an accelerator is available.")
    parser.add_argument("--num_return_sequences", type=int, default=1, help="The number of samples to generate.")
    parser.add_argument("--fp16", action="store_true", help="Shorthand for --dtype float16.")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's dtype")
    parser.add_argument("--jit", action="store_true", help="Trace the decoding step with torch.jit.")
    parser.add_argument(
        "--quantize", choices=["int8", "int4"], default=None,
        help="Weight-only quantization of the linear layers (CPU; see README: Speed). Default: none, exact.",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="In a terminal session, show the logs and loading bars it hides."
    )
    # Models larger than one device: accelerate's big-model loading.
    parser.add_argument("--device_map", default=None, help='e.g. "auto": spread the model over GPUs, CPU and disk.')
    parser.add_argument(
        "--max_memory", nargs="+", default=None, metavar="DEVICE=SIZE",
        help="with --device_map, e.g. 0=10GiB cpu=30GiB",
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
    add_serve_arguments(parser)
    return parser


# --- --serve (rungen/server.py) ---
# Flags that shape one run's prompts, output or sampling: with --serve each request carries its own.
SERVE_REFUSED = ("prompt", "stream", "output_format", "input_format", "whole_stdin", "batch_size", "length",
                 "temperature", "k", "p", "repetition_penalty", "num_beams", "num_return_sequences", "stop_token",
                 "chat", "system", "prefix", "padding_text", "xlm_language", "min_p", "typical_p",
                 "no_repeat_ngram_size", "logprobs", "prompt_lookup_num_tokens", "assistant_model",
                 "generation_config", "json_schema", "regex", "grammar", "jit")


def add_serve_arguments(parser):
    group = parser.add_argument_group("OpenAI-compatible server (docs/server.md)")
    group.add_argument("--serve", action="store_true", help="Serve the model over HTTP until stopped.")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: loopback only).")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api_key", default=None,
                       help="Require 'Authorization: Bearer KEY' on all routes but /health ($RUN_GENERATION_API_KEY)")
    group.add_argument("--max_queue", type=int, default=64, help="Requests waiting beyond it get 503 + Retry-After.")
    group.add_argument("--max_batch", type=int, default=16, help="Sequences decoded together at most.")
    group.add_argument("--max_cache_tokens", type=int, default=65536,
                       help="Key/value positions the batch's cache may hold (rows x longest prompt+max_tokens).")
    group.add_argument("--prefix_cache_mb", type=int, default=256,
                       help="Memory for finished conversations' keys/values, reused by their next turn (0: off).")
    group.add_argument("--cors_origins", nargs="+", default=None, metavar="ORIGIN", help="Allow these CORS origins.")
    group.add_argument("--shutdown_grace", type=float, default=30.0,
                       help="Seconds running requests get to finish on SIGTERM/Ctrl-C before they are cut.")


class Secret(str):
    """A string that logs as *** (main() logs the parsed flags, and --api_key is among them)."""

    def __repr__(self):
        return "'***'"


def check_serve(args, parser):
    """With --serve: one line for a flag that belongs to single runs, or a server setting out of range."""
    if args.api_key is not None:
        args.api_key = Secret(args.api_key)
    if not args.serve:
        return
    for dest in SERVE_REFUSED:
        if getattr(args, dest) != parser.get_default(dest) and getattr(args, dest) not in (None, {}, ()):
            flag = "--" + dest
            if dest == "jit":
                fail("--jit traces the decode step of one generate() call; the server's batch changes rows and "
                     "length at every step, so --serve runs eagerly (drop --jit)")
            fail(f"{flag} does not apply to --serve: each request sets its own (see docs/server.md)")
    for dest, low in (("port", 0), ("max_queue", 0), ("max_batch", 1), ("max_cache_tokens", 1),
                      ("prefix_cache_mb", 0), ("shutdown_grace", 0)):
        if getattr(args, dest) < low:
            fail(f"--{dest} must be >= {low}, got {getattr(args, dest)}")
# --- end --serve ---


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_type:
        args.model_type = check_model_type(args.model_type)
    if args.fp16:
        args.dtype = "float16"
    if args.padding_text:
        if not args.prefix:
            args.prefix = args.padding_text
        logger.warning("--padding_text is deprecated; use --prefix")
    apply_generation_config(args, parser, argv)  # a --generation_config file fills the flags not given
    check_serve(args, parser)
    try:
        check_sampling(args)
    except ValueError as error:
        fail(str(error))
    check_controls(args)
    if args.batch_size < 1:
        fail(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.quantize and args.device_map:
        fail("--quantize needs the whole model in memory on one device; it cannot be combined with --device_map")
    if args.max_memory:
        if not args.device_map:
            fail("--max_memory needs --device_map")
        if not all("=" in item for item in args.max_memory):
            fail("--max_memory takes DEVICE=SIZE items, e.g. 0=10GiB cpu=30GiB")
        pairs = (item.split("=", 1) for item in args.max_memory)
        args.max_memory = {int(key) if key.isdigit() else key: size for key, size in pairs}
    return args


def check_sampling(settings):
    """Raises ValueError with a one-line message for a generation setting out of range (flags, or a
    session's /set)."""
    if settings.k < 0:
        raise ValueError(f"--k must be >= 0, got {settings.k}")
    if not 0 < settings.p <= 1:
        raise ValueError(f"--p must be in (0, 1], got {settings.p}")
    if settings.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {settings.temperature}")
    if settings.num_return_sequences < 1:
        raise ValueError(f"--num_return_sequences must be >= 1, got {settings.num_return_sequences}")
    if settings.repetition_penalty <= 0:
        raise ValueError(f"--repetition_penalty must be > 0, got {settings.repetition_penalty}")
    if settings.num_beams < 1:
        raise ValueError(f"--num_beams must be >= 1, got {settings.num_beams}")
    if settings.num_beams > 1 and settings.num_return_sequences > settings.num_beams:
        raise ValueError("--num_return_sequences cannot exceed --num_beams in beam search")
