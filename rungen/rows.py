"""A row of the engine's batch (one choice of a request) between its tokens and its request's events: the tokens
chosen for every row at once (pick), and the text each token adds, sent as a Delta (Reporter), holding back what
may be the start of a stop string or an unfinished character, until the row is done (its Finish)."""

import dataclasses

import torch

from .logprobs import content_items, decode_text, first_stop, from_a_character, mend_byte_end
from .reasoning import BudgetCount
from .requests import Delta, Finish, Request
from .sampling import Reading, RowState, accept, choose
from .tool_xml import prefix_length
from .transfers import to_device

# Prompt tokens decoded before a row's new tokens to get their text in context (not the whole prompt each step).
TAIL_TOKENS = 32


@dataclasses.dataclass
class Row:
    request: Request
    index: int  # the choice index within the request
    state: RowState  # its sampling on the device: generator, seen tokens, counts, bias
    position: int  # real tokens so far (the next position id)
    generated: list = dataclasses.field(default_factory=list)  # the token ids chosen so far
    emitted: int = 0  # characters of the continuation sent so far
    prompt_tail: tuple[int, str] = (0, "")  # the prompt's last tokens (how many) decoded: the continuation follows
    matcher: object = None
    thinking: BudgetCount | None = None  # its thinking against the request's budget
    last_time: float = 0.0
    finish: Finish | None = None

    def runs_ahead(self) -> bool:
        """Whether a step may be launched before this row's last token is read (overlapped): not where the next
        token depends on it (a grammar's mask, a thinking budget about to close the block)."""
        return self.request.constraint is None and (self.thinking is None or not self.thinking.near())


class Resume:
    """A row that gave way when the GPU ran out of memory, waiting with the requests to go on from where it was: its
    prompt and the tokens it chose are prefilled again, and it decodes on in its own state (generator, penalties,
    grammar, text sent): nothing it sent is taken back, and what follows reads the prefill's keys/values, which
    equal the steps' to the precision's rounding."""

    n = 1

    def __init__(self, row: Row):
        self.row = row
        row.request.away += 1

    @property
    def ids(self):
        return self.row.request.ids + self.row.generated

    @property
    def reserve(self):
        return self.row.request.reserve

    @property
    def cancelled(self):
        return self.row.request.cancelled

    def back(self, start: float) -> Row:
        """The row again, its prompt and tokens in the batch's keys/values (`start`: when their prefill began)."""
        self.row.request.away -= 1
        self.row.position, self.row.last_time = len(self.ids), start
        return self.row


def request_rows(request: Request, width: int, device: torch.device, prompt_tail: tuple, start: float) -> list:
    """A prefilled request's rows, one a choice: each with its sampling state (`width`: the vocabulary's on
    `device`) and its grammar's matcher (once any reasoning has ended)."""
    rows = []
    for index in range(request.n):
        state = RowState(request.sampling, request.ids, width, device, index)
        row = Row(request, index, state, len(request.ids), prompt_tail=prompt_tail, last_time=start)
        if request.constraint is not None and not request.reasoning_end:
            row.matcher = request.constraint.matcher()
        if request.thinking_budget is not None:
            row.thinking = BudgetCount(request.thinking_budget)
        rows.append(row)
    return rows


@dataclasses.dataclass
class Launched:
    """A step's choices for its rows (the batch's rows when it was launched, in that order): on the device, and on
    their way to the host."""

    rows: list
    tokens: torch.Tensor  # [rows, 1] on the device: the next step's input (remove_finished keeps it in step)
    reading: Reading
    stuck: set  # the numbers of the rows whose grammar allows no token


def pick(rows, logits, eos_ids):
    """The rows' choices from their logits, their copy to the host started (Launched.reading.wait() reads it)."""
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
    for row in rows:  # a reply whose constraint waits for the block's end does not end inside it (required: a call)
        row.state.hold_eos = row.matcher is None and row.request.constraint is not None and \
            bool(row.request.reasoning_end)
    tokens, nan = choose(logits, states, sorted(eos_ids), grammar)
    forced = [(number, row.thinking.forced()) for number, row in enumerate(rows) if row.thinking is not None]
    forced = [(number, token) for number, token in forced if token is not None]
    if forced:  # a thinking block that used its budget is closed for the model
        numbers, ids = zip(*forced)
        tokens = tokens.index_put((to_device(list(numbers), tokens.device),), to_device(list(ids), tokens.device))
    accept(states, tokens, skip=stuck)
    top_n = {number: row.request.logprobs for number, row in enumerate(rows) if row.request.logprobs is not None}
    return Launched(list(rows), tokens[:, None], Reading(tokens, nan, logits, top_n), stuck)


class Reporter:
    """The text of rows' tokens, decoded under the tokenizer's lock (the server's handlers share the tokenizer),
    sent to their requests' sinks."""

    def __init__(self, tokenizer, tokenizer_lock, eos_ids):
        self.tokenizer, self.tokenizer_lock, self.eos_ids = tokenizer, tokenizer_lock, eos_ids

    def prompt_tail(self, ids, kept=frozenset()):
        """(how many, their text): the prompt's last tokens, from a character's start, that the continuation is
        decoded after."""
        with self.tokenizer_lock:
            start, text = from_a_character(self.tokenizer, ids, max(0, len(ids) - TAIL_TOKENS), len(ids), kept)
        return len(ids) - start, text

    def report(self, row, token, logprob):
        """Sends the text this token adds (holding back a possible stop string's start or an unfinished character)
        and ends the row when done. `logprob`: (log-probability, top ids, top log-probabilities) where asked."""
        request = row.request
        items = None
        if logprob is not None:
            chosen, top_ids, top_values = logprob
            with self.tokenizer_lock:
                items = content_items(self.tokenizer, request.ids + row.generated[:-1], [token], [chosen],
                                      [top_ids], [top_values], request.kept)
        if row.thinking is not None:
            row.thinking.seen(token)
        if row.matcher is not None:
            row.matcher.accept_token(token)
        elif request.reasoning_end and request.constraint is not None \
                and tuple(row.generated[-len(request.reasoning_end) :]) == request.reasoning_end:
            row.matcher = request.constraint.matcher()  # the thinking block is closed: the grammar starts now
        if request.reasoning_close and self.closes_block(row):
            if row.thinking is not None and row.thinking.state == "inside":
                row.thinking.state = "done"  # closed by the model within the budget
            if row.matcher is None and request.constraint is not None and request.reasoning_end:
                row.matcher = request.constraint.matcher()
        # Decoded every step only where read (a stream, or stop strings to find): the decode grows with the tokens.
        text = self.continuation(row) if request.deltas or request.stop else None
        reason = matched = None
        # Not in a trailing U+FFFD: an unfinished character's stand-in, which the next token may replace.
        settled = text.rstrip("\ufffd") if text is not None else None
        found = first_stop(settled, request.stop, request.markers) if text is not None else None
        if found:
            cut, matched = found
            text, reason = text[:cut], "stop"
        elif token in self.eos_ids and not request.sampling.ignore_eos:
            reason = "stop"
        elif row.matcher is not None and row.matcher.is_terminated():
            reason = "stop"
        elif len(row.generated) >= request.max_tokens:
            reason = "length"
        delta = ""
        if request.deltas:
            ready = len(text) if reason is not None else len(text) - held_back(text, request.stop)
            delta = text[row.emitted : ready] if ready > row.emitted else ""
            row.emitted = max(row.emitted, ready)
        if delta or items:
            request.sink(Delta(row.index, delta, items))
        if reason is not None:
            if text is None:
                text = self.continuation(row)
            row.finish = Finish(reason, text, list(row.generated), len(request.ids), stop=matched,
                                cached=request.reused)

    def cut_short(self, row, reason, error=None):
        """The Finish of a row ended early (cancelled, stuck, aborted), after sending what it held back."""
        text = self.continuation(row)
        if row.request.deltas and len(text) > row.emitted:
            row.request.sink(Delta(row.index, text[row.emitted :], None))
        return Finish(reason, text, list(row.generated), len(row.request.ids), error, cached=row.request.reused)

    def closes_block(self, row) -> bool:
        """Whether the row's last token completes its block's plain-text closing, however the text before it had its
        tokens cut (read only while the grammar or the budget waits for it)."""
        request = row.request
        waiting = row.matcher is None and request.constraint is not None and request.reasoning_end or \
            row.thinking is not None and row.thinking.state == "inside"
        if not waiting:
            return False
        close = request.reasoning_close
        tail = row.generated[-(len(close) + 1) :]
        with self.tokenizer_lock:
            before, after = (decode_text(self.tokenizer, ids, request.kept) for ids in (tail[:-1], tail))
            if row.thinking is not None:  # a budget closing the block now writes only the rest of a closing begun
                begun = prefix_length(after, (close,))
                row.thinking.rest = self.tokenizer.encode(close[begun:], add_special_tokens=False) if begun else None
        return close in after and close not in before

    def continuation(self, row):
        """The text of the row's new tokens, decoded after the prompt's last tokens and cut after them; the EOS that
        ends it is none of it (a file's end-of-turn token need not be a special one)."""
        generated = row.generated
        if generated and generated[-1] in self.eos_ids and not row.request.sampling.ignore_eos:
            generated = generated[:-1]
        with self.tokenizer_lock:
            count, head = row.prompt_tail
            ids, kept = row.request.ids[len(row.request.ids) - count :] + generated, row.request.kept
            whole = mend_byte_end(self.tokenizer, ids, decode_text(self.tokenizer, ids, kept), len(generated), kept)
            if whole.startswith(head):
                return whole[len(head) :]
            return decode_text(self.tokenizer, generated, kept)


def held_back(text, stops):
    """How many characters at the end of text to keep back: an unfinished UTF-8 character (the whole run of
    trailing replacement characters, which the next token may collapse), or the longest ending that starts a stop
    string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold
