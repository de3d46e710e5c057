"""`lily pull` and `--model ORG/NAME` against a local hub (tests/hub/fake_hub.py) serving a synthetic model, and
the cache checked both ways with huggingface_hub: it finds what lily pulled (local_files_only), lily finds what it
downloaded. Also: gated (401/403 without the token, in with HF_TOKEN), missing repo and revision, a connection
cut mid-file (resumed with Range, automatically and on a second run), a corrupted blob (refused by sha256),
--include/--exclude, a commit sha as the revision, and `lily serve --model ORG/NAME`."""
import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lily_harness import LILY_BIN, LilyServer, Runner, main_guard  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_HUB = os.path.join(HERE, "..", "hub", "fake_hub.py")
TOKEN = "hf_test_token_123"
WEIGHTS = "model.safetensors"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Hub:
    """The fake hub on a free port, with a synthetic model under several repo ids."""

    def __init__(self, work, model_dir):
        self.work, self.log_path = work, os.path.join(work, "hub.log")
        spec = {"dir": model_dir}
        config = {"repos": {
            "org/tiny": spec,
            "org/gated": dict(spec, token=TOKEN),
            "org/cut": dict(spec, disconnect_once=[WEIGHTS]),
            "org/cut-again": dict(spec, disconnect_once=[WEIGHTS]),
            "org/corrupt": dict(spec, corrupt=[WEIGHTS]),
        }}
        cfg = os.path.join(work, "hub.json")
        with open(cfg, "w") as f:
            json.dump(config, f)
        port_file = os.path.join(work, "hub.port")
        self.proc = subprocess.Popen([sys.executable, FAKE_HUB, "--config", cfg, "--port-file", port_file,
                                      "--log", self.log_path])
        atexit.register(self.stop)
        deadline = time.time() + 30
        while not os.path.exists(port_file):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("fake hub did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            self.endpoint = "http://127.0.0.1:%s" % f.read().strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def log(self):
        with open(self.log_path) as f:
            return [json.loads(line) for line in f]


class Cases:
    def __init__(self, work, model_dir, hub):
        self.work, self.model_dir, self.hub = work, model_dir, hub
        self.cache = os.path.join(work, "cache")

    def env(self, cache=None, **extra):
        e = dict(os.environ, HF_ENDPOINT=self.hub.endpoint, HF_HUB_CACHE=cache or self.cache,
                 HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", HF_HOME=os.path.join(self.work, "hf_home"))
        e.pop("HF_TOKEN", None)
        e.update(extra)
        return e

    def lily(self, *args, cache=None, **env):
        return subprocess.run([LILY_BIN] + list(args), env=self.env(cache, **env), capture_output=True, text=True,
                              timeout=300)

    def pull(self, *args, ok=True, cache=None, **env):
        r = self.lily("pull", "--no-progress", *args, cache=cache, **env)
        if ok:
            assert r.returncode == 0, r.stderr
        return r

    def repo_dir(self, repo_id, cache=None):
        return os.path.join(cache or self.cache, "models--" + repo_id.replace("/", "--"))

    def expect_same_files(self, snapshot, names=None):
        names = names or sorted(os.listdir(self.model_dir))
        assert sorted(os.listdir(snapshot)) == sorted(names), (os.listdir(snapshot), names)
        for n in names:
            assert sha256(os.path.join(snapshot, n)) == sha256(os.path.join(self.model_dir, n)), n

    # ---- the cases ----------------------------------------------------------------------------------------

    def test_pull_writes_the_hub_cache_layout(self):
        r = self.pull("org/tiny")
        snapshot = r.stdout.strip()
        repo = self.repo_dir("org/tiny")
        with open(os.path.join(repo, "refs", "main")) as f:
            commit = f.read()
        assert snapshot == os.path.join(repo, "snapshots", commit), (snapshot, commit)
        self.expect_same_files(snapshot)
        for n in os.listdir(snapshot):
            link = os.path.join(snapshot, n)
            assert os.path.islink(link), n
            target = os.readlink(link)
            assert target.startswith("../../blobs/"), target
        weights_blob = os.readlink(os.path.join(snapshot, WEIGHTS)).split("/")[-1]
        assert weights_blob == sha256(os.path.join(self.model_dir, WEIGHTS)), "LFS blob named by sha256"
        assert not [b for b in os.listdir(os.path.join(repo, "blobs")) if b.endswith(".incomplete")]

    def huggingface_hub(self, code, cache):
        """Runs `code` with huggingface_hub in a child process (it reads HF_ENDPOINT when imported); the last
        line it prints is returned."""
        r = subprocess.run([sys.executable, "-c", "from huggingface_hub import *\n" + code],
                           env=self.env(cache), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip().splitlines()[-1]

    def test_huggingface_hub_finds_what_lily_pulled(self):
        self.pull("org/tiny")
        snap = self.huggingface_hub("print(snapshot_download('org/tiny', local_files_only=True))", self.cache)
        self.expect_same_files(snap)
        cfg = self.huggingface_hub("print(hf_hub_download('org/tiny', 'config.json', local_files_only=True))",
                                   self.cache)
        assert open(cfg).read() == open(os.path.join(self.model_dir, "config.json")).read()

    def test_second_pull_downloads_nothing(self):
        self.pull("org/tiny")
        before = len(self.hub.log())
        self.pull("org/tiny")
        gets = [e for e in self.hub.log()[before:] if e["method"] == "GET" and "/resolve/" in e["path"]]
        assert not gets, gets

    def test_model_id_runs_inspect_and_generate(self):
        self.pull("org/tiny")
        r = self.lily("inspect", "org/tiny")
        assert r.returncode == 0 and "mlx-lm" in r.stdout, r.stdout + r.stderr
        r = self.lily("generate", "--model", "org/tiny", "--backend", "cpu", "--prompt-ids", "1,2,3",
                      "--max-tokens", "2")
        assert r.returncode == 0, r.stderr

    def test_missing_model_says_to_pull(self):
        r = self.lily("inspect", "org/not-pulled-yet")
        assert r.returncode != 0 and "lily pull org/not-pulled-yet" in r.stderr, r.stderr

    def test_local_directory_wins(self):
        # A directory named like an id, relative to the working directory, is loaded as a directory.
        cwd = os.path.join(self.work, "cwd")
        os.makedirs(os.path.join(cwd, "org"), exist_ok=True)
        if not os.path.exists(os.path.join(cwd, "org", "tiny")):
            shutil.copytree(self.model_dir, os.path.join(cwd, "org", "tiny"))
        r = subprocess.run([os.path.abspath(LILY_BIN), "inspect", "org/tiny"], cwd=cwd,
                           env=self.env(cache=os.path.join(self.work, "empty-cache")), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    def test_gated_needs_the_token(self):
        r = self.pull("org/gated", ok=False)
        assert r.returncode == 1 and "gated or private" in r.stderr and "HF_TOKEN" in r.stderr, r.stderr
        r = self.pull("org/gated", ok=False, HF_TOKEN="wrong")
        assert r.returncode == 1 and "refused" in r.stderr, r.stderr
        r = self.pull("org/gated", HF_TOKEN=TOKEN)
        self.expect_same_files(r.stdout.strip())
        sent = [e["authorization"] for e in self.hub.log() if e["path"].startswith(("/api/models/org/gated/",
                                                                                   "/org/gated/"))]
        assert "Bearer " + TOKEN in sent, sent
        cdn = [e for e in self.hub.log() if e["path"].startswith("/cdn/org/gated/")]
        assert cdn and not any(e["authorization"] for e in cdn), "the token must not leave the hub's host"

    def test_missing_repo_and_revision(self):
        r = self.pull("org/nothing-here", ok=False)
        assert r.returncode == 1 and "not found" in r.stderr, r.stderr
        r = self.pull("org/tiny@no-such-branch", ok=False)
        assert r.returncode == 1 and "no revision `no-such-branch`" in r.stderr, r.stderr
        r = self.pull("not an id", ok=False)
        assert r.returncode == 2 and "ORG/NAME" in r.stderr, r.stderr

    def test_cut_connection_resumes_with_range(self):
        r = self.pull("org/cut-again")
        assert "resuming at byte" in r.stderr, r.stderr
        self.expect_same_files(r.stdout.strip())
        ranges = [e["range"] for e in self.hub.log() if e["path"].startswith("/cdn/org/cut-again/") and e["range"]]
        assert ranges and int(ranges[0][len("bytes="):-1]) > 0, ranges

    def test_cut_download_resumes_on_the_next_run(self):
        r = self.pull("--retries", "0", "org/cut", ok=False)
        assert r.returncode == 1 and "run `lily pull` again to resume" in r.stderr, r.stderr
        blobs = os.path.join(self.repo_dir("org/cut"), "blobs")
        partial = [b for b in os.listdir(blobs) if b.endswith(".incomplete")]
        assert len(partial) == 1, os.listdir(blobs)
        kept = os.path.getsize(os.path.join(blobs, partial[0]))
        assert 0 < kept < os.path.getsize(os.path.join(self.model_dir, WEIGHTS)), kept
        r = self.pull("org/cut")
        self.expect_same_files(r.stdout.strip())
        ranges = [e["range"] for e in self.hub.log() if e["path"].startswith("/cdn/org/cut/") and e["range"]]
        assert ranges == ["bytes=%d-" % kept], ranges

    def test_corrupted_blob_is_refused(self):
        r = self.pull("org/corrupt", ok=False)
        assert r.returncode == 1 and "sha256 mismatch" in r.stderr, r.stderr
        repo = self.repo_dir("org/corrupt")
        good = sha256(os.path.join(self.model_dir, WEIGHTS))
        assert not [b for b in os.listdir(os.path.join(repo, "blobs")) if b.startswith(good)], "no blob, no partial"
        snaps = os.path.join(repo, "snapshots")
        for commit in os.listdir(snaps) if os.path.isdir(snaps) else []:
            assert not os.path.lexists(os.path.join(snaps, commit, WEIGHTS))
        assert not os.path.exists(os.path.join(repo, "refs", "main")), "an incomplete snapshot gets no ref"

    def test_waits_for_a_download_in_progress(self):
        # The blob's lock is the file huggingface_hub locks (fcntl.flock) while it downloads the same blob.
        import fcntl
        cache = os.path.join(self.work, "cache-locked")
        lock = os.path.join(cache, ".locks", "models--org--tiny", sha256(os.path.join(self.model_dir, WEIGHTS)) + ".lock")
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            start = len(self.hub.log())
            p = subprocess.Popen([LILY_BIN, "pull", "--no-progress", "org/tiny"], env=self.env(cache),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 30
            while not self.hub_saw_head_of(WEIGHTS, "org/tiny", start) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            assert p.poll() is None, "lily pull must wait while the blob is locked"
            fcntl.flock(held, fcntl.LOCK_UN)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "waiting for another download" in err, err
        self.expect_same_files(out.strip())

    def hub_saw_head_of(self, name, repo_id, since):
        return any(e["method"] == "HEAD" and e["path"].startswith("/%s/resolve/" % repo_id) and e["path"].endswith(
            "/" + name) for e in self.hub.log()[since:])

    def test_include_exclude(self):
        cache = os.path.join(self.work, "cache-filtered")
        r = self.pull("--include", "*.json", "--exclude", "tokenizer*", "org/tiny", cache=cache)
        names = sorted(os.listdir(r.stdout.strip()))
        want = sorted(n for n in os.listdir(self.model_dir) if n.endswith(".json") and not n.startswith("tokenizer"))
        assert names == want, (names, want)
        r = self.pull("--include", "*.nothing", "org/tiny", ok=False, cache=cache)
        assert r.returncode == 1 and "no file matches" in r.stderr, r.stderr

    def test_commit_revision(self):
        self.pull("org/tiny")
        with open(os.path.join(self.repo_dir("org/tiny"), "refs", "main")) as f:
            commit = f.read()
        cache = os.path.join(self.work, "cache-commit")
        r = self.pull("org/tiny@" + commit, cache=cache)
        assert r.stdout.strip().endswith("/snapshots/" + commit)
        assert not os.path.exists(os.path.join(self.repo_dir("org/tiny", cache), "refs", commit))
        r = self.lily("inspect", "org/tiny@" + commit, cache=cache)
        assert r.returncode == 0, r.stderr
        r = self.lily("inspect", "org/tiny", cache=cache)  # no refs/main in that cache
        assert r.returncode != 0 and "not at revision `main`" in r.stderr, r.stderr

    def test_lily_finds_what_huggingface_hub_downloaded(self):
        cache = os.path.join(self.work, "cache-hf")
        snap = self.huggingface_hub("print(snapshot_download('org/tiny'))", cache)
        self.expect_same_files(snap)
        r = self.lily("inspect", "org/tiny", cache=cache)
        assert r.returncode == 0, r.stderr
        # and lily pull over that cache has nothing left to download: the blobs have the same names
        before = len(self.hub.log())
        self.pull("org/tiny", cache=cache)
        gets = [e for e in self.hub.log()[before:] if e["method"] == "GET" and "/resolve/" in e["path"]]
        assert not gets, gets

    def test_serve_by_model_id(self):
        self.pull("org/tiny")
        old = os.environ.get("HF_HUB_CACHE")
        os.environ["HF_HUB_CACHE"] = self.cache
        try:
            s = LilyServer("org/tiny").start()
        finally:
            if old is None:
                os.environ.pop("HF_HUB_CACHE")
            else:
                os.environ["HF_HUB_CACHE"] = old
        try:
            status, body = s.request("GET", "/v1/models")
            assert status == 200 and json.loads(body)["data"][0]["id"] == "org/tiny", body
        finally:
            assert s.stop() == 0


def main():
    work = tempfile.mkdtemp(prefix="lily_hub_")
    atexit.register(shutil.rmtree, work, True)
    model_dir = os.path.join(work, "tiny")
    subprocess.run([LILY_BIN, "synth", "--preset", "tiny", "--layout", "mlx", "--out", model_dir], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    hub = Hub(work, model_dir)
    runner = Runner()
    cases = Cases(work, model_dir, hub)
    for name in [n for n in dir(Cases) if n.startswith("test_")]:
        runner.run(name, getattr(cases, name))
    hub.stop()
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
