"""Whole-process time of a default-model run against the import floor, and where the difference goes.

    python -m benchmarks.startup [--runs 5] [--first_runs 3]

Rows (each a median over runs, whole processes): the floor, `import torch, transformers` plus the
llama modeling module, which any tool running this model pays; a cached 1-token run of the tool
(`--prompt "The capital of France is" --temperature 0 --length 1`) and the same with 20 tokens;
a first run, which converts the GGUF file into a fresh cache. Then, in this process after the floor's
imports, the stages of a cached 1-token run, timed one by one.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = [sys.executable, os.path.join(ROOT, "run_generation.py"), "--prompt", "The capital of France is",
        "--temperature", "0"]
FLOOR = [sys.executable, "-c", "import torch, transformers, transformers.models.llama.modeling_llama"]


def timed(command, cache_home):
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True,
                   env=dict(os.environ, XDG_CACHE_HOME=cache_home, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - start


def stages(cache_home):
    """Seconds of each stage of a cached 1-token run, in this process (imports already paid)."""
    os.environ.update(XDG_CACHE_HOME=cache_home, HF_HUB_OFFLINE="1")
    clock = [time.perf_counter()]
    out = {}

    def lap(name):
        clock.append(time.perf_counter())
        out[name] = clock[-1] - clock[-2]

    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    lap("floor imports (in process)")
    import run_generation  # noqa: F401
    from rungen.loading import default_model_dir

    lap("the tool's own imports")
    path = default_model_dir()
    config = transformers.AutoConfig.from_pretrained(path)
    lap("config")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    lap("tokenizer")
    from transformers import conversion_mapping

    conversion_mapping._build_checkpoint_conversion_mapping()  # what from_pretrained builds first
    lap("  of which: transformers' weight-renaming table (all model types)")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config).eval()
    lap("model (from_pretrained)")
    with torch.inference_mode():
        model.generate(**tokenizer(["The capital of France is"], return_tensors="pt"), max_new_tokens=1,
                       do_sample=False)
    lap("1-token generate (first forward)")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--first_runs", type=int, default=3)
    args = parser.parse_args()

    rows = {"floor: import torch, transformers, llama modeling": [], "tool, cached, 1 token": [],
            "tool, cached, 20 tokens": [], "tool, first run (converts GGUF)": []}
    for _ in range(args.first_runs):
        with tempfile.TemporaryDirectory() as cache_home:
            rows["tool, first run (converts GGUF)"].append(timed(TOOL + ["--length", "20"], cache_home))
    with tempfile.TemporaryDirectory() as cache_home:
        timed(TOOL + ["--length", "1"], cache_home)  # builds the cache
        for _ in range(args.runs):  # interleaved: the machine's load drifts
            rows["floor: import torch, transformers, llama modeling"].append(timed(FLOOR, cache_home))
            rows["tool, cached, 1 token"].append(timed(TOOL + ["--length", "1"], cache_home))
            rows["tool, cached, 20 tokens"].append(timed(TOOL + ["--length", "20"], cache_home))
        parts = stages(cache_home)
    med = {name: statistics.median(times) for name, times in rows.items()}
    print("| run | median s | all runs s |\n|---|---:|---|")
    for name, times in rows.items():
        print(f"| {name} | {med[name]:.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    floor = med["floor: import torch, transformers, llama modeling"]
    print(f"\ncached 1-token run minus the floor: {med['tool, cached, 1 token'] - floor:.2f} s\n")
    print("| stage of a cached 1-token run (one process) | s |\n|---|---:|")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
