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

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from engine.speakers import SAMPLE_RATE, load

WINDOW_S = 1.5
STEP_S = 0.75
THRESHOLD = 0.75  # cosine distance at which two clusters stay apart
MIN_SPEAKER_S = 2.0  # a cluster of less speech than this joins its nearest (unless counted)
BATCH = 256  # windows an embedding pass


@dataclass(frozen=True)
class SpeakerCount:
    """What the caller knows of the number of speakers: exactly `speakers`, or a range."""

    speakers: int | None = None
    min_speakers: int = 1
    max_speakers: int | None = None

    def __post_init__(self) -> None:
        if self.speakers is not None and self.speakers < 1:
            raise ValueError("speakers: at least 1")
        if self.min_speakers < 1 or (self.max_speakers or self.min_speakers) < self.min_speakers:
            raise ValueError("min_speakers must be at least 1 and at most max_speakers")


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
    return out


def embed(samples: np.ndarray, spans: list[tuple[float, float]], device: str = "cpu") -> np.ndarray:
    """(len(spans), 192) unit embeddings of equal-length spans of 16 kHz samples."""
    if not spans:
        return np.zeros((0, 192), np.float32)
    n = round(WINDOW_S * SAMPLE_RATE)
    padded = np.pad(samples, (0, n))
    cuts = np.stack([padded[round(s * SAMPLE_RATE) :][:n] for s, _ in spans])
    model = load(str(device))
    out = [
        model(torch.from_numpy(cuts[i : i + BATCH]).to(device)).cpu()
        for i in range(0, len(cuts), BATCH)
    ]
    return torch.cat(out).numpy()


def cluster(
    embeddings: np.ndarray, count: SpeakerCount, threshold: float = THRESHOLD
) -> np.ndarray:
    """A speaker index for each embedding, 0, 1, ... in order of first appearance."""
    from scipy.cluster.hierarchy import fcluster, linkage

    n = len(embeddings)
    if n < 2:
        return np.zeros(n, int)
    tree = linkage(embeddings, method="average", metric="cosine")
    if count.speakers is not None:
        labels = fcluster(tree, min(count.speakers, n), "maxclust")
    else:
        labels = fcluster(tree, threshold, "distance")
        labels = _merge_small(embeddings, labels)
        found = len(set(labels))
        want = min(max(found, count.min_speakers), count.max_speakers or found, n)
        if want != found:
            labels = fcluster(tree, want, "maxclust")
    _, first = np.unique(labels, return_index=True)
    order = {labels[i]: k for k, i in enumerate(sorted(first))}
    return np.array([order[x] for x in labels])


def _merge_small(embeddings: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Move the windows of clusters with less than MIN_SPEAKER_S of speech to the nearest
    large cluster (by centroid): a cough, a laugh or a noisy window is no new speaker."""
    keys, sizes = np.unique(labels, return_counts=True)
    small = keys[sizes * STEP_S < MIN_SPEAKER_S]
    large = keys[sizes * STEP_S >= MIN_SPEAKER_S]
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


def diarize(
    samples: np.ndarray,
    regions: list[tuple[float, float]],
    count: SpeakerCount = SpeakerCount(),
    device: str = "cpu",
    threshold: float = THRESHOLD,
) -> list[Turn]:
    """Speaker turns of 16 kHz `samples` whose speech is `regions`."""
    spans = windows(regions, len(samples) / SAMPLE_RATE)
    labels = cluster(embed(samples, spans, device), count, threshold)
    return turns(regions, spans, labels)


def speaker_at(start: float, end: float, turns: list[Turn]) -> int | None:
    """The speaker of [start, end) (a word, a segment): the turn overlapping it most, else the
    nearest turn; None without turns."""
    if not turns:
        return None
    overlap = [min(end, t.end) - max(start, t.start) for t in turns]
    best = max(range(len(turns)), key=overlap.__getitem__)
    if overlap[best] > 0:
        return turns[best].speaker
    distance = [max(t.start - end, start - t.end) for t in turns]
    return turns[min(range(len(turns)), key=distance.__getitem__)].speaker
