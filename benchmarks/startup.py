"""A cached one-shot run of the default model, whole process, against the torch floor and llama-cpp-python;
then where its time goes, stage by stage.

    python -m benchmarks.startup [--runs 3] [--length 16] [--llama-python /work/bench-venv/bin/python]

Whole processes, interleaved round by round (the host's load drifts), each row a median over the rounds of
wall time, CPU time (user + system: steadier than wall time on a shared host, since start-up is one thread)
and peak RSS, as /usr/bin/time reports them:

- `import torch`: the floor of any tool on torch;
- `import torch, tokenizers, jinja2, gguf`: what the tool's GGUF path imports above torch (rungen/gguf/model.py's
  model code, rungen/gguf/tokenizer.py's tokenizer on the tokenizers library, chat templates by jinja2, the file's
  constants); no transformers;
- `... transformers (its top level)`: what a path taking transformers' config, tokenizer and cache classes would
  import (a safetensors checkpoint, generate());
- `... transformers' llama modeling`: what a GGUF path through transformers' model classes would import;
- the tool: `run_generation.py --prompt "The capital of France is" --temperature 0 --length 16` (cached
  header and kernels, default output);
- llama-cpp-python on the same GGUF file, the same prompt and 16 greedy tokens, where that virtualenv has it.

"minus torch" is the median of each round's difference with that round's `import torch`. Then one fresh
process of each runs the stages one by one and reports the seconds of each; the tool's stages are the
library calls main() makes, in its order.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import cpu_flags, has_llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
FLOORS = {
    "import torch": "import torch",
    "import torch, tokenizers, jinja2, gguf": "import torch, tokenizers, jinja2, gguf",
    "... + transformers (its top level)": "import torch, tokenizers, jinja2, gguf, transformers",
    "... + transformers' llama modeling": "import torch, tokenizers, jinja2, gguf, transformers.models.llama."
                                          "modeling_llama; from transformers import AutoConfig, AutoTokenizer",
}

# What both stage scripts start with: lap() times each stage as it ends.
LAPS = r"""
import json, sys, time
clock, cpu_clock, out = [time.perf_counter()], [time.process_time()], {}

def lap(name):  # (wall s, CPU s of this process) since the last lap
    clock.append(time.perf_counter())
    cpu_clock.append(time.process_time())
    out[name] = (clock[-1] - clock[-2], cpu_clock[-1] - cpu_clock[-2])
"""

# The tool's stages in a fresh process, as main() runs them (its imports split from torch's and the libraries').
TOOL_STAGES = LAPS + r"""
import torch
lap("import torch")
import gguf, jinja2, numpy, tokenizers
lap("import tokenizers, jinja2, gguf")
import run_generation
from rungen.gguf import model as gguf_model
from rungen.arguments import parse_args, settings_from_args
from rungen.batch import open_engine, submit_prompts
from rungen.gguf import GGUFHeader, native_kernels
from rungen.loading import default_model_file, finish
from rungen.prompts import encode_prompt, prepare_model, read_prompts
lap("import the tool's own modules")
import gc
gc.freeze()  # as run_generation.command() does: the run's collections skip what the imports made
args = parse_args(sys.argv[1:])
lap("parse the arguments")
header = GGUFHeader(default_model_file())
config, weights_map = gguf_model.read_config(header.cache_dir), header.cached_weights_map()
lap("header from its cache: config, tensor table, weights map")
tokenizer = header.tokenizer
lap("tokenizer (tokenizer.json, by the tokenizers library; rungen/gguf/tokenizer.py)")
native_kernels()
lap("load the native kernels (built and cached)")
cpu = torch.device("cpu")
assert gguf_model.refusal(config, header, weights_map) is None
model = gguf_model.build(header, config, weights_map)
loaded = finish(model, tokenizer, config.model_type, cpu)
lap("model build (rungen/gguf/model.py): weights read and interleaved, q/k/v and gate/up joined")
settings = settings_from_args(args, loaded.context)
prepare_model(loaded, temperature=args.temperature, xlm_language=args.xlm_language)
[prompt] = read_prompts(args.prompt, whole_stdin=False, input_format="text")
prompt.ids = encode_prompt(loaded, prompt, args.prefix, settings.chat, args.system)
lap("encode the prompt")
engine = open_engine(loaded, settings, 1)
lap("open the engine: a one-token pass measures the cache's bytes per token")
[request] = submit_prompts(engine, settings, [prompt], lambda prompt, sequences: None)
engine.run_here()
lap(f"{args.length} tokens")
out["  of which the first (the prompt's pass)"] = (request.first_token_at - clock[-2], None)
print(json.dumps(out))
gc.freeze()  # and the exit skips the collections over everything (command() again)
"""

LLAMA_STAGES = LAPS + r"""
path, length, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from llama_cpp import Llama
lap("import llama_cpp")
llm = Llama(model_path=path, n_ctx=512, verbose=False)
lap("load the GGUF file: header, vocabulary, weights")
tokens = llm.tokenize(prompt.encode())
lap("encode the prompt")
stamps = []
for token in llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0):
    stamps.append(time.perf_counter())
    if len(stamps) == length:
        break
lap(f"{length} tokens")
out["  of which the first (the prompt's pass)"] = (stamps[0] - clock[-2], None)
print(json.dumps(out))
"""

LLAMA_RUN = r"""
import sys
from llama_cpp import Llama
path, length, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_ctx=512, verbose=False)
result = llm(prompt, max_tokens=length, temperature=0.0, top_k=1, repeat_penalty=1.0)
print(prompt + result["choices"][0]["text"])
"""


def measured(command, env):
    """(wall s, CPU s, peak RSS MB) of one process, by /usr/bin/time: its own small process forks the command, so
    the peak is the command's alone (a child forked from this process would start from this one's RSS)."""
    with tempfile.NamedTemporaryFile("r") as report:
        result = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", report.name, *command], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command[:4])} failed: {result.stderr.decode()[-2000:]}")
        wall, user, system, rss_kb = report.read().split()
    return float(wall), float(user) + float(system), int(rss_kb) / 1024


def stages(command, env):
    """{stage: (wall s, CPU s or None)} of one process, and a last row for what no stage holds: the interpreter's
    start and exit (the whole process by /usr/bin/time, less the stages)."""
    with tempfile.NamedTemporaryFile("r") as report:
        result = subprocess.run(["/usr/bin/time", "-f", "%e %U %S", "-o", report.name, *command], env=env,
                                capture_output=True)
        if result.returncode:
            raise RuntimeError(f"stages failed: {result.stderr.decode()[-2000:]}")
        wall, user, system = (float(value) for value in report.read().split())
    out = json.loads(result.stdout.decode().splitlines()[-1])
    counted = [times for name, times in out.items() if not name.startswith(" ")]
    out["interpreter start and exit (the process less its stages)"] = (
        wall - sum(times[0] for times in counted), user + system - sum(times[1] for times in counted))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--llama-python", default="/work/bench-venv/bin/python",
                        help="a Python that imports llama_cpp (llama-cpp-python); its rows are left out otherwise")
    parser.add_argument("--cache_home", default=None,
                        help="XDG_CACHE_HOME with the header cached (default: the user's; a run fills it first)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from rungen.loading import default_model_file

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    if args.cache_home:
        env["XDG_CACHE_HOME"] = args.cache_home
    tool_args = ["--prompt", PROMPT, "--temperature", "0", "--length", str(args.length)]
    commands = {name: [sys.executable, "-c", code] for name, code in FLOORS.items()}
    commands["the tool (cached)"] = [sys.executable, os.path.join(ROOT, "run_generation.py"), *tool_args]
    has_llama = has_llama_cpp(args.llama_python)  # (no such interpreter: no such rows)
    gguf_path = default_model_file()
    if has_llama:
        commands["llama-cpp-python (same GGUF)"] = [args.llama_python, "-c", LLAMA_RUN, gguf_path, str(args.length),
                                                   PROMPT]
    else:
        print(f"no llama-cpp-python rows: {args.llama_python} cannot import llama_cpp", file=sys.stderr)
    measured(commands["the tool (cached)"], env)  # fills the header cache (and builds the kernels) if need be
    rows = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, command in commands.items():
            rows[name].append(measured(command, env))

    print(f"CPU flags: {cpu_flags()}; {args.runs} rounds, {os.cpu_count()} cores\n")
    floor = rows["import torch"]
    print("| process | wall s | CPU s | peak RSS MB | minus torch: wall s | CPU s |\n|---|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        wall, cpu, rss = (statistics.median(run[i] for run in runs) for i in range(3))
        less = [statistics.median(run[i] - base[i] for run, base in zip(runs, floor)) for i in range(2)]
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {rss:.0f} | {less[0]:+.2f} | {less[1]:+.2f} |")

    tables = {"the tool": [sys.executable, "-c", TOOL_STAGES, *tool_args]}
    if has_llama:
        tables["llama-cpp-python"] = [args.llama_python, "-c", LLAMA_STAGES, gguf_path, str(args.length), PROMPT]
    for name, command in tables.items():
        print(f"\n| stage of {name} (one fresh process) | wall s | CPU s |\n|---|---:|---:|")
        for stage, (wall, cpu) in stages(command, env).items():
            print(f"| {stage} | {wall:.2f} | {'' if cpu is None else f'{cpu:.2f}'} |")


if __name__ == "__main__":
    main()
