"""The embedded storage's door: a request is served only if it is signed with the storage's
key (AWS Signature Version 4, in its Authorization header or in a presigned URL's query) and
within its time.

moto's S3 backend checks no signatures: a presigned URL could be edited, forged, or used after
it expired, and any key would do. Its opt-in IAM mode reads the Authorization header only and
never a presigned URL's expiry, so the check is made here, in front of it, as S3 makes it
(https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-authenticating-requests.html).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import re
import time
from calendar import timegm
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW_S = 15 * 60  # S3's: a signed header's X-Amz-Date this far from now is refused
MAX_EXPIRES_S = 7 * 24 * 3600  # S3's longest presigned URL
# payloads whose hash is not signed: S3 takes them, and boto sends them over HTTPS
UNSIGNED = frozenset({"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"})
_HEADER = re.compile(
    rf"{ALGORITHM}\s+Credential=([^,\s]+),\s*SignedHeaders=([^,\s]+),\s*Signature=([0-9a-f]{{64}})$"
)
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class StorageKey:
    access_key_id: str
    secret: str


class Refused(Exception):
    def __init__(self, status: str, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _forbidden(code: str, message: str) -> Refused:
    return Refused("403 Forbidden", code, message)


def _encode(text: str) -> str:
    return quote(text, safe="-_.~")


def _header(environ: dict, name: str) -> str | None:
    if name in ("content-type", "content-length"):
        value = environ.get(name.replace("-", "_").upper())
    else:
        value = environ.get("HTTP_" + name.replace("-", "_").upper())
    return None if value is None else " ".join(value.split())


def _amz_time(stamp: str) -> float:
    try:
        return timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        raise _forbidden(
            "AccessDenied", "X-Amz-Date is not a date of the form 20260101T000000Z"
        ) from None


def _signature(secret: str, scope: list[str], string_to_sign: str) -> str:
    key = ("AWS4" + secret).encode()
    for part in scope[1:]:  # the date, region, service and terminator, after the key's id
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


def verify(environ: dict, key: StorageKey, now: float) -> str:
    """Refused unless the request is signed with `key` and within its time; else the payload
    hash it signed (a hex digest the body must have, or one of UNSIGNED)."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/")
    path, _, query = raw.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    params = dict(pairs)
    if header := environ.get("HTTP_AUTHORIZATION"):
        if not (match := _HEADER.match(header.strip())):
            raise Refused(
                "400 Bad Request",
                "AuthorizationHeaderMalformed",
                f"the Authorization header is not {ALGORITHM} (Signature Version 4)",
            )
        credential, signed, given = match.groups()
        stamp = _header(environ, "x-amz-date") or ""
        if abs(now - _amz_time(stamp)) > MAX_SKEW_S:
            raise _forbidden(
                "RequestTimeTooSkewed", "the request's time is too far from the server's"
            )
        payload = _header(environ, "x-amz-content-sha256")
        if payload is None:
            raise Refused(
                "400 Bad Request", "InvalidRequest", "Missing required header: x-amz-content-sha256"
            )
    elif "X-Amz-Signature" in params:
        if params.get("X-Amz-Algorithm") != ALGORITHM:
            raise Refused(
                "400 Bad Request", "AuthorizationQueryParametersError", f"only {ALGORITHM}"
            )
        credential = params.get("X-Amz-Credential", "")
        signed = params.get("X-Amz-SignedHeaders", "")
        given, stamp = params["X-Amz-Signature"], params.get("X-Amz-Date", "")
        expires = params.get("X-Amz-Expires", "")
        if not expires.isdigit() or not 0 < int(expires) <= MAX_EXPIRES_S:
            raise Refused(
                "400 Bad Request",
                "AuthorizationQueryParametersError",
                f"X-Amz-Expires must be a number of seconds from 1 to {MAX_EXPIRES_S}",
            )
        signed_at = _amz_time(stamp)
        if now > signed_at + int(expires):
            raise _forbidden("AccessDenied", "Request has expired")
        if signed_at > now + MAX_SKEW_S:
            raise _forbidden("AccessDenied", "Request is not valid yet")
        payload = "UNSIGNED-PAYLOAD"
    elif "Signature" in params:
        raise _forbidden("AccessDenied", f"only {ALGORITHM} (Signature Version 4) is taken")
    else:
        raise _forbidden("AccessDenied", "the request is not signed (anonymous access is refused)")

    scope = credential.split("/")
    if len(scope) != 5 or scope[0] != key.access_key_id:
        raise _forbidden("InvalidAccessKeyId", "the access key is not one this storage knows")
    if scope[1] != stamp[:8] or scope[3:] != ["s3", "aws4_request"]:
        raise _forbidden("SignatureDoesNotMatch", "the credential's scope does not match")
    names = signed.split(";")
    values = [_header(environ, name) for name in names]
    if "host" not in names or None in values:
        raise _forbidden("SignatureDoesNotMatch", "a signed header is missing (host is signed)")
    canonical = "\n".join(
        [
            environ["REQUEST_METHOD"],
            quote(unquote(path), safe="/~"),
            "&".join(
                f"{_encode(k)}={_encode(v)}"
                for k, v in sorted(pairs, key=lambda kv: (_encode(kv[0]), _encode(kv[1])))
                if k != "X-Amz-Signature"
            ),
            "".join(f"{name}:{value}\n" for name, value in zip(names, values, strict=True)),
            signed,
            payload,
        ]
    )
    string_to_sign = "\n".join(
        [ALGORITHM, stamp, "/".join(scope[1:]), hashlib.sha256(canonical.encode()).hexdigest()]
    )
    if not hmac.compare_digest(_signature(key.secret, scope, string_to_sign), given):
        raise _forbidden(
            "SignatureDoesNotMatch",
            "the request signature we calculated does not match the signature you provided",
        )
    if payload not in UNSIGNED and not _HEX64.fullmatch(payload):
        raise Refused(
            "501 Not Implemented",
            "NotImplemented",
            "sign the payload's SHA-256 or send it unsigned; chunk signatures are not taken",
        )
    return payload


class SignedOnly:
    """WSGI middleware: `app` sees only requests that `verify` passes, with a body whose
    SHA-256 is the one signed; any other gets S3's XML error."""

    def __init__(self, app, key: StorageKey):
        self.app, self.key = app, key

    def __call__(self, environ, start_response):
        try:
            payload = verify(environ, self.key, time.time())
            if payload not in UNSIGNED:
                length = int(environ.get("CONTENT_LENGTH") or 0)
                body = environ["wsgi.input"].read(length) if length else b""
                if hashlib.sha256(body).hexdigest() != payload:
                    raise Refused(
                        "400 Bad Request",
                        "XAmzContentSHA256Mismatch",
                        "the body's SHA-256 is not the one signed",
                    )
                environ["wsgi.input"] = io.BytesIO(body)
        except Refused as e:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{e.code}</Code><Message>{e.message}</Message></Error>"
            ).encode()
            start_response(
                e.status, [("Content-Type", "application/xml"), ("Content-Length", str(len(xml)))]
            )
            return [xml]
        return self.app(environ, start_response)
