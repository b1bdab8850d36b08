"""The GGUF runtime: a GGUF file run on the CPU in its own quantized blocks.

(Overview written below, once the modules are in place.)
"""

from __future__ import annotations

import importlib

# The names the rest of the tool uses, by the module that holds each: imported where first asked for, so that a run
# without a GGUF file imports none of this package's modules but the kernels' and the blocks'.
PUBLIC = {
    "native_kernels": "kernels", "kernel_cache_dir": "kernels",
    "holds_blocks": "blocks", "GGMLLinear": "blocks",
    "GGUFCausalLM": "model",
    "GGUFError": "file", "GGUFHeader": "file", "build_model": "file", "metadata_parsed_once": "file",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
