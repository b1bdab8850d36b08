"""GPU memory of a GGUF file loaded onto the GPU: the file's bytes against what its GPU form holds and the load's
peak, and the bytes of each kind of part (matrices, embedding, head) in the form it took.

    python -m benchmarks.gguf_gpu_memory [--shape llama-3.1-8b] [--qtype Q4_0] [--keep DIR]
    python tests/virtual_cuda.py -m benchmarks.gguf_gpu_memory       # without a GPU: on the GPU the CPU plays

The file is benchmarks/gpu.py's GGUF row's (GGUF_SHAPES: the published shape, random blocks, a synthetic
vocabulary), written by the gguf package into a temporary folder (or --keep's, reused when there). The goal it
checks (docs/performance.md, "On a GPU"): GPU memory at most 1.3x the file and the cache. On the played GPU the
bytes are its tensors' (tests/virtual_cuda.py): exact but for the allocator's rounding and the libraries'
workspaces; Triton does not run there, so the forms for its kernels fall back as on a GPU without Triton (an int8
type de-quantized to bfloat16).
"""

import argparse
import collections
import os
import tempfile
import time

import torch

from benchmarks.common import command
from benchmarks.gpu import GGUF_SHAPES


def part_of(module, model) -> str:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return "head" if module is head else "embedding" if module is embedding else "layers and norms"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(GGUF_SHAPES))
    parser.add_argument("--qtype", default="Q4_0", choices=("Q4_0", "Q8_0"))
    parser.add_argument("--keep", help="a folder for the file, reused when it is there")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no GPU: run it on one, or on the played GPU (python tests/virtual_cuda.py -m ...)")
    from benchmarks.gguf_files import synthetic_tokenizer_fields, write_family
    from rungen.loading import load

    folder = args.keep or tempfile.mkdtemp(prefix="gguf_gpu_memory_")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{args.shape}-{args.qtype}.gguf")
    vocab, family = GGUF_SHAPES[args.shape]
    if not os.path.exists(path):
        start = time.perf_counter()
        write_family(path + ".part", "llama", args.qtype, synthetic_tokenizer_fields(vocab), shape=family)
        os.replace(path + ".part", path)  # a half-written file is never read back
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
    size = os.path.getsize(path)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loaded = load(path, device=torch.device("cuda"))
    seconds = time.perf_counter() - start
    held, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    print(f"{torch.cuda.get_device_name()}; {args.shape} {args.qtype}: file {size / 2**30:.3f} GiB, loaded in "
          f"{seconds:.0f} s; held {held / 2**30:.3f} GiB ({held / size:.2f}x the file), the load's peak "
          f"{peak / 2**30:.3f} GiB ({peak / size:.2f}x)")
    parts = collections.defaultdict(lambda: [0, set()])
    for name, tensor in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]:
        module = loaded.model.get_submodule(name.rpartition(".")[0])
        part = parts[part_of(module, loaded.model)]
        part[0] += tensor.numel() * tensor.element_size()
        part[1].add(type(module).__name__)
    for part, (held, kinds) in parts.items():
        print(f"  {part}: {held / 2**30:.3f} GiB ({', '.join(sorted(kinds))})")


if __name__ == "__main__":
    command(main)
