"""The worker's peak memory on each hostile input that reaches it (issue 12): one real worker
process (tiny.en on the CPU, `MAX_AUDIO_S=60`), its own redis-server and S3 server, each input
submitted alone as the API submits it; the worker's resident memory (with its quarantine
process) sampled every 20 ms. Prints a Markdown table for docs/reliability.md.

    python scripts/hostile_memory.py
"""

from __future__ import annotations

import io
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import psutil
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import read_clips  # noqa: E402
from tests.faults.fleet import (  # noqa: E402
    Fleet,
    RedisServer,
    StorageServer,
    at_rate,
    npy,
    speech,
    wav,
)
from worker.contract.options import JobOptions  # noqa: E402


def _ogg(seconds: float) -> bytes:
    """Vorbis in OGG: a container whose header does not say how long it is."""
    rate = 16000
    tone = (0.1 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)).astype(
        np.float32
    )
    out = io.BytesIO()
    sf.write(out, tone, rate, format="OGG", subtype="VORBIS")
    return out.getvalue()


def inputs(clips: dict) -> list[tuple[str, bytes, str, JobOptions]]:
    jfk = clips["en_jfk"].bytes
    nan = np.zeros((80, 3000), np.float32)
    nan[3, 7] = np.nan
    plain = JobOptions()
    return [
        ("jfk, 4 s FLAC (a good job, for scale)", speech(jfk, 4), "flac", plain),
        ("WAV at 4,001 Hz, 2 s (8 KB)", at_rate(jfk, 2, 4001), "wav", plain),
        ("WAV at 1 Hz, 7 KB (58 min declared)", wav(np.zeros(3500), 1), "wav", plain),
        ("WAV at 8,000 Hz, 4 s", at_rate(jfk, 4, 8000), "wav", plain),
        ("WAV at 48,001 Hz, 4 s", at_rate(jfk, 4, 48001), "wav", plain),
        ("WAV at 384,000 Hz, 4 s", at_rate(jfk, 4, 384000), "wav", plain),
        ("WAV at 384,001 Hz, 1 s", at_rate(jfk, 1, 384001), "wav", plain),
        ('jfk 1.5 s, prompt "ha " x 333', speech(jfk, 1.5), "flac", JobOptions(prompt="ha " * 333)),
        ("OGG of 90 s (past MAX_AUDIO_S=60; no length in its header)", _ogg(90), "ogg", plain),
        ("FLAC cut in half", jfk[: len(jfk) // 2], "flac", plain),
        ("spectrogram with a NaN", npy(nan), "npy", plain),
        (
            "spectrogram of 128 mels (tiny.en has 80)",
            npy(np.zeros((128, 3000), np.float32)),
            "npy",
            plain,
        ),
    ]


class PeakRSS:
    """The peak resident memory of a process and its children while the block runs."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.done = proc, threading.Event()
        self.idle = self.peak = self._now()
        self.thread = threading.Thread(target=self._sample)

    def _now(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> PeakRSS:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def main() -> int:
    rows = [
        "| input | status | error code | worker peak RSS MB (idle before) |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        storage = StorageServer()
        redis_server = RedisServer(Path(folder))
        redis_server.start()
        fleet = Fleet(Path(folder), redis_server, storage, MAX_AUDIO_S=60)
        try:
            clips = read_clips()
            worker = psutil.Process(fleet.start_worker().pid)
            warm = fleet.submit(speech(clips["en_jfk"].bytes, 2))
            fleet.wait_all([warm], timeout=300)
            for name, data, fmt, options in inputs(clips):
                kind = "spectrogram" if fmt == "npy" else "audio"
                with PeakRSS(worker) as memory:
                    job = fleet.submit(data, kind, fmt, options=options)
                    fleet.wait_all([job], timeout=300)
                record = fleet.store.get(job)
                code = record.error.code if record.error else ""
                mb = f"{memory.peak / 2**20:.0f} ({memory.idle / 2**20:.0f})"
                rows.append(f"| {name} | {record.status.value} | {code} | {mb} |")
                print(rows[-1], file=sys.stderr, flush=True)
        finally:
            fleet.close()
            redis_server.close()
            storage.close()
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
