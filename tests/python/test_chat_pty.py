"""`lily chat` in a real pseudo-terminal (Python's pty module), typed at as a person would: arrow-key and Home
edits reach the message sent, Up and Ctrl-R recall earlier lines, the history is saved under $XDG_STATE_HOME and
read back by the next chat, `/exit` still works after arrow keys (a plain read took their escape codes into the
line, so `/exit` stopped being a command), a line ending in a backslash goes on, Ctrl-Z and `fg` (chat as a job of
an interactive bash) leave the terminal usable and the line intact, and Ctrl-C stops an answer, twice at the
prompt exits. What was sent is read back from `--save`. Piped input is covered by tests/engine/test_engine_cli.cpp.

usage: LILY_BIN=build/lily python3 tests/python/test_chat_pty.py
"""
import json
import os
import pty
import select
import shlex
import signal
import tempfile
import time

from lily_harness import LILY_BIN, Runner, main_guard, make_tiny_model

LEFT, RIGHT, UP, HOME = b"\x1b[D", b"\x1b[C", b"\x1b[A", b"\x1b[H"
CTRL_R, CTRL_C, CTRL_D, CTRL_Z = b"\x12", b"\x03", b"\x04", b"\x1a"


class Chat:
    """`lily chat` on the tiny model with a pseudo-terminal as its stdin, stdout and stderr."""

    def __init__(self, model, state_dir, save, max_tokens=4, in_shell=False):
        """in_shell: run chat as a job of an interactive bash (job control: Ctrl-Z, fg) on the terminal."""
        self.save, self.out = save, b""
        args = [LILY_BIN, "chat", "--model", model, "--backend", "cpu", "--threads", "1", "--temperature", "0",
                "--max-tokens", str(max_tokens), "--save", save]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its controlling terminal is the pty
            env = dict(os.environ, TERM="xterm", XDG_STATE_HOME=state_dir, LANG="C.UTF-8", PS1="$ ")
            try:
                if in_shell:
                    os.execve("/bin/bash", ["bash", "--norc", "--noprofile", "-i"], env)
                os.execve(LILY_BIN, args, env)
            finally:
                os._exit(127)
        self.status = None
        if in_shell:
            self.type(" ".join(shlex.quote(a) for a in args).encode() + b"\r")
        self.expect("lily chat:")

    def pump(self, seconds):
        end = time.time() + seconds
        while time.time() < end:
            r, _, _ = select.select([self.fd], [], [], 0.02)
            if r:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    return False
                if not chunk:
                    return False
                self.out += chunk
        return True

    def expect(self, text, timeout=60, start=0):
        """Waits until `text` appears in the output after offset `start`; returns the offset just past it."""
        end = time.time() + timeout
        needle = text.encode()
        while time.time() < end:
            i = self.out.find(needle, start)
            if i >= 0:
                return i + len(needle)
            if not self.pump(0.05):
                break
        raise AssertionError("no %r in the chat's output: %r" % (text, self.out[-2000:].decode("utf-8", "replace")))

    def type(self, *keys):
        for k in keys:  # one write per key, as a terminal sends them
            os.write(self.fd, k)
            self.pump(0.05)

    def answer(self):
        """Waits for the usage line of the next answer and for the prompt after it: keys typed before the line
        editor has the terminal again can be flushed when it takes it (seen in CI: a Ctrl-D lost)."""
        self.mark = self.expect("tok/s", start=getattr(self, "mark", 0))
        self.expect("> ", start=self.mark)

    def wait_exit(self, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            self.pump(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.status = status
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        raise AssertionError("lily chat did not exit: %r" % self.out[-1000:].decode("utf-8", "replace"))

    def kill(self):
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except ProcessLookupError:
                pass

    def sent(self):
        with open(self.save) as f:
            return [m["content"] for m in json.load(f) if m["role"] == "user"]


def history_lines(state_dir):
    with open(os.path.join(state_dir, "lily", "chat_history")) as f:
        return f.read().splitlines()


def run_chat(fn, model, state_dir, **kw):
    save = os.path.join(state_dir, "conversation.json")
    chat = Chat(model, state_dir, save, **kw)
    try:
        return fn(chat)
    finally:
        chat.kill()


def test_exit_after_escape_sequences(model, tmp):
    state = tempfile.mkdtemp(dir=tmp)

    def go(chat):
        chat.type(b"hi\r")
        chat.answer()
        chat.type(LEFT, RIGHT, LEFT, b"/exit\r")  # arrows on an empty line, then the command
        assert chat.wait_exit() == 0
        assert chat.sent() == ["hi"], chat.sent()
    run_chat(go, model, state)


def test_edits_history_and_search(model, tmp):
    state = tempfile.mkdtemp(dir=tmp)

    def first(chat):
        assert b"history: " + state.encode() + b"/lily/chat_history" in chat.out, chat.out
        chat.type(b"Hello wrld", LEFT, LEFT, LEFT, b"o", HOME, b"Say ", b"\r")
        chat.answer()
        chat.type(b"second: beta\r")
        chat.answer()
        chat.type(CTRL_R, b"Hel", b"\r")  # reverse search finds the first line, not the last
        chat.answer()
        chat.type(UP, UP, b" again\r")  # Up twice: back past the search's own entry to "second: beta"
        chat.answer()
        chat.type(b"/exit\r")
        assert chat.wait_exit() == 0
        assert chat.sent() == ["Say Hello world", "second: beta", "Say Hello world", "second: beta again"], \
            chat.sent()
    run_chat(first, model, state)
    lines = history_lines(state)
    assert lines[0] == "_HiStOrY_V2_" and lines[1] == "Say\\040Hello\\040world" and lines[-1] == "/exit", lines
    assert os.stat(os.path.join(state, "lily", "chat_history")).st_mode & 0o077 == 0, "history readable by others"

    def second(chat):  # a new chat reads the saved history; Ctrl-C stops an answer, twice at the prompt exits
        chat.type(UP, UP, b"\r")  # "/exit", then "second: beta again"
        chat.expect("second: beta again")
        chat.pump(1.0)
        chat.type(CTRL_C)
        chat.expect("[stopped; ")
        chat.type(CTRL_C)
        chat.expect("Ctrl-C again")
        chat.type(CTRL_C)
        assert chat.wait_exit() == 0
        assert chat.sent() == ["second: beta again"], chat.sent()
    run_chat(second, model, state, max_tokens=20000)


def test_backslash_continues(model, tmp):
    state = tempfile.mkdtemp(dir=tmp)

    def go(chat):
        chat.type(b"first line \\\r")
        chat.expect("\u2026 ")  # the continuation prompt
        chat.type(b"  second line\r")
        chat.answer()
        chat.type(b"/exit\r")
        assert chat.wait_exit() == 0
        assert chat.sent() == ["first line \n  second line"], chat.sent()
    run_chat(go, model, state)
    assert history_lines(state)[1:] == ["first\\040line\\040\\134", "\\040\\040second\\040line", "/exit"], \
        history_lines(state)


def test_suspend_and_resume(model, tmp):
    state = tempfile.mkdtemp(dir=tmp)
    save = os.path.join(state, "conversation.json")
    chat = Chat(model, state, save, in_shell=True)
    try:
        chat.type(b"abc")
        chat.type(CTRL_Z)  # the job stops with the terminal given back in cooked mode ...
        at = chat.expect("Stopped")
        chat.type(b"fg\r")  # ... and on fg the editor takes it again and redraws the line
        chat.expect("abc", start=at)
        chat.type(b"xyz", LEFT, LEFT, b"Q", b"\r")
        chat.answer()
        chat.type(b"/exit\r")
        chat.expect("$ ", start=chat.mark)  # back at the shell's prompt
        chat.type(b"exit\r")
        assert chat.wait_exit() == 0
        assert chat.sent() == ["abcxQyz"], chat.sent()
    finally:
        chat.kill()


def test_history_that_cannot_be_saved(model, tmp):
    blocker = os.path.join(tmp, "not_a_dir")
    open(blocker, "w").close()  # XDG_STATE_HOME is a file: the history's folder cannot be made

    def go(chat):
        assert b"history not saved: cannot create " + blocker.encode() in chat.out, chat.out
        chat.type(b"one\r")
        chat.answer()
        chat.type(UP, b" two\r")  # the history still works in memory
        chat.answer()
        chat.type(CTRL_D)  # at an empty prompt: end of input
        assert chat.wait_exit() == 0
        assert chat.sent() == ["one", "one two"], chat.sent()
    chat_save = os.path.join(tmp, "conversation.json")
    chat = Chat(model, blocker, chat_save)
    try:
        go(chat)
    finally:
        chat.kill()


def main():
    model = make_tiny_model()
    tmp = tempfile.mkdtemp(prefix="lily_chat_pty_")
    runner = Runner()
    runner.run("chat: /exit works after arrow keys", lambda: test_exit_after_escape_sequences(model, tmp))
    runner.run("chat: arrow edits, Up, Ctrl-R, saved history, Ctrl-C", lambda: test_edits_history_and_search(model, tmp))
    runner.run("chat: a line ending in a backslash continues the message", lambda: test_backslash_continues(model, tmp))
    runner.run("chat: Ctrl-Z and fg keep the line being edited", lambda: test_suspend_and_resume(model, tmp))
    runner.run("chat: history kept in memory when it cannot be saved", lambda: test_history_that_cannot_be_saved(model, tmp))
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
