"""Decode (tg) and prompt processing (pp) of any GGUF file, the tool against llama.cpp on the same file, paired.

    python -m benchmarks.gguf_files --model FILE [FILE ...] [--repeats 3] [--threads 2] [--tg 128] [--pp 512]
                                    [--tests tg pp] [--depth 0] [--llama-bench LLAMA_CPP/build/bin/llama-bench]
                                    [--ik-llama-bench IK_LLAMA_CPP/build/bin/llama-bench [--ik-tests pp]]
    python -m benchmarks.gguf_files --write DIR [--families llama qwen3] [--types Q4_K_M Q6_K ...]
                                    [--quantize LLAMA_CPP/build/bin/llama-quantize] [--layers N]

Measuring: every file is loaded by the tool as the command line loads it (rungen.loading.load) and run on the
engine (rungen/engine.py: the loop the command line, the session and the server decode in); llama.cpp runs the same
file through its own llama-bench (--llama-bench BINARY, one run a job) or through llama-cpp-python in a child
process of a benchmark-only virtualenv (--llama-python, driven line by line; its Python sampling loop costs about a
millisecond a token, a fifth of a small model's step), so that a round measures both back to back under the same
load. --ik-llama-bench adds ik_llama.cpp's llama-bench (the CPU-focused fork) as a second reference column
for the tests --ik-tests names (--ik-args passed to it, e.g. "-rtr 1" for its run-time repacking). --isa avx2
forces the tool's kernels and torch's ops onto their AVX2 code paths (set ATEN_CPU_CAPABILITY=avx2 too), to be
paired with a llama.cpp built without AVX-512: on an AVX-512 machine a proxy for an AVX2 one (same cores and
memory, AVX2 code on both sides), not a measurement of one. tg: a short prompt (--depth N: N random token ids,
llama-bench's -d N), then `--tg` new tokens greedily (no EOS), tokens per second over the decode steps after the
first token, as llama-bench's tg counts them. pp:
`--pp` random token ids (the same ids for both) processed in one call, tokens per second to the first token, as
llama-bench's pp counts them. Ratios are medians of per-round ratios. CPU flags are printed with the figures.
Models the engine refuses (chunked-attention layers) run through generate(), as the command line runs them, and
their rows say so.

Writing: files in published shapes with random weights (the text is meaningless, the memory and time are real),
the default model's tokenizer as vocabulary: each family in Q4_0 and Q8_0 as the gguf package writes them (random
blocks with valid fp16 scales), then every other type by llama.cpp's own quantizer (llama_model_quantize, with
allow_requantize), as published files are made; and the default model itself requantized.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import cpu_flags, has_llama_cpp  # noqa: E402

BENCH_PYTHON = "/work/bench-venv/bin/python"
# The reference columns, in the table's order.
REFERENCES = ("llama.cpp", "ik_llama.cpp")

# Published shapes (config.json of each family's model of about 1-4B parameters); vocabulary: the default model's.
FAMILIES = {
    "llama": dict(arch="llama", layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4, head_dim=64,
                  rope_base=10000.0, eps=1e-5, tied=False),  # TinyLlama-1.1B
    "qwen3": dict(arch="qwen3", layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128,
                  rope_base=1000000.0, eps=1e-6, tied=True, qk_norm=True),  # Qwen3-1.7B
    "qwen2": dict(arch="qwen2", layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, head_dim=128,
                  rope_base=1000000.0, eps=1e-6, tied=True, qkv_bias=True),  # Qwen2.5-1.5B
    # gemma-2-2b: heads of 256 over 2304, every other layer a 4096-token window, soft-capped attention and logits.
    "gemma2": dict(arch="gemma2", layers=26, hidden=2304, ffn=9216, heads=8, kv_heads=4, head_dim=256,
                   rope_base=10000.0, eps=1e-6, tied=True, gemma=True, context=8192, sliding_window=4096,
                   softcapping=(50.0, 30.0)),
    # gemma-3-1b: one kv head, q/k norms, five layers in six a 512-token window (llama.cpp's and transformers'
    # pattern, not a key of the file).
    "gemma3": dict(arch="gemma3", layers=26, hidden=1152, ffn=6912, heads=4, kv_heads=1, head_dim=256,
                   rope_base=1000000.0, eps=1e-6, tied=True, qk_norm=True, gemma=True, context=32768,
                   sliding_window=512),
    # granite-3.3-2b: llama's layers with multipliers (the embedding's, each residual branch's, the scores', the
    # logits' divisor), llama.cpp's keys for them; a 128k context (4096 here, as the others).
    "granite": dict(arch="granite", layers=40, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64,
                    rope_base=10000000.0, eps=1e-5, tied=True,
                    scales={"attention.scale": 0.015625, "embedding_scale": 12.0, "residual_scale": 0.22,
                            "logit_scale": 8.0}),
    # Ministral-3-3B: llama's layers, heads of 128 over 3072, tied; its yarn rotary (16x over 16384 positions) and
    # llama 4's query temperature past them (llama.cpp's mistral3 files).
    "ministral3": dict(arch="mistral3", layers=26, hidden=3072, ffn=9216, heads=32, kv_heads=8, head_dim=128,
                       rope_base=1000000.0, eps=1e-5, tied=True, context=262144, yarn=(16.0, 16384),
                       temperature=0.1),
    # OLMo-2-0425-1B: norms after the attention and the MLP (none before), q and k normalized over all their heads,
    # untied; llama.cpp's olmo2 files.
    "olmo2": dict(arch="olmo2", layers=16, hidden=2048, ffn=8192, heads=16, kv_heads=16, head_dim=128,
                  rope_base=500000.0, eps=1e-6, tied=False, post_norms=True, qk_norm="all heads"),
    # EXAONE-4.0-1.2B: OLMo 2's norms after the attention and the MLP alone, q and k normalized per head, every
    # layer full (32B's windows are not its); llama.cpp's exaone4 files.
    "exaone4": dict(arch="exaone4", layers=30, hidden=2048, ffn=4096, heads=32, kv_heads=8, head_dim=64,
                    rope_base=1000000.0, eps=1e-5, tied=True, post_norms=True, qk_norm=True),
    # Qwen3.5-0.8B: three Gated DeltaNet layers in four (16 key and 16 value heads of 128, a 4-wide convolution)
    # beside gated full attention (8 heads of 256 over 2, a quarter of each rotated); llama.cpp's qwen35 files.
    "qwen35": dict(arch="qwen35", layers=24, hidden=1024, ffn=3584, heads=8, kv_heads=2, head_dim=256,
                   rope_base=10000000.0, eps=1e-6, tied=True, qk_norm=True, linear=(16, 16, 128)),
    # LFM2-1.2B: 16 layers 2048 wide, 10 of them gated short convolutions (a window of 3), 6 of attention (32 heads of
    # 64 over 8, q/k norms) at 2, 5, 8, 10, 12 and 14; the final norm named token_embd_norm; llama.cpp's lfm2 files.
    "lfm2": dict(arch="lfm2", layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64,
                 rope_base=1000000.0, eps=1e-5, tied=True, qk_norm=True, convolutions=(3, (2, 5, 8, 10, 12, 14))),
    # LFM2-8B-A1B: 24 layers 2048 wide, 18 of them short convolutions, 6 of attention (32 heads of 64 over 8) at 2, 6,
    # 10, 14, 18 and 21; the first two MLPs dense (7168), then 32 experts of 1792, 4 a token by sigmoid scores with the
    # expert bias; 4.7 GB in Q4_0.
    "lfm2moe": dict(arch="lfm2moe", layers=24, hidden=2048, ffn=7168, heads=32, kv_heads=8, head_dim=64,
                    rope_base=1000000.0, eps=1e-5, tied=True, qk_norm=True, convolutions=(3, (2, 6, 10, 14, 18, 21)),
                    experts=32, experts_used=4, expert_ffn=1792, dense_first=2, expert_bias=True),
    # Qwen3.5-35B-A3B: 40 of those layers 2048 wide (16 heads of 256 over 2; 16 key and 32 value heads of 128), each
    # MLP 256 experts of 512 (8 a token) beside a shared expert of 512 behind its sigmoid gate; 20 GB in Q4_0, so
    # --layers writes fewer of its layers where memory is short.
    "qwen35moe": dict(arch="qwen35moe", layers=40, hidden=2048, ffn=512, heads=16, kv_heads=2, head_dim=256,
                      rope_base=10000000.0, eps=1e-6, tied=False, qk_norm=True, linear=(16, 32, 128), experts=256,
                      experts_used=8, expert_ffn=512, shared_ffn=512),
    # Qwen3-Next-80B-A3B: 48 layers of Qwen3.5-35B-A3B's kind 2048 wide (its b and a in one ssm_ba, no MRoPE: a
    # plain rotary over a quarter of each head), each MLP 512 experts of 512 (10 a token) beside a shared one; 45 GB
    # in Q4_0, so --layers writes fewer of its layers.
    "qwen3next": dict(arch="qwen3next", layers=48, hidden=2048, ffn=512, heads=16, kv_heads=2, head_dim=256,
                      rope_base=10000000.0, eps=1e-6, tied=False, qk_norm=True, linear=(16, 32, 128), experts=512,
                      experts_used=10, expert_ffn=512, shared_ffn=512),
    # Phi-3-mini-4k (3.8B, the smallest published phi3 model): q/k/v in one attn_qkv, gate and up in one ffn_up,
    # heads of 96; its sliding_window key (2047) is what llama.cpp's converter writes and both runtimes ignore.
    "phi3": dict(arch="phi3", layers=32, hidden=3072, ffn=8192, heads=32, kv_heads=32, head_dim=96,
                 rope_base=10000.0, eps=1e-5, tied=False, fused=True, context=4096, sliding_window=2047),
    # Qwen3-30B-A3B: every layer's MLP 128 experts of 768 (8 a token) in 3-D ffn_{gate,up,down}_exps tensors, a
    # float32 router (ffn_gate_inp); 17 GB in Q4_0, so --layers writes fewer of its layers where memory is short.
    "qwen3moe": dict(arch="qwen3moe", layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128,
                     rope_base=1000000.0, eps=1e-6, tied=False, qk_norm=True, experts=128, experts_used=8,
                     expert_ffn=768),
    # GLM-4.5-Air (106B-A12B): 46 layers 4096 wide (96 heads of 128 over 8, q/k/v biases, half of each head rotated),
    # the first dense (10944), then 128 experts of 1408 (8 a token, by sigmoid scores with a correction, scaled by 1)
    # beside a shared expert of 1408; 62 GB in Q4_0, so --layers writes fewer of its layers (the first dense).
    "glm4moe": dict(arch="glm4moe", layers=46, hidden=4096, ffn=10944, heads=96, kv_heads=8, head_dim=128,
                    rope_base=1000000.0, eps=1e-5, tied=False, experts=128, experts_used=8, expert_ffn=1408,
                    shared_ffn=1408, dense_first=1, sigmoid_router=1.0, rotated=64, qkv_bias=True, context=131072),
    # DeepSeek-V2-Lite (16B-A2.4B): 27 layers 2048 wide, its latent attention (16 heads; k and v from a 512-wide
    # latent, 128 values a head not rotated and 64 rotated, 128 a value head; kv_b split into attn_k_b and attn_v_b),
    # the first dense (10944), then 64 experts of 1408 (6 a token by the softmax) beside two shared; yarn (40x);
    # 9 GB in Q4_0.
    "deepseek2": dict(arch="deepseek2", layers=27, hidden=2048, ffn=10944, heads=16, kv_heads=1, head_dim=192,
                      rope_base=10000.0, eps=1e-6, tied=False, experts=64, experts_used=6, expert_ffn=1408,
                      shared_ffn=2816, dense_first=1, mla=(512, 128, 64, 128), yarn=(40.0, 4096), context=163840),
    # ERNIE-4.5-21B-A3B: 28 layers 2560 wide (20 heads of 128 over 4), the first dense (12288), then 64 experts of 1536
    # (6 a token by the softmax with its correction) beside two shared; 12 GB in Q4_0.
    "ernie4_5-moe": dict(arch="ernie4_5-moe", layers=28, hidden=2560, ffn=12288, heads=20, kv_heads=4, head_dim=128,
                         rope_base=500000.0, eps=1e-5, tied=True, experts=64, experts_used=6, expert_ffn=1536,
                         shared_ffn=3072, dense_first=1, ernie_router=True),
    # Granite 4.0 H-Tiny (7B-A1B): 40 layers 1536 wide, 36 of them Mamba-2 (48 heads of 64, a state of 128, one
    # group, a window of 4), 4 of attention without rotary (12 heads of 128 over 4) at 5, 15, 25 and 35; each MLP 64
    # experts of 512 (6 a token) beside a shared one of 1024; Granite's multipliers; tied; 4.1 GB in Q4_0.
    "granitehybrid": dict(arch="granitehybrid", layers=40, hidden=1536, ffn=512, heads=12, kv_heads=4, head_dim=128,
                          rope_base=10000.0, eps=1e-5, tied=True, mamba=(48, 64, 128, 1),
                          pattern="".join("*" if layer in (5, 15, 25, 35) else "M" for layer in range(40)), experts=64,
                          experts_used=6, expert_ffn=512, shared_ffn=1024, context=2 ** 20,
                          scales={"attention.scale": 0.0078125, "embedding_scale": 12.0, "residual_scale": 0.22,
                                  "logit_scale": 6.0}),
    # granite-3.1-3b-a800m: 32 layers 1536 wide (24 heads of 64 over 8), each MLP 40 experts of 512 (8 a token),
    # Granite's multipliers; tied; feed_forward_length the experts' width, as its converter writes it.
    "granitemoe": dict(arch="granitemoe", layers=32, hidden=1536, ffn=512, heads=24, kv_heads=8, head_dim=64,
                       rope_base=10000000.0, eps=1e-6, tied=True, experts=40, experts_used=8, expert_ffn=512,
                       scales={"attention.scale": 0.015625, "embedding_scale": 12.0, "residual_scale": 0.22,
                               "logit_scale": 6.0}),
    # NVIDIA-Nemotron-Nano-9B-v2: 56 layers 4480 wide of one mixer each by its pattern (27 Mamba-2 of 128 heads of 80
    # over 8 groups with a state of 128, 4 attention of 40 heads of 128 over 8 without rotary, 25 MLPs of 15680 by
    # relu^2), untied; 5.0 GB in Q4_0.
    "nemotron_h": dict(arch="nemotron_h", layers=56, hidden=4480, ffn=15680, heads=40, kv_heads=8, head_dim=128,
                       rope_base=10000.0, eps=1e-5, tied=False, mamba=(128, 80, 128, 8),
                       pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
    # NVIDIA-Nemotron-3-Nano-30B-A3B: 52 layers 2688 wide of one mixer each by its pattern (23 Mamba-2 of 64 heads of
    # 64 over 8 groups with a state of 128, 6 attention of 32 heads of 128 over 2 without rotary, 23 mixtures of 128
    # experts of 1856 by relu^2 of up (no gate), 6 a token by sigmoid scores with a correction, normalized and scaled
    # by 2.5, beside a shared expert of 3712), untied; 17 GB in Q4_0.
    "nemotron_h_moe": dict(arch="nemotron_h_moe", layers=52, hidden=2688, ffn=1856, heads=32, kv_heads=2,
                           head_dim=128, rope_base=10000.0, eps=1e-5, tied=False, mamba=(64, 64, 128, 8),
                           pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", experts=128,
                           experts_used=6, expert_ffn=1856, shared_ffn=3712, relu2_experts=2.5, context=262144),
    # Falcon-H1-0.5B: 36 layers 1024 wide, each its attention (8 heads of 64 over 2) and its Mamba-2 mixer (24 heads
    # of 64, a state of 128, one group, no gated norm) side by side, then an MLP of 2048; untied, a rotary base of
    # 1e11 (Falcon-H1R-7B and the 1.5B-34B models: the same layers wider and more of them).
    "falcon-h1": dict(arch="falcon-h1", layers=36, hidden=1024, ffn=2048, heads=8, kv_heads=2, head_dim=64,
                      rope_base=1e11, eps=1e-5, tied=False, mamba=(24, 64, 128, 1), pattern="H" * 36),
    # Arcee's Trinity-Mini as transformers' AfmoeConfig defaults give it: 32 layers 2048 wide, 16 heads of 128 (every
    # fourth layer full and without rotary, the others over a window of 1024), each attention's output gated and q
    # and k normalized per head, four norms a layer, a dense first layer of 6144, then 64 experts of 1408, 6 a token
    # (sigmoid scores with a correction, normalized and scaled), beside 2 shared; untied.
    "afmoe": dict(arch="afmoe", layers=32, hidden=2048, ffn=6144, heads=16, kv_heads=16, head_dim=128,
                  rope_base=10000.0, eps=1e-5, tied=False, qk_norm=True, experts=64, experts_used=6,
                  expert_ffn=1408, shared_ffn=2 * 1408, dense_first=1, afmoe_router=1.0, sliding_window=1024),
    # AI2's OLMoE-1B-7B: 16 layers 2048 wide, 16 heads of 128 (as many kv heads), q and k normalized over all their
    # heads, every MLP 64 experts of 1024, 8 a token (softmax, not normalized); untied.
    "olmoe": dict(arch="olmoe", layers=16, hidden=2048, ffn=1024, heads=16, kv_heads=16, head_dim=128,
                  rope_base=10000.0, eps=1e-5, tied=False, qk_norm="all heads", experts=64, experts_used=8,
                  expert_ffn=1024),
    # Llama-4-Scout-17B-16E: 48 layers 5120 wide (40 heads of 128 over 8; every fourth without rotary, the others'
    # q and k L2-normalized), each MLP 16 experts of 8192 (1 a token, by its sigmoid score, which scales its input)
    # beside a shared one of 8192; Scout's llama3 rotary (a step at 8192, factor 16) as rope_freqs; untied; 61 GB in
    # Q4_0, so --layers writes fewer of its layers.
    "llama4": dict(arch="llama4", layers=48, hidden=5120, ffn=16384, heads=40, kv_heads=8, head_dim=128,
                   rope_base=500000.0, eps=1e-5, tied=False, experts=16, experts_used=1, expert_ffn=8192,
                   shared_ffn=8192, interleave=1, context=10485760),
    # MiniMax-M2 (230B-A10B): 62 layers 3072 wide (48 heads of 128 over 8, q and k normalized over all their heads,
    # half of each head rotated), each MLP 256 experts of 1536, 8 a token (sigmoid scores with a correction,
    # normalized); untied; 120 GB in Q4_0, so --layers writes fewer of its layers.
    "minimax-m2": dict(arch="minimax-m2", layers=62, hidden=3072, ffn=1536, heads=48, kv_heads=8, head_dim=128,
                       rope_base=5000000.0, eps=1e-6, tied=False, qk_norm="all heads", rotated=64, experts=256,
                       experts_used=8, expert_ffn=1536, minimax_router=True, context=196608),
    # Mistral 4 as its class's defaults give it: 36 layers 4096 wide, DeepSeek's latent attention (32 heads; q through
    # a rank of 1024, k and v from a 256-wide latent, 64 values a head not rotated and 64 rotated, 128 a value head),
    # each MLP 128 experts of 2048 (4 a token by the softmax, normalized; gate and up in one tensor) beside a shared
    # one; yarn (128x over 8192); 66 GB in Q4_0, so --layers writes fewer of its layers.
    "mistral4": dict(arch="mistral4", layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=1, head_dim=128,
                     rope_base=10000.0, eps=1e-6, tied=False, experts=128, experts_used=4, expert_ffn=2048,
                     shared_ffn=2048, dense_first=0, mla=(256, 64, 64, 128), q_lora=1024, yarn=(128.0, 8192),
                     yarn_log_mul=0.1, context=1048576),
    # Tencent's Hy3 as its class's defaults give it: 80 layers 4096 wide (64 heads of 128 over 8, q and k normalized
    # per head), a dense first layer of 13312, then 192 experts of 1536, 8 a token (sigmoid scores with a correction,
    # normalized, scaled by 2.826), beside a shared one; untied; about 160 GB in Q4_0, so --layers writes fewer.
    "hy_v3": dict(arch="hy_v3", layers=80, hidden=4096, ffn=13312, heads=64, kv_heads=8, head_dim=128,
                  rope_base=11158840.0, eps=1e-5, tied=False, qk_norm=True, experts=192, experts_used=8,
                  expert_ffn=1536, shared_ffn=1536, dense_first=1, hy_router=2.826),
    # rednote's dots.llm1 (142B-A14B): 62 layers 4608 wide (32 heads of 128, q and k normalized per head), a dense
    # first layer of 10944, then 128 experts of 1408, 6 a token (sigmoid scores with a correction, normalized, scaled
    # by 2.5), beside 2 shared; untied; 80 GB in Q4_0, so --layers writes fewer.
    "dots1": dict(arch="dots1", layers=62, hidden=4608, ffn=10944, heads=32, kv_heads=32, head_dim=128,
                  rope_base=10000000.0, eps=1e-5, tied=False, qk_norm=True, experts=128, experts_used=6,
                  expert_ffn=1408, shared_ffn=2 * 1408, dense_first=1, dots_router=2.5),
    # Mixtral-8x7B: llama's file with experts (8 of 14336 a layer, 2 a token: feed_forward_length is the experts'),
    # 26 GB in Q4_0.
    "mixtral": dict(arch="llama", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128,
                    rope_base=1000000.0, eps=1e-5, tied=False, experts=8, experts_used=2, expert_ffn=14336),
    # gpt-oss-20b: 64 heads of 64 over 2880 with q/k/v/o biases and a sink logit a head, every other layer a
    # 128-token window, yarn; every layer 32 experts of 2880 (4 a token) with biases, the router's bias. Its published
    # files: the experts MXFP4, the rest Q8_0 (llama-quantize's MXFP4_MOE); 12 GB.
    "gpt-oss": dict(arch="gpt-oss", layers=24, hidden=2880, ffn=2880, heads=64, kv_heads=8, head_dim=64,
                    rope_base=150000.0, eps=1e-5, tied=False, experts=32, experts_used=4, expert_ffn=2880,
                    context=131072, sliding_window=128, yarn=(32.0, 4096), biases=True),
}
# llama.cpp's file types (llama_ftype) by the names its quantizer uses.
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12, "IQ4_XS": 30, "Q4_K_S": 14,
          "Q5_0": 8, "Q2_K": 10, "MXFP4_MOE": 38}

LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    llm.reset()
    if job["kind"] == "pp":
        start = time.perf_counter()
        llm.eval(job["ids"])
        print(json.dumps({"tokens_per_s": len(job["ids"]) / (time.perf_counter() - start)}), flush=True)
        continue
    stamps = []
    for token in llm.generate(job["ids"], top_k=1, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if len(stamps) == job["new_tokens"]:
            break
    print(json.dumps({"tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}), flush=True)
"""


class LlamaCpp:
    def __init__(self, python, path, threads, context=1024):
        self.child = subprocess.Popen([python, "-c", LLAMA_CHILD, path, str(threads), str(context)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.child.stdout.readline())

    def run(self, kind, ids, new_tokens=0):
        self.child.stdin.write(json.dumps({"kind": kind, "ids": ids, "new_tokens": new_tokens}) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())["tokens_per_s"]

    def close(self):
        self.child.stdin.close()
        self.child.wait()


class LlamaBench:
    """llama.cpp's own llama-bench (built from the source llama-cpp-python vendors), or ik_llama.cpp's, one run a
    job: no Python in its decode loop, the fairer reference for a small model whose step takes a few
    milliseconds. extra_args: more llama-bench arguments (ik_llama.cpp's "-rtr 1")."""

    def __init__(self, binary, path, threads, extra_args=(), depth=0):
        self.binary, self.path, self.threads, self.extra_args = binary, path, threads, list(extra_args)
        self.depth = depth  # tg's context, as the tool's tg prompt (pp's is none)

    def run(self, kind, ids, new_tokens=0):
        sizes = ["-p", str(len(ids)), "-n", "0"] if kind == "pp" else ["-p", "0", "-n", str(new_tokens),
                                                                       "-d", str(self.depth)]
        command = [self.binary, "-m", self.path, "-t", str(self.threads), "-r", "1", "-o", "json", *self.extra_args,
                   *sizes]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{os.path.basename(self.binary)} failed ({out.returncode}): {last}")
        return json.loads(out.stdout)[0]["avg_ts"]

    def close(self):
        pass


class Tool:
    """The tool on one file: on the engine, or through generate() where the engine refuses the model (chunked-attention
    layers), as the command line falls back (rungen.batch.open_engine)."""

    def __init__(self, path):
        import torch

        from rungen.engine import Engine
        from rungen.loading import load

        self.loaded = load(path, device=torch.device("cpu"))
        try:
            self.engine = Engine(self.loaded, max_batch=16, max_queue=16, prefix_cache_bytes=0, eos_ids=())
            self.how = "engine"
        except ValueError as error:
            print(f"{os.path.basename(path)}: through generate(), as the command line runs it ({error})",
                  file=sys.stderr)
            self.engine, self.how = None, "generate()"

    def _request(self, ids, new_tokens):
        """(start, first token, end) times of greedy decoding `new_tokens` after `ids`."""
        if self.engine is None:
            return self._generate(ids, new_tokens)
        from rungen.requests import Request
        from rungen.sampling import Sampling

        request = Request(list(ids), new_tokens, Sampling(temperature=0), deltas=False, sink=lambda event: None)
        start = time.perf_counter()
        self.engine.submit(request)
        self.engine.run_here()
        return start, request.first_token_at, time.perf_counter()

    def _generate(self, ids, new_tokens):
        import torch
        from transformers import LogitsProcessorList

        from benchmarks.common import StepClock

        clock = StepClock()  # called as each token is chosen: the first after the prompt's pass
        inputs = torch.tensor([list(ids)])
        start = time.perf_counter()
        with torch.inference_mode():
            # eos_token_id=None runs all new_tokens, as llama-bench does
            self.loaded.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                       eos_token_id=None, do_sample=False,
                                       logits_processor=LogitsProcessorList([clock]))
        return start, clock.stamps[0], time.perf_counter()

    def run(self, kind, ids, new_tokens=0):
        if kind == "pp":
            start, first, _ = self._request(ids, 1)
            return len(ids) / (first - start)
        _, first, end = self._request(ids, new_tokens)
        return (new_tokens - 1) / (end - first)

    def close(self):
        pass


def measure(path, args):
    """How the tool ran the file ("engine" or "generate()") and per test of args.tests: (test, the tool's median
    tok/s, {reference: (median tok/s, median ratio)}), a reference only for the tests it ran."""
    import random

    import torch

    torch.set_num_threads(args.threads)
    tool = Tool(path)
    # (ids the embedding has: a tokenizer may count a token the model's table lacks)
    vocab = min(len(tool.loaded.tokenizer), tool.loaded.model.config.get_text_config().vocab_size)
    rng = random.Random(0)
    pp_ids = [rng.randrange(vocab) for _ in range(args.pp)]
    tg_ids = [rng.randrange(vocab) for _ in range(args.depth)] if args.depth else \
        tool.loaded.tokenizer("The capital of France is")["input_ids"]
    runners = {"tool": (tool, args.tests)}
    if args.llama_bench:
        runners["llama.cpp"] = (LlamaBench(args.llama_bench, path, args.threads, depth=args.depth), args.tests)
    elif has_llama_cpp(args.llama_python):
        context = max(1024, args.depth + args.tg + 8)
        runners["llama.cpp"] = (LlamaCpp(args.llama_python, path, args.threads, context), args.tests)
    else:
        print(f"no llama.cpp column: {args.llama_python} cannot import llama_cpp", file=sys.stderr)
    if args.ik_llama_bench:
        ik_tests = [kind for kind in args.tests if kind in args.ik_tests]
        runners["ik_llama.cpp"] = (LlamaBench(args.ik_llama_bench, path, args.threads, shlex.split(args.ik_args),
                                              args.depth), ik_tests)
    jobs = {"tg": lambda r: r.run("tg", tg_ids, args.tg), "pp": lambda r: r.run("pp", pp_ids)}
    warm_ups = {"tg": lambda r: r.run("tg", tg_ids, 8), "pp": lambda r: r.run("pp", pp_ids[:64])}
    try:
        for runner, kinds in runners.values():  # warm-up, uncounted
            for kind in kinds:
                warm_ups[kind](runner)
        results = {(name, kind): [] for name, (_, kinds) in runners.items() for kind in kinds}
        for _ in range(args.repeats):
            for kind in args.tests:
                for name, (runner, kinds) in runners.items():
                    if kind in kinds:
                        results[name, kind].append(jobs[kind](runner))
    finally:
        for runner, _ in runners.values():
            runner.close()
    rows = []
    for kind in args.tests:
        tool_speeds = results["tool", kind]
        refs = {}
        for name in REFERENCES:
            ref = results.get((name, kind))
            if ref:
                refs[name] = (statistics.median(ref), statistics.median(t / r for t, r in zip(tool_speeds, ref)))
        rows.append((kind, statistics.median(tool_speeds), refs))
    return tool.how, rows


def quantize_with_llama_cpp(source, target, ftype, binary=None):
    """llama.cpp's quantizer: its `llama-quantize` tool where `binary` names one, else llama_model_quantize through
    llama-cpp-python in the benchmark virtualenv."""
    if binary:
        name = next(name for name, number in FTYPES.items() if number == ftype)
        subprocess.run([binary, "--allow-requantize", source, target + ".tmp", name, "2"], check=True,
                       capture_output=True)
        os.replace(target + ".tmp", target)
        return
    code = ("import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {ftype}\np.allow_requantize = True\np.nthread = 2\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    subprocess.run([BENCH_PYTHON, "-c", code, source, target + ".tmp"], check=True, capture_output=True)
    os.replace(target + ".tmp", target)


def synthetic_tokenizer_fields(vocab):
    """tokenizer.* metadata of a byte-level BPE (tokenizer.ggml.model "gpt2", as Llama 3's and Qwen's files) of
    exactly `vocab` tokens, made up here: no file needed (the default model's tokenizer, which write_family's other
    callers copy, is a package a GPU machine may lack). The 256 byte symbols, then tokens of two and three symbols
    with the merges that make them, then <|begin_of_text|> and <|end_of_text|> (bos, eos) as control tokens."""
    from gguf import GGUFValueType as V

    if vocab < 260:
        raise ValueError(f"a byte-level vocabulary needs 260 tokens at least, not {vocab}")
    # GPT-2's bytes_to_unicode: printable characters for every byte.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens, merges = list(symbols), []
    wanted = vocab - 2
    pairs = ((a, b) for a in symbols for b in symbols)
    for a, b in pairs:
        if len(tokens) >= wanted:
            break
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    for first in list(tokens[256:]):
        for c in symbols:
            if len(tokens) >= wanted:
                break
            tokens.append(first + c)
            merges.append(f"{first} {c}")
        if len(tokens) >= wanted:
            break
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return [("tokenizer.ggml.model", "gpt2", V.STRING, None), ("tokenizer.ggml.pre", "default", V.STRING, None),
            ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            ("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING),
            ("tokenizer.ggml.bos_token_id", vocab - 2, V.UINT32, None),
            ("tokenizer.ggml.eos_token_id", vocab - 1, V.UINT32, None),
            ("tokenizer.ggml.add_bos_token", True, V.BOOL, None)]


# Where a block keeps its float16 scales, by type: (byte offset, how many: d, or d and dmin).
SCALES_AT = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2), "Q8_0": (0, 1), "Q2_K": (80, 2),
             "Q3_K": (108, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1), "IQ4_NL": (0, 1), "IQ4_XS": (0, 1),
             "MXFP4": (0, 0)}


def place_scales(raw, qtype, scales):
    """`raw` uint8 [..., blocks, block bytes] of blocks of `qtype` (a gguf GGMLQuantizationType) with the float16
    `scales` [..., blocks, 2] written where the type keeps them (d, and dmin where it has one): random bytes become
    blocks with finite scales, for weights whose values do not matter."""
    import numpy as np

    offset, count = SCALES_AT[qtype.name]
    if qtype.name == "MXFP4":  # a power of two's exponent byte: 2^(e - 128) times codes of up to 12 (a zero: e 0)
        scale = scales[..., 0].astype("float32")
        with np.errstate(divide="ignore"):
            raw[..., 0] = np.where(scale > 0, np.log2(scale / 6).round() + 128, 0).clip(0, 255).astype("uint8")
        return raw
    raw[..., offset:offset + 2 * count] = scales[..., :count].view("uint8").reshape(*raw.shape[:-1], 2 * count)
    return raw


def write_family(path, family, qtype_name, tokenizer_source, shape=None):
    """A model of `family`'s published shape (or `shape`, a dict as FAMILIES' values) with random weights, every
    matrix in `qtype_name` (Q4_0 or Q8_0) blocks with valid fp16 scales, norms float32 ones, the head Q6_K as
    llama.cpp's Q4_0 files have it; the keys and tensor names llama.cpp's converter writes for the family.
    `tokenizer_source`: a GGUF file whose tokenizer.* metadata the file copies, or that metadata itself as
    (key, value, type, element type) (synthetic_tokenizer_fields)."""
    import gguf
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
    from gguf import GGMLQuantizationType as Q

    shape = shape or FAMILIES[family]
    # MXFP4_MOE (llama-quantize's name): the experts MXFP4, the other matrices Q8_0
    experts_type = Q.MXFP4 if qtype_name == "MXFP4_MOE" else Q[qtype_name]
    qtype = Q.Q8_0 if qtype_name == "MXFP4_MOE" else experts_type
    if isinstance(tokenizer_source, (list, tuple)):
        fields = list(tokenizer_source)
    else:
        fields = [(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
                  for key, field in GGUFReader(tokenizer_source).fields.items() if key.startswith("tokenizer.")]
    vocab = next(len(value) for key, value, *_ in fields if key == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(0)
    arch = shape["arch"]
    writer = GGUFWriter(path, arch, use_temp_file=False)  # the arrays stay in memory: the file written once
    # (no family in the name: llama.cpp gives Phi-3's special tokens their attributes by a "phi3" in it, and fails
    # on this vocabulary, which lacks them)
    writer.add_name(f"Random weights, {shape['layers']} layers of {shape['hidden']}")
    writer.add_context_length(shape.get("context", 4096))
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    # (a hybrid's layers: M Mamba-2, * attention, - an MLP, E a mixture, H attention and Mamba-2 side by side and an
    # MLP)
    kinds = shape.get("pattern", "")[:shape["layers"]]
    nemotron = arch in ("nemotron_h", "nemotron_h_moe")  # (one mixer a layer, behind its one norm)
    falcon = arch == "falcon-h1"
    # (Nemotron-H's: a layer's MLP or experts' width, 0 where it has none)
    writer.add_feed_forward_length([shape["ffn"] if kind in "-E" else 0 for kind in kinds] if nemotron
                                   else shape["ffn"])
    writer.add_head_count(shape["heads"])
    convolutions, mamba = shape.get("convolutions"), shape.get("mamba")
    if convolutions:  # (LFM2's: a layer's kv heads, 0 for a convolution layer; the window; no head size written)
        writer.add_head_count_kv([shape["kv_heads"] if layer in convolutions[1] else 0
                                  for layer in range(shape["layers"])])
        writer.add_shortconv_l_cache(convolutions[0])
    elif mamba:  # (Granite 4.0 H's, Nemotron-H's: a layer's kv heads, 0 but for attention; the ssm keys; no rotary;
        # Falcon-H1's: its kv heads, rotary)
        ssm_heads, ssm_head, state, groups = mamba
        writer.add_head_count_kv(shape["kv_heads"] if falcon else
                                 [shape["kv_heads"] if kind == "*" else 0 for kind in kinds])
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(state)
        writer.add_ssm_group_count(groups)
        writer.add_ssm_inner_size(ssm_heads * ssm_head)
        writer.add_ssm_time_step_rank(ssm_heads)
        if not falcon:
            writer.add_rope_scaling_finetuned(False)
    else:
        writer.add_head_count_kv(shape["kv_heads"])
    if shape.get("fused"):  # phi3's converter: no key/value length (hidden / heads), the original context
        writer.add_rope_scaling_orig_ctx_len(shape["context"])
    elif "mla" in shape:  # (the latent's: the keys with the rotated part, the values without)
        writer.add_key_length(shape["mla"][0] + shape["mla"][2])
        writer.add_value_length(shape["mla"][0])
    elif not convolutions and (not mamba or nemotron or falcon):
        writer.add_key_length(shape["head_dim"])
        writer.add_value_length(shape["head_dim"])
    if nemotron:  # (its converter's key of the norms' epsilon)
        writer.add_layer_norm_eps(shape["eps"])
    else:
        writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_rope_freq_base(shape["rope_base"])
    if "mla" in shape:  # (DeepSeek's: the latent's widths, a head's, the rotated one; mscale 0.707 as 0.1 times it)
        latent, nope, rotated, value = shape["mla"]
        writer.add_kv_lora_rank(latent)
        # (llama.cpp reads no q rank only from a file of V2-Lite's 27 layers: 0 for one cut to fewer, q as V2-Lite's)
        writer.add_q_lora_rank(shape.get("q_lora", 0))
        writer.add_key_length_mla(nope + rotated)
        writer.add_value_length_mla(value)
        writer.add_rope_scaling_yarn_log_mul(shape.get("yarn_log_mul", 0.0707))
    if "yarn" in shape:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape["yarn"][0])
        writer.add_rope_scaling_orig_ctx_len(shape["yarn"][1])
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
    if "temperature" in shape:  # (Ministral 3's: mscale_all_dim 1, llama_4_scaling_beta)
        writer.add_rope_scaling_yarn_log_mul(1.0)
        writer.add_attn_temperature_scale(shape["temperature"])
    if arch in ("gpt-oss", "lfm2", "lfm2moe", "falcon-h1"):  # (their converters write no rotary dimension)
        pass
    elif "linear" in shape:  # Qwen3.5's linear attention, its interleaved MRoPE over a quarter of each head
        key_heads, value_heads, linear_dim = shape["linear"]
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(linear_dim)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * linear_dim)
        writer.add_full_attention_interval(4)
        if arch == "qwen3next":  # (a plain rotary; its converter lists the recurrent layers)
            writer.add_array(f"{arch}.attention.recurrent_layers",
                             [(layer + 1) % 4 != 0 for layer in range(shape["layers"])])
        else:
            writer.add_rope_dimension_sections([11, 11, 10, 0])
        writer.add_rope_dimension_count(shape["head_dim"] // 4)
    elif "mla" in shape:
        writer.add_rope_dimension_count(shape["mla"][2])
    elif not shape.get("gemma"):  # gemma's converters write no rotary dimension (the whole head)
        writer.add_rope_dimension_count(shape.get("rotated", shape["head_dim"]))
    if "sliding_window" in shape:
        writer.add_sliding_window(shape["sliding_window"])
    if "softcapping" in shape:
        writer.add_attn_logit_softcapping(shape["softcapping"][0])
        writer.add_final_logit_softcapping(shape["softcapping"][1])
    if "experts" in shape:
        writer.add_expert_count(shape["experts"])
        writer.add_expert_used_count(shape["experts_used"])
        if arch not in ("llama", "granitemoe"):  # (their converters write the experts' width as feed_forward_length)
            writer.add_expert_feed_forward_length(shape["expert_ffn"])
        if "sigmoid_router" in shape:  # (GLM-4.5's: the shared expert as a count of experts, the dense layers first)
            writer.add_expert_shared_count(1)
            writer.add_leading_dense_block_count(shape["dense_first"])
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            writer.add_expert_weights_scale(shape["sigmoid_router"])
            writer.add_expert_weights_norm(True)
        elif "ernie_router" in shape:  # (ERNIE 4.5's: every layer after the dense ones, its shared experts)
            writer.add_interleave_moe_layer_step(1)
            writer.add_leading_dense_block_count(shape["dense_first"])
            writer.add_expert_shared_count(shape["shared_ffn"] // shape["expert_ffn"])
            writer.add_expert_shared_feed_forward_length(shape["shared_ffn"])
        elif "expert_bias" in shape:  # (LFM2-MoE's: the dense layers first, sigmoid scores)
            writer.add_leading_dense_block_count(shape["dense_first"])
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        elif "relu2_experts" in shape:  # (Nemotron 3's: sigmoid scores in one group, normalized, scaled)
            writer.add_expert_shared_count(1)
            writer.add_expert_shared_feed_forward_length(shape["shared_ffn"])
            writer.add_expert_weights_norm(True)
            writer.add_expert_weights_scale(shape["relu2_experts"])
            writer.add_expert_group_count(1)
            writer.add_expert_group_used_count(1)
        elif "mla" in shape:  # (DeepSeek-V2's: its shared experts counted, the softmax unnormalized; Mistral 4's
            # normalized, its converter naming no gating function: llama.cpp's softmax)
            writer.add_expert_shared_count(shape["shared_ffn"] // shape["expert_ffn"])
            writer.add_leading_dense_block_count(shape["dense_first"])
            if arch == "mistral4":
                writer.add_expert_weights_norm(True)
            else:
                writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
            writer.add_expert_weights_scale(1.0)
        elif "afmoe_router" in shape:  # (AFMoE's: its shared experts counted, the dense layers first)
            writer.add_expert_shared_count(shape["shared_ffn"] // shape["expert_ffn"])
            writer.add_leading_dense_block_count(shape["dense_first"])
            writer.add_expert_weights_norm(True)
            writer.add_expert_weights_scale(shape["afmoe_router"])
        elif "dots_router" in shape:  # (dots.llm1's: its shared experts counted, the dense layers first, one group)
            writer.add_expert_shared_count(shape["shared_ffn"] // shape["expert_ffn"])
            writer.add_leading_dense_block_count(shape["dense_first"])
            writer.add_expert_group_count(1)
            writer.add_expert_group_used_count(1)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            writer.add_expert_weights_scale(shape["dots_router"])
            writer.add_expert_weights_norm(True)
        elif "hy_router" in shape:  # (Hy3's: sigmoid scores, normalized and scaled, a shared expert's width)
            writer.add_expert_shared_feed_forward_length(shape["shared_ffn"])
            writer.add_expert_weights_norm(True)
            writer.add_expert_weights_scale(shape["hy_router"])
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        elif "minimax_router" in shape:  # (MiniMax-M2's: sigmoid scores, as its config's scoring_func says)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        elif "interleave" in shape:  # (Llama 4's: every interleave-th layer a mixture, its shared expert uncounted)
            writer.add_interleave_moe_layer_step(shape["interleave"])
        elif "shared_ffn" in shape:  # (Qwen3.5-MoE's, Granite 4.0 H's)
            writer.add_expert_shared_feed_forward_length(shape["shared_ffn"])
    for key, value in shape.get("scales", {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    writer.add_vocab_size(vocab)
    writer.add_file_type(FTYPES[qtype_name])
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type)

    def blocks(name, rows, cols, kind, scale, experts=1):
        block, size = GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (experts * rows, cols // block, size), dtype=np.uint8)
        place_scales(data, kind, np.full((*data.shape[:2], 2), scale, dtype=np.float16))
        writer.add_tensor(name, data.reshape(*((experts,) if experts > 1 else ()), rows, -1), raw_dtype=kind)

    hidden, ffn, hd = shape["hidden"], shape["ffn"], shape["head_dim"]
    q_rows, kv_rows = shape["heads"] * hd, shape["kv_heads"] * hd
    small = 0.002 if qtype == Q.Q4_0 else 0.0002
    blocks("token_embd.weight", vocab, hidden, qtype, small * 5)
    if arch == "llama4":  # (Scout's llama3 rotary, a step: the slow frequencies, past 8192 positions a turn, / 16)
        wavelengths = 2 * np.pi * shape["rope_base"] ** (np.arange(0, hd, 2) / hd)
        writer.add_tensor("rope_freqs.weight", np.where(wavelengths > 8192, 16.0, 1.0).astype(np.float32))
    for layer in range(shape["layers"]):
        # (gemma's norms multiply by 1 + weight, which its converter stores: ones here too)
        norms = ("attn_norm", "post_attention_norm") if arch == "gpt-oss" else ("attn_norm", "ffn_norm") + (
            ("post_attention_norm", "post_ffw_norm") if shape.get("gemma") else ())
        if shape.get("post_norms"):  # (OLMo 2's: after the attention and the MLP alone)
            norms = ("post_attention_norm", "post_ffw_norm")
        if arch == "afmoe":  # (before and after the attention and the MLP)
            norms = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
        recurrent = "linear" in shape and (layer + 1) % 4 != 0
        convolution = bool(convolutions) and layer not in convolutions[1]
        ssm = bool(mamba) and kinds[layer] == "M"
        if nemotron or falcon:  # (Falcon-H1's MLP norm: below)
            norms = ("attn_norm",)
        if "linear" in shape or "sigmoid_router" in shape:  # (Qwen3.5's, GLM-4.5's: the MLP's norm so named)
            norms = ("attn_norm", "post_attention_norm")
        if "mla" in shape:  # (and the latent's)
            writer.add_tensor(f"blk.{layer}.attn_kv_a_norm.weight", np.ones(shape["mla"][0], dtype=np.float32))
        dense = "experts" not in shape or layer < shape.get("dense_first", 0) or (nemotron and kinds[layer] != "E") \
            or (layer + 1) % shape.get("interleave", 1) != 0
        for norm in norms:
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        if shape.get("qk_norm") == "all heads":  # (OLMo 2's: over all of q's and k's heads)
            writer.add_tensor(f"blk.{layer}.attn_q_norm.weight", np.ones(q_rows, dtype=np.float32))
            writer.add_tensor(f"blk.{layer}.attn_k_norm.weight", np.ones(kv_rows, dtype=np.float32))
        elif shape.get("qk_norm") and not recurrent and not convolution:
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hd, dtype=np.float32))
        if recurrent:  # a Gated DeltaNet layer's: q/k/v, the output gate, each value head's decay and step
            key_heads, value_heads, linear_dim = shape["linear"]
            keys, values = key_heads * linear_dim, value_heads * linear_dim
            parts = (("attn_qkv", 2 * keys + values, hidden), ("attn_gate", values, hidden),
                     *((("ssm_ba", 2 * value_heads, hidden),) if arch == "qwen3next" else  # (Qwen3-Next's b and a)
                       (("ssm_alpha", value_heads, hidden), ("ssm_beta", value_heads, hidden))),
                     ("ssm_out", hidden, values))
            if dense:
                parts += (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
            writer.add_tensor(f"blk.{layer}.ssm_conv1d.weight",
                              rng.normal(0, 0.1, (2 * keys + values, 4)).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_a", -rng.uniform(0.5, 8, value_heads).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_dt.bias", rng.normal(0, 0.5, value_heads).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_norm.weight", np.ones(linear_dim, dtype=np.float32))
        elif ssm or falcon:  # a Mamba-2 layer's: z, x, B, C and dt in one product, the window over x, B and C, A, D,
            # its norm (Falcon-H1's: none; its attention and MLP beside, its MLP's norm named without .weight)
            ssm_heads, ssm_head, state, groups = mamba
            inner, window = ssm_heads * ssm_head, ssm_heads * ssm_head + 2 * groups * state
            parts = (("ssm_in", inner + window + ssm_heads, hidden), ("ssm_out", hidden, inner))
            writer.add_tensor(f"blk.{layer}.ssm_conv1d.weight", rng.normal(0, 0.1, (window, 4)).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_conv1d.bias", np.zeros(window, dtype=np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_dt.bias", rng.normal(0, 0.5, ssm_heads).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_a", -rng.uniform(0.5, 8, (ssm_heads, 1)).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.ssm_d", np.ones((ssm_heads, 1), dtype=np.float32))
            if falcon:
                writer.add_tensor(f"blk.{layer}.ffn_norm", np.ones(hidden, dtype=np.float32))
                parts += (("attn_q", q_rows, hidden), ("attn_k", kv_rows, hidden), ("attn_v", kv_rows, hidden),
                          ("attn_output", hidden, q_rows), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                          ("ffn_down", hidden, ffn))
            else:
                writer.add_tensor(f"blk.{layer}.ssm_norm.weight",
                                  np.ones((groups, inner // groups), dtype=np.float32))
        elif mamba and kinds[layer] == "-":  # a Nemotron-H MLP layer's: relu^2 of up, then down
            parts = (("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
        elif mamba and kinds[layer] == "E":  # a Nemotron 3 mixture's layer: the experts alone (below)
            parts = ()
        elif convolution:  # an LFM2 convolution layer's: its input's three parts, the window's weights, its output
            parts = (("shortconv.in_proj", 3 * hidden, hidden), ("shortconv.out_proj", hidden, hidden))
            if dense:
                parts += (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
            writer.add_tensor(f"blk.{layer}.shortconv.conv.weight",
                              rng.normal(0, 0.1, (hidden, convolutions[0])).astype(np.float32))
        elif shape.get("fused"):
            parts = (("attn_qkv", q_rows + 2 * kv_rows, hidden), ("attn_output", hidden, q_rows),
                     ("ffn_up", 2 * ffn, hidden), ("ffn_down", hidden, ffn))
        elif "mla" in shape:  # q straight from the hidden state (V2-Lite's; Mistral 4's through its rank), the
            # latent and its split kv_b
            latent, nope, rotated, value = shape["mla"]
            q = shape.get("q_lora")
            parts = ((("attn_q_a", q, hidden), ("attn_q_b", shape["heads"] * (nope + rotated), q)) if q else
                     (("attn_q", shape["heads"] * (nope + rotated), hidden),)) + (
                ("attn_kv_a_mqa", latent + rotated, hidden), ("attn_output", hidden, shape["heads"] * value))
            if q:
                writer.add_tensor(f"blk.{layer}.attn_q_a_norm.weight", np.ones(q, dtype=np.float32))
            if dense:
                parts += (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
            blocks(f"blk.{layer}.attn_k_b.weight", latent, nope, qtype, small, shape["heads"])
            blocks(f"blk.{layer}.attn_v_b.weight", value, latent, qtype, small, shape["heads"])
        else:
            # (Qwen3.5's q rows and its output gate's, head by head)
            parts = (("attn_q", q_rows * (2 if "linear" in shape else 1), hidden), ("attn_k", kv_rows, hidden),
                     ("attn_v", kv_rows, hidden), ("attn_output", hidden, q_rows))
            if arch == "afmoe":  # (its output's gate)
                parts += (("attn_gate", q_rows, hidden),)
            if dense and not nemotron:  # (Nemotron-H's attention layer has no MLP)
                parts += (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn))
        for part, rows, cols in parts:
            blocks(f"blk.{layer}.{part}.weight", rows, cols, qtype, small)
        if not dense:
            experts, expert_ffn = shape["experts"], shape["expert_ffn"]
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                              rng.normal(0, 0.02, (experts, hidden)).astype(np.float32))
            if {"sigmoid_router", "expert_bias", "ernie_router", "relu2_experts", "afmoe_router",
                    "minimax_router", "hy_router", "dots_router"} & shape.keys():
                # (its correction; Hy3's converter names it without .bias)
                rows = (1, experts) if "ernie_router" in shape else (experts,)  # (ERNIE's as its checkpoint holds it)
                writer.add_tensor(f"blk.{layer}.exp_probs_b" + ("" if "hy_router" in shape else ".bias"),
                                  rng.normal(0, 0.1, rows).astype(np.float32))
            gated = "relu2_experts" not in shape  # (Nemotron 3's experts and shared expert: up and down alone)
            experts_parts = (("ffn_gate_exps", expert_ffn, hidden), ("ffn_up_exps", expert_ffn, hidden),
                             ("ffn_down_exps", hidden, expert_ffn))[0 if gated else 1:]
            if arch == "mistral4":  # (gate and up in one tensor, as its checkpoints stack them)
                experts_parts = (("ffn_gate_up_exps", 2 * expert_ffn, hidden), ("ffn_down_exps", hidden, expert_ffn))
            for part, rows, cols in experts_parts:
                blocks(f"blk.{layer}.{part}.weight", rows, cols, experts_type, small, experts)
                if shape.get("biases"):
                    writer.add_tensor(f"blk.{layer}.{part}.bias", np.zeros((experts, rows), dtype=np.float32))
            if "shared_ffn" in shape:  # (Qwen3.5-MoE's shared expert and its gate, float32 as its converter writes it;
                # GLM-4.5's without a gate)
                shared = shape["shared_ffn"]
                if not {"sigmoid_router", "mla", "ernie_router", "mamba", "afmoe_router", "interleave",
                        "hy_router", "dots_router"} & shape.keys():
                    writer.add_tensor(f"blk.{layer}.ffn_gate_inp_shexp.weight",
                                      rng.normal(0, 0.02, (1, hidden)).astype(np.float32))
                for part, rows, cols in (("ffn_gate_shexp", shared, hidden), ("ffn_up_shexp", shared, hidden),
                                         ("ffn_down_shexp", hidden, shared))[0 if gated else 1:]:
                    blocks(f"blk.{layer}.{part}.weight", rows, cols, qtype, small)
        if shape.get("biases"):  # gpt-oss's: q/k/v/o, the router's, a sink logit a head
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows), ("attn_output", hidden),
                               ("ffn_gate_inp", shape["experts"])):
                writer.add_tensor(f"blk.{layer}.{part}.bias", np.zeros(rows, dtype=np.float32))
            writer.add_tensor(f"blk.{layer}.attn_sinks.weight", np.zeros(shape["heads"], dtype=np.float32))
        if shape.get("qkv_bias"):  # qwen2's q/k/v biases, float32 as its converter writes them
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                writer.add_tensor(f"blk.{layer}.{part}.bias", rng.normal(0, 0.02, rows).astype(np.float32))
    final_norm = "token_embd_norm" if convolutions else "output_norm"  # (LFM2's: named as an embedding's)
    writer.add_tensor(f"{final_norm}.weight", np.ones(hidden, dtype=np.float32))
    if not shape["tied"]:
        # (llama.cpp's quantizer writes Q8_0 for Q6_K where a row is not whole superblocks: gpt-oss's 2880)
        blocks("output.weight", vocab, hidden, Q.Q6_K if hidden % 256 == 0 else Q.Q8_0, 0.0005)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write(args):
    from rungen.loading import default_model_file

    os.makedirs(args.write, exist_ok=True)
    default = default_model_file()
    written = []
    for family in args.families:
        bases = {}
        name = family + (f"-{args.layers}layers" if args.layers else "")
        for base in ("MXFP4_MOE", "Q8_0") if family == "gpt-oss" else ("Q4_0", "Q8_0"):  # (gpt-oss's as published)
            bases[base] = os.path.join(args.write, f"{name}-{base}.gguf")
            if not os.path.exists(bases[base]):
                print(f"writing {bases[base]}", file=sys.stderr, flush=True)
                shape = dict(FAMILIES[family], layers=args.layers or FAMILIES[family]["layers"])
                write_family(bases[base] + ".tmp", family, base, default, shape)
                os.replace(bases[base] + ".tmp", bases[base])
        for type_name in args.types:
            target = os.path.join(args.write, f"{name}-{type_name}.gguf")
            if type_name not in bases and not os.path.exists(target):
                print(f"writing {target} (llama.cpp's quantizer)", file=sys.stderr, flush=True)
                quantize_with_llama_cpp(bases["Q8_0"], target, FTYPES[type_name], args.quantize)
            written.append(target)
    for name in args.types:
        target = os.path.join(args.write, f"default-{name}.gguf")
        if not os.path.exists(target):
            print(f"writing {target} (llama.cpp's quantizer)", file=sys.stderr, flush=True)
            quantize_with_llama_cpp(default, target, FTYPES[name], args.quantize)
        written.append(target)
    print("\n".join(written))


def fail(message):
    """Bad input: one line on stderr, exit status 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


def set_isa(isa):
    """Force the tool's kernels to `isa`'s code path; torch's own ops must take the same (ATEN_CPU_CAPABILITY,
    which torch reads when imported, so it has to come from the environment): a comparison of AVX2 code paths
    with AVX-512 in torch's attention and norms would not be one. Exits 2 with one line when it cannot."""
    import torch

    from rungen.gguf import native_kernels

    wanted = {"avx2": "AVX2", "scalar": "DEFAULT"}.get(isa)
    have = torch.backends.cpu.get_cpu_capability()
    if wanted and have != wanted:
        fail(f"--isa {isa}: torch's own ops run {have} here; set ATEN_CPU_CAPABILITY={wanted.lower()} in the "
                 "environment too")
    if not native_kernels():
        fail(f"--isa {isa}: the native kernels are not available")
    try:
        torch.ops.rungen_ggml.set_isa(isa)
    except RuntimeError as error:
        fail(f"--isa {isa}: {str(error).splitlines()[0]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="*", default=[], help="GGUF files to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tg", type=int, default=128, help="new tokens of the decode row")
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens of the prompt-processing row")
    parser.add_argument("--tests", nargs="+", default=["tg", "pp"], choices=["tg", "pp"])
    parser.add_argument("--depth", type=int, default=0, help="tg after this many tokens of context (llama-bench's "
                        "-d), random ids")
    parser.add_argument("--llama-python", default=BENCH_PYTHON)
    parser.add_argument("--llama-bench", metavar="BINARY", help="llama.cpp's llama-bench as the reference instead of "
                        "llama-cpp-python (whose Python sampling loop costs a small model's decode ~1 ms a token)")
    parser.add_argument("--ik-llama-bench", metavar="BINARY", help="ik_llama.cpp's llama-bench as a second reference")
    parser.add_argument("--ik-tests", nargs="+", default=["tg", "pp"], choices=["tg", "pp"],
                        help="the tests ik_llama.cpp runs (of --tests)")
    parser.add_argument("--ik-args", default="", help="more arguments for ik_llama.cpp's llama-bench, e.g. '-rtr 1'")
    parser.add_argument("--isa", choices=("amx", "avx512vnni", "avx2", "scalar"),
                        help="the tool's kernel path (default: the best the CPU has); avx2 needs "
                        "ATEN_CPU_CAPABILITY=avx2 in the environment")
    parser.add_argument("--write", metavar="DIR", help="write the synthetic files into DIR instead")
    parser.add_argument("--quantize", metavar="BINARY", help="llama.cpp's llama-quantize for --write (default: "
                        "llama-cpp-python's llama_model_quantize in --llama-python's virtualenv)")
    parser.add_argument("--families", nargs="*", choices=list(FAMILIES),
                        default=[name for name, shape in FAMILIES.items() if "experts" not in shape],
                        help="--write: these families (default: the dense ones; the mixtures, 17 and 26 GB in Q4_0 "
                        "whole, by name, with --layers where memory or disk is short)")
    parser.add_argument("--layers", type=int, help="--write: this many of each family's layers (the published "
                        "count by default), for a machine short of memory or disk; the files' names say it")
    parser.add_argument("--types", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "IQ4_XS", "Q8_0",
                                                       "Q4_0"], choices=list(FTYPES))
    args = parser.parse_args()
    if args.write:
        write(args)
        return
    for binary in (args.llama_bench, args.ik_llama_bench):
        if binary and not os.access(binary, os.X_OK):
            fail(f"{binary}: not an executable file")
    import torch

    from rungen.gguf import native_kernels

    if args.isa:
        set_isa(args.isa)
    isa = torch.ops.rungen_ggml.isa() if native_kernels() else "none (torch's fallback)"
    reference = f"llama-bench ({args.llama_bench})" if args.llama_bench else f"llama-cpp-python ({args.llama_python})"
    if args.ik_llama_bench:
        reference += f"; ik_llama.cpp: llama-bench ({args.ik_llama_bench}{' ' + args.ik_args if args.ik_args else ''})"
    print(f"CPU flags: {cpu_flags()}; kernel path {isa}, torch's CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} threads; tg{args.tg}"
          f"{f' after {args.depth} tokens' if args.depth else ''}, pp{args.pp}; median of "
          f"{args.repeats} paired rounds; llama.cpp: {reference}")
    print("")
    references = REFERENCES if args.ik_llama_bench else REFERENCES[:1]
    print("| file | test | tool tok/s | " + " | ".join(f"{name} tok/s | ratio" for name in references) + " |")
    print("| --- | --- | ---: |" + " ---: | ---: |" * len(references))
    for path in args.model:
        try:
            how, rows = measure(path, args)
        except Exception as error:  # one file's failure (a refused type) is a row, not the end of the table
            print(f"| {os.path.basename(path)} | - | {type(error).__name__}: {str(error).splitlines()[0][:80]} |"
                  + " |" * 2 * len(references), flush=True)
            continue
        for kind, tool, refs in rows:
            cells = []
            for name in references:
                speed, ratio = refs.get(name, (None, None))
                cells += [f"{speed:.1f}" if speed else "-", f"{ratio:.2f}x" if ratio else "-"]
            name = os.path.basename(path) + ("" if how == "engine" else f" ({how})")
            print(f"| {name} | {kind}{args.tg if kind == 'tg' else args.pp} | {tool:.1f} | "
                  + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
