"""Embeddings (the server's /v1/embeddings): a text's vector is its last token's final hidden state, L2-normalised;
in a causal decoder only the last position sees the whole text, and decoder embedding models pool it. Left-padded
batches with each row's own positions give a text the same vector alone and batched (docs/server.md)."""

from __future__ import annotations

import base64
import inspect

import torch

BATCH_TOKENS = 4096  # rows x longest input of one forward pass (an input longer than that runs alone)
BATCH_ROWS = 32


def batches(lengths: list[int], rows: int = BATCH_ROWS, tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """The inputs' indices grouped into forward passes: sorted by length (little padding), each group within
    `rows` inputs and `rows x longest` within `tokens`."""
    groups, group = [], []
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        if group and (len(group) >= rows or (len(group) + 1) * lengths[index] > tokens):
            groups.append(group)
            group = []
        group.append(index)
    return groups + [group] if group else groups


def final_hidden_states(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[batch, tokens, hidden]: the model's final norm's output over a left-padded batch, without a cache."""
    own = getattr(model, "final_hidden_states", None)
    if own is not None:  # rungen/gguf/model.py's model: its forward without the head
        return own(ids, attention_mask=mask, position_ids=positions)
    # Not output_hidden_states: it records layers by class, and rungen/gguf/decoder.py's fused layers are another.
    base = model.base_model
    parameters = inspect.signature(base.forward).parameters
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in parameters:
        kwargs["position_ids"] = positions
    if "use_cache" in parameters:
        kwargs["use_cache"] = False
    return base(**kwargs).last_hidden_state


def embed(loaded, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), hidden] float32 on the CPU: each prompt's last token's final hidden state, L2-normalised,
    from one forward pass over the left-padded batch. Runs the model: call it on the engine's model thread."""
    width = max(len(ids) for ids in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # the padding's id is masked: any valid one does
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # counted from each row's first token, as generate() counts
    device = loaded.input_device
    with torch.inference_mode():
        hidden = final_hidden_states(loaded.model, ids.to(device), mask.to(device), positions.to(device))
        return torch.nn.functional.normalize(hidden[:, -1].float().cpu(), dim=-1)


def as_base64(vector: torch.Tensor) -> str:
    """A vector as OpenAI's encoding_format "base64" sends it: its little-endian float32 bytes in base64."""
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
