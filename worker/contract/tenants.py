"""Tenants and their API keys, kept in Redis beside the job records.

Light on purpose (no torch, no FastAPI): the API looks keys up, the CLI manages them, the
webhook sender reads a tenant's signing secret. A key is shown once, when it is made, and
stored only as its SHA-256 (a key is 256 random bits: a slow hash buys nothing), so neither
Redis nor a log holds one in clear. Each key belongs to one tenant; a tenant's settings
(the `s3://` sources it may read, its limits, the networks its webhooks may reach, its
webhook secret) live with its keys, and what a tenant does not set comes from the
configuration.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from datetime import UTC, datetime

import redis
from pydantic import BaseModel, Field, field_validator

from worker.contract.settings import Settings

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # it names storage keys: jobs/<tenant>/
KEY_PREFIX = "wf_"


class TenantError(ValueError):
    """A tenant name or setting that cannot be used; the message says why."""


def check_tenant(name: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise TenantError(
            f"tenant {name!r}: 1 to 63 of a-z, 0-9, '-' and '_', starting with a letter or digit"
        )
    return name


def parse_source(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` as (bucket, key); TenantError for anything else. Keys with empty,
    `.` or `..` segments are refused: some stores normalise them, which would walk out of a
    prefix that was checked."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "s3" or not sep:
        raise TenantError(f"{_short(uri)}: expected s3://bucket/key (no other scheme)")
    bucket, _, key = rest.partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise TenantError(f"{_short(uri)}: not a valid bucket name")
    segments = key.split("/")
    if not key or any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
        raise TenantError(f"{_short(uri)}: the key must be a path without empty, . or .. parts")
    if len(key.encode()) > 1024 or any(ord(c) < 32 for c in key):
        raise TenantError(f"{_short(uri)}: not a valid object key")
    return bucket, key


def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else f"{text[:77]!r}..."


def check_source_prefix(uri: str) -> str:
    """A prefix as a grant or a backfill names it: `s3://bucket/` (the whole bucket) or
    `s3://bucket/prefix/`. One without its last `/` is given it: a prefix ends at a `/`
    (`s3://b/imports` would grant `imports-old/` too)."""
    if not uri.startswith("s3://"):
        raise TenantError(f"{_short(uri)}: expected s3://bucket/ or s3://bucket/prefix/")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    parse_source(f"s3://{bucket}/{prefix or 'x'}")
    return f"s3://{bucket}/{prefix.removesuffix('/')}/" if prefix else f"s3://{bucket}/"


def check_networks(cidrs: list[str]) -> list[str]:
    """CIDRs as a webhook allow-list names them (`10.1.0.0/16`, `::1/128`), normalised."""
    try:
        return [str(ipaddress.ip_network(c.strip(), strict=False)) for c in cidrs]
    except ValueError as e:
        raise TenantError(f"webhook network: {e}") from None


class TenantSettings(BaseModel):
    """What one tenant may do. None: the configuration's default."""

    sources: list[str] | None = Field(
        None, description="s3://bucket/prefix/ the tenant may name as inputs"
    )
    # reading a prefix never grants writing it (several tenants may read one): a backfill's
    # output goes under the service's own prefix for the tenant, or inside one of these
    outputs: list[str] | None = Field(
        None, description="s3://bucket/prefix/ the tenant alone may write: backfills' outputs"
    )
    jobs_per_minute: int | None = Field(None, gt=0)
    jobs_in_flight: int | None = Field(None, gt=0)
    # one tenant's receivers on a private network are no place another tenant may post to:
    # where tenants share a fleet, each gets its own list (an empty one: public addresses only)
    webhook_networks: list[str] | None = Field(
        None,
        description="CIDRs its webhooks may reach although private, loopback or link-local",
    )
    webhook_secret: str = Field(default_factory=lambda: "whsec_" + secrets.token_urlsafe(32))


class Limits(BaseModel):
    """A tenant's settings with the configuration's defaults filled in."""

    sources: list[str]
    outputs: list[str] = Field(default_factory=list)
    jobs_per_minute: int
    jobs_in_flight: int
    webhook_networks: list[str] = Field(default_factory=list)

    @field_validator("sources", "outputs")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        return [check_source_prefix(uri) for uri in value]

    def may_read(self, bucket: str, key: str) -> bool:
        return _inside(f"s3://{bucket}/{key}", self.sources)

    def may_write(self, bucket: str, key: str) -> bool:
        return _inside(f"s3://{bucket}/{key}", self.outputs)


def _inside(uri: str, prefixes: list[str]) -> bool:
    return any(uri.startswith(prefix) for prefix in prefixes)


class ApiKey(BaseModel):
    id: str  # public: shown by `keys list`, the first characters of the key itself
    tenant: str
    name: str | None = None
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """Keys under `<prefix>:apikey:<sha256>` (and `<prefix>:apikeys`, id -> sha256, to list and
    revoke them), tenant settings under `<prefix>:tenant:<name>`."""

    def __init__(self, client: redis.Redis, settings: Settings, prefix: str = "whisperfleet"):
        self.redis, self.settings, self.prefix = client, settings, prefix
        # WHISPERFLEET_TENANT_SOURCES checked where the API and the scanner start
        self.default_sources = [check_source_prefix(uri) for uri in settings.tenant_sources]
        self.index = f"{prefix}:apikeys"

    def _key(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    def _tenant(self, name: str) -> str:
        return f"{self.prefix}:tenant:{name}"

    # keys

    def create_key(self, tenant: str, name: str | None = None) -> tuple[str, ApiKey]:
        """A new key for `tenant` (whose settings are created with it): the key, shown once,
        and its record."""
        check_tenant(tenant)
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(id=key_id, tenant=tenant, name=name)
        digest = _digest(key)
        with self.redis.pipeline() as pipe:
            pipe.set(self._key(digest), record.model_dump_json())
            pipe.hset(self.index, key_id, digest)
            pipe.set(self._tenant(tenant), TenantSettings().model_dump_json(), nx=True)
            pipe.execute()
        return key, record

    def lookup(self, key: str) -> ApiKey | None:
        """The record of a key that exists and is not revoked."""
        if not key.startswith(KEY_PREFIX) or len(key) > 128:
            return None
        raw = self.redis.get(self._key(_digest(key)))
        return ApiKey.model_validate_json(raw) if raw else None

    def keys(self, tenant: str | None = None) -> list[ApiKey]:
        digests = list(self.redis.hgetall(self.index).values())
        raws = self.redis.mget([self._key(d.decode()) for d in digests]) if digests else []
        found = [ApiKey.model_validate_json(r) for r in raws if r]
        found = [k for k in found if tenant is None or k.tenant == tenant]
        return sorted(found, key=lambda k: k.created_at)

    def revoke(self, key_id: str) -> bool:
        """False if there is no such key."""
        digest = self.redis.hget(self.index, key_id)
        if digest is None:
            return False
        with self.redis.pipeline() as pipe:
            pipe.delete(self._key(digest.decode()))
            pipe.hdel(self.index, key_id)
            pipe.execute()
        return True

    # settings

    def get(self, tenant: str) -> TenantSettings:
        """The tenant's own settings, created (with a webhook secret) if it has none yet."""
        key = self._tenant(tenant)
        self.redis.set(key, TenantSettings().model_dump_json(), nx=True)
        return TenantSettings.model_validate_json(self.redis.get(key))

    def update(self, tenant: str, **changes: object) -> TenantSettings:
        """Set some of the tenant's settings (None: back to the configuration's default)."""
        check_tenant(tenant)
        for grants in ("sources", "outputs"):
            if changes.get(grants):
                changes[grants] = [check_source_prefix(s) for s in changes[grants]]
        if changes.get("webhook_networks"):
            changes["webhook_networks"] = check_networks(changes["webhook_networks"])
        current = self.get(tenant)
        updated = TenantSettings.model_validate({**current.model_dump(), **changes})
        self.redis.set(self._tenant(tenant), updated.model_dump_json())
        return updated

    def tenants(self) -> list[str]:
        """The tenants given settings of their own (not the keys of their job lists and sets,
        which the same pattern matches: a name has no ':')."""
        keys = self.redis.scan_iter(match=self._tenant("*"), count=1000)
        names = (k.decode().removeprefix(self._tenant("")) for k in keys)
        return sorted(n for n in names if TENANT_NAME.fullmatch(n))

    def limits(self, tenant: str) -> Limits:
        raw = self.redis.get(self._tenant(tenant))
        own = TenantSettings.model_validate_json(raw).model_dump() if raw else {}
        s = self.settings
        sources, networks = own.get("sources"), own.get("webhook_networks")
        return Limits(
            sources=sources if sources is not None else self.default_sources,
            outputs=own.get("outputs") or [],
            jobs_per_minute=own.get("jobs_per_minute") or s.tenant_jobs_per_minute,
            jobs_in_flight=own.get("jobs_in_flight") or s.tenant_jobs_in_flight,
            webhook_networks=networks if networks is not None else s.webhook_allow_networks,
        )
