"""Per-token decode latency of the default model with and without --jit, in one process.

    python -m benchmarks.jit_decode [--model DIR] [--new-tokens 64]
        [--repeats 5] [--threads N] [--compile] [--profile]

The machine is shared and noisy, so the modes are interleaved (eager, jit, eager, jit, ...) and
each figure is a median over repeats; only ratios taken in this one run are comparable. Decode
latency is timed inside generate (a logits processor stamps every step), so it includes
generate's own per-step work but neither the prompt's pass (reported as prefill) nor tracing.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LogitsProcessorList

from benchmarks.common import StepClock, at_least, command, cpu_flags, load_float32
from rungen.jit import enable_jit

PROMPT = "Once upon a time, in a small village by the sea,"


def timed_generate(model, enc, new_tokens):
    clock = StepClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]))
    if len(clock.stamps) != new_tokens:  # stopped at EOS: the modes would not be comparable
        raise RuntimeError(f"generation stopped after {len(clock.stamps)} tokens; use another prompt")
    prefill = clock.stamps[0] - start
    per_token = (clock.stamps[-1] - clock.stamps[0]) / max(len(clock.stamps) - 1, 1)
    return out, prefill, per_token


def compile_kwargs():
    """generate's own torch.compile path: static cache, decode steps compiled (forced on CPU)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


class Mode:
    """A way of running generate on the shared model: switches the instance forward in and out."""

    def __init__(self, name, forward=None, generate_kwargs=None):
        self.name, self.forward, self.kwargs = name, forward, generate_kwargs or {}
        self.prefill, self.per_token, self.tokens = [], [], None

    def run(self, model, enc, new_tokens):
        model.__dict__.pop("forward", None)
        if self.forward is not None:
            model.forward = self.forward
        out, prefill, per_token = timed_generate(model, {**enc, **self.kwargs}, new_tokens)
        self.prefill.append(prefill)
        self.per_token.append(per_token)
        self.tokens = out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tool's default model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="also measure --compile")
    parser.add_argument("--profile", action="store_true", help="print where decode time goes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_float32(args.model)  # the tool's load(): the default model de-quantized when no path is given
    tokenizer, model = loaded.tokenizer, loaded.model
    enc = tokenizer([PROMPT], return_tensors="pt")

    modes = [Mode("eager")]
    setup = {"eager": 0.0}
    setup["jit"] = enable_jit(model, tokenizer)
    modes.append(Mode("jit", model.__dict__.pop("forward")))
    if args.compile:
        modes.append(Mode("compile", None, compile_kwargs()))

    for mode in modes:  # warm-up: first-call allocations; compile's graphs (same shapes as measured)
        start = time.perf_counter()
        mode.run(model, enc, args.new_tokens)
        if mode.name == "compile":
            setup["compile"] = time.perf_counter() - start
        mode.prefill.clear(), mode.per_token.clear()
    for _ in range(args.repeats):
        for mode in modes:
            mode.run(model, enc, args.new_tokens)

    eager = modes[0]
    med = statistics.median
    rows = []
    for mode in modes:
        same = torch.equal(mode.tokens, eager.tokens)
        rows.append((mode.name, med(mode.per_token) * 1e3, med(eager.per_token) / med(mode.per_token),
                     med(mode.prefill) * 1e3, setup[mode.name], same))
    header = (f"model {args.model or 'SmolLM2-135M-Instruct (the default, de-quantized)'}, {args.new_tokens} new "
              f"tokens, greedy, batch 1, median of {args.repeats}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, CPU flags {cpu_flags()}")
    table = ["| mode | decode ms/token | speed-up vs eager | prefill ms | tracing/compile s | same tokens |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    table += [f"| {n} | {t:.1f} | {r:.2f}x | {p:.1f} | {s:.1f} | {'yes' if same else 'NO'} |"
              for n, t, r, p, s, same in rows]
    print(header)
    print("\n".join(table))
    if args.profile:
        print("\n".join(profile_modes(model, enc, modes[:2])))


CATEGORIES = (  # operator name -> where decode time goes
    ("matmul (linear layers, lm_head)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention (sdpa)", ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::baddbmm",
                          "aten::_softmax")),
    ("kv cache growth (cat/copy)", ("aten::cat", "aten::copy_", "aten::index_copy_")),
)


def op_times(model, enc, mode, new_tokens):
    """Self time (s) per operator over one generate call, and the call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        mode.run(model, enc, new_tokens)
        wall = time.perf_counter() - start
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}, wall


def profile_modes(model, enc, modes, new_tokens=33, repeats=3):
    """Per decode token: time in each operator category, and between operators (Python: generate's
    loop and the HF modules' code; or the TorchScript runtime). Decode = a long run minus a
    prefill-only run, so the prompt's pass is not counted. Median of `repeats` interleaved runs."""
    rows = {mode.name: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            short, wall_short = op_times(model, enc, mode, 1)
            long, wall_long = op_times(model, enc, mode, new_tokens)
            per_op = {k: (long.get(k, 0) - short.get(k, 0)) * 1e3 / (new_tokens - 1) for k in long}
            row = {name: sum(per_op.get(op, 0) for op in ops) for name, ops in CATEGORIES}
            aten = sum(v for k, v in per_op.items() if k.startswith("aten::"))
            row["other aten ops (norms, rotary, residuals, views...)"] = aten - sum(row.values())
            row["total"] = (wall_long - wall_short) * 1e3 / (new_tokens - 1)
            row["between ops (Python, TorchScript runtime)"] = row["total"] - aten
            rows[mode.name].append(row)
    names = [name for name, _ in CATEGORIES] + ["other aten ops (norms, rotary, residuals, views...)",
                                              "between ops (Python, TorchScript runtime)", "total"]
    lines = [f"where one decode step's time goes: ms/token under torch.profiler, {new_tokens - 1} decode steps, "
             f"median of {repeats}", "",
             "| category | " + " | ".join(m.name for m in modes) + " |", "| --- |" + " ---: |" * len(modes)]
    for name in names:
        cells = [statistics.median(r[name] for r in rows[m.name]) for m in modes]
        lines.append(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return [""] + lines


if __name__ == "__main__":
    command(main)
