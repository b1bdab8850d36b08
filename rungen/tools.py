"""Tool calling (OpenAI's `tools` API) in the model's own format (rungen/tool_formats.py): reading the request's
tools, rendering the conversation for the template, constraining the calls; rungen/tool_reply.py reads the reply.

Markers that are special tokens (Mistral's, Gemma's) stay in the reply's text, and the grammar takes them as the text
they name. A per-request grammar constrains the calls (at most one whitespace character at a time in the arguments,
so a small model cannot pad them to max_tokens): calls only for `required` or a named function; for `auto`, free text
until the call's opening marker.
"""


from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re

from . import tool_python
from .tool_formats import GRAMMAR_STYLES, KIMI, Format, detect_format, template_text
from .tool_reply import CallParser, message_of
from .tool_schema import arguments_grammar, python_name

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A tools field, tool message or tool choice that cannot be honoured (HTTP 400 naming `param`)."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


# The request


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The request's tools (OpenAI's shape, parameters filled in), tool choice and parallel_tool_calls."""

    tools: tuple
    choice: str
    parallel: bool

    def names(self):
        return [tool["function"]["name"] for tool in self.tools]


def read_tool_request(body) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls from a chat request body, checked; None without tools."""
    tools = body.get("tools")
    if tools is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise ToolError(f"{name} needs tools", name)
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    checked, names = [], set()
    for number, tool in enumerate(tools):
        where = f"tools[{number}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ToolError(f"{where}: only function tools are supported, got type {kind!r}", "tools")
        extra = sorted(key for key in tool if key not in ("type", "function"))
        if extra:
            raise ToolError(f"{where}.{extra[0]} is not supported by this server", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function must be an object", "tools")
        extra = sorted(key for key in function if key not in FUNCTION_KEYS and function[key] is not None)
        if extra:
            raise ToolError(f"{where}.function.{extra[0]} is not supported by this server", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {json.dumps(name)}",
                            "tools")
        if name in names:
            raise ToolError(f"{where}: two tools are named {name!r}", "tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", "tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        check_schema(parameters, f"{where}.function.parameters")
        clean = {"name": name}
        if function.get("description") is not None:
            clean["description"] = function["description"]
        clean["parameters"] = parameters
        checked.append({"type": "function", "function": clean})
    return ToolRequest(tuple(checked), read_choice(body.get("tool_choice"), names),
                       read_parallel(body.get("parallel_tool_calls")))


def check_schema(schema, where):
    """A function's parameters: a valid JSON schema (Draft 2020-12) describing an object."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema object", "tools")
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where} must describe an object (type \"object\"), got type {json.dumps(schema['type'])}",
                        "tools")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "".join(f"[{json.dumps(part)}]" for part in error.absolute_path)
        raise ToolError(f"{where}{path} is not a valid JSON schema: {error.message}", "tools") from error
    remote = next(remote_refs(schema), None)
    if remote is not None:  # xgrammar would warn and constrain nothing there
        raise ToolError(f"{where}: $ref {remote!r} points outside the schema; only local refs (#/...) are "
                        "supported", "tools")


def remote_refs(value):
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            yield ref
        for item in value.values():
            yield from remote_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from remote_refs(item)


def read_choice(choice, names):
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "function"}:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or set(function) - {"name"}:
            raise ToolError('tool_choice.function must be {"name": ...}', "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(sorted(names))})",
                            "tool_choice")
        return name
    raise ToolError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                    '{"name": ...}}', "tool_choice")


def read_parallel(value):
    if value is None:
        return True  # OpenAI's default
    if not isinstance(value, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {json.dumps(value)}", "parallel_tool_calls")
    return value


# The conversation


def check_answers(messages) -> dict[str, str]:
    """Each assistant turn's tool calls answered by the tool messages right after it, each once (as OpenAI and
    Anthropic require): a result without its call, or a call without its result, is a conversation the model
    never had. Raises ToolError; returns the calls' names by id."""
    waiting, names, asked_at = {}, {}, None
    for number, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if call_id not in waiting:
                again = " again" if call_id in names else ""
                raise ToolError(f"messages[{number}]: tool_call_id {call_id!r} answers no tool call{again} of the "
                                "assistant message before it", "messages")
            del waiting[call_id]
            continue
        if waiting:
            raise ToolError(f"messages[{asked_at}].tool_calls: {', '.join(map(repr, waiting))} answered by no tool "
                            f"message before messages[{number}]", "messages")
        for call in message.get("tool_calls") or []:
            if call["id"] in names:
                raise ToolError(f"messages[{number}].tool_calls: the id {call['id']!r} is used twice", "messages")
            names[call["id"]] = waiting[call["id"]] = call["name"]
        asked_at = number
    if waiting:
        raise ToolError(f"messages[{asked_at}].tool_calls: {', '.join(map(repr, waiting))} answered by no tool "
                        "message (the conversation ends first)", "messages")
    return names


def template_messages(messages, fmt: Format, request: ToolRequest | None, calls_as_text: bool = False,
                      describe: bool = False):
    """The conversation as the chat template takes it, calls and results in the format's shape (the generic format
    describes the tools in the system message); every call answered (check_answers). `calls_as_text`: the template
    renders no tool_calls (SmolLM3's, LFM2's), so an assistant turn's calls are its text, as the model wrote them.
    `describe`: the template writes no tools, so the format's instructions describe them (DeepSeek's)."""
    calls = check_answers(messages)  # id -> name
    ids = template_ids(fmt, messages)
    out = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = calls[message["tool_call_id"]]
            if fmt.native:
                out.append({"role": "tool", "content": message["content"], "name": name,
                            "tool_call_id": ids[message["tool_call_id"]]})
            else:
                result = json.dumps({"tool_response": {"name": name, "content": message["content"]}})
                if out and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
        elif message.get("tool_calls"):
            if fmt.native and not (calls_as_text and (fmt.style == "json" or fmt.keywords) and not fmt.call_id):
                out.append({"role": "assistant", "content": message.get("content") or "",
                            "tool_calls": [{"id": ids[call["id"]], "type": "function",
                                            "function": {"name": call["name"], "arguments": call["arguments"]}}
                                           for call in message["tool_calls"]]})
            else:
                written = calls_text(fmt, message["tool_calls"])
                out.append({"role": "assistant",
                            "content": message["content"] + fmt.after_text + written if message.get("content")
                            else written})
        else:
            out.append({"role": role, "content": message["content"] if message["content"] is not None else ""})
        if role == "assistant" and message.get("reasoning_content") is not None:
            out[-1]["reasoning_content"] = message["reasoning_content"]  # for the templates that read it back
    for message in out:
        message.pop("tool_results", None)
    if not fmt.native and request is not None and request.choice != "none":
        described = generic_instructions(request)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    elif describe and request is not None and request.choice != "none":
        # after the system prompt, as DeepSeek's cards lay it out ("{system prompt}\n\n{tools}"); R1's template
        # keeps the last system message alone
        described = "\n\n" + INSTRUCTIONS[fmt.instructions](request)
        last = max((number for number, message in enumerate(out) if message["role"] == "system"), default=None)
        if last is None:
            out.insert(0, {"role": "system", "content": described})
        else:
            out[last] = {"role": "system", "content": out[last]["content"] + described}
    return out


def calls_text(fmt: Format, calls) -> str:
    """An assistant turn's calls as the model writes them, in a format whose arguments are JSON (or Python keywords
    of JSON values)."""
    def arguments(values):
        if not fmt.keywords:
            return json.dumps(values, ensure_ascii=False)
        named = next((key for key in values if not python_name(key)), None)
        if named is not None:
            raise ToolError(f"messages: a call's argument {named!r} is no Python identifier, which this model's calls "
                            "name arguments by", "messages")
        value_text = tool_python.python_text if fmt.style == "python_literal" else \
            functools.partial(json.dumps, ensure_ascii=False)
        return ", ".join(f"{key}={value_text(value)}" for key, value in values.items())

    written = fmt.separator.join(fmt.begin + call["name"] + fmt.middle + arguments(call["arguments"]) + fmt.end
                                 for call in calls)
    return fmt.region[0] + written + fmt.region[1] if fmt.region else written


def template_ids(fmt, messages) -> dict[str, str]:
    """Each call's id as the template takes it, alike for call and result: Mistral's templates take 9-character
    alphanumeric ids only; Kimi's model knows a call as `functions.name:index` (Kimi K2's first template writes a
    result's id as given, and numbers the calls of a turn from 0)."""
    ids = {}
    for message in messages:
        for index, call in enumerate(message.get("tool_calls") or []):
            call_id = call["id"]
            if fmt is KIMI:
                ids[call_id] = f"functions.{call['name']}:{index}"
            elif fmt.trigger == "[TOOL_CALLS]" and not (len(call_id) == 9 and call_id.isalnum()):
                ids[call_id] = hashlib.sha256(call_id.encode()).hexdigest()[:9]
            else:
                ids[call_id] = call_id
    return ids


def generic_instructions(request: ToolRequest) -> str:
    described = "\n".join(json.dumps(tool["function"]) for tool in request.tools)
    several = "one JSON object per call, each on its own line" if request.parallel else "one JSON object"
    return ("You can call the following tools, each given with its name, what it does and a JSON schema of its "
            f"arguments:\n{described}\n\nTo call a tool, answer with {several}, and nothing else:\n"
            '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}\n'
            'A tool\'s result comes back as {"tool_response": {"name": <tool name>, "content": <result>}}.')


def deepseek_v3_1_instructions(request: ToolRequest) -> str:
    """The tools as DeepSeek-V3.1's model card writes them into the system prompt, word for word."""
    described = "".join(f"### {function['name']}\nDescription: {function.get('description', '')}\n\nParameters: "
                        f"{json.dumps(function['parameters'], ensure_ascii=False)}\n\n"
                        for function in (tool["function"] for tool in request.tools))
    return ("## Tools\nYou have access to the following tools:\n\n" + described +
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
            "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>"
            "\n\nWhere:\n- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces")


def deepseek_r1_instructions(request: ToolRequest) -> str:
    """The functions as DeepSeek V3's function-calling example lists them, then the call's syntax (R1's distills
    were not trained on calls: an example is all they have, as llama.cpp's R1 template gives them)."""
    listed = "\n".join(f"- `{tool['function']['name']}`:\n```json\n"
                       f"{json.dumps(tool['function'], indent=4, ensure_ascii=False)}\n```" for tool in request.tools)
    several = ("\nFor several calls, write each <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> on a line of its own "
               "before <｜tool▁calls▁end｜>." if request.parallel else "")
    return ("## Tools\n\n### Function\n\nYou have the following functions available:\n\n" + listed +
            "\n\nTo call a function, answer with:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "function_name\n```json\n{arguments}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + several)


INSTRUCTIONS = {"deepseek_v3_1": deepseek_v3_1_instructions, "deepseek_r1": deepseek_r1_instructions}


# The constraint


def tool_grammar(fmt: Format, request: ToolRequest, reply_schema: str | None = None) -> str | None:
    """The EBNF grammar (xgrammar's dialect) a reply must follow, or None for tool_choice none. `reply_schema`:
    the response format's JSON schema, which a reply under tool_choice auto follows where it calls no tool."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        GrammarFormat,
        JSONSchemaFormat,
        OrFormat,
        RegexFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    from .constrain import json_string_characters

    if request.choice == "none":
        return None
    tools = [tool for tool in request.tools if request.choice in ("auto", "required", tool["function"]["name"])]
    tags = []
    for tool in tools:
        function = tool["function"]
        try:
            xgr.Grammar.from_json_schema(json.dumps(function["parameters"]))
        except (RuntimeError, ValueError, TypeError) as error:
            message = re.sub(r"^\[[0-9:]+\] \S+: ", "", str(error).splitlines()[0] if str(error) else "")
            raise ToolError(f"tools: the parameters of {function['name']!r} cannot be compiled: {message}",
                            "tools") from error
        if fmt.style == "gemma" or fmt.keywords:
            try:
                arguments = GrammarFormat(grammar=arguments_grammar(function["parameters"], fmt.style))
            except ValueError as error:
                raise ToolError(f"tools: the parameters of {function['name']!r} cannot be compiled: {error}",
                                "tools") from error
        else:
            arguments = JSONSchemaFormat(json_schema=function["parameters"],
                                         style=GRAMMAR_STYLES.get(fmt.style, fmt.style), max_whitespace_cnt=1)
        if fmt.id_first:  # the model's id, then the name: one begin for every tool, the name in the content
            tags.append(TagFormat(begin=fmt.begin, end=fmt.end, content=SequenceFormat(elements=[
                RegexFormat(pattern=fmt.call_id[0]), ConstStringFormat(value=fmt.call_id[1] + function["name"] +
                                                                       fmt.middle), arguments])))
            continue
        if fmt.call_id:  # the model's own id, then the arguments
            arguments = SequenceFormat(elements=[RegexFormat(pattern=fmt.call_id[0]),
                                                 ConstStringFormat(value=fmt.call_id[1]), arguments])
        for begin, middle in ((fmt.begin, fmt.middle), *([fmt.alternate] if fmt.alternate else [])):
            tags.append(TagFormat(begin=begin + function["name"] + middle, content=arguments, end=fmt.end))
    single = fmt.one_call or not request.parallel or request.choice not in ("auto", "required")
    calls = TagsWithSeparatorFormat(tags=tags, separator=fmt.separator, at_least_one=True,
                                    stop_after_first=single)
    if fmt.region is not None:
        calls = TagFormat(begin=fmt.region[0], content=calls, end=fmt.region[1])
    if request.choice == "auto" and reply_schema is not None:  # the calls, or the answer in its format
        answer = xgr.Grammar.from_json_schema(reply_schema, any_whitespace=False)  # as without tools: compact
        structure = OrFormat(elements=[calls, GrammarFormat(grammar=json_string_characters(str(answer)))])
    elif request.choice == "auto":
        if fmt.region is not None:
            structure = TriggeredTagsFormat(triggers=[fmt.trigger], tags=[calls], stop_after_first=True)
        else:
            triggers = [fmt.trigger, *([fmt.alternate[0]] if fmt.alternate else [])]
            structure = TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=single)
    else:
        structure = calls
    grammar = xgr.Grammar.from_structural_tag(StructuralTag(format=structure).model_dump_json())
    return json_string_characters(str(grammar))


@dataclasses.dataclass
class ToolPlan:
    """A chat request's tools applied: the template's conversation and tools, the reply's grammar and the format
    its calls are parsed in (None: unconstrained / not parsed)."""

    messages: list
    template_tools: list | None = None
    grammar: str | None = None
    fmt: Format | None = None
    calls_only: bool = False  # tool_choice required or named
    holds_format: bool = False  # the grammar holds the response format (an answer that calls no tool follows it)
    schemas: dict | None = None  # {tool name: parameters}

    def parser(self):
        return CallParser(self.fmt, self.calls_only, self.schemas) if self.fmt is not None else None

    def kept(self, tokenizer) -> frozenset:
        """The format's special tokens: kept in the reply's text, and taken by the grammar as their names."""
        from .logprobs import special_ids

        return special_ids(tokenizer, self.fmt.texts) if self.fmt is not None else frozenset()


def plan_tools(body, messages, chat_template, reply_schema: str | None = None) -> ToolPlan:
    """The ToolPlan of a chat request (messages as read, with their tool fields; `reply_schema`: its response
    format's JSON schema, which the grammar then holds). Raises ToolError."""
    request = read_tool_request(body)
    if request is None and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return ToolPlan(messages)
    fmt = detect_format(chat_template)
    if isinstance(fmt, str):
        raise ToolError(f"tools: {fmt}", "tools" if request is not None else "messages")
    calling = request is not None and request.choice != "none"
    template = template_text(chat_template)
    calls_as_text = "tool_calls" not in template or fmt.instructions is not None
    describe = fmt.instructions is not None and re.search(r"\btools\b", template) is None
    return ToolPlan(template_messages(messages, fmt, request, calls_as_text, describe),
                    template_tools=list(request.tools) if calling and fmt.native and not describe else None,
                    grammar=tool_grammar(fmt, request, reply_schema) if calling else None,
                    fmt=fmt if calling else None, calls_only=calling and request.choice != "auto",
                    holds_format=calling and reply_schema is not None,
                    schemas={tool["function"]["name"]: tool["function"].get("parameters", {})
                             for tool in request.tools} if calling else None)


def prompt_constraint(plan: ToolPlan, loaded, settings, compiled: dict, refusal: str | None, eos_ids):
    """The compiled grammar of a jsonl line's tool calls (`compiled` caches them by grammar); raises
    PromptError where these settings cannot take it. `refusal`: why the engine cannot run these settings
    (rungen.batch.engine_refusal), or None; eos_ids: the ids that end a reply."""
    from .constrain import ConstraintError, compile_constraint
    from .errors import PromptError

    if settings.constraint is not None:
        raise PromptError('"tools": one constraint per prompt, and --json_schema, --regex or --grammar is one')
    if refusal:
        raise PromptError(f'"tools": the calls are constrained per prompt on the engine, which {refusal} does not '
                          'run on')
    if plan.grammar not in compiled:
        try:
            compiled[plan.grammar] = compile_constraint("tools", plan.grammar, loaded.tokenizer, loaded.vocab_size,
                                                        eos_ids, plan.kept(loaded.tokenizer))
        except ConstraintError as error:
            raise PromptError(str(error)) from error
    return compiled[plan.grammar]


def record_of(plan: ToolPlan | None, generated_text: str) -> dict:
    """A jsonl record's tool fields: the reply's content and tool_calls (OpenAI's shapes), when it may call."""
    if plan is None or plan.fmt is None:
        return {}
    content, calls = message_of(plan.parser(), generated_text)
    return {"content": content, "tool_calls": calls}


