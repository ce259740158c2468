"""What voice activity and diarization cost, and what voice activity saves: the same recordings
through the engine's stream (the interface the workers drive) with `vad` off, on, and with
`diarize`; and the two stages timed alone on the same audio.

    python scripts/voice_bench.py [--audio-dir ../shared/audio/dev] [--device cuda]
        [--model tiny.en] [--copies 16] [--runs 3] [--json out.json]
        [--rows vad-off,no-silero,vad-on,words,diarize,chunked-off,chunked-on,alone]

The recording: the dev set's English clips one after another, each followed by room tone half
as long as itself, so that one third of it is without speech (about 8 minutes); `--copies`
of it go through the stream at once, as a worker's jobs would. Rows:

- transcription, vad off / on: `Stream.transcribe` of every copy (sequential mode), audio
  seconds per second (RTFx), median and range of `--runs`;
- transcription without Silero: vad and `cover_speech` off, options that use no speech, so
  that no first pass runs Silero: the transcription with no voice activity at all;
- word timestamps: the same with word timestamps (vad on), which diarize turns on;
- with diarize: the same with the option diarize (voice activity on, words timed, speakers
  found on the stream's diarizing thread);
- chunked, vad off / on: the same in chunked mode;
- VAD alone: Silero on every copy's samples, block by block on the device
  (`engine.vad.Detector`), as long inputs' first reads run it: PREPARE_THREADS at once, each
  on a CUDA stream of its own (`engine.inputs.own_stream`); and one after another on the
  default stream, as they ran before (2026-12-06); diarization alone: the speaker turns of
  every copy from its speech (`engine.diarize.speaker_turns`: windows embedded together,
  clustered); each as a share of the transcription with vad off;
- first passes, with Silero and without: `Stream.prepare` of every copy on PREPARE_THREADS
  threads, as `transcribe` runs it before any window is decoded (log-mel and voice activity;
  without, for options that use no speech);
- as a worker: vad off, with and without Silero, word timestamps and diarize, each copy
  prepared on one of PREPARE_THREADS threads and handed to the worker's batcher
  (`worker.core.batching.Batcher`) as soon as its first pass is done, as a worker's jobs
  arrive: the first passes run beside the decoding of the inputs before them, where
  `transcribe` waits for them all.

Then the alignment passes of word timestamps, in the stream and as a worker: one more run of
each, not timed as a row, with each `Aligner.launch` call timed (the stepping thread's CUDA
stream synchronised before and after): passes, windows a pass, the time in them (staggered
inputs, as a worker's jobs arrive, finish their windows apart: more passes of fewer windows).

Each row also counts Python's full garbage collections in its timed runs, and their time:
each stops every thread of the process (on stderr, and in `--json`).

`--rows` runs some of them (the same names; `alone`: VAD and diarization alone, and the first
passes): a device call of ten minutes holds the rows of one question, for two versions.

Then what they add to the transcription, in the stream, as a share of the one without Silero:
Silero's, the transcription with vad off less the one without Silero (with vad off, a long
input's first pass still runs it for sequential's `cover_speech`, on by default); the
speakers', the diarized transcription less the one with word timestamps alone (diarize times
the words, and those are the option's, not the speakers'); and the same for the rows as a
worker.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, TranscriptionOptions  # noqa: E402
from engine.diarize import Recording, speaker_turns  # noqa: E402
from engine.inputs import own_stream  # noqa: E402
from engine.options import SpeakerCount  # noqa: E402
from engine.stream import PREPARE_THREADS  # noqa: E402
from engine.timing import Aligner  # noqa: E402
from engine.vad import Detector, speech_regions  # noqa: E402
from scripts.measure import gc_pauses, spread, timed  # noqa: E402
from tools.evaluate import read_manifest  # noqa: E402
from tools.longform import third_silence  # noqa: E402
from tools.wer import word_error_rate  # noqa: E402
from worker.core.batching import Batcher  # noqa: E402

VAD_OFF = "transcription, vad off"
DEAF = "transcription without Silero (vad off)"
WORDS = "word timestamps (vad on)"
DIARIZED = "with diarize"
AS_WORKER = "as a worker: "
VAD_ALONE = "VAD alone (first passes at once, own streams)"
DIARIZATION_ALONE = "diarization alone (from the speech)"
UNHEARD = TranscriptionOptions(vad=False, cover_speech=False)  # no first pass runs Silero
RUNS = {  # --rows: the name -> the row and its options
    "vad-off": (VAD_OFF, TranscriptionOptions(vad=False)),
    "no-silero": (DEAF, UNHEARD),
    "vad-on": ("transcription, vad on", TranscriptionOptions(vad=True)),
    "words": (WORDS, TranscriptionOptions(vad=True, word_timestamps=True)),
    "diarize": (DIARIZED, TranscriptionOptions(diarize=SpeakerCount())),
    "chunked-off": ("chunked, vad off", TranscriptionOptions(mode="chunked", vad=False)),
    "chunked-on": ("chunked, vad on", TranscriptionOptions(mode="chunked", vad=True)),
}


def synced(run):
    def go():
        out = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return go


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio-dir", type=Path, default=ROOT.parent / "shared" / "audio" / "dev")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows", default=",".join([*RUNS, "alone"]))
    args = parser.parse_args()
    chosen = args.rows.split(",")
    if unknown := set(chosen) - {*RUNS, "alone"}:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")

    made = third_silence(read_manifest(args.audio_dir / "manifest.jsonl"))
    samples, reference = made.samples, made.reference
    seconds = len(samples) / 16000
    items = [samples] * args.copies
    audio = seconds * args.copies
    stream = Engine.open(EngineConfig(model=args.model, device=args.device))
    stream.warm()
    device = str(stream.engine.loaded.device)
    regions = speech_regions(_vad(samples, device), seconds)
    speech = sum(e - s for s, e in regions)
    print(
        f"{args.model} on {torch.cuda.get_device_name() if 'cuda' in device else 'the CPU'}: "
        f"{args.copies} x {seconds:.0f} s ({speech / seconds:.0%} speech by VAD), "
        f"median (range) of {args.runs} runs\n"
    )
    rows, out, passes = {}, {}, {}
    runs = [run for name, run in RUNS.items() if name in chosen]
    for name, options in runs:
        # its first-time costs, at the timed runs' sizes (after one copy alone, the first
        # timed run took about twice the others', 2026-12-07)
        synced(lambda o=options: stream.transcribe(items, o))()
        before = stream.stats
        run = synced(lambda o=options: stream.transcribe(items, o))
        with gc_pauses() as pauses:
            results, times = timed(run, args.runs)
        windows = (stream.stats - before).windows // args.runs
        wer = word_error_rate([reference], [results[0].text])
        rows[name] = times
        out[name] = {"seconds": times, "wer": wer, "rtfx": [audio / t for t in times]}
        out[name].update(windows=windows, gc=pauses)
        print(
            f"  {name}: {spread(times)} s, WER {wer:.1%}, {windows} windows a run; {_gc(pauses)}",
            file=sys.stderr,
        )
    words = RUNS["words"][1]
    if "words" in chosen:  # before the batcher, whose thread would step the stream too
        passes["in the stream"] = _alignment_passes(lambda: stream.transcribe(items, words))

    # as a worker's jobs meet the stream: each input handed over once its own first pass is
    # done, decoded beside the others' first passes (`transcribe` waits for them all)
    while stream.warm_next():  # what the batcher would capture while idle, not in a timed run
        pass
    batcher = Batcher(stream, stream.engine.encoder_batch, 0.01)
    for name, options in (r for r in runs if r[0] in (VAD_OFF, DEAF, WORDS, DIARIZED)):
        run = synced(lambda o=options: _as_worker(stream, batcher, items, o))
        run()
        with gc_pauses() as pauses:
            results, times = timed(run, args.runs)
        wer = word_error_rate([reference], [results[0].text])
        rows[AS_WORKER + name] = times
        out[AS_WORKER + name] = {"seconds": times, "wer": wer, "rtfx": [audio / t for t in times]}
        out[AS_WORKER + name]["gc"] = pauses
        print(
            f"  {AS_WORKER}{name}: {spread(times)} s, WER {wer:.1%}; {_gc(pauses)}", file=sys.stderr
        )
    if "words" in chosen:
        passes["as a worker"] = _alignment_passes(lambda: _as_worker(stream, batcher, items, words))
    batcher.close(wait=True)
    if "alone" in chosen:
        rows.update(_alone(stream, items, seconds, regions, device, args.runs))
    base = statistics.median(rows[DEAF]) if DEAF in rows else None

    print(
        "| run | seconds | audio s per second | share of the transcription without Silero | WER |"
    )
    print("|---|---|---|---|---|")
    for name, times in rows.items():
        rtfx = spread([audio / t for t in times], 0)
        share = f"{statistics.median(times) / base:.1%}" if base else "—"
        wer = f"{out[name]['wer']:.1%}" if name in out else "—"
        print(f"| {name} | {spread(times)} | {rtfx} | {share} | {wer} |")
    if base and "alone" in chosen:
        vad, diarization = (statistics.median(rows[k]) for k in (VAD_ALONE, DIARIZATION_ALONE))
        together = (vad + diarization) / base
        print(f"\nVAD and diarization alone together: {together:.1%} of the transcription's time")
    for prefix, said in (("", "in the stream"), (AS_WORKER, "as a worker")):
        if not all(prefix + k in rows for k in (VAD_OFF, DEAF, WORDS, DIARIZED)):
            continue
        median = {k: statistics.median(rows[prefix + k]) for k in (VAD_OFF, DEAF, WORDS, DIARIZED)}
        plain = median[DEAF]
        silero, speakers = median[VAD_OFF] - plain, median[DIARIZED] - median[WORDS]
        print(
            f"added to the transcription {said}: Silero {silero:.3f} s ({silero / plain:.1%}), "
            f"the speakers (diarize over word timestamps) {speakers:.3f} s "
            f"({speakers / plain:.1%}); together {(silero + speakers) / plain:.1%}"
        )
    for said, timed_passes in passes.items():
        sizes = [n for n, _ in timed_passes]
        seconds = [t * 1000 for _, t in timed_passes]
        median, p90 = statistics.median(seconds), np.percentile(seconds, 90)
        print(
            f"alignment passes {said}: {len(sizes)}, windows a pass {spread(sizes, 0)}, "
            f"{sum(seconds) / 1000:.3f} s in all; ms a pass: median {median:.1f}, "
            f"p90 {p90:.1f}, max {max(seconds):.1f}"
        )
    if args.json:
        out.update(passes=passes)
        out.update({name: times for name, times in rows.items() if name not in out})
        out.update(audio_s=audio, speech=speech)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _alone(stream, items, seconds, regions, device, runs) -> dict[str, list[float]]:
    """The rows of VAD and diarization alone, and of the first passes with and without
    Silero: name -> seconds of each run."""
    with ThreadPoolExecutor(PREPARE_THREADS) as pool:
        _, vad_times = timed(synced(lambda: list(pool.map(_own_vad(device), items))), runs)
    _, serial_times = timed(synced(lambda: [_vad(x, device) for x in items]), runs)
    recordings = [Recording([x], seconds, regions) for x in items]
    triton = stream.engine.triton  # the embedder's kernels, as the stream's diarizer runs it
    _, diarize_times = timed(synced(lambda: speaker_turns(recordings, device, triton=triton)), runs)
    with ThreadPoolExecutor(PREPARE_THREADS) as pool:
        _, heard = timed(synced(lambda: list(pool.map(stream.prepare, items))), runs)
        unheard_pass = functools.partial(stream.prepare, options=UNHEARD)
        _, unheard = timed(synced(lambda: list(pool.map(unheard_pass, items))), runs)
    return {
        VAD_ALONE: vad_times,
        "VAD alone (one after another, default stream)": serial_times,
        DIARIZATION_ALONE: diarize_times,
        "first passes (`prepare`), with Silero": heard,
        "first passes (`prepare`), without": unheard,
    }


def _gc(pauses: list[tuple[int, float]]) -> str:
    """The full collections among a row's garbage collections, in all its timed runs."""
    full = [s * 1000 for generation, s in pauses if generation == 2]
    longest = max(full, default=0)
    return f"{len(full)} full garbage collections, {sum(full):.0f} ms, the longest {longest:.0f}"


def _as_worker(
    stream, batcher: Batcher, items: list[np.ndarray], options: TranscriptionOptions
) -> list:
    """The inputs as a worker's job threads hand them over: each prepared on one of
    PREPARE_THREADS threads, then submitted to the batcher, whose thread steps the stream."""

    def job(samples: np.ndarray):  # as worker.core.process prepares a job's input
        return batcher.submit(stream.prepare(samples, options), options, urgent=False).future

    with ThreadPoolExecutor(PREPARE_THREADS) as pool:
        futures = list(pool.map(job, items))
    return [f.result() for f in futures]


def _alignment_passes(run) -> list[tuple[int, float]]:
    """(windows timed, seconds) of each alignment of one more `run` (`Aligner.launch`: the
    windows a step finished, in one pass unless they hold more than PASS_BYTES), each timed
    with the calling thread's CUDA stream synchronised before and after it: what the pass
    costs the device and the host together (as it runs, the stream does not wait for it)."""
    found, launch = [], Aligner.launch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def timed_launch(self, cache, windows):
        sync()
        start = time.perf_counter()
        pending = launch(self, cache, windows)
        sync()
        found.append((sum(bool(w.tokens) for w in windows), time.perf_counter() - start))
        return pending

    with mock.patch.object(Aligner, "launch", timed_launch):
        run()
    return found


def _own_vad(device: str):
    def run(samples: np.ndarray) -> np.ndarray:
        with own_stream(device):
            return _vad(samples, device)

    return run


def _vad(samples: np.ndarray, device: str) -> np.ndarray:
    """Silero over the samples in 30 s blocks, as a long input's first read feeds it."""
    detector = Detector(device)
    for i in range(0, len(samples), 480000):
        detector.feed(samples[i : i + 480000])
    return detector.finish()


if __name__ == "__main__":
    sys.exit(main())
