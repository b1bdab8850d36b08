"""A session in the terminal: the real CLI on a pseudo-terminal, typed at as a user types.

The tiny checkpoints have no chat template; `chat_llama` is a copy of the tiny llama with a simple one.
Its LM head never produces special or unprintable tokens, so a greedy reply is always --length tokens
on one line. Most sessions send stdout to a file (as `run_generation.py > out.txt` does): then it holds
the replies alone, one per line, and the terminal shows the prompts and the figures.
"""

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time

import pytest
from transformers import AutoTokenizer

from helpers import SCRIPT, cli_env, jsonl, run_main

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = re.compile(rb">>> ")
STATS = re.compile(rb"\((?P<prompt>\d+) prompt(?: \((?P<cached>\d+) cached\))? \+ (?P<reply>\d+) reply tokens"
                   rb"[^)\n]*\)")


def with_chat_template(source, target, **config):
    shutil.copytree(source, target)
    with open(os.path.join(target, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    if config:
        with open(os.path.join(target, "config.json")) as f:
            values = json.load(f)
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(dict(values, **config), f)
    return target


@pytest.fixture(scope="module")
def chat_llama(tiny_models, tmp_path_factory):
    """The tiny llama (context 128) with a chat template."""
    return with_chat_template(tiny_models["llama"], str(tmp_path_factory.mktemp("chat") / "llama"))


@pytest.fixture(scope="module")
def tokenizer(chat_llama):
    return AutoTokenizer.from_pretrained(chat_llama)


def conversation_tokens(tokenizer, messages):
    """The prompt's length for a conversation, encoded as the tool encodes it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _take_the_terminal():
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty becomes the controlling terminal: Ctrl-C sends SIGINT


class Terminal:
    """run_generation.py with stdin and stderr on a pseudo-terminal, stdout there too or to a file."""

    def __init__(self, args, cache_home, stdout=None):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
        env = dict(cli_env(cache_home), TERM="dumb")
        self.stdout_path = stdout
        out = open(stdout, "wb") if stdout else slave
        self.process = subprocess.Popen([sys.executable, SCRIPT, *args], stdin=slave, stdout=out, stderr=slave,
                                        env=env, start_new_session=True, preexec_fn=_take_the_terminal)
        os.close(slave)
        if stdout:
            out.close()
        self.master, self.output, self.seen = master, b"", 0

    def expect(self, pattern, timeout=300):
        """Waits for `pattern` in what the terminal shows after the last match; returns the match."""
        deadline = time.monotonic() + timeout
        while True:
            match = pattern.search(self.output, self.seen)
            if match:
                self.seen = match.end()
                return match
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))
            chunk = b""
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the process is gone
                    pass
            if not chunk:
                raise AssertionError(f"no {pattern.pattern!r} on the terminal; it shows:\n{self.output.decode()}")
            self.output += chunk

    def send(self, data):
        os.write(self.master, data.encode())

    def ask(self, text):
        """Types a prompt, waits for its reply and the next prompt; returns (prompt tokens, reply tokens)."""
        self.send(text + "\r")
        stats = self.expect(STATS)
        self.expect(PROMPT)
        self.cached = int(stats["cached"] or 0)  # prompt tokens whose keys and values the turns before left
        return int(stats["prompt"]), int(stats["reply"])

    def command(self, text):
        """Types a command; returns what the terminal showed until the next prompt."""
        start = self.seen
        self.send(text + "\r")
        self.expect(PROMPT)
        return self.output[start : self.seen].decode()

    def stdout(self):
        with open(self.stdout_path, encoding="utf-8") as f:
            return f.read()

    def wait(self):
        returncode = self.process.wait(timeout=120)
        while select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.output += chunk
        os.close(self.master)
        return returncode


def start(args, tmp_path, stdout_to_file=True):
    """A session, waited on until its first prompt; the cache (readline history) lives in tmp_path."""
    terminal = Terminal(args, tmp_path, stdout=str(tmp_path / "stdout.txt") if stdout_to_file else None)
    terminal.expect(PROMPT)
    return terminal


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_turns_make_one_conversation_that_a_pipe_replays(chat_llama, tokenizer, tmp_path, jit):
    args = ["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "12"] + (["--jit"] if jit else [])
    terminal = start(args, tmp_path)
    first = terminal.ask("Hello there")
    second = terminal.ask("How are you")
    # The second turn takes at least the first prompt's keys and values from the cache (the reply's too where
    # it tokenizes back as generated; with --jit as without), and its reply is the one the whole conversation
    # gives read afresh (the pipe below).
    assert terminal.cached >= first[0]
    terminal.command(f'/save "{tmp_path / "the chat.jsonl"}"')  # quoted, as a shell takes a name with a space
    terminal.send("a line to go on \\\r")
    terminal.expect(re.compile(re.escape(b"... ")))  # the continuation prompt: readline reads the next key
    terminal.send("\x04")  # Ctrl-D: ends the session, and says the line begun was not sent
    assert terminal.wait() == 0
    assert "Chat (the model's chat template)" in terminal.output.decode()
    assert "(the unfinished input was not sent)" in terminal.output.decode()

    [line] = (tmp_path / "the chat.jsonl").read_text().splitlines()
    messages = json.loads(line)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [messages[0]["content"], messages[2]["content"]] == ["Hello there", "How are you"]
    # The second prompt is the whole conversation so far, through the chat template.
    assert first == (conversation_tokens(tokenizer, messages[:1]), 12)
    assert second == (conversation_tokens(tokenizer, messages[:3]), 12) and second[0] > first[0] + 12
    # stdout holds the replies alone, one per line, as streamed.
    assert [text.strip() for text in terminal.stdout().splitlines()] == [messages[1]["content"].strip(),
                                                                          messages[3]["content"].strip()]
    # readline's history of typed lines is a file in the cache directory.
    assert "How are you" in (tmp_path / "run_generation" / "session_history").read_text()

    # The same conversation from a pipe, in the jsonl messages format /save wrote, gives the same replies.
    stdin = "\n".join(json.dumps({"messages": messages[:end], "id": end}) for end in (1, 3))
    piped = run_main(["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "12", "--input_format",
                     "jsonl", "--output_format", "jsonl", "--batch_size", "1"], stdin=stdin)
    assert piped.returncode == 0, piped.stderr.decode()
    records = jsonl(piped.stdout)
    assert [r["generated_text"] for r in records] == [messages[1]["content"], messages[3]["content"]]
    assert [r["prompt"] for r in records] == ["Hello there", "How are you"]  # the last user message
    assert [r["messages"] for r in records] == [messages[:1], messages[:3]] and records[1]["id"] == 3
    assert [r["num_prompt_tokens"] for r in records] == [first[0], second[0]]


@pytest.mark.slow
def test_turns_on_the_engine_and_through_generate_make_one_conversation(chat_llama, tmp_path):
    # Beam search is generate()'s alone: a turn under it runs there, the turns around it on the engine, and
    # each reply is the one the command line gives for the same conversation with the same settings.
    args = ["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "8"]
    terminal = start(args, tmp_path)
    terminal.ask("Hello there")
    terminal.command("/set num_beams 3")
    terminal.ask("How are you")
    terminal.command("/set num_beams 1")
    terminal.ask("Goodbye")
    assert terminal.cached > 0  # the engine's turn took the conversation's start from its cache
    terminal.command(f"/save {tmp_path / 'chat.jsonl'}")
    terminal.send("/exit\r")
    assert terminal.wait() == 0
    messages = json.loads((tmp_path / "chat.jsonl").read_text())["messages"]
    for end, beams in ((1, "1"), (3, "3"), (5, "1")):
        piped = run_main(args + ["--num_beams", beams, "--input_format", "jsonl", "--output_format", "jsonl"],
                         stdin=json.dumps({"messages": messages[:end]}))
        assert piped.returncode == 0, piped.stderr.decode()
        assert jsonl(piped.stdout)[0]["generated_text"] == messages[end]["content"], end


@pytest.mark.slow
def test_set_and_clear(chat_llama, tokenizer, tmp_path):
    terminal = start(["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "12"], tmp_path)
    first = terminal.ask("Hello there")
    assert first[1] == 12
    assert "length              5" in terminal.command("/set length 5")
    assert "error: --temperature must be >= 0, got -1.0" in terminal.command("/set temperature -1")
    assert "error: k takes an integer, got 'x'" in terminal.command("/set k x")
    assert "unknown setting 'beam'" in terminal.command("/set beam 2")
    assert "unknown command /bogus" in terminal.command("/bogus")
    shown = terminal.command("/set")
    assert "length              5" in shown and "temperature         0.0" in shown  # bad values changed nothing
    second = terminal.ask("Hello again")
    assert second[1] == 5 and second[0] > first[0] + 12  # the new length; the first turn is still there
    assert "(conversation cleared)" in terminal.command("/clear")
    assert terminal.ask("Hello there") == (first[0], 5)  # nothing before it any more
    terminal.send("/exit\r")
    assert terminal.wait() == 0
    replies = terminal.stdout().splitlines()
    assert len(replies) == 3 and replies[2] == replies[0][: len(replies[2])]  # greedy: the same reply, shorter


@pytest.mark.slow
def test_old_turns_are_dropped_to_fit_the_context(chat_llama, tokenizer, tmp_path):
    length = 30  # the context is 128: a prompt may be 98 tokens
    terminal = start(["--model_name_or_path", chat_llama, "--temperature", "0", "--length", str(length)], tmp_path)
    # nothing said yet: no file a read back would refuse
    assert "the conversation is empty, nothing to save" in terminal.command(f"/save {tmp_path / 'chat.jsonl'}")
    sizes = [terminal.ask(f"Tell me more about the dog number {n}") for n in range(4)]
    # A prompt too long for any history is refused, and the history stays as it was.
    refused = terminal.command("the dog " * 60)
    assert "error: prompt is" in refused and "dropped" not in refused
    saved = terminal.command(f"/save {tmp_path / 'chat.jsonl'}")
    terminal.send("/quit\r")
    assert terminal.wait() == 0
    shown = terminal.output.decode()
    assert "(dropped the oldest turn to fit the model's context of 128 tokens)" in shown
    assert all(prompt + length <= 128 for prompt, _ in sizes)
    assert sizes[1][0] > sizes[0][0]  # the second turn still carries the first
    messages = json.loads((tmp_path / "chat.jsonl").read_text())["messages"]
    left_out = 4 - sum(message["role"] == "user" for message in messages)  # and /save says how many
    assert (f"the oldest {left_out} turns, dropped to fit the context, are not in it" if left_out > 1 else
            "the oldest turn, dropped to fit the context, is not in it") in saved
    assert messages[-2]["content"] == "Tell me more about the dog number 3"
    assert messages[0]["content"] != "Tell me more about the dog number 0"  # dropped from the conversation
    assert sizes[-1][0] == conversation_tokens(tokenizer, messages[:-1])


def test_a_reply_up_to_the_context_keeps_the_conversation(chat_llama, capsys):
    # --length -1 (the whole context, as /set length 500 on this 128-token model) holds no room back: the turns
    # before stay as long as the prompt fits. An explicit length drops the oldest for its room, and where not even
    # the last turn alone leaves it, says how much the reply gets.
    import torch

    from rungen.generation import Settings
    from rungen.loading import load
    from rungen.session import Session

    loaded = load(chat_llama, device=torch.device("cpu"))
    capsys.readouterr()  # (transformers' loading bar)
    turns = [{"role": role, "content": f"the dog number {n}"} for n in range(3) for role in ("user", "assistant")]

    def encoded(length):
        session = Session(loaded, Settings(chat=True, length=length))
        session.messages = list(turns)
        prompt, _, kept = session.encode("And the cat?")
        assert session.messages == turns  # the turn, not yet kept, changes nothing
        return prompt, kept, capsys.readouterr().err

    prompt, kept, said = encoded(loaded.context)
    assert loaded.context == 128 and prompt.messages[:-1] == turns == kept and said == ""
    room = loaded.context - len(prompt.ids)
    prompt, kept, said = encoded(room + 5)  # the whole conversation leaves 5 too few
    assert kept == turns[2:] and "(dropped the oldest turn to fit the model's context of 128 tokens)" in said
    assert "leaves this reply" not in said
    alone = len(encoded(loaded.context - 1)[0].ids)  # every turn before dropped: the prompt alone
    _, kept, said = encoded(loaded.context - 1)
    assert kept == [] and f"(the model's context of 128 tokens leaves this reply {128 - alone} of its 127 tokens)" \
        in said


def test_prefix_reaches_every_turn_of_a_conversation(chat_llama, tokenizer, capsys):
    # --prefix in a chat session: each user turn carries it, as --prompt --chat's one message does (it was dropped)
    import torch

    from rungen.generation import Settings
    from rungen.loading import load
    from rungen.prompts import Prompt, encode_prompt
    from rungen.session import Session

    loaded = load(chat_llama, device=torch.device("cpu"))
    session = Session(loaded, Settings(chat=True, length=4), prefix="Answer in French. ")
    prompt, user, _ = session.encode("Where is Paris?")
    assert user == {"role": "user", "content": "Answer in French. Where is Paris?"}
    one_shot = encode_prompt(loaded, Prompt(0, "Where is Paris?"), "Answer in French. ", True)
    assert prompt.ids == one_shot and len(one_shot) == conversation_tokens(tokenizer, [user])
    capsys.readouterr()


def test_a_reply_stopped_before_its_first_token_leaves_no_turn(chat_llama, capsys, monkeypatch):
    # Ctrl-C during a long prompt's prefill acts once it ends, before any token: no empty reply is kept (nor read
    # back by /save), and the conversation is as it was, the turns its prompt left out too.
    import torch

    from rungen.generation import Sequence, Settings
    from rungen.loading import load
    from rungen.session import Session

    def stopped(self, engine, prompt, settings, control):
        control.interrupted = True
        return [Sequence("", "", len(prompt.ids), 0, "interrupted")], True, None, 0

    monkeypatch.setattr(Session, "reply_on_engine", stopped)
    session = Session(load(chat_llama, device=torch.device("cpu")), Settings(chat=True, length=8))
    turns = [{"role": role, "content": f"the dog number {n}"} for n in range(6) for role in ("user", "assistant")]
    session.messages = list(turns)
    session.turn("the dog " * 20)  # its prompt leaves out the oldest turns: they stay, as the turn does not
    said = capsys.readouterr().err
    assert "dropped the oldest" in said and "(stopped before the reply began; the turn is not kept)" in said
    assert session.messages == turns and session.replies == []

    # A reply that is kept drops them; given up (a second Ctrl-C just after it), the conversation is as it was.
    def replied(self, engine, prompt, settings, control):
        return [Sequence("Woof", "Woof", len(prompt.ids), 1, "eos")], True, None, 0

    monkeypatch.setattr(Session, "reply_on_engine", replied)
    session.turn("the dog " * 20)
    assert session.messages[-1] == {"role": "assistant", "content": "Woof"} and turns[0] not in session.messages
    session.give_up_last_reply()
    assert session.messages == turns and session.replies == []


def test_a_reply_cut_by_the_context_says_so(chat_llama, capsys, monkeypatch):
    # --length -1 (or a length past the room): a reply that ends at the context's end, not at its length, is said
    import torch

    from rungen.generation import Sequence, Settings
    from rungen.loading import load
    from rungen.session import Session

    def replied(self, engine, prompt, settings, control):
        room = self.loaded.context - len(prompt.ids)
        return [Sequence("w" * room, "w" * room, len(prompt.ids), room, "length")], True, None, 0

    monkeypatch.setattr(Session, "reply_on_engine", replied)
    loaded = load(chat_llama, device=torch.device("cpu"))
    session = Session(loaded, Settings(chat=True, length=loaded.context))
    session.turn("Hello")
    assert "(the reply stopped at the end of the model's context of 128 tokens)" in capsys.readouterr().err
    monkeypatch.setattr(Session, "reply_on_engine", lambda self, *a: ([Sequence("w", "w", 9, 1, "length")], True,
                                                                       None, 0))
    session.turn("Hello")  # one that ends at its length says nothing of the sort
    assert "end of the model's context" not in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_keeps_it(tiny_models, tmp_path):
    # Context 100000, so that a reply of 50000 tokens is still being generated when Ctrl-C comes.
    model = with_chat_template(tiny_models["llama"], str(tmp_path / "long"), max_position_embeddings=100000)
    tokenizer = AutoTokenizer.from_pretrained(model)
    terminal = start(["--model_name_or_path", model, "--temperature", "0", "--length", "50000"], tmp_path)
    terminal.send("Hello there\r")
    deadline = time.monotonic() + 300
    while not terminal.stdout() and time.monotonic() < deadline:  # the reply is streaming
        time.sleep(0.1)
    terminal.send("\x03")  # Ctrl-C
    stats = terminal.expect(STATS)
    terminal.expect(PROMPT)
    assert b"interrupted" in stats[0] and 0 < int(stats["reply"]) < 50000
    terminal.command(f"/save {tmp_path / 'chat.jsonl'}")
    messages = json.loads((tmp_path / "chat.jsonl").read_text())["messages"]
    # What was printed is the reply kept in the conversation, and the next turn is asked with it.
    assert messages[1]["role"] == "assistant" and terminal.stdout().strip() == messages[1]["content"].strip()
    terminal.command("/set length 3")
    prompt_tokens, _ = terminal.ask("And then")
    assert prompt_tokens == conversation_tokens(tokenizer, messages + [{"role": "user", "content": "And then"}])
    terminal.send("half a line")
    time.sleep(0.5)
    terminal.send("\x03")  # Ctrl-C on a typed line drops the line and asks again
    terminal.expect(PROMPT)
    # CPython's readline shows the prompt before it waits for input, and hears a SIGINT only while it waits: one sent
    # as the prompt shows (a loaded machine stretching the gap) is heard at the next key.
    time.sleep(0.5)
    terminal.send("\x03")  # Ctrl-C at an empty prompt ends the session
    assert terminal.wait() == 0
    assert "Traceback" not in terminal.output.decode()


@pytest.mark.slow
def test_plain_continuation_and_multi_line_input(chat_llama, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    args = ["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "8", "--no-chat"]
    terminal = start(args, tmp_path)
    first = terminal.ask("Hello there")
    assert terminal.ask("Hello there") == first  # no history: each prompt is continued on its own
    terminal.send("Hello\\\r")
    terminal.expect(re.compile(rb"\.\.\. "))  # the continuation prompt
    two_lines = terminal.ask("there")
    terminal.send('"""\r')
    terminal.send("Hello\r")
    block = terminal.ask('there"""')
    terminal.send("\x04")
    assert terminal.wait() == 0
    assert "Plain continuation" in terminal.output.decode()
    assert first[0] == len(tokenizer.encode("Hello there"))
    assert two_lines[0] == block[0] == len(tokenizer.encode("Hello\nthere"))
    # A plain session continues a prompt as the pipe does.
    piped = run_main(args + ["--output_format", "jsonl"], stdin="Hello there\n")
    assert piped.returncode == 0, piped.stderr.decode()
    replies = terminal.stdout().splitlines()
    assert replies[0] == replies[1] and replies[0].strip() == jsonl(piped.stdout)[0]["generated_text"].strip()


@pytest.mark.slow
def test_default_model_session_is_quiet_and_converses(default_model, tmp_path):
    cache_home, _, _ = default_model
    # In float (--dequantize): in its own blocks the model answers with a French list, as llama.cpp does. Its
    # one-time conversion (and its notice) happens before the session, which must show nothing but itself.
    assert run_main(["--dequantize", "--prompt", "Hi", "--length", "1"], cache_home=cache_home).returncode == 0
    terminal = Terminal(["--dequantize", "--temperature", "0", "--length", "24"], cache_home)
    terminal.expect(PROMPT)
    before = terminal.output.decode()
    first = terminal.ask("What is the capital of France?")
    second = terminal.ask("Say it again.")
    terminal.send("\x04")
    assert terminal.wait() == 0
    shown = terminal.output.decode()
    # Nothing but the session's own line before the first prompt: no argument dump, no logs, no bars.
    assert before.strip().splitlines() == ["run_generation.py: Chat (the model's chat template). /help for commands, "
                                           "Ctrl-D or /exit to end.", ">>>"]
    assert "Paris" in shown[len(before) :]
    assert second[0] > first[0] + first[1]  # the reply and the question are part of the second prompt


@pytest.mark.parametrize("flags, message", [
    (["--input_format", "jsonl"], "--input_format jsonl is how piped stdin is read; with a terminal on stdin a "
                                  "session starts: pipe the prompts in"),
    (["--whole_stdin"], "--whole_stdin is how piped stdin is read"),
    (["--output_format", "jsonl"], "--output_format jsonl is for piped prompts: a session prints its replies as text"),
    (["--output_format", "jsonl", "--logprobs", "2"], "--output_format jsonl is for piped prompts"),
    (["--num_return_sequences", "3", "--temperature", "1"], "--num_return_sequences: a session gives one reply"),
    (["--system", "Be brief."], "--system is the chat template's system message: this session has no template"),
    (["--batch_size", "4"], "--batch_size: a session replies to one prompt at a time"),
])
def test_a_session_refuses_what_only_piped_prompts_do(tiny_models, monkeypatch, capsys, flags, message):
    # with a terminal on stdin a session starts: these flags would be dropped there, so they are refused
    import io

    from helpers import error_of

    class TerminalStdin(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", TerminalStdin())
    code, line = error_of(["--model_name_or_path", tiny_models["gpt2"], *flags], capsys)
    assert code == 2 and message in line


# Conversations and system messages from pipes


def test_piped_chat_takes_a_system_message(chat_llama, tokenizer):
    base = ["--model_name_or_path", chat_llama, "--temperature", "0", "--length", "4", "--output_format", "jsonl"]
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Hello there"}
    [chat] = jsonl(run_main(base + ["--chat", "--system", "Be brief.", "--prompt", "Hello there"]).stdout)
    assert chat["num_prompt_tokens"] == conversation_tokens(tokenizer, [system, user])
    # A conversation gets --system only when it has no system message of its own.
    stdin = "\n".join(json.dumps({"messages": m}) for m in ([user], [dict(system, content="Own."), user]))
    result = run_main(base + ["--input_format", "jsonl", "--system", "Be brief."], stdin=stdin)
    records = jsonl(result.stdout)
    assert [r["num_prompt_tokens"] for r in records] == [
        conversation_tokens(tokenizer, [system, user]), conversation_tokens(tokenizer, [dict(system, content="Own."),
                                                                                        user])]
    assert records[0]["generated_text"] == chat["generated_text"] and records[0]["text"] == chat["generated_text"]
    # Without --chat, piped text prompts stay plain even when the model has a template.
    [plain] = jsonl(run_main(base, stdin="Hello there").stdout)
    assert plain["num_prompt_tokens"] == len(tokenizer.encode("Hello there"))
    # --system where no line is a conversation, and --prefix where every line is one: nothing would take them.
    for flags, stdin, message in (
            (["--system", "Be brief."], '{"prompt": "Hi"}', "--system is for the chat template, and no line is a "
                                                             "conversation: add --chat"),
            (["--prefix", "Answer: "], json.dumps({"messages": [user]}), "--prefix goes before text prompts, and "
                                                                       "every line is a conversation")):
        refused = run_main(base + ["--input_format", "jsonl", *flags], stdin=stdin)
        assert refused.returncode == 2 and message in refused.stderr.decode() and refused.stdout == b""
    # Scored, a conversation line's record holds no text of its own (the reply's), as with --chat
    [scored] = jsonl(run_main(base[:2] + ["--length", "0", "--logprobs", "0", "--output_format", "jsonl",
                                           "--input_format", "jsonl"], stdin=json.dumps({"messages": [user]})).stdout)
    assert scored["text"] == scored["generated_text"] == "" and scored["prompt_logprobs"]
    mixed = run_main(base + ["--input_format", "jsonl", "--prefix", "Answer: "],
                     stdin=json.dumps({"messages": [user]}) + '\n{"prompt": "Hi"}')  # the text line takes it
    assert mixed.returncode == 0 and len(jsonl(mixed.stdout)) == 2


def test_a_conversation_needs_a_chat_template(tiny_models):
    stdin = '{"messages": [{"role": "user", "content": "Hi"}]}\n{"prompt": "Hi"}\n{"messages": []}\n'
    args = ["--model_name_or_path", tiny_models["gpt2"], "--input_format", "jsonl", "--output_format", "jsonl"]
    result = run_main(args, stdin=stdin)
    assert result.returncode == 1
    records = jsonl(result.stdout)
    assert records[0]["error"] == "this tokenizer has no chat template" and "error" not in records[1]
    assert records[2]["error"] == '"messages": must be a non-empty list'
