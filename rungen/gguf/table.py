"""A GGUF file's tensor table (each tensor's name, type, shape, offset and size), read once a process, an F32
tensor's values read from it, and the one line that says why a file cannot be read."""

from __future__ import annotations

import copy
import functools
import os
import re

import numpy as np

from .families import FAMILIES, WITH_EXPERTS
from .weights import GGUFError


def tensor_table(path: str) -> tuple[str, list]:
    """(architecture, [[name, type code, numpy shape, numpy dtype, byte offset in the file, bytes], ...]): by
    transformers' reader, which skips the vocabulary (the gguf package's builds it object by object), else (a type
    transformers cannot size: Q5_0, Q5_1, MXFP4; a malformed file) by the gguf package's. Read once a process for
    the file as it is (a header's first reading asks for it twice)."""
    stat = os.stat(path)
    architecture, rows = _tensor_table(path, stat.st_size, stat.st_mtime_ns)
    return architecture, copy.deepcopy(rows)


@functools.lru_cache(maxsize=4)
def _tensor_table(path: str, size: int, mtime_ns: int) -> tuple[str, list]:
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        table = GgufHeader.from_file(path)
    except Exception:
        return _read_with_gguf(path)
    return table.architecture, [[t.name, t.ggml_type, *_numpy_layout(t.ggml_type, t.shape),
                                 table.data_start + t.offset, t.nbytes] for t in table.tensors]


def _read_with_gguf(path: str) -> tuple[str, list]:
    """(architecture, tensor table) by the gguf package's reader, which knows every ggml type."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    except Exception as error:  # the gguf package raises whatever a malformed file triggers
        raise GGUFError(f"{path}: not a readable GGUF file ({why_unreadable(path, error)})") from None
    return architecture, [[t.name, int(t.tensor_type), list(t.data.shape), t.data.dtype.str, int(t.data_offset),
                           int(t.data.nbytes)] for t in reader.tensors]


def _numpy_layout(code: int, shape) -> tuple[list[int], str]:
    """(shape, numpy dtype) the loader views a tensor's bytes as: values for F32/F16, uint8 rows otherwise."""
    from gguf import GGML_QUANT_SIZES

    if code in (0, 1):
        return list(shape), "<f4" if code == 0 else "<f2"
    block, size = GGML_QUANT_SIZES.get(code, (1, 1))  # BF16: (1, 2)
    return [*shape[:-1], shape[-1] // block * size], "|u1"


def f32_values(path: str, row: list) -> np.ndarray:
    """An F32 tensor's values, read from the file (`row`: tensor_table's)."""
    return np.fromfile(path, dtype="<f4", count=int(np.prod(row[2])), offset=row[4])


def check_whole(path: str, tensors: list[tuple[int, int]]) -> None:
    """GGUFError where the file ends before its tensors (byte offset, bytes) do: a download or copy cut short."""
    end, size = max((offset + nbytes for offset, nbytes in tensors), default=0), os.path.getsize(path)
    if end > size:
        raise GGUFError(f"{path}: truncated (its tensors end at byte {end}, the file has {size}: an unfinished "
                        "download or copy?)")


def why_unreadable(path: str, error: BaseException) -> str:
    """What a header's reader tripped on, said as the user can act on it: no GGUF at all, or a header cut short
    or damaged (an unfinished download), with the reader's own words."""
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as unreadable:
        return first_line(unreadable)
    if magic != b"GGUF":
        return f"it starts with {magic!r}, not GGUF" if magic else "it is empty"
    return f"its header is cut short or damaged: {first_line(error)}"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    unknown = re.match(r"Unknown gguf model_type: (\S+) in gguf-py", text)
    if unknown and unknown[1] in WITH_EXPERTS.values():  # read by this tool's loader, not by transformers'
        architecture = FAMILIES[unknown[1]].architecture
        return (f"transformers reads no {unknown[1]} file ({architecture}'s with experts, as llama.cpp writes it); "
                "it runs here in its own blocks, without --dequantize or --device_map")
    if unknown:  # transformers' advice (a newer gguf package) would not help: llama.cpp writes no such name
        return (f"its general.architecture {unknown[1]!r} is none the gguf package's name table knows, so "
                "transformers cannot map its tensors")
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


