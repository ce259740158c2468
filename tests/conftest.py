"""Shared fixtures: real clips, the real Redis, a real S3 endpoint (moto's server), real weights."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from worker.contract.settings import Settings
from worker.local import s3_server

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest runs four files at once (pyproject's -n 4) on machines of two cores: torch's
    # default of a thread per core in each, and in each worker process they start, spun in
    # OpenMP's barriers (a test of long audio took five times the CPU it takes alone). One thread
    # each, read when torch starts its pool here and in every process started from here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

DATA = Path(__file__).parent / "data"
# a job's options at their defaults as records and results store them: every key, in order
STORED_OPTIONS = {
    "language": None,
    "task": "transcribe",
    "mode": "sequential",
    "prompt": None,
    "timestamps": True,
    "word_timestamps": False,
    "vad": None,
    "hallucination_silence_threshold": None,
    "diarize": False,
    "speakers": None,
    "min_speakers": None,
    "max_speakers": None,
    "temperature": None,
    "seed": None,
}
# the three voices of tests/data, of which conversations are built (tools.conversations)
VOICES = {
    "jfk": ["en_jfk.flac"],
    "lj": ["en_ljspeech_LJ050-0131.flac"],
    "libri": ["en_librispeech_1272-128104-0000.flac"],
}


def built_conversations() -> list:
    """Two conversations of the test voices, each with stretches without speech: two of the
    voices, then all three (32 s)."""
    from tools.conversations import conversations
    from tools.evaluate import read_manifest

    return conversations(read_manifest(DATA / "manifest.jsonl"), seed=7, count=2, speakers=VOICES)


REDIS_URL = os.environ.get("WHISPERFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def pytest_configure(config):
    """Under pytest-xdist, each worker but the first gets a redis-server of its own (no
    persistence, on a free port): the tests flush and watch their databases, and two files
    at once would flush each other's. (WHISPERFLEET_TEST_REDIS_URL names one Redis for all:
    then run with -n 0.)"""
    global REDIS_URL
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if worker == "gw0" or "WHISPERFLEET_TEST_REDIS_URL" in os.environ:
        return
    port = free_port()
    server = start_redis(port, "--appendonly", "no")
    config.add_cleanup(lambda: stop(server))
    REDIS_URL = os.environ["WHISPERFLEET_TEST_REDIS_URL"] = f"redis://127.0.0.1:{port}"


# the files that take minutes (a fleet, chaos, backfills at scale) go first: the last file
# to start is then a short one, and the two workers end together
LONG_FIRST = ("tests/faults/test_chaos.py", "tests/faults/test_backfills.py", "tests/faults/")


def _start_order(item) -> int:
    return next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order)  # stable: the order within each file is kept
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "requires_cuda" in item.keywords:
                item.add_marker(skip)


@dataclass(frozen=True)
class Clip:
    path: Path
    reference: str
    language: str
    duration: float

    @property
    def bytes(self) -> bytes:
        return self.path.read_bytes()


@pytest.fixture(scope="session")
def clips() -> dict[str, Clip]:
    """The test clips by file stem, e.g. clips["en_jfk"]."""
    return read_clips()


def read_clips() -> dict[str, Clip]:
    out = {}
    for line in (DATA / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        path = DATA / entry["file"]
        out[path.stem] = Clip(path, entry["reference"], entry["language"], entry["duration_s"])
    return out


@pytest.fixture(scope="session")
def english_clips(clips) -> list[Clip]:
    return [c for c in clips.values() if c.language == "en"]


def free_port(run: int = 1) -> int:
    """A free port, with the `run - 1` after it free too, below the range the kernel hands out
    to outgoing connections: the port is bound later, by another process, and a connection
    made meanwhile (to Redis, to storage) must not take it first."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    while True:
        port = random.randrange(10000, ephemeral - run)
        try:
            for p in range(port, port + run):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def start_redis(port: int, *options: str) -> subprocess.Popen:
    """A redis-server of the tests' own on loopback at `port`, no RDB snapshots, once it
    listens; `options` as redis-server takes them (`--appendonly`, `--dir`)."""
    exe = shutil.which("redis-server")
    assert exe, "the tests need redis-server installed"
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *options]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    wait_for_port(port, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server as a real HTTP endpoint, in its own process; or another S3 store named
    by WHISPERFLEET_TEST_S3_ENDPOINT_URL (keys: the settings' defaults), to test against it."""
    if url := os.environ.get("WHISPERFLEET_TEST_S3_ENDPOINT_URL"):
        yield url
        return
    port = free_port()
    proc = subprocess.Popen(
        s3_server.command("127.0.0.1", port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, proc)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def _redis_db(db: int) -> str:
    url = f"{REDIS_URL}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"the tests need a real Redis at {REDIS_URL} ({e}); start redis-server")
    client.flushdb()
    return url


@pytest.fixture
def settings(s3_endpoint, tmp_path_factory) -> Settings:
    """Settings on Redis db 14 (flushed) and a fresh bucket, for in-process tests."""
    return Settings(
        redis_url=_redis_db(14),
        s3_endpoint_url=s3_endpoint,
        s3_bucket=f"test-{uuid.uuid4().hex[:12]}",
        max_upload_bytes=2 * 1024 * 1024,
        max_audio_s=60,
        auth="none",  # tests of keys and tenants turn it on (tests/api/test_tenants.py)
    )


@pytest.fixture(scope="session")
def stack_env(s3_endpoint) -> dict[str, str]:
    """Environment for real API and worker processes: Redis db 15, its own bucket."""
    return {
        **os.environ,
        "WHISPERFLEET_REDIS_URL": _redis_db(15),
        "WHISPERFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "WHISPERFLEET_S3_BUCKET": f"e2e-{uuid.uuid4().hex[:12]}",
        "WHISPERFLEET_MAX_UPLOAD_BYTES": str(4 * 1024 * 1024),
        "WHISPERFLEET_MAX_AUDIO_S": "60",
        "WHISPERFLEET_DEVICE": "cpu",
        "WHISPERFLEET_AUTH": "none",
        "WHISPERFLEET_METRICS_PORT": str(free_port()),
    }


def open_stream(model: str, **config):
    from engine import Engine, EngineConfig

    return Engine.open(EngineConfig(model=model, device="cpu", **config))


# the English clips, each a different voice and text: 66 s in all
SPEECH = [
    DATA / "en_jfk.flac",
    DATA / "en_librispeech_1272-128104-0000.flac",
    DATA / "en_ljspeech_LJ050-0131.flac",
    *sorted((DATA / "longform").glob("en_fleurs_*.flac")),
    DATA / "longform" / "en_sr_one_two_three.flac",
]


def long_speech(seconds: float) -> bytes:
    """`seconds` of real speech as FLAC: the English clips one after another (from the start
    again past 66 s), cut at `seconds`. Not one clip over and over: a window of one clip
    repeated reads as a model repeating itself and falls back through every temperature,
    3 to 6 times the CPU of this (66 s on tiny.en: 16 and 33 CPU s against 5)."""
    import io

    import numpy as np
    import soundfile as sf

    from engine.audio import SAMPLE_RATE, decode_audio

    clips = [decode_audio(path.read_bytes()) for path in SPEECH]
    n = int(SAMPLE_RATE * seconds)
    audio = np.concatenate(clips * (1 + n // sum(map(len, clips))))
    out = io.BytesIO()
    sf.write(out, audio[:n], SAMPLE_RATE, format="FLAC")
    return out.getvalue()


@pytest.fixture(autouse=True)
def _nothing_frozen_after():
    """A warmed stream freezes the objects alive (engine.heap); each test hands them back, so
    that the next one collects what it leaves as it would alone."""
    yield
    gc.unfreeze()


def transcribe(stream, item, options=None, progress=None):
    """One input through an idle stream."""
    return stream.transcribe([item], options, progress)[0]


@pytest.fixture(scope="session")
def tiny_en():
    """tiny.en on the CPU: a stream tests run to completion (never left busy)."""
    return open_stream("tiny.en")


@pytest.fixture(scope="session")
def base():
    return open_stream("base")


LETTERS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONISHRDLU'"]


def random_ctc(tmp_path: Path, architecture: str) -> Path:
    """A small random-weight CTC model of `architecture`, saved with its processor."""
    import torch
    import transformers as tf

    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({c: i for i, c in enumerate(LETTERS)}))
    tokenizer = tf.Wav2Vec2CTCTokenizer(str(vocab), word_delimiter_token="|")
    features = tf.Wav2Vec2FeatureExtractor(return_attention_mask=True)
    small = {
        "vocab_size": len(LETTERS),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": (32, 32, 32),
        "conv_stride": (5, 4, 4),
        "conv_kernel": (10, 8, 8),
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
        "pad_token_id": 0,
        "feat_extract_norm": "layer",  # padded inputs then read as alone (attention mask)
        "do_stable_layer_norm": True,
    }
    config = {"wav2vec2": tf.Wav2Vec2Config, "hubert": tf.HubertConfig}[architecture](**small)
    torch.manual_seed(0)
    model = {"wav2vec2": tf.Wav2Vec2ForCTC, "hubert": tf.HubertForCTC}[architecture](config)
    path = tmp_path / architecture
    model.save_pretrained(path)
    tf.Wav2Vec2Processor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(path)
    return path
