"""Decode steps overlapping the host's work (rungen/engine.py; on by default on a CUDA GPU, forced here with
RUN_GENERATION_OVERLAP=1): a step is launched on the tokens the step before left on the device, and the step before is
read and reported while it computes. Every request gets what steps taken one at a time give it: the same tokens, text,
streamed deltas, log-probabilities and endings, for rows that end at different steps (length, EOS, a stop string, a
cancel), join mid-run, draw from seeds, carry penalties (applied a row at a time, as on a CPU, or to all the rows at
once, as on a GPU) or follow a grammar; in fixed slots and in a padded batch. The order of launches and reads is
checked too: that is the overlap a GPU gets.
"""

import pytest
import torch

from helpers import merge_short_of_memory
from rungen import sampling
from rungen.decode import OVERLAP_ENV
from rungen.engine import Engine
from rungen.loading import load
from rungen.reasoning import Budget
from rungen.requests import Delta, Done, Request
from rungen.sampling import Sampling
from tiny_models import build_tiny_checkpoint

PROMPTS = ["The capital of France is Paris and the capital of Germany is", "Hello, my dog",
           "Once upon a time there was a little girl", "A", "One two three four five six seven eight"]


@pytest.fixture(scope="module", params=["llama", "bloom"])  # fixed slots; a padded batch
def loaded(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    return load(path, device=torch.device("cpu"))


def engine_of(loaded, monkeypatch, overlap, **kwargs):
    monkeypatch.setenv(OVERLAP_ENV, "1" if overlap else "0")
    engine = Engine(loaded, **{"max_batch": 3, **kwargs})
    assert engine.batch.overlap is overlap
    return engine


def run(engine, requests):
    """Runs the requests (keyword dicts for Request) on the calling thread; per request, per choice: (reason, text,
    tokens, stop, the deltas' text, the log-probability items)."""
    results = []

    def sink_of(number, cancel_after):
        deltas, items, out, events = {}, {}, {}, []

        def sink(event):
            assert getattr(event, "index", None) not in out, f"{event} after the choice's end"
            if isinstance(event, Delta):
                deltas[event.index] = deltas.get(event.index, "") + event.text
                items.setdefault(event.index, []).extend(event.logprobs or [])
                events.append(event)
                if cancel_after and len(events) >= cancel_after:
                    sink.request.cancelled = True
            elif isinstance(event, Done):
                f = event.finish
                out[event.index] = (f.reason, f.text, f.tokens, f.stop, deltas.get(event.index, ""),
                                    items.get(event.index, []))
        return sink, out

    for number, fields in enumerate(requests):
        fields = dict(fields)
        sink, out = sink_of(number, fields.pop("cancel_after", 0))
        request = Request(**{"max_tokens": 8, "sampling": Sampling(temperature=0, ignore_eos=True), **fields},
                          sink=sink)
        sink.request = request
        results.append(out)
        engine.submit(request)
    engine.run_here()
    assert not engine.batch.rows and engine.batch.ahead is None and not engine.batch.kv.held()
    return results


def assert_same(results, expected):
    """The same choices, endings, texts and tokens; log-probabilities to float32's rounding (a step's rows are
    computed together, and a row that ended stays one step longer in an overlapped batch)."""
    def logprobs(items):
        return [value for item in items
                for value in [item["logprob"]] + [top["logprob"] for top in item["top_logprobs"]]]

    def rest(items):
        return [(item["id"], item["token"], [top["id"] for top in item["top_logprobs"]]) for item in items]

    assert [sorted(result) for result in results] == [sorted(result) for result in expected]
    for result, wanted in zip(results, expected):
        for index, choice in result.items():
            assert choice[:5] == wanted[index][:5] and rest(choice[5]) == rest(wanted[index][5])
            assert logprobs(choice[5]) == pytest.approx(logprobs(wanted[index][5]), abs=1e-4)


def mixed_requests(loaded, eos):
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS]
    greedy = Sampling(temperature=0, ignore_eos=True)
    return [
        *({"ids": i, "max_tokens": length, "sampling": greedy} for i, length in zip(ids, [3, 9, 1, 12, 7])),
        {"ids": ids[1], "max_tokens": 10, "n": 3, "logprobs": 2,
         "sampling": Sampling(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, seed=5, ignore_eos=True)},
        {"ids": ids[2], "max_tokens": 9, "logprobs": 0,
         "sampling": Sampling(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.3, logit_bias=((eos, -5.0),))},
        {"ids": ids[0], "max_tokens": 12, "sampling": Sampling(temperature=0)},  # ends at `eos`
        {"ids": ids[4], "max_tokens": 12, "cancel_after": 4,
         "sampling": Sampling(temperature=1.0, seed=9, ignore_eos=True)},
    ]


def test_overlapped_steps_give_what_steps_one_at_a_time_give(loaded, monkeypatch):
    # The EOS a row meets mid-run: the 5th token greedy decoding gives the first prompt.
    first = run(engine_of(loaded, monkeypatch, False), [{"ids": loaded.tokenizer(PROMPTS[0]).input_ids}])[0][0]
    eos = first[2][4]
    requests = mixed_requests(loaded, eos)
    alone = run(engine_of(loaded, monkeypatch, False, eos_ids={eos}), requests)
    # A stop string that the fourth prompt's greedy text meets mid-run.
    text = alone[3][0][1]
    assert len(text) > 12
    requests.append({"ids": requests[3]["ids"], "max_tokens": 12, "stop": (text[6:9],)})
    alone = run(engine_of(loaded, monkeypatch, False, eos_ids={eos}), requests)
    overlapped = run(engine_of(loaded, monkeypatch, True, eos_ids={eos}), requests)
    assert_same(overlapped, alone)
    monkeypatch.setattr(sampling, "together_on", lambda device: True)  # a GPU's processors: all the rows at once
    assert_same(run(engine_of(loaded, monkeypatch, True, eos_ids={eos}), requests), alone)
    reasons = {choice[0] for result in alone for choice in result.values()}
    assert reasons == {"length", "stop", "abort"}, reasons
    assert alone[7][0][2][-1] == eos and alone[-1][0][3] == text[6:9]  # ended by EOS, by the stop string


def steps_and_reads(engine, monkeypatch):
    """The order of the engine's decode launches ("F") and reads of a step's choices ("R")."""
    log = []
    forward, wait = engine.batch.kv.forward, sampling.Reading.wait
    monkeypatch.setattr(engine.batch.kv, "forward", lambda *a, **k: (log.append("F"), forward(*a, **k))[1])
    monkeypatch.setattr(sampling.Reading, "wait", lambda self: (log.append("R"), wait(self))[1])
    return log


def test_a_step_is_read_while_the_next_one_runs(loaded, monkeypatch):
    ids = loaded.tokenizer(PROMPTS[1]).input_ids
    for overlap in (False, True):
        engine = engine_of(loaded, monkeypatch, overlap)
        log = steps_and_reads(engine, monkeypatch)
        run(engine, [{"ids": ids, "max_tokens": 6}])
        # The first token comes with the prompt (one read); five steps give the other five. Overlapped, each step
        # is read after the next one is launched, but the last: the step ahead gives the row its last token by
        # length, so it is read without launching one more (a step whose every token would be dropped).
        assert log == (["R", "F", "F"] + ["R", "F"] * 3 + ["R", "R"] if overlap else ["R"] + ["F", "R"] * 5), log


def test_a_cancelled_rows_keys_and_values_serve_the_turn_that_goes_on_from_it(loaded, monkeypatch):
    # A session's Ctrl-C cancels the reply and keeps its text: the next turn, which starts with the prompt and that
    # text, reads none of it again (overlapped, the step launched ahead fed a token the reply never got: not kept)
    ids = loaded.tokenizer(PROMPTS[0]).input_ids
    for overlap in (False, True):
        engine = engine_of(loaded, monkeypatch, overlap)
        [[reason, _, tokens, *_]] = [result[0] for result in run(engine, [{"ids": ids, "max_tokens": 50,
                                                                            "cancel_after": 4}])]
        assert reason == "abort" and 0 < len(tokens) < 50
        follow = ids + tokens + loaded.tokenizer(" and then").input_ids
        went_on = run(engine, [{"ids": follow, "max_tokens": 5}])[0][0][2]
        assert engine.metrics.reused_tokens == len(ids) + len(tokens), overlap
        assert went_on == run(engine_of(loaded, monkeypatch, False, prefix_cache_bytes=0),
                              [{"ids": follow, "max_tokens": 5}])[0][0][2]


def test_an_end_that_is_no_special_token_is_none_of_the_text(loaded, monkeypatch):
    # A file's end-of-turn token may be an ordinary one: the row ends at it, and neither its text nor its deltas
    # hold it (they are those of the tokens before it)
    ids = loaded.tokenizer(PROMPTS[0]).input_ids
    tokens = run(engine_of(loaded, monkeypatch, False), [{"ids": ids}])[0][0][2]
    end = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    [[_, before, *_]] = [result[0] for result in run(engine_of(loaded, monkeypatch, False),
                                                       [{"ids": ids, "max_tokens": end}])]
    for overlap in (False, True):
        engine = engine_of(loaded, monkeypatch, overlap, eos_ids={tokens[end]})
        [[reason, text, got, _, deltas, _]] = [result[0] for result in run(engine, [{"ids": ids, "sampling": Sampling(
            temperature=0)}])]
        assert (reason, got[-1], text, deltas) == ("stop", tokens[end], before, before), overlap


def test_rows_with_a_grammar_step_one_at_a_time(loaded, monkeypatch):
    # Their next mask needs the token just chosen: with such a row in the batch, a step is read before the next.
    pytest.importorskip("xgrammar")
    from rungen.constrain import compile_constraint

    tokenizer = loaded.tokenizer
    constraint = compile_constraint("regex", "[a-z ]{4,40}", tokenizer, loaded.model.config.vocab_size,
                                    {tokenizer.eos_token_id})
    ids = tokenizer(PROMPTS[2]).input_ids
    requests = [{"ids": ids, "max_tokens": 6, "constraint": constraint},
                {"ids": tokenizer(PROMPTS[0]).input_ids, "max_tokens": 6}]
    alone = run(engine_of(loaded, monkeypatch, False), requests)
    engine = engine_of(loaded, monkeypatch, True)
    log = steps_and_reads(engine, monkeypatch)
    assert_same(run(engine, requests), alone)
    assert "FF" not in "".join(log)
    assert all(character in "abcdefghijklmnopqrstuvwxyz " for character in alone[0][0][1])


def test_a_thinking_budget_closes_the_block_for_the_model_at_its_token(loaded, monkeypatch):
    """A reply whose thinking block used its budget gets the closing delimiter's tokens chosen for it, the very next
    step, overlapped or not (such a row is read before the next step is launched while the budget may end); a block
    the model closes itself, a reply that never opens one and a budget never reached leave the tokens alone."""
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS[:3]]
    plain = run(engine_of(loaded, monkeypatch, False), [{"ids": i, "max_tokens": 12} for i in ids])
    greedy = [result[0][2] for result in plain]
    close = (greedy[1][7], greedy[2][3])  # two tokens these replies do not give where they would be forced
    sampled = Sampling(temperature=0.9, seed=7, ignore_eos=True)
    requests = [
        {"ids": ids[0], "max_tokens": 12, "thinking_budget": Budget(3, (), close, inside=True)},  # prompt opened it
        {"ids": ids[1], "max_tokens": 12, "thinking_budget": Budget(4, tuple(greedy[1][:2]), close, inside=False)},
        {"ids": ids[2], "max_tokens": 12, "thinking_budget": Budget(2, (greedy[1][0],), close, inside=False)},
        {"ids": ids[0], "max_tokens": 12, "thinking_budget": Budget(20, (), close, inside=True)},  # never reached
        {"ids": ids[1], "max_tokens": 12, "thinking_budget": Budget(0, (), close, inside=True), "sampling": sampled},
    ]
    alone = run(engine_of(loaded, monkeypatch, False), requests)
    tokens = [result[0][2] for result in alone]
    assert tokens[0][:3] == greedy[0][:3] and tuple(tokens[0][3:5]) == close  # three in the block, then closed
    assert tokens[1][:6] == greedy[1][:6] and tuple(tokens[1][6:8]) == close  # opened by two tokens, four in it
    assert tokens[2] == greedy[2]  # the reply opened no block: nothing to cap
    assert tokens[3] == greedy[0]
    assert tuple(tokens[4][:2]) == close and tokens[4][2:] != greedy[1][2:]  # a budget of 0, and sampling after it
    engine = engine_of(loaded, monkeypatch, True)
    log = steps_and_reads(engine, monkeypatch)
    assert_same(run(engine, requests), alone)
    assert "FF" in "".join(log)  # steps overlapped where no budget was near its end
    # The model's own closing delimiter ends the block within the budget: nothing is forced after it.
    closes_itself = Budget(3, (), (greedy[0][1],), inside=True)
    assert run(engine_of(loaded, monkeypatch, False), [{"ids": ids[0], "max_tokens": 12,
                                                        "thinking_budget": closes_itself}])[0][0][2] == greedy[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_the_gpu_has_no_memory_to_merge_give_way_and_the_batch_goes_on(loaded, monkeypatch, overlap):
    """A left-padded batch copies a joining request's keys/values in beside its rows', a layer at a time; out of GPU
    memory for the second layer's copy (raised where CUDA raises it: the CPU has no such limit), the batch goes on
    with its rows as they were (the first layer read from the copy made) to the text it gives with memory to spare.
    The joining request gives way, its first token already chosen (and sent, where a stream), and goes on once a row
    has left, from that token (its prompt and token prefilled again): every text, stream and log-probability is
    the one a run with memory to spare gives; its two choices (n=2) go on each from its own token."""
    import rungen.batch_cache as batch_cache

    if Engine(loaded, max_batch=2).batch.kv.form != batch_cache.PaddedBatch.form:
        pytest.skip("fixed slots copy nothing at a join")
    failed, ids = [], [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS]
    sampling = Sampling(temperature=0.8, top_k=40, seed=4, ignore_eos=True)
    for joining in ({"deltas": False}, {"deltas": True}, {"deltas": True, "logprobs": 2, "n": 2}):
        # The joining prompt is the longest: the copy pads the batch's rows, which go on without that padding.
        requests = [{"ids": ids[3], "max_tokens": 12}, {"ids": ids[1], "max_tokens": 3},
                    {"ids": ids[0], "max_tokens": 6, "sampling": sampling} | joining]
        rows = 1 + joining.get("n", 1)  # the joining request waits for the second to leave
        spare = run(engine_of(loaded, monkeypatch, overlap, max_batch=rows), requests)
        failed.clear()
        engine = engine_of(loaded, monkeypatch, overlap, max_batch=rows)
        with monkeypatch.context() as patch:
            merge_short_of_memory(patch, lambda batch, parts: batch.cache is not None, failed)  # a join, not the first
            short = run(engine, requests)
        assert failed == [rows]  # the first row and the joining ones
        assert_same(short, spare)
        assert engine.metrics.gave_way == 1
        if joining.get("n"):
            assert short[2][0][2] != short[2][1][2]  # two choices, each gone on from its own token


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ending", ["cancelled", "everything ends", "everything ends, one choice back"])
def test_rows_waiting_to_go_on_end_once(loaded, monkeypatch, overlap, ending):
    """A stream of two choices gives way (a decode step beside an older request out of GPU memory, raised where CUDA
    raises it: the CPU has no such limit), its rows waiting to go on. Cancelled there, or when the engine ends every
    request (shutdown; one choice maybe back in the batch, the other still waiting, as where the cache's positions
    let one in), each choice gets one Done, "abort", with the text it had (all of it streamed), then the request
    one End; the older request goes on to its end, or ends with the rest."""
    from rungen.requests import End

    engine = engine_of(loaded, monkeypatch, overlap, max_batch=3)
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS[:2]]
    events = [], []
    older, newer = (Request(prompt, tokens, Sampling(temperature=0.8, seed=2, ignore_eos=True), sink=sink.append,
                            n=n) for prompt, tokens, sink, n in zip(ids, (12, 8), events, (1, 2)))
    for request in (older, newer):
        engine.submit(request)
    engine.admission.admit()
    engine.step()
    forward = engine.batch.kv.forward

    def short_of_memory(rows, tokens):
        monkeypatch.setattr(engine.batch.kv, "forward", forward)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(engine.batch.kv, "forward", short_of_memory)
    engine.step()
    assert newer.away == 2 and len(engine.waiting) == 2 and len(engine.batch.rows) == 1
    assert engine.metrics.gave_way == 1 and not [event for event in events[1] if isinstance(event, (Done, End))]
    if ending == "cancelled":
        newer.cancelled = True
        engine.run_here()
    else:
        if ending.endswith("back"):
            assert engine.admission.join([engine.waiting.popleft()]) and engine.admission.merge()
            assert len(engine.batch.rows) == 2 and newer.away == 1
        engine.end_all("abort", error="the server is shutting down")
    for request, sent in zip((older, newer), events):
        done = {event.index: event.finish for event in sent if isinstance(event, Done)}
        assert isinstance(sent[-1], End) and sum(isinstance(event, End) for event in sent) == 1
        assert sorted(done) == list(range(request.n)) and len(done) == sum(isinstance(e, Done) for e in sent)
        for index, finish in done.items():
            assert finish.text == "".join(event.text for event in sent if isinstance(event, Delta)
                                          and event.index == index)
            if request is newer or ending != "cancelled":
                assert finish.reason == "abort" and 2 <= len(finish.tokens) < request.max_tokens
            else:
                assert finish.reason == "length" and len(finish.tokens) == request.max_tokens
    assert newer.away == 0 and not engine.waiting and not engine.batch.rows
