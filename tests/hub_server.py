"""A fake Hugging Face Hub for tests: a stdlib HTTP server on 127.0.0.1 that serves a few repos from memory.

It answers just the requests ``huggingface_hub.snapshot_download`` (2.x) makes, with the headers it relies on:

- ``GET /api/models/{repo}/revision/{rev}``: model info (``sha``, ``siblings``) -> resolves the revision;
- ``GET /api/models/{repo}/tree/{rev}``: the file listing (sizes, git and LFS ids), cached by huggingface_hub;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: file metadata and bytes, with ``X-Repo-Commit``, ``ETag`` and,
  for LFS files, ``X-Linked-Etag`` / ``X-Linked-Size`` (the sha256 and size that name the blob in the cache).

Errors carry the ``X-Error-Code`` the Hub sends (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
``GatedRepo``), because huggingface_hub picks its exception class from that header. A gated repo shows its info and
listing to anyone but serves files only with ``Authorization: Bearer {FakeHub.TOKEN}``, as the Hub does. Every
request is recorded in ``FakeHub.requests`` so tests can count downloads and check headers.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

# Stored through git LFS on the Hub (a subset of the default .gitattributes): served with X-Linked-* headers.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".gguf", ".model")

# A repo id is "name" or "owner/name"; the regexes backtrack to the shorter form when needed.
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_API_RE = re.compile(rf"^/api/models/{_REPO}/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE_RE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass
class Request:
    """One request the server received."""

    method: str
    path: str
    authorization: str | None


@dataclass
class _Repo:
    gated: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}

    def commit(self, revision: str) -> str | None:
        if revision in self.refs or revision in self.commits:
            return self.refs.get(revision) or revision
        # The Hub takes an unambiguous prefix of a commit hash too, as git does (7 characters or more).
        matches = [sha for sha in self.commits if len(revision) >= 7 and sha.startswith(revision)]
        return matches[0] if len(matches) == 1 else None


class _QuietServer(ThreadingHTTPServer):
    """A client that drops its connection (a cut download, a test that ends mid-request) makes socketserver print a
    traceback to sys.stderr from the handler's thread, whenever it happens: into whatever stream a later test's
    CliRunner has swapped in, which then fails on a traceback that is not its own (seen in CI). The server keeps it."""

    def handle_error(self, request, client_address) -> None:
        self.errors = getattr(self, "errors", 0) + 1


class FakeHub:
    """The server and its repos. Use as a context manager, or call ``start`` and ``stop``."""

    TOKEN = "hf_fake_token"

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))  # port 0: any free port
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        # The connection drops before the body of every LFS file sent after this many whole ones (None: never).
        self.cut_downloads_after: int | None = None
        # The API (the file listing) holds every request this many seconds before answering (None: at once), as a
        # stalled endpoint or proxy does.
        self.stall_api_seconds: float | None = None
        # Files the listing names and the file endpoint answers 404 for (a repo changing under a download).
        self.unserved: set[str] = set()
        # Files the file endpoint answers 403 for while the listing is answered (a proxy or mirror blocking them).
        self.forbidden: set[str] = set()
        # Whether the API answers every request 500 (an overloaded Hub) while the files stay served.
        self.api_down = False
        # Run once, right after the next model-info answer (a push landing between a client's listing and its
        # downloads).
        self.after_next_info: Callable[[], None] | None = None
        # LFS files' bodies are held this many seconds after their headers (None: sent at once), as a stalled link
        # or mirror holds them.
        self.stall_body_seconds: float | None = None
        self._whole_downloads = 0

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(
        self, repo_id: str, folder: Path | str | Mapping[str, bytes], revision: str = "main", *, gated: bool = False
    ) -> str:
        """Commit the files of ``folder`` (or a ``{path: bytes}`` mapping) to ``revision``; return the commit sha."""
        if isinstance(folder, Mapping):
            files = dict(folder)
        else:
            root = Path(folder)
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(f"{repo_id}\0{revision}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        sha = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            repo.gated = repo.gated or gated
            repo.commits[sha] = files
            repo.refs[revision] = sha
        return sha

    def file_requests(self, method: str | None = None) -> list[Request]:
        """The requests for file contents or metadata (``/resolve/``), optionally of one method."""
        with self._lock:
            return [r for r in self.requests if "/resolve/" in r.path and method in (None, r.method)]

    def start(self) -> FakeHub:
        # A short poll interval makes ``stop`` (which waits for the next poll) quick.
        serve = partial(self._server.serve_forever, poll_interval=0.05)
        self._thread = threading.Thread(target=serve, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the port: later requests get "connection refused". Safe to call twice."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _git_blob_id(content: bytes) -> str:
    """The git object id of a file, which the Hub uses as ETag for files not stored in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so no pooled connection outlives a stopped server.
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
            pass

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

        def _route(self, head: bool) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append(Request(self.command, path, self.headers.get("Authorization")))
            if match := _API_RE.match(path):
                if hub.stall_api_seconds:
                    time.sleep(hub.stall_api_seconds)
                if hub.api_down:
                    self._send_error(500, None, "Internal Server Error")
                    return
                repo_id, rev = match["repo"], unquote(match["rev"])
                if (found := self._find(repo_id, rev)) is not None:
                    repo, sha = found
                    if match["kind"] == "revision":
                        self._send_json(_model_info(repo_id, repo, sha), head)
                        then, hub.after_next_info = hub.after_next_info, None
                        if then is not None:
                            then()
                    else:
                        self._send_json(_tree(repo.commits[sha], unquote(match["path"] or "")), head)
            elif match := _RESOLVE_RE.match(path):
                repo_id, rev, file_path = match["repo"], unquote(match["rev"]), unquote(match["path"])
                if (found := self._find(repo_id, rev)) is not None and self._authorized(repo_id, found[0]):
                    self._send_file(found[1], found[0].commits[found[1]], file_path, head)
            else:
                self._send_error(404, None, "Not found")

        def _find(self, repo_id: str, rev: str) -> tuple[_Repo, str] | None:
            """The repo and commit sha for a request, or None once a Hub-style 404 has been sent."""
            repo = hub._repos.get(repo_id)
            if repo is None:
                self._send_error(404, "RepoNotFound", "Repository not found")
                return None
            sha = repo.commit(rev)
            if sha is None:
                self._send_error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo, sha

        def _authorized(self, repo_id: str, repo: _Repo) -> bool:
            """Gated repos: 401 without a token, 403 with a wrong one (the Hub's answers), else True."""
            if not repo.gated:
                return True
            auth = self.headers.get("Authorization")
            if auth == f"Bearer {FakeHub.TOKEN}":
                return True
            if auth is None:
                self._send_error(401, "GatedRepo", f"Access to model {repo_id} is restricted. Please log in.")
            else:
                self._send_error(403, "GatedRepo", f"Access to model {repo_id} is restricted; you are not authorized.")
            return False

        def _send_file(self, sha: str, files: dict[str, bytes], file_path: str, head: bool) -> None:
            if file_path in hub.forbidden:
                self._send_error(403, None, f"Access to {file_path} is forbidden")
                return
            content = None if file_path in hub.unserved else files.get(file_path)
            if content is None:
                # The Hub names the commit even on a 404, so huggingface_hub can cache the file's absence.
                self._send_error(404, "EntryNotFound", f"{file_path} does not exist", {"X-Repo-Commit": sha})
                return
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{_git_blob_id(content)}"',
                "Content-Type": "application/octet-stream",
            }
            if file_path.endswith(LFS_SUFFIXES):
                headers["X-Linked-Etag"] = f'"{hashlib.sha256(content).hexdigest()}"'
                headers["X-Linked-Size"] = str(len(content))
                if not head and self._cut_this_download():
                    self._send(200, content, headers, head, cut=True)
                    return
            self._send(200, content, headers, head)

        def _cut_this_download(self) -> bool:
            with hub._lock:
                if hub.cut_downloads_after is None or hub._whole_downloads < hub.cut_downloads_after:
                    hub._whole_downloads += 1
                    return False
                return True

        def _send_json(self, payload: object, head: bool) -> None:
            self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"}, head)

        def _send_error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
            if code is not None:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, self.command == "HEAD")

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool, cut: bool = False) -> None:
            """``cut``: the full length is announced, and the connection dropped before the body (a body cut off
            midway would be resumed and cut again, each try resetting huggingface_hub's count of retries)."""
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and not cut:
                if hub.stall_body_seconds and "X-Linked-Size" in headers:
                    self.wfile.flush()
                    time.sleep(hub.stall_body_seconds)
                self.wfile.write(body)
            if cut:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


def _model_info(repo_id: str, repo: _Repo, sha: str) -> dict:
    return {
        "id": repo_id,
        "modelId": repo_id,
        "sha": sha,
        "private": False,
        "gated": "auto" if repo.gated else False,
        "siblings": [{"rfilename": path} for path in sorted(repo.commits[sha])],
    }


def _tree(files: dict[str, bytes], under: str) -> list[dict]:
    """The recursive listing the tree endpoint returns: folders, then files with their git and LFS ids."""
    prefix = f"{under.rstrip('/')}/" if under else ""
    paths = sorted(p for p in files if p.startswith(prefix))
    folders = sorted({"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)} - {""})
    entries: list[dict] = [
        {"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
        for f in folders
        if f.startswith(prefix)
    ]
    for path in paths:
        content = files[path]
        entry = {"type": "file", "oid": _git_blob_id(content), "size": len(content), "path": path}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
        entries.append(entry)
    return entries
