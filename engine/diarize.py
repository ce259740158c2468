"""Who spoke when: voice activity (`engine.vad`), speaker embeddings of short windows of speech
(`engine.speakers`), clustered into speakers with their number found, then speaker turns.

Windows of WINDOW_S every STEP_S cover each stretch of speech (a shorter stretch gets one window
centred on it). Their embeddings are clustered bottom-up (average cosine distance) until the
closest two clusters are further apart than THRESHOLD, or into the number of speakers given,
or into the allowed range. A moment of speech belongs to the speaker of the window whose centre
is nearest. THRESHOLD was chosen on one set of built conversations and checked on another
(scripts/diarization_check.py, docs/accuracy.md).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import chain, groupby, pairwise
from operator import attrgetter

import numpy as np
import torch
import torch.nn.functional as F

from engine.mel import to_device
from engine.options import SpeakerCount
from engine.result import Segment, Speaker, Word
from engine.speakers import SAMPLE_RATE, load

WINDOW_S = 1.5
STEP_S = 0.75
THRESHOLD = 0.75  # cosine distance at which two clusters stay apart
MIN_SPEAKER_S = 2.0  # a cluster of less speech than this joins its nearest (unless counted)
BATCH = 1024  # windows an embedding pass: 1.9 GB of activations on a GPU (docs/benchmarks.md)
# windows clustered bottom-up at most (50 min of speech): the tree's memory and time grow with
# their square (4 h of speech would be 19,000 windows and 1.4 GB)
MAX_CLUSTERED = 4000


@dataclass(frozen=True)
class Turn:
    start: float
    end: float
    speaker: int  # 0, 1, ... in order of first appearance


def windows(regions: list[tuple[float, float]], duration: float) -> list[tuple[float, float]]:
    """The (start, end) of each window embedded: WINDOW_S long, STEP_S apart, inside each
    stretch of speech (the last ending with it); one centred on a shorter stretch."""
    out = []
    for s, e in regions:
        if e - s <= WINDOW_S:
            mid = min(max((s + e) / 2, WINDOW_S / 2), max(duration - WINDOW_S / 2, WINDOW_S / 2))
            out.append((mid - WINDOW_S / 2, mid + WINDOW_S / 2))
            continue
        starts = np.arange(s, e - WINDOW_S, STEP_S).tolist() + [e - WINDOW_S]
        out += [(a, a + WINDOW_S) for a in starts]
    return sorted(out)


def cuts(
    blocks: Iterable[np.ndarray], spans: list[tuple[float, float]], device: str = "cpu"
) -> Iterator[torch.Tensor]:
    """The WINDOW_S of samples from each span's start (spans in order of start), read from an
    input's 16 kHz samples block by block, as (windows, samples) tensors on `device`, a few
    windows at a time: an hour's recording is read again without being held, and crosses to a
    GPU once, as its blocks (its windows overlap: cut on the host, twice its speech would be
    copied there and sent). The windows whole in what is held are gathered in one copy."""
    n = round(WINDOW_S * SAMPLE_RATE)
    starts = [round(s * SAMPLE_RATE) for s, _ in spans]
    held, start, at = torch.zeros(0, device=device), 0, 0  # start: held[0]'s index in the input
    for block in chain(blocks if starts else [], [None]):  # none to cut: nothing read
        if block is not None:
            held = torch.cat([held, to_device(block, device)])
            last = bisect_right(starts, start + len(held) - n, lo=at)  # the windows held whole
        else:  # the end: the rest, zero-padded past it
            last = len(starts)
            if last > at:
                held = F.pad(held, (0, max(0, starts[-1] - start + n - len(held))))
        if last > at:
            offsets = torch.tensor(starts[at:last], device=device) - start
            yield held.unfold(0, n, 1).index_select(0, offsets)
            at = last
        if at == len(starts):  # every window cut: the rest is not read
            return
        drop = min(starts[at] - start, len(held))
        held, start = held[drop:], start + drop


def embed(samples: np.ndarray, spans: list[tuple[float, float]], device: str = "cpu") -> np.ndarray:
    """(len(spans), 192) unit embeddings of WINDOW_S spans of 16 kHz samples."""
    return embed_cuts(cuts([samples], spans, device), device)


def embed_cuts(
    cut: Iterable[torch.Tensor], device: str = "cpu", triton: bool = False
) -> np.ndarray:
    """(n, 192) unit embeddings of the rows of (windows, samples) tensors on `device`, BATCH
    rows a pass, read back once: the host queues each pass while the device runs the one
    before."""
    model, out, rows = load(str(device), triton), [torch.zeros(0, 192, device=device)], []
    for windows in chain(cut, [None]):
        if windows is not None:
            rows.append(windows)
        held = sum(map(len, rows))
        while held >= BATCH or (windows is None and held):
            batch = torch.cat(rows)
            out.append(model(batch[:BATCH]))
            rows, held = [batch[BATCH:]], held - min(held, BATCH)
    return torch.cat(out).cpu().numpy()


def cluster(
    embeddings: np.ndarray, count: SpeakerCount, threshold: float = THRESHOLD
) -> np.ndarray:
    """A speaker index for each embedding, 0, 1, ... in order of first appearance. Over
    MAX_CLUSTERED windows, an even sample of them is clustered and every window joins the
    nearest centroid of the speakers found."""
    n = len(embeddings)
    if n <= MAX_CLUSTERED:
        return _first_appearance(_cluster(embeddings, count, threshold, 1.0))
    picked = np.linspace(0, n - 1, MAX_CLUSTERED).round().astype(int)
    sampled = _cluster(embeddings[picked], count, threshold, n / MAX_CLUSTERED)
    keys = np.unique(sampled)
    centroids = np.stack([embeddings[picked][sampled == k].mean(0) for k in keys])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return _first_appearance(np.argmax(embeddings @ centroids.T, axis=1))


def _cluster(
    embeddings: np.ndarray, count: SpeakerCount, threshold: float, weight: float
) -> np.ndarray:
    """Bottom-up clustering; `weight`: windows each one stands for (a sample's)."""
    from scipy.cluster.hierarchy import fcluster, linkage

    n = len(embeddings)
    if n < 2:
        return np.zeros(n, int)
    tree = linkage(embeddings, method="average", metric="cosine")
    if count.speakers is not None:
        return fcluster(tree, min(count.speakers, n), "maxclust")
    labels = _merge_small(embeddings, fcluster(tree, threshold, "distance"), weight)
    found = len(set(labels))
    want = min(max(found, count.min_speakers), count.max_speakers or found, n)
    return fcluster(tree, want, "maxclust") if want != found else labels


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    """The labels renamed 0, 1, ... in order of first appearance."""
    _, first = np.unique(labels, return_index=True)
    order = {labels[i]: k for k, i in enumerate(sorted(first))}
    return np.array([order[x] for x in labels], dtype=int)


def _merge_small(embeddings: np.ndarray, labels: np.ndarray, weight: float) -> np.ndarray:
    """Move the windows of clusters with less than MIN_SPEAKER_S of speech to the nearest
    large cluster (by centroid): a cough, a laugh or a noisy window is no new speaker."""
    keys, sizes = np.unique(labels, return_counts=True)
    seconds = sizes * weight * STEP_S
    small, large = keys[seconds < MIN_SPEAKER_S], keys[seconds >= MIN_SPEAKER_S]
    if not len(small) or not len(large):
        return labels
    centroids = np.stack([embeddings[labels == k].mean(0) for k in large])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    labels = labels.copy()
    for i in np.flatnonzero(np.isin(labels, small)):
        labels[i] = large[int(np.argmax(centroids @ embeddings[i]))]
    return labels


def turns(
    regions: list[tuple[float, float]], spans: list[tuple[float, float]], labels: np.ndarray
) -> list[Turn]:
    """Speaker turns over the speech: each moment of a stretch of speech goes to the window
    whose centre is nearest; neighbouring turns of one speaker are joined."""
    centres = np.array([(s + e) / 2 for s, e in spans])
    out: list[Turn] = []
    for s, e in regions:
        inside = np.flatnonzero((centres >= s) & (centres <= e))  # this stretch's windows
        if not len(inside):
            continue
        inside = inside[np.argsort(centres[inside])]
        # cut the stretch midway between neighbouring windows of different speakers
        start = s
        for a, b in pairwise(inside):
            if labels[a] != labels[b]:
                cut = min(max((centres[a] + centres[b]) / 2, s), e)
                out.append(Turn(start, cut, int(labels[a])))
                start = cut
        out.append(Turn(start, e, int(labels[inside[-1]])))
    joined: list[Turn] = []
    for t in out:
        if t.end <= t.start:
            continue
        if joined and joined[-1].speaker == t.speaker and t.start - joined[-1].end < STEP_S:
            joined[-1] = Turn(joined[-1].start, t.end, t.speaker)
        else:
            joined.append(t)
    return joined


@dataclass(frozen=True)
class Recording:
    """One input to diarize: its samples (any iterable of 16 kHz blocks, read once, in
    order), its length, its speech (`engine.vad`) and what is known of its speakers."""

    blocks: Iterable[np.ndarray]
    duration: float
    regions: list[tuple[float, float]]
    count: SpeakerCount = SpeakerCount()


def speaker_turns(
    recordings: list[Recording],
    device: str = "cpu",
    threshold: float = THRESHOLD,
    triton: bool = False,
) -> list[list[Turn]]:
    """Speaker turns of each recording; the windows of all of them embedded together, BATCH a
    pass (a stream diarizes together the inputs that finish while it diarizes others); triton:
    the embedder's Triton kernels on CUDA (`engine.speakers.load`)."""
    spans = [windows(r.regions, r.duration) for r in recordings]
    pieces = chain.from_iterable(
        cuts(r.blocks, s, device) for r, s in zip(recordings, spans, strict=True)
    )
    embeddings = np.split(
        embed_cuts(pieces, device, triton), np.cumsum([len(s) for s in spans])[:-1]
    )
    counts = [r.count for r in recordings]
    # scipy's linkage lets go of the GIL: the recordings' trees are built side by side
    with ThreadPoolExecutor(max(1, min(len(recordings), os.cpu_count() or 1))) as pool:
        labels = pool.map(cluster, embeddings, counts, [threshold] * len(recordings))
        return [
            turns(r.regions, s, found)
            for r, s, found in zip(recordings, spans, labels, strict=True)
        ]


def diarize(
    samples: np.ndarray,
    regions: list[tuple[float, float]],
    count: SpeakerCount | None = None,
    device: str = "cpu",
    threshold: float = THRESHOLD,
) -> list[Turn]:
    """Speaker turns of 16 kHz `samples` whose speech is `regions`."""
    recording = Recording([samples], len(samples) / SAMPLE_RATE, regions, count or SpeakerCount())
    return speaker_turns([recording], device, threshold)[0]


def speaker_at(start: float, end: float, turns: list[Turn]) -> int | None:
    """The speaker of [start, end) (a word, a segment): the turn overlapping it most, else the
    nearest turn; None without turns. Turns in order, without overlap (an hour's 40,000 words
    against its thousands of turns: a search, not a scan)."""
    if not turns:
        return None
    after = bisect_right(turns, end, key=attrgetter("start"))  # turns[:after] start by `end`
    best, most, i = None, 0.0, after - 1
    while i >= 0 and turns[i].end > start:  # the turns over it, back from the last
        overlap = min(end, turns[i].end) - max(start, turns[i].start)
        if overlap > 0 and overlap >= most:
            best, most = turns[i], overlap
        i -= 1
    if best is None:
        near = turns[max(0, after - 1) : after + 1]
        best = min(near, key=lambda t: max(t.start - end, start - t.end))
    return best.speaker


def label(speaker: int) -> str:
    return f"SPEAKER_{speaker:02d}"


def talk_times(turns: list[Turn]) -> list[Speaker]:
    """Each speaker's seconds of speech, in order of first appearance."""
    seconds: dict[int, float] = {}
    for t in turns:
        seconds[t.speaker] = seconds.get(t.speaker, 0.0) + t.end - t.start
    return [Speaker(label(k), round(v, 2)) for k, v in seconds.items()]


def attribute(
    segments: list[Segment], turns: list[Turn], decode: Callable[[list[int]], str], eot: int
) -> list[Segment]:
    """The segments with their speakers: each word the speaker of the turn it overlaps most
    (`speaker_at`), a segment the speaker of its words, cut in two where they change (each
    part's tokens are the text tokens decoded to its words); ids numbered again."""
    label_at = _labeller(turns)
    out: list[Segment] = []

    def add(segment: Segment, **changes) -> None:  # numbered as it comes: one copy a segment
        out.append(replace(segment, id=len(out), **changes))

    for segment in segments:
        if not segment.words:
            add(segment, speaker=label_at(segment.start, segment.end))
            continue
        words = [
            Word(w.word, w.start, w.end, w.probability, label_at(w.start, w.end))
            for w in segment.words
        ]
        runs = [list(run) for _, run in groupby(words, key=attrgetter("speaker"))]
        if len(runs) == 1:
            add(segment, words=words, speaker=words[0].speaker)
            continue
        text = [t for t in segment.tokens if t < eot]
        ends = [len(decode(text[:k])) for k in range(len(text) + 1)]
        first, length = 0, 0
        for run in runs:
            length += sum(len(w.word) for w in run)
            last = next((k for k in range(first, len(text) + 1) if ends[k] >= length), len(text))
            add(
                segment,
                start=run[0].start,
                end=run[-1].end,
                text="".join(w.word for w in run),
                tokens=text[first:last],
                words=run,
                speaker=run[0].speaker,
            )
            first = last
    return out


def _labeller(turns: list[Turn]) -> Callable[[float, float], str | None]:
    """(start, end) -> the label of `speaker_at`'s speaker. Most words lie inside one turn,
    which is then theirs: found by one search (an hour's 40,000 words, on the stepping
    thread)."""
    starts = [t.start for t in turns]
    labels = [label(t.speaker) for t in turns]

    def label_at(start: float, end: float) -> str | None:
        k = bisect_right(starts, start) - 1
        if k >= 0 and end <= turns[k].end:
            return labels[k]
        speaker = speaker_at(start, end, turns)
        return None if speaker is None else label(speaker)

    return label_at
