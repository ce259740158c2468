"""The REST API in-process against the real Redis and a real S3 endpoint, no worker."""

import io
import json
import time

import numpy as np
import pytest
import redis
import soundfile as sf
from fastapi.testclient import TestClient

from api.main import create_app
from tests.conftest import STORED_OPTIONS
from worker.contract.jobs import JobStatus, JobStore
from worker.contract.options import JobCreate
from worker.contract.presence import Presence
from worker.storage import Storage


@pytest.fixture
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


def queued_messages(settings, queue="interactive") -> list[dict]:
    return [json.loads(m) for m in redis.Redis.from_url(settings.redis_url).lrange(queue, 0, -1)]


def stored_keys(settings) -> list[str]:
    listing = Storage(settings).client.list_objects_v2(Bucket=settings.s3_bucket)
    return [o["Key"] for o in listing.get("Contents", [])]


def submit(client, data: bytes, filename="clip.flac", **fields):
    return client.post("/v1/jobs", files={"file": (filename, data)}, data=fields)


def assert_error(response, status: int, code: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    for word in words:
        assert word in error["message"]


def test_submit_stores_input_records_job_and_queues_it(client, settings, clips):
    clip = clips["en_jfk"]
    response = submit(client, clip.bytes, "my talk.flac", model="tiny.en", language="EN")
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["model"] == "tiny.en" and job["attempts"] == 0
    assert job["options"] == {**STORED_OPTIONS, "language": "en"}
    assert job["input"] == {
        "kind": "audio",
        "bytes": len(clip.bytes),
        "filename": "my talk.flac",
        "format": "flac",
        "frames": None,
    }
    stored = Storage(settings).get(f"jobs/default/{job['id']}/input")
    assert stored == clip.bytes
    assert (
        JobStore(redis.Redis.from_url(settings.redis_url)).get(job["id"]).status is JobStatus.queued
    )
    (message,) = queued_messages(settings)
    assert message["headers"]["task"] == "whisperfleet.transcribe"
    assert job["id"] in message["headers"]["argsrepr"]
    assert client.get(f"/v1/jobs/{job['id']}").json() == job


def test_bulk_priority_goes_to_the_bulk_queue(client, settings, clips):
    assert submit(client, clips["en_jfk"].bytes, priority="bulk").status_code == 202
    assert len(queued_messages(settings, "bulk")) == 1 and not queued_messages(settings)


def test_result_before_success_is_not_ready(client, clips):
    job = submit(client, clips["en_jfk"].bytes).json()
    assert_error(client.get(f"/v1/jobs/{job['id']}/result"), 409, "not_ready", "queued")


def test_a_succeeded_jobs_result_in_every_format(client, settings, clips):
    job = submit(client, clips["en_jfk"].bytes).json()
    segment = {
        "id": 0,
        "start": 0.0,
        "end": 2.5,
        "text": " And so, my fellow Americans.",
        "tokens": [50363, 843, 50488],
        "avg_logprob": -0.25,
        "compression_ratio": 0.9,
        "no_speech_prob": 0.01,
        "temperature": 0.0,
    }
    stored = {
        "text": "And so, my fellow Americans.",
        "language": "en",
        "language_probability": None,
        "duration": 11.0,
        "segments": [segment],
        "model": "tiny.en",
        "options": job["options"],
        "seed": 42,
    }
    body = json.dumps(stored, ensure_ascii=False).encode()
    Storage(settings).put_once(f"jobs/default/{job['id']}/result.json", body, "application/json")
    JobStore(redis.Redis.from_url(settings.redis_url)).transition(job["id"], JobStatus.succeeded)

    def result(format: str):
        return client.get(f"/v1/jobs/{job['id']}/result", params={"format": format})

    assert result("json").content == body
    assert result("json").headers["content-type"] == "application/json"
    assert result("text").text == "And so, my fellow Americans.\n"
    assert result("srt").text == "1\n00:00:00,000 --> 00:00:02,500\nAnd so, my fellow Americans.\n"
    assert result("vtt").text == "WEBVTT\n\n00:00.000 --> 00:02.500\nAnd so, my fellow Americans.\n"
    verbose = result("verbose_json").json()
    assert verbose["task"] == "transcribe" and verbose["segments"][0]["seek"] == 0
    # word cues: refused for a result without words, for a format without cues, and for a
    # value that is not one; never a traceback
    url = f"/v1/jobs/{job['id']}/result"
    for params, status, code, words in [
        ({"format": "srt", "granularity": "word"}, 422, "invalid_request", "word_timestamps"),
        ({"format": "text", "granularity": "word"}, 422, "invalid_request", "srt and vtt only"),
        ({"format": "vtt", "granularity": "char" * 50}, 422, "invalid_request", "granularity"),
        ({"download": "url", "granularity": "word"}, 422, "invalid_request", "stored json"),
    ]:
        answer = client.get(url, params=params)
        assert_error(answer, status, code, words)
        assert "Traceback" not in answer.text


def test_unknown_job_is_not_found(client):
    assert_error(client.get("/v1/jobs/nope"), 404, "not_found", "nope")
    assert_error(client.get("/v1/jobs/nope/result"), 404, "not_found")


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(16000 * seconds), np.float32), 16000, format="WAV")
    return buf.getvalue()


@pytest.mark.parametrize(
    "data, status, code, words",
    [
        (b"", 422, "invalid_audio", ["empty", "expected WAV, FLAC, OGG, MP3, M4A/AAC"]),
        (b"%PDF-1.7 this is a document, not a recording", 422, "invalid_audio", ["not audio"]),
        (b"<html><body>hello</body></html>", 422, "invalid_audio", ["not audio"]),
    ],
)
def test_bad_uploads_are_refused_and_nothing_is_queued(client, settings, data, status, code, words):
    response = submit(client, data)
    assert_error(response, status, code, *words)
    assert not queued_messages(settings)


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_a_spectrogram_is_accepted_as_such(client, settings):
    mel = np.zeros((1, 80, 3000), np.float32)
    job = submit(client, npy(mel), "mel.npy", model="tiny.en").json()
    assert job["input"]["kind"] == "spectrogram" and job["input"]["frames"] == 3000
    assert job["input"]["format"] == "npy" and len(queued_messages(settings)) == 1


@pytest.mark.parametrize(
    "data, words",
    [
        (npy(np.zeros((80, 2000), np.float32)), "shape [80, 2000]"),
        (npy(np.zeros((3, 80, 3000), np.float16)), "shape [3, 80, 3000]"),
        (npy(np.zeros((80, 3000), np.int32)), "dtype '<i4'"),
        (npy(np.zeros((80, 3000), np.float32))[:-100], "truncated"),
        (npy(np.full((80, 3000), np.nan, np.float16)), "NaN or infinite"),
        (npy(np.asfortranarray(np.zeros((80, 3000), np.float32))), "Fortran"),
        (b"\x93NUMPY\x01\x00\x10\x00{'descr': oops}  \n" + bytes(100), "not a Python literal"),
    ],
)
def test_bad_spectrograms_are_refused_naming_the_accepted_forms(client, settings, data, words):
    response = submit(client, data, "mel.npy")
    assert_error(response, 422, "invalid_spectrogram", words)
    assert "[1, n_mels, 3000]" in response.json()["error"]["message"]
    assert not queued_messages(settings) and stored_keys(settings) == []


def _audio(seconds: float, format: str, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    subtype = "PCM_U8" if format == "WAV" else "PCM_16"
    sf.write(buf, np.zeros(int(rate * seconds), np.float32), rate, format=format, subtype=subtype)
    return buf.getvalue()


def _streamed_wav(seconds: float) -> bytes:
    """A WAV as ffmpeg writes it into a pipe: its sizes left at 0xFFFFFFFF."""
    wav = bytearray(_audio(seconds, "WAV"))
    at = wav.index(b"data")
    wav[4:8] = wav[at + 4 : at + 8] = b"\xff\xff\xff\xff"
    return bytes(wav)


@pytest.mark.parametrize(
    "data, words",
    [
        (npy(np.zeros((80, 6001), np.float16)), "6001 frames (60.01 s); the limit is 60 s"),
        (_audio(61, "WAV"), "the WAV header says 61.0 s; the limit is 60 s"),
        (_audio(61, "FLAC"), "the FLAC header says 61.0 s; the limit is 60 s"),
        # only the header: 4 h at 8 kHz in 8 bits, before any of it
        (_audio(1, "WAV")[:40] + (4 * 3600 * 8000).to_bytes(4, "little"), "says 14400.0 s"),
    ],
)
def test_longer_than_the_limit_is_too_long_from_the_header(client, settings, data, words):
    assert_error(submit(client, data), 422, "too_long", words)
    assert not queued_messages(settings) and stored_keys(settings) == []


@pytest.mark.parametrize(
    "data",
    [
        npy(np.zeros((80, 6000), np.float16)),
        _audio(60, "WAV"),
        _audio(60, "FLAC"),
        _streamed_wav(1),  # its header does not say: the worker finds out as it decodes
    ],
)
def test_up_to_the_limit_or_not_said_is_accepted(client, data):
    assert submit(client, data).status_code == 202


def test_declared_input_must_match_the_file(client, clips):
    response = submit(client, clips["en_jfk"].bytes, input="spectrogram")
    assert_error(response, 422, "invalid_spectrogram", "declared input=spectrogram")


def test_over_the_size_cap_is_too_large(client, settings):
    big = _wav(70)  # 2.2 MB of WAV against a 2 MiB cap
    assert len(big) > settings.max_upload_bytes
    assert_error(submit(client, big, "long.wav"), 413, "too_large", str(settings.max_upload_bytes))
    assert not queued_messages(settings)


def test_size_cap_holds_without_content_length(client, settings):
    big = _wav(70)
    boundary = "xyz"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        ).encode()
        + big
        + f"\r\n--{boundary}--\r\n".encode()
    )

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    response = client.post(
        "/v1/jobs",
        content=chunks(),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert_error(response, 413, "too_large")


@pytest.mark.parametrize(
    "fields, code, words",
    [
        ({"model": "large-v9"}, "unknown_model", ["large-v9", "tiny.en, base"]),
        ({"model": "/etc/passwd"}, "unknown_model", ["available"]),
        ({"model": "base", "language": "klingon"}, "invalid_option", ["'klingon'", "ISO 639-1"]),
        ({"task": "summarize"}, "invalid_option", ["task 'summarize'", "'transcribe' or"]),
        ({"priority": "urgent"}, "invalid_option", ["'interactive' or 'bulk'"]),
        ({"mode": "fast"}, "invalid_option", ["'sequential' or 'chunked'"]),
        ({"timestamps": "sometimes"}, "invalid_option", ["timestamps", "true or false"]),
        ({"word_timestamps": "words"}, "invalid_option", ["word_timestamps", "true or false"]),
        ({"timestamps": ["true", "false"]}, "invalid_request", ["'timestamps' was sent twice"]),
        ({"prompt": "x" * 1025}, "invalid_option", ["prompt of 1025", "at most 1024 characters"]),
        ({"prompt": "x" * 5000}, "invalid_request", ["'prompt' is over 4096 bytes"]),
        # English-only models: refused at the door, not failed later by the worker
        ({"language": "fr"}, "invalid_option", ["'tiny.en' is English-only", "drop language"]),
        (
            {"model": "tiny.en", "task": "translate"},
            "invalid_option",
            ["'tiny.en' is English-only", "drop task=translate", "(base)"],
        ),
        ({"langauge": "en"}, "invalid_request", ["unknown form field 'langauge'"]),
    ],
)
def test_bad_options_are_refused_and_the_upload_removed(
    client, settings, clips, fields, code, words
):
    response = submit(client, clips["en_jfk"].bytes, **fields)
    assert_error(response, 422, code, *words)
    assert "Traceback" not in response.text and "ValidationError" not in response.text
    assert not queued_messages(settings)
    assert stored_keys(settings) == []


def test_a_multilingual_model_takes_any_language_and_translates(client, clips):
    fields = {
        "model": "base",
        "language": "fr",
        "task": "translate",
        "timestamps": "false",
        "seed": "42",
    }
    response = submit(client, clips["fr_fleurs_000"].bytes, **fields)
    assert response.status_code == 202, response.text
    assert response.json()["options"] == {
        **STORED_OPTIONS,
        "language": "fr",
        "task": "translate",
        "timestamps": False,
        "seed": 42,
    }


def test_options_are_stored_on_the_record(client, settings, clips):
    fields = {"timestamps": "false", "mode": "chunked", "prompt": "Ich bin ein Berliner."}
    job = submit(client, clips["en_jfk"].bytes, **fields).json()
    record = JobStore(redis.Redis.from_url(settings.redis_url)).get(job["id"])
    assert record.options.timestamps is False and record.options.mode == "chunked"
    assert record.options.prompt == "Ich bin ein Berliner." and record.model == "tiny.en"


def test_empty_fields_count_as_omitted(client, clips):
    job = submit(client, clips["en_jfk"].bytes, language="", task="", model="").json()
    assert job["model"] == "tiny.en" and job["options"]["task"] == "transcribe"


@pytest.mark.parametrize(
    "files, data, field",
    [
        ([("file", ("a.flac", None)), ("file", ("b.flac", None))], {}, "file"),
        ([("file", ("a.flac", None))], {"language": ["en", "de"]}, "language"),
    ],
)
def test_a_field_sent_twice_is_refused_and_nothing_kept(
    client, settings, clips, files, data, field
):
    """Which of two values would count is a guess: neither does."""
    files = [(name, (fn, body or clips["en_jfk"].bytes)) for name, (fn, body) in files]
    response = client.post("/v1/jobs", files=files, data=data)
    assert_error(response, 422, "invalid_request", f"form field '{field}' was sent twice")
    assert not queued_messages(settings)
    assert stored_keys(settings) == []


def test_missing_file_and_wrong_content_type(client):
    assert_error(client.post("/v1/jobs", data={"model": "tiny.en"}), 422, "invalid_request", "file")
    assert_error(client.post("/v1/jobs", json={"file": "x"}), 422, "invalid_request", "multipart")


def test_health_and_readiness(client, settings):
    """Ready while a worker takes jobs from every queue (a worker's mark, as its heartbeat
    renews it; tests/faults has real workers come and go)."""
    assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
    presence = Presence(redis.Redis.from_url(settings.redis_url))
    expected = {"redis": "ok", "storage": "ok", "workers": "unavailable"}
    assert client.get("/readyz").json() == {"status": "unavailable", "checks": expected}
    presence.mark("w1", ["interactive"], ttl_s=60)
    assert client.get("/readyz").status_code == 503  # no worker takes bulk jobs
    presence.mark("w2", ["bulk"], ttl_s=0.3)
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {**expected, "workers": "ok"}
    time.sleep(0.4)  # w2 died without withdrawing: its mark lapsed
    assert client.get("/readyz").json()["checks"]["workers"] == "unavailable"
    presence.mark("w2", ["bulk"], ttl_s=60)
    presence.withdraw("w1", ["interactive"])
    assert presence.workers(["interactive", "bulk"]) == {"interactive": 0, "bulk": 1}


def test_readiness_reports_unreachable_storage(settings):
    broken = settings.model_copy(update={"s3_endpoint_url": "http://127.0.0.1:9"})
    with TestClient(create_app(broken)) as c:
        response = c.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["redis"] == "ok"
    assert response.json()["checks"]["storage"] == "unavailable"


def test_openapi_describes_the_submission_fields(client):
    operation = client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]
    form = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file"] and form["properties"]["file"]["format"] == "binary"
    assert list(form["properties"]) == ["file", *JobCreate.model_fields]
    assert form["properties"]["task"]["enum"] == ["transcribe", "translate"]
    assert form["properties"]["timestamps"] == {
        "default": True,
        "description": JobCreate.model_fields["timestamps"].description,
        "title": "Timestamps",
        "type": "boolean",
    }
    assert all(field["description"] for field in form["properties"].values())


def test_openapi_declares_the_result(client):
    spec = client.get("/openapi.json").json()
    ok = spec["paths"]["/v1/jobs/{job_id}/result"]["get"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["anyOf"] == [  # the transcript, or download=url's
        {"$ref": "#/components/schemas/TranscriptResult"},
        {"$ref": "#/components/schemas/ResultUrl"},
    ]
    assert {"text/plain; charset=utf-8", "text/vtt; charset=utf-8"} <= set(ok)
    schemas = spec["components"]["schemas"]
    assert set(schemas["TranscriptResult"]["properties"]) == {
        "text",
        "language",
        "language_probability",
        "duration",
        "segments",
        "words",
        "model",
        "options",
        "speakers",
        "seed",
    }
    segment = set(schemas["TranscriptSegment"]["properties"])
    assert {"no_speech_prob", "words", "speaker"} <= segment
    assert {"speaker", "talk_time"} == set(schemas["TranscriptSpeaker"]["properties"])
    assert {"timestamps", "word_timestamps", "vad", "diarize", "speakers"} <= set(
        schemas["JobOptions"]["properties"]
    )
