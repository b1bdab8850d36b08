"""--serve: the OpenAI-compatible server against a live uvicorn on a free loopback port, through the official
openai client and raw HTTP, on a tiny llama (with a chat template added, as an instruct checkpoint has)."""

import base64
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from helpers import SCRIPT, LiveServer, cli_env, free_port, run_cli, serving, wait_until_healthy
from rungen.engine import Engine
from rungen.loading import load
from rungen.server import Guard, ServeOptions, create_app
from tiny_models import build_tiny_checkpoint

MODEL_ID = "tiny-llama"
# ChatML, as SmolLM2-Instruct's template writes it.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HELLO = [{"role": "user", "content": "Hello, my dog is cute."}]


def build_chat_llama(path: str) -> str:
    """A tiny llama checkpoint at `path` with SmolLM2-Instruct's ChatML template (as an instruct checkpoint has),
    so that "messages" run; returns `path`."""
    build_tiny_checkpoint("llama", path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_chat_llama(str(tmp_path_factory.mktemp("serve") / "llama"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(checkpoint, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def served(loaded):
    with serving(loaded, model_id=MODEL_ID, max_batch=8, max_queue=64) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(served, path, body, **kwargs):
    return httpx.post(served[0].url + path, json=body, timeout=60, **kwargs)


def greedy_text(client, **kwargs):
    response = client.completions.create(model=MODEL_ID, temperature=0, **kwargs)
    return response.choices[0].text


def test_models_health_and_metrics(served, client):
    assert [model.id for model in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    assert httpx.get(served[0].url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL_ID, prompt="The capital", max_tokens=3, temperature=0)
    metrics = httpx.get(served[0].url + "/metrics").text
    assert 'rungen_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    for name in ("rungen_prompt_tokens_total", "rungen_generation_tokens_total", "rungen_queue_depth",
                 "rungen_time_to_first_token_seconds_bucket", "rungen_time_per_output_token_seconds_count"):
        assert name in metrics
    generated = int(re.search(r"^rungen_generation_tokens_total (\d+)$", metrics, re.M).group(1))
    assert generated >= 3

    def first_tokens():  # the requests that gave a first token
        text = httpx.get(served[0].url + "/metrics").text
        return int(re.search(r"^rungen_time_to_first_token_seconds_count (\d+)$", text, re.M).group(1))

    before = first_tokens()
    client.completions.create(model=MODEL_ID, prompt="The capital", max_tokens=3, n=3, seed=1)
    assert first_tokens() == before + 1  # a request's first token, whatever its choices


@pytest.mark.slow
def test_greedy_equals_the_command_line(served, client, checkpoint, loaded):
    """The same greedy request gives the same text over HTTP as run_generation.py gives (generate())."""
    long_prompt = "The weather today is sunny with a light wind from the west, and tomorrow it will rain. " * 3
    assert len(loaded.tokenizer.encode(long_prompt)) > 40  # longer than the tail the engine decodes after
    lines = [json.dumps({"prompt": "The capital of France is"}), json.dumps({"prompt": long_prompt}),
             json.dumps({"messages": HELLO})]
    result = run_cli(["--model_name_or_path", checkpoint, "--temperature", "0", "--length", "12",
                      "--input_format", "jsonl", "--output_format", "jsonl"], stdin="\n".join(lines))
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    expected = [json.loads(line)["generated_text"] for line in result.stdout.decode().splitlines()]
    texts = []
    for prompt in ("The capital of France is", long_prompt):
        completion = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0)
        assert completion.usage.completion_tokens == 12 and completion.choices[0].finish_reason == "length"
        texts.append(completion.choices[0].text)
    chat = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=12, temperature=0)
    assert texts + [chat.choices[0].message.content] == expected


def test_streaming_matches_the_whole_answer(served, client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=15, temperature=0)
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=15, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "length" and usage.completion_tokens == 15 and usage.prompt_tokens == whole.usage.prompt_tokens
    # Raw server-sent events end with data: [DONE].
    with httpx.stream("POST", served[0].url + "/v1/completions", timeout=60,
                      json={"model": MODEL_ID, "prompt": "Once upon", "max_tokens": 5, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in events)


def test_hints_a_client_sends_are_taken(client):
    """store false (nothing is stored), prompt_cache_key (the prefix cache needs no key) and safety_identifier, as
    the openai client sends them, change nothing."""
    plain = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=4, temperature=0)
    hinted = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=4, temperature=0, store=False,
                                            prompt_cache_key="conversation-1", safety_identifier="user-1")
    assert hinted.choices[0].message.content == plain.choices[0].message.content


def test_n_and_seed(client):
    kwargs = dict(model=MODEL_ID, messages=HELLO, max_tokens=10, temperature=1.0, n=3, seed=7)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert texts == [choice.message.content for choice in again.choices]  # the request's seed reproduces every choice
    assert len(set(texts)) > 1  # the choices are separate draws
    assert first.usage.completion_tokens == 30


def test_unseeded_requests_draw_from_the_generator_seed_seeds(client):
    # --seed seeds the process's generator (run_generation.set_seed): requests without a seed draw theirs from it,
    # as they come, so the same requests in the same order after a restart with the same --seed get the same text
    import run_generation

    def two_draws():
        run_generation.set_seed(5)
        return [client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12,
                                          temperature=1.0).choices[0].text for _ in range(2)]

    first = two_draws()
    assert two_draws() == first and first[0] != first[1]


def test_stop_strings_cut_and_never_leak(served, client):
    text = greedy_text(client, prompt="Once upon a time", max_tokens=24)
    stop = text[9:12]  # three characters mid-text, very likely spread over tokens
    other = "\u2603never"
    cut = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[other, stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = ""
    for chunk in client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0,
                                           stop=stop, stream=True):
        streamed += chunk.choices[0].text
        assert stop not in streamed
    assert streamed == cut.choices[0].text


def test_logprobs_sum_to_a_forward_pass(loaded, client):
    """The chosen tokens' log-probabilities are those of one forward pass over prompt + continuation."""
    tokenizer, model = loaded.tokenizer, loaded.model
    ids = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    response = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3)
    items = response.choices[0].logprobs.content
    assert len(items) == 8 and all(len(item.top_logprobs) == 3 for item in items)
    with torch.inference_mode():
        new = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)
    expected = logits.gather(1, torch.tensor(new)[:, None]).squeeze(1)
    assert sum(item.logprob for item in items) == pytest.approx(float(expected.sum()), abs=1e-3)
    assert items[0].top_logprobs[0].logprob >= items[0].top_logprobs[1].logprob
    assert "".join(item.token for item in items) == response.choices[0].message.content


def test_echo_scores_the_prompt(loaded, client):
    prompt = "The capital of France is Paris"
    response = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = response.choices[0]
    ids = loaded.tokenizer.encode(prompt)
    with torch.inference_mode():
        logprobs = loaded.model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    expected = logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    # echo with generation: the prompt's text, then the continuation
    echoed = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, echo=True, temperature=0)
    assert echoed.choices[0].text == prompt + greedy_text(client, prompt=prompt, max_tokens=4)


def test_completion_logprobs_hold_the_sampled_token_and_index_the_text(served, client, loaded):
    # OpenAI's legacy logprobs: top_logprobs has the token itself beside the `logprobs` most likely (up to
    # logprobs + 1), text_offset is where each token starts in `text`, and echo gives the prompt back as sent, a
    # special token it spells included (the BOS the tokenizer puts first is listed, and adds nothing to the text).
    sampled = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, logprobs=1,
                                        temperature=1.5, seed=3).choices[0].logprobs
    for top in (sampled, client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=6, logprobs=0,
                                                   temperature=1.5, seed=3).choices[0].logprobs):
        for token, value, alternatives in zip(top.tokens, top.token_logprobs, top.top_logprobs):
            assert alternatives[token] == value and len(alternatives) <= 2
    assert any(len(alternatives) == 2 for alternatives in sampled.top_logprobs)  # the sampled token not the likeliest
    for prompt in ("<|im_start|>user\nHi<|im_end|>\n", "I love \U0001F980 and \u65e5\u672c"):
        choice = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                           temperature=0).choices[0]
        assert choice.text.startswith(prompt)
        logprobs = choice.logprobs
        assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[-1] < len(choice.text)
        assert logprobs.tokens[0] == loaded.tokenizer.bos_token and logprobs.text_offset[:2] == [0, 0]
        for token, offset in zip(logprobs.tokens[1:], logprobs.text_offset[1:]):
            if not token.startswith("bytes:"):  # a token that is no whole character, as OpenAI writes it
                assert choice.text[offset:].startswith(token), (token, offset, choice.text)
    assert "<|im_start|>" in logprobs.tokens or "bytes:" in "".join(logprobs.tokens)


def test_completions_refuse_what_they_would_cut(served, loaded):
    # The default max_tokens (16) is honoured or refused, never cut to the context; a prompt list is of one kind.
    room = loaded.context - 10
    refused = post(served, "/v1/completions", {"model": MODEL_ID, "prompt": [5] * room})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "max_tokens's default (16) exceeds the model's context" in refused.json()["error"]["message"]
    assert post(served, "/v1/completions", {"model": MODEL_ID, "prompt": [5] * room, "max_tokens": 10}).status_code \
        == 200
    for path, field in (("/v1/completions", "prompt"), ("/v1/embeddings", "input")):
        mixed = post(served, path, {"model": MODEL_ID, field: ["a", [1, 2]]})
        assert mixed.status_code == 400 and mixed.json()["error"]["param"] == field
    nested = post(served, "/v1/completions", {"model": MODEL_ID, "prompt": "a", "stream": True,
                                               "stream_options": {"include_usage": "yes"}})
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "stream_options.include_usage"


def test_embeddings_count_in_the_metrics(served, client):
    def prompt_tokens():
        text = httpx.get(served[0].url + "/metrics").text
        return int(next(line.split()[-1] for line in text.splitlines()
                        if line.startswith("rungen_prompt_tokens_total")))

    before = prompt_tokens()
    used = client.embeddings.create(model=MODEL_ID, input=["a dog", "a cat sat"]).usage.prompt_tokens
    assert prompt_tokens() - before == used > 0


def test_json_schema_and_regex(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL_ID, messages=HELLO, max_tokens=60, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(response.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert response.choices[0].finish_reason == "stop"
    regex = r"(yes|no), [0-9]{3}"
    answer = client.completions.create(model=MODEL_ID, prompt="Answer:", max_tokens=20, temperature=1, seed=3,
                                       extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, answer.choices[0].text)
    grammar = 'root ::= ("yes" | "no") " because " ("cats" | "dogs") "."'
    for field in ("grammar", "guided_grammar"):  # llama-server's name, vLLM's name
        answer = client.completions.create(model=MODEL_ID, prompt="Answer:", max_tokens=20, temperature=1, seed=5,
                                           extra_body={field: grammar})
        assert re.fullmatch(r"(yes|no) because (cats|dogs)\.", answer.choices[0].text), answer.choices[0].text
        assert answer.choices[0].finish_reason == "stop"


def test_without_max_tokens_a_chat_fills_the_context(loaded, client):
    response = client.chat.completions.create(model=MODEL_ID, messages=HELLO, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == loaded.context


def test_embeddings_through_the_openai_client(loaded, client):
    """Float, base64 and the client's default (base64, decoded by it) give one vector a text: the last token's
    final hidden state (the one the output head turns into the logits), L2-normalised; the same alone, in a batch
    and from its token ids; usage counts the inputs' tokens."""
    texts = ["The capital of France is Paris.", "Hi", "Water boils at 100 degrees and freezes at 0."]
    floats = client.embeddings.create(model=MODEL_ID, input=texts, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1, 2] and floats.model == MODEL_ID
    ids = [loaded.tokenizer.encode(text) for text in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    vectors = torch.tensor([item.embedding for item in floats.data])
    assert vectors.shape == (3, loaded.model.config.hidden_size)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(3), atol=1e-6)
    for text, tokens, vector in zip(texts, ids, vectors):
        with torch.inference_mode():
            out = loaded.model(torch.tensor([tokens]), output_hidden_states=True)
            last = out.hidden_states[-1][0, -1]
            assert torch.allclose(loaded.model.lm_head(last), out.logits[0, -1], atol=1e-5)  # the final, normed one
        assert torch.allclose(vector, torch.nn.functional.normalize(last, dim=0), atol=1e-6)
        alone = client.embeddings.create(model=MODEL_ID, input=text, encoding_format="float").data[0].embedding
        assert torch.allclose(torch.tensor(alone), vector, atol=1e-6)
    from_ids = client.embeddings.create(model=MODEL_ID, input=ids, encoding_format="float")
    assert torch.allclose(torch.tensor([item.embedding for item in from_ids.data]), vectors, atol=1e-6)
    encoded = client.embeddings.create(model=MODEL_ID, input=texts, encoding_format="base64")
    raw = [base64.b64decode(item.embedding) for item in encoded.data]  # the client hands base64 over as it came
    assert torch.equal(torch.tensor([list(struct.unpack(f"<{len(r) // 4}f", r)) for r in raw]), vectors)
    decoded = client.embeddings.create(model=MODEL_ID, input=texts)  # sent as base64, decoded by the client
    assert torch.equal(torch.tensor([list(item.embedding) for item in decoded.data]), vectors)


def test_embeddings_beside_generation_change_no_token(client):
    """Embeddings run between the batch's decode steps: the requests decoding meanwhile give what they give alone."""
    settings = {"prompt": "Once upon a time", "max_tokens": 40, "extra_body": {"ignore_eos": True}}
    alone = greedy_text(client, **settings)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(greedy_text, client, **settings) for _ in range(2)]
        embedded = [pool.submit(client.embeddings.create, model=MODEL_ID, input=["The cat sat on the mat."] * 40)
                    for _ in range(2)]
        assert [future.result() for future in running] == [alone, alone]
        assert all(len(future.result().data) == 40 for future in embedded)


def test_tokenize_and_detokenize(loaded, served, client):
    """/tokenize gives the ids a request runs on (its count is the request's prompt_tokens), for a text or a
    conversation, counting past the context without refusing; /detokenize gives their text back."""
    def tokenize(body):
        response = post(served, "/tokenize", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == loaded.context
        return answer["tokens"]

    text = "The capital of France is"
    tokens = tokenize({"prompt": text, "model": MODEL_ID})
    assert tokens == loaded.tokenizer.encode(text) and tokens[0] == loaded.tokenizer.bos_token_id
    usage = client.completions.create(model=MODEL_ID, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == len(tokens)
    assert tokenize({"prompt": text, "add_special_tokens": False}) == tokens[1:]
    chat = tokenize({"messages": HELLO})
    assert client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1).usage.prompt_tokens == \
        len(chat)
    unopened = tokenize({"messages": HELLO, "add_generation_prompt": False})
    assert len(tokenize({"prompt": "word " * 300})) > loaded.context
    turn = "<|im_start|>user\nHello, my dog is cute.<|im_end|>\n"
    assert post(served, "/detokenize", {"tokens": chat}).json() == {"prompt": turn + "<|im_start|>assistant\n"}
    assert post(served, "/detokenize", {"tokens": unopened}).json() == {"prompt": turn}
    assert post(served, "/detokenize", {"tokens": tokens[1:], "model": MODEL_ID}).json() == {"prompt": text}
    # A message's text parts are joined by a line (as vLLM joins them): one part's words never run into the next's.
    parts = [{"role": "user", "content": [{"type": "text", "text": "<reminder>ctx</reminder>"},
                                          {"type": "text", "text": "Fix the bug"}]}]
    assert post(served, "/detokenize", {"tokens": tokenize({"messages": parts, "add_generation_prompt": False})}
                ).json()["prompt"].endswith("user\n<reminder>ctx</reminder>\nFix the bug<|im_end|>\n")


BAD_REQUESTS = [
    ("/v1/chat/completions", {"messages": HELLO}, "model", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "store": True}, "store", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "prompt_cache_key": 5}, "prompt_cache_key", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "safety_identifier": []}, "safety_identifier",
     400),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO}, "model", 404),
    ("/v1/chat/completions", {"model": MODEL_ID}, "messages", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "tool", "content": "x"}]}, "messages", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "tools": [{"type": "function"}]}, "tools", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "temperature": 3}, "temperature", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "thinking_token_budget": 8},
     "thinking_token_budget", 400),  # SmolLM2's template has no thinking block
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "top_p": 0}, "top_p", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "n": 0}, "n", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "n": 1000}, "n", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "max_tokens": 1000}, "max_tokens", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "max_completion_tokens": -1},
     "max_completion_tokens", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "stop": ""}, "stop", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "logit_bias": {"99999": 1}}, "logit_bias", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "logit_bias": {"5": 500}}, "logit_bias", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "presence_penalty": 2.5}, "presence_penalty",
     400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "top_logprobs": 2}, "top_logprobs", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "logprobs": True, "top_logprobs": 50},
     "top_logprobs", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "seed": "x"}, "seed", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "stream_options": {"include_usage": True}},
     "stream_options", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "response_format": {"type": "xml"}},
     "response_format", 400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "guided_regex": "(unclosed"}, "guided_regex",
     400),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": HELLO, "guided_regex": "a", "grammar": "root ::= \"a\""},
     "grammar", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "suffix": "y"}, "suffix", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "best_of": 3}, "best_of", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": [1, 2, 10**6]}, "prompt", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "word " * 200}, "prompt", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": 5}, "prompt", 400),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "logprobs": 99}, "logprobs", 400),
    ("/v1/embeddings", {"input": "x"}, "model", 400),
    ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"}, "model", 404),
    ("/v1/embeddings", {"model": MODEL_ID}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": ["x", ""]}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": []}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": [[1, 2], [3, 10**6]]}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": ["x", 5]}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "word " * 200}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": ["x"] * 2049}, "input", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "dimensions": 16}, "dimensions", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "encoding_format": "int8"}, "encoding_format", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "encoding_format": ""}, "encoding_format", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "user": 5}, "user", 400),
    ("/v1/embeddings", {"model": MODEL_ID, "input": "x", "truncate": True}, "truncate", 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model", 404),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": ["x"]}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "messages": HELLO}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", 400),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
    ("/tokenize", {"messages": [{"role": "x", "content": "y"}]}, "messages", 400),
    ("/tokenize", {"messages": HELLO, "add_generation_prompt": 1}, "add_generation_prompt", 400),
    ("/tokenize", {"prompt": "x", "with_pieces": True}, "with_pieces", 400),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, True]}, "tokens", 400),
    ("/detokenize", {"tokens": "1 2"}, "tokens", 400),
    ("/detokenize", {}, "tokens", 400),
]


@pytest.mark.parametrize("path, body, param, status", BAD_REQUESTS, ids=[case[2] for case in BAD_REQUESTS])
def test_bad_requests_are_refused_in_openai_shape(served, path, body, param, status):
    response = post(served, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert httpx.get(served[0].url + "/health").status_code == 200


def test_malformed_bodies(served):
    for content in (b"{not json", b"[1, 2]"):
        response = httpx.post(served[0].url + "/v1/completions", content=content, timeout=10,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()
    too_big = httpx.post(served[0].url + "/v1/completions", content=b" " * (5 << 20), timeout=10)
    assert too_big.status_code == 413
    # no such route: OpenAI's words and type for it
    assert httpx.get(served[0].url + "/nowhere").json()["error"] == {
        "message": "Invalid URL (GET /nowhere)", "type": "invalid_request_error", "param": None, "code": None}
    # a body that says it is not JSON: 415, the body's type named
    form = httpx.post(served[0].url + "/v1/completions", content=b"prompt=Hello", timeout=10,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "application/x-www-form-urlencoded" in form.json()["error"]["message"]


def test_probes_may_ask_with_head(served):
    """Load balancers probe with HEAD: the GET routes a probe reads answer it, with no body."""
    for path in ("/health", "/metrics", "/v1/models"):
        response = httpx.head(served[0].url + path, timeout=10)
        assert response.status_code == 200 and response.content == b"", path
    assert httpx.head(served[0].url + "/v1/completions", timeout=10).status_code == 405


def test_concurrent_load_equals_each_request_alone(served, client):
    """32 requests from 8 clients, mixed prompts, lengths and settings: each gives what it gives alone."""
    prompts = ["The capital of France is", "Once upon a time there was", "Hello", "I think that the best way to",
               "Water boils at 100 degrees and", "The quick brown fox"]
    requests = []
    for number in range(32):
        kwargs = dict(model=MODEL_ID, prompt=prompts[number % len(prompts)] * (1 + number % 3),
                      max_tokens=4 + (number * 7) % 29, temperature=0)
        if number % 4 == 1:
            kwargs.update(temperature=0.9, top_p=0.9, seed=number)  # a seeded draw is reproducible too
        if number % 5 == 2:
            kwargs.update(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"5": -100})
        if number % 7 == 3:
            kwargs.update(stop=["e"])
        requests.append(kwargs)

    def ask(kwargs):
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason

    alone = [ask(kwargs) for kwargs in requests]
    peak = served[1].batch.peak_rows
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone
    assert served[1].batch.peak_rows > max(peak, 1)  # they did share the batch


def test_a_client_dropping_mid_stream_frees_its_slot(served):
    live, engine = served
    body = {"model": MODEL_ID, "prompt": "Once", "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text": "' in line:
                break  # the first token came: hang up
    for _ in range(200):
        if not engine.batch.rows:
            break
        time.sleep(0.02)
    assert not engine.batch.rows and not engine.batch.kv.held()
    assert post(served, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_conversation_reuses_its_cached_prefix(served, client):
    engine = served[1]
    first = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=6, temperature=0)
    conversation = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And the cat?"}]
    before = engine.metrics.reused_tokens
    reply = client.chat.completions.create(model=MODEL_ID, messages=conversation, max_tokens=8, temperature=0)
    assert engine.metrics.reused_tokens > before
    engine.prefix_cache.entries.clear()
    engine.prefix_cache.bytes = 0
    fresh = client.chat.completions.create(model=MODEL_ID, messages=conversation, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == fresh.choices[0].message.content


def test_requests_that_start_alike_reuse_their_shared_start(served, client, loaded):
    """Two chats under one system prompt: the second prefills only what follows the start it shares with the
    first (the system turn and the template's tokens), and answers as it does with no cache."""
    engine = served[1]
    system = {"role": "system", "content": "You answer in one short sentence, politely, and never in verse."}
    first = [system, *HELLO]
    second = [system, {"role": "user", "content": "What is the capital of France?"}]
    client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=4, temperature=0)
    rendered = [loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"] for messages in (first, second)]
    shared = next(n for n, (a, b) in enumerate(zip(*rendered)) if a != b)
    before = engine.metrics.reused_tokens
    reply = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=8, temperature=0)
    assert engine.metrics.reused_tokens - before == shared > 10
    # (usage says so, as OpenAI's does: the prompt's tokens the cache held)
    assert reply.usage.prompt_tokens_details.cached_tokens == shared
    engine.prefix_cache.entries.clear()
    engine.prefix_cache.bytes = 0
    fresh = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == fresh.choices[0].message.content
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_a_next_turn_grows_in_the_buffers_its_first_turn_left(checkpoint):
    """Layers in GGUF blocks, their cache growing in place: a conversation's next turn takes over the buffers of
    the turn before (no copy of the history), and answers as it does with no cache."""
    import numpy as np

    from helpers import to_blocks
    from rungen.gguf.decoder import fuse_decoder_layers

    blocked = load(checkpoint, device=torch.device("cpu"))
    for layer in blocked.model.model.layers:
        to_blocks(layer, np.random.default_rng(3))
    assert fuse_decoder_layers(blocked.model) and blocked.model.cache_grows_in_place

    def run(engine, ids, max_tokens):
        _, finishes, _, _ = collect(engine, ids, max_tokens=max_tokens)
        engine.admission.admit()
        while engine.batch.rows:
            engine.batch.step()
        return finishes[0].tokens

    tokenizer = blocked.tokenizer
    engine = Engine(blocked, eos_ids=())
    first = tokenizer.encode("Hello, my dog is cute and")
    reply = run(engine, first, 5)
    [(held, (layers, _, buffers, *_))] = engine.prefix_cache.entries.items()
    # the last token's position is held only where a step was launched ahead of the row's end (a GPU)
    assert buffers is not None and held == tuple(first + reply[: len(reply) - 1 + engine.batch.lookahead])
    following = first + reply + tokenizer.encode(" so is the cat")
    taken = [keys.data_ptr() for keys, _ in buffers]
    _, finishes, _, _ = collect(engine, following, max_tokens=6)
    engine.admission.admit()
    assert held not in engine.prefix_cache.entries
    assert [layer.keys.data_ptr() for layer in engine.batch.kv.cache.layers] == taken
    while engine.batch.rows:
        engine.batch.step()
    assert finishes[0].tokens == run(Engine(blocked, eos_ids=(), prefix_cache_bytes=0), following, 6)


def test_requests_joining_together_enter_the_batch_at_once_and_each_gives_what_it_gives_alone(loaded):
    """Several requests admitted between two steps (their keys/values merged into the batch together, after the
    last prefill), one of them done at its first token: each gives the tokens it gives alone."""
    tokenizer = loaded.tokenizer
    prompts = [("Hello, my dog is cute", 6), ("The capital of France", 1), ("Once upon a time there was a", 5)]

    def tokens(engine, asked):
        runs = [collect(engine, tokenizer.encode(text), max_tokens=count)[1] for text, count in asked]
        engine.admission.admit()
        assert not engine.waiting and not engine.batch.pending
        while engine.batch.rows:
            engine.batch.step()
        return [finishes[0].tokens for finishes in runs]

    alone = [tokens(Engine(loaded, eos_ids=(), prefix_cache_bytes=0), [asked]) for asked in prompts]
    together = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    assert tokens(together, prompts) == [run[0] for run in alone]
    assert together.batch.peak_rows == 3 and not together.batch.kv.held()


def test_api_key_and_a_full_queue(loaded, served):
    """With a key every route but /health needs it; CORS is off unless origins are named; a queue that is full
    answers 503 with Retry-After."""
    engine = served[1]
    options = ServeOptions(model_id=MODEL_ID, cors_origins=("http://app.example",))
    keyed = LiveServer(Guard(create_app(loaded, engine, options), "s3cret", engine.metrics))
    full = Engine(loaded, max_queue=0, eos_ids=engine.eos_ids, prefix_cache_bytes=0)
    full.start()
    busy = LiveServer(create_app(loaded, full, ServeOptions(model_id=MODEL_ID)))
    try:
        assert httpx.get(keyed.url + "/health").status_code == 200
        denied = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        for header in ("bearer s3cret", "BEARER s3cret"):  # HTTP's auth schemes are any case
            assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": header}).status_code == 200
        for header in ("Basic s3cret", "s3cret", "Bearer  s3cret", "Bearers3cret"):
            assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": header}).status_code == 401
        assert httpx.get(keyed.url + "/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        allowed = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert allowed.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
                model=MODEL_ID, input="Hi")
        assert len(allowed.embeddings.create(model=MODEL_ID, input="Hi").data) == 1
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(keyed.url + path, json=body).status_code == 401
            assert httpx.post(keyed.url + path, json=body, headers={"Authorization": "Bearer s3cret"}).status_code \
                == 200
        # CORS only where asked for: the keyed server allows one origin, the module's server none.
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization"}
        allowed_origin = httpx.options(keyed.url + "/v1/chat/completions", headers=preflight)
        assert allowed_origin.headers.get("access-control-allow-origin") == "http://app.example"
        no_cors = httpx.options(served[0].url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in no_cors.headers
        response = httpx.post(busy.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "Hi"}, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "server_error"
    finally:
        keyed.stop()
        busy.stop()
        full.close()


def test_a_body_that_stalls_is_a_408_and_its_connection_closes(loaded, served):
    """A client that sends a Content-Length and part of the body, then nothing: once the body's time is up, a 408
    in OpenAI's shape, the connection closed and the request counted as ended; the server goes on serving."""
    engine = served[1]
    options = ServeOptions(model_id=MODEL_ID, body_timeout=0.5)
    live = LiveServer(Guard(create_app(loaded, engine, options), None, engine.metrics))
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n" + b'{"model": "' + MODEL_ID.encode())
            answer = b""
            while chunk := sock.recv(1 << 16):  # until the server closes the connection (a timeout fails the test)
                answer += chunk
            elapsed = time.monotonic() - started
        head, _, content = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
        error = json.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout", error
        assert 0.5 <= elapsed < 5, elapsed
        metrics = httpx.get(live.url + "/metrics").text
        assert 'rungen_requests_total{endpoint="/v1/embeddings",status="408"} 1' in metrics
        ok = httpx.post(live.url + "/v1/embeddings", json={"model": MODEL_ID, "input": "Hi"}, timeout=10)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    finally:
        live.stop()


def collect(engine, request_ids, **kwargs):
    """Runs one engine request to its end; returns (finishes by choice, deltas)."""
    from rungen.requests import Delta, Done, Request
    from rungen.sampling import Sampling

    finishes, deltas, done = {}, [], threading.Event()

    def sink(event):
        if isinstance(event, Delta):
            deltas.append(event.text)
        elif isinstance(event, Done):
            finishes[event.index] = event.finish
        else:
            done.set()

    request = Request(request_ids, sink=sink, **{"max_tokens": 10, "sampling": Sampling(temperature=0), **kwargs})
    engine.submit(request)
    return request, finishes, deltas, done


def test_abort_ends_every_request_with_a_reason(loaded):
    """Shutdown's grace over: running and waiting requests all end, with finish_reason "abort"."""
    engine = Engine(loaded, max_batch=1, eos_ids=(), prefix_cache_bytes=0)
    ids = loaded.tokenizer.encode("Once upon a time")
    running = collect(engine, ids, max_tokens=100)
    waiting = collect(engine, ids, max_tokens=100)
    engine.admission.join([engine.waiting.popleft()])  # the first is decoding, the second waits for its slot
    engine.close()
    engine.abort()
    engine.loop()
    for _, finishes, _, done in (running, waiting):
        assert done.is_set() and finishes[0].reason == "abort"
    assert running[1][0].tokens and not engine.batch.rows and not engine.batch.kv.held()


def greedy(loaded, prompt, tokens):
    """generate()'s greedy new tokens after `prompt`."""
    ids = loaded.tokenizer.encode(prompt)
    with torch.inference_mode():
        return loaded.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                     pad_token_id=loaded.tokenizer.pad_token_id)[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt2", "ctrl", "gptj", "bloom", "opt", "mistral", "qwen2"])
def test_every_batchable_type_decodes_as_generate_does(model_type, tmp_path):
    """Three prompts joining one batch give generate()'s greedy tokens, for each cache layout."""
    path = build_tiny_checkpoint(model_type, str(tmp_path / model_type))
    loaded = load(path, device=torch.device("cpu"))
    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    engine.start()
    prompts = ["The capital of France is", "Once upon a time there was a little girl", "Hello"]
    runs = [collect(engine, loaded.tokenizer.encode(prompt)) for prompt in prompts]
    for prompt, (_, finishes, _, done) in zip(prompts, runs):
        assert done.wait(60)
        assert finishes[0].tokens == greedy(loaded, prompt, 10)
    engine.close()
    engine.thread.join(timeout=10)


def test_layers_that_read_another_layers_keys_join_the_batch_as_generate_decodes(tmp_path):
    """Gemma 4 E2B/E4B's last layers keep no keys and values (they read an earlier layer's: transformers' DummyLayer
    in the cache): rows joining a running batch, past the sliding window and from the prefix cache, decode with
    generate()'s greedy tokens."""
    import time

    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_checkpoint("qwen2", str(tmp_path / "qwen2")))
    vocab = -(-len(tokenizer) // 64) * 64
    config = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab, num_kv_shared_layers=2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    path = str(tmp_path / "gemma4")
    Gemma4ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    loaded = load(path, device=torch.device("cpu"))
    engine = Engine(loaded, eos_ids=())
    engine.start()
    prompts = ["The capital of France is", "Once upon a time there was a little girl who lived in a house", "Hello",
               "The capital of France is"]  # the last: the first's keys from the prefix cache
    runs = []
    for number, prompt in enumerate(prompts):
        runs.append(collect(engine, loaded.tokenizer.encode(prompt), max_tokens=12))
        if number == 2:
            assert runs[0][3].wait(60)
        time.sleep(0.05 * number)  # the later rows join a batch already decoding
    for prompt, (_, finishes, _, done) in zip(prompts, runs):
        assert done.wait(60)
        assert finishes[0].tokens == greedy(loaded, prompt, 12), prompt
    assert runs[3][0].reused > 0
    engine.close()
    engine.thread.join(timeout=10)


def test_jit_serves_the_batch_steps_with_the_eager_tokens(checkpoint):
    """--serve --jit: the traced step decodes the batch as rows join and leave, with generate()'s tokens."""
    from rungen.jit import enable_jit

    loaded = load(checkpoint, device=torch.device("cpu"))
    prompts = ["The capital of France is", "Once upon a time there was a little girl", "Hello"]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = loaded.tokenizer.encode(prompt)
            new = loaded.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                        pad_token_id=loaded.tokenizer.pad_token_id)[0, len(ids):].tolist()
            expected.append(new)
    assert enable_jit(loaded.model, loaded.tokenizer) is not None
    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    engine.start()
    runs = [collect(engine, loaded.tokenizer.encode(prompt), max_tokens=10 - 3 * number)
            for number, prompt in enumerate(prompts)]
    for number, ((_, finishes, _, done), tokens) in enumerate(zip(runs, expected)):
        assert done.wait(60)
        assert finishes[0].tokens == tokens[: 10 - 3 * number]
    assert loaded.model.forward.graph_steps > 0
    engine.close()
    engine.thread.join(timeout=10)


def test_flags_that_do_not_apply_are_refused(checkpoint, capsys):
    import run_generation

    with pytest.raises(SystemExit) as exit_info:
        run_generation.cli(["--serve", "--model_name_or_path", checkpoint, "--temperature", "0.5"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("run_generation.py: error: --temperature does not apply to --serve: "
                                               "each request sets its own (see docs/server.md)")
    for flags in (["--temperature", "0"], ["--k", "0"], ["--no-chat"], ["--no-stream"]):  # whatever the value
        with pytest.raises(SystemExit) as exit_info:
            run_generation.cli(["--serve", "--model_name_or_path", checkpoint, *flags])
        assert exit_info.value.code == 2 and "does not apply to --serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no request sets a batch size: the server's own flag is named
        run_generation.cli(["--serve", "--model_name_or_path", checkpoint, "--batch_size", "4"])
    assert "--batch_size does not apply to --serve: it batches requests as they come, up to --max_batch" in \
        capsys.readouterr().err
    # A port another server holds: one line and exit 2, before any "serving" line.
    import socket

    from rungen.server import listen

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            run_generation.cli(["--serve", "--model_name_or_path", checkpoint, "--port", str(port)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "serving" not in err
        assert err.strip().endswith(f"cannot listen on 127.0.0.1:{port}: Address already in use (another server "
                                    "there? choose another --port)")
    listen("127.0.0.1", 0).close()
    # main() logs the parsed flags: the key is not among what it prints, yet it is the key.
    from rungen.arguments import parse_args, serve_options

    args = parse_args(["--serve", "--api_key", "s3cret"])
    assert "s3cret" not in repr(args) and args.api_key == "s3cret"
    assert "s3cret" not in repr(serve_options(args))


@pytest.mark.slow
def test_sigterm_under_load_ends_every_stream_and_exits_0(checkpoint, tmp_path):
    """run_generation.py --serve: SIGTERM while streams run; each ends properly (finish_reason, [DONE]) and the
    process exits 0."""
    port = free_port()
    process = subprocess.Popen([sys.executable, SCRIPT, "--serve", "--model_name_or_path", checkpoint, "--port",
                                str(port), "--shutdown_grace", "0.2"], env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url)
        streams, started = [], threading.Barrier(5, timeout=60)

        def stream(number):
            # ignore_eos: a sampled EOS would end a stream with "stop" before the signal, the sooner the faster
            # the server; every stream must still be running when SIGTERM comes.
            body = {"model": "llama", "prompt": "Once" * (1 + number), "max_tokens": 110, "stream": True,
                    "ignore_eos": True}
            lines = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            started.wait()
            streams.append(lines)

        threads = [threading.Thread(target=stream, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    # Where it listens and that it shuts down, nothing per request (that is --verbose), no arguments.
    lines = process.stderr.read().decode().splitlines()
    assert lines[0] == f"serving {os.path.basename(checkpoint)} on http://127.0.0.1:{port} (OpenAI-compatible: " \
        "/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings; Anthropic-compatible: " \
        "/v1/messages)", lines
    assert lines[1:] == ["shutting down: finishing running requests (at most 0 s)"], lines
    assert len(streams) == 4
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines[:-1]]
        assert finishes[-1] in ("length", "abort") and all(finish is None for finish in finishes[:-1])
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_grace_and_every_request_in_shape():
    """Ctrl-C twice while requests run, the grace long: the second ends them at the next step, each in its shape (a
    stream's final chunk and [DONE], a plain answer's 200 with finish_reason "abort"), and the process exits 0
    with its two lines on stderr, no traceback. (The default model: its 400 tokens outlast the two presses.)"""
    port = free_port()
    process = subprocess.Popen([sys.executable, SCRIPT, "--serve", "--port", str(port), "--shutdown_grace", "600"],
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    answers, started = [], threading.Barrier(3, timeout=60)
    try:
        wait_until_healthy(url)

        def ask(stream):
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once", "max_tokens": 400, "stream": stream,
                    "ignore_eos": True}
            if stream:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                    lines = []
                    for line in response.iter_lines():
                        if line:
                            lines.append(line)
                            if len(lines) == 1:
                                started.wait()
                answers.append(lines)
            else:
                answers.append(httpx.post(url + "/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=ask, args=(stream,)) for stream in (True, True, False)]
        for thread in threads:
            thread.start()
        started.wait()
        for _ in range(600):  # the plain request in the batch too (queued after the signal, it would be a 503)
            if "rungen_running_rows 3" in httpx.get(url + "/metrics", timeout=10).text:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join(timeout=120)
        assert process.wait(timeout=120) == 0, process.stderr.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read().decode()  # (a first run's header read comes before)
    assert stderr.splitlines()[-2:] == [
        "shutting down: finishing running requests (at most 600 s)", "shutting down now: ending running requests"]
    assert "Traceback" not in stderr and "ERROR" not in stderr
    [plain] = [answer for answer in answers if isinstance(answer, httpx.Response)]
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "abort"
    streams = [answer for answer in answers if isinstance(answer, list)]
    assert len(streams) == 2 and all(lines[-1] == "data: [DONE]" for lines in streams)
    assert all(json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort" for lines in streams)


@pytest.mark.slow
def test_verbose_logs_a_line_a_request_on_stderr(checkpoint):
    """run_generation.py --serve --verbose: uvicorn's line per request goes to stderr with the other logs (uvicorn
    writes it to stdout); stdout stays empty."""
    port = free_port()
    process = subprocess.Popen([sys.executable, SCRIPT, "--serve", "--model_name_or_path", checkpoint, "--port",
                                str(port), "--verbose"], env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url)
        body = {"model": "llama", "prompt": "Once", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0 and stdout == b""
    assert '"POST /v1/completions HTTP/1.1" 200' in stderr.decode()


def test_a_stream_a_decode_step_has_no_gpu_memory_for_goes_on_after_the_others(loaded, monkeypatch):
    """A decode step beside another request runs out of GPU memory (raised where CUDA raises it: the CPU has no
    such limit): the newest request, a stream, gives way and goes on from where it was once the older has left, its
    stream whole and equal to what it streams alone; the older request answers what it answers alone, and the
    server goes on; /metrics counts the request that gave way."""
    from rungen.batch_cache import SlotBatch

    forward, queued, failed = SlotBatch.forward, threading.Event(), []

    def short_of_memory(self, rows, tokens):
        # The older's steps wait for the newer to be queued: the two then decode together.
        if len(rows) == 1 and not failed and not queued.wait(30):
            raise AssertionError("the newer request never came")
        if len(rows) == 2 and not failed:
            failed.append(len(rows))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return forward(self, rows, tokens)

    older = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    newer = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 24, "temperature": 0, "stream": True}
    with serving(loaded, model_id=MODEL_ID, max_batch=4, prefix_cache_mb=0) as (live, engine):
        url = live.url + "/v1/completions"
        alone = [httpx.post(url, json=body | {"stream": False}, timeout=60).json()["choices"][0]["text"]
                 for body in (older, newer)]
        monkeypatch.setattr(SlotBatch, "forward", short_of_memory)
        submit, submitted = engine.submit, []
        monkeypatch.setattr(engine, "submit", lambda request: (submit(request), submitted.append(request),
                                                               len(submitted) == 2 and queued.set())[0])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, url, json=older, timeout=60)
            while not engine.batch.rows:
                time.sleep(0.01)
            with httpx.stream("POST", url, json=newer, timeout=60) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert failed == [2] and answer.result().json()["choices"][0]["text"] == alone[0]
        chunks = [json.loads(event) for event in events[:-1]]
        assert not [chunk for chunk in chunks if "error" in chunk]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices")) == alone[1]
        assert httpx.post(url, json=older, timeout=60).json()["choices"][0]["text"] == alone[0]
        assert "rungen_gave_way_total 1" in httpx.get(live.url + "/metrics").text.splitlines()
