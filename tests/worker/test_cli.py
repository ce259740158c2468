"""The command line: `worker --gpus all` counts the GPUs without touching CUDA itself; tenants;
`transcribe` with word timestamps."""

import json
import os
import subprocess
import sys

import pytest
import redis

from worker.contract.jobs import JobInput, JobRecord, JobStore, new_job_id


def test_gpus_all_with_no_gpu_visible_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "worker", "--gpus", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "--gpus all, but no GPU is visible" in result.stderr


def test_tenants_set_and_show_their_settings(settings):
    """`whisperfleet tenants set` changes some settings and keeps the others; `show` prints
    them with the configuration's defaults filled in, and the webhook secret; `list` names
    the tenants with settings, whatever jobs there are."""
    import json

    env = {**os.environ, "WHISPERFLEET_REDIS_URL": settings.redis_url}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "worker.cli", "tenants", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = cli("set", "acme", "--source", "s3://archive/acme/", "--jobs-per-minute", "5")
    assert made.returncode == 0, made.stderr
    again = cli("set", "acme", "--jobs-in-flight", "7")
    shown = json.loads(again.stdout)
    assert shown["sources"] == ["s3://archive/acme/"] and shown["jobs_per_minute"] == 5
    assert shown["jobs_in_flight"] == 7 and shown["webhook_secret"].startswith("whsec_")
    assert json.loads(cli("show", "acme").stdout) == shown
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    for tenant in ("acme", "beta"):  # their job lists and sets are not tenants with settings
        store.create(
            JobRecord(
                id=new_job_id(),
                tenant=tenant,
                model="tiny.en",
                input=JobInput(kind="audio", bytes=1, format="wav"),
            )
        )
    assert cli("list").stdout.split() == ["acme"]
    back = json.loads(cli("set", "acme", "--default-sources").stdout)
    assert back["sources"] == [] and back["jobs_per_minute"] == 5
    assert back["webhook_networks"] == [] and back["own"]["webhook_networks"] is None
    nets = cli("set", "acme", "--webhook-network", "10.20.1.2/16", "--webhook-network", "::1")
    assert json.loads(nets.stdout)["webhook_networks"] == ["10.20.0.0/16", "::1/128"]
    public = json.loads(cli("set", "acme", "--public-webhooks-only").stdout)
    assert public["webhook_networks"] == [] and public["own"]["webhook_networks"] == []
    env["WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS"] = "192.168.0.0/16"  # the fleet's list
    assert json.loads(cli("show", "acme").stdout)["webhook_networks"] == []  # its own: none
    unset = json.loads(cli("set", "acme", "--default-webhook-networks").stdout)
    assert unset["webhook_networks"] == ["192.168.0.0/16"]
    bad_nets = (["--webhook-network", "10.0.0.0/33"], ["--webhook-network", "intranet"])
    for bad in (["--source", "http://x/y"], ["--jobs-per-minute", "0"], *bad_nets):
        refused = cli("set", "acme", *bad)
        assert refused.returncode == 2 and "whisperfleet tenants" in refused.stderr


def transcribe_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "transcribe", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_transcribe_gives_word_timestamps_near_transformers(clips):
    import soundfile as sf

    from engine.loader import model_dir
    from tools.word_timing import ClipWords, transformers_words

    clip = clips["en_jfk"]
    done = transcribe_cli("--word-timestamps", "--format", "json", str(clip.path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    ours = [(w["word"], w["start"], w["end"]) for w in result["words"]]
    reference = transformers_words(model_dir("tiny.en"))(sf.read(clip.path, dtype="float32")[0])
    compared = ClipWords(clip.path.name, ours, reference)
    assert compared.same_words, (ours, reference)
    gaps = compared.gaps()
    assert gaps["start"].mean() <= 0.1 and gaps["end"].mean() <= 0.1, gaps
    cues = transcribe_cli("--granularity", "word", "--format", "srt", str(clip.path))
    assert cues.returncode == 0 and cues.stdout.count(" --> ") == len(ours), cues.stderr


def test_word_cues_in_a_format_without_cues_is_refused_before_any_work(clips):
    done = transcribe_cli("--granularity", "word", "--format", "text", str(clips["en_jfk"].path))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "whisperfleet transcribe: --granularity word applies to srt, vtt"
    ]


def test_transcribe_names_the_speakers_and_checks_their_flags(clips, tmp_path):
    """Two voices, one after the other: --diarize gives a line a turn in text, and a count
    without --diarize is refused as the API refuses it, before any work."""
    import numpy as np
    import soundfile as sf

    from engine.audio import decode_audio
    from tools.longform import leveled

    voices = [leveled(decode_audio(clips[n].bytes)) for n in ("en_jfk", "en_ljspeech_LJ050-0131")]
    path = tmp_path / "two.flac"
    sf.write(path, np.concatenate([voices[0], np.zeros(16000, np.float32), voices[1]]), 16000)
    done = transcribe_cli("--diarize", str(path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["SPEAKER_00", "SPEAKER_01"], lines
    assert "ask not what your country" in lines[0].lower()
    refused = transcribe_cli("--speakers", "2", str(path))
    assert refused.returncode == 2 and "only with diarize=true" in refused.stderr


@pytest.fixture
def settings_env(monkeypatch):
    """Set environment variables and read the settings afresh; both undone afterwards."""
    from worker.contract.settings import get_settings

    def apply(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    yield apply
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.mark.parametrize(
    "env, cores, gpus, expected",
    [
        ({"WHISPERFLEET_DEVICE": "cpu"}, 16, 1, 1),  # the engine needs the cores itself
        ({"WHISPERFLEET_DEVICE": "cpu"}, 16, 2, 1),  # --gpus with a CPU engine (tests)
        ({"WHISPERFLEET_DEVICE": "cuda"}, 16, 1, 8),  # the H200 host: 8 measured best
        ({"WHISPERFLEET_DEVICE": "cuda"}, 64, 1, 8),  # at most 8 a GPU
        ({"WHISPERFLEET_DEVICE": "cuda"}, 16, 2, 4),  # --gpus 0,1: the cores shared
        ({"WHISPERFLEET_DEVICE": "cuda:1"}, 2, 1, 1),
        ({"WHISPERFLEET_DEVICE": "auto", "CUDA_VISIBLE_DEVICES": ""}, 16, 1, 1),  # hidden
        ({"WHISPERFLEET_DEVICE": "auto"}, 16, 1, 1),  # no NVIDIA driver on this machine
        ({"WHISPERFLEET_DEVICE": "cuda", "WHISPERFLEET_WORKER_PROCESSES": "3"}, 16, 1, 3),
    ],
)
def test_job_processes_default_to_the_device_and_the_cores(
    settings_env, monkeypatch, env, cores, gpus, expected
):
    from worker.cli import main as cli

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    settings_env(env)
    assert cli._job_processes(gpus) == expected


@pytest.mark.parametrize(
    "env, processes, expected",
    [
        ({"WHISPERFLEET_DEVICE": "cpu"}, 1, 32),
        ({"WHISPERFLEET_DEVICE": "cpu"}, 4, 32),  # --gpus 0,1 with a CPU engine (tests)
        ({"WHISPERFLEET_DEVICE": "cuda"}, 8, 80),  # 640 among 8: every slot, a quarter more
        ({"WHISPERFLEET_DEVICE": "cuda"}, 3, 214),
        ({"WHISPERFLEET_DEVICE": "auto"}, 1, 32),  # no NVIDIA driver on this machine
        ({"WHISPERFLEET_DEVICE": "cuda", "WHISPERFLEET_WORKER_CONCURRENCY": "50"}, 8, 50),
    ],
)
def test_jobs_in_flight_default_to_filling_the_engine(settings_env, env, processes, expected):
    """256 in flight (32 in each of 8 processes) left half of tiny.en's 512 slots empty on the
    H200: on a GPU the job processes together keep every slot filled."""
    from engine.slots import MAX_SLOTS
    from worker.cli import main as cli
    from worker.contract.settings import GPU_JOBS_IN_FLIGHT

    assert GPU_JOBS_IN_FLIGHT >= MAX_SLOTS
    settings_env(env)
    assert cli._job_concurrency(processes) == expected


@pytest.mark.parametrize("value", ["0", "65", "two", "1.5"])
def test_processes_out_of_range_is_a_usage_error(value):
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "worker", "--processes", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument --processes: '{value}': a whole number from 1 to 64" in done.stderr


def test_a_worker_with_job_processes_spawns_its_core_before_importing_the_engine():
    """The core's imports and warm-up are the slowest part of a start: the worker process
    decides its shape and spawns the core before it imports torch (which it never needs)."""
    code = (
        "import sys, os; os.environ['WHISPERFLEET_DEVICE'] = 'auto'\n"
        "from worker.cli import main as cli\nfrom worker.core import process\n"
        "cli._job_processes()\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
