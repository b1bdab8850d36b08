"""Fast tier: the pure pieces of a terminal session (rungen/session.py), no model."""

import json
import math
import os

import pytest

from rungen.errors import UsageError
from rungen.generation import Settings
from rungen.session import LineJoiner, describe_settings, fit_to_context, set_setting, split_input, turn_stats

# Commands


@pytest.mark.parametrize(
    "line, expected",
    [
        ("/help", ("help", "")),
        ("/set k 5", ("set", "k 5")),
        ("/SET  temperature   0.5 ", ("set", "temperature   0.5")),
        ("/save ~/chat.jsonl", ("save", "~/chat.jsonl")),
        ("/", ("", "")),
        ("//etc/hosts", (None, "/etc/hosts")),  # a prompt that starts with /
        ("Hello /set", (None, "Hello /set")),
        (" /help", (None, " /help")),  # only at the very start
    ],
)
def test_split_input(line, expected):
    assert split_input(line) == expected


# Multi-line input


def feed(*lines):
    joiner, done = LineJoiner(), []
    for line in lines:
        text = joiner.feed(line)
        if text is not None:
            done.append(text)
    return done, joiner.pending


def test_a_backslash_continues_the_line():
    assert feed("one") == (["one"], False)
    assert feed("one\\", "two\\", "three") == (["one\ntwo\nthree"], False)
    assert feed("one\\") == ([], True)


def test_triple_quotes_make_a_block():
    assert feed('"""', "one", "", "two\\", '"""') == (["one\n\ntwo\\"], False)  # a backslash is text in a block
    assert feed('"""one', 'two"""') == (["one\ntwo"], False)
    assert feed('"""one line"""', "next") == (["one line", "next"], False)
    assert feed('"""', "one") == ([], True)


# The context


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def count_words(messages):
    return sum(len(message["content"].split()) for message in messages)


def test_the_oldest_turns_go_first_and_the_system_message_stays():
    system = {"role": "system", "content": "s"}
    turns = [user("a a"), assistant("b b"), user("c c"), assistant("d d"), user("e e")]  # 2 words each
    assert fit_to_context([system, *turns], count_words, 11) == ([system, *turns], 0)
    assert fit_to_context([system, *turns], count_words, 10) == ([system, *turns[2:]], 1)
    assert fit_to_context([system, *turns], count_words, 5) == ([system, turns[4]], 2)
    assert fit_to_context(turns, count_words, 0) == ([turns[4]], 2)  # the question being asked always stays


def test_a_turn_is_everything_up_to_the_next_user_message():
    messages = [user("a"), assistant("b"), assistant("c"), user("d")]
    assert fit_to_context(messages, count_words, 3) == ([user("d")], 1)
    assert fit_to_context([user("x")], lambda messages: math.inf, 5) == ([user("x")], 0)


# /set


def test_set_changes_one_setting_of_a_new_value():
    settings = Settings(temperature=1.0, length=20)
    changed = set_setting(settings, "temperature", "0", context=128)
    assert changed.temperature == 0.0 and settings.temperature == 1.0  # frozen: a new value
    assert set_setting(settings, "length", "500", context=128).length == 128  # clamped as the flag is
    assert set_setting(settings, "length", "-1", context=128).length == 128
    assert set_setting(settings, "stop_token", ".", context=0).stop_token == "."
    assert set_setting(settings, "stop_token", '"\\n"', context=0).stop_token == "\n"  # a line break, in quotes
    assert set_setting(Settings(stop_token="."), "stop_token", "none", context=0).stop_token is None
    assert set_setting(settings, "num_beams", "3", context=0).num_beams == 3


def test_several_stop_strings_are_set_and_shown_as_json():
    # As --stop_token repeated gives them; shown as /set takes them back (a line break in quotes).
    settings = set_setting(Settings(), "stop_token", '["\\n", "."]', context=0)
    assert settings.stop_token == ("\n", ".")
    assert describe_settings(settings, ["stop_token"]) == '  stop_token          ["\\n", "."]'
    assert set_setting(Settings(), "stop_token", '["."]', context=0).stop_token == "."
    assert describe_settings(Settings(stop_token=None), ["stop_token"]).endswith("none")
    for bad in ("[]", '[""]', "[1]", "[oops"):
        with pytest.raises(UsageError, match="a value in brackets is a JSON array of non-empty strings"):
            set_setting(Settings(), "stop_token", bad, context=0)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("temperature", "-1", "--temperature must be >= 0, got -1.0"),  # the flag's own message
        ("k", "-2", "--k must be >= 0, got -2"),
        ("p", "0", "--p must be in (0, 1], got 0.0"),
        ("repetition_penalty", "0", "--repetition_penalty must be > 0, got 0.0"),
        ("k", "x", "k takes an integer, got 'x'"),
        ("p", "high", "p takes a number, got 'high'"),
        ("temperature", "", "/set temperature needs a value"),
        ("seed", "1", "unknown setting 'seed'; /set takes one of: length, temperature, k, p, repetition_penalty"),
        ("temperature", "nan", "temperature must be a finite number, got nan"),
        ("repetition_penalty", "inf", "repetition_penalty must be a finite number, got inf"),
        ("length", "0", "length 0 scores prompts"),
        ("stop_token", '"\\n', 'stop_token: a value in quotes is a JSON string of one or more characters'),
        ("stop_token", '""', 'stop_token: a value in quotes is a JSON string of one or more characters'),
    ],
)
def test_set_refuses_bad_values_with_one_line(name, value, message):
    with pytest.raises(UsageError) as error:
        set_setting(Settings(), name, value, context=128)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_turn_stats():
    assert turn_stats(30, 11, 0.0, 0.5, 1.5) == "(30 prompt + 11 reply tokens, first token 0.50 s, 10.0 tokens/s)"
    assert turn_stats(30, 1, 0.0, 0.5, 0.5, interrupted=True) == (
        "(30 prompt + 1 reply tokens, first token 0.50 s, interrupted)")
    assert turn_stats(30, 0, 0.0, None, 0.5) == "(30 prompt + 0 reply tokens)"
    assert turn_stats(30, 2, 0.0, 0.5, 1.5, reused=24) == (
        "(30 prompt (24 cached) + 2 reply tokens, first token 0.50 s, 1.0 tokens/s)")


# Ctrl-C at the prompt


class Keys:
    """A terminal whose reads give these keys: a line, "^C" (KeyboardInterrupt at an empty prompt), then Ctrl-D."""

    def __init__(self, *keys):
        self.keys = list(keys)

    def read(self, prompt):
        if not self.keys:
            raise EOFError
        key = self.keys.pop(0)
        if key == "^C":
            raise KeyboardInterrupt
        return key

    def typed(self):
        return ""


@pytest.mark.parametrize("printed, out", [("", ""), ("The rep", "The rep\n")])
def test_a_reply_given_up_ends_its_line_and_writes_no_empty_one(printed, out, capsys, monkeypatch):
    """A second Ctrl-C during a reply: what it printed gets its line ended; where it printed nothing yet, stdout (a
    file of replies) gets no empty line."""
    import sys

    from rungen.session import LineEnds, Repl, Session

    session = Session(None, Settings(chat=True))

    def turn(text):
        sys.stdout.write(printed)
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "turn", turn)
    monkeypatch.setattr(sys, "stdout", LineEnds(sys.stdout))  # as run() puts it for the session's duration
    Repl(session).loop(Keys("Hi", "/exit"))
    captured = capsys.readouterr()
    assert captured.out == out and "reply given up" in captured.err


@pytest.mark.parametrize("since, ends", [(0.1, False), (5.0, True)])
def test_a_double_ctrl_c_gives_the_stopped_reply_up_and_a_later_one_ends_the_session(since, ends, capsys):
    """A reply the first Ctrl-C stopped ended within a token: the second press, soon after, lands at the empty
    prompt, and gives that reply up (as it would during the reply) instead of ending the session; pressed later it
    ends the session."""
    import time

    from rungen.session import Repl, Session

    session = Session(None, Settings(chat=True))
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    session.replies = ["Hel"]
    session.stopped_at = time.monotonic() - since
    terminal = Keys("^C", "/exit")
    Repl(session).loop(terminal)
    assert terminal.keys == (["/exit"] if ends else [])  # it ended at the Ctrl-C, or read on to /exit
    assert (session.messages, session.replies) == (([{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Hel"}], ["Hel"]) if ends
                                                   else ([], []))
    assert ("reply given up" in capsys.readouterr().err) is not ends


def test_ctrl_c_waits_until_a_deferred_block_is_done():
    """A session releasing one model and building the other defers Ctrl-C: the model is never left half swapped,
    and the press still acts once the block is done. (A process: signals are heard by a main thread, which a test
    worker's may not be.)"""
    import subprocess
    import sys

    script = """
import os, signal, time
from rungen.interrupt import ctrl_c_deferred
done = []
try:
    with ctrl_c_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a handler would have run by now
        done.append("swapped")
except KeyboardInterrupt:
    print(done, "then KeyboardInterrupt")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.stdout.strip() == "['swapped'] then KeyboardInterrupt", result.stderr


# /save


def saving_session():
    from rungen.session import Session

    session = Session(None, Settings(chat=True))
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    return session


def test_save_writes_through_a_link_and_keeps_a_private_files_mode(tmp_path, capsys):
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("old\n")
    real.chmod(0o600)
    link.symlink_to(real)
    saving_session().save(str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link
    assert json.loads(real.read_text())["messages"][1]["content"] == "Hello"
    assert real.stat().st_mode & 0o777 == 0o600
    assert f"(saved to {link})" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]  # no temporary file left


def test_save_refuses_what_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    session = saving_session()
    session.save(str(fifo))
    assert f"error: cannot write {fifo}: not a regular file" in capsys.readouterr().err
    assert fifo.is_fifo()  # not replaced by a regular file
    session.save(str(tmp_path))
    assert f"error: cannot write {tmp_path}: it is a directory" in capsys.readouterr().err
    missing = tmp_path / "no such folder" / "chat.jsonl"
    session.save(str(missing))
    err = capsys.readouterr().err
    assert f"error: cannot write {missing}: cannot create a file in {missing.parent} (No such file" in err


def test_set_says_where_a_value_does_not_act_as_typed(capsys):
    # As the flags warn at start: k and p at temperature 0, a length the context cuts to itself.
    import types

    from rungen.session import Repl, Session

    session = Session(types.SimpleNamespace(context=128), Settings(chat=True, temperature=0.0))
    repl = Repl(session)
    repl.command("set", "k 5")
    assert "(k applies to sampling only: it takes effect once temperature is above 0)" in capsys.readouterr().err
    repl.command("set", "length 500")
    assert "(length: up to the model's context, 128 tokens)" in capsys.readouterr().err
    repl.command("set", "temperature 0.7")
    repl.command("set", "p 0.5")
    repl.command("set", "length 128")
    err = capsys.readouterr().err
    assert "applies to sampling only" not in err and "up to the model's context" not in err
    assert session.settings.length == 128


@pytest.mark.parametrize("reply, out", [("<think>hmm, still thinking", ""), ("<think>hmm</think>Paris.", "Paris.\n")])
def test_a_thinking_reply_puts_its_answer_alone_on_stdout(reply, out, capsys):
    """The reasoning to stderr, the answer to stdout ended with a line; a reply all reasoning (cut by its length)
    leaves stdout, a file of answers, without an empty line."""
    from rungen.reasoning import THINK, ReplyPlan
    from rungen.session import ReplyWriter

    writer = ReplyWriter(ReplyPlan(THINK, "start"), show=True)
    for piece in (reply[:9], reply[9:]):  # streamed in two pieces
        writer(piece)
    writer.finish()
    captured = capsys.readouterr()
    assert captured.out == out and "hmm" in captured.err
