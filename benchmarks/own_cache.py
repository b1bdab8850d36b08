"""The own model's cache, its forms paired in one process. By default, the sliding layers holding the window's last
positions against every position (RUN_GENERATION_RINGS=0): one request on the engine (a prompt of --prompt tokens of
benchmarks/passage.txt, --new greedy tokens) on a GGUF file with sliding layers (`python -m benchmarks.gguf_files
--write DIR --families gemma3` writes Gemma 3 1B's shape), the two forms alternating each round: the keys/values'
bytes held at the last token and at their peak over the decode steps (every layer's buffers, room included; the
prompt's pass holds every position of every layer in both forms), decode tokens/s (the first token to the last), and
whether both gave the same tokens. `--dtypes`: on any file the own model code runs (or transformers' layers over the
native attention: Gemma 4's, gpt-oss's), its keys and values in float16 (the default) against float32
(RUN_GENERATION_KV_FLOAT32=1): the bytes a position takes, the cache at the last
token, decode tokens/s, the prompt's tokens/s (in the engine's passes of 512) and the tokens the two forms share
before they part. `--passes`: the prompt through the model in one pass against passes of 512 and of 256 tokens (as
the engine's prefill takes it), into one cache: tokens/s, the cache's peak, and whether the last logits are the same
bits.

    python -m benchmarks.own_cache --model FILE [--prompt 1024] [--new 256] [--rounds 3] [--dtypes | --passes]
                                   [--isa avx2]
"""

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import at_least, command, cpu_flags
from benchmarks.gguf_files import set_isa

PASSAGE = os.path.join(os.path.dirname(__file__), "passage.txt")


def held_bytes(cache) -> int:
    """Bytes of every layer's buffers (room to grow included); 0 before the prompt's keys/values joined the batch."""
    if cache is None:
        return 0
    return sum(buffer.untyped_storage().nbytes() for layer in cache.layers
               if getattr(layer, "buffers", None) is not None for buffer in layer.buffers)


def run_once(loaded, ids, new_tokens):
    """(tokens, bytes held at the last token, peak bytes held, decode tokens/s, bytes a position takes) of one
    request."""
    from rungen.engine import Engine
    from rungen.requests import Delta, Done, Request
    from rungen.sampling import Sampling

    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    stamps, held, tokens = [], [], []

    def sink(event):
        if isinstance(event, Delta):  # a token's
            stamps.append(time.perf_counter())
            held.append(held_bytes(engine.batch.kv.cache))
        elif isinstance(event, Done):
            tokens.extend(event.finish.tokens)

    engine.submit(Request(ids, max_tokens=new_tokens, sampling=Sampling(temperature=0, ignore_eos=True), sink=sink))
    engine.run_here()
    return tokens, held[-1], max(held), (len(stamps) - 1) / (stamps[-1] - stamps[0]), engine.bytes_per_token


def passes_once(model, ids, step):
    """(seconds, the cache's peak bytes, the last logits) of the prompt `ids` in passes of `step` tokens."""
    from rungen.kvcache import new_cache

    cache, peak = new_cache(model), 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(ids), step):
            out = model(input_ids=torch.tensor([ids[first : first + step]]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            peak = max(peak, held_bytes(cache))
    return time.perf_counter() - start, peak, out.logits[0, -1]


def passes_rows(model, ids, rounds):
    steps = [len(ids), 512, 256]
    results = {step: [] for step in steps}
    for number in range(rounds):
        for step in steps if number % 2 == 0 else steps[::-1]:
            results[step].append(passes_once(model, ids, step))
    one = results[len(ids)][0][2]
    print("| prompt in | tokens/s (median) | cache's peak, MiB | last logits as one pass's |\n"
          "| --- | ---: | ---: | --- |")
    for step, rows in results.items():
        seconds = statistics.median(row[0] for row in rows)
        same = all(torch.equal(row[2], one) for row in rows)
        print(f"| {'one pass' if step == len(ids) else f'passes of {step}'} | {len(ids) / seconds:.0f} | "
              f"{rows[0][1] / 2**20:.0f} | {'the same bits' if same else 'DIFFERENT'} |")


def shared_start(a, b) -> int:
    """How many tokens two lists share before they part."""
    return next((index for index, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def dtype_rows(loaded, ids, new_tokens, rounds):
    from rungen.kvcache import KV_FLOAT32_ENV
    from rungen.prefill import OWN_PASS

    forms = {"float16": "0", f"float32 ({KV_FLOAT32_ENV}=1)": "1"}
    results = {name: [] for name in forms}
    for number in range(rounds):
        for name in forms if number % 2 == 0 else list(forms)[::-1]:
            os.environ[KV_FLOAT32_ENV] = forms[name]
            seconds = passes_once(loaded.model, ids, OWN_PASS)[0]
            results[name].append((*run_once(loaded, ids, new_tokens), len(ids) / seconds))
    print("| cache holds | a position, KiB | cache at the last token, MiB | decode tokens/s (median) | "
          "prompt tokens/s (median) |\n| --- | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        _, last, _, _, position, _ = rows[-1]
        print(f"| {name} | {position / 1024:.1f} | {last / 2**20:.1f} | "
              f"{statistics.median(row[3] for row in rows):.2f} | {statistics.median(row[5] for row in rows):.0f} |")
    half, full = (rows[0][0] for rows in results.values())
    print(f"tokens shared before the forms part: {shared_start(half, full)} of {len(full)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file with sliding layers")
    parser.add_argument("--prompt", type=at_least(1), default=1024, help="prompt tokens")
    parser.add_argument("--new", type=at_least(2), default=256, help="new tokens")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dtypes", action="store_true", help="a float16 cache against a float32 one instead")
    mode.add_argument("--passes", action="store_true", help="the prompt in one pass against passes instead")
    parser.add_argument("--isa", choices=("amx", "avx512vnni", "avx2", "scalar"),
                        help="the tool's kernel path (default: the best the CPU has); avx2 needs "
                        "ATEN_CPU_CAPABILITY=avx2 in the environment")
    args = parser.parse_args()
    from rungen.loading import load

    if args.isa:
        set_isa(args.isa)
    loaded = load(args.model, device=torch.device("cpu"))
    if not hasattr(loaded.model, "windows"):  # a file's first load: transformers' model, writing the weights map
        del loaded
        loaded = load(args.model, device=torch.device("cpu"))
    # (--dtypes: transformers' layers too where their attention is the native one, Gemma 4's and gpt-oss's files)
    if not hasattr(loaded.model, "windows") and not (args.dtypes and getattr(loaded.model, "cache_reads_float16",
                                                                               False)):
        raise SystemExit(f"{args.model}: not on the own model code")
    windows = getattr(loaded.model, "windows", None) or [0] * loaded.model.config.num_hidden_layers
    with open(PASSAGE) as f:
        text = f.read()
    ids = loaded.tokenizer.encode(text)
    ids = (ids * (args.prompt // len(ids) + 1))[: args.prompt]
    isa = torch.ops.rungen_ggml.isa()
    sliding = f"{sum(map(bool, windows))} sliding (window {max(windows)})" if any(windows) else "none sliding"
    if not hasattr(loaded.model, "windows"):
        sliding = "transformers' layers (each holding every position)"
    print(f"CPU flags: {cpu_flags()}; kernel path {isa}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {os.path.basename(args.model)}: {len(windows)} layers, {sliding}; a {len(ids)}-token prompt, "
          f"{args.new} new tokens, {args.rounds} paired rounds")
    if args.passes:
        passes_rows(loaded.model, ids, args.rounds)
        return
    if args.dtypes:
        dtype_rows(loaded, ids, args.new, args.rounds)
        return
    if not any(windows):
        raise SystemExit(f"{args.model}: no sliding layer")
    forms = {"the window's last positions": "1", "every position (RUN_GENERATION_RINGS=0)": "0"}
    results = {name: [] for name in forms}
    for number in range(args.rounds):
        for name in forms if number % 2 == 0 else list(forms)[::-1]:
            os.environ["RUN_GENERATION_RINGS"] = forms[name]
            results[name].append(run_once(loaded, ids, args.new))
    same = len({tuple(tokens) for rows in results.values() for tokens, *_ in rows}) == 1
    print("| sliding layers hold | cache at the last token, MiB | peak, MiB | decode tokens/s (median) |\n"
          "| --- | ---: | ---: | ---: |")
    for name, rows in results.items():
        _, last, peak, *_ = rows[-1]
        speed = statistics.median(row[3] for row in rows)
        print(f"| {name} | {last / 2**20:.1f} | {peak / 2**20:.1f} | {speed:.2f} |")
    print(f"same tokens: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    command(main)
