"""Ctrl-C as a request to stop generating, not to lose what was generated: the first ends the generation at its
next step (the engine's requests cancelled; generate() stopped by this object, a stopping criterion) and the
caller keeps and writes what came; a second raises KeyboardInterrupt at once."""

import contextlib
import os
import signal
import threading

import torch


@contextlib.contextmanager
def ctrl_c_deferred():
    """Ctrl-C waits until the block is done (then acts as it would have): for work that must not stop halfway, such
    as a model released and its replacement not yet built. Main thread only, where signals are heard."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class CtrlC:
    """The generation's Ctrl-C; `interrupted` once pressed. `requests`: the engine's requests it cancels."""

    def __init__(self):
        self.interrupted, self.requests = False, []

    def __call__(self, input_ids, scores, **kwargs):
        """generate()'s stopping criterion: every sequence stops once interrupted (not transformers' subclass, so
        that nothing here imports it)."""
        return torch.full((input_ids.shape[0],), self.interrupted, dtype=torch.bool, device=input_ids.device)

    def stop(self):
        self.interrupted = True
        for request in self.requests:
            request.cancelled = True  # it ends at the next step, with what it has

    @contextlib.contextmanager
    def catching(self, requests=()):
        """Ctrl-C stops the generation while inside (and `requests` with it). Where SIGINT is not Python's own
        (a caller's handler) or this is not the main thread (where only signals are heard), it is left alone."""
        self.requests = list(requests)
        if threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield self
            return

        def on_ctrl_c(signum, frame):
            if self.interrupted:
                raise KeyboardInterrupt
            self.stop()

        previous = signal.signal(signal.SIGINT, on_ctrl_c)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def signal_children(signum) -> None:
    """Sends `signum` to this process's descendants (Linux's /proc; none found elsewhere): a signal sent to this
    process alone (SIGTERM from `timeout`, a scheduler) reaches a kernel build's ninja and its compilers, which a
    terminal's Ctrl-C reaches by itself (the whole process group)."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                parents[int(entry)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    family, grown = {os.getpid()}, True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family, grown = family | more, bool(more)
    for pid in family - {os.getpid()}:
        try:
            os.kill(pid, signum)
        except OSError:
            continue
