"""Where a decode step's time goes on a GPU: the engine's step for a shape, its kernels and their time.

    python -m benchmarks.gpu_step [--shapes llama-3.2-1b llama-3.1-8b] [--rows 1] [--json FILE]
    python -m benchmarks.gpu_step --quick --device cpu      # the script's own check: tiny shapes, the CPU's operators

For each shape (benchmarks/gpu.py's, random weights built on the device) a decode step over slots holding `--position`
positions a row is timed replayed from a CUDA graph, as the engine runs it, and eagerly (CUDA events, the median of
--repeats), beside its bound (the weights a step reads over the measured copy bandwidth). Then the eager step under
torch.profiler: the kernels a step launches (a layer's share), and their time summed by kind (matrix products,
attention, the rest) and by name (the most costly first). The time past the bound splits there into the products' own
time past their bytes and the small kernels between them: what to fuse first.
Each shape twice: the step through transformers' modules (rungen.slots.decode_step), and the engine's fused layers
(rungen/fused_step.py, the default on a GPU: Triton's kernels where it imports). Kernel time is measured eagerly,
where each launch also waits on the host; the graph's replay leaves only the kernels and their gaps.
"""

import argparse
import json
import statistics
import sys

import torch

from benchmarks.gpu import QUICK_SHAPES, SHAPES, build_model, copy_bandwidth, make_config, one_line, weight_bytes
from rungen.fused_step import FusedStep
from rungen.slots import DecodeGraphs, SlotCache, decode_step
from rungen.step_kernels import TORCH, triton_kernels

PRODUCTS = ("gemm", "gemv", "cutlass", "xmma", "splitk", "sm90_", "sm80_", "linear", "addmm", "mm")
ATTENTION = ("fmha", "flash", "attention", "sdpa")


def kind(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ATTENTION):
        return "attention"
    return "products" if any(word in lowered for word in PRODUCTS) else "other"


def timed_ms(step, device, repeats: int) -> float:
    """The median time of `step()` in ms: CUDA events around each call on a GPU, the host's clock elsewhere."""
    import time

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


# Operators that launch no kernel of their own (views, allocations, dispatch to another operator).
NO_KERNEL = {f"aten::{name}" for name in (
    "view", "as_strided", "empty", "empty_strided", "alias", "_unsafe_view", "reshape", "expand", "t", "transpose",
    "unsqueeze", "slice", "select", "detach", "to", "_reshape_alias", "resolve_conj", "linear", "matmul", "contiguous",
    "scaled_dot_product_attention", "lift_fresh")}


def kernels(profile, device) -> list[tuple[str, float]]:
    """(name, µs) of each kernel the profile saw: CUDA's kernels on a GPU; elsewhere the CPU's operators that compute
    (their own time; an operator calling another counts apart from it)."""
    if device.type == "cuda":
        return [(event.name, event.time_range.elapsed_us()) for event in profile.events()
                if event.device_type == torch.autograd.DeviceType.CUDA]
    return [(event.name, event.self_cpu_time_total) for event in profile.events()
            if event.name.startswith("aten::") and event.name not in NO_KERNEL]


def step_row(name, args, shapes, bandwidth, fused=False) -> dict:
    config = make_config(name, shapes)
    model = build_model(config, args.device, args.dtype)
    step = decode_step
    if fused:
        step = FusedStep(model, (triton_kernels() if args.device.type == "cuda" else None) or TORCH)
        step.checked = True  # (timed as it is, not against transformers' step)
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = SlotCache(config.num_hidden_layers, args.rows, args.position + 64)
    like = [(torch.zeros(1, heads, 1, head_dim, dtype=args.dtype, device=args.device),) * 2
            for _ in range(config.num_hidden_layers)]
    cache.ensure(args.rows, args.position + 64, like)
    cache.rows = args.rows
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.vocab_size - 2, (args.rows, 1), generator=generator).to(args.device)
    positions = torch.full((args.rows,), args.position, device=args.device)
    length = cache.step_length(args.position)
    row = dict(shape=name + (", fused layers" if fused else ""), rows=args.rows, position=args.position,
               layers=config.num_hidden_layers,
               weights_gb=weight_bytes(model) / 1e9)
    if bandwidth:
        row["bound_ms"] = weight_bytes(model) / (bandwidth * 1e9) * 1e3
    with torch.inference_mode():
        def eager():
            step(model, cache, tokens, positions, length)

        eager()
        row["eager_ms"] = timed_ms(eager, args.device, args.repeats)
        if args.device.type == "cuda":
            graphs = DecodeGraphs(model, cache, step=step)
            graphs(tokens, positions, args.position)
            row["graph_ms"] = timed_ms(lambda: graphs(tokens, positions, args.position), args.device, args.repeats)
            row["graph_failed"] = graphs.failed
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if args.device.type == "cuda" else [ProfilerActivity.CPU]
        try:
            with profile(activities=activities) as seen:
                for _ in range(args.profiled):
                    eager()
                if args.device.type == "cuda":
                    torch.cuda.synchronize()
        except Exception as error:  # (a GPU the CPU plays has no profiler): the timings stand alone
            row["profile_error"] = one_line(error)
            return row
    found = kernels(seen, args.device)
    if not found:
        row["profile_error"] = "the profile holds no kernel"
        return row
    by_name, by_kind = {}, {}
    for kernel, us in found:
        count, total = by_name.get(kernel, (0, 0.0))
        by_name[kernel] = (count + 1, total + us)
        by_kind[kind(kernel)] = by_kind.get(kind(kernel), 0.0) + us
    row["kernels_a_step"] = len(found) / args.profiled
    row["kernels_a_layer"] = row["kernels_a_step"] / config.num_hidden_layers
    row["kernel_ms_by_kind"] = {key: value / args.profiled / 1e3 for key, value in sorted(by_kind.items())}
    row["top"] = [dict(name=kernel[:90], a_step=count / args.profiled, ms_a_step=total / args.profiled / 1e3)
                  for kernel, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:args.top]]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", help=f"of {', '.join(SHAPES)} (default: llama-3.2-1b llama-3.1-8b)")
    parser.add_argument("--rows", type=int, default=1, help="rows a step decodes (default 1)")
    parser.add_argument("--position", type=int, default=64, help="positions each row holds (default 64)")
    parser.add_argument("--repeats", type=int, default=50, help="timed steps, their median (default 50)")
    parser.add_argument("--profiled", type=int, default=5, help="eager steps profiled (default 5)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by time (default 15)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the script's own check)")
    parser.add_argument("--json", metavar="FILE", help="every figure as JSON")
    args = parser.parse_args(argv)
    args.device, args.dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    args.shapes = args.shapes or (list(QUICK_SHAPES) if args.quick else ["llama-3.2-1b", "llama-3.1-8b"])
    if args.quick:
        args.repeats, args.profiled = min(args.repeats, 5), min(args.profiled, 2)
    bandwidth = None
    if args.device.type == "cuda":
        bandwidth = copy_bandwidth(args.device, int(0.1e9 if args.quick else 2e9))
        print(f"{torch.cuda.get_device_name(0)}, copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    for name in args.shapes:
        for fused in (False, True):
            try:
                row = step_row(name, args, shapes, bandwidth, fused)
            except Exception as error:  # one shape's failure is its line
                row = dict(shape=name + (", fused layers" if fused else ""), error=one_line(error))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(device=str(args.device), bandwidth_gb_s=bandwidth, rows=rows), f, indent=1)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n| shape | rows | bound ms | graph ms | eager ms | kernels a layer | products ms | attention ms | "
          "other ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        if "error" in row:
            print(f"| {row['shape']} | error: {row['error']} |")
            continue
        spent = row.get("kernel_ms_by_kind", {})
        print(f"| {row['shape']} | {row['rows']} | {row.get('bound_ms', 0):.3f} | {row.get('graph_ms', 0):.3f} | "
              f"{row['eager_ms']:.3f} | {row.get('kernels_a_layer', 0):.1f} | {spent.get('products', 0):.3f} | "
              f"{spent.get('attention', 0):.3f} | {spent.get('other', 0):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
