"""Several processes under accelerate (data parallel): the main process reads and writes, every
process generates a contiguous share of the prompts, and results are gathered after each round.

A process on its own gets OneProcess for accelerate's PartialState, sparing every run accelerate's import."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

import torch


@dataclasses.dataclass
class OneProcess:
    """PartialState's answers for a process that no launcher started: the main and only one."""

    device: torch.device
    num_processes: int = 1
    is_main_process: bool = True

    @contextlib.contextmanager
    def main_process_first(self):
        yield

    @contextlib.contextmanager
    def split_between_processes(self, items):
        yield items


def launched() -> bool:
    """Whether a launcher (accelerate launch, torchrun) started this process among others."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("LOCAL_RANK", "-1")) != -1


def rank() -> int:
    """This process's rank among the launched ones (0: the main process, or no launcher)."""
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def said_once(log):
    """Warnings of `log` within it shown by the main process alone: what every launched process checks alike (the
    flags) is said once, not once a process."""
    if rank() == 0:
        yield
        return
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# What gloo and NCCL say when another process of the group has gone (it ended, or failed and said why).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another launched process has gone."""
    if not launched():
        return False
    import torch.distributed

    return isinstance(error, (RuntimeError, torch.distributed.DistError)) and any(
        words in str(error) for words in PEER_GONE)


def start(use_cpu: bool):
    """This process's place among the launched ones (one process, when not launched)."""
    # Without an accelerator, several launched processes must ask for CPU to get a gloo group.
    cpu = use_cpu or not torch.accelerator.is_available()
    if not launched():
        # PartialState's device for one process: the accelerator's type without an index, or the CPU.
        device = torch.device("cpu") if cpu else torch.device(torch.accelerator.current_accelerator().type)
        if device.type == "mps":  # as PartialState: operators MPS lacks run on the CPU
            os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] = "1"
        return OneProcess(device)
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def share_prompts(state, prompts: list | None) -> list:
    """The main process's prompts, on every process (only the main process reads stdin)."""
    if state.num_processes == 1:
        return prompts
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([prompts])[0]


def my_share(state, items: list) -> list:
    """This process's contiguous share of `items`."""
    with state.split_between_processes(items) as share:
        return share


def rounds(state, my_rounds: int) -> int:
    """How many rounds everyone runs: gathers are collective, so each process joins every round."""
    if state.num_processes == 1:
        return my_rounds
    from accelerate.utils import gather_object

    return max(gather_object([my_rounds]))


def gather(state, results: list) -> list:
    """Every process's results, in process order (on every process)."""
    if state.num_processes == 1:
        return results
    from accelerate.utils import gather_object

    return gather_object(results)


# Set by run_generation.command when it ends a launched process itself: finish() leaves the teardown to that exit.
exit_follows = False


def finish(state) -> None:
    """Leaves the process group, all processes together."""
    if state.num_processes > 1:
        state.wait_for_everyone()  # every process is past its last collective
        if not exit_follows:
            state.destroy_process_group()


def end_launched_process(code: int):
    """Ends a launched process at once with `code`, its output flushed, skipping the group's teardown and the
    interpreter's shutdown: gloo's or torch's native teardown sometimes aborts (SIGABRT) after all output is
    written, failing the launch, and nothing is left there the operating system does not do."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that has gone (| head), a stream already closed
            pass
    os._exit(code)
