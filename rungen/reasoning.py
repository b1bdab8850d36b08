"""Thinking models' reasoning kept apart from the answer (docs/server.md#reasoning).

A template that thinks in a block (`<think>...</think>`, or one of the other published formats in FORMATS) is
recognised by the delimiters it writes, never configured. One splitter reads a whole reply and a stream alike, so both
give the same reasoning and content; a reply may start inside a block the prompt opened (plan_reply), and a block never
closed is all reasoning. Delimiters that are special tokens stay in the reply's text (ReplyPlan.kept) for the split.
`chat_template_kwargs` and `reasoning_effort` are refused where the template does not read them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

from .tool_xml import prefix_length

# What the server passes to the template itself, or the tokenizer does (its special tokens).
RESERVED_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "reasoning_effort", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# The switches thinking templates test (Qwen3's, DeepSeek-V3.1's): booleans only.
SWITCHES = ("enable_thinking", "thinking")
# Prompt tokens decoded to see how the prompt ends: a delimiter is one token or a few, or at most a token a character
# where it is plain text (Apriel's), beyond these.
TAIL_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Delimiters:
    """A thinking block's opening and closing text; `answer`: text that may open the answer after the block or in
    its place (dropped from the content); `signs`: what a template writes where it uses them (open and close);
    `reopen`: text that, where the answer would begin, opens another block."""

    open: str
    close: str
    answer: tuple[str, ...] = ()
    signs: tuple[str, ...] = ()
    reopen: tuple[str, ...] = ()  # text that, where the answer would begin, opens another block (gpt-oss's messages)

    def recognised(self, text: str) -> bool:
        return all(sign in text for sign in self.signs or (self.open, self.close))

    @property
    def texts(self) -> tuple[str, ...]:
        """All the text the reply's split reads and drops."""
        return (self.open, self.close, *self.answer, *self.reopen)


THINK = Delimiters("<think>", "</think>")
# The published formats, checked in this order (THINK last: others may hold "<think" in longer names).
FORMATS = (
    # gpt-oss (harmony): the analysis channel's message, then one in the final channel (or a tool call); a reply may
    # start in the final channel.
    Delimiters("<|channel|>analysis<|message|>", "<|end|>",
               answer=("<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>"),
               signs=("<|channel|>analysis<|message|>", "<|channel|>final<|message|>"),
               # another analysis message, or a preamble to the user before a call: reasoning too
               reopen=("<|start|>assistant<|channel|>analysis<|message|>",
                       "<|start|>assistant<|channel|>commentary<|message|>")),
    Delimiters("<|channel>thought", "<channel|>"),  # Gemma 4
    Delimiters("[THINK]", "[/THINK]"),  # Magistral, Ministral 3 Reasoning
    Delimiters("<seed:think>", "</seed:think>"),  # Seed-OSS
    Delimiters("<mm:think>", "</mm:think>"),  # MiniMax-M3
    Delimiters("<think:opensource>", "</think:opensource>"),  # Hunyuan 3 (its template builds the names)
    Delimiters("<|START_THINKING|>", "<|END_THINKING|>", answer=("<|START_RESPONSE|>",)),  # Command R7B, Command A
    Delimiters("<|inner_prefix|>", "<|inner_suffix|>"),  # Apertus
    # Apriel 1.6: its prompt opens the block in plain text; the answer follows the marker
    Delimiters("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]",
               signs=("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]")),
    THINK,
)
# A conversation whose last turn thinks, rendered to see the delimiters a template builds rather than writes.
PROBE = [{"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi.", "reasoning_content": "The user greets me."}]


def template_sources(chat_template) -> list[str]:
    """The template's text, each of them where a tokenizer holds several by name."""
    if isinstance(chat_template, dict):
        return [text for text in chat_template.values() if isinstance(text, str)]
    return [chat_template] if chat_template else []


def detect_delimiters(chat_template) -> Delimiters | None:
    """The thinking block's delimiters when the template writes or reads one, else None."""
    for text in template_sources(chat_template):
        found = delimiters_of(text)
        if found is not None:
            return found
    return None


@functools.lru_cache(maxsize=8)
def delimiters_of(template: str) -> Delimiters | None:
    """The first of FORMATS the template's text holds, or its rendering of a thinking turn."""
    from .chat_template import render

    found = next((row for row in FORMATS if row.recognised(template)), None)
    if found is None:
        try:
            rendered = render(template, PROBE)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe shows no block either
            return None
        found = next((row for row in FORMATS if row.recognised(rendered)), None)
    return found


# The template's variables


@functools.lru_cache(maxsize=8)
def variables_read(template: str) -> frozenset:
    """The names the template reads from its context: jinja2's undeclared variables less those it sets somewhere
    (jinja2 counts a name set in a block as read where the block may not have run)."""
    import jinja2
    from jinja2 import meta, nodes

    from .chat_template import environment

    try:
        tree = environment().parse(template)
    except jinja2.TemplateSyntaxError:  # a template our environment cannot parse reads nothing it could be given
        return frozenset()
    stored = {node.name for node in tree.find_all(nodes.Name) if node.ctx == "store"}
    # A name the template gives a default to when it is not given ({% if x is not defined %}{% set x = ... %},
    # x | default(...)) is read all the same.
    defaulted = {node.node.name for node in (*tree.find_all(nodes.Test), *tree.find_all(nodes.Filter))
                 if node.name in ("defined", "undefined", "default", "d") and isinstance(node.node, nodes.Name)}
    return frozenset(meta.find_undeclared_variables(tree) - (stored - defaulted))


def template_reads(chat_template, name) -> bool:
    return any(name in variables_read(text) for text in template_sources(chat_template))


def thinking_switch(chat_template) -> str | None:
    """The switch of thinking the template reads (Qwen3's enable_thinking, first where both are read; DeepSeek
    V3.1's and Granite 3.3's thinking), or None."""
    return next((name for name in SWITCHES if template_reads(chat_template, name)), None)


class VariableError(ValueError):
    """A template variable the request cannot set (HTTP 400 naming `param`)."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


def read_template_variables(body, chat_template) -> dict:
    """The template variables `chat_template_kwargs` and `reasoning_effort` give; raises VariableError."""
    variables = {}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise VariableError("chat_template_kwargs must be an object of the chat template's variables",
                                "chat_template_kwargs")
        for name, value in kwargs.items():
            if name in RESERVED_VARIABLES:
                owner = "a field of its own" if name == "reasoning_effort" else "set by the server"
                raise VariableError(f"chat_template_kwargs.{name} is {owner}", "chat_template_kwargs")
            if not template_reads(chat_template, name):
                raise VariableError(f"chat_template_kwargs.{name}: this model's chat template does not read "
                                    f"{name!r}{readable(chat_template)}", "chat_template_kwargs")
            if name in SWITCHES and not isinstance(value, bool):  # a template's `is false` never matches "false"
                raise VariableError(f"chat_template_kwargs.{name} must be true or false, got {json.dumps(value)}",
                                    "chat_template_kwargs")
            variables[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise VariableError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                "reasoning_effort")
        if not template_reads(chat_template, "reasoning_effort"):
            raise VariableError("reasoning_effort: this model's chat template does not read reasoning_effort",
                                "reasoning_effort")
        variables["reasoning_effort"] = effort
    return variables


def check_flag_variables(kwargs: dict, chat_template) -> None:
    """--chat_template_kwargs checked as a request's would be; `reasoning_effort` among them (no flag of its own)."""
    from .errors import UsageError

    if not chat_template:
        raise UsageError("--chat_template_kwargs: this tokenizer has no chat template")
    body = {"chat_template_kwargs": {name: value for name, value in kwargs.items() if name != "reasoning_effort"},
            "reasoning_effort": kwargs.get("reasoning_effort")}
    try:
        read_template_variables(body, chat_template)
    except VariableError as error:
        text = str(error)
        raise UsageError(f"--{text}" if text.startswith("chat_template_kwargs") else
                         f"--chat_template_kwargs.{text}") from None


def readable(chat_template) -> str:
    names = sorted(set().union(*(variables_read(text) for text in template_sources(chat_template)))
                   - RESERVED_VARIABLES - {"raise_exception", "strftime_now", "namespace", "dict"})
    return f" (it reads: {', '.join(names)})" if names else ""


# The reply


@dataclasses.dataclass(frozen=True)
class ReplyPlan:
    """Where a reply starts: "start" (the model may open a block), "inside" (the prompt opened it) or "content"
    (the prompt closed it: no thinking). `end_ids`: the tokens after which a constraint starts (None: from the
    first token); `closing`: the text that ends the block for the model (a budget's, a constraint's): the closing
    delimiter, and the answer's opening where there is one and no tool may be called instead."""

    delimiters: Delimiters
    state: str
    end_ids: tuple[int, ...] | None = None
    kept: frozenset = frozenset()  # the delimiters' special tokens: decoded into the reply's text, not skipped
    closing: str = ""
    # The closing where it is plain text of several tokens (Apriel's "[BEGIN FINAL RESPONSE]"): its ids vary with the
    # text before it, so the reply's text is read for it too.
    text_close: str = ""

    def splitter(self):
        return ReasoningSplitter(self.delimiters, self.state)


def prompt_state(delimiters: Delimiters, prompt_tail: str) -> str:
    """How the prompt (its last text) leaves the block: open, closed or not begun."""
    tail = prompt_tail.rstrip()
    if tail.endswith(delimiters.open):
        return "inside"
    if tail.endswith(delimiters.close):
        return "content"
    return "start"


def plan_reply(tokenizer, delimiters: Delimiters | None, ids: list[int], constrained: bool, tools=False,
               variables: dict | None = None):
    """(ids, ReplyPlan or None) of a chat prompt. A constrained reply must know where the answer starts: where the
    model may open the block itself, the prompt gets the opening delimiter and the constraint starts after the
    closing one (and the answer's opening, unless the reply may call `tools`) — unless thinking is off, the
    template's own turns closing the block with these `variables`: then the answer starts at once (a prompt that
    goes on in the model's turn after tool results, where the template wrote no opening of its own)."""
    if delimiters is None:
        return ids, None
    from .logprobs import special_ids

    kept = special_ids(tokenizer, delimiters.texts)
    tail = TAIL_TOKENS + max(len(delimiters.open), len(delimiters.close))
    state = prompt_state(delimiters, tokenizer.decode(ids[-tail:], skip_special_tokens=False))
    if constrained and state == "start" and thinking_off(tokenizer.chat_template, delimiters, variables or {},
                                                         lambda: tokenizer.decode(ids, skip_special_tokens=False)):
        state = "content"
    if constrained and state == "start":
        ids = ids + tokenizer.encode(delimiters.open, add_special_tokens=False)
        state = "inside"
    closing = delimiters.close + (delimiters.answer[0] if delimiters.answer and not tools else "")
    closing_ids = tuple(tokenizer.encode(closing, add_special_tokens=False))
    end_ids = closing_ids if constrained and state == "inside" else None
    plain = len(closing_ids) > 1 and not special_ids(tokenizer, (closing,))
    return ids, ReplyPlan(delimiters, state, end_ids, kept, closing, closing if plain else "")


def thinking_off(chat_template, delimiters: Delimiters, variables: dict, prompt=lambda: "") -> bool:
    """Whether the template, given `variables`, closes the block where it opens the model's turn (Qwen3's and Gemma
    4's with thinking off), or has a switch that asks the model to think by instructions alone which this `prompt()`
    (its text) lacks: Granite 3.3's `thinking` adds them to its default system message (none where the conversation
    has a system message or tools) and opens nothing, Apertus's enable_thinking writes "Deliberation: enabled"."""
    sources = template_sources(chat_template)
    if not sources:
        return False
    template = chat_template.get("default", sources[0]) if isinstance(chat_template, dict) else sources[0]
    given = json.dumps(variables, sort_keys=True, default=str)
    if opening_closes(template, delimiters, given):
        return True
    asked = thinking_asked(template, delimiters, given)
    return asked is not None and asked not in prompt()


@functools.lru_cache(maxsize=32)
def opening_closes(template: str, delimiters: Delimiters, variables: str) -> bool:
    from .chat_template import render

    try:
        opening = render(template, PROBE[:1], add_generation_prompt=True, **json.loads(variables))
    except Exception:  # noqa: BLE001 - a template that cannot open a turn on the probe says nothing of it
        return False
    return prompt_state(delimiters, opening) == "content"


@functools.lru_cache(maxsize=32)
def thinking_asked(template: str, delimiters: Delimiters, variables: str) -> str | None:
    """The lines a switch of thinking adds to the prompt where set, where it adds them and opens no block (a template
    that opens one when asked lets the model choose when not: MiniCPM5's, Qwen3's), else None."""
    from .chat_template import render

    given = json.loads(variables)
    for switch in (name for name in SWITCHES if name in variables_read(template)):
        unset = {name: value for name, value in given.items() if name != switch}
        try:
            on = render(template, PROBE[:1], add_generation_prompt=True, **unset, **{switch: True})
            off = render(template, PROBE[:1], add_generation_prompt=True, **unset)
        except Exception:  # noqa: BLE001 - a template that cannot open a turn on the probe says nothing of it
            return None
        if on != off and prompt_state(delimiters, on) == "start":
            return added_text(on, off)
    return None


def added_text(on: str, off: str) -> str:
    """What `on` holds where `off` differs, widened to a line or a marker's end on either side (Apertus's "enabled"
    for "disabled" is its line, "Deliberation: enabled")."""
    import os

    start = len(os.path.commonprefix([on, off]))
    end = len(on) - min(len(os.path.commonprefix([on[::-1], off[::-1]])), len(on) - start, len(off) - start)
    if not (on[start : start + 1] == "\n" or on[start - 1 : start] in ("", "\n", ">")):
        start = max(on.rfind("\n", 0, start), on.rfind(">", 0, start)) + 1
    if not (on[end - 1 : end] == "\n" or on[end : end + 1] in ("", "\n", "<")):
        stops = [index for index in (on.find("\n", end), on.find("<", end)) if index != -1]
        end = min(stops, default=len(on))
    return on[start:end]


def plan_prompt(loaded, settings, prompt, variables: dict | None = None) -> None:
    """plan_reply for an encoded command-line or session prompt: sets prompt.reply where its template thinks. A
    run's constraint applies from the first token (generate() too); a jsonl line's tools wait for the block's end."""
    if not (settings.chat or prompt.messages is not None) or settings.constraint is not None:
        return
    delimiters = detect_delimiters(loaded.tokenizer.chat_template)
    tools = prompt.tool_plan is not None and prompt.tool_plan.fmt is not None
    prompt.ids, prompt.reply = plan_reply(loaded.tokenizer, delimiters, prompt.ids, prompt.constraint is not None,
                                          tools, variables)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A cap on a reply's thinking: once the block holds `tokens` tokens, the tokens of `forced_ids` (the plan's
    closing, else the closing delimiter's) are chosen for the model (vLLM's thinking_token_budget); a block the model
    closes itself (`close_ids`) is left alone. `inside`: the prompt opened the block; else the model may."""

    tokens: int
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    inside: bool
    forced_ids: tuple[int, ...] = ()
    # A constrained reply's: where the model closes the block itself, the rest of forced_ids is chosen for it too
    # (gpt-oss's final channel after its <|end|>), since the constraint starts after all of them.
    completes: bool = False


def reply_budget(tokenizer, plan: ReplyPlan | None, tokens: int | None) -> Budget | None:
    """The Budget of a reply: its cap, or for a constrained reply whose closing goes on past the delimiter, none but
    that closing's completion (None: neither, or the prompt closed the block)."""
    if plan is None or plan.state == "content":
        return None
    completes = plan.end_ids is not None and plan.closing != plan.delimiters.close
    if tokens is None and not completes:
        return None
    open_ids, close_ids, forced_ids = (tuple(tokenizer.encode(text, add_special_tokens=False))
                                       for text in (plan.delimiters.open, plan.delimiters.close, plan.closing))
    return Budget(tokens if tokens is not None else sys.maxsize, open_ids, close_ids, plan.state == "inside",
                  forced_ids, completes)


class BudgetCount:
    """A row's thinking against its Budget, token by token: forced() is the token its next step must be (the
    closing delimiter's, once the block used the budget), seen() takes each token chosen. `state`: "start" (the
    block may open), "inside", "closing" (delimiter tokens being forced) or "done" (closed, or never opened)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.state = "inside" if budget.inside else "start"
        self.used = 0  # tokens in the block so far
        self.tail = []  # the last tokens: an opening delimiter's start, or a closing one's
        self.closing = []  # the closing delimiter's tokens still to force
        self.rest = None  # where the text ends in a plain-text closing's start: the tokens of the rest of it

    def forced(self) -> int | None:
        if self.state == "inside" and self.used >= self.budget.tokens:
            self.state, self.closing = "closing", list(self.rest or self.budget.forced_ids or self.budget.close_ids)
        return self.closing.pop(0) if self.state == "closing" and self.closing else None

    def seen(self, token: int) -> None:
        budget = self.budget
        if self.state == "start":
            self.tail.append(token)
            if tuple(self.tail) != budget.open_ids[: len(self.tail)]:
                self.state = "done"  # the reply answers without a block
            elif len(self.tail) == len(budget.open_ids):
                self.state, self.tail = "inside", []
        elif self.state == "inside":
            self.tail = (self.tail + [token])[-len(budget.close_ids) :]
            self.used += 1
            if tuple(self.tail) == budget.close_ids:  # the model closed it within the budget
                rest = list(budget.forced_ids[len(budget.close_ids) :])
                if budget.completes and budget.forced_ids[: len(budget.close_ids)] == budget.close_ids and rest:
                    self.state, self.closing = "closing", rest
                else:
                    self.state = "done"
        elif self.state == "closing" and not self.closing:
            self.state = "done"

    def near(self) -> bool:
        """Whether the next token may use up the budget, or a forced one is due: the step after it must see it."""
        return self.state == "closing" or self.state == "inside" and self.used + 1 >= self.budget.tokens


class ReasoningSplitter:
    """Splits a growing reply into reasoning and content: feed() and finish() return the text each gains (both
    stripped of the whitespace around the block); `had_block`: whether the reply has a block at all."""

    def __init__(self, delimiters: Delimiters, state: str = "start"):
        self.delimiters, self.state = delimiters, state
        self.pending = ""  # text not yet given to either
        self.had_block = state == "inside"
        self.closed = False
        self.reasoning_begun = self.content_begun = False
        self.answered = False  # whether the text that may open the answer (Delimiters.answer) was looked for
        self.space = ""  # whitespace at the reasoning's end, dropped if the block ends there

    def feed(self, text, final=False):
        self.pending += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                rest = self.pending.lstrip()
                if rest.startswith(self.delimiters.open):
                    self.state, self.had_block = "inside", True
                    self.pending = rest[len(self.delimiters.open) :]
                    continue
                if not final and self.delimiters.open.startswith(rest):
                    break  # may still open the block
                self.state = "content"
                continue
            if self.state == "inside":
                end = self.pending.find(self.delimiters.close)
                if end != -1:
                    reasoning += self.reason(self.pending[:end], last=True)
                    self.pending = self.pending[end + len(self.delimiters.close) :]
                    self.state, self.closed = "content", True
                    continue
                # the closing delimiter's start held back: at the end, the reply was cut inside it (no piece of a
                # delimiter is reasoning; a plain-text one, Apriel's, takes several tokens)
                hold = prefix_length(self.pending, (self.delimiters.close,))
                reasoning += self.reason(self.pending[: len(self.pending) - hold], last=final)
                self.pending = "" if final else self.pending[len(self.pending) - hold :]
                break
            openings = self.delimiters.answer + self.delimiters.reopen
            if not self.content_begun and openings and not self.answered:
                rest = self.pending.lstrip()
                marker = next((marker for marker in openings if rest.startswith(marker)), None)
                if marker is None and any(marker.startswith(rest) for marker in openings):
                    if not final:
                        break  # may still be the answer's opening
                    rest, self.pending = "", ""  # the reply ended inside the answer's opening: no answer
                if marker in self.delimiters.reopen:  # another block: its reasoning after the last one's
                    self.state, self.pending = "inside", rest[len(marker) :]
                    self.space = "\n\n" if self.reasoning_begun else ""
                    continue
                self.answered, self.pending = True, rest[len(marker) :] if marker else self.pending
            text, self.pending = self.pending, ""
            if not self.content_begun:
                text = text.lstrip()
                self.content_begun = bool(text)
            content += text
            break
        return reasoning, content

    def reason(self, text, last):
        if not self.reasoning_begun:
            text = text.lstrip()
            self.reasoning_begun = bool(text)
        text, self.space = self.space + text, ""
        kept = text.rstrip()
        if not last:
            self.space = text[len(kept) :]
        return kept

    def finish(self):
        return self.feed("", final=True)


def split_reply(plan: ReplyPlan, text: str):
    """(reasoning or None, content or None) of a whole reply: reasoning None without a block, content None when
    the block is all there is."""
    splitter = plan.splitter()
    reasoning, content = splitter.feed(text)
    more = splitter.finish()
    reasoning, content = reasoning + more[0], content + more[1]
    if not splitter.had_block:
        return None, content
    return reasoning, content or None
