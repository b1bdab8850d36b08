"""The batched sampler (rungen/sampling.py) on the CPU: each control does what its per-row definition says for every
row of a batch at once (the processors a row at a time, as a CPU runs them, and all the rows at once, as a GPU does,
in kernels that do not grow with the rows), a row's draw follows its probabilities and its own generator, and a step
reads the device once."""

import math

import pytest
import torch

from rungen import sampling
from rungen.sampling import (
    Reading,
    RowState,
    Sampling,
    accept,
    apply_together,
    choose,
    draw,
)

VOCAB = 50


def states(*samplings, prompt=(1, 2, 3)):
    """A row for each sampling, each the first choice of its request."""
    return [RowState(s, list(prompt), VOCAB, torch.device("cpu")) for s in samplings]


def step(scores, rows):
    """A step's tokens as the engine takes them: chosen, then accepted (the draw used up)."""
    tokens, _ = choose(scores, rows, [])
    accept(rows, tokens)
    return tokens


def logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    scores = logits(3)
    tokens, nan = choose(scores, states(Sampling(temperature=0), Sampling(seed=1), Sampling(temperature=0)), [])
    assert tokens[0] == scores[0].argmax() and tokens[2] == scores[2].argmax() and not nan.any()


@pytest.mark.parametrize("control", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-30)])
def test_a_control_at_its_narrowest_leaves_the_top_token(control):
    scores = logits(4, seed=2)
    tokens, _ = choose(scores, states(*[Sampling(seed=n, **control) for n in range(4)]), [])
    assert tokens.tolist() == scores.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_their_tokens():
    scores = logits(2, seed=3)
    order = scores.argsort(-1, descending=True)
    probs = scores.softmax(-1).gather(1, order)
    nucleus = int((probs[1].cumsum(0) < 0.5).sum()) + 1  # the smallest set whose mass reaches 0.5
    drawn = [set(), set()]
    for seed in range(300):
        tokens, _ = choose(scores, states(Sampling(top_k=3, seed=seed), Sampling(top_p=0.5, seed=seed)), [])
        drawn[0].add(int(tokens[0]))
        drawn[1].add(int(tokens[1]))
    assert drawn[0] == set(order[0, :3].tolist())
    assert drawn[1] == set(order[1, :nucleus].tolist())


def test_a_draw_follows_the_probabilities():
    # A row's draw picks token i with probability p_i.
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    expected = scores[0, :4].softmax(-1)
    row = states(Sampling(seed=5))
    counts = torch.zeros(VOCAB)
    for _ in range(4000):
        counts[step(scores, row)[0]] += 1
    share = counts[:4] / counts.sum()
    assert counts[4:].sum() == 0 and (share - expected).abs().max() < 4 * math.sqrt(0.25 / 4000)


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch():
    scores = logits(3, seed=4)
    alone = states(Sampling(seed=9))
    batch = states(Sampling(seed=1), Sampling(seed=9), Sampling(temperature=0.5, seed=2))
    draws = [(int(step(scores[1:2], alone)[0]), int(step(scores, batch)[1])) for _ in range(20)]
    assert [a for a, _ in draws] == [b for _, b in draws] and len({a for a, _ in draws}) > 1
    # a step that failed (out of GPU memory) and runs again draws what it would have drawn
    again = states(Sampling(seed=9))
    choose(scores[1:2], again, [])
    assert [int(step(scores[1:2], again)[0]) for _ in range(20)] == [a for a, _ in draws]
    # a request's other choices draw from generators of their own, seeded from its seed
    seeds = [RowState(Sampling(seed=9), [1], VOCAB, torch.device("cpu"), index).seed
             for index in (0, 1, 2, 1)]
    assert seeds[0] == 9 and len(set(seeds)) == 3 and seeds[1] == seeds[3]


def test_a_draw_never_lands_on_a_token_without_probability():
    # The uniform number's two ends: 0 takes the first token with a probability, the largest double below 1 (whose
    # product with the sum can round up to the sum) the last one, never the zeros around them.
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]],
                         dtype=torch.float64)
    peak = torch.zeros(2)
    for u, expected in ((0.0, [1, 6]), (1 - 2**-53, [4, 6]), (0.3, [3, 6]), (0.8, [4, 6])):
        assert draw(probs, peak, torch.full((2,), u, dtype=torch.float64)).tolist() == expected
    # a row whose top score is NaN or +inf draws a stand-in (its token is the argmax or an error, never this draw)
    bad = torch.tensor([float("nan"), float("inf")])
    assert draw(torch.full((2, 7), float("nan"), dtype=torch.float64), bad, torch.full((2,), 0.9,
                dtype=torch.float64)).tolist() == [0, 0]


def test_processors_change_the_scores_as_defined():
    scores = torch.zeros(1, VOCAB)
    scores[0, 7] = 5.0
    # logit_bias sends the top token to -100: the next one wins greedily
    tokens, _ = choose(scores, states(Sampling(temperature=0, logit_bias=((7, -100.0), (3, 1.0)))), [])
    assert tokens.tolist() == [3]
    tokens, _ = choose(scores, states(Sampling(temperature=0, ignore_eos=True)), [7])
    assert tokens.tolist() != [7]
    # repetition penalty divides a positive score of a prompt token (7 is not in the prompt, 2 is)
    scores[0, 2] = 5.5
    tokens, _ = choose(scores, states(Sampling(temperature=0, repetition_penalty=1.2)), [])
    assert tokens.tolist() == [7]
    # presence/frequency penalties count the generated tokens: accepted ones
    row = states(Sampling(temperature=0, presence_penalty=1.0))
    accept(row, torch.tensor([2]))
    assert choose(scores, row, [])[0].tolist() == [7]
    assert choose(scores, states(Sampling(temperature=0)), [])[0].tolist() == [2]


MIXED = [Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.5),),
                 ignore_eos=True),
         Sampling(), Sampling(repetition_penalty=0.8), Sampling(frequency_penalty=-0.75, logit_bias=((1, -100.0),)),
         Sampling(ignore_eos=True, presence_penalty=2.0), Sampling(logit_bias=((4, 1.0), (9, -3.0)))]


def reference(scores, sampling, prompt, generated, eos_ids):
    """One row's processors by their per-row definitions: transformers' SuppressTokens and RepetitionPenalty
    processors, OpenAI's logit_bias and presence/frequency penalties."""
    from transformers import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    row = scores[None].clone()
    if sampling.ignore_eos:
        row = SuppressTokensLogitsProcessor(eos_ids)(None, row)
    for token, bias in sampling.logit_bias:
        row[0, token] += bias
    if sampling.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(torch.tensor([prompt + generated]), row)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=VOCAB).float()
    return row[0] - (sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float())


@pytest.mark.parametrize("together", [False, True], ids=["a row at a time (a CPU's)", "all rows at once (a GPU's)"])
def test_every_rows_processors_apply_as_each_alone(together, monkeypatch):
    # Rows asking for different processors, for several steps of accepted tokens (one row's grammar stuck: its
    # token is not counted): the batch's scores are each row's by its own definition, to the bit.
    monkeypatch.setattr(sampling, "together_on", lambda device: together)
    prompt, eos_ids = [1, 2, 3, 2], [0, 7]
    rows, generated = states(*MIXED, prompt=prompt), [[] for _ in MIXED]
    for step in range(5):
        scores = logits(len(MIXED), seed=step)
        scores[:, 10] = 0.0  # a zero score stays zero
        processed = scores.clone()
        sampling.apply_processors(processed, rows, eos_ids)
        for number, setting in enumerate(MIXED):
            assert torch.equal(processed[number], reference(scores[number], setting, prompt, generated[number],
                                                            eos_ids)), (step, number)
        tokens = torch.tensor([(step * 3 + number) % 12 for number in range(len(MIXED))])
        stuck = {0} if step == 2 else set()
        accept(rows, tokens, skip=stuck)
        for number in range(len(MIXED)):
            if number not in stuck:
                generated[number].append(int(tokens[number]))


def kernels(function):
    """The operators a call runs (each a launch on a GPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    return sorted(event.name for event in profile.events() if event.name.startswith("aten::"))


def test_the_processors_kernels_on_a_gpu_do_not_grow_with_the_rows():
    # (The one-hot count's fused adds are a GPU's alone: test_cuda counts its launches.)
    def processors(count):
        rows, scores = states(*[MIXED[0]] * count), logits(count)
        return kernels(lambda: apply_together(scores, rows, [0, 7]))

    assert processors(2) == processors(16)


def test_the_grammar_mask_allows_only_its_tokens():
    scores = logits(2, seed=6)
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 1] = 1 << (40 - 32)  # token 40 alone
    tokens, _ = choose(scores, states(Sampling(seed=1), Sampling(temperature=0)), [], (bitmask, [0], VOCAB))
    assert int(tokens[0]) == 40 and int(tokens[1]) == int(scores[1].argmax())


def test_nan_scores_are_flagged():
    scores = logits(2)
    scores[1, 3] = float("nan")
    _, nan = choose(scores, states(Sampling(temperature=0), Sampling(seed=1)), [])
    assert nan.tolist() == [False, True]


@pytest.mark.parametrize("form", ["a CPU's", "a GPU's"])
def test_a_step_reads_the_device_once(monkeypatch, form):
    # Tokens, NaN flags and log-probabilities come back in one copy: each of these reads would wait for the device
    # (as would nonzero, which a GPU's processors and counting never call).
    reads, names = [], ["tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]
    if form == "a GPU's":
        monkeypatch.setattr(sampling, "together_on", lambda device: True)
        names.append("nonzero")
    for name in names:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                             _o(self, *a, **k))[1])
    scores = logits(3, seed=7)
    rows = states(Sampling(seed=1, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.1,
                           presence_penalty=0.5, logit_bias=((4, 2.0),)), Sampling(temperature=0), Sampling(seed=3))
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    reads.clear()
    tokens, nan = choose(scores, rows, [0], (bitmask, [2], VOCAB))
    accept(rows, tokens)
    picked = Reading(tokens, nan, scores, {0: 3, 2: 0}).wait()
    assert reads == ["tolist"], reads
    expected = scores[0].log_softmax(-1)
    assert picked.logprobs[0][0] == pytest.approx(float(expected[picked.tokens[0]]))
    assert picked.logprobs[0][1] == expected.topk(3).indices.tolist() and picked.logprobs[2][1] == []
