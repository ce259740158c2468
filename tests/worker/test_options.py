"""A submission's options: the values each accepts, and what the server refuses at the door."""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import STORED_OPTIONS
from worker.contract.jobs import QUEUES
from worker.contract.options import (
    MAX_SPEAKERS,
    PROMPT_MAX_CHARS,
    InputKind,
    JobCreate,
    JobOptions,
    Mode,
    OptionError,
    Priority,
    Task,
    values,
)
from worker.contract.settings import Settings

SERVED = Settings(models="tiny.en,base,small.en=/models/whisper-small.en")


def test_values_are_read_from_the_aliases_in_order():
    assert values(Task) == ("transcribe", "translate")
    assert QUEUES == values(Priority) == ("interactive", "bulk")


def test_defaults_and_the_options_part():
    job = JobCreate.parse({})
    assert job.model is None and job.priority == "interactive" and job.input is None
    assert job.options == JobOptions()
    assert job.options.model_dump() == STORED_OPTIONS


def test_form_strings_become_typed_values():
    job = JobCreate.parse({"language": "FR", "timestamps": "false", "mode": "chunked"})
    assert job.language == "fr" and job.timestamps is False and job.mode == "chunked"
    assert JobCreate.parse({"seed": str(2**63 - 1)}).options.seed == 2**63 - 1


@pytest.mark.parametrize(
    "fields, code, message",
    [
        ({"task": "summarize"}, "invalid_option", "task 'summarize': expected 'transcribe' or"),
        ({"priority": "urgent"}, "invalid_option", "priority 'urgent': expected 'interactive' or"),
        ({"language": "klingon"}, "invalid_option", "language 'klingon': expected an ISO 639-1"),
        ({"timestamps": "maybe"}, "invalid_option", "timestamps 'maybe': expected true or false"),
        (
            {"prompt": "x" * (PROMPT_MAX_CHARS + 1)},
            "invalid_option",
            f"prompt of {PROMPT_MAX_CHARS + 1} characters: expected at most {PROMPT_MAX_CHARS}",
        ),
        ({"seed": "-1"}, "invalid_option", "seed '-1': expected 0 or more"),
        ({"seed": str(2**63)}, "invalid_option", f"seed '{2**63}': expected less than {2**63}"),
        ({"seed": "0x1f"}, "invalid_option", "seed '0x1f': expected a whole number"),
        ({"langauge": "en"}, "invalid_request", "unknown option 'langauge'; expected language"),
        ({"vad": "sometimes"}, "invalid_option", "vad 'sometimes': expected true or false"),
        ({"speakers": "2"}, "invalid_option", "speakers: only with diarize=true"),
        (
            {"diarize": "true", "min_speakers": "2", "max_speakers": "3", "speakers": "2"},
            "invalid_option",
            "speakers, or min_speakers / max_speakers: not both",
        ),
        (
            {"diarize": "true", "min_speakers": "4", "max_speakers": "3"},
            "invalid_option",
            "min_speakers 4 is more than max_speakers 3",
        ),
        ({"diarize": "true", "speakers": "0"}, "invalid_option", "speakers '0': expected 1 or"),
        (
            {"diarize": "true", "max_speakers": "1000"},
            "invalid_option",
            f"max_speakers '1000': expected {MAX_SPEAKERS} or less",
        ),
    ],
)
def test_refusals_name_the_field_the_value_and_what_was_expected(fields, code, message):
    with pytest.raises(OptionError, match="^" + message) as refused:
        JobCreate.parse(fields)
    assert refused.value.code == code


def test_stored_options_ignore_keys_they_do_not_know():
    stored = {"task": "translate", "initial_prompt": None, "temperatures": [0.0, 0.2]}
    assert JobOptions.model_validate(stored).task == "translate"


def test_resolve_names_the_default_model_and_the_input_found():
    job = JobCreate.parse({"language": "en"}).resolve(SERVED, "audio")
    assert job.model == "tiny.en" and job.input == "audio"


@pytest.mark.parametrize(
    "fields, code, words",
    [
        ({"model": "large-v9"}, "unknown_model", ["'large-v9'", "tiny.en, base, small.en"]),
        ({"task": "translate"}, "invalid_option", ["English-only", "drop task=translate", "base"]),
        (
            {"model": "small.en", "language": "fr"},
            "invalid_option",
            ["'small.en' is English-only", "language=fr", "drop language"],
        ),
        ({"input": "spectrogram"}, "invalid_spectrogram", ["declared input=spectrogram"]),
    ],
)
def test_resolve_refuses_what_the_worker_would_fail(fields, code, words):
    with pytest.raises(OptionError) as refused:
        JobCreate.parse(fields).resolve(SERVED, "audio")
    assert refused.value.code == code
    for word in words:
        assert word in str(refused.value)


@pytest.mark.parametrize("fields", [{"vad": "true"}, {"diarize": "true", "speakers": "2"}])
@pytest.mark.parametrize("declared, found", [("spectrogram", None), (None, "spectrogram")])
def test_voice_options_are_refused_for_a_spectrogram(fields, declared, found):
    """Speech is found in audio: a spectrogram job asking for it is refused at the door,
    whether it says it is one or its file shows it."""
    job = JobCreate.parse({**fields, **({"input": declared} if declared else {})})
    with pytest.raises(OptionError, match="need audio: a spectrogram has none") as refused:
        job.resolve(SERVED, found)
    assert refused.value.code == "invalid_option"
    assert JobCreate.parse(fields).resolve(SERVED, "audio").input == "audio"


def test_a_multilingual_model_translates_any_language():
    job = JobCreate.parse({"model": "base", "language": "fr", "task": "translate"})
    assert job.resolve(SERVED, "audio").options.task == "translate"


def _listed(tree: ast.AST) -> Iterator[ast.AST]:
    """The members written in each tuple, list, set, dict's keys or subscript."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            yield from node.elts
        elif isinstance(node, ast.Dict):
            yield from (k for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            yield node.slice


def test_option_values_are_listed_only_in_their_aliases():
    """No other list of the values in the API or the worker (the CLI's choices included): a new
    value is added once. (The engine, which may not import the worker, implements them; a
    test in tests/test_layers.py keeps the two in step.)"""
    root = Path(__file__).parents[2]
    options = root / "worker/contract/options.py"
    sources = sorted([*root.glob("api/**/*.py"), *root.glob("worker/**/*.py")])
    aliases = {"Task": Task, "Mode": Mode, "Priority": Priority, "InputKind": InputKind}
    alias_of = {value: name for name, alias in aliases.items() for value in values(alias)}
    listed = [
        (member.value, path, member.lineno)
        for path in sources
        for member in _listed(ast.parse(path.read_text()))
        if isinstance(member, ast.Constant) and member.value in alias_of
    ]
    lines = options.read_text().splitlines()
    for value, path, line in listed:
        assert path == options, f"{value!r} listed again at {path.relative_to(root)}:{line}"
        assert lines[line - 1].startswith(f"{alias_of[value]} = Literal["), (value, line)
    assert sorted(value for value, _, _ in listed) == sorted(alias_of)  # each once
    # nor named at all outside the options module, as the issue asks
    for value in ("sequential", "chunked", "translate", "bulk"):
        quoted = re.compile(rf"[\"']{value}[\"']")
        found = [p.name for p in sources if p != options and quoted.search(p.read_text())]
        assert not found, f"{value!r} spelled out in {found}"
