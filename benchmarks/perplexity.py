"""Perplexity of the default model on a fixed English text, in float32 and each --quantize mode.

    python -m benchmarks.perplexity [--text benchmarks/data/declaration.txt] [--threads 2] [--ggml]

The text (benchmarks/data/declaration.txt, about 2,350 tokens) is the Declaration of Independence
(1776), the Gettysburg Address (1863) and the Preamble and Article I, sections 1-3, of the US
Constitution (1787): public domain. It fits the model's 8,192-token context, so one forward pass
scores every token after the first; perplexity = exp(mean negative log-likelihood).

--ggml adds the model with the GGUF file's own blocks multiplied by rungen_ggml (benchmarks/ggml_decode.py
builds it): once with the integer kernel for every token, as decoding runs (activations rounded to
8 bits per block of 32), and once as a prompt pass runs (many tokens: de-quantized float tiles).
"""

import argparse
import copy
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rungen.loading import default_model_dir
from rungen.quantize import quantize_model

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "declaration.txt")


def perplexity(model, ids):
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ggml", action="store_true", help="add the GGUF blocks through rungen_ggml")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(open(args.text).read(), return_tensors="pt")["input_ids"]
    reference = perplexity(base, ids)
    print(f"default model, {ids.shape[1]} tokens of {os.path.basename(args.text)}, torch {torch.__version__}")
    print("")
    print("| weights | perplexity | vs float32 |")
    print("| --- | ---: | ---: |")
    print(f"| float32 | {reference:.3f} | - |")
    for mode in ("int8", "int4"):
        model = copy.deepcopy(base)
        quantize_model(model, mode)
        value = perplexity(model, ids)
        print(f"| {mode} | {value:.3f} | {value / reference - 1:+.2%} |")
    if args.ggml:
        from ggml_decode import gguf_path, use_gguf_blocks

        from rungen.ggml import native_kernels

        if not native_kernels():
            sys.exit("the native kernels are not available")
        model = use_gguf_blocks(copy.deepcopy(base), gguf_path())
        for label, threshold in (("integer kernel, every token", 2**62), ("as a prompt pass (float tiles)", 16)):
            torch.ops.rungen_ggml.set_tile_threshold(threshold)
            value = perplexity(model, ids)
            print(f"| GGUF blocks, rungen_ggml {torch.ops.rungen_ggml.isa()}, {label} | {value:.3f} "
                  f"| {value / reference - 1:+.2%} |")


if __name__ == "__main__":
    main()
