"""A waiting request's prompt through the model before its rows join the batch, after the prefix cache's longest
match: alone (its keys/values enter the batch's form at the next merge), or, where the batch keeps fixed slots,
several requests in one pass written straight into their slots: under load the prompts share one pass (one set of
launches on a GPU, larger matrix products on a CPU) instead of each waiting for the ones before it.
"""

from __future__ import annotations

import dataclasses

import torch

from . import logger
from .kvcache import layers_of, new_cache, put_states, recurrent, states_of


@dataclasses.dataclass
class Prefilled:
    reused: int  # prompt tokens the prefix cache held
    part: object  # what the batch's merge() takes (None: in its slots already)
    logits: torch.Tensor  # [1, vocabulary]: the next token's, float32


RING_PASS = 1024  # a pass's tokens where the sliding layers hold rings: a ring holds the window and a pass
OWN_PASS = 512  # a prompt's passes on the own GGUF model (docs/performance.md: no slower than one pass)


def pass_tokens(device: torch.device, rings: bool = False) -> int:
    """The most tokens a pass together takes, padding included (rows x the longest). A GPU's pass costs about what
    one prompt's does (its launches): many. A CPU's costs the prompts' arithmetic, which one pass only makes a little
    cheaper, and every request in it waits for all of it: few (docs/performance.md measures both ways). `rings`:
    where the sliding layers hold rings (rungen/slots.py), which a pass must not go round, at most RING_PASS."""
    most = 4096 if device.type == "cuda" else 256
    return min(most, RING_PASS) if rings else most


def together_tokens(requests) -> int:
    """The tokens a pass for `requests` together computes, padding included (the prefix cache's aside)."""
    return len(requests) * max(len(request.ids) for request in requests)


def prefill_alone(model, kv, request, prefix_cache, device, *, use_positions, keep_last, turn_ends=()) -> Prefilled:
    """The request's prompt after the prefix cache's longest match, in one pass; on the own GGUF model in passes of
    OWN_PASS tokens: its sliding layers then let go of what their window no longer reaches between passes (they hold
    every position of a pass), and a pass's activations are the pass's (the same bits: the native products take each
    row alike). A model with recurrent layers, where a prefix cache is kept: the cache keeps its keys/values and
    states (a state stands for exactly its tokens) after the prompt's last token but one (the same prompt again, or
    one that goes on from it, starts from there), after its first turn's end (the first of `turn_ends`, the tokens
    that end a turn, within it: an application's chats under one system prompt share it) and after its last turn's
    end (a conversation's next turn renders the history before it alike, where a template drops a reply's reasoning
    or renders the generation prompt otherwise), the passes stopping there."""
    ids = request.ids
    reused, layers, buffers, states = prefix_cache.longest(ids) if prefix_cache else (0, None, None, None)
    # Stored tensors are never written to (a cache copies them), unless the prefix cache gave the buffers up.
    cache = new_cache(model, layers, buffers, reused)
    if states:
        put_states(cache, states)
    step = OWN_PASS if getattr(model, "own_cache", False) else len(ids)
    ends = [min(len(ids), start + step) for start in range(reused, len(ids), step)]
    checkpoints = set()
    if prefix_cache is not None and any(recurrent(layer) for layer in cache.layers):
        turns = [at + 1 for at, token in enumerate(ids[:-1]) if token in turn_ends]
        checkpoints = {end for end in (len(ids) - 1, *turns[:1], *turns[-1:]) if end > reused}
        ends = sorted({*ends, *checkpoints})
    with torch.inference_mode():
        for start, end in zip([reused, *ends], ends):
            kwargs = {}
            if use_positions:
                kwargs["position_ids"] = torch.arange(start, end, device=device)[None]
            if start:
                kwargs["attention_mask"] = torch.ones(1, end, dtype=torch.long, device=device)
            if keep_last:
                kwargs["logits_to_keep"] = 1  # the prompt's other logits are never read
            output = model(input_ids=torch.tensor([ids[start:end]], device=device), past_key_values=cache,
                           use_cache=True, **kwargs)
            if end in checkpoints:
                keep_checkpoint(prefix_cache, ids[:end], cache)
    return Prefilled(reused, kv.part(output, request.n, len(ids)), output.logits[:, -1].float())


def keep_checkpoint(prefix_cache, tokens, cache) -> None:
    """The prefix cache keeps copies of `cache`'s keys/values and recurrent states after `tokens` (a prompt's
    pass stopped short of its last token); out of GPU memory, the cache gives up its entries instead (it only saves
    time)."""
    try:
        prefix_cache.keep(tokens, layers_of(cache), states=states_of(cache))
    except torch.OutOfMemoryError:
        prefix_cache.give_up("a prompt's recurrent states")


def prefill_together(kv, requests, prefix_cache, reserve: int, chunk: int | None = None) -> list[Prefilled]:
    """The requests' prompts in one pass into the slots after the batch's (kv.prefill); `reserve`: the positions a
    row of the batch takes at most, theirs included; `chunk`: a prompt alone in passes of that many tokens."""
    prompts = []
    for request in requests:  # (the slots hold no recurrent layer's state)
        reused, layers, *_ = prefix_cache.longest(request.ids, states=False) if prefix_cache else (0, None)
        prompts.append((request.ids, reused, layers, request.n))
    logits = kv.prefill(prompts, reserve, chunk)
    return [Prefilled(reused, None, logits[number : number + 1])
            for number, (_, reused, _, _) in enumerate(prompts)]


def into_slots(kv, requests, device: torch.device) -> bool:
    """Whether `requests` go straight into their slots (kv.prefill), not each prefilled alone: several together, or a
    prompt longer than a pass, a pass at a time, on a GPU (or a CPU where the slots hold rings): prefilled alone, its
    keys/values would stand twice at the merge (the prefill's cache and the slot), its activations whole (and a
    sliding layer's every position). The rows prefilled alone before must enter their slots first (their merge)."""
    if len(requests) > 1:
        return True
    return kv.prefills_together and len(requests[0].ids) > kv.pass_tokens and (device.type == "cuda" or kv.rings)


def prefill_group(model, kv, requests, prefix_cache, device, rows: int, reserve: int, *, use_positions, keep_last,
                  turn_ends=()) -> list[Prefilled] | None:
    """The requests prefilled after the batch's `rows` rows (together where there are several), their slots made
    first so that nothing joins half; None where the GPU has no memory for them beside those rows, which go on
    untouched (alone, that is raised), even once the prefix cache's entries are given up."""
    try:
        kv.make_room(rows + sum(request.n for request in requests), reserve)
        if into_slots(kv, requests, device):
            return prefill_together(kv, requests, prefix_cache, reserve, kv.pass_tokens)
        return [prefill_alone(model, kv, requests[0], prefix_cache, device, use_positions=use_positions,
                              keep_last=keep_last, turn_ends=turn_ends)]
    except torch.OutOfMemoryError:
        if prefix_cache is not None and prefix_cache.give_up("a prefill"):  # tried again without it
            return prefill_group(model, kv, requests, prefix_cache, device, rows, reserve,
                                 use_positions=use_positions, keep_last=keep_last, turn_ends=turn_ends)
        if not rows:
            raise
        logger.warning("out of GPU memory for %d waiting request(s) beside %d running rows: they wait for rows to "
                       "leave", len(requests), rows)
        return None
