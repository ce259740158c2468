"""Long-form against openai-whisper's own windows on real audio: each of Whisper's rules as the
reference applies it (its windows on the same samples, tests/data/longform/openai-whisper.json,
written by `scripts/longform_check.py --rules`), and speech that no window may skip."""

import json

import numpy as np
import pytest
import torch

from engine import TranscriptionOptions
from engine.longform import BRIDGE_S, LEAD_IN_S, UNCOVERED_S, SequentialRequest, first_gap
from engine.mel import log_mel_spectrogram
from tests.conftest import DATA, transcribe
from tools.longform import Run, rule_recordings, wer, widest_gap, window_log, with_regions

REFERENCE = DATA / "longform" / "openai-whisper.json"
# openai-whisper's rules and no more (no voice activity: it decodes every window)
RULES_ONLY = TranscriptionOptions(cover_speech=False, vad=False)


@pytest.fixture(scope="module")
def recordings():
    return {r.name: r for r in with_regions(rule_recordings(DATA))}


@pytest.fixture(scope="module")
def reference() -> dict[str, Run]:
    return {name: Run.from_json(run) for name, run in json.loads(REFERENCE.read_text()).items()}


def windows(stream, samples, options):
    with window_log() as log:
        result = transcribe(stream, samples, options)
    return result, [(w.seek, w.size, w.temperature, w.tokens) for w in log]


def theirs(run: Run):
    return [(w.seek, w.size, w.temperature, w.tokens) for w in run.windows]


@pytest.mark.parametrize("cover_speech", [False, True])
def test_a_seek_to_the_last_timestamp_and_the_last_window_padded(
    tiny_en, recordings, reference, cover_speech
):
    """The first window's last segment is unfinished: the next window starts at the last
    timestamp before it; the last window runs past the end of the audio and is padded with
    zeros, as openai-whisper pads it. Nothing is skipped, so covering speech changes nothing."""
    expected = theirs(reference["seek"])
    assert expected[1][0] < 3000 and expected[-1][1] < 3000  # the rules this recording takes
    options = TranscriptionOptions(cover_speech=cover_speech, vad=False)
    _, ours = windows(tiny_en, recordings["seek"].samples, options)
    assert ours == expected


@pytest.mark.parametrize("cover_speech", [False, True])
def test_a_window_of_room_tone_is_skipped_as_silence(tiny_en, recordings, reference, cover_speech):
    run = reference["silence"]
    skipped = [w for w in run.windows if w.no_speech_prob > 0.6 and w.avg_logprob <= -1.0]
    assert [w.seek for w in skipped] == [3000]
    options = TranscriptionOptions(cover_speech=cover_speech, vad=False)
    result, ours = windows(tiny_en, recordings["silence"].samples, options)
    assert ours == theirs(run)
    assert not [s for s in result.segments if 30 <= s.start < 60]  # no text in the skip


def test_voice_activity_decodes_no_window_of_room_tone(tiny_en, recordings):
    """With voice activity the seek jumps over the minute of room tone that openai-whisper
    decodes and then skips as silence: the same text, from fewer windows, the window after the
    tone starting just before the speech."""
    recording = recordings["silence"]
    heard, ours = windows(tiny_en, recording.samples, TranscriptionOptions(vad=True))
    every, all_windows = windows(tiny_en, recording.samples, TranscriptionOptions(vad=False))
    assert heard.text == every.text
    assert len(ours) < len(all_windows)
    assert not [seek for seek, *_ in ours if 1100 < seek < 7000]  # tone: 11 s to 71 s
    speech = next(s for s, _ in recording.regions if s > 60)
    assert speech - LEAD_IN_S - 0.1 < ours[-1][0] / 100 < speech


def test_a_window_that_fails_the_checks_falls_back_as_openai_whisper(
    tiny_en, recordings, reference
):
    """Reversed speech: the greedy try is openai-whisper's token for token, and fails the
    checks here as there; the window is sampled hotter (from other noise: the sampled tries
    differ), at every temperature up to the last."""
    [window] = reference["fallback"].windows
    (first, greedy), *hotter = window.tries
    assert first == 0.0 and [t for t, _ in hotter] == [0.2, 0.4, 0.6, 0.8, 1.0]
    samples = recordings["fallback"].samples
    greedy_only = TranscriptionOptions(temperature=(0.0,), cover_speech=False)
    _, ours = windows(tiny_en, samples, greedy_only)
    assert ours[0][3] == greedy  # all 224 tokens: the last try is decoded to its end
    _, ours = windows(tiny_en, samples, RULES_ONLY)
    assert ours[0][2] == window.temperature == 1.0


def test_speech_a_window_passes_over_is_decoded_again(tiny_en, recordings, reference):
    """Four quiet FLEURS clips: openai-whisper's first window jumps from the first clip to the
    third, and its last stops before the fourth clip's speech; the engine with openai-whisper's
    rules alone does the same, window for window. Covering speech (the default), it decodes
    both again and leaves no second of speech without a segment."""
    recording, run = recordings["skips"], reference["skips"]
    missed = widest_gap(run.segments, recording.regions, recording.seconds)
    assert missed.voiced > 4
    rules_only, ours = windows(tiny_en, recording.samples, RULES_ONLY)
    assert ours == theirs(run)
    covered = transcribe(tiny_en, recording.samples)
    segments = [(s.start, s.end, s.text) for s in covered.segments]
    assert widest_gap(segments, recording.regions, recording.seconds).voiced < UNCOVERED_S
    assert wer(recording, Run(covered.text, [], None, 0)) < wer(recording, run) - 20
    for words in ("twentieth century research", "in their heyday"):  # the clips it skipped
        assert words not in rules_only.text.lower().replace("20th", "twentieth")
        assert words in covered.text.lower().replace("20th", "twentieth")


def test_a_short_clip_is_padded_as_transformers_pads_it_not_as_openai_whisper(
    tiny_en, recordings, reference
):
    """A clip of up to 30 s is decoded from its audio padded to 30 s, as transformers'
    extractor pads it (greedy tokens identical, tests/engine/test_reference.py): "one two
    three" comes out "1, 2, 3.". openai-whisper (and faster-whisper) pad the clip's frames with
    zeros instead; given that spectrogram, the engine decodes openai-whisper's "One, two,
    three." token for token: the rules agree, the padding differs."""
    samples = recordings["digits"].samples
    assert transcribe(tiny_en, samples).text == "1, 2, 3."
    mel = log_mel_spectrogram(torch.from_numpy(samples), 80).numpy()
    zero_padded = np.zeros_like(mel)
    zero_padded[:, : len(samples) // 160] = mel[:, : len(samples) // 160]
    result, ours = windows(tiny_en, zero_padded, RULES_ONLY)
    assert ours[0][3] == reference["digits"].windows[0].tokens
    assert result.text == reference["digits"].text.strip() == "One, two, three."


def test_every_window_moves_the_seek_on_where_speech_is_missed_again_and_again(
    tiny_en, recordings, monkeypatch
):
    """A window that reports skipped speech 1.5 s after its start, every time (the model
    jumping ahead in every window, as it did in a cut window of the dev set's "as-recorded"
    recording, which then looped at one seek for ever): a full window seeks back and the next
    is cut, and a cut window that misses speech again seeks on to that speech, so the request
    ends, with no window empty and none decoded twice at the same place."""
    samples = recordings["skips"].samples

    def always(self, window, segments, timed, advance):
        return 0, window.offset + UNCOVERED_S + 0.5

    monkeypatch.setattr(SequentialRequest, "wants_times", lambda self, window, result: True)
    monkeypatch.setattr(SequentialRequest, "missed", always)
    accept = SequentialRequest.accept
    seen = []

    def bounded(self, window, result, times=None):
        seen.append((window.seek, window.size, window.focused))
        assert len(seen) < 200, "the seek stopped moving"
        accept(self, window, result, times)

    monkeypatch.setattr(SequentialRequest, "accept", bounded)
    transcribe(tiny_en, samples)
    assert all(size > 0 for _, size, _ in seen)
    assert len({(seek, focused) for seek, _, focused in seen}) == len(seen)
    seeks = [seek for seek, _, focused in seen if focused]
    assert seeks == sorted(set(seeks))  # each cut window later than the last


def test_a_window_timed_to_look_for_skipped_speech_gives_its_segments_their_words_times(
    tiny_en, recordings, monkeypatch
):
    """Where a window's words were timed to look for skipped speech and it skipped none, its
    segments start and end with their words, as with word timestamps, not at the model's
    timestamps, which can end seconds before the words do (on the dev set's hour a segment
    ended at 3083.5 s, its words at 3102.5 s, and the gap report counted 16 s of speech with
    no segment over it)."""
    samples = recordings["seek"].samples
    plain = transcribe(tiny_en, samples).segments  # nothing suggests a skip: no words timed
    worded = transcribe(tiny_en, samples, TranscriptionOptions(word_timestamps=True)).segments
    monkeypatch.setattr(SequentialRequest, "wants_times", lambda self, window, result: True)
    timed = transcribe(tiny_en, samples).segments

    def first_window(segments):  # decoded alike in all three; later windows may seek apart
        return [(s.start, s.end, s.tokens) for s in segments if s.end <= 25.0]

    assert len(first_window(timed)) >= 2
    assert first_window(timed) == first_window(worded)
    assert first_window(timed) != first_window(plain)
    assert all(s.words is None for s in timed)
    assert [s.text for s in timed] == [s.text for s in plain]


def test_the_first_gap_in_speech_is_found_in_one_sweep():
    """`first_gap` against its definition, eighth of a second by eighth (every time here on
    that grid, so the sums are exact): the first stretch of speech that no covered interval
    overlaps, pauses of up to BRIDGE_S bridged, UNCOVERED_S long; on random speech and covered
    intervals, overlapping and out of order as words with their slack are."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        cuts = np.sort(rng.choice(np.arange(0, 400), 2 * int(rng.integers(1, 12)), replace=False))
        speech = [(a / 8, b / 8) for a, b in cuts.reshape(-1, 2)]
        covered = [
            (a / 8, (a + int(rng.integers(0, 30))) / 8)
            for a in rng.integers(0, 400, int(rng.integers(0, 30)))
        ]
        start, end = sorted(int(x) for x in rng.integers(0, 400, 2))
        assert first_gap(speech, covered, start / 8, end / 8) == _gap_by_eighths(
            speech, covered, start, end
        )


def _gap_by_eighths(speech, covered, start: int, end: int) -> float | None:
    bridge, needed = BRIDGE_S * 8, UNCOVERED_S * 8
    begin = after = count = None  # the stretch: its first eighth, the eighth after, how many
    for eighth in range(start, end):
        t = eighth / 8
        if not any(s <= t < e for s, e in speech) or any(s <= t < e for s, e in covered):
            continue
        if begin is None or eighth - after > bridge:
            begin, count = eighth, 0
        after, count = eighth + 1, count + 1
        if count >= needed:
            return begin / 8
    return None
