"""The embedded storage serves only what its key signed, within its time, and to no other web
origin (issue #37: moto's server took edited, forged and expired presigned URLs, any key, and
answered every origin's CORS preflight). Against a real `worker.local.s3_server` process."""

import io
import subprocess
from datetime import UTC, datetime, timedelta
from unittest import mock

import boto3
import httpx
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from pydantic import ValidationError

from tests.conftest import free_port, stop, wait_for_port
from worker.contract.settings import DEFAULT_S3_KEY, Settings
from worker.local import s3_server

KEY = "a b/c+d~é!*'(),=&.flac"  # every character a signature's encoding treats apart


@pytest.fixture(scope="module")
def endpoint():
    port = free_port()
    proc = subprocess.Popen(s3_server.command("127.0.0.1", port), stdout=subprocess.DEVNULL)
    wait_for_port(port, proc)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def client(endpoint, key_id=DEFAULT_S3_KEY, secret=DEFAULT_S3_KEY):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(signature_version="s3v4", retries={"max_attempts": 1}),
    )


@pytest.fixture(scope="module")
def bucket(endpoint):
    client(endpoint).create_bucket(Bucket="gate")
    client(endpoint).put_object(Bucket="gate", Key=KEY, Body=b"mine")
    client(endpoint).put_object(Bucket="gate", Key="other", Body=b"not yours")
    return "gate"


def error(answer: httpx.Response) -> str:
    return answer.text.split("<Code>")[1].split("</Code>")[0]


def test_the_storage_key_signs_every_operation_the_fleet_makes(endpoint, bucket):
    s3 = client(endpoint)
    big = bytes(range(256)) * (24 * 1024)  # two parts of a multipart upload
    s3.upload_fileobj(
        io.BytesIO(big), bucket, "dir/big", Config=TransferConfig(multipart_threshold=5 << 20)
    )
    assert s3.get_object(Bucket=bucket, Key="dir/big")["Body"].read() == big
    assert s3.get_object(Bucket=bucket, Key=KEY, Range="bytes=1-2")["Body"].read() == b"in"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="a b/")["Contents"]
    assert [o["Key"] for o in listed] == [KEY]
    s3.copy_object(Bucket=bucket, Key="dir/copy", CopySource={"Bucket": bucket, "Key": KEY})
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "dir/big"}, {"Key": "dir/copy"}]})
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="dir/")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": KEY})
    assert httpx.get(url).content == b"mine"
    put = s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "dir/up"})
    assert httpx.put(put, content=b"uploaded").status_code == 200
    assert s3.get_object(Bucket=bucket, Key="dir/up")["Body"].read() == b"uploaded"


def test_an_edited_forged_or_expired_presigned_url_is_refused(endpoint, bucket):
    s3 = client(endpoint)
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": KEY})
    mine = url.split("?")[0]
    edited = url.replace(mine, f"{endpoint}/{bucket}/other")
    forged = url[: -len("0000")] + "0000"
    longer = url.replace("X-Amz-Expires=3600", "X-Amz-Expires=604800")
    for answer in map(httpx.get, (edited, forged, longer)):
        assert (answer.status_code, error(answer)) == (403, "SignatureDoesNotMatch")
        assert b"not yours" not in answer.content
    # signed 30 s ago: still good for 60 s, expired after 10 (signed then, not raced against a
    # 1 s expiry, which a busy machine missed)
    assert httpx.get(signed_ago(s3, bucket, 30, expires_s=60)).status_code == 200
    answer = httpx.get(signed_ago(s3, bucket, 30, expires_s=10))
    assert (answer.status_code, error(answer)) == (403, "AccessDenied")
    assert "expired" in answer.text


def signed_ago(s3, bucket: str, seconds: float, expires_s: int) -> str:
    """A presigned GET of KEY as signed `seconds` ago."""
    then = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=seconds)
    with mock.patch("botocore.auth.get_current_datetime", return_value=then):
        return s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": KEY}, ExpiresIn=expires_s
        )


def test_a_request_unsigned_or_signed_with_another_key_is_refused(endpoint, bucket):
    answer = httpx.get(f"{endpoint}/{bucket}/other")
    assert (answer.status_code, error(answer)) == (403, "AccessDenied")
    assert httpx.get(f"{endpoint}/").status_code == 403  # not even the list of buckets
    sigv2 = boto3.client(  # an old client's presigned URL (Signature Version 2): not taken
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DEFAULT_S3_KEY,
        aws_secret_access_key=DEFAULT_S3_KEY,
        config=Config(signature_version="s3"),
    )
    answer = httpx.get(sigv2.generate_presigned_url("get_object", {"Bucket": bucket, "Key": KEY}))
    assert answer.status_code == 403 and "Signature Version 4" in answer.text
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        client(endpoint, key_id="someone-else").get_object(Bucket=bucket, Key="other")
    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        client(endpoint, secret="a-guess").get_object(Bucket=bucket, Key="other")
    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        client(endpoint, secret="a-guess").put_object(Bucket=bucket, Key="other", Body=b"x")
    assert client(endpoint).get_object(Bucket=bucket, Key="other")["Body"].read() == b"not yours"


def test_a_body_other_than_the_one_signed_is_refused(endpoint, bucket):
    request = AWSRequest("PUT", f"{endpoint}/{bucket}/other", data=b"signed")
    request.context["payload_signing_enabled"] = True
    S3SigV4Auth(Credentials(DEFAULT_S3_KEY, DEFAULT_S3_KEY), "s3", "us-east-1").add_auth(request)
    headers = dict(request.headers.items())
    answer = httpx.put(request.url, content=b"swapped", headers=headers)
    assert (answer.status_code, error(answer)) == (400, "XAmzContentSHA256Mismatch")
    assert client(endpoint).get_object(Bucket=bucket, Key="other")["Body"].read() == b"not yours"


def test_no_web_origin_is_let_in(endpoint, bucket):
    origin = {"Origin": "https://evil.example"}
    preflight = httpx.options(
        f"{endpoint}/{bucket}/other", headers={**origin, "Access-Control-Request-Method": "GET"}
    )
    url = client(endpoint).generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "other"}
    )
    signed = httpx.get(url, headers=origin)
    assert preflight.status_code == 403 and signed.status_code == 200
    for answer in (preflight, signed):
        assert not [h for h in answer.headers if h.lower().startswith("access-control")]


def test_the_public_default_key_serves_this_host_alone():
    refused = subprocess.run(
        s3_server.command("0.0.0.0", free_port()), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "public default key" in refused.stderr
    with pytest.raises(ValidationError, match="public default keys"):
        Settings(s3_public_endpoint_url="http://storage.example.com:9000")
    with pytest.raises(ValidationError, match="public default keys"):
        Settings(s3_endpoint_url="http://10.0.0.5:9000")
    Settings(s3_public_endpoint_url="http://127.0.0.1:9000")  # the quickstart's
