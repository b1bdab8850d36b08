"""Constrained output (--json_schema) on the default model: how many replies are schema-valid JSON with and
without the constraint, and what the constraint costs per generated token at batch 1 and batch 16.

    python -m benchmarks.constrained [--model DIR] [--new-tokens 96] [--batch1-prompts 4] [--threads N]

16 chat prompts ask for a JSON record of a person (name, age, city); the schema bounds each field. Greedy
decoding, through the tool's own path (rungen: load, compile_constraint, encode_prompt, generate_batch).
Overhead: the time spent inside the grammar's logits processor and stopping criterion (xgrammar's mask
fill and apply, our state bookkeeping), timed in the run, over the rest of the generate time: the extra
fraction a step costs. End-to-end tokens/s of both runs are printed beside it (their lengths differ).
"""

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import command, cpu_flags, load_float32
from rungen import constrain
from rungen.generation import Settings, eos_token_ids, generate_batch
from rungen.prompts import Prompt, encode_prompt

CITIES = ["Paris", "London", "Tokyo", "Zürich", "New York"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": CITIES},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = ["a retired teacher", "a young painter", "a chef", "a taxi driver", "a nurse", "a student",
          "a violinist", "a bookseller", "a carpenter", "a pilot", "a gardener", "a journalist",
          "a baker", "a software engineer", "a fisherman", "an architect"]


def request(person):
    return (f"Reply with only a JSON object with the keys name, age and city, describing {person} who lives in "
            f"one of: {', '.join(CITIES)}.")


def valid(text):
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["name"], str)
            and len(value["name"]) <= 30 and type(value["age"]) is int and 0 <= value["age"] <= 120
            and value["city"] in CITIES)


class GrammarClock:
    """Adds up the time spent in the grammar's processor and stopping criterion."""

    def __init__(self):
        self.seconds = 0.0
        for cls in (constrain.GrammarLogitsProcessor, constrain.GrammarStop):
            cls.__call__ = self.timed(cls.__call__)

    def timed(self, call):
        def wrapper(instance, *args, **kwargs):
            start = time.perf_counter()
            try:
                return call(instance, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def run(loaded, settings, prompts, batch_size, clock):
    clock.seconds = 0.0
    start = time.perf_counter()
    sequences = []
    for offset in range(0, len(prompts), batch_size):
        batch = prompts[offset : offset + batch_size]
        results = generate_batch(loaded, settings, batch)
        sequences += [sequence for prompt in batch for sequence in results[prompt.index]]
    seconds = time.perf_counter() - start
    return sequences, seconds, clock.seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tool's default model")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one at a time for batch 1")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_float32(args.model)
    free = Settings(length=args.new_tokens, temperature=0, chat=True)
    start = time.perf_counter()
    constraint = constrain.compile_constraint("json_schema", json.dumps(SCHEMA), loaded.tokenizer, loaded.vocab_size,
                                              eos_token_ids(free, loaded.model))
    compile_seconds = time.perf_counter() - start
    constrained = dataclasses.replace(free, constraint=constraint)
    prompts = []
    for index, person in enumerate(PEOPLE):
        prompt = Prompt(index, request(person))
        prompt.ids = encode_prompt(loaded, prompt, chat=True)
        prompts.append(prompt)
    clock = GrammarClock()
    generate_batch(loaded, constrained, prompts[:1])  # warm-up

    print(f"default model (SmolLM2-135M-Instruct, float32) unless --model; greedy, chat template, "
          f"{args.new_tokens} new tokens at most; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"CPU flags: {cpu_flags()}; schema compiled in {compile_seconds * 1000:.0f} ms")
    print()
    print("| batch | prompts | mode | valid JSON | finished | tokens | tokens/s | grammar s | overhead per token |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch_size, count in ((1, args.batch1_prompts), (16, len(prompts))):
        for mode, settings in (("free", free), ("--json_schema", constrained)):
            sequences, seconds, grammar = run(loaded, settings, prompts[:count], batch_size, clock)
            tokens = sum(sequence.num_generated_tokens for sequence in sequences)
            ok = sum(valid(sequence.generated_text) for sequence in sequences)
            finished = sum(sequence.finish_reason != "length" for sequence in sequences)
            overhead = f"{grammar / (seconds - grammar) * 100:.1f} %" if settings.constraint else "-"
            print(f"| {batch_size} | {count} | {mode} | {ok}/{count} | {finished}/{count} | {tokens} | "
                  f"{tokens / seconds:.1f} | {grammar:.2f} | {overhead} |", flush=True)
            if batch_size == 16 and os.environ.get("SHOW"):
                for sequence in sequences:
                    print("   ", repr(sequence.generated_text[:120]), file=sys.stderr)


if __name__ == "__main__":
    command(main)
