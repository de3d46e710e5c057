"""`lily serve --cache-dir`: sessions that survive a restart (the real binary, the tiny model, CPU backend).
A conversation's second turn after SIGTERM or SIGKILL of the server resumes from the session file (cached_tokens
> 0) with the same greedy output as without a restart, with --speculative mtp:K too (the files then hold the MTP
head's state); truncated, corrupted, foreign, junk and unreadable files, and files without the head's state on a
server with it, and unusable directories are refused with a warning naming the file and the reason, and the
request prefills with the same output; a file with the head's state resumes a server without --speculative;
--cache-disk-budget evicts files.
Run: LILY_BIN=build/lily python3 tests/python/test_session_disk.py [TEST_NAME...]"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from lily_harness import LILY_BIN, LilyServer, Runner, main_guard, make_tiny_model

SYSTEM = "You are a helpful assistant. Answer briefly and precisely; when unsure, say so."
SPEC = ("--speculative", "mtp:2")


def chat(server, messages):
    status, raw = server.request("POST", "/v1/chat/completions",
                                 {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert status == 200, (status, raw)
    j = json.loads(raw)
    return j["choices"][0]["message"], j["usage"]


def turn_one():
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


def turn_two(reply):
    assistant = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning_content"):
        assistant["reasoning_content"] = reply["reasoning_content"]
    return turn_one() + [assistant, {"role": "user", "content": "And of Italy?"}]


def output(message):
    return (message.get("content"), message.get("reasoning_content"), message.get("tool_calls"))


def session_files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".lsess"))


def wait_for(pred, what, timeout=20):
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.05)


class Suite:
    def __init__(self):
        self.model = make_tiny_model()
        self.tmp = tempfile.mkdtemp(prefix="lily_sessdisk_")
        # Reference: both turns on one server with no disk tier.
        s = LilyServer(self.model).start()
        try:
            self.reply1, u1 = chat(s, turn_one())
            self.reply2, self.usage2 = chat(s, turn_two(self.reply1))
        finally:
            s.stop()
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0, u1
        assert self.usage2["prompt_tokens_details"]["cached_tokens"] > 0, self.usage2
        self.n = 0

    def fresh_dir(self):
        self.n += 1
        d = os.path.join(self.tmp, "cache%d" % self.n)
        os.makedirs(d)
        return d

    def first_turn(self, d, sig=signal.SIGTERM, model=None, extra=()):
        """Turn one on a server with --cache-dir d (and `extra` arguments), then the server is stopped with `sig`;
        the new session file."""
        before = set(session_files(d)) if os.path.isdir(d) else set()
        name = ["--served-model-name", "tiny"] if model else []
        s = LilyServer(model or self.model, "--cache-dir", d, *name, *extra).start()
        try:
            reply, _ = chat(s, turn_one())
            if model is None:
                assert output(reply) == output(self.reply1), (reply, self.reply1)
            if sig == signal.SIGKILL:
                wait_for(lambda: session_files(d), "the session file")
                s.kill()
            else:
                assert s.stop(sig) == 0, "\n".join(s.lines)
        finally:
            s.kill()
        files = sorted(set(session_files(d)) - before)
        assert len(files) == 1, (files, before)
        return files[0]

    def second_turn(self, d, expect_cached, extra=()):
        """Turn two on a restarted server (with `extra` arguments); checks the output against the reference;
        returns its stderr lines (its metrics in self.last_metrics)."""
        s = LilyServer(self.model, "--cache-dir", d, *extra).start()
        try:
            reply, usage = chat(s, turn_two(self.reply1))
            self.last_metrics = s.metrics()
            lines = list(s.lines)
            assert s.stop() == 0
        finally:
            s.kill()
        assert output(reply) == output(self.reply2), (reply, self.reply2, "\n".join(lines))
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if expect_cached:
            assert cached == self.usage2["prompt_tokens_details"]["cached_tokens"], (usage, self.usage2)
        else:
            assert cached == 0, usage
        return lines

    def refused(self, lines, path, reason):
        hits = [l for l in lines if ("refusing %s: " % path) in l and reason in l]
        assert len(hits) == 1, (path, reason, "\n".join(lines))
        return hits[0]

    # --- the tests

    def test_resumes_after_sigterm(self):
        d = self.fresh_dir()
        self.first_turn(d)
        lines = self.second_turn(d, expect_cached=True)
        assert not [l for l in lines if "refusing" in l], lines

    def test_resumes_after_sigkill(self):
        d = self.fresh_dir()
        self.first_turn(d, sig=signal.SIGKILL)
        self.second_turn(d, expect_cached=True)

    def test_sigkill_at_any_time_leaves_no_bad_file(self):
        """Killed right after answering (the writer may be mid-file), five times over: every restart indexes the
        directory without a refusal, and no temporary survives it."""
        d = self.fresh_dir()
        for i in range(5):
            s = LilyServer(self.model, "--cache-dir", d).start()
            try:
                lines = list(s.lines)
                chat(s, [{"role": "user", "content": "round %d" % i}])
                time.sleep(0.002 * i)
                s.kill()
            finally:
                s.kill()
            assert not [l for l in lines if "refusing" in l], lines
            assert not [f for f in os.listdir(d) if f.endswith(".tmp") and ".%d." % s.proc.pid not in f], os.listdir(d)
        self.first_turn(d)
        self.second_turn(d, expect_cached=True)

    def test_two_servers_share_a_directory(self):
        """Both write the same conversation into one directory at once; a third server resumes from it."""
        d = self.fresh_dir()
        a = LilyServer(self.model, "--cache-dir", d).start()
        b = LilyServer(self.model, "--cache-dir", d).start()
        try:
            results = []
            threads = [threading.Thread(target=lambda s=s: results.append(chat(s, turn_one()))) for s in (a, b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [output(r[0]) for r in results] == [output(self.reply1)] * 2, results
            assert a.stop() == 0 and b.stop() == 0
        finally:
            a.kill()
            b.kill()
        assert len(session_files(d)) == 2, os.listdir(d)
        lines = self.second_turn(d, expect_cached=True)
        assert not [l for l in lines if "refusing" in l], lines

    def test_missing_directory_is_created(self):
        d = os.path.join(self.fresh_dir(), "not", "there", "yet")
        self.first_turn(d)
        self.second_turn(d, expect_cached=True)

    def test_truncated_file(self):
        d = self.fresh_dir()
        f = self.first_turn(d)
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
        line = self.refused(self.second_turn(d, expect_cached=False), f, "truncated")
        assert line.endswith("; deleted"), line

    def test_flipped_byte(self):
        d = self.fresh_dir()
        f = self.first_turn(d)
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x40]))
        self.refused(self.second_turn(d, expect_cached=False), f, "checksum mismatch")
        assert not os.path.exists(f)

    def test_wrong_format_version(self):
        d = self.fresh_dir()
        f = self.first_turn(d)
        with open(f, "r+b") as fh:
            fh.seek(8)
            fh.write(bytes([77]))
        line = self.refused(self.second_turn(d, expect_cached=False), f, "format version 77")
        assert line.endswith("; left in place") and os.path.exists(f), line

    def test_file_of_another_model(self):
        other = os.path.join(self.tmp, "other_model")
        subprocess.run([LILY_BIN, "synth", "--preset", "tiny", "--layout", "mlx", "--seed", "7", "--out", other],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        d = self.fresh_dir()
        f = self.first_turn(d, model=other)
        line = self.refused(self.second_turn(d, expect_cached=False), f, "another model")
        assert line.endswith("; left in place") and os.path.exists(f), line

    def test_junk_and_unreadable_files(self):
        d = self.fresh_dir()
        junk = os.path.join(d, "junk.lsess")
        with open(junk, "wb") as fh:
            fh.write(os.urandom(4096))
        unreadable = os.path.join(d, "locked.lsess")
        if os.geteuid() == 0:  # root reads any file: a directory is what cannot be read as one
            os.mkdir(unreadable)
        else:
            shutil.copy(junk, unreadable)
            os.chmod(unreadable, 0)
        lines = self.second_turn(d, expect_cached=False)
        self.refused(lines, junk, "no magic")
        self.refused(lines, unreadable, "not a regular file" if os.geteuid() == 0 else "Permission denied")
        assert not os.path.exists(junk) and os.path.exists(unreadable)
        if os.geteuid() != 0:
            os.chmod(unreadable, 0o600)

    def test_unusable_directory(self):
        d = self.fresh_dir()
        plain = os.path.join(d, "a_file")
        with open(plain, "w") as fh:
            fh.write("x")
        for bad in [plain, os.path.join(plain, "sub")]:
            s = LilyServer(self.model, "--cache-dir", bad).start()
            try:
                r1, _ = chat(s, turn_one())
                r2, _ = chat(s, turn_two(r1))
                assert output(r2) == output(self.reply2)
                lines = list(s.lines)
                assert s.stop() == 0
            finally:
                s.kill()
            warn = [l for l in lines if ("--cache-dir %s: " % bad) in l and "sessions are kept in memory only" in l]
            assert len(warn) == 1, lines
        if os.geteuid() != 0:
            ro = os.path.join(d, "read_only")
            os.mkdir(ro, 0o500)
            s = LilyServer(self.model, "--cache-dir", ro).start()
            try:
                lines = list(s.lines)
                assert s.stop() == 0
            finally:
                s.kill()
            assert [l for l in lines if "cannot write in it" in l], lines

    def test_disk_budget_evicts(self):
        d = self.fresh_dir()
        size = os.path.getsize(self.first_turn(d))
        shutil.rmtree(d)
        s = LilyServer(self.model, "--cache-dir", d, "--cache-disk-budget", str(int(size * 2.5))).start()
        try:
            for i in range(4):
                chat(s, [{"role": "user", "content": "conversation %d: say something" % i}])
                wait_for(lambda: s.metrics()["lily_session_disk_writes_total"] == i + 1, "write %d" % (i + 1))
            m = s.metrics()
            assert m["lily_session_disk_files"] == 2, m
            assert m["lily_session_disk_evictions_total"] == 2, m
            assert m["lily_session_disk_bytes"] <= size * 2.5, m
            assert len(session_files(d)) == 2, session_files(d)
            assert s.stop() == 0
        finally:
            s.kill()

    def test_bad_budget_is_refused(self):
        for bad, msg in [("20X", "is not a size"), ("0", "0 would hold no session")]:
            p = subprocess.run([LILY_BIN, "serve", "--model", self.model, "--port", "0", "--cache-dir",
                                os.path.join(self.tmp, "b"), "--cache-disk-budget", bad],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
            assert p.returncode == 2 and msg in p.stderr.decode(), (p.returncode, p.stderr)

    def test_speculative_resumes_after_restart(self):
        """With --speculative the files hold the MTP head's state too: the second turn after a restart resumes from
        the file (the reference's cached tokens and greedy output, those of a server without speculation) and
        drafts."""
        d = self.fresh_dir()
        self.first_turn(d, extra=SPEC)
        lines = self.second_turn(d, expect_cached=True, extra=SPEC)
        assert not [l for l in lines if "refusing" in l], lines
        assert self.last_metrics["lily_speculative_drafted_tokens_total"] > 0, self.last_metrics

    def test_files_with_and_without_the_mtp_head(self):
        """A file without the head's state (written without --speculative) is refused by a server with it, left in
        place, and the request prefills; a file with it resumes a server without --speculative."""
        d = self.fresh_dir()
        f = self.first_turn(d)
        line = self.refused(self.second_turn(d, expect_cached=False, extra=SPEC), f,
                            "saved without the MTP head's state")
        assert line.endswith("; left in place") and os.path.exists(f), line
        d = self.fresh_dir()
        self.first_turn(d, extra=SPEC)
        lines = self.second_turn(d, expect_cached=True)
        assert not [l for l in lines if "refusing" in l], lines


def main():
    suite = Suite()
    names = sys.argv[1:] or [n for n in dir(Suite) if n.startswith("test_")]
    runner = Runner()
    try:
        for n in names:
            runner.run(n, getattr(suite, n))
    finally:
        shutil.rmtree(suite.tmp, True)
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
