"""The embedded S3 storage: moto's S3 backend served on its own, threaded.

    python -m worker.local.s3_server -H 127.0.0.1 -p 9000

`python -m moto.server` routes every request through all of moto's services: under one lock
shared by every request it lists moto's modules on disk to find the request's backend, then
logs the request. At a GPU fleet's rate of jobs that routing was the storage server's ceiling
(one process, one interpreter lock: about 110 jobs a second on the H200's machine,
docs/benchmarks.md). Serving the S3 backend alone does the same S3 work, with moto's own
request handler, in a third less CPU a request and no lock between requests.

It serves only requests signed with the storage's key (worker.local.s3_gate), the one the rest of
the fleet is configured with (WHISPERFLEET_S3_ACCESS_KEY_ID and _SECRET_ACCESS_KEY), and sends no
CORS headers, so a web page open in the operator's browser can neither read nor write it. Its
public default key is refused where it would serve beyond this host.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from worker.contract.settings import DEFAULT_S3_KEY, LOOPBACK, Settings
from worker.local.s3_disk import Disk, WriteThrough
from worker.local.s3_gate import SignedOnly, StorageKey


def command(host: str, port: int, data: Path | None = None) -> list[str]:
    """The command line that serves it at host:port (the stack's, the tests', the scripts'),
    its objects kept under `data` (None: in memory, gone when it stops)."""
    kept = ["--data", str(data)] if data is not None else []
    return [sys.executable, "-m", "worker.local.s3_server", "-H", host, "-p", str(port), *kept]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=9000)
    parser.add_argument("--data", type=Path, help="keep the objects here (default: in memory)")
    args = parser.parse_args()
    settings = Settings()
    key = StorageKey(settings.s3_access_key_id, settings.s3_secret_access_key)
    if args.host not in LOOPBACK and DEFAULT_S3_KEY in (key.access_key_id, key.secret):
        parser.error(
            f"serving on {args.host} with the public default key: set "
            "WHISPERFLEET_S3_ACCESS_KEY_ID and WHISPERFLEET_S3_SECRET_ACCESS_KEY"
        )
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto's server: URLs it writes
    os.environ["MOTO_DISABLE_GLOBAL_CORS"] = "true"  # no Access-Control-* for any origin

    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = create_backend_app("s3")
    if args.data is not None:
        disk = Disk(args.data, settings.s3_region)
        print(f"storage: {disk.load()} objects kept in {args.data}", file=sys.stderr, flush=True)
        app = WriteThrough(app, disk)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    run_simple(
        args.host,
        args.port,
        SignedOnly(app, key),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()
