"""What a caller hands the engine and hears back: a Request, and the events its sink gets from the model thread
(Delta, Done, then End); small values, so the server passes them across threads as they are.
"""

import dataclasses
import time

from .sampling import Sampling


@dataclasses.dataclass
class Request:
    """One generation request: n rows from one prompt. `sink(event)` is called from the model thread with a Delta
    or a Done for each row, and finally End."""

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
    reasoning_close: str = ""  # its text, where plain text's ids vary with the text before it (ReplyPlan.text_close)
    thinking_budget: object = None  # rungen.reasoning.Budget: the reply's thinking capped
    kept: frozenset = frozenset()  # special tokens kept in the text: a thinking block's delimiters (ReplyPlan.kept)
    markers: tuple[str, ...] = ()  # the delimiters the reply's split drops: no stop string is found inside them
    deltas: bool = True  # text as it grows (a stream); False: the text once, at the end (a stop string is still cut)
    cancelled: bool = False  # set by the server (client gone) or a session (Ctrl-C); the row leaves at the next step
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    reused: int = 0  # prompt tokens whose keys/values came from the prefix cache
    away: int = 0  # rows that gave way (out of GPU memory) and wait to go on: its End waits for them

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
    cached: int = 0  # prompt tokens whose keys/values (and states) came from the prefix cache (Request.reused)


@dataclasses.dataclass(frozen=True)
class Delta:
    """Text that row `index` gained (maybe empty), and its tokens' log-probability items when asked for."""

    index: int
    text: str
    logprobs: list | None = None


@dataclasses.dataclass(frozen=True)
class Done:
    """Row `index` ended."""

    index: int
    finish: Finish


@dataclasses.dataclass(frozen=True)
class End:
    """The request's last event: every row is done."""
