"""The embedded storage keeps its objects on disk: a server killed (SIGKILL) and started again
over the same directory serves every object, with its metadata, as it was (issue #37: the
local stack's storage lived in memory)."""

import io
import signal
import subprocess

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from tests.conftest import free_port, stop, wait_for_port
from worker.contract.settings import DEFAULT_S3_KEY
from worker.local import s3_server


def serve(port, data):
    proc = subprocess.Popen(s3_server.command("127.0.0.1", port, data), stderr=subprocess.PIPE)
    wait_for_port(port, proc)
    return proc


def client(port):
    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id=DEFAULT_S3_KEY,
        aws_secret_access_key=DEFAULT_S3_KEY,
        region_name="us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def test_objects_outlive_a_killed_server(tmp_path):
    port, data = free_port(), tmp_path / "storage"
    big = bytes(range(256)) * (40 * 1024)  # a multipart upload of two parts
    proc = serve(port, data)
    try:
        s3 = client(port)
        s3.create_bucket(Bucket="kept")
        s3.put_object(
            Bucket="kept",
            Key="jobs/a b+é/result.json",
            Body=b"{}",
            ContentType="application/json",
            Metadata={"job": "a"},
        )
        s3.upload_fileobj(
            io.BytesIO(big), "kept", "jobs/big", Config=TransferConfig(multipart_threshold=5 << 20)
        )
        s3.copy_object(Bucket="kept", Key="jobs/copy", CopySource="kept/jobs/big")
        s3.put_object(Bucket="kept", Key="jobs/replaced", Body=b"first")
        s3.put_object(Bucket="kept", Key="jobs/replaced", Body=b"second")
        for key in ("jobs/deleted", "jobs/bulk-1", "jobs/bulk-2"):
            s3.put_object(Bucket="kept", Key=key, Body=b"x")
        s3.delete_object(Bucket="kept", Key="jobs/deleted")
        s3.delete_objects(
            Bucket="kept", Delete={"Objects": [{"Key": "jobs/bulk-1"}, {"Key": "jobs/bulk-2"}]}
        )
        s3.create_bucket(Bucket="dropped")
        s3.delete_bucket(Bucket="dropped")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = serve(port, data)
    try:
        s3 = client(port)
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["kept"]
        listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="kept")["Contents"])
        assert listed == ["jobs/a b+é/result.json", "jobs/big", "jobs/copy", "jobs/replaced"]
        result = s3.get_object(Bucket="kept", Key="jobs/a b+é/result.json")
        assert result["Body"].read() == b"{}"
        assert result["ContentType"] == "application/json" and result["Metadata"] == {"job": "a"}
        assert s3.get_object(Bucket="kept", Key="jobs/big")["Body"].read() == big
        assert s3.get_object(Bucket="kept", Key="jobs/copy")["Body"].read() == big
        assert s3.get_object(Bucket="kept", Key="jobs/replaced")["Body"].read() == b"second"
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket="kept", Key="jobs/deleted")
    finally:
        stop(proc)
    assert b"4 objects kept" in proc.stderr.read()
