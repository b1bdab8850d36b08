"""Prompt lookup decoding (--prompt_lookup_num_tokens) against plain greedy decoding, on the default model.

    python -m benchmarks.prompt_lookup [--model DIR] [--new-tokens 128] [--lookup 3 10] [--repeats 3] [--threads N]

Two tasks: an input-grounded one (copy a fixed passage, benchmarks/passage.txt, through the chat template:
the output repeats the input, where prompt lookup drafts well) and a free-form one (where it rarely
drafts, to show its overhead). Generation runs through the tool's own path (rungen: load, encode_prompt,
generate_batch), one prompt at a time, greedy. The machine is shared and noisy, so the modes are
interleaved (prefill, greedy, lookup N..., prefill, greedy, ...) after a warm-up, and every figure is a
median over repeats. tokens/s counts generated tokens over the whole generate_batch call (the prompt's
prefill included); "decode-only" takes off the median time of a one-token generation (the prefill).
"""

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import at_least, command, cpu_flags, load_float32
from rungen.generation import Settings, generate_batch
from rungen.prompts import Prompt, encode_prompt

PASSAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "passage.txt")


def tasks():
    passage = " ".join(open(PASSAGE).read().split())
    return {
        "copy the passage (input-grounded)": "Copy the following text exactly, word for word: " + passage,
        "free-form story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tool's default model")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=int, nargs="+", default=[3, 10], help="--prompt_lookup_num_tokens values")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_float32(args.model)
    greedy = Settings(length=args.new_tokens, temperature=0, chat=True)
    modes = {"prefill": dataclasses.replace(greedy, length=1), "greedy": greedy}
    modes.update({n: dataclasses.replace(greedy, prompt_lookup_num_tokens=n) for n in args.lookup})

    rows = []
    for task, text in tasks().items():
        prompt = Prompt(0, text)
        prompt.ids = encode_prompt(loaded, prompt, chat=True)
        seconds, tokens, texts = {m: [] for m in modes}, {}, {}
        for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
            for mode, settings in modes.items():
                start = time.perf_counter()
                [sequence] = generate_batch(loaded, settings, [prompt])[0]
                elapsed = time.perf_counter() - start
                if repeat:
                    seconds[mode].append(elapsed)
                tokens[mode], texts[mode] = sequence.num_generated_tokens, sequence.generated_text
        median = {m: statistics.median(seconds[m]) for m in modes}
        prefill = median["prefill"]
        for n in args.lookup:
            same = texts[n] == texts["greedy"] and tokens[n] == tokens["greedy"]
            rate = {m: tokens[m] / median[m] for m in ("greedy", n)}
            decode = {m: (tokens[m] - 1) / (median[m] - prefill) for m in ("greedy", n)}
            rows.append((task, len(prompt.ids), tokens["greedy"], prefill, n, rate["greedy"], rate[n],
                         decode[n] / decode["greedy"], same))

    print(f"default model (SmolLM2-135M-Instruct, float32) unless --model; greedy, batch 1, chat template, "
          f"median of {args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"CPU flags: {cpu_flags()}")
    print()
    print("| task | prompt tokens | new tokens | prefill s | N | greedy tokens/s | lookup tokens/s | speed-up "
          "| decode-only speed-up | same text |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for task, prompt_tokens, new, prefill, n, plain, lookup, decode, same in rows:
        print(f"| {task} | {prompt_tokens} | {new} | {prefill:.2f} | {n} | {plain:.1f} | {lookup:.1f} | "
              f"{lookup / plain:.2f}x | {decode:.2f}x | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    command(main)
