"""The whole path with real processes: uvicorn serving the API, a Celery worker process,
moto's S3 server and the real Redis. Real weights (tiny.en), real speech."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import psutil
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests import conftest
from tests.conftest import free_port, random_ctc, stop, wait_for_port
from tools.wer import word_error_rate

pytestmark = pytest.mark.slow
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="session")
def api_url(stack_env, tmp_path_factory):
    """`whisperfleet api` and `whisperfleet worker` as separate processes; besides the
    packaged models, `w2v` and `q3`: a random-weight wav2vec2 and a Qwen3-ASR-shaped model
    through transformers (engine.hf), and `q3n`: the same Qwen3-ASR directory in the engine's
    own implementation (engine.qwen3_asr)."""
    from tools.qwen3_asr import make

    w2v = random_ctc(tmp_path_factory.mktemp("w2v"), "wav2vec2")
    q3 = make(tmp_path_factory.mktemp("q3") / "qwen3-asr")
    models = f"tiny.en,base,w2v=hf:{w2v},q3=hf:{q3},q3n={q3}"
    stack_env = {**stack_env, "WHISPERFLEET_MODELS": models}
    logs = tmp_path_factory.mktemp("stack")
    port = free_port()
    cli = [sys.executable, "-m", "worker.cli"]
    with open(logs / "worker.log", "w") as wlog, open(logs / "api.log", "w") as alog:
        worker = subprocess.Popen([*cli, "worker"], env=stack_env, stdout=wlog, stderr=wlog)
        api = subprocess.Popen(
            [*cli, "api", "--port", str(port)], env=stack_env, stdout=alog, stderr=alog
        )
    try:
        wait_for_port(port, api)
        yield f"http://127.0.0.1:{port}", worker
    finally:
        stop(api)
        stop(worker)
        for name in ("api.log", "worker.log"):
            sys.stderr.write(f"--- {name} (tail)\n{(logs / name).read_text()[-3000:]}\n")


def run_job(url: str, data: bytes, filename: str, timeout: float = 120.0, **fields) -> dict:
    response = httpx.post(f"{url}/v1/jobs", files={"file": (filename, data)}, data=fields)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")


def test_a_real_clip_is_transcribed_through_the_queue(api_url, clips, stack_env):
    url, _ = api_url
    clip = clips["en_jfk"]
    job = run_job(url, clip.bytes, "jfk.flac")
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 1 and job["error"] is None
    assert job["progress"] == {"done_s": clip.duration, "total_s": clip.duration}
    # its record stays WHISPERFLEET_JOB_RETENTION_S (30 days) from its end, then goes
    client = redis.Redis.from_url(stack_env["WHISPERFLEET_REDIS_URL"])
    assert 30 * 86400 - 120 < client.ttl(f"whisperfleet:job:{job['id']}") <= 30 * 86400

    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result").json()
    assert result["language"] == "en" and result["model"] == "tiny.en"
    assert result["duration"] == pytest.approx(clip.duration, abs=0.01)
    assert result["text"] == "".join(s["text"] for s in result["segments"]).strip()
    assert word_error_rate([clip.reference], [result["text"]]) <= 0.10

    text = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "text"})
    assert text.headers["content-type"].startswith("text/plain")
    assert text.text == result["text"] + "\n"


def test_several_jobs_in_flight_all_finish(api_url, english_clips):
    url, _ = api_url
    ids = [
        httpx.post(f"{url}/v1/jobs", files={"file": (c.path.name, c.bytes)}).json()["id"]
        for c in english_clips
    ]
    deadline = time.monotonic() + 180
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            if httpx.get(f"{url}/v1/jobs/{job_id}").json()["status"] == "succeeded":
                pending.discard(job_id)
        time.sleep(0.2)
    assert not pending
    texts = [httpx.get(f"{url}/v1/jobs/{i}/result").json()["text"] for i in ids]
    assert word_error_rate([c.reference for c in english_clips], texts) <= 0.10


def test_the_worker_serves_prometheus_metrics(api_url, stack_env, clips):
    url, _ = api_url
    job = run_job(url, clips["en_jfk"].bytes, "jfk.flac")
    assert job["status"] == "succeeded"
    port = stack_env["WHISPERFLEET_METRICS_PORT"]
    deadline = time.monotonic() + 5  # the engine core sends its metrics once a second
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("whisperfleet_")
        }
        if values["whisperfleet_audio_seconds_total"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values['whisperfleet_jobs_total{outcome="succeeded"}'] >= 1
    assert values["whisperfleet_batch_inputs_count"] >= 1
    assert values["whisperfleet_windows_encoded_total"] >= 1
    assert values["whisperfleet_audio_seconds_total"] >= clips["en_jfk"].duration - 0.01
    assert values['whisperfleet_engine_seconds_total{phase="decoder"}'] > 0
    assert values['whisperfleet_queue_depth{queue="interactive"}'] == 0
    assert values["whisperfleet_active_jobs"] >= 0 and values["whisperfleet_running_jobs"] == 0
    stages = {
        sample.labels["stage"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "whisperfleet_job_stage_seconds_count"
        and sample.labels["priority"] == "interactive"
    }
    assert min(stages.get(s, 0) for s in ("queue", "fetch", "decode", "engine", "store")) >= 1
    assert values["whisperfleet_engine_busy_seconds_total"] > 0
    ready = httpx.get(f"http://127.0.0.1:{port}/ready")  # it took a job: it is ready
    assert (ready.status_code, ready.json()) == (200, {"ready": True})


def _truncated_flac(clip) -> bytes:
    return clip.bytes[: len(clip.bytes) // 2]


def _corrupt_wav(clip) -> bytes:
    return b"RIFF\xff\xff\x00\x00WAVEfmt " + os.urandom(4000)


def _128_mel_spectrogram(clip) -> bytes:
    """Well formed, so the API takes it; but tiny.en has 80 mel bins, which only the worker
    knows."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.zeros((128, 3000), np.float32))
    return buf.getvalue()


@pytest.mark.parametrize(
    "make, code, words",
    [
        (_truncated_flac, "invalid_audio", ["the FLAC audio is damaged or cut short"]),
        (_corrupt_wav, "invalid_audio", ["could not decode", "expected WAV, FLAC, OGG, MP3"]),
        (_128_mel_spectrogram, "invalid_spectrogram", ["shape [128, 3000]", "[80, 3000]"]),
    ],
)
def test_input_only_the_worker_can_judge_fails_that_job_with_a_reason(
    api_url, clips, make, code, words
):
    url, worker = api_url
    job = run_job(url, make(clips["en_jfk"]), "bad.flac")
    assert job["status"] == "failed", job
    assert job["error"]["code"] == code
    for word in words:
        assert word in job["error"]["message"]
    assert job["finished_at"] is not None
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result")
    # failed, not "not ready": a client waiting for ready stops here, with the reason
    assert result.status_code == 409 and result.json()["error"]["code"] == "job_failed"
    assert job["error"]["message"] in result.json()["error"]["message"]
    # the worker lives on and takes the next job
    assert worker.poll() is None
    next_job = run_job(url, clips["en_librispeech_1272-128104-0000"].bytes, "ok.flac")
    assert next_job["status"] == "succeeded"


def test_a_spectrogram_job_gives_the_text_of_its_audio(api_url, clips):
    import io

    import numpy as np
    from transformers import WhisperFeatureExtractor

    from engine.audio import decode_audio

    url, _ = api_url
    clip = clips["en_jfk"]
    mel = WhisperFeatureExtractor(feature_size=80)(
        decode_audio(clip.bytes), sampling_rate=16000, return_tensors="np"
    ).input_features
    buf = io.BytesIO()
    np.save(buf, mel)
    from_mel = run_job(url, buf.getvalue(), "jfk.npy")
    from_audio = run_job(url, clip.bytes, "jfk.flac")
    assert from_mel["status"] == from_audio["status"] == "succeeded"
    assert from_mel["input"]["kind"] == "spectrogram"
    texts = [
        httpx.get(f"{url}/v1/jobs/{j['id']}/result?format=text").text
        for j in (from_mel, from_audio)
    ]
    assert texts[0] == texts[1]


def test_long_audio_and_subtitle_formats(api_url, clips):
    import io

    import numpy as np
    import soundfile as sf

    from engine.audio import decode_audio

    url, _ = api_url
    names = ("en_jfk", "en_ljspeech_LJ050-0131", "en_jfk", "en_jfk")
    audio = np.concatenate([decode_audio(clips[n].bytes) for n in names])
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="OGG", subtype="VORBIS")
    job = run_job(url, buf.getvalue(), "long.ogg", mode="chunked")
    assert job["status"] == "succeeded", job
    assert job["progress"]["done_s"] == pytest.approx(len(audio) / 16000, abs=0.05)
    srt = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "srt"})
    assert srt.headers["content-type"].startswith("application/x-subrip")
    cues = srt.text.strip().split("\n\n")
    assert len(cues) >= 4 and cues[0].startswith("1\n00:00:00,000 --> ")
    vtt = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "vtt"}).text
    assert vtt.startswith("WEBVTT\n\n00:00.000 --> ")
    verbose = httpx.get(f"{url}/v1/jobs/{job['id']}/result?format=verbose_json").json()
    assert verbose["language"] == "english" and verbose["segments"][-1]["end"] > 30


def test_word_timestamps_through_the_queue_match_transformers(api_url, clips):
    """REST -> queue -> worker -> stored result: the words, their times near transformers' own
    on the same weights (tools.word_timing), and a subtitle cue per word."""
    import soundfile as sf

    from engine.loader import model_dir
    from tools.word_timing import ClipWords, transformers_words

    url, _ = api_url
    clip = clips["en_librispeech_1272-128104-0000"]
    job = run_job(url, clip.bytes, "clip.flac", word_timestamps="true", temperature="0")
    assert job["status"] == "succeeded" and job["options"]["word_timestamps"] is True, job
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result").json()
    assert result["words"] == [w for s in result["segments"] for w in s["words"]]
    reference = transformers_words(model_dir("tiny.en"))(sf.read(clip.path, dtype="float32")[0])
    compared = ClipWords(
        clip.path.name, [(w["word"], w["start"], w["end"]) for w in result["words"]], reference
    )
    assert compared.same_words, (compared.ours, compared.theirs)
    gaps = compared.gaps()
    assert gaps["start"].mean() <= 0.1 and gaps["end"].mean() <= 0.1, gaps
    vtt = httpx.get(
        f"{url}/v1/jobs/{job['id']}/result", params={"format": "vtt", "granularity": "word"}
    )
    assert vtt.text.count(" --> ") == len(result["words"])
    verbose = httpx.get(f"{url}/v1/jobs/{job['id']}/result?format=verbose_json").json()
    assert verbose["words"] == result["words"]
    plain = run_job(url, clip.bytes, "clip.flac", temperature="0")  # no words asked: none given
    refused = httpx.get(
        f"{url}/v1/jobs/{plain['id']}/result", params={"format": "srt", "granularity": "word"}
    )
    assert refused.status_code == 422 and "word_timestamps" in refused.json()["error"]["message"]
    assert "words" not in httpx.get(f"{url}/v1/jobs/{plain['id']}/result").json()


def test_speakers_and_voice_activity_through_the_queue(api_url):
    """A conversation of three real voices with a stretch without speech, uploaded with
    diarize: each segment and word names who spoke it, the result lists the three, subtitles
    and text carry them, nothing is said in the stretch; the OpenAI endpoint takes the same
    fields; a spectrogram asking for them is refused at the door."""
    import io

    import numpy as np
    import soundfile as sf

    from tests.conftest import built_conversations

    url, _ = api_url
    conv = built_conversations()[1]
    buf = io.BytesIO()
    sf.write(buf, conv.samples, 16000, format="FLAC")
    job = run_job(url, buf.getvalue(), "conversation.flac", diarize="true", vad="true")
    assert job["status"] == "succeeded", job
    assert job["options"]["diarize"] is True and job["options"]["vad"] is True
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result").json()
    assert [s["speaker"] for s in result["speakers"]] == [f"SPEAKER_0{i}" for i in range(3)]
    assert all(s["speaker"] and s["words"] for s in result["segments"])
    assert result["words"] == [w for s in result["segments"] for w in s["words"]]
    assert all(w["speaker"] == s["speaker"] for s in result["segments"] for w in s["words"])
    for start, end, _ in conv.no_speech:
        assert not [w for w in result["words"] if start + 0.5 < w["start"] < end - 0.5]
    srt = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "srt"}).text
    assert srt.count("[SPEAKER_0") == len(result["segments"])
    vtt = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "vtt"}).text
    assert vtt.count("<v SPEAKER_0") == len(result["segments"])
    text = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "text"}).text
    lines = text.splitlines()
    assert len(lines) >= 3 and all(line.startswith("SPEAKER_0") for line in lines)

    answer = httpx.post(
        f"{url}/v1/audio/transcriptions",
        files={"file": ("conversation.flac", buf.getvalue())},
        data={"response_format": "verbose_json", "diarize": "true", "speakers": "3"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    speakers = {s["speaker"] for s in answer.json()["segments"]}
    assert speakers == {"SPEAKER_00", "SPEAKER_01", "SPEAKER_02"}

    mel = io.BytesIO()
    np.save(mel, np.zeros((80, 3000), np.float32))
    refused = httpx.post(
        f"{url}/v1/jobs", files={"file": ("x.npy", mel.getvalue())}, data={"diarize": "true"}
    )
    assert refused.status_code == 422 and "need audio" in refused.json()["error"]["message"]


def test_a_model_served_through_transformers_runs_jobs_end_to_end(api_url, clips):
    """REST -> queue -> worker -> stored result for `w2v=hf:/dir`: the same contract, the
    fields it cannot give null; options it cannot honour fail the job with the reason."""
    url, _ = api_url
    job = run_job(url, clips["en_jfk"].bytes, "clip.flac", model="w2v")
    assert job["status"] == "succeeded", job
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result").json()
    assert result["model"] == "w2v" and result["language"] is None and result["duration"] == 11.0
    assert all(s["avg_logprob"] is None for s in result["segments"])
    srt = httpx.get(f"{url}/v1/jobs/{job['id']}/result", params={"format": "verbose_json"})
    assert srt.status_code == 200 and srt.json()["language"] is None
    refused = run_job(url, clips["en_jfk"].bytes, "clip.flac", model="w2v", prompt="Kennedy")
    assert refused["status"] == "failed" and refused["error"]["code"] == "invalid_option"
    assert "cannot give a prompt" in refused["error"]["message"], refused


@pytest.mark.parametrize("model", ["q3", "q3n"])
def test_a_qwen3_asr_shaped_model_runs_jobs_end_to_end(api_url, clips, model):
    """`q3=hf:/dir` (transformers) and `q3n=/dir` (the engine's own), an audio language
    model: its language forced by the job, a prompt as its context; a translation it cannot
    make fails the job with the reason."""
    url, _ = api_url
    job = run_job(url, clips["fr_fleurs_000"].bytes, "clip.flac", model=model, language="fr",
                  prompt="Paris")  # fmt: skip
    assert job["status"] == "succeeded", job
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result").json()
    assert result["model"] == model and result["language"] == "fr"
    assert result["duration"] == pytest.approx(10.2, abs=0.01)
    assert all(s["avg_logprob"] is None for s in result["segments"])
    refused = run_job(url, clips["fr_fleurs_000"].bytes, "clip.flac", model=model, task="translate")
    assert refused["status"] == "failed" and refused["error"]["code"] == "invalid_option"
    assert "task 'translate'" in refused["error"]["message"], refused


def test_the_engines_qwen3_asr_answers_as_transformers_does(api_url, clips):
    """The same directory served both ways through the fleet: the same text and tokens."""
    url, _ = api_url
    results = []
    for model in ("q3", "q3n"):
        job = run_job(url, clips["en_jfk"].bytes, "clip.flac", model=model)
        assert job["status"] == "succeeded", job
        results.append(httpx.get(f"{url}/v1/jobs/{job['id']}/result").json())
    assert [s["tokens"] for s in results[0]["segments"]] == [
        s["tokens"] for s in results[1]["segments"]
    ]
    assert results[0]["text"] == results[1]["text"] and results[0]["text"]


def test_english_only_model_refuses_a_translate_job_at_submission(api_url, clips):
    url, _ = api_url
    files = {"file": ("jfk.flac", clips["en_jfk"].bytes)}
    response = httpx.post(f"{url}/v1/jobs", files=files, data={"task": "translate"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_option" and "English-only" in error["message"]


def test_stack_command_serves_and_stops_everything_on_ctrl_c(clips, stack_env, tmp_path):
    """`whisperfleet stack` starts its own storage (nothing answers on its port), an API and a
    worker; SIGINT stops every process it started; started again, it serves the first job's
    result (issue #37: its storage was in memory, and every old result answered 500)."""
    port, storage_port = free_port(), free_port()
    env = {
        **stack_env,
        "WHISPERFLEET_REDIS_URL": f"{conftest.REDIS_URL}/13",
        "WHISPERFLEET_S3_ENDPOINT_URL": f"http://127.0.0.1:{storage_port}",
        "WHISPERFLEET_S3_BUCKET": f"stack-{uuid.uuid4().hex[:8]}",
        "WHISPERFLEET_DATA_DIR": str(tmp_path / "data"),
    }
    api = f"http://127.0.0.1:{port}"
    job = None
    for run in ("first", "again"):
        log = open(tmp_path / f"stack-{run}.log", "w")
        stack = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "stack", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            wait_for_port(port, stack, timeout=90)
            children = psutil.Process(stack.pid).children(recursive=True)
            assert len(children) >= 3  # storage, worker, api
            ready = httpx.get(f"{api}/readyz")
            deadline = time.monotonic() + 120
            while ready.status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.5)
                ready = httpx.get(f"{api}/readyz")
            assert ready.json()["checks"] == dict.fromkeys(("redis", "storage", "workers"), "ok")
            said = (tmp_path / f"stack-{run}.log").read_text()
            # one line a part at start: no Celery banner, no warning in a paragraph, no steps
            noises = ("-------------- ", "celery beat v", "SecurityWarning", "startup", "Starting")
            for noise in noises:
                assert noise not in said, said
            for part in ("takes jobs", "takes webhooks", "takes scheduled runs", "sends backfills"):
                assert said.count(f"ready: {part}") == 1, said
            assert said.count("Uvicorn running on") == 1, said
            if job is None:
                job = run_job(api, clips["en_jfk"].bytes, "jfk.flac")
                assert job["status"] == "succeeded", log.name
            result = httpx.get(f"{api}/v1/jobs/{job['id']}/result", params={"format": "text"})
            assert result.status_code == 200, result.text
            assert "ask not what your country" in result.text
            stack.send_signal(signal.SIGINT)
            assert stack.wait(timeout=30) == 0
            gone, alive = psutil.wait_procs(children, timeout=10)
            assert not alive, [p.cmdline() for p in alive]
        finally:
            stop(stack)
            log.close()


def test_audio_longer_than_the_limit_fails_as_too_long(api_url, clips):
    """An OGG file does not say its length up front, so the API lets it in; the worker stops
    decoding it once it passes WHISPERFLEET_MAX_AUDIO_S (60 s here)."""
    import io

    import numpy as np
    import soundfile as sf

    from engine.audio import decode_audio

    url, worker = api_url
    audio = np.tile(decode_audio(clips["en_jfk"].bytes), 7)  # 77 s
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="OGG", subtype="VORBIS")
    job = run_job(url, buf.getvalue(), "long.ogg")
    assert job["status"] == "failed" and job["error"]["code"] == "too_long", job
    assert "60" in job["error"]["message"] and worker.poll() is None
