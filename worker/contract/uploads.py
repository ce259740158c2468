"""Recognise an upload from its first bytes, before any decoding.

Light on purpose: the API uses it to refuse non-audio and malformed spectrograms cheaply;
the worker decodes and validates everything again, for real.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.contract.options import InputKind, OptionError
from worker.contract.settings import FRAMES_PER_SECOND

EXPECTED = "expected WAV, FLAC, OGG, MP3, M4A/AAC, MP4 or WebM audio, or a .npy spectrogram"


@dataclass(frozen=True)
class Sniffed:
    format: str | None  # wav, flac, ogg, mp3, mp4, webm, aac, npy; None when unrecognised
    supported: bool

    @property
    def kind(self) -> InputKind:
        return "spectrogram" if self.format == "npy" else "audio"


def sniff(head: bytes) -> Sniffed:
    """Name the container from at least the first 12 bytes of a file."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return Sniffed("wav", True)
    if head[:4] == b"fLaC":
        return Sniffed("flac", True)
    if head[:4] == b"OggS":
        return Sniffed("ogg", True)
    if head[:3] == b"ID3":
        return Sniffed("mp3", True)
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # MPEG audio frame sync: layer bits 00 mean ADTS AAC, anything else MPEG layer I-III
        return Sniffed("mp3" if head[1] & 0x06 else "aac", True)
    if head[:6] == b"\x93NUMPY":
        return Sniffed("npy", True)
    if head[4:8] == b"ftyp":
        return Sniffed("mp4", True)
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return Sniffed("webm", True)
    return Sniffed(None, False)


# --- NumPy .npy spectrograms, read without NumPy (the API must stay light) -------------------

SPECTROGRAM_FORMS = (
    "expected a .npy float16/32/64 array of shape [n_mels, 3000] or [1, n_mels, 3000] "
    "(one 30 s window, as WhisperFeatureExtractor returns), or [n_mels, T] / [1, n_mels, T] "
    "with T > 3000 (longer audio, truncation=False); n_mels is 80, or 128 for large-v3"
)
# exponent bytes of each little-endian float: a value is NaN or infinite iff every
# (byte, mask) pair has all its mask bits set
_EXPONENT = {
    "<f2": (2, ((1, 0x7C),)),
    "<f4": (4, ((3, 0x7F), (2, 0x80))),
    "<f8": (8, ((7, 0x7F), (6, 0xF0))),
}
_FLAG = {
    mask: bytes(1 if b & mask == mask else 0 for b in range(256))
    for _, m in _EXPONENT.values()
    for _, mask in m
}


class SpectrogramHeaderError(ValueError):
    pass


@dataclass(frozen=True)
class NpyHeader:
    dtype: str  # "<f2", "<f4" or "<f8"
    shape: tuple[int, ...]
    offset: int  # where the data starts

    @property
    def itemsize(self) -> int:
        return _EXPONENT[self.dtype][0]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def frames(self) -> int:
        return self.shape[-1]


NPY_HEADER_MAX = 10_000  # bytes before the data; numpy's reader refuses more, ours are 128
_NPY_KEYS = {"descr", "fortran_order", "shape"}
_MAX_DIM = 2**63  # numpy's dimensions are signed 64-bit


def npy_header_length(head: bytes) -> int | None:
    """Bytes up to the end of the .npy header, once the first 12 are known: 10 + a 2-byte
    length in version 1, 12 + a 4-byte length in versions 2 and 3."""
    if len(head) < 12:
        return None
    if head[6] == 1:
        return 10 + int.from_bytes(head[8:10], "little")
    return 12 + int.from_bytes(head[8:12], "little")


def _shown(value: object) -> str:
    """A value from a client's header, as it wrote it, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def parse_npy_header(head: bytes) -> NpyHeader:
    """Check a .npy header describes a spectrogram; `head` holds at least the whole header.

    Strict where numpy is lenient, so that what passes here is what the worker reads: exactly
    numpy's three keys, `shape` a tuple of plain ints (not bools, not floats), `fortran_order`
    a bool; the length is capped before the header is parsed."""
    import ast

    cut_short = SpectrogramHeaderError(f"the .npy header is cut short; {SPECTROGRAM_FORMS}")
    if len(head) < 12:
        raise cut_short
    if head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
        raise SpectrogramHeaderError(f"not a .npy file of version 1, 2 or 3; {SPECTROGRAM_FORMS}")
    length = npy_header_length(head)
    if length > NPY_HEADER_MAX:
        raise SpectrogramHeaderError(
            f"a .npy header of {length} bytes; at most {NPY_HEADER_MAX}; {SPECTROGRAM_FORMS}"
        )
    if len(head) < length:
        raise cut_short
    try:
        fields = ast.literal_eval(head[10 if head[6] == 1 else 12 : length].decode("latin1"))
    # MemoryError and RecursionError: how Python's parser refuses deep nesting ("-" * 5000)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise SpectrogramHeaderError(
            f"the .npy header is not a Python literal; {SPECTROGRAM_FORMS}"
        ) from e
    if not isinstance(fields, dict) or set(fields) != _NPY_KEYS:
        raise SpectrogramHeaderError(
            f"the .npy header is not a dict of descr, fortran_order and shape; {SPECTROGRAM_FORMS}"
        )
    dtype, shape, fortran = fields["descr"], fields["shape"], fields["fortran_order"]
    if not isinstance(dtype, str) or dtype not in _EXPONENT:
        raise SpectrogramHeaderError(f"dtype {_shown(dtype)}; {SPECTROGRAM_FORMS}")
    if type(fortran) is not bool:
        raise SpectrogramHeaderError(f"fortran_order {_shown(fortran)}: expected True or False")
    if fortran:
        raise SpectrogramHeaderError(f"a Fortran-ordered array; {SPECTROGRAM_FORMS} (C order)")
    if type(shape) is not tuple or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        raise SpectrogramHeaderError(
            f"shape {_shown(shape)}: expected a tuple of whole numbers from 0 to 2**63 - 1; "
            f"{SPECTROGRAM_FORMS}"
        )
    core = shape[1:] if len(shape) == 3 and shape[0] == 1 else shape
    if len(core) != 2 or core[0] not in (80, 128) or core[1] < 3000:
        raise SpectrogramHeaderError(f"shape {_shown(list(shape))}; {SPECTROGRAM_FORMS}")
    return NpyHeader(dtype, shape, length)


# --- What the first bytes of an upload say ----------------------------------------------------

HEAD_BYTES = 64 * 1024  # the most of an upload held to read its header
# a WAV `data` size that says nothing: 0, or what ffmpeg (0xFFFFFFFF) and SoX (0x7FFFF000) write
# where they cannot seek back to fill it in (a pipe)
_WAV_UNKNOWN = 0x7FFFF000


@dataclass(frozen=True)
class Head:
    sniffed: Sniffed
    npy: NpyHeader | None = None
    duration_s: float | None = None  # the length the header declares, where it declares one


def read_head(head: bytes, complete: bool) -> Head | int:
    """What `head`, the first bytes of an upload, says about it; or, while it cannot tell yet,
    how many bytes it needs. `complete`: no more will come (`head` is the whole file, or
    HEAD_BYTES of it), so tell now. Headers only, nothing decoded: a .npy's shape, a WAV's
    `fmt ` and `data` chunks, a FLAC's STREAMINFO. Raises SpectrogramHeaderError for a bad .npy
    header."""
    if len(head) < 12 and not complete:
        return 12
    sniffed = sniff(head)
    if sniffed.format == "npy":
        length = npy_header_length(head)
        if length is not None and len(head) < length <= NPY_HEADER_MAX and not complete:
            return length
        npy = parse_npy_header(head)
        return Head(sniffed, npy, npy.frames / FRAMES_PER_SECOND)
    if sniffed.format == "wav":
        return _wav(head, complete, sniffed)
    if sniffed.format == "flac":
        if len(head) < 26:
            return Head(sniffed) if complete else 26
        # the first block is STREAMINFO (type 0, 34 bytes); from its 10th byte: 20 bits of
        # sample rate, 3 of channels, 5 of bits per sample, 36 of samples (0: not known)
        if head[4] & 0x7F != 0 or int.from_bytes(head[5:8], "big") != 34:
            return Head(sniffed)
        bits = int.from_bytes(head[18:26], "big")
        rate, samples = bits >> 44, bits & (2**36 - 1)
        return Head(sniffed, duration_s=samples / rate if rate and samples else None)
    return Head(sniffed)


def _wav(head: bytes, complete: bool, sniffed: Sniffed) -> Head | int:
    """A RIFF WAVE's length from its `fmt ` chunk's byte rate and its `data` chunk's size."""
    at, byte_rate = 12, 0
    while True:
        if len(head) < at + 8:
            return Head(sniffed) if complete else at + 8
        chunk, size = head[at : at + 4], int.from_bytes(head[at + 4 : at + 8], "little")
        if chunk == b"fmt ":
            if len(head) < at + 20:
                return Head(sniffed) if complete else at + 20
            byte_rate = int.from_bytes(head[at + 16 : at + 20], "little")
        elif chunk == b"data":
            known = byte_rate and 0 < size < _WAV_UNKNOWN
            return Head(sniffed, duration_s=size / byte_rate if known else None)
        at += 8 + size + size % 2


def all_finite(data: bytes, dtype: str) -> bool:
    """True if no value in `data` (whole little-endian floats) is NaN or infinite."""
    size, parts = _EXPONENT[dtype]
    flags = None
    for index, mask in parts:
        f = int.from_bytes(data[index::size].translate(_FLAG[mask]), "big")
        flags = f if flags is None else flags & f
    return not flags


class Inspector:
    """Looks at a file as it streams in (an upload), or at the first bytes of one already
    stored (a source, a backfill's object), to the same verdict however it is chunked: the
    first bytes name its kind (non-audio is refused at once), its length where its header
    says it (longer than `max_audio_s`: too_long), and a .npy spectrogram's shape; the
    spectrogram's values are checked as they pass. A refusal is an OptionError whose status
    is the API's (413 too_large, else 422)."""

    def __init__(self, max_bytes: int, max_audio_s: float):
        self.max_bytes, self.max_audio_s = max_bytes, max_audio_s
        self.head = bytearray()  # the first bytes, until they are read
        self.need = 0  # bytes `head` must hold before it is read again
        self.found: Head | None = None
        self.carry = b""  # a float split across chunks
        self.size = 0

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise OptionError(
                "too_large", f"the file is over the limit of {self.max_bytes} bytes", status=413
            )
        if self.found is None:
            kept = HEAD_BYTES - len(self.head)
            self.head += data[:kept]
            if len(self.head) < min(self.need, HEAD_BYTES) or not self._read(
                complete=len(self.head) == HEAD_BYTES
            ):
                return
            data = self._held() + data[kept:]
        self._check(data)

    def _held(self) -> bytes:
        """The file's bytes held in `head` past the .npy header, once read; `head` let go."""
        npy, head, self.head = self.found.npy, self.head, bytearray()
        return bytes(head[npy.offset :]) if npy else b""

    def _check(self, data: bytes) -> None:
        """The next bytes of a .npy spectrogram's values, in any chunk: finite, and no more
        than the header describes."""
        npy = self.found.npy
        if npy is None:
            return
        if self.size > npy.offset + npy.nbytes:
            raise OptionError(
                "invalid_spectrogram",
                f"more bytes than the .npy header describes ({npy.offset + npy.nbytes}); "
                f"{SPECTROGRAM_FORMS}",
            )
        data = self.carry + data
        whole = len(data) - len(data) % npy.itemsize
        if not all_finite(data[:whole], npy.dtype):
            raise OptionError("invalid_spectrogram", f"NaN or infinite values; {SPECTROGRAM_FORMS}")
        self.carry = data[whole:]

    def _read(self, complete: bool) -> bool:
        """Read `head`; False while it needs more bytes."""
        try:
            found = read_head(bytes(self.head), complete)
        except SpectrogramHeaderError as e:
            raise OptionError("invalid_spectrogram", str(e)) from e
        if isinstance(found, int):  # at least twice what it holds: a header read a few times
            self.need = max(found, 2 * len(self.head))
            return False
        if not found.sniffed.supported:
            what = found.sniffed.format
            kind = f"a {what.upper()} file" if what else "not audio"
            raise OptionError("invalid_audio", f"the file is {kind}; {EXPECTED}")
        if found.duration_s is not None and found.duration_s > self.max_audio_s:
            raise OptionError("too_long", _too_long(found, self.max_audio_s))
        npy = found.npy
        if npy is not None and npy.offset + npy.nbytes > self.max_bytes:
            raise OptionError(
                "too_large",
                f"the .npy header describes {npy.offset + npy.nbytes} bytes; the limit is "
                f"{self.max_bytes}",
                status=413,
            )
        self.found = found
        return True

    def judge(self, head: bytes, size: int) -> Head:
        """The verdict on an object already stored, from its first bytes and its size."""
        if size > self.max_bytes:
            raise OptionError(
                "too_large", f"the file is over the limit of {self.max_bytes} bytes", status=413
            )
        self.feed(head)
        self.size = size
        self.carry = b""  # values past `head` are the worker's to check
        if self.found is None:
            self._read(complete=True)
        npy = self.found.npy
        if npy is not None and size != npy.offset + npy.nbytes:
            raise OptionError(
                "invalid_spectrogram",
                f"{size} bytes, but the .npy header describes {npy.offset + npy.nbytes}; "
                f"{SPECTROGRAM_FORMS}",
            )
        return self.found

    def finish(self) -> Head:
        if self.size == 0:
            raise OptionError("invalid_audio", f"the file is empty; {EXPECTED}")
        if self.found is None:
            self._read(complete=True)
            self._check(self._held())
        npy = self.found.npy
        if npy is not None and self.size != npy.offset + npy.nbytes:
            raise OptionError(
                "invalid_spectrogram",
                f"{self.size} bytes, but the .npy header describes {npy.offset + npy.nbytes}; "
                f"the file is truncated; {SPECTROGRAM_FORMS}",
            )
        return self.found


def _too_long(found: Head, max_audio_s: float) -> str:
    limit = f"the limit is {max_audio_s:g} s"
    if found.npy is not None:
        frames = found.npy.frames
        return (
            f"the spectrogram has {frames} frames ({found.duration_s:g} s); {limit} "
            f"({int(max_audio_s * FRAMES_PER_SECOND)} frames)"
        )
    return f"the {found.sniffed.format.upper()} header says {found.duration_s:.1f} s; {limit}"
