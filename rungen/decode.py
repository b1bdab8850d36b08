"""The rows the engine decodes together (DecodeBatch): their keys/values in one of batch_cache's forms, one decode
step for all of them at a time, their tokens reported, and the rows leaving when done, their keys/values lent to the
prefix cache.

On a GPU the steps overlap the host's work: a step is launched on the tokens the step before left on the device,
and the step before is read, reported (text, stop strings, the server's events) and its finished rows ended while
the new one computes. A row that ended is one step behind: that step's token is dropped and its position is
reserved (`lookahead`); where every row's last token is the step ahead's (their lengths), none is launched after it.
Rows with a grammar step one at a time: their next mask needs the token just chosen (so does a thinking budget's
last token).
"""

import os
import time

import torch

from . import logger
from .batch_cache import LeftOut, batch_cache
from .errors import GenerationError
from .metrics import Metrics
from .requests import Done, End
from .rows import Resume, pick, request_rows
from .transfers import to_device

OVERLAP_ENV = "RUN_GENERATION_OVERLAP"


def overlaps(device):
    """Whether steps overlap the host's work: on a CUDA device (a CPU computes as it is asked, so nothing would run
    meanwhile); RUN_GENERATION_OVERLAP=0 or 1 says otherwise."""
    setting = os.environ.get(OVERLAP_ENV, "")
    return setting == "1" if setting in ("0", "1") else device.type == "cuda"


class DecodeBatch:
    """The batch's rows (in the order of their keys/values), the step launched ahead and not yet read, and the rows
    joined since the last merge."""

    def __init__(self, model, device, use_positions, max_batch, context, *, reporter, metrics, prefix_cache,
                 eos_ids, shapes=None):
        self.device, self.reporter, self.metrics = device, reporter, metrics
        self.prefix_cache, self.eos_ids = prefix_cache, eos_ids
        self.overlap = overlaps(device)
        self.lookahead = int(self.overlap)  # positions a row may be fed past its end (the step launched ahead)
        self.kv = batch_cache(model, device, use_positions, max_batch, context, self.lookahead, shapes)
        self.rows = []
        self.ahead = None  # the step launched and not yet read (rows.Launched)
        self.pending = []  # the kv's parts of the rows joined since the last merge
        self.unmerged = 0  # how many rows those are (the last of `rows`)
        self.peak_rows = 0  # the most rows decoded together so far

    def enter(self, requests, prefilled, start):
        """Adds prefilled requests' rows (rungen/prefill.py's Prefilled, one a request) with their first tokens, those
        already in their slots chosen in one read; `start`: when their prefill began."""
        joined, firsts = [], []
        for request, done in zip(requests, prefilled):
            ids, reused, logits = request.ids, done.reused, done.logits
            self.metrics.add_tokens(prompt=len(ids) - reused, reused=reused)
            if reused:
                logger.info("prefix cache: reused %d of %d prompt tokens", reused, len(ids))
            if isinstance(request, Resume):
                rows = [request.back(start)]
            else:
                request.reused = reused
                rows = request_rows(request, logits.shape[-1], logits.device,
                                    self.reporter.prompt_tail(ids, request.kept), start)
            if done.part is None:
                joined, firsts = joined + rows, firsts + [logits.expand(request.n, -1)]
            else:
                self.join(rows, done.part, logits.expand(request.n, -1))
        if joined:
            self.join(joined, None, torch.cat(firsts))

    def join(self, rows, part, logits):
        """Adds a prefilled request's rows (their keys/values `part` enter at merge()) and reports their first
        tokens, chosen from `logits` [rows, vocabulary]."""
        self.pending.append(part)
        self.rows += rows
        self.unmerged += len(rows)
        self.peak_rows = max(self.peak_rows, len(self.rows))
        self.report(pick(rows, logits, self.eos_ids))  # they leave once merged

    def merge(self):
        """The joined rows' keys/values into the batch's, in one copy; the rows done at their first token leave.
        Out of GPU memory for it (LeftOut): the joined rows leave the batch again, as its `rows` (but any kept)."""
        pending, self.pending = self.pending, []
        joined, self.unmerged = self.unmerged, 0
        if pending:
            try:
                self.kv.merge(pending, self.rows)
            except LeftOut as error:
                staying = len(self.rows) - joined + error.kept
                error.rows, self.rows = self.rows[staying:], self.rows[:staying]
                raise
            self.remove_finished()

    def step(self):
        """One decode step for every row, fed the tokens of the step launched ahead where there is one; overlapped,
        that step is reported while this one computes and this one is left ahead."""
        rows = list(self.rows)
        if self.ahead is not None and all(len(row.generated) + 1 >= row.request.max_tokens for row in rows):
            self.drain()  # the step ahead gives every row its last token: a step more would be dropped whole
            return
        tokens = self.ahead.tokens if self.ahead is not None else to_device([[row.generated[-1]] for row in rows],
                                                                             self.device)
        logits = self.kv.forward(rows, tokens)
        launched = pick(rows, logits, self.eos_ids)
        for row in rows:  # only now: a step that failed (out of GPU memory) runs again at the same positions
            row.position += 1
        previous, self.ahead = self.ahead, launched
        if previous is not None:
            self.report(previous)
        if not (self.overlap and all(row.runs_ahead() for row in self.rows)):
            self.drain()
        self.remove_finished()

    def drain(self):
        """Reads and reports the step launched ahead, and ends the rows it finished."""
        if self.ahead is not None:
            launched, self.ahead = self.ahead, None
            self.report(launched)
            self.remove_finished()

    def report(self, launched):
        """Reads a step's choices, reports each row's token and marks the rows that are done; a row that ended
        before the step (overlapped) drops its token."""
        picked, stuck = launched.reading.wait(), launched.stuck
        now = time.perf_counter()
        for number, row in enumerate(launched.rows):
            request = row.request
            if row.finish is not None:
                continue
            if request.cancelled:
                row.finish = self.reporter.cut_short(row, "abort")  # what it holds back is sent: a session shows it
                continue
            if number in stuck:
                logger.warning("%s: no token of the vocabulary continues the output; it ends incomplete",
                               request.constraint.flag)
                row.finish = self.reporter.cut_short(row, "stop", error="the grammar allows no token of this "
                                                     "vocabulary here; the output ends incomplete")
                continue
            if picked.nan[number]:
                raise GenerationError("the model's scores are NaN: its weights are broken (a damaged file?)")
            token = picked.tokens[number]
            row.generated.append(token)
            if not row.generated[:-1]:
                if request.first_token_at is None:  # a request's first token (not each choice's, nor a rerun's)
                    request.first_token_at = now
                    self.metrics.observe(self.metrics.ttft, Metrics.TTFT_BUCKETS, now - request.submitted)
            else:
                self.metrics.observe(self.metrics.tpot, Metrics.TPOT_BUCKETS, now - row.last_time)
            row.last_time = now
            self.metrics.add_tokens(generated=1)
            self.reporter.report(row, token, picked.logprobs[number] if request.logprobs is not None else None)

    def remove_finished(self):
        """The rows that are done leave: their Done (and End once a request's rows all ended, none away), the first
        choice's keys/values to the prefix cache, the rows left closing up in the kv."""
        done = [number for number, row in enumerate(self.rows) if row.finish is not None]
        if not done:
            return
        finished_requests = {}  # by identity: requests are dataclasses, whose == compares every field
        for number in done:
            row = self.rows[number]
            if self.prefix_cache is not None and row.index == 0:  # a cancelled one too: a session goes on from it
                self.remember(number, row, last=len(self.rows) == 1)
            row.request.sink(Done(row.index, row.finish))
            finished_requests[id(row.request)] = row.request
        self.leave([number for number, row in enumerate(self.rows) if row.finish is None], done)
        for request in finished_requests.values():
            self.end_when_done(request)

    def end_when_done(self, request):
        """The request's End, where none of its rows is left in the batch or away (waiting to go on)."""
        if not request.away and all(row.request is not request for row in self.rows):
            request.sink(End())

    def leave(self, staying, leaving):
        """The rows numbered `leaving` leave the batch and its kv, the others closing up."""
        keep = self.kv.keep(self.rows, staying, leaving)
        self.rows = [self.rows[number] for number in keep]
        if self.ahead is not None:  # its tokens follow the rows into their new order (none left: nothing to feed)
            if keep:
                self.ahead.tokens = self.ahead.tokens.index_select(0, to_device(keep, self.ahead.tokens.device))
            else:
                self.ahead = None

    def take_out(self, request) -> list:
        """Takes a request's rows out of the batch, telling it nothing, each to go on later (rows.Resume)."""
        rows = [row for row in self.rows if row.request is request]
        self.leave([number for number, row in enumerate(self.rows) if row.request is not request],
                   [number for number, row in enumerate(self.rows) if row.request is request])
        return [Resume(row) for row in rows]

    def give_up(self, resume, reason, error=None):
        """Ends a row that waited to go on (cancelled, or the engine ends every request): its Done with what it
        held back, and its request's End where none of its rows is left."""
        row = resume.back(0.0)
        row.finish = self.reporter.cut_short(row, reason, error)
        row.request.sink(Done(row.index, row.finish))
        self.end_when_done(row.request)

    def remember(self, number, row, last=False):
        """Keeps a finished row's keys/values in the prefix cache (`last`: it may take over the buffers)."""
        tokens = row.request.ids + row.generated
        # The positions the cache holds: the last token fed only by a step launched ahead; a cancelled row's step
        # ahead fed it a token it never got.
        length = min(row.position, len(tokens))
        tokens = tokens[:length]
        layers, buffers, states = self.kv.row_layers(number, length, row.position, last)
        if layers is None:
            return
        try:
            self.prefix_cache.keep(tokens, layers, buffers, self.kv.windows, states)
        except torch.OutOfMemoryError:  # (its copy) the cache only saves time: the row leaves all the same
            self.prefix_cache.give_up("a finished row's keys/values")

    def clear(self):
        """Gives every row up (their requests are ended by the caller)."""
        self.rows, self.pending, self.ahead, self.unmerged = [], [], None, 0
        self.kv.clear()
