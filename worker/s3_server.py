"""The embedded S3 storage: moto's S3 backend served on its own, threaded.

    python -m worker.s3_server -H 127.0.0.1 -p 9000

`python -m moto.server` routes every request through all of moto's services: under one lock
shared by every request it lists moto's modules on disk to find the request's backend, then
logs the request. At a GPU fleet's rate of jobs that routing was the storage server's ceiling
(one process, one interpreter lock: about 110 jobs a second on the H200's machine,
docs/benchmarks.md). Serving the S3 backend alone does the same S3 work, with moto's own
request handler, in a third less CPU a request and no lock between requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def command(host: str, port: int) -> list[str]:
    """The command line that serves it at host:port (the stack's, the tests', the scripts')."""
    return [sys.executable, "-m", "worker.s3_server", "-H", host, "-p", str(port)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=9000)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto's server: URLs it writes

    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    run_simple(
        args.host,
        args.port,
        create_backend_app("s3"),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()
