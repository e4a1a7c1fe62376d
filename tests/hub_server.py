"""A loopback stand-in of the Hugging Face Hub's HTTP API, for tests with no network.

It serves what `huggingface_hub.snapshot_download` (2.4) asks for, so the library's real download
code runs against it (`HF_ENDPOINT=hub.endpoint`):

- `GET /api/{models|datasets}/ORG/NAME/revision/REV` (and without `/revision/REV`): the repo's
  info, whose `sha` is the commit the download pins;
- `GET /api/{models|datasets}/ORG/NAME/tree/REV?recursive=...`: the file listing (blob ids, sizes,
  the `lfs` block of large files);
- `HEAD` / `GET /ORG/NAME/resolve/REV/PATH` (`/datasets/ORG/NAME/...` for data sets): small files
  answered here with `ETag` (the git blob id), `X-Repo-Commit` and `Content-Length`; large files
  (safetensors, parquet) as the Hub does, a 302 to a second origin (the "CDN", another port)
  carrying `X-Linked-Etag` (the sha256), `X-Linked-Size` and `X-Repo-Commit`;
- `GET /api/agent-harnesses`: the (empty) registry huggingface_hub reads for its user agent.

Errors carry the headers `huggingface_hub.utils.hf_raise_for_status` reads: a missing repo is 404
`X-Error-Code: RepoNotFound`, an unknown revision 404 `RevisionNotFound`, a missing file 404
`EntryNotFound`, and a gated repo's files 401 `GatedRepo` (its info and listing stay public, as
on the Hub). Every request is recorded (`requests`), so a test can say what was fetched, and that
nothing was. Anything else is a plain 404 and recorded in `unknown`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".parquet")  # stored in LFS on the Hub: resolved through a redirect
_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (the Hub's `oid` and `ETag` of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, files: dict[str, bytes], gated: bool = False):
        self.files = files
        self.gated = gated
        listing = json.dumps(sorted((p, git_blob_id(d)) for p, d in files.items())).encode()
        self.sha = hashlib.sha1(listing).hexdigest()  # a commit id that changes with the content

    def entry(self, path: str) -> dict:
        data = self.files[path]
        out = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
        if path.endswith(LFS_SUFFIXES):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


class HubStandIn:
    """`with HubStandIn() as hub:` a Hub at `hub.endpoint` (127.0.0.1) and its CDN on another port."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        self.blobs: dict[str, bytes] = {}
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self)) for _ in range(2)]
        self.endpoint, self.cdn = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)

    def add_folder(self, repo_id: str, folder: Path, kind: str = "model", gated: bool = False) -> Repo:
        """Serve every file under `folder` (symlinks read through) as the repo `repo_id`."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_files(repo_id, files, kind, gated)

    def add_files(self, repo_id: str, files: dict[str, bytes], kind: str = "model", gated: bool = False) -> Repo:
        repo = Repo(files, gated)
        self.repos[(kind, repo_id)] = repo
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return repo

    def fetched(self, repo_id: str) -> list[str]:
        """The files of `repo_id` the client asked for (HEAD or GET of their resolve URL), sorted."""
        marker = f"/{repo_id}/resolve/"
        return sorted({p.split(marker, 1)[1].split("/", 1)[1] for _, p in self.requests if marker in p})

    def __enter__(self) -> HubStandIn:
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the recorded requests say what happened
            pass

        def do_GET(self):
            self._route(body=True)

        def do_HEAD(self):
            self._route(body=False)

        def _route(self, body: bool):
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path))
            if path.startswith("/cdn/") and path[5:] in hub.blobs:
                return self._send(200, hub.blobs[path[5:]], {}, body)
            if path == "/api/agent-harnesses":  # huggingface_hub's user-agent registry, asked once a day
                return self._json({"standardEnvVars": [], "harnesses": {}}, body)
            api, resolve = _API.match(path), _RESOLVE.match(path)
            if api and self.command == "GET":
                return self._api(api, body)
            if resolve:
                return self._resolve(resolve, body)
            hub.unknown.append((self.command, path))
            return self._send(404, b"not served by the stand-in", {}, body)

        def _repo(self, kind: str, repo_id: str, rev: str, body: bool) -> Repo | None:
            repo = hub.repos.get((kind, repo_id))
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", body)
            elif rev not in ("main", repo.sha):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
                repo = None
            return repo

        def _api(self, m, body: bool):
            kind, repo_id, what, rev, sub = m.group(1)[:-1], m.group(2), m.group(3), m.group(4) or "main", m.group(5)
            repo = self._repo(kind, repo_id, rev, body)
            if repo is None:
                return
            if what == "tree":
                prefix = f"{sub.rstrip('/')}/" if sub else ""
                listing = [repo.entry(p) for p in sorted(repo.files) if p.startswith(prefix)]
                return self._json(listing, body)
            siblings = [{"rfilename": p} for p in sorted(repo.files)]
            info = {"id": repo_id, "sha": repo.sha, "private": False, "gated": "auto" if repo.gated else False}
            return self._json({**info, "siblings": siblings}, body)

        def _resolve(self, m, body: bool):
            kind, repo_id, rev, path = "dataset" if m.group(1) else "model", m.group(2), m.group(3), m.group(4)
            repo = self._repo(kind, repo_id, rev, body)
            if repo is None:
                return
            if repo.gated:
                msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                return self._error(401, "GatedRepo", msg, body)
            if path not in repo.files:
                return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", body, repo.sha)
            data, entry = repo.files[path], repo.entry(path)
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{entry["oid"]}"'}
            if "lfs" in entry:  # the Hub sends LFS files from a CDN: the metadata rides on the redirect
                sha = entry["lfs"]["oid"]
                headers.update({"Location": f"{hub.cdn}/cdn/{sha}", "X-Linked-Etag": f'"{sha}"'})
                headers["X-Linked-Size"] = str(len(data))
                return self._send(302, b"", headers, body)
            return self._send(200, data, headers, body)

        def _error(self, status: int, code: str, message: str, body: bool, commit: str | None = None):
            headers = {"X-Error-Code": code, "X-Error-Message": message}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers, body)

        def _json(self, obj, body: bool):
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body)

        def _send(self, status: int, data: bytes, headers: dict, body: bool):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
