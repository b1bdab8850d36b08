"""The command line's prompts and a session's turns through the engine on the calling thread (engine_refusal,
open_engine, run_prompts), into Sequences as generate() gives.
"""

import collections
import contextlib
import sys

import numpy
import torch

from . import logger
from .engine import Engine
from .errors import GenerationError, UsageError, one_line
from .generation import (
    StuckError,
    describe_sequence,
    eos_token_ids,
    make_batches,
    reply_kept,
    reply_markers,
    stop_strings,
    stuck_error,
)
from .prefix_cache import PrefixCache
from .reasoning import detect_delimiters, reply_budget
from .requests import Delta, Done, Request
from .sampling import Sampling


def engine_refusal(loaded, settings):
    """Why the engine cannot generate with these settings (generate() then runs them), or None."""
    return settings_refusal(settings, getattr(loaded, "assistant_model", None) is not None)


def settings_refusal(settings, assistant: bool):
    """engine_refusal's reasons, known before the model loads (so loading picks the model generate() runs on)."""
    sampling = settings.temperature != 0
    reasons = [reason for reason, applies in (
        ("beam search (--num_beams)", settings.num_beams > 1),
        ("--typical_p", sampling and settings.typical_p is not None),
        ("--no_repeat_ngram_size", bool(settings.no_repeat_ngram_size)),
        ("--prompt_lookup_num_tokens", bool(settings.prompt_lookup_num_tokens)),
        ("--assistant_model", assistant),
        ("--generation_config keys " + ", ".join(sorted(set(settings.generation_config) - {"eos_token_id"})),
         bool(set(settings.generation_config) - {"eos_token_id"})),
    ) if applies]
    return ", ".join(reasons) or None


def check_thinking_budget(loaded, settings) -> None:
    """UsageError where --thinking_budget would cap nothing: a chat template without a thinking block, or settings
    only generate() runs (it has no such control)."""
    if detect_delimiters(loaded.tokenizer.chat_template) is None:
        raise UsageError("--thinking_budget: this model's chat template has no thinking block to cap")
    why = engine_refusal(loaded, settings)
    if why is not None:
        raise UsageError(f"--thinking_budget caps replies on the tool's engine; {why} runs them on generate(), "
                         "which has no such cap")


def open_engine(loaded, settings, batch_size, conversation=False):
    """An Engine for the command line's prompts or a session's turns, or None (logged) where generate() must run
    them. `conversation`: a prefix cache holds the turns before, as long as the context."""
    why = engine_refusal(loaded, settings)
    if why is None:
        try:
            # The memory generate() would take: no bound beyond the rows, no prefix cache for independent prompts.
            engine = Engine(loaded, max_batch=batch_size * settings.num_return_sequences, max_queue=sys.maxsize,
                            max_cache_tokens=sys.maxsize, prefix_cache_bytes=0,
                            eos_ids=eos_token_ids(settings, loaded.model))
        except ValueError as error:
            why = str(error)
        else:
            # (and a recurrent model's states: a turn leaves up to three entries of them, the first up to four)
            if conversation:
                positions = 2 * loaded.context if loaded.context else sys.maxsize // engine.bytes_per_token
                engine.prefix_cache = PrefixCache(positions * engine.bytes_per_token + 8 * engine.bytes_per_row)
            logger.info("KV cache in %s", engine.batch.kv.form)
            return engine
    logger.info("generating with generate(): %s", why)
    return None


def sampling_of(settings, seed):
    """The engine's Sampling for the command line's settings (greedy at temperature 0, as generate())."""
    if settings.temperature == 0:
        return Sampling(temperature=0, repetition_penalty=settings.repetition_penalty, seed=seed)
    return Sampling(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                    min_p=settings.min_p or 0.0, repetition_penalty=settings.repetition_penalty, seed=seed)


def run_prompts(engine, settings, prompts, on_done, stream=False, ctrl_c=None):
    """Generates every encoded prompt through `engine` on this thread, continuously batched; calls
    on_done(prompt, sequences) as each ends (an error sets prompt.error, no sequences). `stream`: to stdout.
    `ctrl_c` (rungen/interrupt.py): Ctrl-C ends the running prompts at the next step, as sequences with
    finish_reason "interrupted", and those not started with no sequences."""
    requests = submit_prompts(engine, settings, prompts, on_done, stream)
    with ctrl_c.catching(requests) if ctrl_c is not None else contextlib.nullcontext():
        try:
            engine.run_here()
        except ValueError as error:
            raise GenerationError(one_line(error)) from error


def prompt_seed(base: int, index: int) -> int:
    """The seed of the prompt at `index` of a run whose draw is `base`: numpy's SeedSequence of the two, so that
    neighbouring places get unrelated seeds (63 bits, as torch's generators take)."""
    return int(numpy.random.SeedSequence([base, index]).generate_state(1, numpy.uint64)[0]) >> 1


def submit_prompts(engine, settings, prompts, on_done, stream=False):
    """Queues the prompts as run_prompts does, without running them; returns their Requests. `stream` may be a
    function that takes the text as it grows instead of stdout (it then ends the line itself)."""
    tokenizer, context, eos_ids = engine.tokenizer, engine.loaded.context, engine.eos_ids
    stops = stop_strings(settings.stop_token)

    def collect(prompt):
        finishes, items = {}, collections.defaultdict(list)

        def sink(event):
            if isinstance(event, Delta):
                text = event.text
                items[event.index] += event.logprobs or []
                if callable(stream) and text:
                    stream(text)
                elif stream and text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
            elif isinstance(event, Done):
                finishes[event.index] = event.finish
            else:
                if stream is True:
                    sys.stdout.write("\n")
                on_done(prompt, sequences_of(prompt, finishes, items))

        return sink

    def sequences_of(prompt, finishes, items):
        sequences = []
        for index in sorted(finishes):
            finish = finishes[index]
            if finish.error is not None and finish.reason == "abort":  # cut short (out of GPU memory): its record
                prompt.error = finish.error
                return []
            try:
                if finish.error is not None and settings.constraint is not None:
                    raise stuck_error(settings, tokenizer, finish.tokens)
                described = describe_sequence(settings, tokenizer, prompt, finish.tokens, eos_ids)
            except StuckError as error:  # that prompt fails (an error record), the others go on
                prompt.error = str(error)
                return []
            if finish.reason == "abort":  # cancelled: Ctrl-C
                described.finish_reason = "interrupted"
            if settings.logprobs is not None:
                described.logprobs = {"content": items[index][: described.num_generated_tokens]}
            sequences.append(described)
        return sequences

    # Each prompt's seed from one draw and its place in the input, so a sampled text depends on neither the batch
    # nor the launched process that runs it (each draws the same, seeded alike); joined in make_batches' order.
    base = int(torch.randint(2**63 - 1, ()))
    seeds = {prompt.index: prompt_seed(base, prompt.index) for prompt in prompts}
    requests = []
    for prompt in [prompt for batch in make_batches(prompts, engine.max_batch) for prompt in batch]:
        new_tokens = settings.length if not context else min(settings.length, context - len(prompt.ids))
        requests.append(Request(prompt.ids, new_tokens, sampling_of(settings, seeds[prompt.index]),
                                collect(prompt), n=settings.num_return_sequences, stop=stops,
                                logprobs=settings.logprobs, constraint=prompt.constraint or settings.constraint,
                                reasoning_end=prompt.reply.end_ids if prompt.reply is not None else None,
                                reasoning_close=prompt.reply.text_close if prompt.reply is not None else "",
                                thinking_budget=reply_budget(engine.tokenizer, prompt.reply, settings.thinking_budget),
                                kept=reply_kept(engine.tokenizer, prompt),
                                markers=reply_markers(engine.tokenizer, prompt),
                                deltas=bool(stream)))
        engine.submit(requests[-1])
    return requests
