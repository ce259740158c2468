"""The embedded storage's objects on disk, so that they outlive the server (a stack restarted
over the same Redis finds every job's input and result where its record says).

moto keeps objects in memory. Each request that changes an object is written through to a
directory once moto has answered it: a file of the object's bytes and one of its metadata,
both named by the SHA-256 of its key, replaced atomically; a start loads them all back.
What is in flight is not kept: a multipart upload's parts until it completes (as an upload cut
by the restart, the client sends it again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, unquote

# the server's account and partition: every client of the embedded storage lands there
ACCOUNT, PARTITION = "123456789012", "aws"
CHANGES = frozenset({"PUT", "POST", "DELETE"})


class Disk:
    def __init__(self, root: Path, region: str):
        from moto.s3.models import s3_backends

        self.root, self.region = root, region
        self.backend = s3_backends[ACCOUNT][PARTITION]
        self._locks = [threading.Lock() for _ in range(64)]

    def load(self) -> int:
        """Put every object kept under root back into moto; how many there were."""
        count = 0
        self.root.mkdir(parents=True, exist_ok=True)
        for bucket in sorted(p for p in self.root.iterdir() if p.is_dir()):
            self.backend.create_bucket(bucket.name, self.region)
            for meta_file in bucket.glob("*.json"):
                meta = json.loads(meta_file.read_text())
                value = meta_file.with_suffix(".data").read_bytes()
                key = self.backend.put_object(bucket.name, meta["key"], value)
                key.set_metadata(meta["metadata"], replace=True)
                key.last_modified = datetime.fromisoformat(meta["last_modified"])
                count += 1
        return count

    def changed(self, method: str, path: str, query: str) -> None:
        """Write through what a request that moto answered 2xx changed (path-style:
        /bucket[/key])."""
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        params = parse_qs(query, keep_blank_values=True)
        if not bucket or (method == "PUT" and "uploadId" in params):  # a part: not yet an object
            return
        folder = self.root / bucket
        if not key:
            if method == "PUT" and not params:
                folder.mkdir(exist_ok=True)
            elif method == "DELETE" and not params:
                shutil.rmtree(folder, ignore_errors=True)
            elif method == "POST" and "delete" in params:  # DeleteObjects: whichever it named
                self._prune(bucket)
            return
        with self._locks[hash((bucket, key)) % len(self._locks)]:
            self._sync(bucket, key)

    def _sync(self, bucket: str, key: str) -> None:
        stem = self.root / bucket / hashlib.sha256(key.encode()).hexdigest()
        try:
            found = self.backend.get_object(bucket, key)
        except Exception:  # moto's MissingKey or MissingBucket: deleted
            found = None
        if found is None:
            for suffix in (".json", ".data"):
                stem.with_suffix(suffix).unlink(missing_ok=True)
            return
        meta = {
            "key": key,
            "metadata": dict(found.metadata),
            "last_modified": found.last_modified.isoformat(),
        }
        _replace(stem.with_suffix(".data"), found.value)
        _replace(stem.with_suffix(".json"), json.dumps(meta).encode())

    def _prune(self, bucket: str) -> None:
        kept = {
            hashlib.sha256(name.encode()).hexdigest()
            for name in self.backend.get_bucket(bucket).keys.keys()
        }
        for path in (self.root / bucket).glob("*.json"):
            if path.stem not in kept:
                path.unlink(missing_ok=True)
                path.with_suffix(".data").unlink(missing_ok=True)


def _replace(path: Path, data: bytes) -> None:
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WriteThrough:
    """WSGI middleware: after `app` answered a change 2xx, `disk` keeps it."""

    def __init__(self, app, disk: Disk):
        self.app, self.disk = app, disk

    def __call__(self, environ, start_response):
        status = []

        def started(line, headers, exc_info=None):
            status.append(line)
            return start_response(line, headers, exc_info)

        body = self.app(environ, started)
        method = environ["REQUEST_METHOD"]
        if method in CHANGES and status and status[0].startswith("2"):
            raw = environ.get("RAW_URI") or environ.get("PATH_INFO", "/")
            path, _, query = raw.partition("?")
            self.disk.changed(method, path, query)
        return body
