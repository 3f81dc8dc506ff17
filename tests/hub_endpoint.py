"""A stand-in for the Hugging Face Hub: just enough of its HTTP API for the real clients (huggingface_hub's
snapshot_download / hf_hub_download / model_info / list_repo_tree, and datasets' load_dataset through
HfFileSystem) to fetch files from repos held in memory. Point HF_ENDPOINT at `StandInHub.url`.

    hub = StandInHub()
    hub.add_repo("org/name", {"config.json": b"{}", ...})                 # a model repo, branch main
    hub.add_repo("org/name", {...}, revision="v1")                       # another commit under tag v1
    hub.add_repo("org/data", {...}, repo_type="dataset")
    hub.add_repo("org/gated", {...}, gated=True)    # files answer 401 GatedRepo without HF_TOKEN=StandInHub.TOKEN
    with hub:                                                            # serves on 127.0.0.1:<random port>
        ...  hub.requests  # (method, path) of every request, in order

Served, for repo types `models` (URL prefix none) and `datasets` (`/datasets`):
    GET  /api/{type}/{repo}[/revision/{rev}]       repo info: id, sha (the commit), siblings
    GET  /api/{type}/{repo}/tree/{rev}[/{path}]    listing (?recursive=true|false)
    POST /api/{type}/{repo}/paths-info/{rev}       info of the listed paths (form field `paths`)
    HEAD/GET [/datasets]/{repo}/resolve/{rev}/{path}   the file, with X-Repo-Commit, ETag, Content-Length and
                                                   byte ranges (Range -> 206), no xet headers (plain HTTP)
Errors carry the Hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) so the client
raises its own typed errors. A revision is a branch / tag name added with add_repo, or a commit hash.

The repos the tests serve: `qwen3_repo()` (the committed tiny qwen3 fixture, served as Qwen/Qwen3-0.6B, with
decoys a run must not fetch: pytorch_model.bin, onnx/, original/), `finetome_repo()` (20 short rows in
mlabonne/FineTome-100k's layout and columns: conversations [{from, value}], source, score).
"""
from __future__ import annotations

import hashlib
import io
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

FIXTURES = Path(__file__).parent / "fixtures"
DECOYS = {"pytorch_model.bin": b"\0" * 64, "onnx/model.onnx": b"onnx", "original/consolidated.safetensors": b"x",
          "README.md": b"# a model card\n", ".gitattributes": b"*.safetensors filter=lfs\n"}


def qwen3_repo() -> dict[str, bytes]:
    """The tiny qwen3 fixture (config, weights, generation config) with the fixture tokenizer, plus DECOYS."""
    files = {p.name: p.read_bytes() for p in (FIXTURES / "models" / "qwen3").iterdir()
             if p.name in ("config.json", "generation_config.json", "model.safetensors")}
    files.update({p.name: p.read_bytes() for p in (FIXTURES / "tokenizer").iterdir()
                  if p.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")})
    return {**files, **DECOYS}


def finetome_rows(n: int = 20) -> list[dict]:
    """Short ShareGPT conversations with FineTome-100k's columns."""
    return [{"conversations": [{"from": "human", "value": f"What is {i} plus {i % 7}?"},
                               {"from": "gpt", "value": f"{i} plus {i % 7} is {i + i % 7}."}],
             "source": "arithmetic", "score": 4.0 + (i % 10) / 10} for i in range(n)]


def finetome_repo() -> dict[str, bytes]:
    """A dataset repo in the Hub layout: data/train-00000-of-00001.parquet and a card declaring the config."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(finetome_rows()), buf)
    card = (b"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
            b"    path: data/train-*\n---\n# FineTome (a stand-in)\n")
    return {"data/train-00000-of-00001.parquet": buf.getvalue(), "README.md": card}

_TYPES = {"models": "model", "datasets": "dataset"}


@dataclass
class _Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit hash -> path -> content
    refs: dict[str, str] = field(default_factory=dict)                  # branch / tag -> commit hash
    gated: bool = False

    def commit_of(self, revision: str) -> str | None:
        return self.refs.get(revision) or (revision if revision in self.commits else None)


class StandInHub:
    """The repos, the server thread, and the log of requests (see the module docstring)."""

    TOKEN = "hf_stand_in_token"  # the one token that opens a gated repo

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], _Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server: ThreadingHTTPServer | None = None

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model", revision: str = "main",
                 gated: bool = False) -> str:
        """Add (or add a revision to) a repo; returns the commit hash, a digest of the files."""
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
        commit = digest.hexdigest()
        repo = self.repos.setdefault((repo_type, repo_id), _Repo())
        repo.commits[commit] = dict(files)
        repo.refs[revision] = commit
        repo.gated = repo.gated or gated
        return commit

    # ---- server ------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start the server first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "StandInHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StandInHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def downloaded(self, repo_id: str, since: int = 0) -> set[str]:
        """The file paths of `repo_id` fetched (GET; HEAD requests are not counted) after the first `since`
        requests."""
        out = set()
        for method, path in self.requests[since:]:
            parts = path.split("/resolve/", 1)
            if method == "GET" and len(parts) == 2 and parts[0].removeprefix("/datasets").strip("/") == repo_id:
                out.add(parts[1].split("/", 1)[1])
        return out


def _entry(path: str, content: bytes) -> dict:
    oid = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    return {"type": "file", "path": path, "size": len(content), "oid": oid}


def _folders(files: dict[str, bytes]) -> set[str]:
    return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}


class _Handler(BaseHTTPRequestHandler):
    hub: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---- dispatch ----------------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.requests.append((method, path))
        query = parse_qs(url.query)
        body = b""
        if method == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in _TYPES:
            return self._api(method, _TYPES[parts[1]], "/".join(parts[2:4]), parts[4:], query, body)
        repo_type = "model"
        if parts[0] == "datasets":
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(method, repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        self._error(404, "EntryNotFound", f"no route for {path}")

    # ---- answers -----------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, value, headers: dict | None = None) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, head: bool = False, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

    def _lookup(self, repo_type: str, repo_id: str, revision: str, head: bool = False):
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head)
            return None, None
        commit = repo.commit_of(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            return None, None
        return repo, commit

    def _api(self, method, repo_type, repo_id, rest, query, body) -> None:
        revision = "main"
        if rest[:1] == ["revision"]:
            revision = "/".join(rest[1:])
        elif rest[:1] in (["tree"], ["paths-info"]):
            revision = rest[1]
        repo, commit = self._lookup(repo_type, repo_id, revision)
        if repo is None:
            return
        files = repo.commits[commit]
        if not rest or rest[0] == "revision":
            siblings = [{"rfilename": p, "size": len(c)} for p, c in sorted(files.items())]
            return self._json({"id": repo_id, "sha": commit, "siblings": siblings, "private": False,
                               "gated": "auto" if repo.gated else False, "disabled": False, "tags": []})
        if rest[0] == "tree":
            prefix = "/".join(rest[2:])
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            under = [p for p in sorted(files) if not prefix or p.startswith(prefix + "/")]
            entries = [_entry(p, files[p]) for p in under
                       if recursive or p[len(prefix):].lstrip("/").count("/") == 0]
            folders = sorted(d for d in _folders(files) if (not prefix or d.startswith(prefix + "/"))
                             and (recursive or d[len(prefix):].lstrip("/").count("/") == 0))
            if prefix and not under:
                return self._error(404, "EntryNotFound", f"{prefix} does not exist")
            return self._json([{"type": "directory", "path": d, "oid": "0" * 40} for d in folders] + entries)
        if rest[0] == "paths-info":
            asked = parse_qs(body.decode()).get("paths", [])
            out = [_entry(p, files[p]) for p in asked if p in files]
            out += [{"type": "directory", "path": p, "oid": "0" * 40} for p in asked if p in _folders(files)]
            return self._json(out)
        self._error(404, "EntryNotFound", f"no API route {rest}")

    def _resolve(self, method, repo_type, repo_id, revision, path) -> None:
        head = method == "HEAD"
        repo, commit = self._lookup(repo_type, repo_id, revision, head)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {StandInHub.TOKEN}":
            return self._error(401, "GatedRepo", f"Access to {repo_type} {repo_id} is restricted. You must have "
                                                 "access to it and be authenticated to access it.", head)
        content = repo.commits[commit].get(path)
        if content is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {revision!r}", head, commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(content).hexdigest()}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            start_s, _, end_s = ranged[6:].partition("-")
            start = int(start_s or 0)
            end = min(int(end_s) if end_s else len(content) - 1, len(content) - 1)
            if start >= len(content):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(content)}"}, head)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            return self._send(206, content[start:end + 1], headers, head)
        self._send(200, content, headers, head)
