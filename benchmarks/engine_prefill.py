"""The engine's prefill under load, paired in one process: 16 requests submitted at once (prompts of 23-63 tokens,
8 new tokens each, greedy) to the engine on the default model de-quantized (llama: fixed slots), with the requests
admitted together prefilled alone, together within the default tokens a pass (rungen/prefill.py), and together in
one pass; for each, the median and the last request's time to first token (from submission) and the whole run,
medians over the rounds (the first round left out), the modes alternating in each round. Also the batch's draw
(rungen/sampling.py's draw: one inverse-CDF pass for every row) against a multinomial a row from a generator of its
own, the sampler's former draw, on the default model's vocabulary; and the logits processors of rows that all ask
for every one (ignore_eos, logit_bias, repetition, presence and frequency penalties) with the chosen tokens counted,
a row at a time (the CPU's way) against all the rows at once (a GPU's): time and operators (each a kernel launch on
a GPU); and the sampler on the default model's own logits, its passes in float32 against float64.

    python -m benchmarks.engine_prefill [--rounds 7] [--only prefill|draw|processors|sampler]
"""

import argparse
import dataclasses
import random
import statistics
import time

import torch

from benchmarks.common import at_least, command, cpu_flags, load_float32


def prompts(tokenizer, count=16):
    texts = [f"Question {i}: " + f"Write a short note about the history of the number {i} and why people like it. "
             * (1 + i % 3) for i in range(count)]
    return [tokenizer(text).input_ids for text in texts]


def run_once(loaded, ids, together, pass_tokens):
    """(median first-token ms, last first-token ms, whole-run ms) of the ids submitted at once."""
    from rungen import admission
    from rungen import engine as engine_module
    from rungen.requests import Request
    from rungen.sampling import Sampling

    admission.pass_tokens = pass_tokens  # the name admission reads, imported from rungen.prefill
    engine = engine_module.Engine(loaded, max_batch=len(ids), prefix_cache_bytes=0)
    engine.batch.kv.prefills_together = together
    first = {}

    def sink_of(number):
        return lambda event: first.setdefault(number, time.perf_counter())

    start = time.perf_counter()
    for number, tokens in enumerate(ids):
        engine.submit(Request(tokens, max_tokens=8, sampling=Sampling(temperature=0, ignore_eos=True),
                              sink=sink_of(number)))
    engine.run_here()
    end = time.perf_counter()
    ttft = sorted((first[number] - start) * 1e3 for number in range(len(ids)))
    return statistics.median(ttft), ttft[-1], (end - start) * 1e3


def prefill_rows(loaded, rounds):
    from rungen import prefill

    ids = prompts(loaded.tokenizer)
    print(f"16 prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, 8 new tokens each")
    default = prefill.pass_tokens
    modes = {"alone": (False, default),
             f"together, {default(torch.device('cpu'))} tokens a pass (the CPU's default)": (True, default),
             "together, one pass": (True, lambda device: 1 << 20)}
    results = {name: [] for name in modes}
    names = list(modes)
    for number in range(rounds):
        for name in names if number % 2 else names[::-1]:
            results[name].append(run_once(loaded, ids, *modes[name]))
    print("| prefill | first token, median ms | first token, last ms | whole run ms |\n| --- | ---: | ---: | ---: |")
    for name, rows in results.items():
        rows = rows[1:]
        print(f"| {name} | {statistics.median(r[0] for r in rows):.0f} | {statistics.median(r[1] for r in rows):.0f} "
              f"| {statistics.median(r[2] for r in rows):.0f} |")


def draw_rows(vocab, repeats=40):
    from rungen.sampling import draw

    print("| rows | a multinomial a row, ms | one draw, ms | ratio |\n| ---: | ---: | ---: | ---: |")
    for rows in (1, 16, 64):
        probs = (torch.randn(rows, vocab, dtype=torch.float64) * 3).softmax(-1)
        peak = torch.zeros(rows)
        generators = [torch.Generator().manual_seed(row) for row in range(rows)]
        randoms = [random.Random(row) for row in range(rows)]
        old = new = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            torch.cat([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(generators)])
            old += time.perf_counter() - start
            start = time.perf_counter()
            draw(probs, peak, torch.tensor([r.random() for r in randoms], dtype=torch.float64))
            new += time.perf_counter() - start
        print(f"| {rows} | {old / repeats * 1e3:.2f} | {new / repeats * 1e3:.2f} | {old / new:.1f}x |")


def processor_rows(vocab, repeats=20):
    from rungen.sampling import RowState, Sampling, apply_each, apply_together, count_together

    sampling = Sampling(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                        logit_bias=((5, 2.0), (9, -1.0), (100, 1.5)), ignore_eos=True)

    def each(scores, states, tokens):
        apply_each(scores, states, [2])
        for number, state in enumerate(states):
            state.count(tokens[number : number + 1])

    def together(scores, states, tokens):
        apply_together(scores, states, [2])
        count_together(states, tokens)

    def operators(function, *args):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            function(*args)
        return sum(event.name.startswith("aten::") for event in profile.events())

    print("| rows | a row at a time (the CPU's), ms | operators | all rows at once (a GPU's), ms | operators |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for rows in (1, 16, 64):
        states = [RowState(sampling, list(range(0, 2000, 7)), vocab, torch.device("cpu")) for _ in range(rows)]
        scores, tokens = torch.randn(rows, vocab) * 3, torch.randint(vocab, (rows,))
        times = {each: 0.0, together: 0.0}
        for _ in range(repeats):
            for function in times:
                copy = scores.clone()
                start = time.perf_counter()
                function(copy, states, tokens)
                times[function] += time.perf_counter() - start
        print(f"| {rows} | {times[each] / repeats * 1e3:.2f} | {operators(each, scores.clone(), states, tokens)} | "
              f"{times[together] / repeats * 1e3:.2f} | {operators(together, scores.clone(), states, tokens)} |")


def sampler_rows(loaded, repeats=20):
    """The sampler (rungen/sampling.py's choose) on the default model's own logits (a story prompt's last 64
    positions), its passes after the temperature in float32 against float64."""
    from rungen import sampling
    from rungen.sampling import RowState, Sampling, choose

    def in_float64(rows, peak, temperature):  # apply_temperature in float64: every pass after it in float64 too
        return (rows - peak[:, None]).double() / temperature[:, None]

    ids = loaded.tokenizer("Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4,
                           return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = loaded.model(ids).logits[0, -64:].float()
    forms = {"float64": in_float64, "float32": sampling.apply_temperature}
    print("| settings | rows | float64, ms | float32, ms | ratio |\n| --- | ---: | ---: | ---: | ---: |")
    for label, setting in (("temperature 1, top-p 0.9 (the command line's defaults)", Sampling(top_p=0.9)),
                           ("temperature 0.7, top-k 50", Sampling(temperature=0.7, top_k=50)),
                           ("temperature 1", Sampling())):
        for rows in (1, 16, 64):
            states = [RowState(dataclasses.replace(setting, seed=n), [1], logits.shape[1], torch.device("cpu"))
                      for n in range(rows)]
            times = dict.fromkeys(forms, 0.0)
            for round_ in range(repeats + 2):
                for name in forms if round_ % 2 else list(forms)[::-1]:
                    sampling.apply_temperature = forms[name]
                    start = time.perf_counter()
                    choose(logits[:rows], states, [])
                    if round_ >= 2:
                        times[name] += time.perf_counter() - start
            sampling.apply_temperature = forms["float32"]
            old, new = times["float64"] / repeats * 1e3, times["float32"] / repeats * 1e3
            print(f"| {label} | {rows} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(2), default=7, help="the first of them is left out")
    parser.add_argument("--only", choices=["prefill", "draw", "processors", "sampler"], help="one table alone")
    args = parser.parse_args()
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    loaded = load_float32()
    if args.only in (None, "prefill"):
        prefill_rows(loaded, args.rounds)
    if args.only in (None, "draw"):
        draw_rows(loaded.vocab_size)
    if args.only in (None, "processors"):
        processor_rows(loaded.vocab_size)
    if args.only in (None, "sampler"):
        sampler_rows(loaded)


if __name__ == "__main__":
    command(main)
