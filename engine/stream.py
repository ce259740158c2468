"""Continuous batching across inputs: what the worker, the command line and the bench drive.

Every input becomes a request (`engine.longform`) that hands out 30 s windows. A stream feeds
the windows of all its requests to one pool of slots (`engine.runner`): whenever slots are
free, ready windows join the running batch (urgent inputs first); whenever a window finishes,
its request takes the result and may hand out its next window at once. Temperature fallback
re-decodes only the window that needs it, in its slot, from the K/V already projected; the
words of a finished window whose input asks for them are timed (`engine.timing`) from those
K/V too, before the slot is freed.

An input that asks for its speakers (`diarize`) is handed on as soon as its speech is known
(when it is admitted) to the stream's diarizing thread, which reads its audio again and finds
its speakers on a CUDA stream of its own while its windows and others' are decoded: finding
them needs the speech, not the words, so it is done by the time the last window is, instead of
after it (a stream of inputs that end together would otherwise wait for all their speakers at
the end). The inputs handed on while it runs are diarized together next, their windows
embedded in one pass; an input is handed back once both its words and its speakers are.

`submit` inputs as they come, call `step` while `busy`; each step hands back the inputs whose
last window it decoded, and those whose speakers were found since. `abort` takes an input out
and frees its slots. `transcribe` runs an idle stream over a fixed list of inputs.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import heap
from engine.diarize import Recording, Turn, attribute, talk_times
from engine.inputs import MelSource, Prepared, own_stream, sources
from engine.longform import REQUESTS, Request, Window, words_in_speech
from engine.mel import SAMPLE_RATE
from engine.options import OptionsError, TranscriptionOptions
from engine.result import Transcription
from engine.runner import DecodedWindow, Runner
from engine.slots import Sequence as Slotted
from engine.timing import Aligned, Aligner, PendingTimes, TokenTimes
from engine.vad import clip_probabilities, speech_regions

if TYPE_CHECKING:
    from engine.config import Input
    from engine.engine import Engine

Progress = Callable[[float, float], None]  # (seconds done, seconds in all)
_ORDER = operator.attrgetter("order")
PREPARE_THREADS = 8  # threads `transcribe` decodes its inputs on, at most
# a step with no window to decode waits this long for a diarization to end (and no longer: the
# worker's batcher admits new inputs between steps)
SPEAKERS_WAIT_S = 0.02


@dataclass(frozen=True)
class StreamStats:
    """What a stream has done so far. Host seconds: on CUDA the work is asynchronous and shows
    where the host waits for it (mostly in decode steps, which read their tokens back)."""

    encode_s: float = 0.0  # admitting windows: log-mel, encoder, prefill
    decode_s: float = 0.0  # in decode steps
    windows: int = 0  # windows encoded
    timed: int = 0  # windows whose words were timed (word timestamps, or skipped speech)

    def __add__(self, other: StreamStats) -> StreamStats:
        return StreamStats(
            self.encode_s + other.encode_s,
            self.decode_s + other.decode_s,
            self.windows + other.windows,
            self.timed + other.timed,
        )

    def __sub__(self, other: StreamStats) -> StreamStats:
        return StreamStats(
            self.encode_s - other.encode_s,
            self.decode_s - other.decode_s,
            self.windows - other.windows,
            self.timed - other.timed,
        )


@dataclass(frozen=True)
class Finished:
    owner: Hashable
    transcription: Transcription | None
    error: Exception | None = None  # this input alone failed (finding its speakers)


@dataclass(eq=False)
class _Input:
    owner: Hashable
    item: Prepared
    options: TranscriptionOptions
    progress: Progress | None
    order: tuple[bool, int]  # admitted in this order: urgent ones first, then by arrival
    request: Request | None = None  # once its source is open (the next step)
    polling: bool = False  # in Stream._polling
    turns: list[Turn] | None = None  # its speakers, once found (option diarize)


class Streaming:
    """What every stream does the same way over its own `submit`, `step`, `reset`, `check`
    and `prepare` (this one, and the transformers backend's: engine.hf), keeping the inputs
    not yet handed back in `_inputs`."""

    _inputs: dict[Hashable, object]

    @property
    def busy(self) -> bool:
        return bool(self._inputs)

    @property
    def owners(self) -> list[Hashable]:
        """The owners of the inputs in the stream."""
        return list(self._inputs)

    def transcribe(
        self,
        items: Sequence[Input],
        options: TranscriptionOptions | None = None,
        progress: Callable[[int, float, float], None] | None = None,
    ) -> list[Transcription]:
        """Transcribe these inputs together, on an idle stream; progress: (input index,
        seconds done, seconds in all). A failure leaves the stream idle and free. The inputs
        are decoded on up to PREPARE_THREADS threads (the audio decoder releases the GIL): one
        by one, the 168 short FLAC clips of `scripts/rtfx_bench.py` take about 0.3 s of one
        CPU core, where the engine's whole run over them took 0.6 s on an H200."""
        if self.busy:
            raise RuntimeError("transcribe() needs an idle stream; this one has inputs in it")
        options = self.check(options or TranscriptionOptions())
        threads = max(1, min(len(items), PREPARE_THREADS, os.cpu_count() or 1))
        with ThreadPoolExecutor(threads, thread_name_prefix="prepare") as pool:
            prepared = list(pool.map(functools.partial(self.prepare, options=options), items))
        for i, p in enumerate(prepared):
            self.submit(i, p, options, progress=progress and functools.partial(progress, i))
        results: dict[Hashable, Transcription] = {}
        try:
            while self.busy:
                for f in self.step():
                    if f.error is not None:
                        raise f.error
                    results[f.owner] = f.transcription
        except BaseException:
            self.reset()
            raise
        return [results[i] for i in range(len(items))]


class Stream(Streaming):
    """One model's pool of slots, fed by the inputs submitted to it. Not thread-safe, except
    `prepare` and `check`, which job threads call while another thread steps."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stats = StreamStats()
        self._runner: Runner = engine.runner()
        self._aligner: Aligner | None = None  # once an input asks for word timestamps
        # the windows decoded last step, whose words are being timed: taken this step
        self._timing: tuple[list[DecodedWindow], PendingTimes] | None = None
        self._inputs: dict[Hashable, _Input] = {}  # every input not yet handed back
        self._arrivals = itertools.count()
        self._new: list[_Input] = []  # submitted, source not yet opened
        self._done: list[_Input] = []  # opened with nothing to decode (empty input)
        # opened inputs that may have windows ready, in `order`; one whose windows are all
        # handed out leaves, and comes back when one of them is decoded
        self._polling: list[_Input] = []
        self._waiting: list[tuple[_Input, Window]] = []  # ready windows that did not fit yet
        self._asking: list[_Input] = []  # opened, their speakers to be found next
        # the inputs whose speakers are being found, on the diarizing thread
        self._diarizing: tuple[list[_Input], Future[list[list[Turn]]]] | None = None
        self._decoded: list[_Input] = []  # every window decoded, their speakers not found yet
        self._diarizer: ThreadPoolExecutor | None = None  # that thread, once an input asks

    def prepare(self, item: Input, options: TranscriptionOptions | None = None) -> Prepared:
        """Validate and decode one input on the calling thread, for `options` if known; see
        `Engine.prepare`."""
        return self.engine.prepare(item, options)

    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        return self.engine.check(options)

    def submit(
        self,
        owner: Hashable,
        item: Prepared,
        options: TranscriptionOptions | None = None,
        *,
        urgent: bool = False,
        progress: Progress | None = None,
    ) -> None:
        """Add a prepared input; `owner` (unique in the stream) comes back with its result.
        urgent: admitted ahead of the others (interactive work before bulk)."""
        if owner in self._inputs:
            raise ValueError(f"{owner!r} is already in the stream")
        options = self.check(options or TranscriptionOptions())
        if (options.vad or options.diarize) and isinstance(item, MelSource) and not item.hears:
            raise OptionsError("vad and diarize need audio; a spectrogram has no samples")
        if options.finds_speech and isinstance(item, MelSource) and item.unheard:
            raise ValueError("these options use the input's speech: prepare it with them")
        order = (not urgent, next(self._arrivals))
        self._inputs[owner] = entry = _Input(owner, item, options, progress, order)
        self._new.append(entry)

    def abort(self, owner: Hashable) -> bool:
        """Take an input out of the stream (between steps): its windows leave their slots and
        it is never handed back (nor its speakers, if they are being found). False if it was
        not in the stream."""
        entry = self._inputs.pop(owner, None)
        if entry is None:
            return False
        for group in (self._new, self._polling, self._done, self._asking, self._decoded):
            if entry in group:
                group.remove(entry)
        self._waiting = [(e, w) for e, w in self._waiting if e is not entry]
        self._runner.release_where(lambda s: s.owner[0] is entry)
        self._runner.compact()
        if not self._inputs:  # a pass timing only aborted windows: its copies go now
            self._timing = None
        return True

    def reset(self) -> None:
        """Drop every input (after a failure): the pool is free again."""
        self._runner.reset()
        self._inputs.clear()
        self._new.clear()
        self._polling.clear()
        self._done.clear()
        self._waiting.clear()
        self._asking.clear()
        self._decoded.clear()
        self._timing = None
        self._diarizing = None  # what is being found is dropped as it ends

    def shrink(self) -> bool:
        """Drop every input and halve the pool of slots (after running out of device memory);
        False at one slot, where there is nothing left to give up."""
        self.reset()
        if not self.engine.shrink():
            return False
        self._runner = None  # its caches go before the smaller pool is allocated
        heap.settle()  # (frozen since `warm`, a cycle among its objects would hold them)
        self._runner = self.engine.runner()
        return True

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Launch decode steps, take the windows whose words were being timed, admit ready
        windows while the GPU runs them, then hand back the inputs whose last window was
        decoded (and whose speakers were found, if they asked), and those whose speakers were
        found after it."""
        runner = self._runner
        start = time.perf_counter()
        self._open()
        finished, self._done = self._done, []
        if len(self._inputs) == len(finished) + len(self._decoded):  # nothing left to decode
            return self._hand_back(finished, SPEAKERS_WAIT_S)
        opened = time.perf_counter()
        runner.launch()  # the GPU decodes while the host admits ready windows
        launched = time.perf_counter()
        timed, self._timing = self._timing, None
        if timed is not None:  # their pass ran ahead of this step's decoding
            timed_windows, pending = timed
            self._accept(timed_windows, pending.result(), finished)
        windows = self._admit()
        admitted = time.perf_counter()
        if runner.n_live == 0:
            if timed is not None:  # the last windows timed; their inputs' next, if any, next
                runner.compact()
                return self._hand_back(finished, 0.0)
            raise RuntimeError("no window is ready, yet some inputs are not done")
        decoded = runner.collect()
        self.stats += StreamStats(
            encode_s=opened - start + admitted - launched,
            decode_s=launched - opened + time.perf_counter() - admitted,
            windows=windows,
        )
        done = []
        for d in decoded:
            entry, window = d.sequence.owner
            retry = d.sequence.attempt + 1
            if entry.options.needs_fallback(d.result) and retry < len(entry.options.temperature):
                runner.restart(d.slot, entry.request.task(window, retry), retry)
            else:
                done.append(d)
        # words to time: their pass reads their slots' cross-attention K/V as it is launched
        # (the slots may take other windows after), and the windows are taken next step
        pending = self._time_tokens(done)
        for d in done:
            runner.release(d.slot)
        if pending is not None:
            self._timing = (done, pending)
        else:
            self._accept(done, [None] * len(done), finished)
        runner.compact()
        return self._hand_back(finished, 0.0)

    def _accept(
        self,
        done: list[DecodedWindow],
        times: list[TokenTimes | None],
        finished: list[_Input],
    ) -> None:
        """Each decoded window to its request (with its text's times, if timed); the inputs
        done go to `finished`, the others are polled for their next windows."""
        for d, window_times in zip(done, times, strict=True):
            entry, window = d.sequence.owner
            if self._inputs.get(entry.owner) is not entry:  # aborted meanwhile
                continue
            r = entry.request
            r.accept(window, d.result, window_times)
            if entry.progress:
                entry.progress(r.done_seconds, r.source.duration)
            if r.done:
                finished.append(entry)
            else:
                self._poll(entry)

    def _hand_back(self, finished: list[_Input], wait_s: float) -> list[Finished]:
        """The results of the decoded inputs whose speakers are found or not asked for (the
        others wait for theirs), and of those waiting whose speakers were found since,
        waiting up to `wait_s` for the diarizing thread. An input whose speakers could not be
        found fails alone, and leaves its slots if it was still being decoded."""
        out = []
        for entry in finished:
            if entry.options.diarize and entry.turns is None:
                self._decoded.append(entry)
            else:
                out.append(self._finish(entry))
        self._diarize_next()
        if wait_s and self._diarizing:
            wait([self._diarizing[1]], wait_s)
        if self._diarizing and self._diarizing[1].done():
            (batch, future), self._diarizing = self._diarizing, None
            error = future.exception()
            found = [None] * len(batch) if error else future.result()
            for entry, turns in zip(batch, found, strict=True):
                if self._inputs.get(entry.owner) is not entry:  # aborted meanwhile
                    continue
                if error is not None:
                    self.abort(entry.owner)
                    out.append(Finished(entry.owner, None, error))
                    continue
                entry.turns = turns
                if entry in self._decoded:
                    self._decoded.remove(entry)
                    out.append(self._finish(entry))
            self._diarize_next()
        return out

    def _finish(self, entry: _Input) -> Finished:
        del self._inputs[entry.owner]
        return Finished(entry.owner, self._result(entry, entry.turns))

    def _diarize_next(self) -> None:
        """Hand the inputs waiting for their speakers to the diarizing thread, if it is free."""
        if self._asking and self._diarizing is None:
            if self._diarizer is None:
                self._diarizer = ThreadPoolExecutor(1, thread_name_prefix="diarize")
            batch, self._asking = self._asking, []
            self._diarizing = (batch, self._diarizer.submit(self._diarized, batch))

    def warm(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Pay the first-time costs before the first input does: capture the graphs an input
        without a prompt can need (on CUDA: every encoder batch and decode step shape), then
        run a second of silence through every phase outside them (log-mel, encoder, language
        detection, prefill), which loads their kernels, and freeze the objects alive then
        (`engine.heap`). Returns the graphs captured; progress: (graphs done, in all).
        `warm_next` captures the rest."""
        if self.busy:
            raise RuntimeError("warm() needs an idle stream; this one has inputs in it")
        captured = self._runner.capture(progress)
        self.transcribe([np.zeros(SAMPLE_RATE, np.float32)])
        self.stats = StreamStats()  # what it has done is for users' inputs only
        heap.settle()
        return captured

    def warm_next(self) -> bool:
        """Capture one graph `warm` left for later (a wider prompt's prefill), while idle;
        False when none was left."""
        if self.busy:
            raise RuntimeError("warm_next() needs an idle stream; this one has inputs in it")
        return self._runner.capture_next()

    def _open(self) -> None:
        """Open the new inputs' sources: clips of up to 30 s get their log-mel in one pass."""
        if not self._new:
            return
        new, self._new = self._new, []
        m = self.engine.loaded
        opened = sources([e.item for e in new], m.dims.n_mels, m.device)
        # the clips that need their speech found (long audio's is, as it is read): together
        clips = [
            s
            for e, s in zip(new, opened, strict=True)
            if (e.options.vad or e.options.diarize) and s.speech is None
        ]
        if clips:
            held = [next(s.samples()) for s in clips]
            for source, probs in zip(clips, clip_probabilities(held, m.device), strict=True):
                source.speech = speech_regions(probs, source.duration)
        for entry, source in zip(new, opened, strict=True):
            entry.request = REQUESTS[entry.options.mode](source, entry.options, m.tokenizer)
            if entry.options.diarize:
                self._asking.append(entry)
            if entry.request.done:
                self._done.append(entry)
            else:
                self._poll(entry)

    def _poll(self, entry: _Input) -> None:
        if not entry.polling:
            entry.polling = True
            bisect.insort(self._polling, entry, key=_ORDER)

    def _admit(self) -> int:
        """Admit ready windows, an encoder batch at a time, as long as they fit; return how
        many. (One batch a step would fill an empty pool of 512 slots over 16 steps, each
        decoding a fraction of what it could.)"""
        admitted = 0
        while batch := self._admit_batch():
            admitted += batch
        return admitted

    def _admit_batch(self) -> int:
        """Admit ready windows (kept waiting until they fit) as one encoder batch; return how
        many."""
        runner, waiting, full = self._runner, self._waiting, self._runner.encoder_batch
        polled = 0
        for entry in self._polling:
            if len(waiting) >= full:
                break
            polled += 1
            for window in entry.request.ready():
                waiting.append((entry, window))
                if len(waiting) >= full:
                    polled -= 1  # it may have more
                    break
        # the inputs polled to the end have handed out every window they have for now
        for entry in self._polling[:polled]:
            entry.polling = False
        del self._polling[:polled]
        room = runner.room(len(waiting))
        if not room:
            return 0
        batch, waiting[:] = waiting[:room], waiting[room:]
        rows = runner.encode(torch.stack([w.mel for _, w in batch]))  # cast as it is copied in
        if any(e.request.needs_language for e, _ in batch):
            for (e, _), guess in zip(batch, runner.detect_language(rows), strict=True):
                e.request.detected(guess)
        runner.start(
            rows,
            [Slotted((e, w), e.request.task(w, 0)) for e, w in batch],
        )
        return len(batch)

    def _time_tokens(self, done: list[DecodedWindow]) -> PendingTimes | None:
        """The times of the finished windows' text tokens, for the windows of inputs that ask
        for word timestamps (or whose requests want them: a window that may have skipped
        speech), in order of `done` (None for the others): the text each window adds, timed
        in one pass, launched. None if no window asks."""
        asking, eot = [], self.engine.loaded.tokenizer.eot
        for d in done:
            entry, window = d.sequence.owner
            tokens = []
            if entry.options.word_timestamps or entry.request.wants_times(window, d.result):
                pieces, _ = entry.request.pieces(window, d.result)
                tokens = [t for *_, piece_tokens in pieces for t in piece_tokens if t < eot]
            task = d.sequence.task
            asking.append(Aligned(d.slot, tokens, task.language, task.task, window.size))
        if not any(a.tokens for a in asking):
            return None
        if self._aligner is None:
            self._aligner = Aligner(self.engine.loaded, self.engine.triton)
        self.stats += StreamStats(timed=sum(bool(a.tokens) for a in asking))
        return self._aligner.launch(self._runner.slots.cache, asking)

    @torch.inference_mode()
    def _diarized(self, entries: list[_Input]) -> list[list[Turn]]:
        """On the diarizing thread: the speakers of opened inputs, from the engine's backend
        (the built-in one embeds all their windows together, on the stream's device). It reads
        only what opening them fixed (their length and speech) and their audio again, through
        readers of its own, while the steps decode their windows."""
        recordings = [
            Recording(s.samples(), s.duration, s.speech, e.options.diarize)
            for e in entries
            for s in [e.request.source]
        ]
        with own_stream(self.engine.loaded.device):
            return self.engine.diarize(recordings)

    def _result(self, entry: _Input, turns: list[Turn] | None = None) -> Transcription:
        r, tok = entry.request, self.engine.loaded.tokenizer
        if len(r.segments) == 1:  # its text is decoded already
            text = r.segments[0].text
        else:
            text = tok.decode([t for seg in r.segments for t in seg.tokens])
        segments = r.segments
        if r.vad is not None:  # as reported: every rule before went by the words as timed
            segments = words_in_speech(segments, r.vad)
        if turns is not None:
            segments = attribute(segments, turns, tok.decode, tok.eot)
        return Transcription(
            text=text.strip(),
            language=r.language or "en",
            language_probability=r.language_probability,
            duration=round(r.source.duration, 3),
            segments=segments,
            model=self.engine.name,
            options=dict(entry.options.__dict__),
            speakers=None if turns is None else talk_times(turns),
        )
