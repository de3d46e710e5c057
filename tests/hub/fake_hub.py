"""A local stand-in for the Hugging Face hub's HTTP API, enough for `lily pull` and huggingface_hub's
snapshot_download / hf_hub_download to run against it (HF_ENDPOINT=http://127.0.0.1:PORT):

  GET  /api/models/ORG/NAME/revision/REV[?blobs=true]   model info: sha (commit) and siblings
  GET  /api/models/ORG/NAME/tree/REV[?recursive=true]    the file tree (what snapshot_download lists)
  HEAD|GET /ORG/NAME/resolve/REV/PATH                     small files: 200 with ETag (git blob sha1);
                                                          LFS files: 302 to /cdn/... with X-Linked-Etag (sha256)
                                                          and X-Linked-Size; X-Repo-Commit on both
  HEAD|GET /cdn/ORG/NAME/SHA256                           the LFS bytes, with Range (206, Content-Range),
                                                          reached as http://localhost:PORT (another host)

Repositories come from a JSON config: {"repos": {"ORG/NAME": {"dir": PATH, "token": TOKEN (gated: only
`Authorization: Bearer TOKEN` gets in), "corrupt": [PATH...] (served with one byte flipped), "disconnect_once":
[PATH...] (the first GET of the bytes is cut after half the body)}}}. Errors carry the hub's X-Error-Code
(RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo). Every request is appended to --log as a JSON line
(method, path, range, authorization). The port it listens on is written to --port-file.

    python3 tests/hub/fake_hub.py --config CONFIG --port-file PORTFILE --log LOG
"""
import argparse
import hashlib
import http.server
import json
import os
import socketserver
import threading
import urllib.parse

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".f32")
LFS_MIN_BYTES = 1 << 20


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, repo_id, spec):
        self.repo_id, self.token = repo_id, spec.get("token")
        self.corrupt, self.disconnect_once = set(spec.get("corrupt", [])), set(spec.get("disconnect_once", []))
        self.files = {}  # path -> dict(data, size, blob_id, sha256, lfs)
        root = spec["dir"]
        for dirpath, _, names in os.walk(root):
            for n in sorted(names):
                full = os.path.join(dirpath, n)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                with open(full, "rb") as f:
                    data = f.read()
                self.files[rel] = {"data": data, "size": len(data), "blob_id": git_blob_sha1(data),
                                   "sha256": hashlib.sha256(data).hexdigest(),
                                   "lfs": rel.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_BYTES}
        listing = "".join("%s %s\n" % (p, f["blob_id"]) for p, f in sorted(self.files.items()))
        self.commit = hashlib.sha1(listing.encode()).hexdigest()

    def by_sha256(self, sha):
        for path, f in self.files.items():
            if f["sha256"] == sha:
                return path, f
        return None, None


class Hub:
    def __init__(self, config, log_path):
        self.repos = {rid: Repo(rid, spec) for rid, spec in config["repos"].items()}
        self.log_path, self.lock, self.cut = log_path, threading.Lock(), set()

    def log(self, entry):
        with self.lock, open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub = None  # set in main

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.route(head=True)

    def do_GET(self):
        self.route(head=False)

    # ---- plumbing -------------------------------------------------------------------------------------

    def send(self, status, body=b"", headers=None, head=False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def error(self, status, code, message, head):
        body = json.dumps({"error": message}).encode()
        self.send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                 "X-Error-Message": message}, head)

    def repo_or_error(self, repo_id, head):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self.error(404, "RepoNotFound", "Repository not found", head)
            return None
        if repo.token is not None:
            auth = self.headers.get("Authorization", "")
            if auth != "Bearer " + repo.token:
                self.error(401 if not auth else 403, "GatedRepo",
                           "Access to model %s is restricted. You must have access to it and be authenticated to "
                           "access it. Please log in." % repo_id, head)
                return None
        return repo

    def revision_ok(self, repo, rev, head):
        if rev in ("main", repo.commit):
            return True
        self.error(404, "RevisionNotFound", "Invalid rev id: %s" % rev, head)
        return False

    # ---- routes ---------------------------------------------------------------------------------------

    def route(self, head):
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/")[1:]]
        query = urllib.parse.parse_qs(url.query)
        self.hub.log({"method": self.command, "path": url.path, "range": self.headers.get("Range"),
                      "authorization": self.headers.get("Authorization")})
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("revision", "tree"):
            return self.api(parts[2] + "/" + parts[3], parts[4], parts[5], query, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
        if len(parts) == 4 and parts[0] == "cdn":
            return self.cdn(parts[1] + "/" + parts[2], parts[3], head)
        self.error(404, "EntryNotFound", "no route for %s" % url.path, head)

    def api(self, repo_id, kind, rev, query, head):
        repo = self.repo_or_error(repo_id, head)
        if repo is None or not self.revision_ok(repo, rev, head):
            return
        if kind == "revision":
            siblings = []
            for path, f in sorted(repo.files.items()):
                s = {"rfilename": path}
                if query.get("blobs") == ["true"] or query.get("blobs") == ["True"]:
                    s.update(size=f["size"], blobId=f["blob_id"])
                    if f["lfs"]:
                        s["lfs"] = {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}
                siblings.append(s)
            body = {"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                    "private": False, "gated": "auto" if repo.token else False, "disabled": False,
                    "tags": [], "siblings": siblings}
        else:
            body = []
            for path, f in sorted(repo.files.items()):
                e = {"type": "file", "oid": f["blob_id"], "size": f["size"], "path": path}
                if f["lfs"]:
                    e["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
                body.append(e)
        self.send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)

    def resolve(self, repo_id, rev, path, head):
        repo = self.repo_or_error(repo_id, head)
        if repo is None or not self.revision_ok(repo, rev, head):
            return
        f = repo.files.get(path)
        if f is None:
            return self.error(404, "EntryNotFound", "Entry not found", head)
        common = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if f["lfs"]:
            # Another host, as the hub's CDN is: clients must not follow it for the metadata nor send the token.
            location = "http://localhost:%d/cdn/%s/%s" % (self.server.server_address[1], repo_id, f["sha256"])
            common.update({"Location": location, "X-Linked-Etag": '"%s"' % f["sha256"],
                           "X-Linked-Size": str(f["size"]), "ETag": '"%s"' % f["blob_id"]})
            return self.send(302, b"", common, head)
        common["ETag"] = '"%s"' % f["blob_id"]
        self.send_bytes(f["data"], common, head)

    def cdn(self, repo_id, sha, head):
        repo = self.hub.repos.get(repo_id)
        path, f = repo.by_sha256(sha) if repo else (None, None)
        if f is None:
            return self.error(404, "EntryNotFound", "no such object", head)
        data = f["data"]
        if path in repo.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        cut = False
        if not head and path in repo.disconnect_once:
            with self.hub.lock:
                cut = (repo_id, path) not in self.hub.cut
                self.hub.cut.add((repo_id, path))
        self.send_bytes(data, {"ETag": '"%s"' % sha, "Accept-Ranges": "bytes"}, head, cut)

    def send_bytes(self, data, headers, head, cut=False):
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
            if start >= len(data):
                return self.send(416, b"", {"Content-Range": "bytes */%d" % len(data)}, head)
            status = 206
            headers = dict(headers, **{"Content-Range": "bytes %d-%d/%d" % (start, len(data) - 1, len(data))})
        body = data[start:]
        if not cut:
            return self.send(status, body, headers, head)
        # Announce the whole body, send half of it, then drop the connection.
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log", required=True)
    a = ap.parse_args()
    with open(a.config) as f:
        Handler.hub = Hub(json.load(f), a.log)
    server = Server(("127.0.0.1", 0), Handler)
    tmp = a.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, a.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
