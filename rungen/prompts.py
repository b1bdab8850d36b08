"""Prompts: reading them (argument, stdin lines, JSON lines), the original script's per-model preparation,
and encoding to token ids."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from . import NOTICE, logger, strict_json
from .conversation import MessageError, read_conversation
from .errors import PromptError, UsageError

if TYPE_CHECKING:
    from .loading import Loaded

# Padding text to help Transformer-XL and XLNet with short prompts as proposed by Aman Rusia
# in https://github.com/rusiaaman/XLNet-gen#methodology
# and https://medium.com/@amanrusia/xlnet-speaks-comparison-to-gpt-2-ea1a4e9ba39e
PREFIX = """In 1991, the remains of Russian Tsar Nicholas II and his family
(except for Alexei and Maria) are discovered.
The voice of Nicholas's young son, Tsarevich Alexei Nikolaevich, narrates the
remainder of the story. 1883 Western Siberia,
a young Grigori Rasputin is asked by his father and a group of men to perform magic.
Rasputin has a vision and denounces one of the men as a horse thief. Although his
father initially slaps him for making such an accusation, Rasputin watches as the
man is chased outside and beaten. Twenty years later, Rasputin sees a vision of
the Virgin Mary, prompting him to become a priest. Rasputin quickly becomes famous,
with people, even a bishop, begging for his blessing. <eod> </s> <eos>"""


TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# An OpenAI request's settings: in a jsonl line they would be taken for settings and do nothing.
SETTING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "stop",
                  "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias", "response_format", "stream", "stream_options", "chat_template_kwargs",
                  "reasoning_effort", *TOOL_FIELDS}
# What an output record holds besides the input line's other fields (rungen/output.py, generation.Sequence).
RECORD_FIELDS = {"prompt_index", "sequence_index", "generated_text", "text", "num_prompt_tokens",
                 "num_generated_tokens", "finish_reason", "logprobs", "prompt_logprobs", "perplexity", "error",
                 "content", "tool_calls", "reasoning_content"}


@dataclasses.dataclass
class Prompt:
    """One input, in input order: `error` when it cannot be generated, `ids` once encoded; a conversation has
    `messages` and `text` is its last user message."""

    index: int
    text: str | None
    extra: dict = dataclasses.field(default_factory=dict)  # other jsonl fields, carried to the output
    error: str | None = None
    ids: list[int] | None = None
    messages: list[dict] | None = None
    # A jsonl line's tools, tool_choice, parallel_tool_calls ({}: calls but no tools).
    tools: dict | None = None
    tool_plan: object = None  # rungen.tools.ToolPlan, once encoded
    constraint: object = None  # the grammar of its tool calls, compiled
    reply: object = None  # rungen.reasoning.ReplyPlan of a chat prompt whose template thinks


# Reading


def read_prompts(prompt: str | None, *, whole_stdin: bool = False, input_format: str = "text") -> list[Prompt]:
    """The prompts, in input order: `prompt` when given, else stdin's lines (all of it as one with
    `whole_stdin`; JSON objects with `input_format` "jsonl")."""
    if prompt is not None:
        return [Prompt(0, prompt)]
    if sys.stdin is None:
        raise UsageError("no prompt: pass --prompt, or pipe prompts through stdin")
    data = sys.stdin.buffer.read().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Windows files)
    if whole_stdin:  # one prompt, line breaks as text read in Python takes them (a Windows file's too)
        lines = [data.replace(b"\r\n", b"\n")] if data.strip() else []
    else:
        lines = [line.rstrip(b"\r") for line in data.split(b"\n") if line.strip()]
    return [parse_prompt_line(index, line, input_format) for index, line in enumerate(lines)]


def parse_prompt_line(index: int, line: bytes, input_format: str) -> Prompt:
    """A Prompt from one line of bytes; a line that cannot be read becomes a Prompt with an error."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return Prompt(index, None, error=f"input is not valid UTF-8 ({error.reason} at byte {error.start})")
    if input_format == "text":
        return Prompt(index, text)
    try:
        record = strict_json.loads(text)
    except strict_json.JSONError as error:
        return Prompt(index, None, error=f"input: {error.message}")
    if isinstance(record, dict) and "messages" in record and "prompt" not in record:
        messages = record.pop("messages")
        tools = {key: record.pop(key) for key in TOOL_FIELDS if key in record}
        try:
            conversation = read_conversation(messages)
        except MessageError as error:
            return Prompt(index, None, extra=record, error=f'"messages": {error}')
        with_tools = bool(tools) or any(message["role"] == "tool" or "tool_calls" in message
                                        for message in conversation)
        last_user = [message["content"] for message in conversation if message["role"] == "user"][-1:]
        problem = carried_fields_problem(record)
        if problem:
            return Prompt(index, "".join(last_user), extra=record, error=problem)
        return Prompt(index, "".join(last_user), extra=dict(record, messages=messages), messages=conversation,
                      tools=tools if with_tools else None)
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        return Prompt(index, None, error='a jsonl input line must be an object with a string "prompt" field '
                      'or a "messages" list')
    problem = carried_fields_problem(record)
    if problem:
        return Prompt(index, record.pop("prompt"), extra=record, error=problem)
    text = record.pop("prompt")
    return Prompt(index, text, extra=record)


def carried_fields_problem(record: dict) -> str | None:
    """A carried field named as one of the output record's own would overwrite it (or be lost); one named as a
    request setting would be taken for one and do nothing (the flags set a run's settings)."""
    taken = sorted(RECORD_FIELDS.intersection(record))
    if taken:
        return f'the field "{taken[0]}" is one the output record writes; rename it'
    settings = sorted(SETTING_FIELDS.intersection(record))
    if settings:
        flags = "--chat_template_kwargs" if settings[0] in ("chat_template_kwargs", "reasoning_effort") else \
            "--temperature, --length..."
        return (f'the field "{settings[0]}" is a request setting, which a jsonl line does not set: the flags set '
                f'them for every line ({flags})' if settings[0] not in TOOL_FIELDS else
                f'the field "{settings[0]}" goes with a "messages" conversation, not a "prompt"')
    return None


# The original script's per-model preparation


# The types the original script prepared by hand, encoding them without the tokenizer's special tokens.
HAND_PREPARED_TYPES = ("ctrl", "xlm", "xlnet")


def warn_without_control_code(tokenizer, text: str, index: int) -> None:
    """CTRL generates well only from a control code (Links, Books, ...) at the start."""
    encoded_prompt = tokenizer.encode(text, add_special_tokens=False)
    if not any(encoded_prompt[:1] == [x] for x in tokenizer.control_codes.values()):
        logger.warning("WARNING! You are not starting your generation from a control code so you won't get good "
                       "results%s", f" (prompt {index + 1})" if index else "")


def prepare_xlnet_input(text: str, prefix: str) -> str:
    """XLNet's prompt behind a padding text (--prefix, or the original script's PREFIX)."""
    return (prefix or PREFIX) + text


def select_xlm_language(model, language: str) -> None:
    """XLM models with language embeddings generate in one language, chosen once per run."""
    if not (getattr(model.config, "lang2id", None) and getattr(model.config, "use_lang_emb", False)):
        if language:  # xlm-mlm-17/100's layout: no language embedding for it to choose
            raise UsageError("--xlm_language: this XLM model has no language embeddings to choose from")
        return
    available_languages = list(model.config.lang2id)
    if language not in available_languages:
        if language or sys.stdin is None or not sys.stdin.isatty():
            raise UsageError(f"--xlm_language must be one of {available_languages}")
        while language not in available_languages:  # the question on stderr: stdout holds generated text only
            print(f"Using XLM. Select language in {available_languages} >>> ", end="", file=sys.stderr, flush=True)
            language = input()
    model.config.lang_id = model.config.lang2id[language]


def prepare_model(loaded: Loaded, *, temperature: float, xlm_language: str = "") -> None:
    """What the original script asked or said once per run, before any prompt is encoded."""
    if loaded.model_type == "ctrl" and temperature > 0.7:
        logger.log(NOTICE, "CTRL typically works better with lower temperatures (and lower top_k).")
    if loaded.model_type == "xlm":
        select_xlm_language(loaded.model, xlm_language)
    elif xlm_language:
        raise UsageError(f"--xlm_language chooses an XLM model's language; this model is {loaded.model_type}")


# Encoding


def encode_prompt(loaded: Loaded, prompt: Prompt, prefix: str = "", chat: bool = False,
                  system: str | None = None, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None, *, add_generation_prompt: bool = True,
                  add_special_tokens: bool | None = None, within_context: bool = True) -> list[int]:
    """Token ids for one Prompt, with the original script's per-model preparation; raises PromptError.

    A conversation, or with `chat` the text as one user message, goes through the chat template (with `system`
    first unless it has one, `tools` and `template_kwargs`); --prefix applies to text prompts only.
    `add_special_tokens` None: as the model takes them (none after a template, which holds its own);
    `within_context`: refuse a prompt that leaves the model no room to generate."""
    tokenizer, model = loaded.tokenizer, loaded.model
    messages = prompt.messages
    if messages is not None and prompt.tools is not None and tools is None:
        from .tools import ToolError, plan_tools

        try:
            prompt.tool_plan = plan_tools(prompt.tools or {}, messages, tokenizer.chat_template)
        except ToolError as error:  # named once: "tools": ..., not "tools": tools: ...
            text = str(error).removeprefix(f"{error.param}: ")
            raise PromptError(f'"{error.param}": {text}') from error
        messages, tools = prompt.tool_plan.messages, prompt.tool_plan.template_tools
    if messages is None and chat:
        messages = [{"role": "user", "content": prefix + prompt.text}]
    if messages is not None:
        if not tokenizer.chat_template:
            raise PromptError(("--chat: " if prompt.messages is None else "") + "this tokenizer has no chat template")
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        import jinja2

        extra = {**(template_kwargs or {}), **(template_tools(tokenizer.chat_template, tools) if tools is not None
                                                 else {})}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra)
        except jinja2.exceptions.SecurityError:
            # transformers' sandbox refuses a template that changes a list it made (Kimi K2's later ones): the tool's
            # renders it, with what transformers passes (rungen/chat_template.py)
            text = render_as_transformers(tokenizer, messages, add_generation_prompt, extra)
        except jinja2.TemplateError as error:  # the template's raise_exception: a conversation it refuses
            raise PromptError(f"the chat template refused the conversation: {error}") from error
        if add_generation_prompt:
            from .tool_formats import open_turn

            text = open_turn(tokenizer.chat_template, text, template_kwargs)
        special = bool(add_special_tokens)  # the template already holds them
    else:
        text = prompt.text
        text = prepare_xlnet_input(text, prefix) if loaded.model_type == "xlnet" else prefix + text
        if loaded.model_type == "ctrl":
            warn_without_control_code(tokenizer, text, prompt.index)
        # Llama's and OPT's BOS, but not XLNet's and XLM's, which go at the end where nothing could follow.
        special = loaded.model_type not in HAND_PREPARED_TYPES if add_special_tokens is None else add_special_tokens
    ids = tokenizer.encode(text, add_special_tokens=special)
    if not ids and add_special_tokens is not False:  # asked for no special tokens, nothing is what the text is
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
        if start is None:
            raise PromptError("empty prompt, and the model has no BOS token to start from")
        ids = [start]
    outside = [token for token in ids if token >= loaded.vocab_size]
    if outside:  # a tokenizer from another checkpoint: the embedding lookup would fail with an IndexError
        raise PromptError(
            f"token {tokenizer.convert_ids_to_tokens(outside[0])!r} (id {outside[0]}) is outside the model's "
            f"vocabulary of {loaded.vocab_size}: the tokenizer does not match the model"
        )
    if within_context and loaded.context and len(ids) >= loaded.context:
        raise PromptError(f"prompt is {len(ids)} tokens; the model's context is {loaded.context}")
    return ids


def render_as_transformers(tokenizer, messages, add_generation_prompt: bool, extra: dict) -> str:
    """A transformers tokenizer's chat template rendered in the tool's environment: the template transformers picks
    by name, the messages' None fields left out and the tokenizer's special tokens given, as transformers does."""
    import jinja2

    from .chat_template import render

    template = tokenizer.get_chat_template(None, extra.get("tools"))
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    try:
        return render(template, chat, add_generation_prompt=add_generation_prompt,
                      **{**tokenizer.special_tokens_map, **extra})
    except jinja2.TemplateError as error:
        raise PromptError(f"the chat template refused the conversation: {error}") from error


def template_tools(chat_template, tools: list[dict]) -> dict:
    """The tools as the template reads them: `tools`, or where it reads only `xml_tools` (SmolLM3's), the functions
    there, as its model card passes them."""
    from .reasoning import template_reads

    if template_reads(chat_template, "xml_tools") and not template_reads(chat_template, "tools"):
        return {"xml_tools": [tool["function"] for tool in tools]}
    return {"tools": tools}


def warn_short_room(loaded: Loaded, prompt: Prompt, length: int) -> None:
    """A notice where the context leaves a prompt less room than --length asks for (it then ends at the context,
    finish_reason length): the original script's clamp, said rather than silent."""
    room = loaded.context - len(prompt.ids)
    if loaded.context and 0 < length and room < length:  # a context not known (0) says nothing; -1 asks for all
        logger.warning("prompt %d: its %d tokens leave room for %d of the %d new tokens --length asks for (the "
                       "model's context is %d)", prompt.index + 1, len(prompt.ids), room, length, loaded.context)
