"""Running the tool the way users do: in-process through its entry point (run_main), or as a subprocess
(run_cli) where a real process is the point; and a memo that loads each model once per test session."""

import contextlib
import copy
import dataclasses
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback

import pytest
from gguf import GGMLQuantizationType as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "run_generation.py")
SEED_TYPES = ["gpt2", "ctrl", "openai-gpt", "xlnet", "xlm", "gptj", "bloom", "llama", "opt"]
# What each type needs beyond a prompt to run non-interactively.
TYPE_ARGS = {"xlm": ["--xlm_language", "en"]}


def cli_env(cache_home=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if cache_home:
        env["XDG_CACHE_HOME"] = str(cache_home)
    return env


def wait_until_healthy(url, tries=600):
    """Returns once a server started in another process answers GET /health with 200 (or after `tries` polls:
    the test's next request then fails with what is wrong)."""
    import time

    import httpx

    for _ in range(tries):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def run_cli(args, stdin=None, cache_home=None, timeout=600):
    """Runs run_generation.py; stdin is bytes or str (None: no stdin, like CI)."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        env=cli_env(cache_home),
        timeout=timeout,
    )


@dataclasses.dataclass
class Result:
    """What a run of the tool leaves behind, in-process or not: the fields of subprocess.run's result."""

    returncode: int
    stdout: bytes
    stderr: bytes


@contextlib.contextmanager
def _root_logging_to(stream):
    """main()'s logging.basicConfig reaches `stream` only on a root logger without handlers: clear them for the
    run (pytest's capture handlers included), and put back handlers, level and transformers' verbosity after."""
    from transformers.utils import logging as transformers_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    verbosity = transformers_logging.get_verbosity()
    transformers_handler = transformers_logging._default_handler  # transformers' own handler keeps its stream
    transformers_stream = transformers_handler.stream if transformers_handler else None
    root.handlers = []
    if transformers_handler:
        transformers_handler.setStream(stream)
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        transformers_logging.set_verbosity(verbosity)
        if transformers_handler:
            transformers_handler.setStream(transformers_stream)


def run_main(args, stdin=None, cache_home=None):
    """Runs the tool in this process as run_cli runs it as a subprocess: the entry point run_generation.cli
    with argv, stdin as bytes or str (None: empty, like CI), stdout and stderr captured, the subprocess's
    environment; returns a Result with its exit code."""
    import run_generation

    if isinstance(stdin, str):
        stdin = stdin.encode()
    # sys.stdin has .buffer (prompts are read as bytes) and is no terminal, as a pipe; stdout and stderr
    # encode as Python's own streams do in a UTF-8 locale.
    fake_stdin = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8")
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in cli_env(cache_home).items():
            if os.environ.get(name) != value:
                patch.setenv(name, value)
        patch.setattr(sys, "argv", [SCRIPT, *args])
        patch.setattr(sys, "stdin", fake_stdin)
        patch.setattr(sys, "stdout", out)
        patch.setattr(sys, "stderr", err)
        with _root_logging_to(err):
            try:
                run_generation.cli(list(args))
                returncode = 0
            except SystemExit as exit_:  # as the interpreter turns it into an exit status
                code = exit_.code
                if code is None or isinstance(code, int):
                    returncode = code or 0
                else:
                    print(code, file=err)
                    returncode = 1
            except Exception:  # what a process would print before exiting with 1
                traceback.print_exc(file=err)
                returncode = 1
        out.flush()
        err.flush()
    return Result(returncode, out.buffer.getvalue(), err.buffer.getvalue())


class LoadMemo:
    """A stand-in for the loader main() calls that loads each model once per test session and hands every
    caller a deep copy (main changes the model in place: --quantize swaps layers, --jit patches forward).

    The key is the repr of every argument, XDG_CACHE_HOME (where the default model is cached) and the
    RUN_GENERATION_* variables (some choose the forms a GPU load keeps: RUN_GENERATION_GPU_INT4...). Placement
    over devices (device_map: accelerate's hooks and an offload folder on disk) is loaded afresh every time,
    and so is a load that fails. A checkpoint rewritten in place under the same path would be missed: tests
    write changed checkpoints to new directories."""

    def __init__(self, load):
        self.load = load
        self.loaded = {}  # key -> Loaded, never handed out itself
        self.hits = self.misses = 0

    def __call__(self, *args, **kwargs):
        if kwargs.get("device_map"):
            return self.load(*args, **kwargs)
        settings = sorted((name, value) for name, value in os.environ.items() if name.startswith("RUN_GENERATION_"))
        key = repr(args) + repr(sorted(kwargs.items())) + repr(os.environ.get("XDG_CACHE_HOME")) + repr(settings)
        if key in self.loaded:
            self.hits += 1
            return copy.deepcopy(self.loaded[key])
        loaded = self.load(*args, **kwargs)
        self.misses += 1
        self.loaded[key] = copy.deepcopy(loaded)
        return loaded


def gguf_header_dir(cache_home):
    """The default model's cached GGUF header (config, tokenizer, tensor table) in a cache home, or None."""
    cached = os.path.join(cache_home, "run_generation", "gguf")
    names = sorted(os.listdir(cached)) if os.path.isdir(cached) else []
    return os.path.join(cached, names[0]) if names else None


def default_model_dir(cache_home):
    """The default model's float checkpoint (--dequantize) in a cache home (None before the first such run)."""
    cached = os.path.join(cache_home, "run_generation")
    names = sorted(os.listdir(cached)) if os.path.isdir(cached) else []
    found = [name for name in names if name.startswith("SmolLM2-")]
    return os.path.join(cached, found[0]) if found else None


def tiny_args(tiny_models, model_type, *extra, with_type=True):
    args = ["--model_name_or_path", tiny_models[model_type]]
    if with_type:
        args += ["--model_type", model_type]
    return args + TYPE_ARGS.get(model_type, []) + list(extra)


def blocks(stdout):
    """Splits the original script's text output into {header: text}."""
    out, header = {}, None
    for line in stdout.decode().splitlines(keepends=True):
        if line.startswith("=== ") and line.rstrip().endswith(" ==="):
            header = line.strip()
            out[header] = ""
        else:
            assert header is not None, f"text before the first header: {line!r}"
            out[header] += line
    return {h: t[:-1] if t.endswith("\n") else t for h, t in out.items()}


def jsonl(stdout):
    return [json.loads(line) for line in stdout.decode().splitlines()]


def error_line(result):
    """The last stderr line, which must be the tool's one-line error, with no traceback before it."""
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


def to_blocks(layer, rng):
    """Replaces a llama-like decoder `layer`'s linear weights by Q8_0/Q4_1 blocks of random weights (as the GGUF
    loader holds them: Q4_1 rows interleaved where the native kernels take them), its norms (qwen3's per-head ones
    too) by random ones. phi3's q/k/v and gate/up are one projection each, as its file holds them."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from rungen.gguf.blocks import GGMLLinear

    qtypes = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "qkv_proj": "Q8_0", "o_proj": "Q4_1",
              "gate_proj": "Q4_1", "up_proj": "Q4_1", "gate_up_proj": "Q4_1", "down_proj": "Q8_0"}
    for parent in (layer.self_attn, layer.mlp):
        for name, linear in list(parent.named_children()):
            if name not in qtypes:
                continue
            weights = rng.standard_normal((linear.out_features, linear.in_features)).astype(np.float32) * 0.1
            qtype = GGMLQuantizationType[qtypes[name]]
            blocks = torch.from_numpy(quantize(weights, qtype)).reshape(linear.out_features, -1)
            bias = None if linear.bias is None else torch.randn(linear.out_features) * 0.1
            setattr(parent, name, GGMLLinear(blocks, qtype, linear.in_features, bias))
            getattr(parent, name).interleave()
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)]
    for norm in norms:
        norm.weight.data = torch.rand(norm.weight.shape[0]) + 0.5


# The block types the gguf package quantizes; the others' fixtures are random bytes with their scales set (float16,
# MXFP4's exponent byte).
SIMPLE = (T.Q4_1, T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1)


def blocks_for(qtype, rows, in_features, seed=0, kind="random"):
    """uint8 [rows, row_bytes] as a GGUF file holds them. kind: random, zero-block or zeros; for the types the gguf
    package quantizes also extremes (+-3e3) or high (the largest codes); for raw types max (every other byte 0xFF:
    the largest codes, scales and mins) or min (0x00: the smallest; IQ4's -127, Q3_K's scale -32 and code -4,
    MXFP4's 0)."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    from benchmarks.gguf_files import place_scales

    rng = np.random.default_rng(seed)
    if qtype in SIMPLE:
        w = rng.standard_normal((rows, in_features)).astype(np.float32) * 0.05
        if kind == "extremes":
            w = np.where(rng.random(w.shape) < 0.5, -1.0, 1.0).astype(np.float32) * 3e3
            w[:, 5] = 0
        if kind == "zero-block":  # one block of each row all zeros: scale 0
            w[:, 32:64] = 0
        if kind == "zeros":
            w[:] = 0
        if kind == "high":  # one low value a block, the others at the top: the largest codes (15, 31, 119)
            w[:] = 0.9375
            w[:, ::32] = -1
        return torch.from_numpy(quantize(w, qtype)).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, in_features // block, size), dtype=np.uint8)
    if kind == "extremes":  # every byte all zeros or all ones: codes, scales and mins at their ends
        raw = np.where(rng.random(raw.shape) < 0.5, 0, 255).astype(np.uint8)
        # The largest integer sums: the first rows' codes all at the top (Q6_K at q - 32 = -32, scales -128).
        raw[:8] = 0 if qtype == T.Q6_K else 255
        if qtype == T.Q6_K:
            raw[:8, :, 192:208] = 0x80
    scales = (rng.random((rows, in_features // block, 2)) * 0.01).astype(np.float16)
    if kind == "zero-block":
        scales[:, 0] = 0
    if kind == "zeros":
        raw[:] = 0
        scales[:] = 0
    if kind in ("max", "min"):
        raw[:] = 0xFF if kind == "max" else 0
    return torch.from_numpy(place_scales(raw, qtype, scales).reshape(rows, -1))


def padded_prompt_and_steps(model, cache=None, positions=False):
    """The logits of `model` over a left-padded prompt of two rows and two decoding steps after it, on `cache` (by
    default the one rungen.kvcache.new_cache gives it). `positions`: each row's positions passed as they are when
    left out (0, 1, ... with the padding), for a model that would count them from the mask instead (Qwen3-VL's)."""
    import torch

    from rungen.kvcache import new_cache

    ids = torch.tensor([[0, 0, 5, 9, 13, 2], [7, 3, 5, 9, 13, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    cache, out = new_cache(model) if cache is None else cache, []

    def at(first, count):
        return {"position_ids": torch.arange(first, first + count).expand(2, count)} if positions else {}

    with torch.no_grad():
        out.append(model(ids, attention_mask=mask, past_key_values=cache, **at(0, 6)).logits)
        for number, step in enumerate((11, 17)):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
            out.append(model(torch.tensor([[step], [step + 1]]), attention_mask=mask, past_key_values=cache,
                             **at(6 + number, 1)).logits)
    return out


def assert_float16_cache_as_rounded(model):
    """A GGUF file's model on transformers' layers and the native attention: the engine's cache (new_cache) holds
    float16 keys and values, and the logits over it are, bit for bit, the same model's over transformers' own cache
    rounding what it stores to float16 (stored_as_own: the attention then reads float32 values)."""
    import torch
    from transformers import DynamicCache

    from rungen.kvcache import holding, new_cache

    cache = new_cache(model)
    half = padded_prompt_and_steps(model, cache)
    assert {layer.keys.dtype for layer in holding(cache)} == {torch.float16}
    with stored_as_own():
        rounded = padded_prompt_and_steps(model, DynamicCache(config=model.config))
    for got, wanted in zip(half, rounded):
        assert torch.equal(got, wanted)


def plain_grouped_kernel(widened=None):
    """A stand-in for the GPU's Triton kernels in plain products (`widened`: rungen.int8.widened by default, the
    4-bit form's widened4), with their grouped launches (rungen/code_kernels.py's run.grouped and run.grouped_tiles)
    as loops over the pairs and blocks: the launches' reference; the rows a tiled launch leaves unwritten hold NaN,
    so a read of one shows."""
    import torch

    if widened is None:
        from rungen.int8 import widened

    def product(x, codes, scales, offsets, expert):  # (a table of levels as offsets: every expert's)
        return widened(x, codes[expert], scales[expert],
                       None if offsets is None else offsets if offsets.dim() == 1 else offsets[expert])

    def run(x, codes, scales, blocks=None, offsets=None):
        return widened(x, codes, scales, offsets)

    def grouped(x, codes, scales, offsets, pairs):
        return torch.cat([product(x[source:source + 1], codes, scales, offsets, expert)
                          for expert, source in pairs.tolist()])

    def grouped_tiles(x, codes, scales, offsets, tiles, sources):
        y = torch.full((16 * tiles.shape[0], codes.shape[-2]), float("nan"), dtype=x.dtype, device=x.device)
        for block, expert in enumerate(tiles.tolist()):
            for row in range(16 * block, 16 * block + 16):
                if expert >= 0 and sources[row] >= 0:
                    y[row] = product(x[sources[row]:sources[row] + 1], codes, scales, offsets, expert)[0]
        return y

    run.grouped, run.grouped_tiles = grouped, grouped_tiles
    return run


def write_moe_gguf(path, experts=4, used=2, layers=2, expert_types=(None, None, None), expert_ffn=768,
                   arch="qwen3moe", shared_ffn=256, hidden=64, fields=None):
    """A tiny Qwen3-MoE GGUF file at `path` as llama.cpp's converter writes Qwen3-30B-A3B's: qwen3 attention (q/k
    norms, head size 64 apart from hidden / heads), every layer's MLP `experts` experts (`used` a token) of
    `expert_ffn` (Qwen3-30B-A3B's 768, Qwen3MoeConfig's default; Qwen3-235B-A22B's 1536) in 3-D
    ffn_{gate,up,down}_exps tensors and the router's ffn_gate_inp; Q8_0 matrices (the experts' gate, up and
    down in `expert_types` where given: llama.cpp's mixes give ffn_down_exps more bits), F32 norms and router, the
    head tied, a synthetic byte-level vocabulary (or the tokenizer.* `fields` given: a published one's, with its chat
    template); `hidden` wide (256 and more for k-quants' superblocks in gate and up). arch "qwen2moe":
    Qwen1.5-MoE-A2.7B's layout instead, qwen2's
    attention (q/k/v biases, heads of hidden / heads) and beside the experts a shared one of `shared_ffn`
    (ffn_{gate,up,down}_shexp) weighted by the sigmoid of its own gate (ffn_gate_inp_shexp, a vector). arch "llama":
    Mixtral-8x7B's as llama.cpp's converter writes it, llama's file with experts: llama's attention (heads of hidden /
    heads, q/k rows permuted, no biases), the experts' width as feed_forward_length, an untied head."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    from benchmarks.gguf_files import synthetic_tokenizer_fields

    fields = fields or synthetic_tokenizer_fields(1024)
    qwen2, mixtral = arch == "qwen2moe", arch == "llama"
    heads, kv_heads, head_dim = 2, 1, hidden // 2 if qwen2 or mixtral else 64
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    if mixtral:
        writer.add_feed_forward_length(expert_ffn)
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_feed_forward_length(6144)  # the dense MLP's, which no layer has (Qwen3-30B-A3B's)
        writer.add_expert_feed_forward_length(expert_ffn)
    if qwen2:
        writer.add_expert_shared_feed_forward_length(shared_ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if not qwen2 and not mixtral:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type)
    vocab = next(len(value) for key, value, *_ in fields if key == "tokenizer.ggml.tokens")

    def add(name, shape, qtype=Q.Q8_0, spread=0.15):
        qtype = Q.Q8_0 if qtype is None else qtype
        if qtype not in (*SIMPLE, Q.F32, Q.F16, Q.BF16):  # random blocks, scales set (blocks_for)
            blocks = blocks_for(qtype, int(np.prod(shape[:-1])), shape[-1], seed=len(name) + shape[0])
            writer.add_tensor(name, blocks.numpy().reshape(*shape[:-1], -1), raw_dtype=qtype)
            return
        values = rng.normal(0, spread, shape).astype(np.float32) if qtype != Q.F32 else rng.uniform(0.8, 1.2, shape)
        if qtype == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), spread=0.5)
    for n in range(layers):
        add(f"blk.{n}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{n}.attn_q.weight", (heads * head_dim, hidden))
        add(f"blk.{n}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{n}.attn_v.weight", (kv_heads * head_dim, hidden))
        if qwen2:
            for part, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                writer.add_tensor(f"blk.{n}.{part}.bias", rng.normal(0, 0.1, rows).astype(np.float32))
            writer.add_tensor(f"blk.{n}.ffn_gate_inp_shexp.weight", rng.normal(0, 0.5, hidden).astype(np.float32))
            add(f"blk.{n}.ffn_gate_shexp.weight", (shared_ffn, hidden))
            add(f"blk.{n}.ffn_up_shexp.weight", (shared_ffn, hidden))
            add(f"blk.{n}.ffn_down_shexp.weight", (hidden, shared_ffn), spread=0.05)
        elif not mixtral:
            add(f"blk.{n}.attn_q_norm.weight", (head_dim,), Q.F32)
            add(f"blk.{n}.attn_k_norm.weight", (head_dim,), Q.F32)
        add(f"blk.{n}.attn_output.weight", (hidden, heads * head_dim))
        add(f"blk.{n}.ffn_norm.weight", (hidden,), Q.F32)
        writer.add_tensor(f"blk.{n}.ffn_gate_inp.weight", rng.normal(0, 0.5, (experts, hidden)).astype(np.float32))
        gate, up, down = expert_types
        add(f"blk.{n}.ffn_gate_exps.weight", (experts, expert_ffn, hidden), gate)
        add(f"blk.{n}.ffn_up_exps.weight", (experts, expert_ffn, hidden), up)
        add(f"blk.{n}.ffn_down_exps.weight", (experts, hidden, expert_ffn), down, spread=0.05)
    add("output_norm.weight", (hidden,), Q.F32)
    if mixtral:
        add("output.weight", (vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def experts_apart(path, target, skip=None):
    """The GGUF file at `path` rewritten at `target` as llama.cpp's converter wrote Mixtral until April 2024: each
    expert's part of a 3-D ffn_{gate,up,down}_exps tensor a tensor of its own (blk.N.ffn_gate.E.weight), but expert
    `skip`'s."""
    from gguf import GGUFReader, GGUFWriter

    reader, writer = GGUFReader(path), GGUFWriter(str(target), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if "_exps." not in tensor.name:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        for e in range(tensor.data.shape[0]):
            if e != skip:
                name = tensor.name.replace("_exps.", f".{e}.")
                writer.add_tensor(name, tensor.data[e], raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(target)


def write_tiny_gguf(path, qtype_name, tied=False):
    """A tiny llama GGUF file at `path`: `qtype_name` (Q4_0 or Q8_0) matrices of random blocks, a Q6_K head (none:
    `tied`, the head reads the embedding), a synthetic byte-level vocabulary of 1024 (a GPU machine may lack the
    default model, whose tokenizer other GGUF tests copy); benchmarks/gguf_files.py's FAMILIES form, two layers with
    rows of 256 (the Q6_K head's blocks)."""
    from benchmarks.gguf_files import synthetic_tokenizer_fields, write_family

    shape = dict(arch="llama", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, rope_base=500000.0,
                 eps=1e-5, tied=tied)
    write_family(path, "llama", qtype_name, synthetic_tokenizer_fields(1024), shape=shape)
    return path


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """uvicorn serving an ASGI app in a thread on 127.0.0.1, on a free port."""

    def __init__(self, app, keep_alive: float = 5):
        import uvicorn  # the server's tests only: a GPU machine may lack it

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_keep_alive=keep_alive))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                return
            time.sleep(0.05)
        raise RuntimeError("the server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serving(loaded, **options):
    """(LiveServer, engine): the tool's server (rungen.server.build with ServeOptions(**options)) on `loaded`,
    live; stopped, and its engine ended, after."""
    from rungen.server import ServeOptions, build

    app, engine = build(loaded, ServeOptions(**options))
    live = LiveServer(app)
    try:
        yield live, engine
    finally:
        live.stop()
        engine.close()
        engine.abort()


def blocks_and_reference(files):
    """{name: (header, the model in its own blocks, transformers' de-quantized float32 model)} of GGUF files
    {name: path}, each loaded once; the reference shares the header's one parse of the file's metadata."""
    import torch
    from transformers import AutoModelForCausalLM

    from rungen.gguf import GGUFHeader, build_model, metadata_parsed_once

    out = {}
    for name, path in files.items():
        with metadata_parsed_once():
            header = GGUFHeader(path)
            if header.config.model_type == "mixtral":  # transformers reads no Mixtral file
                reference = mixtral_reference(path, header.config)
            else:
                reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                                 gguf_file=os.path.basename(path))
        out[name] = header, build_model(header, torch.float32), reference.eval()
    return out


@contextlib.contextmanager
def stored_as_own():
    """Within it, transformers' DynamicLayer and DynamicSlidingWindowLayer (generate()'s caches) round the keys and
    values they store as the own model's cache holds them (float16 unless RUN_GENERATION_KV_FLOAT32=1), computing on
    them in float32: generate() on transformers' model of a GGUF file then gives the own model's tokens."""
    import torch
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from rungen.kvcache import own_dtype

    originals = {kind: kind.__dict__["update"] for kind in (DynamicLayer, DynamicSlidingWindowLayer)}
    dtype = own_dtype()

    def rounding(update):
        def stored(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            return update(self, key_states.to(dtype).to(key_states.dtype),
                          value_states.to(dtype).to(value_states.dtype), *args, **kwargs)
        return stored

    for kind, update in originals.items():
        kind.update = rounding(update)
    try:
        yield
    finally:
        for kind, update in originals.items():
            kind.update = update


def mixtral_reference(path, config):
    """transformers' MixtralForCausalLM of `config` over the tensors of a Mixtral GGUF file (write_moe_gguf's arch
    "llama"), de-quantized by the gguf package and mapped by hand as llama.cpp's converter wrote them from Mixtral's
    checkpoint: q/k rows un-permuted, each expert's gate and up rows concatenated."""
    import torch
    from gguf import GGUFReader, quants
    from transformers import MixtralForCausalLM

    values = {t.name: torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype("float32"))
              for t in GGUFReader(path).tensors}

    def unpermuted(w, heads):  # llama.cpp's permute: reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2)
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    state = {"model.embed_tokens.weight": values["token_embd.weight"], "lm_head.weight": values["output.weight"],
             "model.norm.weight": values["output_norm.weight"]}
    for n in range(config.num_hidden_layers):
        blk, layer = f"blk.{n}.", f"model.layers.{n}."
        state |= {
            layer + "input_layernorm.weight": values[blk + "attn_norm.weight"],
            layer + "post_attention_layernorm.weight": values[blk + "ffn_norm.weight"],
            layer + "self_attn.q_proj.weight": unpermuted(values[blk + "attn_q.weight"], config.num_attention_heads),
            layer + "self_attn.k_proj.weight": unpermuted(values[blk + "attn_k.weight"], config.num_key_value_heads),
            layer + "self_attn.v_proj.weight": values[blk + "attn_v.weight"],
            layer + "self_attn.o_proj.weight": values[blk + "attn_output.weight"],
            layer + "mlp.gate.weight": values[blk + "ffn_gate_inp.weight"],
            layer + "mlp.experts.gate_up_proj": torch.cat([values[blk + "ffn_gate_exps.weight"],
                                                           values[blk + "ffn_up_exps.weight"]], dim=1),
            layer + "mlp.experts.down_proj": values[blk + "ffn_down_exps.weight"]}
    model = MixtralForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model


def merge_short_of_memory(monkeypatch, when, failed):
    """Patches PaddedBatch.merge: the first merge where `when(batch, parts)` holds runs out of GPU memory for its
    second layer's copy, the first layer's made (raised where CUDA raises it: the CPU has no such limit); `failed`
    gets the batch's rows then."""
    import torch

    import rungen.batch_cache as batch_cache

    merge, left_pad = batch_cache.PaddedBatch.merge, batch_cache.left_pad

    def short_of_memory(self, parts, rows):
        if failed or not when(self, parts):
            return merge(self, parts, rows)
        groups, padded = len(parts) + (self.cache is not None), []  # a layer pads the batch's and each part's

        def counted(tensor, width, dim=2):  # keys and values
            if len(padded) == 2 * groups:
                failed.append(len(rows))
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            padded.append(tensor)
            return left_pad(tensor, width, dim)

        with monkeypatch.context() as patch:
            patch.setattr(batch_cache, "left_pad", counted)
            return merge(self, parts, rows)

    monkeypatch.setattr(batch_cache.PaddedBatch, "merge", short_of_memory)


def error_of(args, capsys):
    """The exit code and the last stderr line of the command (run_generation.cli), which must fail in one line."""
    import run_generation

    with pytest.raises(SystemExit) as exit_info:
        run_generation.cli(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    return exit_info.value.code, lines[-1]


# Operators that read a tensor back to the host (each waits for a GPU, and a CUDA graph's capture refuses it), and
# torch.tensor's, which makes a tensor of host data (a capture copies it once; every replay reuses that copy). Under
# inference mode .item(), int() and float() reach a dispatch mode as `item`, not `_local_scalar_dense`.
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal", "allclose", "unique",
              "_unique2", "unique_consecutive", "repeat_interleave"}
HOST_DATA = {"lift_fresh"}


def watched(function, names):
    """(`function` wrapped, calls): each call's list of the operators it ran that are in `names` (and a boolean
    index, which is a nonzero())."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            indices = (args[1] or ()) if name in ("index", "index_put", "index_put_") else ()
            if name in names or any(getattr(index, "dtype", None) == torch.bool for index in indices):
                calls[-1].append(name)
            return func(*args, **(kwargs or {}))

    def run(*args, **kwargs):
        calls.append([])
        with Watch():
            return function(*args, **kwargs)

    return run, calls


# A function as a tool-calling request declares it (tests/test_tools.py, tests/test_cuda.py).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


# Sliding windows as the slots' rings take them: Gemma 3's by layer type (sdpa), Gemma 2's (eager: additive masks,
# soft-capping), StarCoder2's on every layer, a window of 4; Gemma 4's E2B (its last layers reading earlier ones'
# keys) and 26B-A4B (experts beside the MLP, transformers' grouped_mm ones), a window of 8.
RINGED = {"gemma3_text": dict(head_dim=16, layer_types=["sliding_attention", "full_attention"]),
          "gemma2": dict(head_dim=16, attn_implementation="eager"), "starcoder2": {}, "gemma4 e2b": None,
          "gemma4 26b-a4b": None}


def rings_decode_as_generate_does(family, device, monkeypatch, tmp_path):
    """Asserts that a sliding layer's slots on `device` hold a ring (the window, a pass and the step ahead, rounded up:
    passes of 8 tokens here, RING_PASS, buckets of 8), not every position: prompts longer than a pass go into their
    slots a pass at a time (the rows of those prefilled alone entering theirs first), rows joining and ending at
    different steps decode past the ring, and each prompt gives the tokens generate() gives it alone; a conversation's
    next turn takes the finished row's entry whole from the prefix cache, its rings as they were, and gives
    generate()'s tokens for the whole conversation."""
    import torch
    import transformers

    import rungen.prefill
    import rungen.slots
    from rungen.engine import Engine, describe_memory
    from rungen.loading import Loaded, load
    from rungen.requests import Done, Request
    from rungen.sampling import Sampling
    from tiny_models import build_tiny_checkpoint

    monkeypatch.setattr(rungen.slots, "POSITION_BUCKET", 8)
    monkeypatch.setattr(rungen.prefill, "RING_PASS", 8)
    source = load(build_tiny_checkpoint("llama", str(tmp_path / "llama")), device=torch.device("cpu"))
    if RINGED[family] is None:
        from tiny_models import gemma4_checkpoint

        model = load(gemma4_checkpoint(str(tmp_path), family.split()[1]), device=torch.device("cpu")).model
    else:
        fields = dict(RINGED[family])
        attention = fields.pop("attn_implementation", "sdpa")
        config = transformers.AutoConfig.for_model(
            family, vocab_size=source.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, sliding_window=4,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model = model.eval().to(device)
    engine = Engine(Loaded(model, source.tokenizer, family, device, 128, source.vocab_size), max_batch=3,
                    prefix_cache_bytes=1 << 24)
    ring = engine.batch.kv.slots.ring
    assert ring < 32 and f"the sliding layers in rings of {ring} positions" in engine.batch.kv.form
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, source.vocab_size, (length,), generator=generator).tolist()
               for length in (30, 5, 21, 17, 40)]
    lengths = [20, 9, 25, 12, 30]

    def run(requests):
        done = {}
        for number, (ids, length) in enumerate(requests):
            engine.submit(Request(ids, length, Sampling(temperature=0, ignore_eos=True),
                                  sink=lambda event, n=number: done.__setitem__(n, event.finish.tokens)
                                  if isinstance(event, Done) else None))
        engine.run_here()
        return [done[number] for number in range(len(requests))]

    def alone(ids, length):
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=length, min_new_tokens=length,
                             do_sample=False)
        return out[0, len(ids):].tolist()

    line = describe_memory(engine)  # (--verbose's)
    assert "per token position (every layer's: a sliding layer holds fewer)" in line
    with monkeypatch.context() as patch:  # (RUN_GENERATION_RINGS=0: every position held)
        patch.setenv("RUN_GENERATION_RINGS", "0")
        full = Engine(Loaded(model, source.tokenizer, family, device, 128, source.vocab_size), max_batch=3)
        assert "ring" not in full.batch.kv.form and "ring" not in describe_memory(full)
    held, ensure = [], rungen.slots.SlotCache.ensure

    def ensured(cache, *args):  # the positions each layer holds, and a full layer's, as the slots grow
        ensure(cache, *args)
        held.append(({keys.shape[2] for keys in cache.keys}, cache.capacity))

    monkeypatch.setattr(rungen.slots.SlotCache, "ensure", ensured)
    tokens = run(list(zip(prompts, lengths)))
    graphs = engine.batch.kv.graphs  # (on a GPU: steps past the ring replayed, their own bucket of lengths)
    if device.type == "cuda":
        lengths_replayed = [length for _, length in graphs.graphs]
        assert not graphs.failed and max(lengths_replayed) > ring
    else:
        assert graphs is None
    sizes, capacity = held[-1]  # (the slots at their largest: the CPU's go at the end)
    assert capacity > ring and sizes == ({ring, capacity} if family != "starcoder2" else {ring})
    with torch.no_grad():
        assert tokens == [alone(ids, length) for ids, length in zip(prompts, lengths)]
    # the next turn of the last conversation: all of it from the prefix cache (but its last token, never fed), then
    # 3 more tokens of prompt, two choices (the second slot a copy of the first); a request sharing only its first
    # 20 tokens prefills them again
    turn, shared = prompts[-1] + tokens[-1] + [7, 8, 9], prompts[-1][:20] + [7, 8, 9]
    done = []
    for ids, n, reused in ((turn, 2, len(prompts[-1]) + len(tokens[-1]) - 1), (shared, 1, 0)):
        engine.submit(Request(ids, 10, Sampling(temperature=0, ignore_eos=True), n=n, sink=lambda event: (
            done.append(event.finish.tokens) if isinstance(event, Done) else None)))
        submitted = engine.waiting[-1]
        engine.run_here()
        assert submitted.reused == reused
    with torch.no_grad():
        assert done == [alone(turn, 10)] * 2 + [alone(shared, 10)]


def q8_0_rounded(values):
    """`values` (a tensor) as a Q8_0 tensor of them holds them (blocks along the last dimension)."""
    import torch
    from gguf import quants

    blocks = quants.quantize(values.contiguous().numpy(), T.Q8_0)
    return torch.from_numpy(quants.dequantize(blocks, T.Q8_0)).view(values.shape)


def as_converted(model):
    """`model` as llama.cpp's converter leaves it where it multiplies a model's multipliers into its weights
    (Falcon-H1's: tiny_models.falcon_h1_folded), the multipliers then 1: the same function, a new model of the same
    class (the checkpoint's other fields kept)."""
    import torch

    from tiny_models import falcon_h1_folded

    config = copy.deepcopy(model.config)
    folded = {name: torch.from_numpy(falcon_h1_folded(name, value.detach().float().numpy().copy(),
                                                      config.to_dict()))
              for name, value in model.state_dict().items()}
    for field in ("lm_head_multiplier", "embedding_multiplier", "key_multiplier", "attention_out_multiplier",
                  "attention_in_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"):
        setattr(config, field, 1.0)
    config.mlp_multipliers, config.ssm_multipliers = [1.0, 1.0], [1.0] * 5
    converted = type(model)(config).eval()
    converted.load_state_dict(folded)  # (the mixer's mup_vector, a buffer not saved: the new config's ones)
    return converted


def round_as_q8_0_file(model, keep=("mlp.gate.weight", "feed_forward.gate.weight", "shared_expert_gate.weight",
                                    "block_sparse_moe.router.weight", "mixer.gate.weight",
                                    "feed_forward.router.weight"),
                       split_latent=True) -> None:
    """`model`'s weights (in place) as the Q8_0 file a tiny model's writer makes of it holds them: each matrix of
    whole blocks a row in Q8_0 but those named ending in `keep` (routers, gates: F32); DeepSeek's kv_b_proj as the
    converter splits it (k's rows per head transposed, so in blocks along them; v's as they are) unless not
    `split_latent` (the files of 2024); Llama 4's experts, which it holds transposed, in blocks along their hidden
    and inner sizes as the converter's transposed tensors are."""
    import torch

    config = model.config.get_text_config()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if config.model_type == "llama4_text" and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                parameter.copy_(q8_0_rounded(parameter.transpose(1, 2)).transpose(1, 2))
            elif name.endswith("kv_b_proj.weight") and split_latent:
                heads = parameter.view(config.num_attention_heads, -1, parameter.shape[-1])
                k, v = heads.split([config.qk_nope_head_dim, config.v_head_dim], dim=1)
                k.copy_(q8_0_rounded(k.transpose(1, 2)).transpose(1, 2))
                v.copy_(q8_0_rounded(v))
            elif parameter.dim() >= 2 and parameter.shape[-1] % 32 == 0 and not name.endswith(keep):
                parameter.copy_(q8_0_rounded(parameter))
