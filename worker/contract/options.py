"""A job's options: what a submission may ask for, the values each accepts, the checks at the door.

Light on purpose (no torch, no FastAPI). Each list of allowed values is written once, as a
`Literal` alias: the models below validate against it, OpenAPI shows it, and anyone else who
needs the list (the CLI's choices) reads it with `values()`. `JobCreate` is what a submission
carries; `JobOptions`, its part that is stored on the record, passed to the worker and kept in
the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from worker.contract.languages import LANGUAGES
from worker.contract.settings import Settings

Task = Literal["transcribe", "translate"]
Mode = Literal["sequential", "chunked"]
Priority = Literal["interactive", "bulk"]
InputKind = Literal["audio", "spectrogram"]

# Whisper keeps only the prompt's last 223 tokens; this bounds what a client may send
PROMPT_MAX_CHARS = 1024
SEED_LIMIT = 2**63  # seeds fit a signed 64-bit integer (the engine's, engine.sampling)
MAX_SPEAKERS = 32  # speakers a job may name (a range's upper end included)


def values(alias: Any) -> tuple[str, ...]:
    """The values of a `Literal` alias, in the order written: `values(Task)`."""
    return get_args(alias)


class OptionError(ValueError):
    """A submission the server refuses; `code` is the API's error code for it, `status` the
    HTTP status it answers with."""

    def __init__(self, code: str, message: str, status: int = 422):
        super().__init__(message)
        self.code, self.status = code, status


class JobOptions(BaseModel):
    """How a job is transcribed: stored on its record, passed to the worker, kept in its result.

    Keys it does not know are ignored, so results stored by earlier versions still load.
    """

    language: str | None = Field(
        None,
        description="ISO 639-1 code of the spoken language; omitted: detected (multilingual "
        "models)",
    )
    task: Task = Field(
        "transcribe", description="transcribe, or translate into English (multilingual models)"
    )
    mode: Mode = Field(
        "sequential",
        description="for long audio: sequential (Whisper's seek over 30 s windows, each "
        "conditioned on the text before) or chunked (independent windows cut at quiet moments, "
        "decoded together: faster, slightly less accurate)",
    )
    prompt: str | None = Field(
        None,
        max_length=PROMPT_MAX_CHARS,
        description="text as if it preceded the audio: names, spellings, style",
    )
    timestamps: bool = Field(
        True, description="segment timestamps; without them each 30 s window is one segment"
    )
    word_timestamps: bool = Field(
        False,
        description="each word's start and end (`words` in the result), from the attention of "
        "the model's alignment heads: one more decoder pass a window for the jobs that ask",
    )
    vad: bool | None = Field(
        None,
        description="voice activity (Silero VAD): stretches without speech are not decoded, "
        "chunked windows are cut at silences, and a segment with no speech under it is "
        "dropped (what Whisper makes up in silence, noise or music); omitted: on for chunked "
        "audio over 30 s and jobs with diarize; off in sequential mode, where the speech Silero "
        "misses (quiet voices) costs more than the silences it skips, for short clips, and "
        "for spectrograms, which have no audio",
    )
    hallucination_silence_threshold: float | None = Field(
        None,
        ge=0,
        le=60,
        description="sequential mode: a segment that looks made up (improbable, too short or "
        "too long words) with at least this many seconds of silence before and after it is "
        "dropped and the silence skipped, as openai-whisper's option of the same name; turns "
        "word timestamps on; omitted: off",
    )
    diarize: bool = Field(
        False,
        description="who spoke when: each segment and word gets a `speaker` (SPEAKER_00, "
        "SPEAKER_01, ... in order of first appearance), a segment is split where the speaker "
        "changes, and the result lists `speakers` with their talk time; turns word "
        "timestamps on; needs audio",
    )
    speakers: int | None = Field(
        None,
        ge=1,
        le=MAX_SPEAKERS,
        description="with diarize: how many speakers there are, if known; omitted: found",
    )
    min_speakers: int | None = Field(
        None, ge=1, le=MAX_SPEAKERS, description="with diarize: at least this many speakers"
    )
    max_speakers: int | None = Field(
        None, ge=1, le=MAX_SPEAKERS, description="with diarize: at most this many speakers"
    )
    temperature: float | None = Field(
        None,
        ge=0,
        le=1,
        description="the first temperature of Whisper's fallback schedule (0, 0.2, ... 1): a "
        "window is decoded again hotter while its text looks wrong; omitted: 0 (greedy "
        "first); higher: sampled from the start",
    )
    seed: int | None = Field(
        None,
        ge=0,
        lt=SEED_LIMIT,
        description="for sampling (the windows temperature fallback decodes again): the same "
        "audio, options and seed give the same text on any worker and in any batch; omitted: "
        "derived from the audio's bytes and the other options (the result gives it)",
    )

    @field_validator("language")
    @classmethod
    def _known_language(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.lower() not in LANGUAGES:
            raise ValueError(f"language {value!r}: expected an ISO 639-1 code (en, de, fr, ...)")
        return value.lower()

    @model_validator(mode="after")
    def _speaker_count(self) -> JobOptions:
        counts = {
            name: value
            for name in ("speakers", "min_speakers", "max_speakers")
            if (value := getattr(self, name)) is not None
        }
        if counts and not self.diarize:
            raise ValueError(f"{', '.join(counts)}: only with diarize=true")
        if self.speakers is not None and len(counts) > 1:
            raise ValueError("speakers, or min_speakers / max_speakers: not both")
        if (self.min_speakers or 1) > (self.max_speakers or MAX_SPEAKERS):
            raise ValueError(
                f"min_speakers {self.min_speakers} is more than max_speakers {self.max_speakers}"
            )
        return self


class JobCreate(JobOptions):
    """A submission: the job's options, plus which model runs it, how urgently, on what input.

    The one place a job's options and their allowed values live; new options go here.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="a model the server serves (see its configuration); omitted: its default"
    )
    priority: Priority = Field(
        "interactive", description="interactive, or bulk: queued behind interactive work"
    )
    input: InputKind | None = Field(
        None, description="what the file holds; omitted: recognised from its first bytes"
    )
    webhook: str | None = Field(
        None,
        max_length=2048,
        description="an http(s) URL posted the job's record, signed, when the job ends "
        "(docs/api.md, Webhooks); private and loopback addresses are refused",
    )
    # how a caller takes back a translation an English-only model cannot make, in the words
    # of the route that was asked (an OpenAI translations route has no task to drop)
    _undo_translate: str = PrivateAttr("drop task=translate")

    @field_validator("webhook")
    @classmethod
    def _web_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = urlsplit(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"webhook {value[:80]!r}: expected an http:// or https:// URL")
        if url.username or url.password:
            raise ValueError(
                "webhook: credentials in the URL are not allowed; verify the signature instead"
            )
        return value

    @classmethod
    def parse(cls, fields: Mapping[str, Any]) -> JobCreate:
        """Validate submitted fields; OptionError names the first one refused, in words."""
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            raise _refusal(e.errors()[0]) from e

    def resolve(self, settings: Settings, kind: InputKind | None) -> JobCreate:
        """This job as the server will run it: its model named and served, options that model
        can honour, its input the `kind` found in the file. Refuses at the door what the worker
        would only fail later."""
        model = self.model or settings.default_model
        if model not in settings.models:
            available = ", ".join(settings.models)
            raise OptionError("unknown_model", f"unknown model {model!r}; available: {available}")
        if settings.english_only(model):
            multilingual = ", ".join(m for m in settings.models if not settings.english_only(m))
            instead = f", or choose a multilingual model ({multilingual})" if multilingual else ""
            if self.task == "translate":
                raise OptionError(
                    "invalid_option",
                    f"model {model!r} is English-only and cannot translate: "
                    f"{self._undo_translate}{instead}",
                )
            if self.language not in (None, "en"):
                raise OptionError(
                    "invalid_option",
                    f"model {model!r} is English-only, but language={self.language}: drop "
                    f"language (or send en){instead}",
                )
        listens = [name for name in ("vad", "diarize") if getattr(self, name)]
        if listens and "spectrogram" in (kind, self.input):
            raise OptionError(
                "invalid_option",
                f"{' and '.join(listens)} need audio: a spectrogram has none to listen to",
            )
        if kind is None:  # the file is not here yet: what can be checked without it
            return self.model_copy(update={"model": model})
        if self.input is not None and self.input != kind:
            code = "invalid_spectrogram" if self.input == "spectrogram" else "invalid_audio"
            raise OptionError(code, f"declared input={self.input}, but the file is {kind}")
        return self.model_copy(update={"model": model, "input": kind})

    @property
    def options(self) -> JobOptions:
        """The part stored on the record and passed to the worker."""
        return JobOptions(**{name: getattr(self, name) for name in JobOptions.model_fields})


class SourceJob(JobCreate):
    """A submission whose input is already in object storage, as a JSON body."""

    source: str = Field(
        description="s3://bucket/key of the input, inside the sources the tenant may read",
        examples=["s3://archive/acme/call-0042.flac"],
    )


def _refusal(error: ErrorDetails) -> OptionError:
    """One of pydantic's errors about a submission as the API says it: the field, the value
    received, what was expected; unknown fields are `invalid_request`, bad values
    `invalid_option`."""
    field = ".".join(str(part) for part in error["loc"])
    value, ctx = error["input"], error.get("ctx", {})
    received = repr(value) if len(repr(value)) <= 40 else f"of {len(str(value))} characters"
    match error["type"]:
        case "extra_forbidden":
            known = ", ".join(JobCreate.model_fields)  # a source is named only in JSON
            return OptionError("invalid_request", f"unknown option {field!r}; expected {known}")
        case "value_error":  # our validators' own words, which name the value
            return OptionError("invalid_option", str(ctx["error"]))
        case "literal_error":
            expected = f"expected {ctx['expected']}"
        case "string_too_long":
            expected = f"expected at most {ctx['max_length']} characters"
        case "bool_parsing" | "bool_type":
            expected = "expected true or false"
        case "int_parsing" | "int_type" | "int_from_float":
            expected = "expected a whole number"
        case "greater_than_equal":
            expected = f"expected {ctx['ge']} or more"
        case "less_than_equal":
            expected = f"expected {ctx['le']} or less"
        case "less_than":
            expected = f"expected less than {ctx['lt']}"
        case _:
            expected = error["msg"]
    return OptionError("invalid_option", f"{field} {received}: {expected}")
