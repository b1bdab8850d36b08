"""The generation engine of the server, the piped prompts and the session's turns: continuous batching, per-row
sampling and stopping (engine_refusal says which settings it cannot honour: generate() runs those). The server runs
it on a model thread of its own, the command line and the session on the calling thread (run_prompts).

Between decode steps, waiting requests are admitted (rungen/admission.py says which and when): prefilled (after the
prefix cache's longest match; on fixed slots those admitted together in one pass, rungen/prefill.py) they get their
first tokens and join the batch. Out of GPU memory, the newest request gives way to the others. Every row's next
token is chosen at once on the model's device (rungen/sampling.py), with one copy to the host a step;
log-probabilities are the model's raw ones. The batch and its steps are rungen/decode.py's (on a GPU each step is
launched before the last one is read).
"""

import inspect
import queue
import threading

import torch

from . import logger
from .admission import Admission
from .batch_cache import layer_shapes, probed_layers, state_bytes, token_bytes
from .decode import DecodeBatch
from .errors import one_line
from .generation import UNBATCHABLE_TYPES
from .kvcache import MIN_ROOM
from .metrics import Metrics
from .prefix_cache import PrefixCache
from .requests import Done, End, Finish
from .rows import Reporter, Resume


class EngineBusy(RuntimeError):
    """The queue is full (HTTP 503 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class Engine:
    """Owns the model on its own thread; submit() queues a Request, whose events reach request.sink."""

    def __init__(self, loaded, *, max_batch=16, max_queue=64, max_cache_tokens=65536, prefix_cache_bytes=256 << 20,
                 eos_ids=(), metrics=None, tokenizer_lock=None, threads=0):
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.threads = threads  # torch's intra-op threads on the model thread (0: the process's setting)
        self.device = loaded.input_device
        self.max_batch, self.max_queue, self.max_cache_tokens = max_batch, max_queue, max_cache_tokens
        self.eos_ids = set(eos_ids)
        self.metrics = metrics or Metrics()
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self.reporter = Reporter(self.tokenizer, self.tokenizer_lock, self.eos_ids)
        parameters = inspect.signature(self.model.forward).parameters
        if loaded.model_type in UNBATCHABLE_TYPES:
            raise ValueError(f"{loaded.model_type} drops the attention mask when decoding, so it cannot share a "
                             "padded batch with other requests")
        if "past_key_values" not in parameters:
            raise ValueError(f"{loaded.model_type} keeps no key/value cache, which continuous batching needs")
        self.use_positions = "position_ids" in parameters
        self.calls = queue.Queue()  # functions to run on the model thread between steps (prompt scoring)
        self.wake = threading.Condition()
        # One one-token pass says what a token's keys and values take and the shapes the slots hold them in.
        bos = self.tokenizer.bos_token_id
        states = []
        layers = probed_layers(self.model, self.device, loaded.model_type, 0 if bos is None else bos, states)
        self.bytes_per_token = token_bytes(layers)
        self.bytes_per_row = state_bytes(states)  # (recurrent layers' states: the same whatever the row's length)
        # (a model with recurrent layers: its prefix cache's entries hold a row's states after exactly their tokens)
        self.keeps_states = bool(states)
        del states
        self.batch = DecodeBatch(self.model, self.device, self.use_positions, max_batch, loaded.context,
                                 reporter=self.reporter, metrics=self.metrics, eos_ids=self.eos_ids,
                                 prefix_cache=PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None,
                                 shapes=layer_shapes(layers))
        del layers
        self.admission = Admission(self.model, self.batch, self.wake, max_batch=max_batch,
                                   max_cache_tokens=max_cache_tokens, use_positions=self.use_positions,
                                   keep_last="logits_to_keep" in parameters)
        self.waiting = self.admission.waiting  # the queue, guarded by `wake`
        self.closing = self.stopped = False
        self.admission.stopping = lambda: self.stopped
        self.thread = threading.Thread(target=self.loop, name="rungen-engine", daemon=True)

    # -- the server's side ------------------------------------------------------------------------------

    def start(self):
        self.thread.start()

    def submit(self, request):
        """Queues a request; raises EngineBusy (queue full) or EngineClosed (shutting down)."""
        with self.wake:
            if self.closing:
                raise EngineClosed("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise EngineBusy(f"{len(self.waiting)} requests are waiting already (--max_queue)")
            self.waiting.append(request)
            self.wake.notify()

    def call(self, function):
        """Runs function() on the model thread between two steps; returns a concurrent Future."""
        import concurrent.futures

        future = concurrent.futures.Future()
        with self.wake:
            if self.closing:
                raise EngineClosed("the server is shutting down")
            self.calls.put((function, future))
            self.wake.notify()
        return future

    def close(self):
        """Takes no new requests; running and waiting ones go on until abort() or their end."""
        with self.wake:
            self.closing = True
            self.wake.notify()

    def abort(self):
        """Ends every request now: each choice gets finish_reason "abort"; the thread then stops."""
        with self.wake:
            self.stopped = True
            self.wake.notify()

    def idle(self):
        return not self.batch.rows and not self.waiting and self.calls.empty()

    @property
    def queue_depth(self):
        return len(self.waiting)

    @property
    def prefix_cache(self):
        """The finished rows' keys/values that a request starting the same way prefills after (None: off); the
        batch keeps them, the prefill reads them."""
        return self.batch.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache):
        self.batch.prefix_cache = cache

    @property
    def cache_limit_bytes(self):
        return self.max_cache_tokens * self.bytes_per_token

    # -- the model thread ---------------------------------------------------------------------------------

    def loop(self):
        if self.threads:
            torch.set_num_threads(self.threads)  # per thread under OpenMP: this thread's parallel regions
        while True:
            with self.wake:
                while not self.stopped and not self.batch.rows and not self.waiting and self.calls.empty():
                    if self.closing:
                        return
                    self.wake.wait()
                stopped = self.stopped
            if stopped:
                self.end_all("abort")
                return
            try:
                self.run_calls()
                self.admission.admit()
                if self.batch.rows:
                    self.step()
            except Exception as error:  # a failed step fails its requests, never the server
                joining = self.admission.joining
                if isinstance(error, torch.OutOfMemoryError) and joining and not self.batch.rows:
                    why = one_line(error)
                    logger.warning("out of GPU memory for a request alone: %s", why)
                    self.turn_away(joining, f"out of GPU memory for this prompt alone ({why}); send a shorter "
                                            "prompt or fewer tokens")
                else:
                    logger.exception("the engine step failed")
                    self.end_all("abort", error=f"generation failed: {error}")

    def run_here(self):
        """Runs the model loop on the calling thread until every submitted request has ended (a failed step
        raises)."""
        try:
            while self.batch.rows or self.waiting:
                self.admission.admit()
                if self.batch.rows:
                    self.step()
        except BaseException:
            # Stopped mid-step: the half-updated batch's requests are given up, the engine left empty.
            self.batch.clear()
            self.admission.joining = []
            self.waiting.clear()
            raise

    def step(self):
        """One decode step of the batch; out of GPU memory, the newest request gives way and the others go on
        (rungen/admission.py), once the batch holds more than one."""
        try:
            self.batch.step()
        except torch.OutOfMemoryError as error:
            if not self.admission.give_way(error):
                raise

    def run_calls(self):
        if not self.calls.empty():
            self.batch.drain()
        while True:
            try:
                function, future = self.calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except Exception as error:
                    future.set_exception(error)

    def turn_away(self, requests, error, reason="abort"):
        """Ends requests none of whose rows ran (each row's Done, then its End) and rows waiting to go on (rows.Resume:
        Done where they were), and whatever the batch held of them."""
        self.batch.clear()
        self.admission.joining = []
        for request in requests:
            if isinstance(request, Resume):
                self.batch.give_up(request, reason, error)
                continue
            for index in range(request.n):
                request.sink(Done(index, Finish(reason, "", [], len(request.ids), error)))
            request.sink(End())

    def end_all(self, reason, error=None):
        """Ends every running, joining and waiting request (shutdown's grace is over, or a step failed)."""
        requests = []
        for row in self.batch.rows:
            if row.finish is None:
                row.finish = self.reporter.cut_short(row, reason, error)
            row.request.sink(Done(row.index, row.finish))
            if row.request not in requests:
                requests.append(row.request)
        joining = [entry for entry in self.admission.joining  # those whose rows entered the batch are ended
                   if (all(row is not entry.row for row in self.batch.rows) if isinstance(entry, Resume)
                       else entry not in requests)]
        for request in requests:
            if not request.away:  # else its End follows its last row waiting to go on (turn_away)
                request.sink(End())
        with self.wake:
            waiting = list(self.waiting)
            self.waiting.clear()
        self.turn_away(joining + waiting, error, reason)
        while True:
            try:
                _, future = self.calls.get_nowait()
            except queue.Empty:
                break
            future.cancel()


def describe_memory(engine):
    """One line stating the cache's form and bound."""
    room = ""
    if getattr(engine.model, "cache_grows_in_place", False):  # room to grow: a quarter of a row, or MIN_ROOM
        most = engine.cache_limit_bytes * 5 / 4 + engine.max_batch * MIN_ROOM * engine.bytes_per_token
        room = f", {most / 2**30:.2f} GiB with the room left to grow"
    fewer = engine.batch.kv.rings or engine.batch.kv.windows is not None  # (the own model's SlidingLayers)
    every = " (every layer's: a sliding layer holds fewer)" if fewer else ""
    states = (f", and {engine.bytes_per_row / 2**20:.1f} MiB of recurrent state a row "
              f"({engine.bytes_per_row * engine.max_batch / 2**30:.2f} GiB)" if engine.bytes_per_row else "")
    prefix = (engine.prefix_cache.max_bytes if engine.prefix_cache else 0) / 2**20
    return (f"KV cache in {engine.batch.kv.form}: {engine.bytes_per_token / 1024:.1f} KiB per token position{every}, "
            f"at most {engine.max_cache_tokens} "
            f"positions ({engine.cache_limit_bytes / 2**30:.2f} GiB{room}) over at most {engine.max_batch} rows"
            f"{states}; prefix cache at most {prefix:.0f} MiB")

