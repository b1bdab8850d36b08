"""A session in the terminal (no --prompt, stdin a terminal): the model stays loaded and answers prompt after
prompt, a conversation fitted to the context with a chat template, else each prompt continued on its own.

Replies, and nothing else, go to stdout (so `> out.txt` collects them alone); the prompt, notices and a thinking
model's reasoning go to stderr. Lines starting with / are commands (HELP lists them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time

from . import PROG
from .batch import check_thinking_budget, engine_refusal, open_engine, submit_prompts
from .errors import GenerationError, PromptError, UsageError, one_line
from .generation import FLAG_NAMES, Settings, adjust_length_to_model, eos_token_ids, generate_batch
from .interrupt import CtrlC, ctrl_c_deferred
from .loading import Loaded, cache_dir, use_transformers_model
from .prompts import Prompt, encode_prompt
from .reasoning import plan_prompt, split_reply

PROMPT, CONTINUATION = ">>> ", "... "
BLOCK = '"""'
HISTORY_FILE = "session_history"  # readline's history of typed lines, under the cache directory
HISTORY_LENGTH = 1000
# A Ctrl-C at the empty prompt this soon after one stopped a reply is the second of a double press (the reply ended
# within a token of the first): it gives the reply up, as during the reply, instead of ending the session.
SECOND_PRESS = 1.0
GIVEN_UP = "(reply given up; it is not kept in the conversation)"

# What /set may change, and the type its value is read as.
SETTABLE = {"length": int, "temperature": float, "k": int, "p": float, "repetition_penalty": float,
            "num_beams": int, "stop_token": str}
FIELDS = {name: field for field, name in FLAG_NAMES.items()}  # a /set name -> its Settings field

HELP = f"""Type a prompt and press Enter; the reply streams below it.
  /help              this help
  /set               show the generation settings
  /set NAME VALUE    change one: length, temperature (0: greedy), k, p, repetition_penalty,
                     num_beams, stop_token (none: no stop token; "\\n" in quotes: a line break;
                     ["\\n", "."]: several)
  /clear             forget the conversation (a --system message stays)
  /save FILE         write the conversation to FILE as one JSON line {{"messages": [...]}} (quotes: a name
                     with spaces)
  /exit, /quit       end the session; so do Ctrl-D, and Ctrl-C at an empty prompt
Multi-line input: end a line with \\ to go on on the next line, or put the text between two {BLOCK}.
A prompt that starts with / is typed with two: //etc/hosts is the prompt /etc/hosts.
Ctrl-C while a reply is generated stops it; what was printed stays in the conversation."""


# --- The pure parts: commands, multi-line input, the context, settings ---


def split_input(line: str) -> tuple[str | None, str]:
    """(command name, argument) for a command line, (None, prompt text) for anything else.

    '/set k 5' -> ('set', 'k 5'); '//etc' -> (None, '/etc'); 'Hello' -> (None, 'Hello')."""
    if line.startswith("//"):
        return None, line[1:]
    if line.startswith("/"):
        name, _, argument = line[1:].strip().partition(" ")
        return name.lower(), argument.strip()
    return None, line


class LineJoiner:
    """Joins the lines of one input. A line ending in a backslash goes on on the next line; a line
    starting with \"\"\" opens a block that a line ending with \"\"\" closes (\"\"\"one line\"\"\" works too)."""

    def __init__(self):
        self.lines, self.block = [], False

    @property
    def pending(self):
        """Whether an input has begun and needs more lines."""
        return self.block or bool(self.lines)

    def feed(self, line):
        """The whole input once `line` completes it, else None."""
        if self.block:
            if line.rstrip().endswith(BLOCK):
                self._add(line.rstrip()[: -len(BLOCK)])
                return self._done()
            self.lines.append(line)
            return None
        if not self.lines and line.lstrip().startswith(BLOCK):
            rest = line.lstrip()[len(BLOCK) :]
            if rest.rstrip().endswith(BLOCK):
                return rest.rstrip()[: -len(BLOCK)]
            self.block = True
            self._add(rest)
            return None
        if line.endswith("\\"):
            self.lines.append(line[:-1])
            return None
        self.lines.append(line)
        return self._done()

    def _add(self, part):
        if part.strip():  # the block's own """ lines add no empty line
            self.lines.append(part)

    def _done(self):
        text = "\n".join(self.lines)
        self.lines, self.block = [], False
        return text


def fit_to_context(messages: list[dict], count_tokens, limit: int) -> tuple[list[dict], int]:
    """(messages, turns dropped): the oldest turns (a user message and what follows) dropped until
    count_tokens(messages) <= limit; a leading system message and the last turn always stay."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest, dropped = messages[len(system) :], 0
    while count_tokens(system + rest) > limit:
        next_turn = next((i for i, message in enumerate(rest) if i > 0 and message["role"] == "user"), None)
        if next_turn is None:
            break
        rest, dropped = rest[next_turn:], dropped + 1
    return system + rest, dropped


def set_setting(settings: Settings, name: str, value: str, context: int) -> Settings:
    """A new Settings with NAME set to VALUE as typed; UsageError (the flags' own messages) when it cannot be."""
    if name not in SETTABLE:
        raise UsageError(f"unknown setting {name!r}; /set takes one of: {', '.join(SETTABLE)}")
    if not value:
        raise UsageError(f"/set {name} needs a value")
    kind = SETTABLE[name]
    if kind is str and value[:1] in ('"', "["):  # JSON: a string (a line break can be typed), or several in a list
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        strings = [parsed] if value.startswith('"') else parsed
        if not isinstance(strings, list) or not strings or not all(isinstance(v, str) and v for v in strings):
            raise UsageError(f'{name}: a value in quotes is a JSON string of one or more characters ("\\n": a line '
                             f"break), got {value}" if value.startswith('"') else
                             f'{name}: a value in brackets is a JSON array of non-empty strings (["\\n", "."]), got '
                             f"{value}")
        parsed = strings[0] if len(strings) == 1 else tuple(strings)  # several: as --stop_token repeated gives
    elif kind is str:
        parsed = None if value.lower() == "none" else value
    else:
        try:
            parsed = kind(value)
        except ValueError:
            raise UsageError(f"{name} takes {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if kind is float and not math.isfinite(parsed):
            raise UsageError(f"{name} must be a finite number, got {value}")  # as the flag says
    if name == "length" and parsed == 0:
        raise UsageError("length 0 scores prompts (the command line's --length 0); a reply needs 1 or more")
    if name == "length":
        parsed = adjust_length_to_model(parsed, max_sequence_length=context)
    changed = dataclasses.replace(settings, **{FIELDS.get(name, name): parsed})
    changed.check()
    return changed


def describe_settings(settings: Settings, names=SETTABLE) -> str:
    """The settings NAMES, each as /set takes it back (stop strings in JSON)."""
    def shown(value):
        if isinstance(value, (str, tuple)):
            return json.dumps(value if isinstance(value, str) else list(value), ensure_ascii=False)
        return "none" if value is None else repr(value)

    return "\n".join(f"  {name:<20}{shown(getattr(settings, FIELDS.get(name, name)))}" for name in names)


def turn_stats(prompt_tokens: int, reply_tokens: int, started: float, first_token_at: float | None, ended: float,
               interrupted: bool = False, reused: int = 0) -> str:
    """The line printed after each reply: tokens (reused from the cache), time to first token, speed."""
    parts = [f"{prompt_tokens} prompt ({reused} cached) + {reply_tokens} reply tokens" if reused
             else f"{prompt_tokens} prompt + {reply_tokens} reply tokens"]
    if first_token_at is not None:
        parts.append(f"first token {first_token_at - started:.2f} s")
        if reply_tokens > 1 and ended > first_token_at:
            parts.append(f"{(reply_tokens - 1) / (ended - first_token_at):.1f} tokens/s")
    if interrupted:
        parts.append("interrupted")
    return "(" + ", ".join(parts) + ")"


# --- Generating one reply ---


class TurnControl(CtrlC):
    """A reply's Ctrl-C (rungen/interrupt.py: it stops the reply, a second raises KeyboardInterrupt) that notes, as
    generate()'s stopping criterion, the first token's time and the tokens so far."""

    def __init__(self):
        super().__init__()
        self.first_token_at, self.ids = None, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids = input_ids  # prompt and reply so far (a new tensor every step: no copy needed)
        return super().__call__(input_ids, scores, **kwargs)


# --- The terminal ---


def _is_terminal(stream, fd):
    try:
        return stream.fileno() == fd and stream.isatty()
    except (AttributeError, OSError, ValueError):
        return False


class Terminal:
    """Reads lines with readline's editing and history, the prompt shown without putting it into stdout."""

    def __init__(self):
        try:
            import readline
        except ImportError:  # no readline on this platform: plain lines, no history
            readline = None
        self.readline, self.history_path = readline, os.path.join(cache_dir(), HISTORY_FILE)
        self.stdout_is_terminal = _is_terminal(sys.stdout, 1)
        self.stderr_is_terminal = _is_terminal(sys.stderr, 2)
        if readline:
            readline.set_history_length(HISTORY_LENGTH)
            with contextlib.suppress(OSError):
                readline.read_history_file(self.history_path)

    def close(self):
        if self.readline:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(self.history_path), exist_ok=True)
                self.readline.write_history_file(self.history_path)

    def read(self, prompt):
        """One line; EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C."""
        sys.stdout.flush()
        if self.stdout_is_terminal:
            return input(prompt)
        if not self.stderr_is_terminal:  # both redirected: no line editing, the prompt to stderr
            sys.stderr.write(prompt)
            sys.stderr.flush()
            return input()
        # readline writes the prompt and echo to fd 1, which goes to a file: point it at the terminal meanwhile.
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            return input(prompt)
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    def typed(self):
        """What was typed on the line when Ctrl-C came."""
        return self.readline.get_line_buffer() if self.readline else ""


class ReplyWriter:
    """A thinking model's streamed reply: the reasoning to stderr (dimmed, where `show`), the answer to stdout."""

    def __init__(self, plan, show: bool):
        self.splitter, self.show = plan.splitter(), show
        self.dim = _is_terminal(sys.stderr, 2)
        self.thought = False  # some reasoning was shown (a line ends it before the answer)
        self.answered = False  # some of the answer went to stdout (its line is ended at the finish)

    def __call__(self, text, final=False):
        reasoning, content = self.splitter.finish() if final else self.splitter.feed(text)
        if reasoning and self.show:
            sys.stderr.write(f"\033[2m{reasoning}\033[0m" if self.dim else reasoning)
            sys.stderr.flush()
            self.thought = True
        if content:
            self.end_reasoning()
            sys.stdout.write(content)
            sys.stdout.flush()
            self.answered = True

    def end_reasoning(self):
        if self.thought:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.thought = False

    def finish(self):
        self("", final=True)
        self.end_reasoning()
        if self.answered:  # a reply all reasoning leaves no empty line among the answers
            sys.stdout.write("\n")
            sys.stdout.flush()


def user_turns(messages) -> int:
    return sum(message["role"] == "user" for message in messages)


def say(text: str) -> None:
    """A notice: to stderr, never mixed into the replies."""
    print(text, file=sys.stderr, flush=True)


class LineEnds:
    """stdout for the session's duration, noting whether its last write ended a line: a reply cut short ends its
    line, and no empty line is written where nothing of it was (stdout to a file holds the replies alone)."""

    def __init__(self, stream):
        self.stream, self.at_line_start = stream, True

    def write(self, text):
        if text:
            self.at_line_start = text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name):  # fileno, isatty, flush, buffer...: the stream's own
        return getattr(self.stream, name)


def end_line() -> None:
    """Ends the line a reply cut short left on stdout, if it left one."""
    if not getattr(sys.stdout, "at_line_start", False):
        print(flush=True)


# --- The session ---


class TurnCache:
    """generate()'s cache kept from turn to turn, so only a prompt's new tokens need a forward pass; it is cut back
    to the prefix the new prompt shares (a template can render a reply's end differently)."""

    def __init__(self):
        self.cache, self.tokens = None, []

    def usable(self, loaded: Loaded, settings: Settings) -> bool:
        """Whether the turn can use it: one sequence, no beams, assistant, prompt lookup or --jit."""
        return (settings.num_beams == 1 and settings.num_return_sequences == 1
                and not settings.prompt_lookup_num_tokens and getattr(loaded, "assistant_model", None) is None
                and not hasattr(loaded.model.forward, "graph_steps"))

    def take(self, ids: list[int], model):
        """(cache, reused tokens) for `ids`: the cache cut to their common prefix (one token left to compute),
        or (a new cache, 0)."""
        from transformers import DynamicCache

        from .kvcache import new_cache

        fresh = new_cache(model) if getattr(model, "cache_grows_in_place", False) else DynamicCache()
        shared = 0
        for held, new in zip(self.tokens, ids[:-1]):
            if held != new:
                break
            shared += 1
        # Lent to this turn: a turn that fails leaves it half-extended, so it comes back only through keep().
        cache, self.cache, self.tokens = self.cache, None, []
        if cache is None or shared == 0:
            return fresh, 0
        try:
            cache.crop(shared - cache.get_seq_length())  # negative: tokens removed from the end
        except (RuntimeError, ValueError):  # a sliding-window layer that cannot rewind: start afresh
            return fresh, 0
        return cache, shared

    def keep(self, cache, ids: list[int]):
        """After a turn whose prompt and reply are `ids`: the cache holds all of them but the last token."""
        self.cache, self.tokens = cache, ids[: cache.get_seq_length()]


class Session:
    """One conversation (or, without a chat template, a run of independent prompts) on a loaded model."""

    def __init__(self, loaded: Loaded, settings: Settings, *, system: str | None = None, stream: bool = True,
                 prefix: str = "", tools: dict | None = None, template_kwargs: dict | None = None,
                 figures: bool = True):
        self.loaded, self.settings, self.prefix = loaded, settings, prefix
        self.template_kwargs = template_kwargs  # --chat_template_kwargs
        self.tools, self.tool_grammars = tools, {}  # --tools: each turn may call them (rungen/tools.py)
        self.figures = figures  # figures after each reply, a thinking model's reasoning (not with --quiet)
        self.chat = settings.chat
        self.system = [{"role": "system", "content": system}] if self.chat and system else []
        self.messages = []  # the conversation after the system message: user and assistant turns
        self.left_out = 0  # the user turns dropped from the conversation to fit the context (/save says so)
        self.previous = ([], 0)  # messages and left_out before the last turn (a second Ctrl-C gives it up)
        self.stream = stream
        self.stdout_is_terminal = _is_terminal(sys.stdout, 1)
        self.replies = []  # what main() returns: each reply (prompt + continuation in plain continuation)
        self.turn_cache = TurnCache() if self.chat else None  # generate()'s turns
        self.engine, self.engine_opened = None, False
        self.stopped_at = None  # when Ctrl-C last stopped a reply (time.monotonic)

    def engine_for(self, settings):
        """The engine for a turn under these settings (opened at the first), or None where generate() runs it."""
        if engine_refusal(self.loaded, settings) is not None:
            from .gguf import GGUFCausalLM

            if isinstance(self.loaded.model, GGUFCausalLM):  # generate() runs on transformers' model of the file
                self.engine, self.engine_opened = None, False  # the engine holds the own model, released now
                with ctrl_c_deferred():  # one model released, the other not yet built: never left halfway
                    use_transformers_model(self.loaded)
            return None
        if not self.engine_opened:
            self.engine_opened = True
            self.engine = open_engine(self.loaded, settings, 1, conversation=self.chat)
        return self.engine

    def give_up_last_reply(self):
        """Forgets the last turn, as a second Ctrl-C during its reply would have."""
        self.stopped_at = None
        self.messages, self.left_out = self.previous  # with the turns it dropped
        self.replies.pop()
        say(GIVEN_UP)

    def clear(self):
        self.messages, self.left_out = [], 0

    def save(self, path):
        if len(path) > 1 and path[0] == path[-1] and path[0] in "\"'":  # a name with spaces, as a shell takes it
            path = path[1:-1]
        if not path:
            say("error: /save needs a file name")
            return
        if not self.messages:
            say("error: /save: the conversation is empty, nothing to save")
            return
        if self.chat:  # the jsonl input's conversation format: it reads back with --input_format jsonl
            lines = [{"messages": self.system + self.messages, **(self.tools or {})}]
        else:  # plain continuation: one prompt per line, as --input_format jsonl reads prompts
            pairs = zip(self.messages[::2], self.messages[1::2])
            lines = [{"prompt": user["content"], "continuation": reply["content"]} for user, reply in pairs]
        target = os.path.realpath(os.path.expanduser(path))  # a link's file is written, the link kept
        if os.path.exists(target) and not os.path.isfile(target):
            say(f"error: cannot write {path}: " + ("it is a directory" if os.path.isdir(target)
                                                     else "not a regular file"))
            return
        temporary = f"{target}.tmp-{os.getpid()}"
        try:  # written whole beside it, then put in its place: a failed write leaves the file as it was
            with open(temporary, "w", encoding="utf-8") as file:
                file.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
            if os.path.exists(target):  # a private file stays private
                shutil.copymode(target, temporary)
            os.replace(temporary, target)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            why = error.strerror
            if error.filename == temporary:  # the file written first, beside it
                why = f"cannot create a file in {os.path.dirname(target)} ({why})"
            say(f"error: cannot write {path}: {why}")
            return
        if not self.left_out:
            say(f"(saved to {path})")
        else:  # the conversation as the model last read it: a read back gets the reply that follows it
            turns = "turn, dropped to fit the context, is" if self.left_out == 1 else \
                f"{self.left_out} turns, dropped to fit the context, are"
            say(f"(saved to {path}; the oldest {turns} not in it)")

    def encode(self, text):
        """(prompt, user message, the history its prompt keeps): this turn's prompt, encoded (with a template, the
        conversation fitted to the context: the oldest turns left out); PromptError if it cannot be generated."""
        # --prefix on each user turn, as --prompt --chat takes it (kept so in the history: the next turn's prompt
        # starts as this one's did, and its keys/values are reused)
        user, dropped = {"role": "user", "content": self.prefix + text if self.chat else text}, 0
        kept = self.messages
        if not self.chat:
            prompt = Prompt(len(self.replies), text)
        else:
            messages = self.system + self.messages + [user]
            if self.loaded.context:
                messages, dropped = fit_to_context(messages, self.count_tokens,
                                                   self.loaded.context - self.reply_room())
            prompt = Prompt(len(self.replies), text, messages=messages, tools=self.tools)
        prompt.ids = encode_prompt(self.loaded, prompt, self.prefix, self.chat, template_kwargs=self.template_kwargs)
        context, length = self.loaded.context, self.settings.length
        if dropped:  # only once the prompt fits: one too long for any history keeps the history
            turns = "turn" if dropped == 1 else f"{dropped} turns"
            say(f"(dropped the oldest {turns} to fit the model's context of {context} tokens)")
            kept = messages[len(self.system) : -1]
        if context and length < context and context - len(prompt.ids) < length:
            say(f"(the model's context of {context} tokens leaves this reply {context - len(prompt.ids)} of its "
                f"{length} tokens)")
        if prompt.tool_plan is not None and prompt.tool_plan.grammar:
            from .tools import prompt_constraint

            prompt.constraint = prompt_constraint(prompt.tool_plan, self.loaded, self.settings, self.tool_grammars,
                                                  engine_refusal(self.loaded, self.settings),
                                                  eos_token_ids(self.settings, self.loaded.model))
        plan_prompt(self.loaded, self.settings, prompt, self.template_kwargs)
        return prompt, user, kept

    def reply_room(self) -> int:
        """The tokens a turn's prompt leaves the reply, older turns dropped for them: the length, or one where the
        length is the whole context (-1), which no history could leave room for."""
        return self.settings.length if self.settings.length < self.loaded.context else 1

    def count_tokens(self, messages):
        """The tokens of a conversation's prompt with the tools the template renders, however many; PromptError where
        the template refuses it (a refusal is no length: no turn is dropped for it)."""
        return len(encode_prompt(self.loaded, Prompt(0, "", messages=messages, tools=self.tools),
                                 template_kwargs=self.template_kwargs, within_context=False))

    def refused(self, messages) -> bool:
        try:
            self.count_tokens(self.system + messages)
        except PromptError:
            return True
        return False

    def turn(self, text):
        """One prompt and its reply: streamed to stdout, then a line of figures on stderr."""
        try:
            prompt, user, kept = self.encode(text)
        except PromptError as error:
            say(f"error: {error}")
            return
        settings, control = self.settings, TurnControl()
        engine = self.engine_for(settings)
        started = time.perf_counter()
        try:
            if engine is not None:
                sequences, streamed, first_token_at, reused = self.reply_on_engine(engine, prompt, settings, control)
            else:
                sequences, streamed, first_token_at, reused = self.reply_by_generate(prompt, settings, control)
        except GenerationError as error:  # these settings cannot be generated (out of memory among them)
            end_line()
            say(f"error: {error}; the conversation is as it was")
            return
        ended = time.perf_counter()
        if not sequences:  # a constraint the vocabulary could not follow
            say(f"error: {prompt.error}")
            return
        [sequence] = sequences
        if control.interrupted and not sequence.num_generated_tokens:  # stopped before its first token
            say("(stopped before the reply began; the turn is not kept)")
            return
        if control.interrupted and not streamed:
            sys.stderr.write("\n")  # after the ^C the terminal echoed, before the reply printed now
        reply = {"role": "assistant", "content": sequence.generated_text}
        if prompt.reply is not None:
            reasoning, content = split_reply(prompt.reply, sequence.generated_text)
            reply = {"role": "assistant", "content": content or "",
                     **({"reasoning_content": reasoning} if reasoning is not None else {})}
            if not content and self.refused(kept + [user, reply]):  # a template that takes no empty answer
                reply = {"role": "assistant", "content": sequence.generated_text}  # (Mistral's): as written
            if not streamed:
                writer = ReplyWriter(prompt.reply, self.figures)
                writer(sequence.generated_text)
                writer.finish()
        elif not streamed:
            print(sequence.generated_text, flush=True)
        if prompt.tool_plan is not None and prompt.tool_plan.fmt is not None:
            from .tool_reply import message_of

            parser = prompt.tool_plan.parser()
            calls = message_of(parser, reply["content"])[1]
            for call, finished in zip(calls, parser.finished):
                cut = "" if finished else " cut short by --length"
                say(f"(tool call{cut}: {call['function']['name']}({call['function']['arguments']}))")
            if parser.unnamed:
                say("(a further tool call cut short by --length before its name)")
        self.previous = self.messages, self.left_out
        self.left_out += user_turns(self.messages) - user_turns(kept)
        self.messages = kept + [user, reply]  # the turns its prompt left out go only now
        self.replies.append(sequence.text)
        self.stopped_at = time.monotonic() if control.interrupted else None
        if control.interrupted and streamed and not self.stdout_is_terminal:
            sys.stderr.write("\n")  # after the ^C the terminal echoed; the reply's own newline went to stdout
        if self.figures:
            say(turn_stats(len(prompt.ids), sequence.num_generated_tokens, started, first_token_at, ended,
                           control.interrupted, reused))
        context, used = self.loaded.context, len(prompt.ids) + sequence.num_generated_tokens
        if sequence.finish_reason == "length" and context and used >= context:  # not the length it was given
            say(f"(the reply stopped at the end of the model's context of {context} tokens)")

    def reply_on_engine(self, engine, prompt, settings, control):
        """(sequences, streamed, first token's time, reused prompt tokens) of a turn on the engine."""
        done = {}
        stream = self.stream
        if stream and prompt.reply is not None:
            stream = ReplyWriter(prompt.reply, self.figures)
        [request] = submit_prompts(engine, settings, [prompt], lambda _, sequences: done.update(sequences=sequences),
                                   stream=stream)
        with control.catching([request]):
            try:
                engine.run_here()
            except ValueError as error:
                raise GenerationError(one_line(error)) from error
        if isinstance(stream, ReplyWriter) and done["sequences"]:
            stream.finish()
        return done["sequences"], self.stream, request.first_token_at, request.reused

    def reply_by_generate(self, prompt, settings, control):
        """The same through generate(), for the settings only it has; the turns before come from TurnCache."""
        from transformers import StoppingCriteriaList

        from .generation import StopTokenStreamer

        streamer = StopTokenStreamer(self.loaded.tokenizer, settings.stop_token) if self.stream else None
        if settings.num_beams > 1 or prompt.reply is not None:
            streamer = None  # beam search cannot stream, nor a thinking model's reply here: it comes when done
        cache, reused = None, 0
        if self.turn_cache is not None and self.turn_cache.usable(self.loaded, settings):
            cache, reused = self.turn_cache.take(prompt.ids, self.loaded.model)
        with control.catching():
            results = generate_batch(self.loaded, settings, [prompt], streamer, StoppingCriteriaList([control]),
                                     past_key_values=cache)
        if cache is not None and control.ids is not None:
            self.turn_cache.keep(cache, control.ids[0].tolist())
        return results[prompt.index], streamer is not None, control.first_token_at, reused


class Repl:
    """The terminal's side of a session: reads lines (multi-line input, /commands, Ctrl-C and Ctrl-D) and hands each
    prompt to the Session."""

    def __init__(self, session: Session):
        self.session = session

    def loop(self, terminal):
        session, joiner = self.session, LineJoiner()
        while True:
            try:
                line = terminal.read(CONTINUATION if joiner.pending else PROMPT)
            except EOFError:  # Ctrl-D
                sys.stderr.write("\n")
                if joiner.pending:
                    say("(the unfinished input was not sent)")
                return
            except KeyboardInterrupt:  # Ctrl-C: drops what is being typed, or ends at an empty prompt
                sys.stderr.write("\n")
                if not joiner.pending and not terminal.typed():
                    if session.stopped_at is not None and time.monotonic() - session.stopped_at < SECOND_PRESS:
                        session.give_up_last_reply()  # the second press of a double Ctrl-C, come as the reply ended
                        continue
                    return
                joiner = LineJoiner()
                continue
            session.stopped_at = None
            if not joiner.pending:
                name, line = split_input(line)
                if name is not None:
                    if self.command(name, line):
                        return
                    continue
            text = joiner.feed(line)
            if text is None or not text.strip():
                continue
            try:
                session.turn(text)
            except KeyboardInterrupt:  # a second Ctrl-C during one reply
                end_line()
                say(GIVEN_UP)

    def command(self, name, argument):
        """Runs one /command; True when it ends the session."""
        session = self.session
        if name in ("exit", "quit"):
            return True
        if name == "help":
            say(HELP)
        elif name == "clear":
            session.clear()
            say("(conversation cleared)")
        elif name == "save":
            session.save(argument)
        elif name == "set" and not argument:
            say(describe_settings(session.settings))
        elif name == "set":
            setting, _, value = argument.partition(" ")
            try:
                changed = set_setting(session.settings, setting.lower(), value.strip(), session.loaded.context)
                if changed.thinking_budget is not None:
                    check_thinking_budget(session.loaded, changed)  # a setting only generate() runs would drop the cap
                session.settings = changed
            except UsageError as error:
                say(f"error: {error}")
            else:
                say(describe_settings(session.settings, [setting.lower()]))
                self.say_unused(setting.lower(), value.strip())
        else:
            say(f"unknown command /{name}; /help lists the commands")
        return False

    def say_unused(self, name, value):
        """A notice where a setting just set does not act as typed (the flags' start-up warnings)."""
        settings, context = self.session.settings, self.session.loaded.context
        if name in ("k", "p") and settings.temperature == 0:
            say(f"({name} applies to sampling only: it takes effect once temperature is above 0)")
        elif name == "length" and context and settings.length == context and value != str(context):
            say(f"(length: up to the model's context, {context} tokens)")


def run(loaded: Loaded, settings: Settings, *, chat: bool | None = None, system: str | None = None,
        stream: bool | None = None, prefix: str = "", tools: dict | None = None,
        template_kwargs: dict | None = None, figures: bool = True) -> list[str]:
    """The session, until /exit, Ctrl-D or Ctrl-C at an empty prompt; returns the replies. `chat`/`stream` None:
    by the tokenizer's chat template / on."""
    has_template = bool(loaded.tokenizer.chat_template)
    chat = chat if chat is not None else has_template
    if chat and not has_template:
        raise UsageError("--chat: this tokenizer has no chat template")
    if tools is not None and not chat:
        raise UsageError("--tools needs a conversation: this model has no chat template" if not has_template
                         else "--tools needs a conversation; it cannot be used with --no-chat")
    if tools is not None:
        from .tool_formats import detect_format

        fmt = detect_format(loaded.tokenizer.chat_template)
        if isinstance(fmt, str):  # refused before the first turn, not at each
            raise UsageError(f"--tools: {fmt}")
    for flag, value, what in (("system", system, "system message"), ("chat_template_kwargs", template_kwargs,
                                                                     "variables")):
        if value is not None and not chat:
            raise UsageError(f"--{flag} is the chat template's {what}: this session has no template")
    session = Session(loaded, dataclasses.replace(settings, chat=chat), system=system,
                      stream=stream is not False, prefix=prefix, tools=tools, template_kwargs=template_kwargs,
                      figures=figures)
    if tools is not None:
        try:  # the template renders them at every turn: one that refuses them is refused before the first
            session.encode("Hello")
        except PromptError as error:
            raise UsageError(f"--tools: {error}") from None
    kind = "Chat (the model's chat template)" if chat else "Plain continuation"
    if figures:  # --quiet: nothing on stderr but warnings and errors
        say(f"{PROG}: {kind}. /help for commands, Ctrl-D or /exit to end.")
    terminal, stdout = Terminal(), sys.stdout
    sys.stdout = LineEnds(stdout)
    try:
        Repl(session).loop(terminal)
    finally:
        sys.stdout = stdout
        terminal.close()
    return session.replies
