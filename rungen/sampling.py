"""The next token of every row of a batch, chosen on the logits' device: the rows' logits processors (grammar mask,
ignore_eos, logit_bias, repetition_penalty, presence/frequency penalties; on a GPU each for all its rows at once),
then the batched sampler (greedy, or temperature, top-k, top-p, min-p and one draw for the whole batch, each row's
uniform number from its own seeded generator on the host).

Nothing here reads a device tensor back: `Reading` starts the step's one copy of what the host needs, and waits for
it only when the host reads it (`Picked`).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from .transfers import HostCopy, to_device


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling settings, checked by the server."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether any processor changes this request's logits (a grammar aside)."""
        return bool(self.ignore_eos or self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty)


class RowState:
    """What one row's processors and draws keep between steps: its generator (a draw depends on neither the batch,
    nor the row's place in it, nor the device), and on the device, a value a token [vocabulary] each: the bias, the
    tokens seen (prompt and generated: 1), the generated tokens' counts and what their presence and frequency
    penalties take off the scores (kept up to date by `accept`)."""

    def __init__(self, sampling: Sampling, prompt: list[int], width: int, device: torch.device, index: int = 0):
        self.sampling = sampling
        self.seed = row_seed(sampling.seed, index)
        self.generator = random.Random(self.seed)
        self.drawn = None  # this step's uniform number, until accept() takes it
        # This step the row may not end: a constraint waits for its thinking block to close (rows.pick sets it).
        self.hold_eos = False
        self.bias = self.seen = self.counts = self.penalty = None
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self.bias = torch.zeros(width, dtype=torch.float32, device=device).index_add_(
                0, to_device(ids, device), to_device(values, device, torch.float32))
        if sampling.repetition_penalty != 1.0:
            self.seen = torch.zeros(width, dtype=torch.float32, device=device)
            self.seen[to_device(sorted(set(prompt)), device)] = 1.0
        if sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = torch.zeros(width, dtype=torch.float32, device=device)
            self.penalty = torch.zeros(width, dtype=torch.float32, device=device)

    def uniform(self) -> float:
        """This step's uniform number for the row's draw: the same until accept(), so that a step run again (its
        first try out of GPU memory) draws what it would have drawn."""
        if self.drawn is None:
            self.drawn = self.generator.random()
        return self.drawn

    @property
    def counting(self) -> bool:
        """Whether the row's chosen tokens change its state."""
        return self.seen is not None or self.counts is not None

    def count(self, token: torch.Tensor) -> None:
        """Counts the row's chosen token (a one-element tensor), a few small kernels."""
        if self.seen is not None:
            self.seen[token] = 1.0
        if self.counts is not None:
            self.counts.index_add_(0, token, torch.ones(1, device=token.device))
            self.penalty[token] = count_penalties(self.counts[token], self.sampling.presence_penalty,
                                                  self.sampling.frequency_penalty)


def row_seed(seed: int | None, index: int = 0) -> int:
    """The seed of choice `index` of a request seeded with `seed`: choice 0's is `seed` itself, the others' are drawn
    from it. None: drawn from torch's generator, which --seed seeds (a server's unseeded requests, as they come)."""
    if seed is None:
        return int(torch.randint(2**63 - 1, ()))
    if index:
        return int(torch.randint(2**63 - 1, (index,), generator=torch.Generator().manual_seed(seed))[-1])
    return seed


def penalize_repetition(scores: torch.Tensor, penalty) -> torch.Tensor:
    """transformers' repetition_penalty on scores (a row's, or [rows, vocabulary] with `penalty` [rows, 1]): a
    positive score divided, a negative one multiplied."""
    # A zero score stays zero: a penalty near 0 (1e-313) is 0 in float32, and 0 / 0 would be NaN.
    kept = torch.where(scores == 0, scores, scores / penalty)
    return torch.where(scores < 0, scores * penalty, kept)


def count_penalties(counts: torch.Tensor, presence, frequency) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the generated tokens' counts (a row's, or [rows, vocabulary]
    with the penalties [rows, 1]): what the scores lose."""
    return frequency * counts + presence * (counts > 0)


def together_on(device: torch.device) -> bool:
    """Whether the processors run for all the rows at once on `device`: on a GPU (a kernel a row would be a launch a
    row); elsewhere a row at a time (its scores stay in the CPU's cache: faster there)."""
    return device.type == "cuda"


def apply_processors(scores: torch.Tensor, states: list[RowState], eos_ids: list[int]) -> None:
    """Each row's processors on its scores [rows, vocabulary], in place (float32), in this order: ignore_eos,
    logit_bias, repetition_penalty, presence/frequency penalties; all the rows at once or a row at a time
    (together_on)."""
    (apply_together if together_on(scores.device) else apply_each)(scores, states, eos_ids)


def apply_each(scores: torch.Tensor, states: list[RowState], eos_ids: list[int]) -> None:
    """apply_processors a row at a time."""
    eos = None  # made once a step, where a row asks for it
    for number, state in enumerate(states):
        row, sampling = scores[number], state.sampling
        if (sampling.ignore_eos or state.hold_eos) and eos_ids:
            if eos is None:
                eos = torch.tensor(eos_ids, dtype=torch.long, device=scores.device)
            row.index_fill_(0, eos, float("-inf"))
        if state.bias is not None:
            row += state.bias
        if state.seen is not None:
            seen = state.seen.nonzero().squeeze(1)
            row.index_copy_(0, seen, penalize_repetition(row.index_select(0, seen), sampling.repetition_penalty))
        if state.penalty is not None:
            row -= state.penalty


def apply_together(scores: torch.Tensor, states: list[RowState], eos_ids: list[int]) -> None:
    """apply_processors for all the rows at once: each processor a few kernels, whatever the rows that ask for it."""
    ignoring = [n for n, s in enumerate(states) if s.sampling.ignore_eos or s.hold_eos] if eos_ids else []
    biased = [n for n, s in enumerate(states) if s.bias is not None]
    repeated = [n for n, s in enumerate(states) if s.seen is not None]
    counted = [n for n, s in enumerate(states) if s.penalty is not None]
    if not (ignoring or biased or repeated or counted):
        return
    eos = list(eos_ids) if ignoring else []
    parts = [ignoring, eos, biased, repeated, counted]
    on_device = torch.split(to_device(sum(parts, []), scores.device), [len(part) for part in parts])
    if ignoring:
        scores[on_device[0][:, None], on_device[1][None, :]] = float("-inf")
    if biased:
        scores.index_add_(0, on_device[2], torch.stack([states[n].bias for n in biased]))
    if repeated:
        rows = scores.index_select(0, on_device[3])
        seen = torch.stack([states[n].seen for n in repeated]) > 0
        penalty = to_device([states[n].sampling.repetition_penalty for n in repeated], scores.device, torch.float32)
        penalized = penalize_repetition(rows, penalty[:, None])
        scores.index_copy_(0, on_device[3], torch.where(seen, penalized, rows))
    if counted:
        scores.index_add_(0, on_device[4], -torch.stack([states[n].penalty for n in counted]))


def accept(states: list[RowState], tokens: torch.Tensor, skip=frozenset()) -> None:
    """Counts each row's chosen token (`tokens` [rows] on the device: no copy to the host), but the rows in `skip`'s:
    in a few kernels for all the rows, or a row at a time (together_on)."""
    for state in states:
        state.drawn = None
    rows = [n for n, state in enumerate(states) if state.counting and n not in skip]
    if not rows:
        return
    if together_on(tokens.device):
        count_together([states[n] for n in rows], tokens.index_select(0, to_device(rows, tokens.device)))
    else:
        for n in rows:
            states[n].count(tokens[n : n + 1])


def count_together(states: list[RowState], tokens: torch.Tensor) -> None:
    """RowState.count for every row at once (`tokens` [rows]): one-hot rows added, the penalties recomputed whole,
    in a few kernels fused across the rows."""
    width = next(t for t in (states[0].seen, states[0].counts) if t is not None).shape[0]
    ones = torch.zeros(len(states), width, dtype=torch.float32, device=tokens.device).scatter_(1, tokens[:, None], 1.0)
    seen = [n for n, state in enumerate(states) if state.seen is not None]
    if seen:
        torch._foreach_maximum_([states[n].seen for n in seen], [ones[n] for n in seen])
    counted = [n for n, state in enumerate(states) if state.counts is not None]
    if counted:
        counts = [states[n].counts for n in counted]
        torch._foreach_add_(counts, [ones[n] for n in counted])
        penalties = to_device([[states[n].sampling.presence_penalty, states[n].sampling.frequency_penalty]
                               for n in counted], tokens.device, torch.float32)
        fresh = count_penalties(torch.stack(counts), penalties[:, :1], penalties[:, 1:])
        torch._foreach_copy_([states[n].penalty for n in counted], list(fresh.unbind(0)))


def apply_grammar(scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Masks the rows `rows` of scores with xgrammar's bitmask (int32 on the host, bit set: allowed); tokens past
    `vocab_size` are never allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=scores.device)
    words = bitmask.to(scores.device, non_blocking=True)
    allowed = ((words[:, :, None] >> bits) & 1).bool().reshape(len(rows), -1)
    width = min(vocab_size, allowed.shape[1], scores.shape[1])
    full = torch.zeros(len(rows), scores.shape[1], dtype=torch.bool, device=scores.device)
    full[:, :width] = allowed[:, :width]
    index = to_device(rows, scores.device)
    scores.index_copy_(0, index, scores.index_select(0, index).masked_fill_(~full, float("-inf")))


def settings_tensors(samplings: list[Sampling], uniforms: list[float], device: torch.device
                     ) -> dict[str, torch.Tensor]:
    """The rows' sampler settings and this step's uniform numbers as tensors [rows] (one host-to-device copy)."""
    values = to_device([[s.temperature, s.top_k, s.top_p, s.min_p, u] for s, u in zip(samplings, uniforms)], device,
                       torch.float64)
    return {"temperature": values[:, 0], "top_k": values[:, 1].long(), "top_p": values[:, 2], "min_p": values[:, 3],
            "uniform": values[:, 4]}


def choose(logits: torch.Tensor, states: list[RowState], eos_ids: list[int], grammar=None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' next tokens [rows] and whether their processed scores were NaN, on the device, from the logits
    [rows, vocabulary] (left as they are: log-probabilities read them raw). `grammar`: apply_grammar's arguments."""
    scores = logits
    if grammar is not None or any(state.sampling.processed or state.hold_eos for state in states):
        scores = logits.clone()
        if grammar is not None:
            apply_grammar(scores, *grammar)
        apply_processors(scores, states, eos_ids)
    top, argmax = scores.max(-1)
    sampler = make_sampler([state.sampling for state in states], [state.uniform for state in states])
    return sampler(scores, top, argmax), torch.isnan(top)


def make_sampler(samplings: list[Sampling], uniforms: list):
    """The rows' sampler: (scores, each row's maximum, its argmax) -> tokens [rows] on the device: the argmax where
    greedy (or a score is +inf), else a draw after temperature, top-k, top-p and min-p, from the uniform number
    uniforms[row]() gives (RowState.uniform)."""
    drawn = [number for number, s in enumerate(samplings) if not s.greedy]
    if not drawn:
        return lambda scores, top, argmax: argmax
    settings_of = [samplings[number] for number in drawn]
    widest = max(s.top_k for s in settings_of)
    nucleus = any(s.top_p < 1.0 for s in settings_of)
    min_p = any(s.min_p > 0 for s in settings_of)
    drawn_uniforms = [uniforms[number] for number in drawn]

    def sampler(scores: torch.Tensor, top: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        index = to_device(drawn, scores.device) if len(drawn) < len(samplings) else None
        rows = scores if index is None else scores.index_select(0, index)
        # The draws' uniform numbers come from the host: no device generator, so one draw serves the whole batch.
        settings = settings_tensors(settings_of, [uniform() for uniform in drawn_uniforms],
                                    scores.device)
        peak = top if index is None else top.index_select(0, index)
        x = apply_temperature(rows, peak, settings["temperature"])
        if 0 < widest:
            x = apply_top_k(x, settings["top_k"], widest)
        probs, order = x.softmax(-1), None
        if nucleus:
            probs, order = apply_top_p(probs, settings["top_p"])
        if min_p:
            probs = apply_min_p(probs, settings["min_p"], descending=order is not None)
        tokens = draw(probs, peak, settings["uniform"])
        if order is not None:
            tokens = order.gather(1, tokens[:, None]).squeeze(1)
        tokens = torch.where(peak == float("inf"), argmax if index is None else argmax.index_select(0, index), tokens)
        if index is None:
            return tokens
        return argmax.index_copy(0, index, tokens)

    return sampler


def apply_temperature(rows: torch.Tensor, peak: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The scores [rows, vocabulary] less each row's maximum `peak`, over its temperature, in float32 (half the bytes
    of float64 for every pass after it, and 32-bit keys to sort: the sampler 1.1-1.4x faster on a CPU)."""
    # Shifted: the top is 0 whatever the temperature (never inf: a NaN softmax), and a tiny temperature sends the
    # others to -inf; below float32's smallest normal it would be 0 there (0 / 0).
    tiny = torch.finfo(torch.float32).tiny
    return (rows.float() - peak[:, None].float()) / temperature[:, None].float().clamp(min=tiny)


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor, widest: int) -> torch.Tensor:
    """-inf for every score below each row's k-th highest (`top_k` [rows], 0: off); `widest`: the largest k."""
    k = torch.where(top_k > 0, top_k, x.shape[1]).clamp(max=x.shape[1])
    values = x.topk(min(int(widest), x.shape[1]), dim=-1).values
    kth = values.gather(1, (k.clamp(max=values.shape[1]) - 1)[:, None])
    kth = torch.where((k >= x.shape[1])[:, None], float("-inf"), kth)  # top-k off (or wider than the vocabulary)
    return x.masked_fill(x < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities in descending order, with their ids, zero past the smallest set reaching each row's top_p
    (the top token always kept; 1: off)."""
    limit = torch.where(top_p < 1.0, top_p, float("inf"))
    probs, order = nucleus_candidates(probs, limit)
    return probs.masked_fill(probs.cumsum(-1) - probs >= limit[:, None], 0), order


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor, descending: bool) -> torch.Tensor:
    """Zero for every probability below each row's min_p times its top one (`descending`: the top one first)."""
    most = probs[:, :1] if descending else probs.max(-1, keepdim=True).values
    return probs.masked_fill(probs < min_p[:, None] * most, 0)


def draw(probs: torch.Tensor, peak: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token a row [rows] from its probabilities [rows, vocabulary] (not necessarily summing to 1) and a uniform
    number in [0, 1) [rows], by the inverse of the cumulative sum: the first token whose running sum passes it."""
    # NaN/+inf rows draw from a stand-in, token 0: their choice is the argmax or an error, never this draw.
    bad = torch.isnan(peak) | torch.isinf(peak)
    probs = probs.nan_to_num(0.0).masked_fill(bad[:, None], 0)
    probs[:, 0] += bad.to(probs.dtype)
    sums = probs.double().cumsum(-1)  # float64: a float32 running sum near 1 would round a rare token away
    total = sums[:, -1:].contiguous()
    chosen = torch.searchsorted(sums, uniforms[:, None] * total, right=True)
    # u * total can round up to total: the last token with a probability is where the sum first reaches it
    return torch.minimum(chosen, torch.searchsorted(sums, total)).squeeze(1)


CANDIDATES = 1024  # the most likely tokens a CPU sorts first for top-p (all of them where those fall short)


def nucleus_candidates(probs: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' probabilities in descending order with their ids, as far as top-p (`limit`) reaches: on a CPU the
    CANDIDATES most likely when their mass suffices (the same set), else all; a GPU sorts all (no host read)."""
    if probs.device.type == "cpu" and CANDIDATES < probs.shape[1]:
        top = probs.topk(CANDIDATES, dim=-1)
        if bool((top.values.sum(-1) >= limit).all()):
            return top.values, top.indices
    return probs.sort(-1, descending=True)


@dataclasses.dataclass
class Picked:
    """A step's choices as the host reads them, from one device-to-host copy: tokens, NaN flags, log-probabilities."""

    tokens: list[int]
    nan: list[bool]
    logprobs: dict[int, tuple[float, list[int], list[float]]]  # row -> (logprob, top ids, top logprobs)


class Reading:
    """A step's choices on their way to the host: the one copy is started here, behind the step's work, and
    wait() reads it, so that the host can launch the next step in between."""

    def __init__(self, tokens: torch.Tensor, nan: torch.Tensor, logits: torch.Tensor, top_n: dict[int, int]):
        """`top_n`: row -> how many alternatives (0: the chosen token's log-probability alone)."""
        self.count, self.top_n, self.rows = tokens.shape[0], top_n, sorted(top_n)
        self.widest = max(top_n.values()) if top_n else 0
        self.width = min(self.widest, logits.shape[1])
        parts = [tokens.double(), nan.double()]
        if top_n:
            index = to_device(self.rows, logits.device)
            raw = logits.index_select(0, index).float().log_softmax(-1)
            parts.append(raw.gather(1, tokens.index_select(0, index)[:, None]).double().reshape(-1))
            if self.widest:
                top = raw.topk(self.width, dim=-1)
                parts += [top.indices.double().reshape(-1), top.values.double().reshape(-1)]
        self.copy = HostCopy(torch.cat(parts))  # the step's one copy to the host

    def wait(self) -> Picked:
        flat, count, rows, width = self.copy.tolist(), self.count, self.rows, self.width
        picked = Picked([int(t) for t in flat[:count]], [bool(f) for f in flat[count : 2 * count]], {})
        if rows:
            chosen = flat[2 * count : 2 * count + len(rows)]
            start = 2 * count + len(rows)
            ids, values = flat[start : start + len(rows) * width], flat[start + len(rows) * width :]
            for number, row in enumerate(rows):
                keep = min(self.top_n[row], width)
                picked.logprobs[row] = (chosen[number], [int(i) for i in ids[number * width : number * width + keep]],
                                        values[number * width : number * width + keep])
        return picked
