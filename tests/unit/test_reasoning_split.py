"""rungen/reasoning.py on its own: the thinking block's delimiters read from the published templates, where a
prompt leaves the block, the splitter on replies as thinking models write them (whole and in every split into
pieces, which must agree), and the template variables a request may set."""

import os

import pytest

from rungen.reasoning import (
    THINK,
    ReasoningSplitter,
    ReplyPlan,
    VariableError,
    detect_delimiters,
    prompt_state,
    read_template_variables,
    split_reply,
)

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "chat_templates")


def template(name):
    with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


def streamed(state, text, sizes, delimiters=THINK):
    """(reasoning, content) of `text` fed in pieces of the given sizes (cycled), each piece's output joined."""
    splitter = ReasoningSplitter(delimiters, state)
    reasoning, content, position, number = "", "", 0, 0
    while position < len(text):
        size = sizes[number % len(sizes)]
        gained = splitter.feed(text[position : position + size])
        reasoning, content = reasoning + gained[0], content + gained[1]
        position, number = position + size, number + 1
    gained = splitter.finish()
    return reasoning + gained[0], content + gained[1]


# (state the prompt leaves, reply as written, reasoning, content)
REPLIES = [
    ("start", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "The user greets me.",
     "Hello! How can I help?"),
    ("inside", "\nOkay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.", "The answer is 4."),
    ("start", "Hello there.", None, "Hello there."),  # a thinking model may answer without a block
    ("content", "  Paris.", None, "Paris."),  # the prompt closed the block (enable_thinking false)
    ("inside", "\nI must count the letters: r, r, r and", "I must count the letters: r, r, r and", None),  # cut short
    ("start", "<think>\n\n</think>\n\n{\"a\": 1}", "", "{\"a\": 1}"),
    ("start", "<think>a < b and </thin is not the end</think>x</think>y", "a < b and </thin is not the end",
     "x</think>y"),
    ("start", "<thinking about it", None, "<thinking about it"),  # not the delimiter
    ("start", "<thi", None, "<thi"),  # the reply ended on what could have opened a block
]


@pytest.mark.parametrize("state,text,reasoning,content", REPLIES)
def test_a_reply_splits_into_its_reasoning_and_its_answer(state, text, reasoning, content):
    assert split_reply(ReplyPlan(THINK, state), text) == (reasoning, content)


@pytest.mark.parametrize("state,text,reasoning,content", REPLIES)
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [5, 7, 2], [1000]])
def test_a_stream_gives_what_the_whole_reply_gives(state, text, reasoning, content, sizes):
    assert streamed(state, text, sizes) == (reasoning or "", content or "")


def test_no_piece_of_a_delimiter_leaks_into_a_stream():
    splitter = ReasoningSplitter(THINK, "start")
    pieces = [splitter.feed(piece) for piece in ["<", "think", ">", "hmm", " ", "</", "think", ">", " ", "Yes"]]
    assert all("<" not in reasoning + content and ">" not in reasoning + content for reasoning, content in pieces)
    assert "".join(r for r, _ in pieces) == "hmm" and "".join(c for _, c in pieces) == "Yes"


def test_delimiters_are_read_from_the_template():
    assert detect_delimiters(template("qwen3.jinja")) == THINK
    assert detect_delimiters({"default": template("qwen3.jinja")}) == THINK
    for name in ("qwen2.5-instruct.jinja", "llama3.1-instruct.jinja", "mistral-7b-instruct-v0.3.jinja"):
        assert detect_delimiters(template(name)) is None
    assert detect_delimiters(None) is None


def test_where_the_prompt_leaves_the_block():
    assert prompt_state(THINK, "<|im_start|>assistant\n") == "start"  # Qwen3: the model opens it
    assert prompt_state(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"  # enable_thinking false
    assert prompt_state(THINK, "<｜Assistant｜><think>\n") == "inside"  # DeepSeek-R1's template


def test_template_variables_reach_only_a_template_that_reads_them():
    qwen3 = template("qwen3.jinja")
    assert read_template_variables({"chat_template_kwargs": {"enable_thinking": False}}, qwen3) == \
        {"enable_thinking": False}
    assert read_template_variables({}, qwen3) == {}
    effort = "{{ messages[0].content }}{% if reasoning_effort %} effort: {{ reasoning_effort }}{% endif %}"
    assert read_template_variables({"reasoning_effort": "low"}, effort) == {"reasoning_effort": "low"}
    # A template that gives the variable a default when it is not given (gpt-oss's reasoning effort, DeepSeek-V3.1's
    # thinking) reads it all the same; a name only set in a block is no variable.
    defaulted = ('{%- if not reasoning_effort is defined %}{%- set reasoning_effort = "medium" %}{%- endif %}'
                 "Reasoning: {{ reasoning_effort }}{% set on = thinking | default(false) %}"
                 "{% if on %}{% set mode = 1 %}{% endif %}{{ mode }}")
    assert read_template_variables({"reasoning_effort": "low", "chat_template_kwargs": {"thinking": True}},
                                   defaulted) == {"reasoning_effort": "low", "thinking": True}
    with pytest.raises(VariableError, match="does not read 'mode'"):
        read_template_variables({"chat_template_kwargs": {"mode": 2}}, defaulted)
    refused = [
        ({"chat_template_kwargs": {"enable_thinking": False}}, template("qwen2.5-instruct.jinja"),
         "chat_template_kwargs", "does not read 'enable_thinking'"),
        ({"chat_template_kwargs": {"thinking_budget": 10}}, qwen3, "chat_template_kwargs",
         "it reads: enable_thinking"),
        ({"chat_template_kwargs": {"messages": []}}, qwen3, "chat_template_kwargs", "set by the server"),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, effort, "chat_template_kwargs", "a field of its own"),
        ({"chat_template_kwargs": ["enable_thinking"]}, qwen3, "chat_template_kwargs", "must be an object"),
        ({"chat_template_kwargs": {"enable_thinking": "false"}}, qwen3, "chat_template_kwargs",
         'enable_thinking must be true or false, got "false"'),
        ({"reasoning_effort": "low"}, qwen3, "reasoning_effort", "does not read reasoning_effort"),
        ({"reasoning_effort": "extreme"}, effort, "reasoning_effort", "must be one of"),
    ]
    for body, text, param, message in refused:
        with pytest.raises(VariableError, match=message) as caught:
            read_template_variables(body, text)
        assert caught.value.param == param


# The published formats besides <think>: (template, variables that turn thinking on, delimiters as written)
PUBLISHED = [
    ("qwen3.jinja", {}, "<think>", "</think>"),
    ("gpt-oss.jinja", {}, "<|channel|>analysis<|message|>", "<|end|>"),
    ("gemma-4-it.jinja", {"enable_thinking": True}, "<|channel>thought", "<channel|>"),
    ("ministral-3-reasoning.jinja", {}, "[THINK]", "[/THINK]"),
    ("seed-oss.jinja", {}, "<seed:think>", "</seed:think>"),
    ("minimax-m3.jinja", {}, "<mm:think>", "</mm:think>"),
    ("hy3.jinja", {"reasoning_effort": "high"}, "<think:opensource>", "</think:opensource>"),  # names built in jinja
    ("command-r7b-tool_use.jinja", {"enable_thinking": True}, "<|START_THINKING|>", "<|END_THINKING|>"),
    ("apriel-1.6-thinker.jinja", {}, "Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"),  # plain text
]
ASKED = [{"role": "user", "content": "Hi"}]
THOUGHT, ANSWER = "The user greets me.", "Hello! How can I help?"
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY}}


def thinking_turn(name):
    """The assistant turn as the template writes a reply that thought: its reasoning field, or where the template
    writes reasoning only in a thinking chunk (Mistral) or before a tool call (Gemma 4, Command R7B), those."""
    if name == "ministral-3-reasoning.jinja":
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT},
                                                  {"type": "text", "text": ANSWER}]}
    if name in ("gemma-4-it.jinja", "command-r7b-tool_use.jinja"):
        return {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [CALL]}
    return {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}


@pytest.mark.parametrize("name,variables,opening,closing", PUBLISHED)
def test_each_published_format_splits_the_reply_its_template_writes(name, variables, opening, closing):
    """The delimiters found in the template are those it writes around a reply's reasoning, and the splitter gives
    back that reasoning from the reply as the model writes it (the template's text after the generation prompt)."""
    from rungen.chat_template import render

    text = template(name)
    delimiters = detect_delimiters(text)
    assert (delimiters.open, delimiters.close) == (opening, closing)
    turn = thinking_turn(name)
    tools = [WEATHER] if "tool_calls" in turn else None
    prompt = render(text, ASKED, tools=tools, add_generation_prompt=True, **variables)
    whole = render(text, ASKED + [turn], tools=tools, **variables)
    # Apriel's template writes the opening in the generation prompt only: the turn it renders is what follows it.
    start = len(prompt) if whole.startswith(prompt) else prompt.rindex(opening)
    assert whole.startswith(prompt[:start])
    reasoning, content = split_reply(ReplyPlan(delimiters, prompt_state(delimiters, prompt)), whole[start:])
    assert reasoning == THOUGHT
    assert THOUGHT not in content and opening not in content and closing not in content
    if ANSWER in whole:
        assert content.startswith(ANSWER)


@pytest.mark.parametrize("name,variables", [("qwen3.jinja", {"enable_thinking": False}), ("gemma-4-it.jinja", {}),
                                            ("hy3.jinja", {}), ("command-r7b-tool_use.jinja", {})])
def test_a_prompt_that_turns_thinking_off_closes_the_block(name, variables):
    from rungen.chat_template import render

    text = template(name)
    assert prompt_state(detect_delimiters(text), render(text, ASKED, add_generation_prompt=True, **variables)) == \
        "content"


def test_a_switch_that_only_asks_the_model_to_think_is_off_where_the_prompt_does_not_ask():
    """Granite 3.3's `thinking` adds instructions to think to its default system message and opens nothing: unset,
    or set where the conversation has a system message or tools (the template then writes none), its model is not
    asked to think, so a constrained reply is the answer from its first token; set and asking, the block may come
    first. Apertus's enable_thinking writes "Deliberation: enabled". Qwen3's switch, unset, leaves the choice to the
    model (its template closes the block only when the switch is off)."""
    from rungen.chat_template import render
    from rungen.reasoning import thinking_off

    def off(text, variables, messages=ASKED, tools=None):
        prompt = render(text, messages, tools=tools, add_generation_prompt=True, **variables)
        return thinking_off(text, detect_delimiters(text), variables, lambda: prompt)

    tools = [{"type": "function", "function": {"name": "f", "description": "F.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    told = [{"role": "system", "content": "Be brief."}, *ASKED]
    for name, switch in (("granite-3.3.jinja", "thinking"), ("apertus-8b-instruct.jinja", "enable_thinking")):
        assert off(template(name), {}) and not off(template(name), {switch: True}), name
        assert off(template(name), {switch: True}, told, tools) == (name == "granite-3.3.jinja"), name
    qwen3 = template("qwen3.jinja")
    assert not thinking_off(qwen3, detect_delimiters(qwen3), {})
    assert thinking_off(qwen3, detect_delimiters(qwen3), {"enable_thinking": False})


HARMONY = detect_delimiters(template("gpt-oss.jinja"))
HARMONY_REPLIES = [  # gpt-oss: the analysis channel, then the final one (or a call); or the final channel alone
    ("<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "User greets.", "Hi!"),
    ("<|channel|>final<|message|>Paris.", None, "Paris."),
    ("<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     '<|message|>{"a": 1}', "Need a tool.", '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>'
     '{"a": 1}'),  # a call: the tool's parser reads it
    ("<|channel|>final", None, ""),  # cut short inside the answer's opening: no answer, and no piece of it
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assis", "Hm.", None),
    # several analysis messages, and a preamble to the user before a call: all reasoning, the call what follows
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Sunny.", "One.\n\nTwo.", "Sunny."),
    ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
     "<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}", "Need it.\n\nChecking.",
     "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"),
]


@pytest.mark.parametrize("text,reasoning,content", HARMONY_REPLIES)
@pytest.mark.parametrize("sizes", [[1], [3, 1], [5, 7, 2], [1000]])
def test_the_answer_channel_opening_is_no_part_of_the_content(text, reasoning, content, sizes):
    assert split_reply(ReplyPlan(HARMONY, "start"), text) == (reasoning, content)
    assert streamed("start", text, sizes, HARMONY) == (reasoning or "", content or "")


def test_delimiters_that_are_special_tokens_stay_in_the_reply_text(tmp_path):
    """gpt-oss's channel tokens are special: a decode that skips special tokens would leave "analysis...assistantfinal"
    in the answer. The reply's plan keeps the delimiters' special tokens, and only those, in its text."""
    from rungen.logprobs import decode_text
    from rungen.reasoning import plan_reply
    from tiny_models import build_tokenizer

    tokenizer, _ = build_tokenizer("qwen2", str(tmp_path))
    harmony = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|constrain|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": harmony})
    special = {name: tokenizer.convert_tokens_to_ids(name) for name in harmony}
    prompt = tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", add_special_tokens=False)
    ids, plan = plan_reply(tokenizer, HARMONY, prompt, constrained=False)
    assert ids == prompt and plan.state == "start"
    assert plan.kept == {special[name] for name in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")}
    written = "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    reply = tokenizer.encode(written + "<|return|>", add_special_tokens=False)
    assert tokenizer.decode(reply, skip_special_tokens=True) == "analysisUser greets.assistantfinalHi!"
    assert decode_text(tokenizer, reply, plan.kept) == written  # <|return|> is no delimiter: skipped as before
    assert split_reply(plan, decode_text(tokenizer, reply, plan.kept)) == ("User greets.", "Hi!")
    assert decode_text(tokenizer, reply) == tokenizer.decode(reply, skip_special_tokens=True)  # nothing kept
    growing = [decode_text(tokenizer, reply[:end], plan.kept) for end in range(len(reply) + 1)]
    assert all(later.startswith(earlier) for earlier, later in zip(growing, growing[1:]))  # a stream only grows
    # A stop string is never found where it cuts into a delimiter ("final" inside the final channel's opening).
    from rungen.logprobs import first_stop

    markers = plan.delimiters.texts
    assert first_stop(written, ("final", "Hi"), markers) == (written.index("Hi"), "Hi")
    assert first_stop(written, ("final", "|"), markers) is None
    assert first_stop(written, ("final",)) == (written.index("final"), "final")  # no chat reply's markers
    assert first_stop("a final word", ("final",), markers) == (2, "final")
    assert first_stop(written, ("<|end|>",), markers) == (written.index("<|end|>"), "<|end|>")  # a whole one
    growing = written[: written.index("final") + 3]  # "...<|channel|>fin": the opening is being written
    assert first_stop(growing, ("fin",), markers) is None and first_stop(growing + "x", ("fin",), markers)


def test_a_reply_cut_inside_the_closing_delimiter_has_no_piece_of_it_in_its_reasoning():
    """Apriel 1.6's closing marker is plain text, several tokens: a reply cut (or a budget's closing cut) inside it
    gives the reasoning before it, whole and streamed alike."""
    apriel = detect_delimiters(template("apriel-1.6-thinker.jinja"))
    for text in ("Let me think.\n[BEGIN FIN", "[BEGI", "Let me think.\n["):
        expected = text[: text.rindex("[")].strip()
        assert split_reply(ReplyPlan(apriel, "inside"), text) == (expected, None)
        for sizes in ([1], [3, 1], [1000]):
            assert streamed("inside", text, sizes, apriel) == (expected, "")
