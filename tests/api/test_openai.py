"""OpenAI's `/v1/audio/transcriptions` and `/v1/audio/translations`.

In-process (no worker: a thread plays one, finishing the job as each test needs) for the
mapping of fields, answers and refusals; then the official `openai` client, unchanged, against
the real stack (the API and a worker as processes, tiny.en and base on the CPU, the real
Redis, moto's S3 server) for every response format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient
from openai.types.audio import (
    Transcription,
    TranscriptionVerbose,
    TranslationVerbose,
)

from api.main import create_app
from tests import conftest
from tests.conftest import free_port, stop, wait_for_port
from tools.wer import word_error_rate
from worker.contract.formats import WRITERS
from worker.contract.jobs import JobError, JobStatus, JobStore
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.storage import Storage

TRANSCRIBE, TRANSLATE = "/v1/audio/transcriptions", "/v1/audio/translations"
FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
RESULT = {
    "text": "Hello there. General Kenobi.",
    "language": "en",
    "language_probability": None,
    "duration": 3.5,
    "segments": [
        {
            "id": 0,
            "start": 0.0,
            "end": 1.5,
            "text": " Hello there.",
            "tokens": [1, 2],
            "avg_logprob": -0.2,
            "compression_ratio": 1.1,
            "no_speech_prob": 0.01,
            "temperature": 0.0,
        },
        {
            "id": 1,
            "start": 1.5,
            "end": 3.5,
            "text": " General Kenobi.",
            "tokens": [3],
            "avg_logprob": -0.3,
            "compression_ratio": 1.1,
            "no_speech_prob": 0.02,
            "temperature": 0.2,
        },
    ],
    "model": "tiny.en",
    "options": {"task": "transcribe"},
    "seed": 7,
}


# --- in-process -------------------------------------------------------------------------------


def app_client(settings: Settings, **changes) -> TestClient:
    return TestClient(create_app(settings.model_copy(update=changes)))


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with app_client(settings, sync_timeout_s=10.0) as c:
        yield c


@pytest.fixture
def store(settings) -> JobStore:
    return JobStore(redis.Redis.from_url(settings.redis_url))


def play_worker(settings, outcome: str, code: str = "invalid_audio") -> threading.Thread:
    """A thread that takes the next job to run and ends it with `outcome`, as a worker would:
    `succeeded` stores RESULT (with the job's task) first."""
    store, storage = JobStore(redis.Redis.from_url(settings.redis_url)), Storage(settings)

    def run() -> None:
        deadline = time.monotonic() + 10
        while not (ids := store.redis.zrange(store.active, 0, -1)):
            assert time.monotonic() < deadline, "no job was queued"
            time.sleep(0.01)
        record = store.transition(ids[0].decode(), JobStatus.running)
        if outcome == "succeeded":
            result = {**RESULT, "options": record.options.model_dump()}
            storage.put_once(record.result_key, json.dumps(result).encode(), "application/json")
            store.transition(record.id, JobStatus.succeeded)
        elif outcome == "failed":
            error = JobError(code=code, message="the reason")
            store.transition(record.id, JobStatus.failed, error=error)
        else:
            error = JobError(code="cancelled", message="cancelled by the client")
            store.transition(record.id, JobStatus.cancelled, error=error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def post(client, path=TRANSCRIBE, data: bytes = b"", filename="clip.flac", **fields):
    """OpenAI's form: the fields, then the file, as the openai client sends them; a list is
    sent as repeated parts."""
    return client.post(path, data=fields, files={"file": (filename, data)})


def assert_error(response, status: int, code: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    for word in words:
        assert word in error["message"], error


def only_job(store: JobStore):
    (job,) = store.page("default", 10).records
    return job


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_response_format_is_rendered_from_the_job(client, settings, store, clips, fmt):
    play_worker(settings, "succeeded")
    response = post(client, data=clips["en_jfk"].bytes, model="whisper-1", response_format=fmt)
    assert response.status_code == 200, response.text
    result = TranscriptResult.model_validate(RESULT)
    if fmt == "json":
        assert response.json() == {"text": RESULT["text"]}
        Transcription.model_validate(response.json())
    elif fmt == "verbose_json":
        verbose = TranscriptionVerbose.model_validate(response.json())
        assert verbose.language == "english" and verbose.duration == 3.5
        assert [s.text for s in verbose.segments] == [" Hello there.", " General Kenobi."]
        assert verbose.segments[1].seek == 150 and verbose.segments[1].temperature == 0.2
    else:
        assert response.text == WRITERS[fmt].render(result)
        assert response.headers["content-type"] == WRITERS[fmt].media_type


def test_the_form_maps_to_an_interactive_job_and_whisper_1_to_the_default_model(
    client, settings, store, clips
):
    play_worker(settings, "succeeded")
    fields = {"model": "whisper-1", "language": "EN", "prompt": "Kenobi", "temperature": "0.4"}
    response = post(client, data=clips["en_jfk"].bytes, filename="talk.flac", **fields)
    assert response.status_code == 200, response.text
    job = only_job(store)
    assert job.model == settings.default_model == "tiny.en"
    assert job.priority == "interactive" and job.input.filename == "talk.flac"
    assert job.options.task == "transcribe" and job.options.language == "en"
    assert job.options.prompt == "Kenobi" and job.options.temperature == 0.4


def test_a_translation_is_a_translate_job_and_answers_in_the_translation_shape(
    client, settings, store, clips
):
    play_worker(settings, "succeeded")
    response = post(
        client,
        TRANSLATE,
        clips["fr_fleurs_000"].bytes,
        model="base",
        response_format="verbose_json",
    )
    assert response.status_code == 200, response.text
    verbose = TranslationVerbose.model_validate(response.json())
    assert response.json()["task"] == "translate" and verbose.text == RESULT["text"]
    job = only_job(store)
    assert job.model == "base" and job.options.task == "translate"


def test_a_job_past_the_wait_answers_202_with_the_job_and_where_to_poll(settings, clips):
    with app_client(settings, sync_timeout_s=0.2) as client:
        started = time.monotonic()
        response = post(client, data=clips["en_jfk"].bytes, response_format="text")
        assert 0.2 <= time.monotonic() - started < 5
        assert response.status_code == 202, response.text
        job = response.json()
        assert job["status"] == "queued" and job["priority"] == "interactive"
        assert response.headers["location"] == f"/v1/jobs/{job['id']}"
        assert client.get(response.headers["location"]).json() == job


@pytest.mark.parametrize(
    "code, status",
    [("invalid_audio", 422), ("too_long", 422), ("internal", 500), ("poison", 500)],
)
def test_a_failed_job_answers_its_code_and_is_not_retried(client, settings, clips, code, status):
    play_worker(settings, "failed", code)
    response = post(client, data=clips["en_jfk"].bytes)
    assert_error(response, status, code, "failed: the reason")
    assert response.headers["x-should-retry"] == "false"


def test_a_job_cancelled_while_waited_for_answers_409(client, settings, clips):
    play_worker(settings, "cancelled")
    response = post(client, data=clips["en_jfk"].bytes)
    assert_error(response, 409, "job_cancelled", "was cancelled")
    assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    "path, fields, code, words",
    [
        (TRANSCRIBE, {"response_format": "xml"}, "invalid_option", ["response_format 'xml'"]),
        (
            TRANSCRIBE,
            {"response_format": "verbose_json", "timestamp_granularities[]": ["word", "char"]},
            "invalid_option",
            ["['char', 'word']: expected segment, word"],
        ),
        (  # a list is sent as repeated parts; any other field twice is ambiguous
            TRANSCRIBE,
            {"response_format": ["text", "srt"]},
            "invalid_request",
            ["'response_format' was sent twice"],
        ),
        (  # a list's parts together are bounded as one field is
            TRANSCRIBE,
            {"response_format": "verbose_json", "timestamp_granularities[]": ["word"] * 1000},
            "invalid_request",
            ["'timestamp_granularities[]' is over 4096 bytes"],
        ),
        (
            TRANSCRIBE,
            {"timestamp_granularities[]": "segment"},
            "invalid_option",
            ["needs response_format=verbose_json"],
        ),
        (TRANSCRIBE, {"temperature": "1.5"}, "invalid_option", ["temperature '1.5'"]),
        (TRANSCRIBE, {"language": "xx"}, "invalid_option", ["language 'xx'"]),
        (TRANSCRIBE, {"model": "whisper-2"}, "unknown_model", ["'whisper-2'", "tiny.en"]),
        (TRANSCRIBE, {"stream": "true"}, "invalid_option", ["stream"]),
        (TRANSCRIBE, {"task": "translate"}, "invalid_request", ["unknown form field 'task'"]),
        (TRANSLATE, {"language": "fr"}, "invalid_request", ["unknown form field 'language'"]),
        # whisper-1 is the default model, English-only here
        (TRANSLATE, {"model": "whisper-1"}, "invalid_option", ["English-only", "transcriptions"]),
    ],
)
def test_refused_before_anything_is_stored_or_queued(
    client, settings, store, clips, path, fields, code, words
):
    response = post(client, path, clips["en_jfk"].bytes, **fields)
    assert_error(response, 422, code, *words)
    # in the words of this route: no field it cannot send (issue #37: "drop task=translate")
    assert "task=" not in response.json()["error"]["message"]
    assert not store.redis.zrange(store.active, 0, -1)
    listing = Storage(settings).client.list_objects_v2(Bucket=settings.s3_bucket)
    assert not listing.get("Contents")


@pytest.mark.parametrize(
    "granularities", [["segment"], ["word"], ["segment", "word"], ["word", "segment"]]
)
def test_granularities_with_verbose_json_are_accepted(
    client, settings, store, clips, granularities
):
    """As the openai client sends a list: repeated parts, one value each; `word` asks the job
    for word timestamps."""
    play_worker(settings, "succeeded")
    response = post(
        client,
        data=clips["en_jfk"].bytes,
        response_format="verbose_json",
        **{"timestamp_granularities[]": granularities},
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["segments"]) == 2
    assert only_job(store).options.word_timestamps is ("word" in granularities)


def test_a_retry_with_the_same_idempotency_key_answers_the_first_job(
    client, settings, store, clips
):
    play_worker(settings, "succeeded")
    headers = {"Idempotency-Key": "call-0042"}
    fields = {"data": {"response_format": "text"}, "headers": headers}
    first = client.post(TRANSCRIBE, files={"file": ("a.flac", clips["en_jfk"].bytes)}, **fields)
    again = client.post(TRANSCRIBE, files={"file": ("a.flac", clips["en_jfk"].bytes)}, **fields)
    assert first.status_code == again.status_code == 200, again.text
    assert first.text == again.text == RESULT["text"] + "\n"
    only_job(store)  # one job


def test_not_audio_is_refused_at_the_door(client, settings, store):
    response = post(client, data=b"just some notes, not audio", filename="notes.txt")
    assert_error(response, 422, "invalid_audio", "not audio")
    assert not store.redis.zrange(store.active, 0, -1)


def test_openapi_describes_the_form_and_every_answer(client):
    spec = client.get("/openapi.json").json()
    for path, has_language in ((TRANSCRIBE, True), (TRANSLATE, False)):
        op = spec["paths"][path]["post"]
        form = op["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert form["required"] == ["file"]
        assert form["properties"]["file"]["format"] == "binary"
        assert set(form["properties"]["response_format"]["enum"]) == set(FORMATS)
        assert "timestamp_granularities[]" in form["properties"]
        assert ("language" in form["properties"]) is has_language
        assert set(op["responses"]["200"]["content"]) == {
            "application/json",
            "text/plain; charset=utf-8",
            "application/x-subrip; charset=utf-8",
            "text/vtt; charset=utf-8",
        }
        assert op["responses"]["202"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/JobPublic"
        }
        for status in ("401", "413", "422", "429", "500", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"
            }


# --- the official client against the real stack --------------------------------------------

REDIS_URL = f"{conftest.REDIS_URL}/13"  # the e2e `stack` test's db: never in use at once


@dataclass
class Stack:
    url: str
    key: str
    env: dict[str, str]

    def client(self, key: str | None = None, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.url}/v1", api_key=key or self.key)


@pytest.fixture(scope="module")
def stack(s3_endpoint, tmp_path_factory) -> Iterator[Stack]:
    """The API (with keys) and one worker as processes; tiny.en is the default model."""
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    env = {
        "WHISPERFLEET_REDIS_URL": REDIS_URL,
        "WHISPERFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "WHISPERFLEET_S3_BUCKET": f"openai-{uuid.uuid4().hex[:12]}",
        "WHISPERFLEET_MAX_UPLOAD_BYTES": str(4 * 1024 * 1024),
        "WHISPERFLEET_MAX_AUDIO_S": "60",
        "WHISPERFLEET_DEVICE": "cpu",
        "WHISPERFLEET_MODELS": "tiny.en,base",
        "WHISPERFLEET_DEFAULT_MODEL": "tiny.en",
        "WHISPERFLEET_METRICS_PORT": "0",
        "WHISPERFLEET_AUTH": "keys",
    }
    settings = Settings(**{k.removeprefix("WHISPERFLEET_").lower(): v for k, v in env.items()})
    key, _ = Tenants(client, settings).create_key("acme")
    logs = tmp_path_factory.mktemp("openai")
    port = free_port()
    cli = [sys.executable, "-m", "worker.cli"]
    full = {**os.environ, **env}
    with open(logs / "worker.log", "w") as wlog, open(logs / "api.log", "w") as alog:
        worker = subprocess.Popen(
            [*cli, "worker", "--concurrency", "4"], env=full, stdout=wlog, stderr=wlog
        )
        api = subprocess.Popen(
            [*cli, "api", "--port", str(port)], env=full, stdout=alog, stderr=alog
        )
    try:
        wait_for_port(port, api)
        yield Stack(f"http://127.0.0.1:{port}", key, full)
    finally:
        stop(api)
        stop(worker)
        client.flushdb()
        for name in ("api.log", "worker.log"):
            sys.stderr.write(f"--- {name} (tail)\n{(logs / name).read_text()[-3000:]}\n")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_openai_client_gets_every_response_format(stack, clips, fmt):
    clip = clips["en_jfk"]
    extra = {"timestamp_granularities": ["segment"]} if fmt == "verbose_json" else {}
    with open(clip.path, "rb") as f:
        raw = stack.client().audio.transcriptions.with_raw_response.create(
            model="whisper-1",
            file=f,
            response_format=fmt,
            language="en",
            temperature=0,
            **extra,
        )
    assert raw.status_code == 200
    answer = raw.parse()
    if fmt == "json":
        assert isinstance(answer, Transcription)
        text = answer.text
    elif fmt == "verbose_json":
        assert isinstance(answer, TranscriptionVerbose)
        strict = TranscriptionVerbose.model_validate_json(raw.text)  # validated, not built
        assert strict.language == "english" and strict.duration == pytest.approx(clip.duration)
        assert strict.segments and strict.segments[0].start == 0
        assert strict.segments[-1].end <= clip.duration + 0.01
        assert strict.text.strip() == "".join(s.text for s in strict.segments).strip()
        text = strict.text
    else:
        assert isinstance(answer, str)
        text = answer
        if fmt == "srt":
            assert answer.startswith("1\n00:00:00,000 --> 00:00:")
        elif fmt == "vtt":
            assert answer.startswith("WEBVTT\n\n00:00.000 --> 00:")
        else:
            assert answer.endswith("\n") and "-->" not in answer
    words = " ".join(line for line in text.splitlines() if "-->" not in line)
    words = " ".join(w for w in words.split() if not w.isdigit() and w != "WEBVTT")
    assert word_error_rate([clip.reference], [words]) <= 0.10, text


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # OpenAI's whisper-1 notice
def test_the_openai_client_translates_french_with_a_multilingual_model(stack, clips):
    with open(clips["fr_fleurs_000"].path, "rb") as f:
        answer = stack.client().audio.translations.create(
            model="base", file=f, response_format="verbose_json"
        )
    assert isinstance(answer, TranslationVerbose)
    assert answer.language == "french"
    assert "accident" in answer.text.lower() and " the " in f" {answer.text.lower()} "


@pytest.mark.slow
def test_bad_input_raises_unprocessable_in_the_client(stack, clips):
    client = stack.client()
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # at the door
        client.audio.transcriptions.create(model="whisper-1", file=("notes.txt", b"not audio"))
    assert refused.value.code == "invalid_audio"
    cut = clips["en_jfk"].bytes[: len(clips["en_jfk"].bytes) // 2]
    with pytest.raises(openai.UnprocessableEntityError) as failed:  # by the worker
        client.audio.transcriptions.create(model="whisper-1", file=("cut.flac", cut))
    assert failed.value.code == "invalid_audio"
    assert "damaged or cut short" in failed.value.message


@pytest.mark.slow
def test_a_key_is_needed(stack, clips):
    with pytest.raises(openai.AuthenticationError) as refused:
        stack.client(key="wf_unknown").audio.transcriptions.create(
            model="whisper-1", file=("jfk.flac", clips["en_jfk"].bytes)
        )
    assert refused.value.code == "invalid_key"
    response = httpx.post(
        f"{stack.url}{TRANSCRIBE}",
        data={"model": "whisper-1"},
        files={"file": ("jfk.flac", clips["en_jfk"].bytes)},
    )
    assert_error(response, 401, "unauthorized", "send an API key")


@pytest.mark.slow
def test_past_the_wait_the_client_gets_202_and_polls_the_job(stack, clips, tmp_path):
    """A second API on the same queue that waits 10 ms: 202, then the job API has the
    result."""
    port = free_port()
    env = {**stack.env, "WHISPERFLEET_SYNC_TIMEOUT_S": "0.01"}
    with open(tmp_path / "api.log", "w") as log:
        api = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "api", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_port(port, api)
        url = f"http://127.0.0.1:{port}"
        raw = stack.client(url=url).audio.transcriptions.with_raw_response.create(
            model="whisper-1", file=("jfk.flac", clips["en_jfk"].bytes), response_format="text"
        )
        assert raw.status_code == 202
        job = json.loads(raw.text)
        assert raw.headers["location"] == f"/v1/jobs/{job['id']}"
        headers = {"Authorization": f"Bearer {stack.key}"}
        deadline = time.monotonic() + 60
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
            job = httpx.get(f"{url}{raw.headers['location']}", headers=headers).json()
        assert job["status"] == "succeeded", job
        text = httpx.get(
            f"{url}/v1/jobs/{job['id']}/result", params={"format": "text"}, headers=headers
        ).text
        assert word_error_rate([clips["en_jfk"].reference], [text]) <= 0.10
    finally:
        stop(api)
