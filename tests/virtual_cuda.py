"""A CUDA GPU played by the CPU (played_gpu), for the code that runs only where `device.type == "cuda"` (the decode
step captured as CUDA graphs, copies through pinned memory, the processors for all rows at once, the half-precision
default, torch's int4 kernel) and for the mistakes only a GPU reports: a host tensor in a device operator, a read
from the device inside a graph's capture or where sync debug mode forbids one.

A tensor on the played GPU is a CPU tensor in a wrapper that says cuda:0 (OnDevice). Every operator on one is checked
as CUDA checks it, run on the CPU and its results wrapped again. A graph's capture records the operators it ran and
its replay runs them again on the same tensors, as a CUDA graph replays its kernels on the same memory: what the
capture computed on the host stays baked in, as on a GPU. torch's int4 kernels are played by the CPU's (the same
groups, scales and zeros). Its memory is the bytes of the storages its tensors hold and what graphs' pools keep
(Memory), to a capacity past which an allocation is CUDA's out-of-memory error. Triton's kernels cannot be played,
nor time.

    python tests/virtual_cuda.py -m benchmarks.gpu --quick     # a module run on the played GPU
"""

import contextlib
import copy
import functools
import os
import sys
import tempfile
import threading
import time
import types
import weakref

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._device import _device_constructors as device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import HOST_READS

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
# Operators CUDA lets take a host tensor beside a device one: copies, and indexing by host indices.
CROSSING = {"_to_copy", "copy_", "index", "index_put_", "_index_put_impl_"}
# Operators that draw from a generator (the GPU's default one where none is given).
RANDOM = {"normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "exponential_", "geometric_", "cauchy_",
          "log_normal_", "random_", "rand", "randn", "randint", "randperm", "multinomial", "rand_like", "randn_like",
          "randint_like", "native_dropout"}


def leaves(*values) -> list:
    """The values, and the items of those that are lists or tuples: an operator's arguments or results go no
    deeper (torch's pytree would, at several times the cost a call)."""
    return [leaf for value in values for leaf in (value if isinstance(value, (list, tuple)) else (value,))]


def mapped(function, value):
    """`function` of `value`, or of each item where it is a list or tuple (of the same type)."""
    return type(value)([function(item) for item in value]) if isinstance(value, (list, tuple)) else function(value)


def each(function, args, kwargs) -> tuple[tuple, dict]:
    """mapped(function) of each argument and keyword argument."""
    return tuple(mapped(function, value) for value in args), {key: mapped(function, value)
                                                               for key, value in kwargs.items()}


def on_the_cpu(value):
    """A device argument as the CPU, where the played GPU computes."""
    return CPU if isinstance(value, torch.device) else value


def unwrapped(value):
    return value.elem if on_device(value) else value


def readable(size: int) -> str:
    """A size as CUDA's allocator writes it in its messages."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.2f} {unit}"
    return f"{size} bytes"


class DeviceError(RuntimeError):
    """What CUDA would have raised."""


def int4pack(pairs: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """CUDA's int4 packing of codes two a byte (the even one high), played: the codes as they are, a channel a row,
    which concatenate along the channels as CUDA's packed rows of eight channels do (the CPU's own packing, which
    int4mm takes them to, is blocked by 32 or 64 channels where the CPU has AVX-512, and so does not)."""
    return pairs.contiguous().clone()


def int4mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales: torch.Tensor) -> torch.Tensor:
    """CUDA's int4 product, played by the CPU's on int4pack's codes packed for it."""
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_packed, group_size, scales)


STAND_INS = {torch.ops.aten._convert_weight_to_int4pack.default: int4pack,
             torch.ops.aten._weight_int4pack_mm.default: int4mm}


class OnDevice(torch.Tensor):
    """A CPU tensor (`elem`) that says it is on cuda:0."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                   storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                   device=CUDA, requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem
        STATE.memory.hold(self)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    def __tensor_flatten__(self):  # nn.Module.to swaps such a wrapper in for a parameter, `elem` and all
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return OnDevice(inner["elem"])

    def data_ptr(self):
        return self.elem.data_ptr()

    def __deepcopy__(self, memo):
        copied = OnDevice(copy.deepcopy(self.elem, memo))
        copied.__dict__.update({key: value for key, value in self.__dict__.items() if key != "elem"})
        memo[id(self)] = copied
        return copied

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return STATE.dispatch(func, args, kwargs or {})


def on_device(value) -> bool:
    return isinstance(value, OnDevice)


def is_host(value) -> bool:
    """A host tensor CUDA refuses beside a device one (a 0-dim one is a scalar to it)."""
    return isinstance(value, torch.Tensor) and not on_device(value) and value.dim() > 0


def wrap(elem: torch.Tensor) -> OnDevice:
    """`elem` on the played GPU, an inference tensor where `elem` is one (a view made in inference mode of a normal
    tensor is normal: autograd sets its version counter)."""
    normal = torch.is_inference_mode_enabled() and not elem.is_inference()
    with torch.inference_mode(False) if normal else contextlib.nullcontext():
        return OnDevice(elem)


class PoolHandle:
    """torch.cuda.graph_pool_handle(): while it lives (a graph holds its own), its pool keeps its memory. Once every
    graph captured into it has gone, it takes no capture: CUDA's allocator asserts that a pool it still keeps is in
    use (while its blocks are cached: here, always)."""

    def __init__(self, usage: list):
        self.usage = usage
        self.graphs, self.captured = 0, False  # the graphs alive that were captured into it; whether any was

    def release(self) -> None:
        self.graphs -= 1


class Memory:
    """The played GPU's memory. Allocated: the bytes of the storages its tensors hold, each counted until the last
    host tensor playing one on the device that holds it goes, as CUDA's allocator frees a block (its rounding to 512
    bytes and the libraries' workspaces left out). A graph's capture allocates from its pool, which keeps the most
    its captures held at once, for their replays, until the pool goes: a tensor made in a capture is freed when the
    program drops it (the recording keeps the host tensor for the replays), its bytes left to the pool. Past the
    capacity, an allocation is CUDA's out-of-memory error."""

    def __init__(self, capacity: int):
        self.total = self.capacity = capacity  # the GPU's memory, and what set_per_process_memory_fraction allows
        self.allocated = self.peak = 0
        self.spare = 0  # bytes the pools keep beyond the tensors live in them
        self.held = {}  # a storage's address -> [its bytes, the tensors holding it, its pool's usage or None]
        self.pool = None  # the usage [kept, live, open] of the pool the capture under way allocates from

    @property
    def reserved(self) -> int:
        return self.allocated + self.spare

    def new_pool(self) -> PoolHandle:
        handle = PoolHandle([0, 0, True])
        weakref.finalize(handle, self.close_pool, handle.usage)
        return handle

    def close_pool(self, usage: list) -> None:
        self.spare -= usage[0] - usage[1]
        usage[2] = False

    def limit(self, fraction: float) -> None:
        self.capacity = int(fraction * self.total)

    def hold(self, tensor: OnDevice) -> None:
        """Counts `tensor`'s storage from now on. (Outside a capture the host tensor it plays with is watched, not the
        wrapper: nn.Module.to swaps a wrapper into a parameter, which no weak reference may watch.)"""
        storage = tensor.elem.untyped_storage()
        key = storage.data_ptr()
        if not key:
            return
        entry = self.held.get(key)
        if entry is None:
            size, pool = storage.nbytes(), self.pool
            from_pool = min(size, pool[0] - pool[1]) if pool else 0
            if self.reserved + size - from_pool > self.capacity:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {readable(size)}. GPU 0 has a total capacity of "
                    f"{readable(self.total)} of which {readable(self.total - self.reserved)} is free. Of the "
                    f"allocated memory {readable(self.allocated)} is allocated by PyTorch, and this process is "
                    f"allowed {readable(self.capacity)} (set_per_process_memory_fraction)")
            if pool:
                pool[0], pool[1] = pool[0] + size - from_pool, pool[1] + size
                self.spare -= from_pool
            self.allocated += size
            self.peak = max(self.peak, self.allocated)
            entry = self.held[key] = [size, 0, pool]
        entry[1] += 1
        weakref.finalize(tensor if entry[2] else tensor.elem, self.release, key)

    def release(self, key: int) -> None:
        entry = self.held[key]
        entry[1] -= 1
        if entry[1]:
            return
        del self.held[key]
        size, _, pool = entry
        self.allocated -= size
        if pool:
            pool[1] -= size
            if pool[2]:
                self.spare += size
            else:
                pool[0] -= size

    def reset_peak(self, device=None) -> None:
        self.peak = self.allocated


class State:
    """What the played GPU has seen, and the graph it is capturing (a list of recorded operators) or None."""

    def __init__(self, capacity: int = 141 << 30):
        self.reads = []  # the operators the host waited for, in order
        self.copies = 0  # copies to pinned host memory, which do not wait
        self.launches = 0  # operators run on the device, views left out: a kernel each (or a copy)
        self.captures = self.replays = 0
        self.capturing = None
        self.generator_capturing = False  # the default generator left marked as capturing (DefaultGenerator)
        self.strict = False  # torch.cuda.set_sync_debug_mode("error")
        self.pinned = {}  # id -> a weak reference of each host tensor made in pinned memory
        self.memory = Memory(capacity)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)  # forgotten as the tensor goes, before its id can be another's
        self.pinned[key] = weakref.ref(tensor, lambda _: self.pinned.pop(key, None))
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        held = self.pinned.get(id(tensor))
        return held is not None and held() is tensor

    def read(self, name: str) -> None:
        if self.capturing is not None:
            raise DeviceError(f"{name}: operation not permitted when stream is capturing")
        if self.strict:
            raise DeviceError(f"{name}: called a synchronizing CUDA operation")
        self.reads.append(name)

    def dispatch(self, func, args, kwargs):
        """`func` on the played GPU, where an argument is on it or a device argument names it."""
        name = func.overloadpacket.__name__
        flat = leaves(*args, *kwargs.values())  # its tensors stay the same objects below
        named = {value.type for value in flat if isinstance(value, torch.device)}
        args, kwargs = each(on_the_cpu, args, kwargs)
        kwargs.pop("pin_memory", None)
        from_device = any(on_device(value) for value in flat)
        if from_device and name not in CROSSING and any(is_host(value) for value in flat):
            raise DeviceError(f"{name}: Expected all tensors to be on the same device, but found at least two "
                              f"devices, cuda:0 and cpu!")
        to_host = "cpu" in named or name == "copy_" and not on_device(args[0])
        on_gpu = "cuda" in named or from_device and not to_host
        waits = not (name == "copy_" and (kwargs.get("non_blocking") or args[2:3] == (True,))
                     and self.is_pinned(args[0]))
        copy = from_device and to_host and name in ("_to_copy", "copy_", "to")  # (empty_like(device="cpu"): none)
        if from_device and name in HOST_READS or copy and waits:
            self.read(name)
        self.copies += copy and not waits
        self.launches += on_gpu and not func.is_view
        if (self.generator_capturing and self.capturing is None and on_gpu and name in RANDOM
                and kwargs.get("generator") is None):
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")
        if self.capturing is not None and on_gpu and any(is_host(value) for value in flat):
            raise DeviceError(f"{name}: a copy from pageable host memory while the stream is capturing")
        func = STAND_INS.get(func, func) if on_gpu else func
        elems = each(unwrapped, args, kwargs)
        out = func(*elems[0], **elems[1])
        if from_device and name not in HOST_READS and isinstance(out, (bool, int, float)):
            self.read(name)  # a number from the device, whatever the operator
        for value in flat:  # an out= variant may resize: the wrapper's shape would lie
            if on_device(value) and (value.shape != value.elem.shape or value.stride() != value.elem.stride()):
                raise DeviceError(f"{name} changed a tensor's shape to {tuple(value.elem.shape)}")
        if self.capturing is not None and on_gpu:
            self.capturing.append((func, *elems, out))
        if not on_gpu:
            return out
        given = {id(value.elem): value for value in flat if on_device(value)}  # an in-place result is its input
        return mapped(lambda value: (given[id(value)] if id(value) in given else wrap(value))
                      if isinstance(value, torch.Tensor) else value, out)


STATE = State()


class Mode(TorchDispatchMode):
    """Sends the played GPU the operators that name it without a tensor on it (a tensor made on cuda), and plays
    pinned host memory, which the CPU has none of without a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(on_device(value) or isinstance(value, torch.device) and value.type == "cuda"
               for value in leaves(*args, *kwargs.values())):
            return STATE.dispatch(func, args, kwargs)
        name = func.overloadpacket.__name__
        if name == "is_pinned":
            return STATE.is_pinned(args[0])
        if name in ("pin_memory", "_pin_memory"):
            return STATE.pin(args[0].clone())
        if kwargs.get("pin_memory"):
            return STATE.pin(func(*args, **dict(kwargs, pin_memory=False)))
        return func(*args, **kwargs)


class Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class Event:
    """Records the host's clock: every operator before it has run when it is recorded."""

    def __init__(self, *args, **kwargs):
        self.time = None

    def record(self, stream=None):
        self.time = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.time - self.time) * 1000


class CUDAGraph:
    """Replays the operators its capture recorded, on the tensors they ran on: a new result is copied into the
    captured one, as a kernel writes the same memory again."""

    def __init__(self, *args, **kwargs):
        self.recorded = []

    def replay(self):
        STATE.replays += 1
        for func, args, kwargs, out in self.recorded:
            for captured, again in zip(leaves(out), leaves(func(*args, **kwargs))):
                if isinstance(captured, torch.Tensor) and captured is not again:
                    captured.copy_(again)


@contextlib.contextmanager
def graph(cuda_graph, pool=None, stream=None, **kwargs):
    if pool is not None and pool.captured and not pool.graphs:
        STATE.generator_capturing = True  # registered by the capture's start, which fails before its end
        raise RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "/pytorch/c10/cuda/'
                           'CUDACachingAllocator.cpp":2799, please report a bug to PyTorch. ')
    cuda_graph.pool = pool if pool is not None else STATE.memory.new_pool()
    cuda_graph.pool.captured, cuda_graph.pool.graphs = True, cuda_graph.pool.graphs + 1
    weakref.finalize(cuda_graph, cuda_graph.pool.release)
    STATE.capturing, STATE.captures = cuda_graph.recorded, STATE.captures + 1
    STATE.memory.pool = cuda_graph.pool.usage
    try:
        yield
    finally:
        STATE.capturing = STATE.memory.pool = None


def sync_debug_mode(mode) -> None:
    STATE.strict = mode in ("error", 2)


class DefaultGenerator:
    """torch.cuda.default_generators[0]: a capture that failed before its end leaves it marked as capturing (every
    random draw on the GPU without a generator of its own then fails) until a copy of its state takes its place."""

    def clone_state(self):
        return DefaultGenerator()

    def graphsafe_set_state(self, other):
        STATE.generator_capturing = False


class HostGenerator(torch.Generator):
    """torch.Generator(device="cuda"), played by a host generator. (C++ hands operators a new wrapper of a generator,
    so which device it was made for cannot be checked.)"""

    def __new__(cls, device="cpu"):
        return super().__new__(cls)  # the device's would need CUDA


def context_device() -> torch.device:
    """The device of the innermost `with torch.device(...)`, else the default's (torch.get_default_device would make
    a tensor to find its index)."""
    contexts = [mode for mode in _get_current_function_mode_stack() if isinstance(mode, DeviceContext)]
    if contexts:
        return torch.device(contexts[-1].device)
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return CPU if context is None else torch.device(context.device)


def made_on_host(original):
    """torch.tensor or as_tensor given device="cuda", or within torch.device("cuda") (C++ would make it on CUDA
    itself): made on the host, then copied."""
    def make(data, *args, device=None, **kwargs):
        if torch.device(context_device() if device is None else device).type == "cuda":
            return original(data, *args, device=CPU, **kwargs).to(CUDA)
        return original(data, *args, device=device, **kwargs)
    return make


def read_list(tolist):
    """Tensor.tolist, which C++ refuses a subclass: from the played GPU, a read."""
    def read(tensor):
        if not on_device(tensor):
            return tolist(tensor)
        STATE.read("tolist")
        return tolist(tensor.elem)
    return read


def forget_what_was_found() -> None:
    """Clears what transformers caches of the machine (is_torch_cuda_available, get_available_devices...): found
    afresh inside a played GPU, and again after it, so that nothing of it outlives it."""
    for name in ("transformers.utils.import_utils", "transformers.utils"):
        if name not in sys.modules:
            continue
        for value in vars(sys.modules[name]).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@functools.cache
def register_device_guard() -> None:
    """Builds and loads tests/played_guard.cpp: C++ code that guards the device of a cuda tensor (indexing, .to)
    finds a guard, as CUDA's build has."""
    from torch.utils import cpp_extension

    build = os.path.join(tempfile.gettempdir(), f"run_generation_played_guard_{torch.__version__}")
    os.makedirs(build, exist_ok=True)
    cpp_extension.load(name="played_guard", sources=[os.path.join(os.path.dirname(__file__), "played_guard.cpp")],
                       build_directory=build, is_python_module=False)


@contextlib.contextmanager
def played_gpu(name="NVIDIA H200 (played by the CPU)", capability=(9, 0), bf16=True, capacity=141 << 30):
    """Within it torch sees one CUDA GPU (`name`, compute `capability`, with bfloat16 or not, `capacity` bytes of
    memory), played by the CPU, in this thread and in every thread started in it; yields its State."""
    global STATE
    register_device_guard()
    STATE = State(capacity)
    cuda = {"_lazy_init": lambda: None, "is_available": lambda: True, "device_count": lambda: 1,
            "current_device": lambda: 0, "set_device": lambda device: None, "_exchange_device": lambda device: 0,
            "_maybe_exchange_device": lambda device: 0, "get_device_capability": lambda device=None: capability,
            "get_device_name": lambda device=None: name, "is_bf16_supported": lambda including_emulation=True: bf16,
            "Stream": Stream, "current_stream": lambda device=None: Stream(), "set_stream": lambda stream: None,
            "stream": lambda stream: contextlib.nullcontext(), "Event": Event, "synchronize": lambda device=None: None,
            "CUDAGraph": CUDAGraph, "graph": graph, "graph_pool_handle": lambda: STATE.memory.new_pool(),
            "set_sync_debug_mode": sync_debug_mode, "empty_cache": lambda: None,
            "default_generators": (DefaultGenerator(),),
            "mem_get_info": lambda device=None: (capacity - STATE.memory.reserved, capacity),
            "memory_allocated": lambda device=None: STATE.memory.allocated,
            "memory_reserved": lambda device=None: STATE.memory.reserved,
            "set_per_process_memory_fraction": lambda fraction, device=None: STATE.memory.limit(fraction),
            "max_memory_allocated": lambda device=None: STATE.memory.peak,
            "reset_peak_memory_stats": lambda device=None: STATE.memory.reset_peak(),
            "get_device_properties": lambda device=None: types.SimpleNamespace(
                name=name, total_memory=capacity, multi_processor_count=132, major=capability[0],
                minor=capability[1], L2_cache_size=60 << 20)}
    run = threading.Thread.run

    def run_played(thread):  # a dispatch mode is its thread's own
        with Mode():
            run(thread)

    device_constructors()  # cached first with the real torch.tensor, which torch.device("meta") must still see
    with pytest.MonkeyPatch.context() as patch:
        for attribute, value in cuda.items():
            patch.setattr(torch.cuda, attribute, value)
        module_of = torch.get_device_module
        patch.setattr(torch, "get_device_module", lambda device=None: torch.cuda if device is None or torch.device(
            device).type == "cuda" else module_of(device))
        patch.setattr(torch.accelerator, "is_available", lambda: True)
        patch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        patch.setattr(torch.accelerator, "device_count", lambda: 1)  # the one GPU played (torch.cuda's count)
        patch.setattr(torch.Tensor, "tolist", read_list(torch.Tensor.tolist))
        patch.setattr(torch, "Generator", HostGenerator)
        for factory in ("tensor", "as_tensor"):
            patch.setattr(torch, factory, made_on_host(getattr(torch, factory)))
        patch.setattr(threading.Thread, "run", run_played)
        forget_what_was_found()
        try:
            with Mode():
                yield STATE
        finally:
            forget_what_was_found()


if __name__ == "__main__":  # python tests/virtual_cuda.py -m MODULE [ARGS...]: MODULE run on a played GPU
    import runpy

    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        sys.exit("usage: python tests/virtual_cuda.py -m MODULE [ARGS...]")
    sys.path.insert(0, os.getcwd())
    module, sys.argv = sys.argv[2], sys.argv[2:]
    with played_gpu():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
