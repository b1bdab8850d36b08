"""What a GPU machine meets, checked on the CPU device: the device is chosen as before, a GGUF file goes to its
accelerator form instead of being refused (the Triton kernels stood in by the plain product), checkpoints default to
half precision on CUDA, the CPU-only flag (--jit) is refused in one line before anything loads while --quantize goes
on, and running out of GPU memory is one line that says how to fit. The runs on a GPU, real or played by the CPU
(the default model's Quick start among them), are tests/test_cuda.py's."""

import os

import pytest
import torch

from helpers import error_line, run_main, write_tiny_gguf
from rungen import processes
from rungen.errors import UsageError
from rungen.loading import resolve_dtype


class Config:
    def __init__(self, dtype=None):
        self.dtype = dtype


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device as processes.start chooses one where torch sees a GPU; `bf16`: whether it has bfloat16."""
    state = {"bf16": True}
    monkeypatch.setattr(processes, "start", lambda use_cpu: processes.OneProcess(
        torch.device("cpu" if use_cpu else "cuda")))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: state["bf16"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    return state


def gguf_gpu_form(monkeypatch, checked_kernel, embedding=False):
    """rungen.gguf.device's choices as on a GPU, the CPU standing in: every int8 type keeps its codes, each type's
    kernel what `checked_kernel(layer, dtype, instead)` gives (the plain product stands in for the Triton kernel),
    and where `embedding`, an embedding keeps its blocks."""
    import rungen.gguf.device
    from rungen.gguf.device import INT8_TYPES

    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", checked_kernel)
    if embedding:
        monkeypatch.setattr(rungen.gguf.device, "gpu_embedding", lambda qtype, device: True)


def test_checkpoints_run_in_half_precision_on_cuda(gpu):
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", Config(), cuda) == torch.bfloat16  # a GGUF file names none
    assert resolve_dtype("auto", Config(torch.float32), cuda) == torch.bfloat16
    assert resolve_dtype("auto", Config(torch.float16), cuda) == torch.float16  # the checkpoint's own half
    assert resolve_dtype("float32", Config(torch.float32), cuda) == torch.float32  # --dtype wins
    assert resolve_dtype("auto", Config(torch.float32), torch.device("cpu")) == torch.float32
    gpu["bf16"] = False  # before Ampere
    assert resolve_dtype("auto", Config(), cuda) == torch.float16
    assert resolve_dtype("auto", Config(torch.bfloat16), cuda) == torch.float16
    with pytest.raises(UsageError, match="--dtype bfloat16: this GPU .*V100.* has no bfloat16"):
        resolve_dtype("bfloat16", Config(), cuda)


@pytest.mark.parametrize("flag, message", [
    (["--jit"], "--jit traces the decode step for TorchScript's CPU Static Runtime; on cuda drop it, or add "
                "--use_cpu"),
    (["--jit", "--device_map", "auto"], "--jit traces the decode step for TorchScript's CPU Static Runtime; on cuda "
                                        "drop it, or add --use_cpu"),  # the map puts the model on the GPU too
])
def test_cpu_only_flags_are_refused_before_loading(gpu, monkeypatch, flag, message):
    import run_generation

    monkeypatch.setattr(run_generation, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    result = run_main(["--prompt", "Hi"] + flag)
    assert result.returncode == 2 and error_line(result) == f"run_generation.py: error: {message}"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_goes_on_to_load_on_cuda(gpu, monkeypatch, mode):
    # Both modes run on a CUDA GPU (tests/test_cuda.py runs them there): nothing refuses them before loading.
    def load(*args, **kwargs):
        raise UsageError(f"reached the load on {kwargs.get('device')}")

    import run_generation

    monkeypatch.setattr(run_generation, "load", load)
    result = run_main(["--prompt", "Hi", "--quantize", mode])
    assert result.returncode == 2 and error_line(result) == "run_generation.py: error: reached the load on cuda"


def test_a_q8_0_gguf_file_on_the_gpu_keeps_its_codes_and_its_q6_k_heads(tmp_path, monkeypatch, module_cache_home):
    # The GPU's load of a Q8_0 file (its head Q6_K, as llama.cpp's) with the CPU standing in and the Triton kernel
    # stood in by the plain product it is checked against (tests/test_cuda.py runs the kernel itself): the matrices
    # keep their int8 codes and float16 scales, rows permuted as transformers wants the attention's, the head its
    # Q6_K codes and a float32 scale a group of 16, each type's kernel checked on its first weight, and the model
    # computes what the de-quantized one does; a kernel that does not check out leaves them de-quantized.
    import rungen.gguf.device
    from rungen.int8 import CudaInt8Linear, widened
    from rungen.loading import load_gguf_on

    path = write_tiny_gguf(str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    cpu = torch.device("cpu")
    checked = []
    gguf_gpu_form(monkeypatch, lambda layer, dtype, instead: (checked.append(
        (layer.scales.dtype, layer.in_features // layer.scales.shape[1])), widened)[1])
    kept = load_gguf_on(path, cpu, dtype="float32")
    layers = [m for m in kept.model.modules() if isinstance(m, CudaInt8Linear)]
    assert len(layers) == 2 * 7 + 1 and all(m.kernel is widened for m in layers)
    assert sorted(checked, key=str) == [(torch.float16, 32), (torch.float32, 16)]
    head = kept.model.get_output_embeddings()
    assert head in layers and head.codes.abs().max() <= 32 and head.scales.shape == (head.out_features, 256 // 16)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: None)
    dequantized = load_gguf_on(path, cpu, dtype="float32")
    assert not any(isinstance(m, CudaInt8Linear) for m in dequantized.model.modules())
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        ours, theirs = kept.model(input_ids=ids).logits, dequantized.model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_4_bit_file_on_the_triton_kernel_keeps_its_codes_two_a_byte(tmp_path, monkeypatch, module_cache_home,
                                                                      caplog):
    # Where torch's int4 kernel cannot run in half precision (float16, GPUs before Ampere) or where
    # RUN_GENERATION_GPU_INT4=triton asks, the CPU standing in for the GPU: a Q4_0 file's matrices keep their codes
    # two a byte for rungen/int4_kernel.py's kernel (checked on the first; the plain product stands in for it),
    # inputs that fill no chunk of 64 stay on torch's kernel or are de-quantized (float32 too, unless asked), and
    # the model computes what the de-quantized one does; a kernel that does not check out leaves the 4-bit weights
    # de-quantized, with a warning.
    import rungen.gguf.device
    from rungen.gguf.device import gpu_int4
    from rungen.int4 import TinyGemmLinear
    from rungen.int4_kernel import CudaInt4Linear, widened4
    from rungen.loading import load_gguf_on

    monkeypatch.delenv("RUN_GENERATION_GPU_INT4", raising=False)

    Q = rungen.gguf.device.GGMLQuantizationType
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(TinyGemmLinear, "runs_on", staticmethod(lambda in_features, dtype, device: (
        device.type == "cuda" and dtype == torch.bfloat16 and os.environ.get("RUN_GENERATION_GPU_INT4") != "0")))
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    forms = [(Q.Q4_0, 4096, bf16, cuda), (Q.Q4_K, 4096, f16, cuda), (Q.Q4_1, 576, f16, cuda), (Q.Q4_0, 96, bf16, cuda),
             (Q.Q4_0, 4096, f32, cuda), (Q.Q4_0, 96, f16, cuda), (Q.Q8_0, 4096, f16, cuda), (Q.Q4_0, 4096, bf16, cpu)]
    assert [gpu_int4(*form) for form in forms] == ["tinygemm", "triton", "triton", "tinygemm"] + [None] * 4
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "triton")
    assert [gpu_int4(*form) for form in forms] == ["triton", "triton", "triton", "tinygemm", "triton"] + [None] * 3
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "0")
    assert [gpu_int4(*form) for form in forms] == [None] * 8

    path = write_tiny_gguf(str(tmp_path / "tiny-Q4_0.gguf"), "Q4_0")
    dequantized = load_gguf_on(path, cpu, dtype="float32")
    monkeypatch.setattr(rungen.gguf.device, "gpu_int4", lambda qtype, in_features, dtype, device: (
        "triton" if qtype in rungen.gguf.device.INT4_TYPES else None))
    checked = []
    monkeypatch.setattr(rungen.gguf.device, "checked_int4_kernel",
                        lambda layer, dtype: (checked.append(layer), (widened4, None))[1])
    kept = load_gguf_on(path, cpu, dtype="float32")
    layers = [m for m in kept.model.modules() if isinstance(m, CudaInt4Linear)]
    assert len(layers) == 2 * 7 and all(m.kernel is widened4 for m in layers) and len(checked) == 1
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        torch.testing.assert_close(kept.model(input_ids=ids).logits, dequantized.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(rungen.gguf.device, "checked_int4_kernel", lambda layer, dtype: (None, "it disagrees"))
    refused = load_gguf_on(path, cpu, dtype="float32")
    assert not any(isinstance(m, CudaInt4Linear) for m in refused.model.modules())
    assert "the 4-bit Triton kernel: it disagrees" in caplog.text


def test_a_tied_q8_0_file_on_the_gpu_keeps_one_set_of_codes_for_its_embedding_and_head(tmp_path, monkeypatch,
                                                                                       module_cache_home):
    # A tied file's Q8_0 table (Q6_K's alike) on the GPU, the CPU standing in: the head keeps its codes for the int8
    # kernel and the embedding's lookup reads those same codes (one copy, a byte a weight, where it was a bfloat16
    # table the two shared), to the de-quantized model's values and logits.
    from rungen.int8 import CodesEmbedding, CudaInt8Linear, widened
    from rungen.loading import load_gguf_on

    path = write_tiny_gguf(str(tmp_path / "tied-Q8_0.gguf"), "Q8_0", tied=True)
    cpu = torch.device("cpu")
    dequantized = load_gguf_on(path, cpu, dtype="float32").model
    gguf_gpu_form(monkeypatch, lambda layer, dtype, instead: widened)
    kept = load_gguf_on(path, cpu, dtype="float32").model
    head, embedding = kept.get_output_embeddings(), kept.get_input_embeddings()
    assert isinstance(head, CudaInt8Linear) and isinstance(embedding, CodesEmbedding) and embedding.head is head
    assert head.codes.shape == dequantized.get_input_embeddings().weight.shape
    ids = torch.tensor([list(range(3, 40)), list(range(40, 77))])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), dequantized.get_input_embeddings()(ids))
        torch.testing.assert_close(kept(input_ids=ids).logits, dequantized(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_gguf_files_embedding_keeps_its_blocks_on_the_gpu(tmp_path, monkeypatch, module_cache_home, qtype):
    # The GPU's load with the CPU standing in: an untied file's token embeddings stay in the file's blocks (a
    # quarter or half of bfloat16's bytes), a lookup de-quantizing its rows with torch operators, to the same values:
    # the model computes what the fully de-quantized one does; a file whose head reads the embedding keeps a table.
    import rungen.gguf.device
    from rungen.gguf.device import DeviceRowsEmbedding
    from rungen.loading import load_gguf_on

    path = write_tiny_gguf(str(tmp_path / f"tiny-{qtype}.gguf"), qtype)
    cpu = torch.device("cpu")
    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: False)  # Q8_0's matrices de-quantized
    dequantized = load_gguf_on(path, cpu, dtype="float32")
    monkeypatch.setattr(rungen.gguf.device, "gpu_embedding", lambda qtype, device: True)
    kept = load_gguf_on(path, cpu, dtype="float32")
    embedding = kept.model.get_input_embeddings()
    assert isinstance(embedding, DeviceRowsEmbedding) and embedding.blocks.dtype == torch.uint8
    assert embedding.blocks.numel() < 0.3 * dequantized.model.get_input_embeddings().weight.numel() * 4
    ids = torch.tensor([list(range(3, 40)), list(range(40, 77))])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), dequantized.model.get_input_embeddings()(ids))
        torch.testing.assert_close(kept.model(input_ids=ids).logits, dequantized.model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    tied = load_gguf_on(write_tiny_gguf(str(tmp_path / f"tied-{qtype}.gguf"), qtype, tied=True), cpu,
                        dtype="float32").model
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight


def test_a_gguf_files_gpu_form_decodes_without_waiting_for_the_device(tmp_path, monkeypatch, module_cache_home):
    # The GPU form of a Q8_0 file with the CPU standing in (int8 codes, the head's Q6_K codes, the embedding in its
    # blocks; the Triton kernel stood in by the plain product): its decode step on the engine's slots reads nothing
    # back to the host and makes no tensor of host data, as a CUDA graph's capture needs (tests/test_slots.py's
    # check for checkpoints; tests/test_cuda.py captures it on a GPU).
    import rungen.batch_cache
    from helpers import HOST_DATA, HOST_READS, watched
    from rungen.engine import Engine
    from rungen.gguf.device import DeviceRowsEmbedding
    from rungen.int8 import widened
    from rungen.loading import load_gguf_on
    from rungen.requests import Request
    from rungen.sampling import Sampling

    gguf_gpu_form(monkeypatch, lambda layer, dtype, instead: widened, embedding=True)
    loaded = load_gguf_on(write_tiny_gguf(str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0"), torch.device("cpu"),
                          dtype="float32")
    assert isinstance(loaded.model.get_input_embeddings(), DeviceRowsEmbedding)
    step, steps = watched(rungen.batch_cache.decode_step, HOST_READS | HOST_DATA)
    monkeypatch.setattr(rungen.batch_cache, "decode_step", step)
    engine = Engine(loaded, max_batch=2, prefix_cache_bytes=0)
    assert engine.batch.kv.form == "fixed slots"
    for ids in ([5, 6, 7], [8, 9]):
        engine.submit(Request(ids, 6, Sampling(temperature=0, ignore_eos=True), sink=lambda event: None))
    engine.run_here()
    assert steps == [[]] * 5


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB "
                           "of which 1.02 GiB is free.\nIncluding non-PyTorch memory"),
    # CUDA's own errors, outside torch's allocator: a context, a cuBLAS handle on the first product
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
], ids=["allocator", "context", "cublas"])
def test_running_out_of_gpu_memory_says_how_to_fit(gpu, monkeypatch, error):
    def out_of_memory(*args, **kwargs):
        raise error

    import run_generation

    monkeypatch.setattr(run_generation, "load", out_of_memory)
    result = run_main(["--prompt", "Hi"])
    line = error_line(result)
    first = str(error).splitlines()[0]
    assert result.returncode == 2 and f"out of GPU memory ({first}" in line
    assert "--batch_size" in line and "--device_map auto" in line and "--use_cpu" in line


def test_other_cuda_errors_are_not_called_out_of_memory(gpu, monkeypatch):
    def device_assert(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    import run_generation

    monkeypatch.setattr(run_generation, "load", device_assert)
    with pytest.raises(RuntimeError, match="device-side assert"):  # a bug's traceback, not advice on memory
        run_generation.cli(["--prompt", "Hi"])
