import pytest
from pydantic import ValidationError

from worker.contract.settings import Settings


def test_defaults_are_the_embedded_stack(monkeypatch):
    for var in ("REDIS_URL", "S3_ENDPOINT_URL", "MODELS", "DEFAULT_MODEL"):
        monkeypatch.delenv(f"WHISPERFLEET_{var}", raising=False)
    s = Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0" and s.redis_is_local
    assert s.s3_endpoint_url == "http://127.0.0.1:9000" and s.storage_is_local
    assert s.models == {"tiny.en": "tiny.en", "base": "base"} and s.default_model == "tiny.en"


def test_models_come_from_a_comma_list(monkeypatch):
    monkeypatch.setenv("WHISPERFLEET_MODELS", "tiny.en, mine=/models/mine ,base")
    monkeypatch.setenv("WHISPERFLEET_DEFAULT_MODEL", "mine")
    s = Settings()
    assert s.models == {"tiny.en": "tiny.en", "mine": "/models/mine", "base": "base"}
    assert s.default_model == "mine"


def test_default_model_must_be_served(monkeypatch):
    monkeypatch.setenv("WHISPERFLEET_MODELS", "tiny.en")
    monkeypatch.setenv("WHISPERFLEET_DEFAULT_MODEL", "base")
    with pytest.raises(ValidationError, match="not in models"):
        Settings()


@pytest.mark.parametrize(
    "name, english_only",
    [
        ("tiny.en", True),
        ("base", False),
        ("small", True),  # by its source
        ("fast.en", False),  # random weights take a multilingual vocabulary
    ],
)
def test_english_only_models_by_whispers_naming(name, english_only):
    settings = Settings(models="tiny.en,base,small=/models/whisper-small.en/,fast.en=random:tiny")
    assert settings.english_only(name) is english_only


def test_one_length_limit_for_audio_and_spectrograms(monkeypatch):
    monkeypatch.delenv("WHISPERFLEET_MAX_AUDIO_S", raising=False)
    assert Settings().max_audio_s == 4 * 3600
    monkeypatch.setenv("WHISPERFLEET_MAX_AUDIO_S", "90.5")
    assert Settings().max_audio_s == 90.5
    with pytest.raises(ValidationError, match="greater than 0"):
        Settings(max_audio_s=0)


def test_retentions_are_bounded_so_redis_takes_them(settings):
    """A retention Redis would refuse would fail every job's end: refused at start instead;
    the longest allowed is one Redis takes."""
    import redis

    from worker.contract.jobs import JobInput, JobRecord, JobStatus, JobStore, new_job_id
    from worker.contract.settings import MAX_RETENTION_S

    for name in ("job_retention_s", "cancelled_retention_s"):
        with pytest.raises(ValidationError, match="less than or equal"):
            Settings(**{name: 1e20})
    store = JobStore(redis.Redis.from_url(settings.redis_url), retention_s=MAX_RETENTION_S)
    job = JobRecord(
        id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=1, format="wav")
    )
    store.create(job)
    store.transition(job.id, JobStatus.succeeded)
    assert store.redis.ttl(f"whisperfleet:job:{job.id}") == MAX_RETENTION_S


@pytest.mark.parametrize("value", ["pyannote", "pyannote:", "pyannote:models/p", "nemo:/m"])
def test_a_diarization_backend_is_builtin_or_a_pyannote_directory(monkeypatch, value):
    monkeypatch.setenv("WHISPERFLEET_DIARIZATION", "pyannote:/models/pyannote")
    assert Settings().diarization == "pyannote:/models/pyannote"
    monkeypatch.setenv("WHISPERFLEET_DIARIZATION", value)
    with pytest.raises(ValidationError, match="expected builtin, or pyannote:/absolute/dir"):
        Settings()
