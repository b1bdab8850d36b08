"""Output: results to stdout in input order, as the original script's text blocks or as JSON lines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

from . import PROG
from .errors import GenerationError
from .generation import Sequence
from .prompts import RECORD_FIELDS, Prompt


class Writer:
    """Writes results in input order, flushing as soon as the next prompt in order is done."""

    def __init__(self, output_format: str, num_prompts: int, active: bool = True):
        self.jsonl, self.num_prompts = output_format == "jsonl", num_prompts
        self.next, self.done = 0, {}
        self.sequences, self.failed, self.tokens = [], 0, 0
        self.active = active  # only the main process writes

    def add(self, prompt: Prompt, sequences: list[Sequence] | tuple = (), streamed: bool = False) -> None:
        """A prompt's result: its Sequences, or its error (prompt.error); `streamed` if already printed."""
        if not self.active:
            return
        self.done[prompt.index] = (prompt, sequences, streamed)
        while self.next in self.done:
            self.write(*self.done.pop(self.next))
            self.next += 1
        sys.stdout.flush()

    @contextlib.contextmanager
    def finishing(self, prompts: list[Prompt]):
        """Where generation fails (GenerationError: the model's scores NaN, out of memory), each of `prompts` not
        written yet gets an error record saying so, the results held for input order with them; then it raises."""
        try:
            yield
        except GenerationError as error:
            for prompt in prompts:
                if prompt.index >= self.next and prompt.index not in self.done:
                    self.add(dataclasses.replace(prompt, error=f"not generated: {error}"))
            raise

    def write(self, prompt: Prompt, sequences: list[Sequence] | tuple, streamed: bool) -> None:
        if prompt.error is not None:
            self.failed += 1
            if self.jsonl:
                print(json.dumps(carrying({"prompt_index": prompt.index, "prompt": prompt.text,
                                           "error": prompt.error}, prompt.extra), ensure_ascii=False))
            else:
                print(f"{PROG}: prompt {prompt.index + 1}: error: {prompt.error}", file=sys.stderr, flush=True)
            return
        for number, sequence in enumerate(sequences):
            self.sequences.append(sequence.text)
            self.tokens += sequence.num_generated_tokens
            if self.jsonl:
                print(json.dumps(carrying({"prompt_index": prompt.index, "sequence_index": number,
                                           "prompt": prompt.text, **record_fields(sequence),
                                           **reply_fields(prompt, sequence.generated_text)}, prompt.extra),
                                 ensure_ascii=False))
            elif not streamed:  # the streamer has printed it already
                where = f"PROMPT {prompt.index + 1}, " if self.num_prompts > 1 else ""
                print(f"=== {where}GENERATED SEQUENCE {number + 1} ===")
                print(sequence.text)


def carrying(record: dict, extra: dict) -> dict:
    """The record and then the input line's other fields; never one named as a record's own, which would pass an
    error record off as a reply or as another line's (a line naming one is an error record saying so)."""
    return {**record, **{key: value for key, value in extra.items() if key not in record and key not in RECORD_FIELDS}}


def record_fields(sequence: Sequence) -> dict:
    """A Sequence's jsonl fields; optional ones (metadata omit_if_none, e.g. logprobs) only when set."""
    omitted = {field.name for field in dataclasses.fields(sequence) if field.metadata.get("omit_if_none")}
    return {key: value for key, value in dataclasses.asdict(sequence).items()
            if value is not None or key not in omitted}


def reply_fields(prompt: Prompt, text: str) -> dict:
    """A chat reply's fields beside the raw text: reasoning and content where the template thinks, content and
    tool calls where it may call tools."""
    fields = {}
    if prompt.reply is not None:
        from .reasoning import split_reply

        reasoning, text = split_reply(prompt.reply, text)
        fields = {"reasoning_content": reasoning, "content": text}
    if prompt.tool_plan is not None:
        from .tools import record_of

        fields.update(record_of(prompt.tool_plan, text or ""))
        if text is None and "content" in fields:  # a block and nothing after it: no content, as without tools
            fields["content"] = None
    return fields


def print_stream_header(prompt: Prompt, chat: bool) -> None:
    """The text block's header and the prompt, before the streamer prints the continuation."""
    print("=== GENERATED SEQUENCE 1 ===\n" + ("" if chat else prompt.text), end="", flush=True)
