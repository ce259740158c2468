"""S3-compatible object storage through boto3: job inputs in, results out.

Results are written once with a conditional put (`If-None-Match: *`): a second delivery of the
same job can never replace a stored result with a different one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import suppress

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import ClientError

from worker.contract.settings import Settings

# S3 refuses multipart parts below 5 MiB (except the last one).
PART_SIZE = 8 * 1024 * 1024


GONE = ("NoSuchKey", "NoSuchBucket", "404")


def gone(e: Exception) -> bool:
    """Whether a storage call failed because its object (or its bucket) is not there."""
    return isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in GONE


# connections kept to the store: botocore's default (10), or one per thread that may call it
# at once (a worker's job threads), so that none opens and drops a connection of its own
MIN_CONNECTIONS = 10


class Storage:
    def __init__(self, settings: Settings, threads: int = MIN_CONNECTIONS):
        self.settings, self.bucket = settings, settings.s3_bucket
        self.client: BaseClient = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            aws_access_key_id=settings.s3_access_key_id,
            aws_secret_access_key=settings.s3_secret_access_key,
            config=Config(
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=min(5.0, settings.s3_timeout_s),
                read_timeout=settings.s3_timeout_s,
                s3={"addressing_style": "path"},
                max_pool_connections=max(MIN_CONNECTIONS, threads),
            ),
        )

    def ensure_bucket(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response["Error"]["Code"] not in ("404", "NoSuchBucket"):
                raise
            self.client.create_bucket(Bucket=self.bucket)

    def ping(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)

    def get(self, key: str, bucket: str | None = None) -> bytes:
        """The object `key` of `bucket` (default: the job bucket)."""
        return self.client.get_object(Bucket=bucket or self.bucket, Key=key)["Body"].read()

    def head(self, key: str, bucket: str | None = None, first: int = 0) -> tuple[int, bytes]:
        """The size of an object and its `first` bytes (at most), in one request."""
        if first <= 0:
            return self.client.head_object(Bucket=bucket or self.bucket, Key=key)[
                "ContentLength"
            ], b""
        reply = self.client.get_object(
            Bucket=bucket or self.bucket, Key=key, Range=f"bytes=0-{first - 1}"
        )
        total = reply.get("ContentRange", "").rpartition("/")[2]
        data = reply["Body"].read()
        return (int(total) if total.isdigit() else len(data)), data

    def put_once(self, key: str, data: bytes, content_type: str) -> bool:
        """Write `key` unless it exists. True if this call wrote it."""
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType=content_type, IfNoneMatch="*"
            )
        except ClientError as e:
            if e.response["Error"]["Code"] in ("PreconditionFailed", "412"):
                return False
            raise
        return True

    def presign(self, key: str, endpoint_url: str, ttl_s: int) -> str:
        """A GET URL of `key` that clients can use for `ttl_s`, signed for `endpoint_url` (the
        storage's public address: the signature covers the host)."""
        s = self.settings
        public = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=s.s3_region,
            aws_access_key_id=s.s3_access_key_id,
            aws_secret_access_key=s.s3_secret_access_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )
        return public.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=ttl_s
        )

    def put(self, key: str, data: bytes, content_type: str, bucket: str | None = None) -> None:
        self.client.put_object(
            Bucket=bucket or self.bucket, Key=key, Body=data, ContentType=content_type
        )

    def copy(self, key: str, to_bucket: str, to_key: str) -> None:
        """Copy object `key` of the job bucket to `to_bucket`/`to_key`, inside storage."""
        self.client.copy_object(
            CopySource={"Bucket": self.bucket, "Key": key}, Bucket=to_bucket, Key=to_key
        )

    def delete(self, key: str, bucket: str | None = None) -> None:
        self.client.delete_object(Bucket=bucket or self.bucket, Key=key)

    def listing(
        self, bucket: str, prefix: str, after: str | None, limit: int = 1000
    ) -> tuple[list[dict], bool]:
        """Up to `limit` objects of `bucket` under `prefix` whose keys sort after `after`, in
        key order (S3's ListObjectsV2 entries: Key, Size, ETag, LastModified), and whether
        more follow."""
        kwargs = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": limit}
        if after:
            kwargs["StartAfter"] = after
        page = self.client.list_objects_v2(**kwargs)
        return page.get("Contents", []), bool(page.get("IsTruncated"))

    def pages(self, prefix: str) -> Iterator[list[str]]:
        """The keys under `prefix`, a page (up to 1,000) at a time."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        for page in pages:
            yield [o["Key"] for o in page.get("Contents", [])]

    def writer(self, key: str) -> ObjectWriter:
        return ObjectWriter(self, key)


class ObjectWriter:
    """Stream bytes into one object: a single put when small, a multipart upload otherwise."""

    def __init__(self, storage: Storage, key: str):
        self.storage, self.key = storage, key
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict] = []
        self.size = 0
        self.closing = False  # close was called: the object may exist, even if close raised

    def append(self, data: bytes) -> bool:
        """Buffer `data`, without I/O (an event loop may call this); True when a part is full
        and `flush` is due."""
        self.buffer += data
        self.size += len(data)
        return len(self.buffer) >= PART_SIZE

    def flush(self) -> None:
        """Upload the buffer as the next part (blocking)."""
        client, bucket = self.storage.client, self.storage.bucket
        if self.upload_id is None:
            self.upload_id = client.create_multipart_upload(Bucket=bucket, Key=self.key)["UploadId"]
        number = len(self.parts) + 1
        part = client.upload_part(
            Bucket=bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=bytes(self.buffer),
        )
        self.parts.append({"PartNumber": number, "ETag": part["ETag"]})
        self.buffer.clear()

    def close(self) -> None:
        self.closing = True
        client, bucket = self.storage.client, self.storage.bucket
        if self.upload_id is None:
            client.put_object(Bucket=bucket, Key=self.key, Body=bytes(self.buffer))
            return
        if self.buffer:
            self.flush()
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    def abort(self) -> None:
        """Undo what this writer stored: its multipart upload, and the object once `close` was
        called (a put that timed out may still have landed)."""
        client, bucket = self.storage.client, self.storage.bucket
        if self.upload_id is not None:
            with suppress(client.exceptions.NoSuchUpload):  # a close completed it
                client.abort_multipart_upload(Bucket=bucket, Key=self.key, UploadId=self.upload_id)
        if self.closing:
            client.delete_object(Bucket=bucket, Key=self.key)
