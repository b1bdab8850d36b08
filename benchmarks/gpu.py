"""Decode speed on a GPU: the tool's engine against transformers' generate() paths, on published model shapes with
random bfloat16 weights, beside the GPU's measured copy bandwidth.

    python -m benchmarks.gpu [--json FILE] [--shapes NAME ...] [--batches 1 16 64] [--new-tokens 64]
                             [--budget 300] [--device cuda]
    python -m benchmarks.gpu --quick --device cpu     # tiny shapes, a few tokens: checks the script end to end
    python tests/virtual_cuda.py -m benchmarks.gpu --quick   # the same on a GPU the CPU plays: its CUDA paths too

For every shape (transformers' LlamaConfig / Qwen3Config with the published sizes, the weights random and built
directly on the device: no download, no tokenizer; token ids are fed) and every batch: the time until every row has
its first token (first_token_ms: the batch's prefill), decode tokens/s, the step's
time against its bandwidth bound (weight bytes + key/value bytes read a step over the measured copy bandwidth), the
first call's extra time (compilation, graph capture, kernel selection) and peak GPU memory, for

- engine: the tool's rungen.engine.Engine over a rungen.loading.Loaded around the model (greedy, EOS ignored), as
  the command line, the session and the server decode (its rows say whether the keys/values sat in fixed slots and
  the steps replayed CUDA graphs, and the graphs' capture time); on CUDA also at batch 1 without the graphs
  (RUN_GENERATION_CUDA_GRAPHS=0), at the first two batches with each step read before the next is launched
  (RUN_GENERATION_OVERLAP=0), and at the second batch with each request prefilled alone
  (RUN_GENERATION_PREFILL_TOGETHER=0: its first_token_ms beside the default's); on the first shape, last, also with
  --quantize int8 at the first two batches;
- engine, transformers' layers: on CUDA, the engine with its decode step through transformers' modules
  (RUN_GENERATION_FUSED_STEP=0) instead of rungen/fused_step.py's fused layers, at the first two batches;
- engine, compiled step: on CUDA, the engine with its captured decode step compiled by torch.compile first
  (RUN_GENERATION_COMPILE=1: inductor fuses the elementwise operators between the matrix products), at
  --compile-batches, beside generate static+compile (the two compiled paths measured together);
- generate eager: transformers' generate(), greedy, min_new_tokens = max_new_tokens (EOS ignored);
- generate static+compile: the same with cache_implementation="static" (generate() then compiles the decode step
  on CUDA, CompileConfig's defaults: inductor, "reduce-overhead", i.e. CUDA graphs); batch 1 only unless
  --compile-batches says more (each batch is a compilation of its own);
- generate_batch: transformers' continuous batching, where the installed transformers has it, at the largest batch
  unless --cb-batches says more (prefill included in its tokens/s: it reports no first token; its manager kept
  between the two calls of a batch, so that the first call's extra time is its start and CUDA-graph warm-up);

and time to first token for a --ttft-tokens prompt (512) at batch 1 on the engine and through generate(). A GGUF row:
Llama-3.1-8B's shape written as Q4_0 by benchmarks/gguf_files.py's writer (random blocks, a synthetic byte-level
vocabulary of the published size), loaded through rungen.loading.load on the device (Q4_0 as 4-bit codes for torch's
int4 kernel, the embedding in its Q4_0 blocks, the Q6_K head as int8 codes for rungen/int8.py's kernel), decoding at
batch 1 on the engine and its time to first token (the 4-bit kernel over a prompt's rows), its load time and peak
memory beside the file's size, then at the second batch (wide_tokens_per_s), loaded twice in a row: in the 4-bit form
the load times faster at one row (the default; int4_form says which) and on rungen/int4_kernel.py's Triton kernel
(RUN_GENERATION_GPU_INT4=triton); and Llama-3.2-1B's
shape as Q8_0 (tied, as published: the table the head's int8 codes, which the lookup reads too), loaded twice, on the
int8 Triton kernel and de-quantized to bfloat16 (RUN_GENERATION_TRITON_INT8=0), the kernel's speed and memory against
what it replaced. A server row: `run_generation.py --serve` on the default model's shape written as a Q4_0 file (with a
ChatML template), 16 clients each streaming two chat completions (--new-tokens each), after a first such level
reported apart (first_level_*: the batch's growth captures the step at each size): output tokens/s, time to first
token (median and 95th percentile), time per output token, and the requests cut short (none expected; one that fails is
the row's error). Product rows: one layer's matrix product in each weight form at 1 to 4096 rows
(benchmarks/gpu_products.py). Last, while time is left, a mixture of experts: Qwen3-30B-A3B's shape cut to 8 of its
48 layers as Q4_0, its experts in codes (a decode step's chosen ones in the GEMV kernels' grouped launches and its
prompt's in the tiled kernels', where the Triton forms run), its bound counting the experts one token chooses; and
gpt-oss-20b's shape cut to 8 of its 24 layers as its published files hold it (MXFP4 experts, the rest Q8_0): its
experts in e2m1 codes two a byte, its sliding-window layers in the fixed slots, its steps CUDA graphs.

Each measurement is guarded: a failure prints one line and the run goes on. The run keeps to --budget seconds (300
by default: the whole script within 6 minutes on an H100/H200, a last measurement's overrun included), the goals'
rows first: the engine and eager generate() of every shape, the 8B shape's Q4_0 file (both kernels), the server, then
shape by shape (in the list's order, the smaller first: the 8B's compiles may take minutes) the paths whose first
call compiles or captures (generate static+compile and the engine's compiled step, generate_batch); then, while time
is left, the engine's variants (no CUDA graphs, no overlap, prefills alone, --quantize int8), the Q8_0 pair and the
product rows. What is skipped says so (--shapes NAME --no-products runs one shape's
rows in full). A first call of every path at every batch is timed and left out of the figures ("first_call_s": its
time beyond the measured call's). Every figure is also in --json FILE, rewritten after each measurement (a run cut
short keeps what it measured).
"""

import argparse
import contextlib
import gc
import inspect
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Published sizes (each model's config.json). SmolLM2-135M is the default model's shape.
SHAPES = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192),
                                   tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "llama-3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192),
                                   tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)),
}
# --quick: the same code on shapes a 2-core CPU runs in seconds.
QUICK_SHAPES = {
    "tiny-llama": ("llama", dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "tiny-qwen3": ("qwen3", dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
}
# The GGUF rows' files: benchmarks/gguf_files.py's FAMILIES form of Llama-3.1-8B and Llama-3.2-1B (tied, as published;
# and a tiny one for --quick: Q6_K's head needs rows of 256).
GGUF_SHAPES = {
    "llama-3.1-8b": (128256, dict(arch="llama", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128,
                                  rope_base=500000.0, eps=1e-5, tied=False)),
    "llama-3.2-1b": (128256, dict(arch="llama", layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64,
                                  rope_base=500000.0, eps=1e-5, tied=True)),
    "smollm2-135m": (49152, dict(arch="llama", layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3, head_dim=64,
                                 rope_base=100000.0, eps=1e-5, tied=True)),
    "tiny-llama": (1024, dict(arch="llama", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64,
                              rope_base=500000.0, eps=1e-5, tied=False)),
    # Qwen3-30B-A3B's shape cut to 8 of its 48 layers (3 GB in Q4_0: a file the run writes in seconds), and a tiny
    # mixture for --quick
    "qwen3-30b-a3b-8layers": (151936, dict(arch="qwen3moe", layers=8, hidden=2048, ffn=6144, heads=32, kv_heads=4,
                                           head_dim=128, rope_base=1000000.0, eps=1e-6, tied=False, qk_norm=True,
                                           experts=128, experts_used=8, expert_ffn=768)),
    "tiny-qwen3moe": (1024, dict(arch="qwen3moe", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64,
                                 rope_base=1000000.0, eps=1e-6, tied=False, qk_norm=True, experts=4, experts_used=2,
                                 expert_ffn=256)),
    # gpt-oss-20b's shape cut to 8 of its 24 layers (its published vocabulary; MXFP4 experts, the rest Q8_0:
    # llama-quantize's MXFP4_MOE, about 4.6 GB), and a tiny one for --quick
    "gpt-oss-20b-8layers": (201088, dict(arch="gpt-oss", layers=8, hidden=2880, ffn=2880, heads=64, kv_heads=8,
                                         head_dim=64, rope_base=150000.0, eps=1e-5, tied=False, experts=32,
                                         experts_used=4, expert_ffn=2880, context=131072, sliding_window=128,
                                         yarn=(32.0, 4096), biases=True)),
    "tiny-gpt-oss": (1024, dict(arch="gpt-oss", layers=2, hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64,
                                rope_base=150000.0, eps=1e-5, tied=False, experts=4, experts_used=2, expert_ffn=256,
                                context=4096, sliding_window=128, yarn=(32.0, 4096), biases=True)),
}
# The server row's file carries a chat template (ChatML, as SmolLM2-Instruct's).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


class Report:
    """The figures: rows printed as they come, the table at the end, all of it in --json FILE after each row."""

    def __init__(self, path, header):
        self.path, self.header, self.rows, self.notes = path, header, [], []

    def save(self):
        if not self.path:
            return
        with open(self.path + ".tmp", "w") as f:
            json.dump({**self.header, "rows": self.rows, "notes": self.notes}, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def add(self, **row):
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={fmt(v)}" for k, v in row.items() if v is not None), flush=True)
        self.save()

    def note(self, text):
        self.notes.append(text)
        print(f"note: {text}", flush=True)
        self.save()

    def table(self):
        columns = ("shape", "path", "batch", "tokens_per_s", "step_ms", "bound_ms", "of_bound", "ttft_ms",
                   "first_call_s", "peak_gib", "error")
        hidden = set(columns) | {"new_tokens", "total_s", "prompt_tokens"}
        print("")
        print("| " + " | ".join(columns) + " | more |")
        print("| " + " | ".join("---" if c in ("shape", "path", "error") else "---:" for c in columns) + " | --- |")
        for row in self.rows:
            more = ", ".join(f"{k} {fmt(v)}" for k, v in row.items() if k not in hidden and v is not None)
            print("| " + " | ".join(fmt(row.get(c), c) for c in columns) + f" | {more or '-'} |")
        for text in self.notes:
            print(f"- {text}")


def fmt(value, column=None):
    if value is None:
        return "-"
    if column == "of_bound" and isinstance(value, float):
        return f"{value:.0%}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


class Budget:
    def __init__(self, seconds):
        self.end = time.perf_counter() + seconds

    def left(self):
        return self.end - time.perf_counter()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def copy_bandwidth(device, size_bytes, repeats=10):
    """GB/s of a device-to-device copy of `size_bytes`, counting the bytes read and the bytes written (the median of
    `repeats` timed copies after two uncounted)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    source.fill_(1)
    target = torch.empty_like(source)
    times = []
    for number in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        if number >= 2:
            times.append(time.perf_counter() - start)
    del source, target
    return 2 * size_bytes / statistics.median(times) / 1e9


def make_config(shape, shapes):
    from transformers import LlamaConfig, Qwen3Config

    kind, sizes = shapes[shape]
    return (LlamaConfig if kind == "llama" else Qwen3Config)(**sizes)


def build_model(config, device, dtype):
    """transformers' model of `config` with random weights made on `device` (no host copy)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def weight_bytes(model):
    """Bytes of weights a decode step reads: every parameter and buffer once (a tied head once; --quantize's codes
    are buffers), less the input embedding when it is not the head (a step reads only its rows), and of a mixture's
    experts only the share one token chooses (num_experts_per_tok of num_experts)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    config = model.config.get_text_config(decoder=True)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)  # (Mixtral, gpt-oss)
    chosen = getattr(config, "num_experts_per_tok", None)
    if experts and chosen:
        held = sum(t.numel() * t.element_size() for module in model.modules()
                   if type(module).__name__.endswith("Experts") for t in [*module.parameters(), *module.buffers()])
        total -= held * (1 - chosen / experts)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()  # a table, or a GGUF file's blocks
    tensors = [*embedding.parameters(), *embedding.buffers()]
    read_by_head = {id(t) for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    if not any(id(t) in read_by_head for t in tensors):  # (tied: one table, or one set of codes)
        total -= sum(t.numel() * t.element_size() for t in tensors)
    return total


def kv_bytes_per_token(config, element_size):
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * element_size


class StubTokenizer:
    """What the engine asks of a tokenizer (bos_token_id, decode) for token ids that need no text."""

    pad_token = "<pad>"
    padding_side = "left"

    def __init__(self, config):
        self.bos_token_id, self.eos_token_id = config.bos_token_id, config.eos_token_id
        self.vocab_size = config.vocab_size

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return ""

    def __len__(self):
        return self.vocab_size


def loaded_around(model, tokenizer, device):
    from rungen.loading import Loaded, model_context

    return Loaded(model, tokenizer, model.config.model_type, device, model_context(model.config),
                  model.get_input_embeddings().num_embeddings)


def prompts(count, length, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 2, (count, length), generator=generator).tolist()


@contextlib.contextmanager
def environment(settings: dict):
    """The environment variables `settings` set within the block, as they were after it."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class EngineRunner:
    """The tool's engine over a Loaded: greedy requests, EOS ignored, all submitted at once and run on this
    thread (as the command line's prompts). `settings`: environment variables the engine reads when it is made
    (RUN_GENERATION_CUDA_GRAPHS, RUN_GENERATION_OVERLAP)."""

    def __init__(self, loaded, max_batch, settings=None):
        from rungen import engine as engine_module

        self.captured = 0.0  # capture seconds reported by the rows before
        with environment(settings or {}):
            self.engine = engine_module.Engine(loaded, max_batch=max_batch, max_queue=max_batch + 1,
                                               max_cache_tokens=sys.maxsize, prefix_cache_bytes=0, eos_ids=())

    def extra(self):
        """How the engine ran: keys/values in fixed slots or a padded batch; its layers fused or transformers'; CUDA
        graphs (compiled first or not) and their capture time (the compilation's included); whether steps overlapped
        the host's work."""
        from rungen import fused_step

        kv = self.engine.batch.kv
        graphs = getattr(kv, "graphs", None)
        state = "off" if graphs is None else "failed" if graphs.failed else "compiled" if graphs.compiled else "on"
        slots = getattr(kv, "slots", None)
        figures = dict(cache="slots" if slots is not None else "padded batch", graphs=state,
                       overlap=self.engine.batch.overlap,
                       layers="fused" if fused_step.fused(getattr(kv, "step", None)) else "transformers'")
        if slots is not None:  # the slots' buffers as allocated (a reserve of positions a row, rounded up)
            figures["cache_gib"] = sum(t.numel() * t.element_size() for t in slots.keys + slots.values) / 2**30
        if graphs is not None:  # this row's captures: the engine's total less the rows' before
            figures.update(graph_capture_s=graphs.capture_seconds - self.captured, graphs_held=len(graphs.graphs))
            self.captured = graphs.capture_seconds
        return figures

    def run(self, ids, new_tokens):
        """(start, the last row's first token, end): all rows prefill before the first decode step."""
        from rungen.requests import Request
        from rungen.sampling import Sampling

        requests = [Request(list(row), new_tokens, Sampling(temperature=0, ignore_eos=True), sink=lambda event: None,
                            deltas=False) for row in ids]
        start = time.perf_counter()
        for request in requests:
            self.engine.submit(request)
        self.engine.run_here()
        end = time.perf_counter()
        return start, max(request.first_token_at for request in requests), end


class GenerateRunner:
    """transformers' generate(), greedy, exactly new_tokens (min_new_tokens), a clock on every step."""

    def __init__(self, model, device, **kwargs):
        self.model, self.device, self.kwargs = model, device, kwargs

    def run(self, ids, new_tokens):
        from transformers import LogitsProcessorList

        from benchmarks.common import StepClock

        inputs = torch.tensor(ids, device=self.device)
        clock = StepClock()
        sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                logits_processor=LogitsProcessorList([clock]), **self.kwargs)
        sync(self.device)
        end = time.perf_counter()
        # the clock runs as each token is chosen: its first stamp is the prompt's pass done
        return start, clock.stamps[0] if clock.stamps else end, end


class BatchRunner:
    """transformers' generate_batch (continuous batching): no per-token clock, so (start, None, end). Its manager
    (a thread, its paged cache, its CUDA graphs) is kept between the calls of one batch size (persistent_manager), so
    that the first call's extra time is the manager's start and warm-up and the second call is generation."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.generated, self.size = 0, None
        self.persistent = "persistent_manager" in inspect.signature(model.generate_batch).parameters

    def close(self):
        destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
        if self.persistent and destroy is not None:
            destroy()

    def run(self, ids, new_tokens):
        import transformers
        from transformers import GenerationConfig

        if self.size != len(ids):  # a manager is sized for its first workload
            self.close()
            self.size = len(ids)
        # EOS -1: none (its own "disabled"), so every row makes new_tokens
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0, eos_token_id=-1)
        kwargs = {"persistent_manager": True} if self.persistent else {}
        if hasattr(transformers, "ContinuousBatchingConfig"):
            # blocks for this workload (256 positions each), not 90% of the free memory: a peak beside the others'
            blocks = -(-len(ids) * (len(ids[0]) + new_tokens) // 256) + 8
            kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig(num_blocks=blocks)
        sync(self.device)
        start = time.perf_counter()
        # (not under inference_mode: its manager thread writes its own tensors in place outside it)
        outputs = self.model.generate_batch(inputs=[list(row) for row in ids], generation_config=config,
                                            progress_bar=False, **kwargs)
        sync(self.device)
        end = time.perf_counter()
        # a request that fails is logged by transformers and left out or empty, never raised: count what came back
        self.generated = sum(len(getattr(output, "generated_tokens", None) or []) for output in outputs.values())
        if self.generated < len(ids) * new_tokens:
            raise RuntimeError(f"generate_batch returned {self.generated} of {len(ids) * new_tokens} tokens (its "
                               "log above says why)")
        return start, None, end


class Shape:
    """One shape's model on the device and what its bound needs."""

    def __init__(self, name, args, shapes):
        self.name, self.args, self.device = name, args, args.device
        self.config = make_config(name, shapes)
        self.model = build_model(self.config, self.device, args.dtype)
        self.weights = weight_bytes(self.model)
        self.kv_per_token = kv_bytes_per_token(self.config, torch.finfo(args.dtype).bits // 8)
        self.loaded = loaded_around(self.model, StubTokenizer(self.config), self.device)

    def bound_ms(self, batch, bandwidth):
        """The bandwidth bound of a decode step at mid-generation: the weights once, every row's keys and values."""
        positions = self.args.prompt_tokens + self.args.new_tokens / 2
        return (self.weights + batch * positions * self.kv_per_token) / (bandwidth * 1e9) * 1e3

    def close(self):
        self.model = self.loaded = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def decode_rows(report, shape, path, make_runner, batches, bandwidth, budget, reserve):
    """For each batch: a first (uncounted, timed) call, then the measured one; one row each."""
    args = shape.args
    runner = None
    for batch in batches:
        if budget.left() < reserve:
            report.add(shape=shape.name, path=path, batch=batch, error=f"skipped: {budget.left():.0f} s of the "
                       "budget left")
            continue
        try:
            reset_peak(shape.device)
            runner = runner or make_runner()
            ids = prompts(batch, args.prompt_tokens, shape.config.vocab_size, seed=batch)
            start, _, end = runner.run(ids, args.new_tokens)
            first_call = end - start
            start, first, end = runner.run(ids, args.new_tokens)
            steady = end - start
            row = dict(shape=shape.name, path=path, batch=batch, new_tokens=args.new_tokens,
                       first_call_s=max(0.0, first_call - steady), total_s=steady)
            if first is not None:  # every row's first token: the batch's prefill
                row["first_token_ms"] = (first - start) * 1e3
            if first is not None and args.new_tokens > 1 and end > first:
                step = (end - first) / (args.new_tokens - 1)
                row.update(tokens_per_s=batch / step, step_ms=step * 1e3)
            else:  # generate_batch: the whole call, prefill included
                tokens = getattr(runner, "generated", batch * args.new_tokens)
                row.update(tokens_per_s=tokens / steady, step_ms=None, note="prefill included")
            if bandwidth:
                row["bound_ms"] = shape.bound_ms(batch, bandwidth)
                if row.get("step_ms"):
                    row["of_bound"] = row["bound_ms"] / row["step_ms"]
            row["peak_gib"] = peak_gib(shape.device)
            if hasattr(runner, "extra"):
                row.update(runner.extra())
            report.add(**row)
        except Exception as error:  # one path's failure is a row, not the end of the run
            report.add(shape=shape.name, path=path, batch=batch, error=one_line(error))
            if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error):
                runner = None
            reset_peak(shape.device)
    return runner


def ttft_ms(runner, tokens, vocab):
    """Milliseconds to the first token of one `tokens`-token prompt at batch 1: one uncounted call, the median of
    three."""
    ids = prompts(1, tokens, vocab, seed=7)
    runner.run(ids, 1)
    times = []
    for _ in range(3):
        start, first, end = runner.run(ids, 1)
        times.append(((first or end) - start) * 1e3)
    return statistics.median(times)


def ttft_row(report, shape, path, runner):
    """Time to the first token of one --ttft-tokens prompt at batch 1."""
    args = shape.args
    try:
        report.add(shape=shape.name, path=path + " ttft", batch=1, prompt_tokens=args.ttft_tokens,
                   ttft_ms=ttft_ms(runner, args.ttft_tokens, shape.config.vocab_size))
    except Exception as error:
        report.add(shape=shape.name, path=path + " ttft", batch=1, error=one_line(error))


def open_shape(report, name, args, shapes, what):
    """The shape's model, or None (its failure a row)."""
    try:
        start = time.perf_counter()
        shape = Shape(name, args, shapes)
        print(f"{name}: built in {time.perf_counter() - start:.1f} s, {shape.weights / 1e9:.2f} GB of weights read a "
              f"step, {shape.kv_per_token / 1024:.0f} KiB of keys/values a position", flush=True)
        return shape
    except Exception as error:
        report.add(shape=name, path=what, error=one_line(error))
        return None


def cheap_paths(report, name, args, shapes, bandwidth, budget):
    """The engine and eager generate() on one shape at every batch, and their time to first token."""
    if budget.left() < 20:
        report.add(shape=name, path="engine, generate eager", error=f"skipped: {budget.left():.0f} s of the budget "
                   "left")
        return
    shape = open_shape(report, name, args, shapes, "engine, generate eager")
    if shape is None:
        return
    try:
        engine = decode_rows(report, shape, "engine", lambda: EngineRunner(shape.loaded, max(args.batches)),
                             args.batches, bandwidth, budget, reserve=10)
        if engine is not None:
            ttft_row(report, shape, "engine", engine)
        engine = None
        if args.device.type == "cuda":  # the step through transformers' modules, as before the fused layers
            from rungen.fused_step import FUSED_STEP_ENV

            decode_rows(report, shape, "engine, transformers' layers",
                        lambda: EngineRunner(shape.loaded, max(args.batches), {FUSED_STEP_ENV: "0"}),
                        args.batches[:2], bandwidth, budget, reserve=10)
        eager = decode_rows(report, shape, "generate eager", lambda: GenerateRunner(shape.model, args.device),
                            args.batches, bandwidth, budget, reserve=10)
        if eager is not None:
            ttft_row(report, shape, "generate eager", eager)
        eager = None
    finally:
        shape.close()


def engine_variants(report, name, args, shapes, bandwidth, budget):
    """What the engine's parts give, on CUDA: the engine without its CUDA graphs, without the overlap of steps, with
    prefills alone; on the first shape, --quantize int8 too."""
    if args.device.type != "cuda" and name != args.shapes[0]:
        return
    if budget.left() < 20:
        report.add(shape=name, path="engine variants", error=f"skipped: {budget.left():.0f} s of the budget left")
        return
    shape = open_shape(report, name, args, shapes, "engine variants")
    if shape is None:
        return
    try:
        if args.device.type == "cuda":
            from rungen.batch_cache import GRAPHS_ENV, PREFILL_ENV
            from rungen.decode import OVERLAP_ENV

            for path, settings, batches in (("engine, no CUDA graphs", {GRAPHS_ENV: "0"}, args.batches[:1]),
                                            ("engine, steps not overlapped", {OVERLAP_ENV: "0"}, args.batches[:2]),
                                            ("engine, prefills alone", {PREFILL_ENV: "0"}, args.batches[1:2])):
                decode_rows(report, shape, path,
                            lambda settings=settings: EngineRunner(shape.loaded, max(args.batches), settings),
                            batches, bandwidth, budget, reserve=10)
        if name == args.shapes[0]:
            int8_rows(report, shape, args, bandwidth, budget)
    finally:
        shape.close()
        torch._dynamo.reset()


def int8_rows(report, shape, args, bandwidth, budget):
    """--quantize int8 on the shape's model (in place: the last rows of the shape; on CUDA rungen/int8.py's Triton
    kernel): the engine at the first two batches, the bound counted on the int8 bytes."""
    from rungen.quantize import quantize_model

    path = "engine, --quantize int8"
    if budget.left() < 20:
        report.add(shape=shape.name, path=path, error=f"skipped: {budget.left():.0f} s of the budget left")
        return
    try:
        start = time.perf_counter()
        quantize_model(shape.model, "int8")
        shape.weights = weight_bytes(shape.model)
        layers = [m for m in shape.model.modules() if hasattr(m, "codes")]
        kernel = "Triton" if any(getattr(m, "kernel", None) for m in layers) else "widened" if \
            args.device.type == "cuda" else "CPU"
        print(f"{shape.name}: --quantize int8 in {time.perf_counter() - start:.1f} s ({kernel} products), "
              f"{shape.weights / 1e9:.2f} GB read a step", flush=True)
    except Exception as error:
        report.add(shape=shape.name, path=path, error=one_line(error))
        return
    decode_rows(report, shape, f"{path} ({kernel})", lambda: EngineRunner(shape.loaded, max(args.batches)),
                args.batches[:2], bandwidth, budget, reserve=10)


def costly_paths(report, name, args, shapes, bandwidth, budget):
    """transformers' fastest paths: generate() with a static cache, compiled by generate() itself on CUDA
    (CompileConfig's defaults), at --compile-batches, beside the engine with its captured step compiled by
    torch.compile (RUN_GENERATION_COMPILE=1, on CUDA); then generate_batch at --cb-batches. Each first call compiles
    or captures: tens of seconds."""
    if budget.left() < min(args.compile_reserve, 20):
        report.add(shape=name, path="generate static+compile, generate_batch", error=f"skipped: {budget.left():.0f} s "
                   "of the budget left")
        return
    shape = open_shape(report, name, args, shapes, "generate static+compile, generate_batch")
    if shape is None:
        return
    batch_runner = None
    try:
        if args.device.type != "cuda":
            report.note(f"{name}: generate() compiles a static cache's step on CUDA only; the static+compile rows "
                        f"on {args.device.type} are the static cache uncompiled")
        decode_rows(report, shape, "generate static+compile",
                    lambda: GenerateRunner(shape.model, args.device, cache_implementation="static"),
                    args.compile_batches, bandwidth, budget, reserve=args.compile_reserve)
        torch._dynamo.reset()  # the graphs and their memory go before the next path
        if args.device.type == "cuda":
            from rungen.batch_cache import COMPILE_ENV

            decode_rows(report, shape, "engine, compiled step",
                        lambda: EngineRunner(shape.loaded, max(args.batches), {COMPILE_ENV: "1"}),
                        args.compile_batches, bandwidth, budget, reserve=args.compile_reserve)
            torch._dynamo.reset()
        if not hasattr(shape.model, "generate_batch"):
            report.note(f"generate_batch: not in this transformers ({transformers_version()}), no row")
        elif args.device.type != "cuda" and name != args.shapes[-1]:
            pass  # tens of seconds a call on a CPU (its manager's start and polling): checked on one shape
        else:
            batch_runner = decode_rows(report, shape, "generate_batch", lambda: BatchRunner(shape.model, args.device),
                                       args.cb_batches, bandwidth, budget, reserve=20)
    finally:
        if batch_runner is not None:
            try:
                batch_runner.close()
            except Exception as error:
                report.note(f"{name}: closing generate_batch's manager: {one_line(error)}")
        shape.close()
        torch._dynamo.reset()


def gguf_row(report, args, bandwidth, budget, name, qtype, variants, reserve):
    """`name`'s shape (GGUF_SHAPES) written as a `qtype` GGUF file, loaded through the tool's own loader on the
    device once per variant ((path label, environment variables set while it loads and runs)), decoding at batch 1
    on the engine; `reserve`: the seconds of the budget the row needs to start."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        report.note(f"GGUF {qtype} row: the gguf package is not importable here, no row")
        return
    if budget.left() < reserve:
        for label, _ in variants:
            report.add(shape=name, path=label, error=f"skipped: {budget.left():.0f} s of the budget left")
        return
    from benchmarks.gguf_files import synthetic_tokenizer_fields, write_family

    vocab, family = GGUF_SHAPES[name]
    path = os.path.join(args.gguf_folder, f"{name}-{qtype}.gguf")  # written once, read by each call's variants
    try:
        if not os.path.isfile(path):
            start = time.perf_counter()
            write_family(path, family["arch"], qtype, synthetic_tokenizer_fields(vocab), shape=family)
            print(f"{name} {qtype} GGUF: {os.path.getsize(path) / 2**30:.2f} GiB written in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        for number, (label, settings) in enumerate(variants):
            if number and budget.left() < reserve / 2:  # a second load of the same file: about half the row
                report.add(shape=name, path=label, error=f"skipped: {budget.left():.0f} s of the budget left")
                continue
            try:
                with environment(settings):
                    report.add(**gguf_variant(args, bandwidth, name, path, label))
            except Exception as error:
                report.add(shape=name, path=label, error=one_line(error))
    except Exception as error:
        report.add(shape=name, path=variants[0][0], error=one_line(error))


def gguf_variant(args, bandwidth, name, path, label):
    """One load of the GGUF file at `path`, its batch-1 decode on the engine and its first token of a --ttft-tokens
    prompt, then its decode at the second of --batches (wide_tokens_per_s): the row's figures."""
    from rungen.loading import load

    loaded = runner = None
    try:
        reset_peak(args.device)
        start = time.perf_counter()
        loaded = load(path, device=args.device)
        load_s = time.perf_counter() - start
        load_peak = peak_gib(args.device)
        # (the CPU's own GGUF model holds buffers only)
        dtype = next(t.dtype for t in [*loaded.model.parameters(), *loaded.model.buffers()] if t.is_floating_point())
        runner = EngineRunner(loaded, 1)
        ids = prompts(1, args.prompt_tokens, loaded.vocab_size)
        reset_peak(args.device)
        start, _, end = runner.run(ids, args.new_tokens)
        first_call = end - start
        start, first, end = runner.run(ids, args.new_tokens)
        step = (end - first) / max(1, args.new_tokens - 1)
        row = dict(shape=name, path=label, batch=1, new_tokens=args.new_tokens, tokens_per_s=1 / step,
                   step_ms=step * 1e3, first_call_s=max(0.0, first_call - (end - start)), load_s=load_s,
                   file_gib=os.path.getsize(path) / 2**30, dtype=str(dtype).removeprefix("torch."),
                   model=type(loaded.model).__name__, load_peak_gib=load_peak, peak_gib=peak_gib(args.device),
                   weight_gib=weight_bytes(loaded.model) / 2**30, int4_form=int4_form(loaded.model),
                   **runner.extra())
        if "cache_gib" in row:  # the goal: GPU memory at most 1.3x the file and the cache
            row["memory_ratio"] = row["peak_gib"] / (row["file_gib"] + row["cache_gib"])
        # (after the peak's reading: the prompt's rows make activations of their own; a failure leaves the decode's)
        try:
            row.update(ttft_tokens=args.ttft_tokens, ttft_ms=ttft_ms(runner, args.ttft_tokens, loaded.vocab_size))
        except Exception as error:
            row["ttft_error"] = one_line(error)
        runner = None
        try:  # the second batch's rows, where torch's int4 kernel grows with the rows (benchmarks/gpu_products.py)
            batch = args.batches[1] if len(args.batches) > 1 else args.batches[0]
            runner = EngineRunner(loaded, batch)
            ids = prompts(batch, args.prompt_tokens, loaded.vocab_size)
            runner.run(ids, args.new_tokens)
            _, first, end = runner.run(ids, args.new_tokens)
            row.update(wide_batch=batch, wide_tokens_per_s=batch / ((end - first) / max(1, args.new_tokens - 1)))
        except Exception as error:
            row["wide_error"] = one_line(error)
        if bandwidth and args.device.type == "cuda":  # the weights as the model holds them are what a step reads
            kv = kv_bytes_per_token(loaded.model.config, torch.finfo(dtype).bits // 8)
            row["bound_ms"] = (row["weight_gib"] * 2**30 + (args.prompt_tokens + args.new_tokens / 2) * kv) / (
                bandwidth * 1e9) * 1e3
            row["of_bound"] = row["bound_ms"] / row["step_ms"]
        return row
    finally:
        loaded = runner = None  # noqa: F841
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()


def int4_form(model):
    """The 4-bit layers' form in `model`: "tinygemm", "Triton", both, or "none"."""
    kinds = {type(module).__name__ for module in model.modules()}
    forms = [name for name, kind in (("tinygemm", "TinyGemmLinear"), ("Triton", "CudaInt4Linear")) if kind in kinds]
    return " and ".join(forms) or "none"


def server_row(report, args, budget):
    """The server on the device, as a user starts it: `run_generation.py --serve` on the default model's shape
    written as a Q4_0 GGUF file (random blocks, a synthetic byte-level vocabulary, a ChatML template), and
    --server-clients clients each sending two streaming chat completions back to back (greedy, EOS ignored,
    --new-tokens each). Every token's log-probability is asked for, so that each token is a chunk of its own: the
    text of random bytes often ends in an unfinished character, which the server holds back. A first request
    (graph capture) is left out, and so is a first level of as many clients (the batch growing to them captures the
    step anew at each size of rows: its figures reported as first_level_*). Time to first token: from the request to
    its first token's chunk. `lost`: requests that came back short (of both levels); a request that fails makes the
    row an error naming it."""
    name = "tiny-llama" if args.quick else "smollm2-135m"
    path_name = f"server Q4_0, {args.server_clients} streaming clients"
    try:
        import gguf  # noqa: F401
        import httpx
    except ImportError as error:
        report.note(f"server row: {one_line(error)}, no row")
        return
    if budget.left() < args.server_reserve:
        report.add(shape=name, path=path_name, error=f"skipped: {budget.left():.0f} s of the budget left")
        return
    import subprocess

    from gguf import GGUFValueType

    from benchmarks.batch_throughput import PROMPTS, free_port
    from benchmarks.gguf_files import synthetic_tokenizer_fields, write_family
    from benchmarks.serve import SCRIPT, level, one_request, wait_healthy

    vocab, family = GGUF_SHAPES[name]
    folder = tempfile.mkdtemp(prefix="gpu_bench_server_", dir=args.scratch)
    path, log = os.path.join(folder, f"{name}-Q4_0.gguf"), os.path.join(folder, "server.log")
    process = None
    try:
        fields = synthetic_tokenizer_fields(vocab) + [("tokenizer.chat_template", CHATML, GGUFValueType.STRING, None)]
        write_family(path, "llama", "Q4_0", fields, shape=family)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as stderr:
            process = subprocess.Popen([sys.executable, SCRIPT, "--serve", "--port", str(port), "--model_name_or_path",
                                        path, "--max_batch", str(args.server_clients)], stdout=subprocess.DEVNULL,
                                       stderr=stderr, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        start = time.perf_counter()
        wait_healthy(url, process, seconds=max(10, min(60, budget.left() - 10)))
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        one_request(url, model, PROMPTS[0], args.new_tokens, logprobs=True)
        warm = time.perf_counter() - start
        # A first level at full concurrency: the batch's growth (1, 2, 4, 8, 16 rows) captures the step's graphs
        # anew at each size, which a serving process does once; its figures are reported apart.
        first = level(url, model, args.server_clients, args.new_tokens, True, logprobs=True)
        figures = level(url, model, args.server_clients, args.new_tokens, True, logprobs=True)
        row = dict(shape=name, path=path_name, batch=args.server_clients, new_tokens=args.new_tokens,
                   requests=2 * args.server_clients, lost=figures["short"] + first["short"],
                   tokens_per_s=figures["tokens_per_s"], ttft_ms=figures["ttft_p50"] * 1e3,
                   ttft_p95_ms=figures["ttft_p95"] * 1e3, tpot_ms=figures["tpot"] * 1e3, first_call_s=warm,
                   first_level_tokens_per_s=first["tokens_per_s"], first_level_ttft_ms=first["ttft_p50"] * 1e3,
                   first_level_tpot_ms=first["tpot"] * 1e3)
        report.add(**row)
    except Exception as error:
        tail = ""
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
            tail = f" (server: {lines[-1][:200]})" if lines else ""
        report.add(shape=name, path=path_name, error=one_line(error) + tail)
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def transformers_version():
    try:
        import transformers

        return transformers.__version__
    except Exception as error:  # pragma: no cover
        return one_line(error)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE (JSON)")
    parser.add_argument("--shapes", nargs="+", help=f"of {', '.join(SHAPES)} (default: all; --quick: "
                        f"{', '.join(QUICK_SHAPES)})")
    parser.add_argument("--batches", nargs="+", type=int, help="decode batches (default: 1 16 64; --quick: 1 2)")
    parser.add_argument("--compile-batches", nargs="+", type=int, help="batches of the compiled path (default: 1)")
    parser.add_argument("--cb-batches", nargs="+", type=int, help="batches of generate_batch (default: the largest "
                        "of --batches)")
    parser.add_argument("--new-tokens", type=int, help="new tokens a row (default 64; --quick: 6)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens of the decode rows (default 32; --quick 8)")
    parser.add_argument("--ttft-tokens", type=int, help="prompt tokens of the first-token rows (default 512; "
                        "--quick 32)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--budget", type=float, default=300.0, help="seconds the run keeps to (default 300)")
    parser.add_argument("--compile-reserve", type=float, default=75.0,
                        help="seconds a compiled row needs at least to start (default 75)")
    parser.add_argument("--gguf-reserve", type=float, default=120.0,
                        help="seconds the GGUF row needs at least to start (default 120)")
    parser.add_argument("--int8-reserve", type=float, default=60.0,
                        help="seconds the GGUF Q8_0 rows need at least to start (default 60)")
    parser.add_argument("--moe-reserve", type=float, default=60.0,
                        help="seconds of the budget the mixture-of-experts GGUF row needs to start (default 60)")
    parser.add_argument("--no-gguf", action="store_true", help="leave the GGUF rows out")
    parser.add_argument("--server-clients", type=int, help="streaming clients of the server row (default 16; "
                        "--quick: 2)")
    parser.add_argument("--server-reserve", type=float, default=45.0,
                        help="seconds the server row needs at least to start (default 45)")
    parser.add_argument("--no-server", action="store_true", help="leave the server row out")
    parser.add_argument("--no-products", action="store_true", help="leave out the matrix products alone "
                        "(benchmarks/gpu_products.py)")
    parser.add_argument("--copy-gb", type=float, help="bytes of the bandwidth copy's source, GB (default 2; --quick "
                        "0.05)")
    parser.add_argument("--scratch", default=None, help="folder for the GGUF file (default: the system's temporary)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few tokens (checks the script on a CPU)")
    args = parser.parse_args(argv)
    # What each load chose and why (the 4-bit form and its times at one row, GEMV or tiled, the fused layers or not):
    # the tool's info lines, on stderr beside the rows.
    logging.basicConfig(format="%(name)s: %(message)s")
    for name in ("run_generation", "rungen"):
        logging.getLogger(name).setLevel(logging.INFO)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    args.shapes = args.shapes or list(shapes)
    unknown = [name for name in args.shapes if name not in shapes]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(shapes)}")
    args.batches = args.batches or ([1, 2] if args.quick else [1, 16, 64])
    args.compile_batches = args.compile_batches or [1]
    args.cb_batches = args.cb_batches or [max(args.batches)]
    args.new_tokens = args.new_tokens or (6 if args.quick else 64)
    args.server_clients = args.server_clients or (2 if args.quick else 16)
    args.prompt_tokens = args.prompt_tokens or (8 if args.quick else 32)
    args.ttft_tokens = args.ttft_tokens or (32 if args.quick else 512)
    args.copy_gb = args.copy_gb or (0.05 if args.quick else 2.0)
    args.dtype = getattr(torch, args.dtype)
    try:
        args.device = torch.device(args.device)
        if args.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available (torch " + torch.__version__ + "); --device cpu --quick runs "
                               "the script on the CPU, tests/virtual_cuda.py on a GPU the CPU plays")
        torch.empty(1, device=args.device)
    except Exception as error:
        print(f"--device {args.device}: {one_line(error)}", file=sys.stderr)
        return 2
    budget = Budget(args.budget)

    if args.device.type == "cuda":
        properties = torch.cuda.get_device_properties(args.device)
        gpu = f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, {properties.multi_processor_count} SMs"
    else:
        gpu = f"none ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)"
    header = dict(device=gpu, torch=torch.__version__, transformers=transformers_version(),
                  python=platform.python_version(), dtype=str(args.dtype).removeprefix("torch."),
                  new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, ttft_tokens=args.ttft_tokens,
                  batches=args.batches, compile_batches=args.compile_batches, cb_batches=args.cb_batches,
                  shapes=args.shapes)
    report = Report(args.json, header)
    print(f"device: {gpu}; torch {torch.__version__}, transformers {header['transformers']}, Python "
          f"{header['python']}; {header['dtype']} random weights; prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, greedy, EOS ignored", flush=True)
    bandwidth = None
    try:
        bandwidth = copy_bandwidth(args.device, int(args.copy_gb * 1e9))
        header["copy_gb_per_s"] = bandwidth
        print(f"copy bandwidth: {bandwidth:.0f} GB/s (a {args.copy_gb:g} GB device-to-device copy, bytes read + "
              "written)", flush=True)
    except Exception as error:
        report.note(f"copy bandwidth: {one_line(error)}; no bound figures")
    report.save()

    args.gguf_folder = tempfile.mkdtemp(prefix="gpu_bench_gguf_", dir=args.scratch)
    gguf_8b = "tiny-llama" if args.quick else "llama-3.1-8b"
    try:
        # The goals' rows first: the engine and eager generate() of every shape, the 8B shape's Q4_0 file, the
        # server, then transformers' compiled paths, shape by shape in the list's order (the smaller first: their
        # compiles take seconds, the 8B's may take minutes).
        for name in args.shapes:
            cheap_paths(report, name, args, shapes, bandwidth, budget)
        if args.no_gguf:
            report.note("GGUF rows: left out (--no-gguf)")
        else:
            # the form the load times faster at one row (the default: int4_form says which) and
            # rungen/int4_kernel.py's Triton kernel, on the same file
            gguf_row(report, args, bandwidth, budget, gguf_8b, "Q4_0",
                     [("gguf Q4_0 engine", {}),
                      ("gguf Q4_0 engine, int4 Triton kernel", {"RUN_GENERATION_GPU_INT4": "triton"})],
                     args.gguf_reserve)
        if args.no_server:
            report.note("server row: left out (--no-server)")
        else:
            server_row(report, args, budget)
        for name in args.shapes:
            costly_paths(report, name, args, shapes, bandwidth, budget)
        # Then, while time is left, what the tool's parts give: the engine without each, its step compiled, int8;
        # the other kernels on the same files; each weight form's product alone.
        for name in args.shapes:
            engine_variants(report, name, args, shapes, bandwidth, budget)
        if not args.no_gguf:
            # The int8 kernel against the same weights de-quantized to bfloat16 (what it replaced), paired in one run.
            gguf_row(report, args, bandwidth, budget, "tiny-llama" if args.quick else "llama-3.2-1b", "Q8_0",
                     [("gguf Q8_0 engine, int8 kernel", {}),
                      ("gguf Q8_0 engine, de-quantized", {"RUN_GENERATION_TRITON_INT8": "0"})], args.int8_reserve)
        if args.no_products:
            report.note("product rows: left out (--no-products)")
        else:
            from benchmarks.gpu_products import product_rows

            with torch.inference_mode():
                product_rows(report.add, args.device, args.quick, budget.left)
        if not args.no_gguf:
            # A mixture of experts: each layer's experts in codes (its bound counts the experts one token chooses).
            gguf_row(report, args, bandwidth, budget, "tiny-qwen3moe" if args.quick else "qwen3-30b-a3b-8layers",
                     "Q4_0", [("gguf Q4_0 mixture of experts, engine", {})], args.moe_reserve)
            # gpt-oss: its MXFP4 experts in e2m1 codes two a byte, its sliding layers in the fixed slots
            gguf_row(report, args, bandwidth, budget, "tiny-gpt-oss" if args.quick else "gpt-oss-20b-8layers",
                     "MXFP4_MOE", [("gguf MXFP4 gpt-oss, engine", {})], args.moe_reserve)
    finally:
        shutil.rmtree(args.gguf_folder, ignore_errors=True)
    report.header["seconds"] = args.budget - budget.left()
    report.save()
    report.table()
    print(f"\n{report.header['seconds']:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
