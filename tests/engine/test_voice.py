"""Voice activity and speakers through the stream (options `vad` and `diarize`), on tiny.en and
real voices: the text of speech only, each word with who spoke it."""

import threading

import numpy as np
import pytest
import torch

from engine import OptionsError, TranscriptionOptions
from engine.audio import decode_audio
from engine.diarize import speaker_at
from engine.longform import (
    LEAD_IN_S,
    MAX_GAP_S,
    is_anomaly,
    speech_stretches,
    words_in_speech,
)
from engine.mel import log_mel_spectrogram
from engine.options import SpeakerCount
from engine.result import Segment, Word
from engine.vad import regions_of
from tests.conftest import built_conversations
from tools.conversations import no_speech
from tools.longform import leveled, room_tone
from tools.wer import word_error_rate

DIARIZE = TranscriptionOptions(diarize=SpeakerCount())


@pytest.fixture(scope="module")
def conversation():
    return built_conversations()[1]  # three voices, 32 s


SPACED = ("en_jfk", "en_ljspeech_LJ050-0131")


@pytest.fixture(scope="module")
def spaced(clips):
    """JFK, 45 s of room tone, LJ: audio over 30 s, two thirds of it without speech."""
    rng = np.random.default_rng(0)
    jfk, lj = (leveled(decode_audio(clips[n].bytes)) for n in SPACED)
    return np.concatenate([jfk, room_tone(45.0, rng), lj])


def test_each_segment_and_word_names_its_speaker(tiny_en, conversation):
    """Three voices, told apart: every word's speaker is the true one at that moment (under a
    one-to-one naming), each speaker's words are their own clip's, and the result lists the
    three with their talk time."""
    conv = conversation
    result = tiny_en.transcribe([conv.samples], DIARIZE)[0]
    assert [s.speaker for s in result.speakers] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_02"]
    truth = sum(e - s for s, e, _ in conv.turns)
    assert sum(s.talk_time for s in result.speakers) == pytest.approx(truth, rel=0.15)
    words = result.words
    assert words and all(w.speaker for w in words)
    assert all(s.speaker and {w.speaker for w in s.words} == {s.speaker} for s in result.segments)
    true = [conv.turns[speaker_at(w.start, w.end, _turns(conv))][2] for w in words]
    naming = {}
    for w, who in zip(words, true, strict=True):
        naming.setdefault(w.speaker, who)
    assert sorted(naming.values()) == sorted(conv.speakers)
    right = sum(naming[w.speaker] == who for w, who in zip(words, true, strict=True))
    assert right >= 0.95 * len(words)
    for label, who in naming.items():
        said = "".join(s.text for s in result.segments if s.speaker == label)
        assert word_error_rate([conv.references[who]], [said]) < 0.4, who
    # the same text as without speakers: they cut segments, never words
    assert result.text == tiny_en.transcribe([conv.samples])[0].text


def _turns(conv):
    """The conversation's ground truth as engine turns, numbered by their place in it."""
    from engine.diarize import Turn

    return [Turn(s, e, i) for i, (s, e, _) in enumerate(conv.turns)]


def test_a_count_given_is_the_count_found(tiny_en, conversation):
    two = tiny_en.transcribe([conversation.samples], TranscriptionOptions(diarize=SpeakerCount(2)))
    assert [s.speaker for s in two[0].speakers] == ["SPEAKER_00", "SPEAKER_01"]


def test_inputs_finishing_together_are_diarized_as_alone(tiny_en, conversation, clips):
    jfk = decode_audio(clips["en_jfk"].bytes)
    together = tiny_en.transcribe([conversation.samples, jfk], DIARIZE)
    alone = [tiny_en.transcribe([x], DIARIZE)[0] for x in (conversation.samples, jfk)]
    assert [who(r) for r in together] == [who(r) for r in alone]
    assert [s.speaker for s in alone[1].speakers] == ["SPEAKER_00"]


class Held:
    """The engine's diarization, held until released: what a long recording's takes."""

    def __init__(self, engine):
        self.diarize, self.entered, self.release = (
            engine.diarize,
            threading.Event(),
            threading.Event(),
        )

    def __call__(self, recordings):
        self.entered.set()
        assert self.release.wait(60)
        return self.diarize(recordings)


def steps_until(stream, condition):
    finished = {}
    while not condition(finished):
        finished.update((f.owner, f) for f in stream.step())
    return finished


def test_decoding_goes_on_while_speakers_are_found(tiny_en, conversation, clips, monkeypatch):
    """An input's speakers are found on the stream's diarizing thread: while they are, another
    input is decoded to its end and handed back; then the first comes back with its speakers,
    as found alone."""
    alone = tiny_en.transcribe([conversation.samples], DIARIZE)[0]
    held = Held(tiny_en.engine)
    monkeypatch.setattr(tiny_en.engine, "diarize", held)
    tiny_en.submit("talk", tiny_en.prepare(conversation.samples), DIARIZE)
    steps_until(tiny_en, lambda _: held.entered.is_set())
    tiny_en.submit("jfk", tiny_en.prepare(clips["en_jfk"].bytes))
    finished = steps_until(tiny_en, lambda f: "jfk" in f)
    assert "ask not" in finished["jfk"].transcription.text.lower() and "talk" not in finished
    assert tiny_en.busy and tiny_en.owners == ["talk"]
    held.release.set()
    finished = steps_until(tiny_en, lambda f: not tiny_en.busy)
    assert who(finished["talk"].transcription) == who(alone)


def test_speakers_are_found_while_the_words_are_decoded(tiny_en, conversation, monkeypatch):
    """Finding an input's speakers starts when it is admitted, not after its last window: a
    stream whose inputs end together does not wait for all their speakers at the end. Its
    words decoded, the input waits for its speakers, and comes back as found alone."""
    alone = tiny_en.transcribe([conversation.samples], DIARIZE)[0]
    held, done = Held(tiny_en.engine), []
    monkeypatch.setattr(tiny_en.engine, "diarize", held)
    talk = tiny_en.prepare(conversation.samples)
    tiny_en.submit("talk", talk, DIARIZE, progress=lambda seconds, _: done.append(seconds))
    steps_until(tiny_en, lambda _: held.entered.is_set())
    assert not done  # entered before any window was decoded
    for _ in range(400):  # its words, to the end
        if done and done[-1] >= conversation.duration - 0.05:
            break
        assert tiny_en.step() == []
    else:
        raise AssertionError(f"decoding stood still at {done[-1:]} s")
    assert [tiny_en.step() for _ in range(3)] == [[]] * 3 and tiny_en.owners == ["talk"]
    held.release.set()
    finished = steps_until(tiny_en, lambda f: not tiny_en.busy)
    assert who(finished["talk"].transcription) == who(alone)


def test_a_failed_diarization_fails_its_input_alone(tiny_en, conversation, clips, monkeypatch):
    def broken(recordings):
        raise OSError("the recording could not be read again")

    monkeypatch.setattr(tiny_en.engine, "diarize", broken)
    tiny_en.submit("talk", tiny_en.prepare(conversation.samples), DIARIZE)
    tiny_en.submit("jfk", tiny_en.prepare(clips["en_jfk"].bytes), DIARIZE)
    tiny_en.submit("plain", tiny_en.prepare(clips["en_jfk"].bytes))
    finished = steps_until(tiny_en, lambda f: not tiny_en.busy)
    for owner in ("talk", "jfk"):
        assert isinstance(finished[owner].error, OSError) and not finished[owner].transcription
    assert finished["plain"].error is None and "ask not" in finished["plain"].transcription.text
    with pytest.raises(OSError, match="read again"):
        tiny_en.transcribe([conversation.samples], DIARIZE)
    assert not tiny_en.busy


def test_an_input_aborted_while_its_speakers_are_found_never_comes_back(
    tiny_en, conversation, monkeypatch
):
    held = Held(tiny_en.engine)
    monkeypatch.setattr(tiny_en.engine, "diarize", held)
    tiny_en.submit("talk", tiny_en.prepare(conversation.samples), DIARIZE)
    steps_until(tiny_en, lambda _: held.entered.is_set())
    assert tiny_en.abort("talk") and not tiny_en.busy
    held.release.set()
    tiny_en.submit("again", tiny_en.prepare(conversation.samples), DIARIZE)
    finished = steps_until(tiny_en, lambda f: not tiny_en.busy)
    assert list(finished) == ["again"] and finished["again"].transcription.speakers


def who(result):
    """Who said what when (a batch's log-probabilities differ in their last bits on a CPU)."""
    said = [(s.start, s.end, s.speaker, s.text) for s in result.segments]
    return said, [(w.word, w.speaker) for w in result.words], result.speakers


@pytest.mark.parametrize("kind", ["silence", "noise", "tone", "music"])
def test_a_clip_without_speech_gives_no_text(tiny_en, kind):
    samples = no_speech(kind, 8.0, np.random.default_rng(1))
    result = tiny_en.transcribe([samples], TranscriptionOptions(vad=True))[0]
    assert result.text == "" and result.segments == []
    diarized = tiny_en.transcribe([samples], DIARIZE)[0]
    assert diarized.segments == [] and diarized.speakers == []


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_long_silence_is_not_decoded(tiny_en, clips, spaced, mode):
    """With voice activity (chunked long audio's default) the windows go to the speech only,
    the 45 s of room tone gives no text, and the text is as right as the one decoded without
    it."""
    before = tiny_en.stats.windows
    heard = tiny_en.transcribe([spaced], TranscriptionOptions(mode=mode, vad=True))[0]
    windows = tiny_en.stats.windows - before
    every = tiny_en.transcribe([spaced], TranscriptionOptions(mode=mode, vad=False))[0]
    assert windows == 2 < tiny_en.stats.windows - before - windows
    assert not [s for s in heard.segments if 12.0 < (s.start + s.end) / 2 < 56.0]
    reference = " ".join(clips[n].reference for n in SPACED)
    wers = [word_error_rate([reference], [r.text]) for r in (heard, every)]
    assert wers[0] <= wers[1] + 0.03, wers
    default = tiny_en.transcribe([spaced], TranscriptionOptions(mode=mode))[0]
    assert default.options["vad"] is None  # as asked
    assert default.segments == (heard if mode == "chunked" else every).segments


def test_chunked_windows_join_speech_up_to_30_s_unless_a_long_silence_parts_it():
    assert (MAX_GAP_S, LEAD_IN_S) == (4.0, 1.0)
    speech = [(0.5, 4.0), (5.0, 12.0), (16.1, 20.0), (20.5, 60.0), (61.0, 62.0)]
    # joined from the start; parted by 4.1 s of silence (a second of it kept before the
    # speech); too long to join (cut as decoded), too far to join: each from where the one
    # before ends, which is less than a second before its speech
    expected = [(0, 1200), (1510, 2000), (2000, 6000), (6000, 6200)]
    assert speech_stretches(speech, 6500) == expected
    assert speech_stretches(speech, 6000) == expected[:3]  # none past the end
    assert speech_stretches([(9.0, 10.0)], 2000) == [(800, 1000)]  # a long silence first


def test_words_are_kept_to_the_speech():
    """A word timed into a stretch without speech comes back to the speech: cut back to the
    stretch it overlaps most, or, wholly outside, moved to the nearer edge with no more time
    than it had, sharing what it then overlaps with the word beside it; its segment follows its
    words."""
    speech = [(1.0, 3.0), (5.0, 6.0), (10.0, 12.0)]

    def kept(segment):
        [out] = words_in_speech([segment], speech)
        return out

    def segment(*spans):
        words = [Word(f" w{i}", s, e, 0.9) for i, (s, e) in enumerate(spans)]
        text = "".join(w.word for w in words)
        return Segment(0, spans[0][0], spans[-1][1], text, [], -0.2, 1.1, 0.01, 0.0, words)

    inside = segment((1.2, 1.5), (1.6, 2.9))
    assert kept(inside) is inside  # nothing to move
    cut = kept(segment((0.2, 1.4), (2.5, 5.4), (5.5, 6.8)))
    assert [(w.start, w.end) for w in cut.words] == [(1.0, 1.4), (2.5, 3.0), (5.5, 6.0)]
    assert (cut.start, cut.end) == (1.0, 6.0)
    # wholly in the silence between 6 and 10: to the nearer edge, its length kept
    moved = kept(segment((8.0, 9.5), (9.6, 11.0)))
    assert [(w.start, w.end) for w in moved.words] == [(10.0, 10.5), (10.5, 11.0)]
    back = kept(segment((6.5, 7.0)))
    assert [(w.start, w.end) for w in back.words] == [(5.5, 6.0)] and back.start == 5.5
    late = kept(segment((12.5, 14.0)))  # after the last speech
    assert [(w.start, w.end) for w in late.words] == [(10.5, 12.0)]


def test_words_kept_to_the_speech_change_their_times_only(tiny_en, conversation, monkeypatch):
    """Words are kept to the speech as the result is made: the windows, the text and the
    speakers are what they would be without it, and every word overlaps the speech."""
    import engine.stream

    options = TranscriptionOptions(diarize=SpeakerCount(), word_timestamps=True)
    kept = tiny_en.transcribe([conversation.samples], options)[0]
    monkeypatch.setattr(engine.stream, "words_in_speech", lambda segments, _: segments)
    as_timed = tiny_en.transcribe([conversation.samples], options)[0]
    assert kept.text == as_timed.text and kept.speakers == as_timed.speakers
    assert [w.word for w in kept.words] == [w.word for w in as_timed.words]
    speech = regions_of(conversation.samples)
    assert all(any(s < w.end and e > w.start for s, e in speech) for w in kept.words)


def test_a_spectrogram_cannot_be_listened_to(tiny_en, clips):
    mel = log_mel_spectrogram(torch.from_numpy(decode_audio(clips["en_jfk"].bytes)), 80)
    for options in (TranscriptionOptions(vad=True), DIARIZE):
        with pytest.raises(OptionsError, match="need audio"):
            tiny_en.transcribe([mel.numpy()], options)
    assert not tiny_en.busy


def test_a_made_up_word_between_silences_is_dropped_as_openai_whisper_drops_it(tiny_en, clips):
    """hallucination_silence_threshold: tiny.en makes a word of 8 s of a tone, improbable and
    between silences: with the threshold it goes (and the window is skipped), where real speech
    keeps every word."""
    tone = no_speech("tone", 8.0, np.random.default_rng(1))
    plain = tiny_en.transcribe([tone], TranscriptionOptions(word_timestamps=True))[0]
    assert plain.text  # what the option is for
    assert is_anomaly(plain.segments[0])
    guarded = TranscriptionOptions(hallucination_silence_threshold=2.0)
    assert tiny_en.transcribe([tone], guarded)[0].segments == []
    jfk = decode_audio(clips["en_jfk"].bytes)
    kept = tiny_en.transcribe([jfk], guarded)[0]
    assert kept.text == tiny_en.transcribe([jfk])[0].text and kept.words


def test_an_anomaly_is_openai_whispers():
    def segment(*words):
        timed = [Word(w, s, e, p) for w, s, e, p in words]
        return Segment(0, 0.0, 9.0, "", [], -1.0, 1.0, 0.1, 0.0, timed)

    assert is_anomaly(segment((" you", 5.0, 6.0, 0.1)))  # improbable: 1 for 1 word
    assert not is_anomaly(segment((" you", 5.0, 6.0, 0.4)))
    assert is_anomaly(segment((" so", 0.0, 5.0, 0.9), (" la", 5.0, 6.0, 0.9)))  # 3 s too long
    assert not is_anomaly(segment((" so", 0.0, 1.0, 0.1), (" la", 1.0, 2.0, 0.9)))  # 1 of 2
    assert is_anomaly(segment((" a", 0.0, 0.01, 0.9), (".", 0.01, 0.5, 0.9)))  # marks left out
