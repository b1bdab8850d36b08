"""The generation engine of the server, the piped prompts and the session's turns: continuous batching,
per-row sampling and stopping. The server runs it on a model thread of its own; the command line and the
session on their own thread (run_prompts), for every setting it can honour (engine_refusal says which it
cannot: generate() runs those).

Requests wait in a bounded queue. The model thread runs one decode step at a time for every active row;
between steps it admits waiting requests: each is prefilled alone (after the longest start of its tokens
that a recently finished sequence shares: a conversation's earlier turns, a common system prompt) and gets
its first token; then their keys/values join the batch's, and they decode with the others from the next step
on. A row ends on EOS, max_tokens, a stop string, its grammar or a cancelled request.

Where the batch's keys/values live:
- in fixed slots (rungen/slots.py) on transformers' llama-shaped models: a joining row's are written into its
  slot, a step writes each row's new position in place, a row that ends frees its slot to the last row; on a
  CUDA GPU the steps are replayed from CUDA graphs;
- elsewhere (the own GGUF model code, other families) in a left-padded batch: transformers' DynamicCache, or
  the own model's Cache (rungen/kvcache.py: growing in place where the model's attention reads it so; a
  sliding-window layer holds every position too, its mask applying the window) holding [batch, kv_heads,
  length, head_dim] per layer. The joining rows' keys/values and the batch's are left-padded to the longest and
  concatenated in one copy; a row that ends leaves by index_select and the columns no row needs are trimmed; an
  attention mask and per-row position ids hide the padding, so each row computes what it would alone (the
  layout generate() uses for a left-padded batch).
Memory: a request is admitted only while rows x the longest (prompt + max_tokens) of the batch fits in
`max_cache_tokens` (the slots round rows and positions up to their buckets).

Every row's next token is chosen at once on the model's device (rungen/sampling.py: OpenAI's logit_bias and
presence/frequency penalties, transformers' repetition_penalty, the grammar's mask, then greedy, or temperature,
top-k, top-p, min-p and a draw from the row's own generator, seeded by `seed`), with one copy to the host a step.
Log-probabilities are the model's raw ones (rungen/logprobs.py).
"""

import collections
import dataclasses
import inspect
import os
import queue
import sys
import threading
import time

import torch

from . import logger
from .errors import GenerationError, one_line
from .generation import (
    UNBATCHABLE_TYPES,
    StuckError,
    describe_sequence,
    eos_token_ids,
    make_batches,
    stop_strings,
    stuck_error,
)
from .kvcache import MIN_ROOM, full_attention, growing, new_cache
from .logprobs import content_items
from .sampling import Picked, RowState, Sampling, choose
from .slots import DecodeGraphs, SlotCache, decode_step

GRAPHS_ENV = "RUN_GENERATION_CUDA_GRAPHS"

# Prompt tokens decoded before a row's new tokens to get their text in context: decoding the whole prompt at
# every step would cost as much as the prompt is long.
TAIL_TOKENS = 32


class EngineBusy(RuntimeError):
    """The queue is full (HTTP 503 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


@dataclasses.dataclass
class Request:
    """One generation request: n rows from one prompt. `sink(event)` is called from the model thread with
    ("delta", index, text, logprob_items), ("done", index, Finish) and finally ("end", None)."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    sink: object
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    constraint: object = None  # rungen.constrain.Constraint
    # Token ids that close the thinking block the reply starts in: the constraint applies from the token after them.
    reasoning_end: tuple[int, ...] | None = None
    deltas: bool = True  # text as it grows (a stream); False: the text once, at the end (a stop string is still cut)
    cancelled: bool = False  # set by the server (client gone) or a session (Ctrl-C); the row leaves at the next step
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    reused: int = 0  # prompt tokens whose keys/values came from the prefix cache

    @property
    def reserve(self):
        return len(self.ids) + self.max_tokens


@dataclasses.dataclass
class Finish:
    """How one choice ended."""

    reason: str  # "stop" (EOS, a stop string, the grammar complete), "length", or "abort" (shutdown)
    text: str
    tokens: list[int]
    prompt_tokens: int
    error: str | None = None
    stop: str | None = None  # the stop string that ended it (the first given of those found earliest)


class Metrics:
    """Counters and histograms for /metrics (Prometheus text), shared by the server and the model thread."""

    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.reused_tokens = 0  # prompt tokens whose keys/values came from the prefix cache
        self.ttft = [0] * (len(self.TTFT_BUCKETS) + 1), [0.0, 0]
        self.tpot = [0] * (len(self.TPOT_BUCKETS) + 1), [0.0, 0]

    def observe(self, histogram, buckets, value):
        counts, total = histogram
        with self.lock:
            counts[next((i for i, bound in enumerate(buckets) if value <= bound), len(buckets))] += 1
            total[0] += value
            total[1] += 1

    def count_request(self, endpoint, status):
        with self.lock:
            self.requests[endpoint, status] += 1

    def add_tokens(self, prompt=0, generated=0, reused=0):
        with self.lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.reused_tokens += reused

    def render(self, queue_depth, running):
        lines = ["# HELP rungen_requests_total HTTP requests by endpoint and status.",
                 "# TYPE rungen_requests_total counter"]
        with self.lock:
            for (endpoint, status), count in sorted(self.requests.items()):
                lines.append(f'rungen_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
            lines += ["# HELP rungen_prompt_tokens_total Prompt tokens prefilled.",
                      "# TYPE rungen_prompt_tokens_total counter", f"rungen_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP rungen_generation_tokens_total Tokens generated.",
                      "# TYPE rungen_generation_tokens_total counter",
                      f"rungen_generation_tokens_total {self.generation_tokens}",
                      "# HELP rungen_prefix_cache_tokens_total Prompt tokens taken from the prefix cache.",
                      "# TYPE rungen_prefix_cache_tokens_total counter",
                      f"rungen_prefix_cache_tokens_total {self.reused_tokens}",
                      "# HELP rungen_queue_depth Requests waiting for a batch slot.",
                      "# TYPE rungen_queue_depth gauge",
                      f"rungen_queue_depth {queue_depth}",
                      "# HELP rungen_running_rows Sequences decoding in the batch.",
                      "# TYPE rungen_running_rows gauge",
                      f"rungen_running_rows {running}"]
            for name, help_text, buckets, (counts, total) in (
                ("rungen_time_to_first_token_seconds", "From arrival to the first generated token.",
                 self.TTFT_BUCKETS, self.ttft),
                ("rungen_time_per_output_token_seconds", "Between consecutive tokens of a sequence.",
                 self.TPOT_BUCKETS, self.tpot),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
                cumulative = 0
                for bound, count in zip((*buckets, "+Inf"), counts):
                    cumulative += count
                    lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
                lines += [f"{name}_sum {total[0]:.6f}", f"{name}_count {total[1]}"]
        return "\n".join(lines) + "\n"


class PrefixCache:
    """Keys/values of recently finished sequences, keyed by their tokens, bounded in bytes (least recently
    used first out). A request prefills only what follows the longest start it shares with one of them: the
    next turn of a conversation, or any request under the same system prompt and chat template."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries = collections.OrderedDict()  # tuple(tokens) -> (layers, bytes, buffers or None)

    def put(self, tokens, layers, size=None, buffers=None):
        """Keeps `layers` for `tokens`. `buffers`: per layer the (keys, values) buffers whose starts the layers
        are, with room after them, that a next turn may take over; `size`: the bytes held alive, when more than
        the layers' own."""
        size = size or sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        key = tuple(tokens)
        if size > self.max_bytes or len(key) < 2 or key in self.entries:
            return
        self.entries[key] = (layers, size, buffers)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped, _) = self.entries.popitem(last=False)
            self.bytes -= dropped

    def longest(self, ids):
        """(length, layers, buffers) for the longest start of ids that an entry holds, one token at least left
        to prefill, or (0, None, None). `layers` are views of the entry's first `length` positions, never written
        to: a key or value depends only on the tokens up to its own, so a shared start's are the ones ids would
        get. When that start is the whole entry (a conversation's next turn) and the entry kept its buffers,
        they come too and the entry leaves the cache: the request's cache grows in them, without a copy."""
        best, found = 0, None
        for key in self.entries:
            length = shared_start(key, ids, limit=len(ids) - 1)
            if length > best:
                best, found = length, key
        if found is None:
            return 0, None, None
        layers, size, buffers = self.entries[found]
        if buffers is not None and best == len(found):
            del self.entries[found]
            self.bytes -= size
            return best, layers, buffers
        self.entries.move_to_end(found)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers], None


def shared_start(a, b, limit):
    """How many first items a and b have in common, at most `limit`."""
    length = 0
    for x, y in zip(a[:limit], b):
        if x != y:
            break
        length += 1
    return length


@dataclasses.dataclass
class Row:
    request: Request
    index: int  # the choice index within the request
    state: RowState  # its sampling on the device: generator, seen tokens, counts, bias
    position: int  # real tokens so far (the next position id)
    new: list = dataclasses.field(default_factory=list)
    emitted: int = 0  # characters of the continuation sent so far
    head: str = ""  # the decoding of the prompt's last tokens (the continuation is what follows it)
    matcher: object = None
    last_time: float = 0.0
    finish: Finish | None = None


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
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        parameters = inspect.signature(self.model.forward).parameters
        if loaded.model_type in UNBATCHABLE_TYPES:
            raise ValueError(f"{loaded.model_type} drops the attention mask when decoding, so it cannot share a "
                             "padded batch with other requests")
        if "past_key_values" not in parameters:
            raise ValueError(f"{loaded.model_type} keeps no key/value cache, which continuous batching needs")
        self.use_positions = "position_ids" in parameters
        self.keep_last = "logits_to_keep" in parameters
        self.joining = None  # the request being prefilled (ended too if that fails)
        self.waiting = collections.deque()
        self.calls = queue.Queue()  # functions to run on the model thread between steps (prompt scoring)
        self.wake = threading.Condition()
        self.rows, self.cache, self.mask = [], None, None
        # Keys/values in fixed slots where the model takes them (rungen/slots.py), else a left-padded batch.
        self.slots = SlotCache.for_model(self.model, max_batch, loaded.context) if loaded.context else None
        # On a CUDA GPU the decode step over the slots is replayed from CUDA graphs (RUN_GENERATION_CUDA_GRAPHS=0:
        # eager steps).
        self.graphs = None
        if self.slots is not None and self.device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0":
            self.graphs = DecodeGraphs(self.model, self.slots)
        self.pending = []  # (layers, mask, cache) of rows joined since the last merge; with slots (layers, n)
        self.peak_rows = 0  # the most rows decoded together so far
        self.closing = self.stopped = False
        self.bytes_per_token = self.measure_bytes_per_token()
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
        return not self.rows and not self.waiting and self.calls.empty()

    @property
    def queue_depth(self):
        return len(self.waiting)

    @property
    def cache_limit_bytes(self):
        return self.max_cache_tokens * self.bytes_per_token

    # -- the model thread ---------------------------------------------------------------------------------

    def measure_bytes_per_token(self):
        """Bytes of keys/values one token position takes, measured on a one-token forward pass."""
        token = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0
        cache = new_cache(self.model)  # sliding-window layers hold every position: the mask applies the window
        if not all(full_attention(layer) for layer in cache.layers):
            # A chunked or recurrent layer keeps other state than all keys/values, which the batch's left-padded
            # merge and trim do not know how to move (and a chunk's bounds would move with the padding).
            raise ValueError(f"{self.loaded.model_type} has chunked-attention or recurrent layers, which a padded "
                             "batch cannot hold")
        with torch.inference_mode():
            self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=cache, use_cache=True)
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers_of(cache))

    def loop(self):
        if self.threads:
            torch.set_num_threads(self.threads)  # per thread under OpenMP: this thread's parallel regions
        while True:
            with self.wake:
                while not self.stopped and not self.rows and not self.waiting and self.calls.empty():
                    if self.closing:
                        return
                    self.wake.wait()
                stopped = self.stopped
            if stopped:
                self.end_all("abort")
                return
            try:
                self.run_calls()
                self.admit()
                if self.rows:
                    self.step()
            except Exception as error:  # a failed step fails its requests, never the server
                logger.exception("the engine step failed")
                self.end_all("abort", error=f"generation failed: {error}")

    def run_here(self):
        """Runs the model loop on the calling thread until every submitted request has ended (the command
        line's batches: no second thread, and a failed step raises to the caller)."""
        try:
            while self.rows or self.waiting:
                self.admit()
                if self.rows:
                    self.step()
        except BaseException:
            # Stopped mid-step (an error, a second Ctrl-C in a session): the batch is half-updated, and its
            # requests are given up; the engine is left empty for the next ones.
            self.rows, self.pending, self.joining, self.cache, self.mask = [], [], None, None, None
            if self.slots is not None:
                self.slots.clear()
            self.waiting.clear()
            raise

    def run_calls(self):
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

    def admit(self):
        """Moves waiting requests into the batch while rows and cache positions allow. Each is prefilled and
        gets its first token as it joins; their keys/values enter the batch together, after the last of them
        (a merge at every join would copy the whole batch each time: most of a wave of joins' time)."""
        while True:
            with self.wake:
                while self.waiting and self.waiting[0].cancelled:
                    self.waiting.popleft().sink(("end", None))
                if not self.waiting:
                    break
                request = self.waiting[0]
                reserve = max([request.reserve] + [row.request.reserve for row in self.rows])
                rows = len(self.rows) + request.n
                if self.rows and (rows > self.max_batch or rows * reserve > self.max_cache_tokens):
                    break  # waits for rows to leave
                self.waiting.popleft()
            self.joining = request
            self.join(request)
            self.joining = None
        pending, self.pending = self.pending, []
        if pending:
            self.merge(pending)
            self.remove_finished()  # rows done at their first token

    def join(self, request):
        ids = request.ids
        start = time.perf_counter()
        reused, layers, buffers = self.prefix_cache.longest(ids) if self.prefix_cache else (0, None, None)
        # The stored tensors are never written to: a cache copies what it is given into new buffers, unless
        # the prefix cache gave the buffers up.
        cache = new_cache(self.model, layers, buffers)
        rest = torch.tensor([ids[reused:]], device=self.device)
        kwargs = {}
        if self.use_positions:
            kwargs["position_ids"] = torch.arange(reused, len(ids), device=self.device)[None]
        if reused:
            kwargs["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long, device=self.device)
        if self.keep_last:
            kwargs["logits_to_keep"] = 1  # the prompt's other logits are never read
        with torch.inference_mode():
            output = self.model(input_ids=rest, past_key_values=cache, use_cache=True, **kwargs)
        self.metrics.add_tokens(prompt=len(ids) - reused, reused=reused)
        request.reused = reused
        if reused:
            logger.info("prefix cache: reused %d of %d prompt tokens", reused, len(ids))
        new_layers = layers_of(output.past_key_values)
        if self.slots is not None:
            self.pending.append((new_layers, request.n))  # each of the n rows gets a copy in its slot
        else:
            if request.n > 1:
                new_layers = [(k.repeat(request.n, 1, 1, 1), v.repeat(request.n, 1, 1, 1)) for k, v in new_layers]
            mask = torch.ones(request.n, len(ids), dtype=torch.long, device=self.device)
            self.pending.append((new_layers, mask, output.past_key_values if request.n == 1 else None))
        logits = output.logits[:, -1].float()
        with self.tokenizer_lock:
            head = self.tokenizer.decode(ids[-TAIL_TOKENS:], skip_special_tokens=True)
        new_rows = []
        for index in range(request.n):
            state = RowState(request.sampling, ids, logits.shape[-1], logits.device, index)
            row = Row(request, index, state, len(ids), head=head, last_time=start)
            if request.constraint is not None and not request.reasoning_end:
                row.matcher = request.constraint.matcher()
            new_rows.append(row)
        self.rows += new_rows
        self.peak_rows = max(self.peak_rows, len(self.rows))
        self.advance(new_rows, logits.expand(request.n, -1), remove=False)  # they leave once merged

    def merge(self, parts):
        """Appends rows to the batch in one copy: parts [(layers, mask, cache)] in the order of their rows, all
        left-padded to the longest. A lone part joining an empty batch gives it its `cache` (the cache that
        holds its layers, when the batch may have it) without a copy. With slots, parts [(layers, n)]: each row's
        keys/values are written into its slot, the joined rows being the batch's last."""
        if self.slots is not None:
            slot = self.slots.rows
            self.slots.ensure(len(self.rows), max(row.request.reserve for row in self.rows), parts[0][0])
            for layers, n in parts:
                for _ in range(n):
                    self.slots.write(slot, layers)
                    slot += 1
            self.slots.rows = slot
            return
        if self.cache is None and len(parts) == 1:
            layers, mask, cache = parts[0]
            self.cache, self.mask = cache if cache is not None else new_cache(self.model, layers), mask
            return
        groups = [(layers, mask) for layers, mask, _ in parts]
        if self.cache is not None:
            groups.insert(0, (layers_of(self.cache), self.mask))
        width = max(mask.shape[1] for _, mask in groups)
        merged = [tuple(torch.cat([left_pad(layers[layer][kind], width) for layers, _ in groups]) for kind in (0, 1))
                  for layer in range(len(groups[0][0]))]
        self.cache = new_cache(self.model, merged)
        self.mask = torch.cat([left_pad(mask, width, dim=1) for _, mask in groups])

    def step(self):
        """One decode step for every row."""
        tokens = torch.tensor([[row.new[-1]] for row in self.rows], device=self.device)
        if self.slots is not None:
            positions = torch.tensor([row.position for row in self.rows], device=self.device)
            longest = max(row.position for row in self.rows)
            with torch.inference_mode():
                if self.graphs is not None:
                    logits = self.graphs(tokens, positions, longest)
                else:
                    logits = decode_step(self.model, self.slots, tokens, positions, self.slots.step_length(longest))
            for row in self.rows:
                row.position += 1
            return self.advance(list(self.rows), logits)
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long, device=self.device)], 1)
        kwargs = {}
        if self.use_positions:
            kwargs["position_ids"] = torch.tensor([[row.position] for row in self.rows], device=self.device)
        with torch.inference_mode():
            output = self.model(input_ids=tokens, attention_mask=self.mask, past_key_values=self.cache,
                                use_cache=True, **kwargs)
        self.cache = output.past_key_values
        for row in self.rows:
            row.position += 1
        self.advance(list(self.rows), output.logits[:, -1].float())

    def advance(self, rows, logits, remove=True):
        """Chooses each row's next token, reports it, and ends the rows that are done (`remove`: lets them
        leave the batch now)."""
        now = time.perf_counter()
        picked, stuck = self.pick(rows, logits)
        for number, row in enumerate(rows):
            request = row.request
            if request.cancelled:
                row.finish = self.finish_row(row, "abort")  # what it holds back is sent: a session shows it
                continue
            if number in stuck:
                logger.warning("%s: no token of the vocabulary continues the output; it ends incomplete",
                               request.constraint.flag)
                row.finish = self.finish_row(row, "stop", error="the grammar allows no token of this vocabulary "
                                             "here; the output ends incomplete")
                continue
            if picked.nan[number]:
                raise GenerationError("the model's scores are NaN: its weights are broken (a damaged file?)")
            token = picked.tokens[number]
            row.new.append(token)
            if not row.new[:-1]:
                request.first_token_at = request.first_token_at or now
                self.metrics.observe(self.metrics.ttft, Metrics.TTFT_BUCKETS, now - request.submitted)
            else:
                self.metrics.observe(self.metrics.tpot, Metrics.TPOT_BUCKETS, now - row.last_time)
            row.last_time = now
            self.metrics.add_tokens(generated=1)
            items = None
            if request.logprobs is not None:
                chosen, top_ids, top_values = picked.logprobs[number]
                with self.tokenizer_lock:
                    items = content_items(self.tokenizer, request.ids + row.new[:-1], [token], [chosen],
                                          [top_ids], [top_values])
            self.report(row, token, items)
        if remove:
            self.remove_finished()

    def pick(self, rows, logits):
        """The rows' choices (sampling.choose on the device, one copy to the host), and the numbers of the rows
        whose grammar allows no token (they get none)."""
        grammar, stuck = None, set()
        constrained = [number for number, row in enumerate(rows) if row.matcher is not None]
        if constrained:
            import xgrammar as xgr

            from .constrain import nothing_allowed

            vocab = rows[constrained[0]].request.constraint.vocab_size  # one tokenizer: one vocabulary
            bitmask = xgr.allocate_token_bitmask(len(constrained), vocab)
            for place, number in enumerate(constrained):
                rows[number].matcher.fill_next_token_bitmask(bitmask, place)
            empty = nothing_allowed(bitmask).tolist()
            stuck = {number for number, nothing in zip(constrained, empty) if nothing}
            keep = [place for place, nothing in enumerate(empty) if not nothing]
            if keep:
                grammar = (bitmask[keep], [constrained[place] for place in keep], vocab)
        states = [row.state for row in rows]
        tokens, nan = choose(logits, states, sorted(self.eos_ids), grammar)
        for number, state in enumerate(states):
            if number not in stuck:
                state.accept(tokens[number : number + 1])
        top_n = {number: row.request.logprobs for number, row in enumerate(rows) if row.request.logprobs is not None}
        return Picked.read(tokens, nan, logits, top_n), stuck

    def report(self, row, token, items):
        """Sends the text this token adds (holding back what may be the start of a stop string or an
        unfinished character) and ends the row when it is done."""
        request = row.request
        if row.matcher is not None:
            row.matcher.accept_token(token)
        elif request.reasoning_end and request.constraint is not None \
                and tuple(row.new[-len(request.reasoning_end) :]) == request.reasoning_end:
            row.matcher = request.constraint.matcher()  # the thinking block is closed: the grammar starts now
        # The text is decoded at every step only where something reads it: a stream, or stop strings to find
        # (a decode of the new tokens so far, which grows with them).
        text = self.continuation(row) if request.deltas or request.stop else None
        reason = matched = None
        cuts = [(text.index(stop), stop) for stop in request.stop if stop in text] if text is not None else []
        if cuts:
            cut, matched = min(cuts, key=lambda found: found[0])
            text, reason = text[:cut], "stop"
        elif token in self.eos_ids and not request.sampling.ignore_eos:
            reason = "stop"
        elif row.matcher is not None and row.matcher.is_terminated():
            reason = "stop"
        elif len(row.new) >= request.max_tokens:
            reason = "length"
        delta = ""
        if request.deltas:
            ready = len(text) if reason is not None else len(text) - held_back(text, request.stop)
            delta = text[row.emitted : ready] if ready > row.emitted else ""
            row.emitted = max(row.emitted, ready)
        if delta or items:
            request.sink(("delta", row.index, delta, items))
        if reason is not None:
            if text is None:
                text = self.continuation(row)
            row.finish = Finish(reason, text, list(row.new), len(request.ids), stop=matched)

    def continuation(self, row):
        """The text of the row's new tokens, decoded after the prompt's last tokens and cut after them, as
        describe_sequence does with the whole prompt (a leading space, a character split over tokens)."""
        with self.tokenizer_lock:
            whole = self.tokenizer.decode(row.request.ids[-TAIL_TOKENS:] + row.new, skip_special_tokens=True)
            if whole.startswith(row.head):
                return whole[len(row.head) :]
            return self.tokenizer.decode(row.new, skip_special_tokens=True)

    def finish_row(self, row, reason, error=None):
        text = self.continuation(row)
        if row.request.deltas and len(text) > row.emitted:
            row.request.sink(("delta", row.index, text[row.emitted :], None))
        return Finish(reason, text, list(row.new), len(row.request.ids), error)

    def remove_finished(self):
        done = [number for number, row in enumerate(self.rows) if row.finish is not None]
        if not done:
            return
        finished_requests = []
        for number in done:
            row = self.rows[number]
            if self.prefix_cache is not None and row.index == 0 and row.finish.reason != "abort":
                self.remember(number, row, last=len(self.rows) == 1)
            row.request.sink(("done", row.index, row.finish))
            if all(other.finish is not None for other in self.rows if other.request is row.request):
                finished_requests.append(row.request)
        keep = [number for number, row in enumerate(self.rows) if row.finish is None]
        if self.slots is not None:  # the last rows move into the freed slots: rows stay in slots 0..rows-1
            order = list(range(len(keep)))
            movers = [number for number in keep if number >= len(keep)]
            for hole, mover in zip([number for number in done if number < len(keep)], movers):
                self.slots.move(mover, hole, self.rows[mover].position)
                order[hole] = mover
            keep = order
            self.slots.rows = len(keep)
            if not keep and self.graphs is None:  # graphs replay over the buffers: kept for the next batch
                self.slots.clear()
        self.rows = [self.rows[number] for number in keep]
        for request in finished_requests:
            request.sink(("end", None))
        if self.slots is not None:
            return
        if not self.rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(0).long().argmax())  # columns before it are padding in every row left
        self.mask = mask[:, first:]
        kept = [(k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
                for k, v in layers_of(self.cache)]
        self.cache = new_cache(self.model, kept)

    def remember(self, number, row, last=False):
        """Keeps a finished row's keys/values for requests that start as it does. `last`: the batch ends with
        this row, so its buffers are handed over (counted whole, room included) instead of copied, and the
        next request does not wait for the copy."""
        length = row.position  # the positions the cache holds (the last token was never fed)
        tokens = (row.request.ids + row.new)[:length]
        if self.slots is not None:
            self.prefix_cache.put(tokens, [(k.clone(), v.clone()) for k, v in self.slots.row_layers(number, length)])
            return
        if not self.mask[number, -length:].all():
            return
        layers = [(k[number : number + 1, :, -length:], v[number : number + 1, :, -length:])
                  for k, v in layers_of(self.cache)]
        if last:
            held = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in layers)
            # Growing layers that hold just this row from their buffers' start: a next turn can grow in them.
            grown = [layer.buffers for layer in self.cache.layers if growing(layer)
                     and layer.buffers is not None and layer.keys.shape[0] == 1 and layer.keys.shape[-2] == length
                     and layer.keys.data_ptr() == layer.buffers[0].data_ptr()]
            buffers = grown if len(grown) == len(layers) else None
            self.prefix_cache.put(tokens, layers, size=held, buffers=buffers)
        else:
            self.prefix_cache.put(tokens, [(k.clone(), v.clone()) for k, v in layers])

    def end_all(self, reason, error=None):
        """Ends every running, joining and waiting request (shutdown's grace is over, or a step failed)."""
        requests = []
        for row in self.rows:
            if row.finish is None:
                row.finish = self.finish_row(row, reason, error)
            row.request.sink(("done", row.index, row.finish))
            if row.request not in requests:
                requests.append(row.request)
        joining = self.joining if self.joining is not None and self.joining not in requests else None
        self.rows, self.joining, self.cache, self.mask, self.pending = [], None, None, None, []
        if self.slots is not None:
            self.slots.clear()
        with self.wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for request in ([joining] if joining else []) + waiting:
            for index in range(request.n):
                request.sink(("done", index, Finish(reason, "", [], len(request.ids), error)))
            requests.append(request)
        for request in requests:
            request.sink(("end", None))
        while True:
            try:
                _, future = self.calls.get_nowait()
            except queue.Empty:
                break
            future.cancel()


# -- the command line's prompts --------------------------------------------------------------------------


def engine_refusal(loaded, settings):
    """Why the engine cannot generate with these settings (generate() then runs them, a batch at a time), or
    None. It samples as the server does; what only generate() has stays there."""
    return settings_refusal(settings, getattr(loaded, "assistant_model", None) is not None)


def settings_refusal(settings, assistant: bool):
    """engine_refusal's reasons, from the settings and whether a draft model (`assistant`) is given: known before
    the model loads (rungen/loading.py then loads the model generate() runs on)."""
    sampling = settings.temperature != 0
    reasons = [reason for reason, applies in (
        ("beam search (--num_beams)", settings.num_beams > 1),
        ("--typical_p", sampling and settings.typical_p is not None),
        ("--no_repeat_ngram_size", bool(settings.no_repeat_ngram_size)),
        ("--prompt_lookup_num_tokens", bool(settings.prompt_lookup_num_tokens)),
        ("--assistant_model", assistant),
        ("--generation_config keys " + ", ".join(sorted(set(settings.generation_config) - {"eos_token_id"})),
         bool(set(settings.generation_config) - {"eos_token_id"})),
    ) if applies]
    return ", ".join(reasons) or None


def open_engine(loaded, settings, batch_size, conversation=False):
    """An Engine for the command line's prompts or a session's turns (run_prompts drives it on the calling
    thread), or None where generate() must run them (logged with the reason). Up to batch_size prompts decode
    together. `conversation`: a turn reuses the keys/values of the turns before it (a prefix cache that holds
    one conversation as long as the context, with its room to grow)."""
    why = engine_refusal(loaded, settings)
    if why is None:
        try:
            # No bound on the cache beyond the batch's rows (the prompts are all known), and no prefix cache
            # for independent prompts: the memory generate() would take for these batches.
            engine = Engine(loaded, max_batch=batch_size * settings.num_return_sequences, max_queue=sys.maxsize,
                            max_cache_tokens=sys.maxsize, prefix_cache_bytes=0,
                            eos_ids=eos_token_ids(settings, loaded.model))
        except ValueError as error:
            why = str(error)
        else:
            if conversation:
                positions = 2 * loaded.context if loaded.context else sys.maxsize // engine.bytes_per_token
                engine.prefix_cache = PrefixCache(positions * engine.bytes_per_token)
            logger.info("KV cache in %s", cache_form(engine))
            return engine
    logger.info("generating with generate(): %s", why)
    return None


def sampling_of(settings, seed):
    """The engine's Sampling for the command line's settings (greedy at temperature 0, as generate())."""
    if settings.temperature == 0:
        return Sampling(temperature=0, repetition_penalty=settings.repetition_penalty, seed=seed)
    return Sampling(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                    min_p=settings.min_p or 0.0, repetition_penalty=settings.repetition_penalty, seed=seed)


def run_prompts(engine, settings, prompts, on_done, stream=False):
    """Generates every encoded prompt through `engine` on this thread, continuously batched: a prompt that
    ends frees its rows for the next one waiting, and each row computes what it would alone. Calls
    on_done(prompt, sequences) as each prompt ends (in the order they end; an error sets prompt.error and
    gives no sequences). `stream`: the one prompt's text goes to stdout as it grows."""
    submit_prompts(engine, settings, prompts, on_done, stream)
    try:
        engine.run_here()
    except ValueError as error:
        raise GenerationError(one_line(error)) from error


def submit_prompts(engine, settings, prompts, on_done, stream=False):
    """Queues the prompts as run_prompts does, without running them; returns their Requests. `stream` may be a
    function that takes the text as it grows instead of stdout (it then ends the line itself)."""
    tokenizer, context, eos_ids = engine.tokenizer, engine.loaded.context, engine.eos_ids
    stops = stop_strings(settings.stop_token)

    def collect(prompt):
        finishes, items = {}, collections.defaultdict(list)

        def sink(event):
            kind = event[0]
            if kind == "delta":
                _, index, text, logprob_items = event
                items[index] += logprob_items or []
                if callable(stream) and text:
                    stream(text)
                elif stream and text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
            elif kind == "done":
                finishes[event[1]] = event[2]
            else:
                if stream is True:
                    sys.stdout.write("\n")
                on_done(prompt, sequences_of(prompt, finishes, items))

        return sink

    def sequences_of(prompt, finishes, items):
        sequences = []
        for index in sorted(finishes):
            finish = finishes[index]
            try:
                if finish.error is not None and settings.constraint is not None:
                    raise stuck_error(settings, tokenizer, finish.tokens)
                described = describe_sequence(settings, tokenizer, prompt, finish.tokens, eos_ids)
            except StuckError as error:  # that prompt fails (an error record), the others go on
                prompt.error = str(error)
                return []
            if settings.logprobs is not None:
                described.logprobs = {"content": items[index][: described.num_generated_tokens]}
            sequences.append(described)
        return sequences

    # Seeds drawn in input order from the generator --seed set: a prompt's sampled text does not depend on the
    # batch. Prompts then join in make_batches' order (similar lengths together): less left padding.
    seeds = {prompt.index: int(torch.randint(2**63 - 1, ())) for prompt in prompts}
    requests = []
    for prompt in [prompt for batch in make_batches(prompts, engine.max_batch) for prompt in batch]:
        new_tokens = settings.length if not context else min(settings.length, context - len(prompt.ids))
        requests.append(Request(prompt.ids, new_tokens, sampling_of(settings, seeds[prompt.index]),
                                collect(prompt), n=settings.num_return_sequences, stop=stops,
                                logprobs=settings.logprobs, constraint=prompt.constraint or settings.constraint,
                                reasoning_end=prompt.reply.end_ids if prompt.reply is not None else None,
                                deltas=bool(stream)))
        engine.submit(requests[-1])
    return requests


def layers_of(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_pad(tensor, width, dim=2):
    """Zeros before the tensor's entries along dim (the sequence) up to width."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def held_back(text, stops):
    """How many characters at the end of text to keep back: an unfinished UTF-8 character, or the longest
    ending that is the start of a stop string (it may become one with the next token). An unfinished
    character is the whole run of replacement characters at the end: byte tokens that do not make a character
    yet decode to one each, and fewer once the next token ends the run (a byte-fallback decoder replaces each
    invalid stretch as one), so sending any of them could send text that is not there."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold


def cache_form(engine):
    """Where the engine keeps the batch's keys/values, and how its steps run."""
    if engine.slots is None:
        return "a left-padded batch"
    return "fixed slots" + (", decode steps replayed from CUDA graphs" if engine.graphs is not None else "")


def describe_memory(engine):
    """One line stating the cache's form and bound."""
    room = ""
    if getattr(engine.model, "cache_grows_in_place", False):  # room to grow: a quarter of a row, or MIN_ROOM
        most = engine.cache_limit_bytes * 5 / 4 + engine.max_batch * MIN_ROOM * engine.bytes_per_token
        room = f", {most / 2**30:.2f} GiB with the room left to grow"
    return (f"KV cache in {cache_form(engine)}: {engine.bytes_per_token / 1024:.1f} KiB per token position, at most "
            f"{engine.max_cache_tokens} "
            f"positions ({engine.cache_limit_bytes / 2**30:.2f} GiB{room}) over at most {engine.max_batch} rows; "
            f"prefix cache at most {(engine.prefix_cache.max_bytes if engine.prefix_cache else 0) / 2**20:.0f} MiB")

