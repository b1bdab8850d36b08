"""Several processes under accelerate (data parallel): the main process reads and writes, every
process generates a contiguous share of the prompts, and results are gathered after each round."""

from __future__ import annotations

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object


def start(use_cpu: bool) -> PartialState:
    """This process's place among the launched ones (one process, when not launched)."""
    # Without an accelerator, several launched processes must ask for CPU to get a gloo group.
    return PartialState(cpu=use_cpu or not torch.accelerator.is_available())


def share_prompts(state: PartialState, prompts: list | None) -> list:
    """The main process's prompts, on every process (only the main process reads stdin)."""
    return broadcast_object_list([prompts])[0] if state.num_processes > 1 else prompts


def my_share(state: PartialState, items: list) -> list:
    """This process's contiguous share of `items`."""
    with state.split_between_processes(items) as share:
        return share


def rounds(state: PartialState, my_rounds: int) -> int:
    """How many rounds everyone runs: gathers are collective, so every process joins each round,
    with an empty batch if it has none left."""
    return max(gather_object([my_rounds])) if state.num_processes > 1 else my_rounds


def gather(state: PartialState, results: list) -> list:
    """Every process's results, in process order (on every process)."""
    return gather_object(results) if state.num_processes > 1 else results


def finish(state: PartialState) -> None:
    """Leaves the process group, all processes together."""
    if state.num_processes > 1:
        # Everyone leaves the group together: CI once saw the main process abort while tearing it down
        # ("terminate called without an active exception", about 1 run in 50), the other one already gone.
        state.wait_for_everyone()
        state.destroy_process_group()
