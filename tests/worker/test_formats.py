import json

import pytest

from worker.contract.formats import WRITERS, format_timestamp
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
    "options": {
        "language": None,
        "task": "transcribe",
        "mode": "sequential",
        "prompt": None,
        "timestamps": True,
        "temperature": None,
        "seed": None,
    },
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
