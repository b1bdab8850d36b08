"""Which waiting requests join the engine's batch, and when (Admission); and which gives way when a decode step runs
out of GPU memory.

A request joins between decode steps while its rows fit within `max_batch` and rows x the longest (prompt +
max_tokens) within `max_cache_tokens`; on fixed slots those waiting after it that fit beside it in one pass join
with it (rungen/prefill.py).

Out of GPU memory, the prefix cache's entries go first (they only save time). Where the GPU still has no memory for
a group's prefill beside the running rows, the group waits, first in the queue, and nothing joins beside that many
rows until a row has left. Where a decode step runs out, the newest request gives way and the others go on: its
rows wait at the head of the queue, each to go on from where it was once a row has left (rows.Resume: its prompt
and tokens prefilled again, as vLLM's preemption by recomputation does), so a stream goes on and nothing sent is
taken back. Where the copy of joined rows' keys/values into the batch runs out (a left-padded batch), they give way
likewise (those done at their first token answered), but for the first request's where the batch was empty.
"""

import collections
import time

from . import logger
from .batch_cache import LeftOut
from .errors import one_line
from .prefill import into_slots, prefill_group, together_tokens
from .requests import Done, End
from .rows import Resume


class Admission:
    """The waiting requests (guarded by `wake`, the engine's condition) and the requests being prefilled."""

    def __init__(self, model, batch, wake, *, max_batch, max_cache_tokens, use_positions, keep_last):
        self.model, self.batch, self.wake = model, batch, wake
        self.max_batch, self.max_cache_tokens = max_batch, max_cache_tokens
        self.use_positions, self.keep_last = use_positions, keep_last
        self.waiting = collections.deque()
        self.joining = []  # the requests being prefilled (ended too if that fails)
        self.crowded = max_batch + 1  # rows at which the GPU's memory last fell short: none join beside as many
        self.stopping = lambda: False  # the engine's: stop admitting (its requests are about to be ended)

    def admit(self):
        """Moves waiting requests into the batch while rows and cache positions allow. Where the batch keeps fixed
        slots, the requests admitted together are prefilled in one pass; elsewhere each alone, their keys/values
        entering together after the last (a merge at every join would copy the whole batch each time)."""
        batch = self.batch
        while True:
            with self.wake:
                if self.stopping():  # a prefill more would only delay a shutdown that ends every request
                    break
                while self.waiting and self.waiting[0].cancelled:
                    self.cancel(self.waiting.popleft())
                if not self.waiting:
                    break
                if batch.rows and (not self.fits([self.waiting[0]]) or len(batch.rows) >= self.crowded):
                    break  # waits for rows to leave
                if batch.ahead is None:
                    group = self.take_group()
            if batch.ahead is not None:
                batch.drain()  # the batch changes: the step launched ahead is read first
                continue
            self.joining = group
            if not self.join(group):  # out of GPU memory beside the batch: it waits, first, for rows to leave
                with self.wake:
                    self.waiting.extendleft(reversed(group))
                self.crowded, self.joining = len(batch.rows), []
                break
            self.joining = []
        self.merge()

    def take_group(self):
        """The first waiting request, and those after it that fit beside it in one pass (fixed slots only)."""
        group = [self.waiting.popleft()]
        while (self.batch.kv.prefills_together and self.waiting and not self.waiting[0].cancelled
               and self.fits(group + [self.waiting[0]])
               and together_tokens(group + [self.waiting[0]]) <= self.batch.kv.pass_tokens):
            group.append(self.waiting.popleft())
        return group

    def fits(self, requests):
        """Whether the requests' rows join the batch within max_batch and max_cache_tokens."""
        reserve = self.reserve(requests) + self.batch.lookahead
        count = len(self.batch.rows) + sum(request.n for request in requests)
        return count <= self.max_batch and count * reserve <= self.max_cache_tokens

    def reserve(self, requests):
        """The positions a row takes at most, the batch's and `requests`' rows."""
        return max([request.reserve for request in requests] + [row.request.reserve for row in self.batch.rows])

    def join(self, requests) -> bool:
        """Prefills the requests (into their slots where prefill.into_slots says: the rows joined before enter their
        slots first) and adds their rows to the batch, with their first tokens. False: the GPU ran out of memory for
        their prefill (or that merge) beside the batch's rows, which go on untouched (alone, that is raised)."""
        batch, start = self.batch, time.perf_counter()
        if into_slots(batch.kv, requests, batch.device) and not self.merge():
            return False
        prefilled = prefill_group(self.model, batch.kv, requests, batch.prefix_cache, batch.device, len(batch.rows),
                                  self.reserve(requests), use_positions=self.use_positions, keep_last=self.keep_last,
                                  turn_ends=frozenset(batch.eos_ids))
        if prefilled is None:
            return False
        batch.enter(requests, prefilled, start)
        self.crowded = self.max_batch + 1  # until the GPU's memory says otherwise
        return True

    def give_way(self, error) -> bool:
        """After a decode step ran out of GPU memory (`error`): the prefix cache's entries go, or else the batch's
        newest request leaves it, so that the others go on; nothing joins beside as many rows as are left until one
        has left. False where the batch holds one request (nothing to give way to), or keeps its keys/values in a
        form that cannot run the failed step again: the caller ends them."""
        batch = self.batch
        if not batch.kv.steps_again:
            return False
        rows = len(batch.rows)
        batch.drain()  # the step launched before the failed one: its tokens reported, its finished rows gone
        if len(batch.rows) < rows or (batch.prefix_cache is not None and batch.prefix_cache.give_up("a decode step")):
            return True  # the step runs again, every request left in it
        requests = list({id(row.request): row.request for row in batch.rows}.values())
        if len(requests) < 2:
            return False
        newest = max(requests, key=lambda request: request.submitted)
        logger.warning("out of GPU memory for a decode step of %d rows: the newest request waits to go on (%s)",
                       len(batch.rows), one_line(error))
        batch.metrics.count_gave_way()
        resumes = batch.take_out(newest)
        self.crowded = len(batch.rows)
        with self.wake:
            self.waiting.extendleft(reversed(resumes))
        return True

    def merge(self) -> bool:
        """The batch's merge; False where the GPU had no memory for it: the rows that joined since gave way."""
        try:
            self.batch.merge()
        except LeftOut as error:
            self.left_out(error)
            return False
        return True

    def left_out(self, error):
        """After a merge ran out of GPU memory (LeftOut, its `rows` those that joined since the last merge, out of the
        batch again): their running rows give way as the newest request's do in give_way, those done at their first
        token are answered; nothing joins beside as many rows as the batch holds until one has left."""
        batch = self.batch
        self.crowded = len(batch.rows)
        if batch.prefix_cache is not None:
            batch.prefix_cache.give_up("the joining rows' keys/values")
        logger.warning("out of GPU memory to add %d row(s) to the batch's %d: they give way (%s)", len(error.rows),
                       len(batch.rows), one_line(error))
        resumes = [Resume(row) for row in error.rows if row.finish is None]
        batch.metrics.count_gave_way(len({id(resume.row.request) for resume in resumes}))
        with self.wake:
            self.waiting.extendleft(reversed(resumes))  # at the head, in their order
        for row in error.rows:
            if row.finish is not None:
                row.request.sink(Done(row.index, row.finish))
                batch.end_when_done(row.request)

    def cancel(self, entry):
        """Ends a cancelled waiting entry: a request none of whose rows ran (End), or a row waiting to go on."""
        if isinstance(entry, Resume):
            self.batch.give_up(entry, "abort")
        else:
            entry.sink(End())
