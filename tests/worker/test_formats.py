import json

import pytest

from tests.conftest import STORED_OPTIONS
from worker.contract.formats import WRITERS, GranularityError, format_timestamp
from worker.contract.results import TranscriptResult

# as stored: the fields in TranscriptResult's order, every job option
STORED = {
    "text": "Hello there. General Kenobi.",
    "language": "en",
    "language_probability": None,
    "duration": 3725.5,
    "segments": [
        {
            "id": 0,
            "start": 0.0,
            "end": 1.5,
            "text": " Hello there.",
            "tokens": [1, 2],
            "avg_logprob": -0.2,
            "compression_ratio": 1.1,
            "no_speech_prob": 0.01,
            "temperature": 0.0,
        },
        {
            "id": 1,
            "start": 3661.005,
            "end": 3725.5,
            "text": " General Kenobi.",
            "tokens": [3],
            "avg_logprob": -0.3,
            "compression_ratio": 1.1,
            "no_speech_prob": 0.02,
            "temperature": 0.2,
        },
    ],
    "model": "tiny.en",
    "options": STORED_OPTIONS,
    "seed": 1234567890123,
}
RESULT = TranscriptResult.model_validate(STORED)


@pytest.mark.parametrize(
    "seconds, kwargs, expected",
    [
        (0.0, {}, "00:00.000"),
        (12.3456, {}, "00:12.346"),
        (3661.005, {}, "01:01:01.005"),
        (1.5, {"decimal": ",", "always_hours": True}, "00:00:01,500"),
    ],
)
def test_format_timestamp(seconds, kwargs, expected):
    assert format_timestamp(seconds, **kwargs) == expected


def test_srt():
    assert WRITERS["srt"].render(RESULT) == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
        "2\n01:01:01,005 --> 01:02:05,500\nGeneral Kenobi.\n"
    )


def test_vtt():
    assert WRITERS["vtt"].render(RESULT) == (
        "WEBVTT\n\n00:00.000 --> 00:01.500\nHello there.\n\n"
        "01:01:01.005 --> 01:02:05.500\nGeneral Kenobi.\n"
    )


def test_text_and_json():
    assert WRITERS["text"].render(RESULT) == "Hello there. General Kenobi.\n"
    assert WRITERS["json"].render(RESULT) == json.dumps(STORED, ensure_ascii=False)


def test_results_stored_with_other_option_keys_still_load():
    before_seeds = {key: value for key, value in STORED.items() if key != "seed"}
    earlier = {**before_seeds, "options": {"task": "translate", "initial_prompt": None, "beam": 1}}
    result = TranscriptResult.model_validate_json(json.dumps(earlier))
    assert result.options.task == "translate" and result.options.timestamps is True
    assert result.seed is None and result.options.seed is None
    assert json.loads(WRITERS["verbose_json"].render(result))["task"] == "translate"


def test_verbose_json_is_openais_shape():
    body = json.loads(WRITERS["verbose_json"].render(RESULT))
    assert body["task"] == "transcribe" and body["language"] == "english"
    assert body["duration"] == 3725.5 and body["text"] == RESULT.text
    assert set(body["segments"][1]) == {
        "id",
        "seek",
        "start",
        "end",
        "text",
        "tokens",
        "temperature",
        "avg_logprob",
        "compression_ratio",
        "no_speech_prob",
    }


def with_words() -> TranscriptResult:
    """RESULT as a job run with word_timestamps stores it: words per segment and in all."""
    words = [
        [(" Hello", 0.0, 0.6, 0.9), (" there.", 0.6, 1.5, 0.8)],
        [(" General", 3661.005, 3662.2, 0.7), (" Kenobi.", 3662.2, 3663.0, 0.5)],
    ]
    timed = [
        [dict(zip(("word", "start", "end", "probability"), w, strict=False)) for w in s]
        for s in words
    ]
    stored = {
        **STORED,
        "segments": [{**s, "words": w} for s, w in zip(STORED["segments"], timed, strict=False)],
        "words": [w for s in timed for w in s],
        "options": {**STORED["options"], "word_timestamps": True},
    }
    return TranscriptResult.model_validate_json(json.dumps(stored))


def test_a_result_without_words_is_stored_without_the_keys():
    """Results of jobs that did not ask are stored as before word timestamps existed."""
    stored = json.loads(WRITERS["json"].render(RESULT))
    assert "words" not in stored and all("words" not in s for s in stored["segments"])


def test_words_in_json_and_verbose_json():
    result = with_words()
    stored = json.loads(WRITERS["json"].render(result))
    assert [w["word"] for w in stored["words"]] == [" Hello", " there.", " General", " Kenobi."]
    assert stored["segments"][1]["words"][0] == {
        "word": " General",
        "start": 3661.005,
        "end": 3662.2,
        "probability": 0.7,
    }
    verbose = json.loads(WRITERS["verbose_json"].render(result))
    assert verbose["words"] == stored["words"]  # OpenAI's top-level words
    assert [len(s["words"]) for s in verbose["segments"]] == [2, 2]


def test_subtitles_a_cue_per_word():
    result = with_words()
    srt = WRITERS["srt"].render(result, "word")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:00,600\nHello\n\n2\n")
    assert "4\n01:01:02,200 --> 01:01:03,000\nKenobi.\n" in srt
    vtt = WRITERS["vtt"].render(result, "word")
    assert vtt.count(" --> ") == 4 and "01:01:01.005 --> 01:01:02.200\nGeneral\n" in vtt
    assert WRITERS["srt"].render(result) == WRITERS["srt"].render(RESULT)  # segments by default


@pytest.mark.parametrize("fmt", ["json", "verbose_json", "text"])
def test_word_cues_only_in_subtitles(fmt):
    with pytest.raises(GranularityError, match="srt and vtt only"):
        WRITERS[fmt].render(with_words(), "word")


def test_word_cues_need_a_job_run_with_word_timestamps():
    with pytest.raises(GranularityError, match="word_timestamps"):
        WRITERS["vtt"].render(RESULT, "word")


def with_speakers() -> TranscriptResult:
    """with_words() as a job run with diarize stores it: three segments (the second cut where
    the speaker changed), each word and segment with its speaker, the speakers listed."""
    stored = json.loads(WRITERS["json"].render(with_words()))
    hello, general = stored["segments"]
    one = {**hello, "speaker": "SPEAKER_00"}
    one["words"] = [{**w, "speaker": "SPEAKER_00"} for w in hello["words"]]
    two = {**general, "id": 1, "end": 3662.2, "text": " General", "speaker": "SPEAKER_01"}
    two["words"] = [{**general["words"][0], "speaker": "SPEAKER_01"}]
    three = {**general, "id": 2, "start": 3662.2, "text": " Kenobi.", "speaker": "SPEAKER_01"}
    three["words"] = [{**general["words"][1], "speaker": "SPEAKER_01"}]
    stored["segments"] = [one, two, three]
    stored["words"] = [w for s in stored["segments"] for w in s["words"]]
    stored["speakers"] = [
        {"speaker": "SPEAKER_00", "talk_time": 1.5},
        {"speaker": "SPEAKER_01", "talk_time": 2.0},
    ]
    stored["options"] = {**stored["options"], "diarize": True, "speakers": 2}
    return TranscriptResult.model_validate_json(json.dumps(stored))


def test_speakers_in_subtitles_text_and_json():
    result = with_speakers()
    srt = WRITERS["srt"].render(result)
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\n[SPEAKER_00] Hello there.\n\n2\n")
    assert "[SPEAKER_01] General\n" in srt and "[SPEAKER_01] Kenobi.\n" in srt
    vtt = WRITERS["vtt"].render(result)
    assert "00:00.000 --> 00:01.500\n<v SPEAKER_00>Hello there.\n" in vtt
    assert "<v SPEAKER_01>General\n" in WRITERS["vtt"].render(result, "word")
    # text: a line a turn, the two segments of the second speaker's one turn joined
    assert WRITERS["text"].render(result) == (
        "SPEAKER_00: Hello there.\nSPEAKER_01: General Kenobi.\n"
    )
    stored = json.loads(WRITERS["json"].render(result))
    assert stored["speakers"][1] == {"speaker": "SPEAKER_01", "talk_time": 2.0}
    assert [s["speaker"] for s in stored["segments"]] == ["SPEAKER_00", *["SPEAKER_01"] * 2]
    assert stored["words"][2] == {**stored["segments"][1]["words"][0], "speaker": "SPEAKER_01"}
    verbose = json.loads(WRITERS["verbose_json"].render(result))
    assert [s["speaker"] for s in verbose["segments"]] == ["SPEAKER_00", *["SPEAKER_01"] * 2]


def test_a_result_without_speakers_is_stored_without_the_keys():
    stored = json.loads(WRITERS["json"].render(with_words()))
    assert "speakers" not in stored and all("speaker" not in s for s in stored["segments"])
    assert all("speaker" not in w for w in stored["words"])
    assert "SPEAKER" not in WRITERS["text"].render(with_words())
