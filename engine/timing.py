"""Word timestamps from the cross-attention of finished windows: openai-whisper's method, run
for many windows in one pass.

A few cross-attention heads of a Whisper decoder follow the speech closely, its alignment heads
(listed in the model's `generation_config.json`; for a model without a list, every head of the
upper half of the layers, as openai-whisper does). Once a window is decoded, one more decoder
pass over its text (no timestamp tokens), on the cross-attention K/V that its slot still holds,
gives those heads' weights for each token. Normalised over the tokens, median-filtered along
time and averaged over the heads, they make a token-by-time cost whose cheapest monotonic path
(dynamic time warping) says where each token starts. Tokens join into words and punctuation
into the word beside it; words longer than plausible are cut back at sentence and segment
boundaries.

Windows that do not ask pay nothing: the pass runs, outside the CUDA graphs, only for the
windows of inputs that ask, after their last decode step and before their slots are freed.
It is launched and not waited for (`Aligner.launch`): the stream reads the times back a step
later, once the next decode step is launched behind it, so the host does not wait for the
device between the two (for tiny.en a pass cost some 8 ms of the stepping thread, most of
it waiting).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from engine.kernels.dtw import host_paths, search, walked_back
from engine.kernels.median import median_filter
from engine.loader import LoadedModel
from engine.mel import FRAMES_PER_SECOND
from engine.model import CrossWeights, KVCache
from engine.result import Segment, Word
from engine.tokenizer import Tokenizer

MEDIAN_FILTER_WIDTH = 7
PASS_BYTES = 512 * 1024**2  # attention weights one alignment pass may hold (windows at once)
PROMPT = 4  # tokens before a window's text in the pass: sot, language, task, notimestamps
TOKENS_PER_SECOND = FRAMES_PER_SECOND // 2  # encoder positions a second (20 ms each)
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = ".。!！?？"
NO_SPACES = {"zh", "ja", "th", "lo", "my", "yue"}  # words split at characters instead


def alignment_heads(loaded: LoadedModel) -> dict[int, list[int]]:
    """layer -> its alignment heads: the model's own list, else every head of the upper half
    of the layers."""
    config = loaded.path / "generation_config.json"
    pairs = json.loads(config.read_text()).get("alignment_heads") if config.exists() else None
    d = loaded.dims
    if not pairs:
        half = range(d.n_text_layer // 2, d.n_text_layer)
        pairs = [(layer, head) for layer in half for head in range(d.n_text_head)]
    heads: dict[int, list[int]] = {}
    for layer, head in pairs:
        heads.setdefault(int(layer), []).append(int(head))
    return dict(sorted(heads.items()))


@dataclass(frozen=True)
class Aligned:
    """A finished window to time: its slot (holding its cross-attention K/V), text tokens
    (below end-of-text), language and task, and frames of content."""

    slot: int
    tokens: list[int]
    language: str
    task: str
    n_frames: int


@dataclass(frozen=True)
class TokenTimes:
    """When each text token of a window starts (seconds from the window's start; one more
    entry: when the text ends) and how probable it was."""

    starts: np.ndarray  # (n_tokens + 1,)
    probabilities: np.ndarray  # (n_tokens,)

    @classmethod
    def of(cls, path: tuple[np.ndarray, np.ndarray], probabilities: np.ndarray) -> TokenTimes:
        """From the path through (text tokens + end-of-text) x frames: a token starts where
        the path first enters its row."""
        rows, frames = path
        entered = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
        return cls(frames[entered] / TOKENS_PER_SECOND, probabilities)


@dataclass(frozen=True)
class WordTiming:
    word: str
    tokens: list[int]
    start: float  # seconds from the window's start
    end: float
    probability: float


class Aligner:
    """Times the words of finished windows of one model."""

    def __init__(self, loaded: LoadedModel, triton: bool = False):
        self.m, self.triton = loaded, triton  # triton: the path search in one kernel a pass
        self.heads = alignment_heads(loaded)

    @torch.inference_mode()
    def launch(self, cache: KVCache, windows: list[Aligned]) -> PendingTimes:
        """Launch the windows' passes, as many at once as `PASS_BYTES` allows; their times
        come back through `PendingTimes.result`. What the passes read of `cache` is copied
        when they are launched: the windows' slots may take other windows after."""
        todo = [i for i, w in enumerate(windows) if w.tokens]
        d = self.m.dims
        n_heads = sum(map(len, self.heads.values()))
        longest = PROMPT + max((len(windows[i].tokens) for i in todo), default=0)
        # in float: the heads' products, two copies of them while they are weighed, and a
        # layer's attention in the decoder pass
        per_window = 4 * (3 * n_heads + d.n_text_head) * longest * d.n_audio_ctx
        group = max(1, PASS_BYTES // per_window)
        passes = []
        for at in range(0, len(todo), group):
            part = todo[at : at + group]
            passes.append((part, self._pass(cache, [windows[i] for i in part])))
        return PendingTimes(len(windows), passes, _recorded(self.m.device))

    def _pass(self, cache: KVCache, windows: list[Aligned]) -> _Launched:
        """One decoder pass over the windows' texts, then every step after it for all of them
        at once, padded to the longest: a pass's kernels do not grow with its windows (the
        stepping thread launches them, and a worker's passes are many and small)."""
        tok, d, device = self.m.tokenizer, self.m.dims, self.m.device
        starts = [tok.sot_sequence(w.language, w.task) for w in windows]
        rows = [s + w.tokens + [tok.eot] for s, w in zip(starts, windows, strict=True)]
        width = max(map(len, rows))
        frames = [max(1, min(w.n_frames // 2, d.n_audio_ctx)) for w in windows]
        # one copy to the device (the stream has just been waited for): each row's tokens,
        # then its slot and sizes (its rows; the row that predicts its first word, its text
        # tokens and end-of-text, its frames: the span of its cost matrix)
        packed = torch.tensor(
            [
                r
                + [tok.eot] * (width - len(r))
                + [w.slot, len(r), len(s) - 1, len(w.tokens) + 1, f]
                for s, r, w, f in zip(starts, rows, windows, frames, strict=True)
            ],
            device=device,
        )
        tokens, slots, sizes = packed[:, :width], packed[:, width], packed[:, width + 1 :]
        positions = torch.arange(width, device=device).expand(len(rows), -1)
        d_head = d.n_text_state // d.n_text_head
        self_shape = (d.n_text_layer, len(rows), d.n_text_head, width, d_head)
        scratch = KVCache(  # the windows' own cross-attention K/V; self-attention from scratch
            self_k=torch.empty(self_shape, device=device, dtype=self.m.dtype),
            self_v=torch.empty(self_shape, device=device, dtype=self.m.dtype),
            cross_k=cache.cross_k[:, slots],
            cross_v=cache.cross_v[:, slots],
        )
        weights = CrossWeights(self.heads)
        logits = self.m.model.decoder(
            tokens, positions, slice(0, len(rows)), scratch, width, weights=weights
        )
        qk = torch.cat(weights.qk, dim=1)  # (windows, heads, width, n_audio_ctx)
        costs = -alignment_weights(qk, sizes[:, 0], sizes[:, 3], max(frames), self.triton)
        # each text token's probability: the next token's, from each row that predicts one
        probabilities = token_probabilities(logits, tokens, tok.eot)
        spans, searched = sizes[:, 1:], self.triton and costs.is_cuda
        found = _to_host(*search(costs, spans)) if searched else _to_host(costs.double(), spans)
        texts = [(len(s) - 1, len(w.tokens)) for s, w in zip(starts, windows, strict=True)]
        return _Launched(found, searched, _to_host(probabilities)[0], texts)


@dataclass(frozen=True)
class _Launched:
    """One pass's results on their way to the host: the paths searched on the device (walked,
    lengths), or else the costs to search on the host (costs, spans); each row's
    probabilities; each window's (first row, text tokens)."""

    found: tuple[Tensor, Tensor]
    searched: bool
    probabilities: Tensor
    texts: list[tuple[int, int]]

    def times(self) -> list[TokenTimes]:
        a, b = (t.numpy() for t in self.found)
        found = walked_back(a, b) if self.searched else host_paths(a, b)
        p = self.probabilities.numpy()
        return [
            TokenTimes.of(path, p[k, first : first + n])
            for k, (path, (first, n)) in enumerate(zip(found, self.texts, strict=True))
        ]


class PendingTimes:
    """The token times of windows whose passes were launched."""

    def __init__(
        self,
        n_windows: int,
        passes: list[tuple[list[int], _Launched]],
        done: torch.cuda.Event | None,
    ):
        self.n_windows, self.passes, self.done = n_windows, passes, done

    def result(self) -> list[TokenTimes | None]:
        """Each window's token times (None: no text), once the device has them."""
        if self.done is not None:
            self.done.synchronize()
        timed: list[TokenTimes | None] = [None] * self.n_windows
        for part, launched in self.passes:
            for i, times in zip(part, launched.times(), strict=True):
                timed[i] = times
        return timed


def _to_host(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Copies on their way to the host's pinned memory (CUDA), not waited for."""
    if not tensors[0].is_cuda:
        return tensors
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.append(host.copy_(t, non_blocking=True))
    return tuple(out)


def _recorded(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work launched so far on the current CUDA stream (None elsewhere)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def alignment_weights(
    qk: Tensor, rows: Tensor, frames: Tensor, most_frames: int, triton: bool = False
) -> Tensor:
    """(windows, tokens, frames): openai-whisper's weights of each window, padded. qk: the
    alignment heads' (windows, heads, tokens, n_audio_ctx) products; rows, frames: each
    window's tokens and frames of content. A window alone is: its softmax over its frames,
    normalised over its tokens, median-filtered along its frames (reflected at its last),
    averaged over the heads; here the padding takes no part in any of it, and at most two
    float copies of the products are held at once."""
    pad = MEDIAN_FILTER_WIDTH // 2
    columns = torch.arange(most_frames, device=qk.device)
    x = qk[..., :most_frames].float()
    x.masked_fill_(columns >= frames[:, None, None, None], float("-inf"))
    x = x.softmax(dim=-1)
    n = rows[:, None, None, None].to(x.dtype)
    padding = (torch.arange(x.shape[2], device=qk.device) >= rows[:, None])[:, None, :, None]
    x.masked_fill_(padding, 0.0)
    x -= x.sum(dim=-2, keepdim=True) / n  # each frame's mean over the tokens
    x.masked_fill_(padding, 0.0)
    x /= torch.linalg.vector_norm(x, dim=-2, keepdim=True) / n.sqrt()  # and their deviation
    # each window's reflection past its last frame, in the columns after it, so that the
    # filter's edge there is the window's own (the filter reflects at the padded edge)
    last = frames[:, None, None, None] - 1
    reflected = torch.where(columns > last, (2 * last - columns).clamp(min=0), columns)
    x = x.gather(-1, reflected.expand_as(x))
    filtered = median_filter(x, MEDIAN_FILTER_WIDTH, triton)
    # a window too short to reflect is left unfiltered
    torch.where(last < pad, x, filtered, out=filtered)
    return filtered.mean(dim=1)


def token_probabilities(logits: Tensor, tokens: Tensor, eot: int) -> Tensor:
    """(windows, tokens - 1): each row's probability of the token after it, among the text
    tokens; in parts of at most PASS_BYTES of probabilities."""
    out = torch.empty(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    nexts = tokens[:, 1:].clamp(max=eot - 1)[..., None]  # past the text: any, unread
    part = max(1, PASS_BYTES // (4 * eot * tokens.shape[1]))
    for at in range(0, tokens.shape[0], part):
        p = logits[at : at + part, :-1, :eot].softmax(dim=-1, dtype=torch.float32)
        out[at : at + part] = p.gather(-1, nexts[at : at + part])[..., 0]
    return out


def split_words(
    tokenizer: Tokenizer, tokens: list[int], language: str
) -> tuple[list[str], list[list[int]]]:
    """The tokens grouped into words (at spaces and punctuation; at characters in languages
    written without spaces), each word's text with them."""
    subwords, groups = _split_on_unicode(tokenizer, tokens)
    if language in NO_SPACES:
        return subwords, groups
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for subword, group in zip(subwords, groups, strict=True):
        special = group[0] >= tokenizer.eot
        if special or subword.startswith(" ") or subword.strip() in string.punctuation or not words:
            words.append(subword)
            word_tokens.append(list(group))
        else:
            words[-1] += subword
            word_tokens[-1].extend(group)
    return words, word_tokens


def _split_on_unicode(tokenizer: Tokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """The tokens cut wherever what they decode to so far is whole characters."""
    full, replacement = None, "\ufffd"
    words, groups, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        decoded = tokenizer.text_of(token) if len(current) == 1 else tokenizer.decode(current)
        if replacement in decoded:  # part of a character, or the text's own U+FFFD
            full = tokenizer.decode(tokens) if full is None else full
            at = offset + decoded.find(replacement)
            if full[at : at + 1] != replacement:
                continue
        words.append(decoded)
        groups.append(current)
        current = []
        offset += len(decoded)
    return words, groups


def segment_words(
    tokenizer: Tokenizer, segments: list[list[int]], language: str, times: TokenTimes
) -> list[list[WordTiming]]:
    """The words of each of a window's segments (its text tokens, the window's in order), with
    the times at which their first token starts and the token after their last, and the mean
    probability of their tokens. A word never spans two segments."""
    out, first = [], 0
    starts, probabilities = times.starts.tolist(), times.probabilities.tolist()
    for tokens in segments:
        words, groups = split_words(tokenizer, tokens, language)
        timed = []
        for word, group in zip(words, groups, strict=True):
            last = first + len(group)
            probability = (  # numpy's mean (in float32) is slow for a single token
                probabilities[first]
                if len(group) == 1
                else float(times.probabilities[first:last].mean())
            )
            timed.append(WordTiming(word, group, starts[first], starts[last], probability))
            first = last
        out.append(timed)
    return out


def merge_punctuation(words: list[WordTiming]) -> list[WordTiming]:
    """Opening punctuation joins the word after it, closing punctuation the word before."""
    merged = list(words)
    following = len(merged) - 1
    for i in range(len(merged) - 2, -1, -1):
        before, after = merged[i], merged[following]
        if before.word.startswith(" ") and before.word.strip() in PREPEND_PUNCTUATION:
            merged[following] = replace(
                after, word=before.word + after.word, tokens=before.tokens + after.tokens
            )
            merged[i] = replace(before, word="", tokens=[])
        else:
            following = i
    previous = 0
    for j in range(1, len(merged)):
        before, after = merged[previous], merged[j]
        if not before.word.endswith(" ") and after.word in APPEND_PUNCTUATION:
            merged[previous] = replace(
                before, word=before.word + after.word, tokens=before.tokens + after.tokens
            )
            merged[j] = replace(after, word="", tokens=[])
        else:
            previous = j
    return merged


def place_words(
    segments: list[Segment], words: list[list[WordTiming]], offset: float, last_speech: float
) -> tuple[list[Segment], float]:
    """Give each of a window's segments its words (`segment_words`; times from the window's
    start, at `offset` s): words too long for their place are cut back at sentence and segment
    boundaries, and a segment's start and end follow its first and last word's unless those
    are implausible. Returns the segments and where speech last ended (`last_speech`, the end
    of the window before's speech, going in)."""
    flat = [t for timed in words for t in timed]
    durations = np.array([t.end - t.start for t in flat])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    placed = []
    for segment, timed in zip(segments, words, strict=True):
        timed = merge_punctuation(_cut_at_sentences(timed, longest))
        out = [
            Word(
                t.word,
                round(offset + t.start, 2),
                round(offset + t.end, 2),
                round(t.probability, 4),
            )
            for t in timed
            if t.word
        ]
        start, end = segment.start, segment.end
        if out:
            out, start, end = _fit(out, start, end, median, longest, last_speech)
            last_speech = end
        placed.append(replace(segment, start=start, end=end, words=out))
    return placed, last_speech


def _cut_at_sentences(words: list[WordTiming], longest: float) -> list[WordTiming]:
    """A word at a sentence boundary lasts at most `longest` (twice the median word)."""
    words = list(words)
    if longest <= 0:
        return words
    for i in range(1, len(words)):
        t = words[i]
        if t.end - t.start > longest:
            if t.word in SENTENCE_END:
                words[i] = replace(t, end=t.start + longest)
            elif words[i - 1].word in SENTENCE_END:
                words[i] = replace(t, start=t.end - longest)
    return words


def _fit(
    words: list[Word], start: float, end: float, median: float, longest: float, last_speech: float
) -> tuple[list[Word], float, float]:
    """openai-whisper's fixes at a segment's edges: the first word after a pause, and words
    longer than the segment's own timestamps allow."""
    first, last = words[0], words[-1]
    second = words[1] if len(words) > 1 else None
    if first.end - last_speech > median * 4 and (
        first.end - first.start > longest
        or (second is not None and second.end - first.start > longest * 2)
    ):
        if second is not None and second.end - second.start > longest:
            boundary = max(second.end / 2, second.end - longest)
            first, second = replace(first, end=boundary), replace(second, start=boundary)
        first = replace(first, start=max(0.0, first.end - longest))
    if start < first.end and start - 0.5 > first.start:
        first = replace(first, start=max(0.0, min(first.end - median, start)))
    # the segment starts with its first word (openai-whisper keeps its timestamp where the
    # word was cut back to a median's length, which can leave the word starting before it)
    start = first.start
    words = [first, *([second] if second is not None else []), *words[2:]]
    last = words[-1]
    if end > last.start and end + 0.5 < last.end:
        last = replace(last, end=max(last.start + median, end))
    else:
        end = last.end
    words[-1] = last
    for i in {0, min(1, len(words) - 1), len(words) - 1}:  # the words changed here
        words[i] = replace(words[i], start=round(words[i].start, 2), end=round(words[i].end, 2))
    return words, round(start, 3), round(end, 3)
