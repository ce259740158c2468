"""Qwen3-ASR in the engine: its audio encoder batched over windows, its Qwen3 decoder over a
pool of slots that windows join and leave between decode steps (continuous batching).

The weights are a transformers Qwen3-ASR directory's (`Qwen3ASRForConditionalGeneration`,
the `-hf` checkpoints), read by name. Each window's request holds what its processor would
build (the same log-mel features, computed on the device; the chat prompt's tokens, from the
processor's text tokenized once for each language and prompt), and its processor parses the
answer, as the transformers backend does (engine.hf), so both give the same text for the
same tokens.

- Audio encoder: every 1 s chunk (100 frames) of every window through the convolutions at
  once, then attention within windows of 8 chunks (104 positions; a window's last may be
  shorter), as a batch of those windows with their padding masked: what the reference packs
  as FlashAttention's `cu_seqlens`.
- Decoder: each slot holds one window's keys and values for every layer, `context` positions
  deep. Admitted windows are prefilled together (right-padded, causal, their audio spliced in
  at the audio tokens); every step then decodes one token for each live slot, reading its own
  length, and a window leaves when it says end of turn or reaches `MAX_NEW_TOKENS`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import heap
from engine.config import EngineConfig
from engine.graphs import capture
from engine.hf import Chat, window_refusals
from engine.kernels.attention import decode_attention
from engine.kernels.rms import add_rms_norm, norm_rope, rms_norm, rotated, silu_mul
from engine.kernels.store import store_kv
from engine.mel import HOP_LENGTH, N_FFT, log_mel, mel_filters
from engine.options import OptionsError, TranscriptionOptions
from engine.slots import DECODE_BUCKETS, bucket, key_bucket, slots_within
from engine.weights import read_config, tensors
from engine.windows import Decoded, Request, WindowModel

CHUNK_FRAMES = 100  # mel frames a convolution chunk (1 s)
CHUNK_TOKENS = 13  # positions a whole chunk leaves after three stride-2 convolutions
WINDOW_CHUNKS = 8  # chunks an attention window (n_window_infer 800 frames)
MAX_NEW_TOKENS = 448  # an answer for one window at most (engine.hf's bound too)
HORIZON = 4  # decode steps queued between reads of their tokens (engine.runner's too)


def tokens_after_convolutions(frames: Tensor) -> Tensor:
    """Positions left of each count of frames in a chunk (0 stays 0)."""
    for _ in range(3):
        frames = torch.where(frames > 0, (frames - 1) // 2 + 1, 0)
    return frames


def audio_tokens(frames: int) -> int:
    """Positions the encoder gives (and audio tokens the prompt holds) for `frames` frames."""
    whole, rest = divmod(frames, CHUNK_FRAMES)
    return whole * CHUNK_TOKENS + int(tokens_after_convolutions(torch.tensor(rest)))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(d, d))
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: Tensor, keys: Tensor) -> Tensor:
        """x: (windows, positions, d); keys: (windows, 1, 1, positions), True where real."""
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (
            p(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = x + a.out_proj(h.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, hidden, mels = c["d_model"], c["downsample_hidden_size"], c["num_mel_bins"]
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        bins = ((((mels + 1) // 2) + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(hidden * bins, d, bias=False)
        self.layers = nn.ModuleList(
            EncoderLayer(d, c["encoder_attention_heads"], c["encoder_ffn_dim"])
            for _ in range(c["encoder_layers"])
        )
        self.ln_post = nn.LayerNorm(d)
        scale = math.log(10000) / (d // 2 - 1)
        with torch.device("cpu"):  # computed, also where the weights are built on "meta"
            t = torch.arange(CHUNK_TOKENS)[:, None] * torch.exp(-scale * torch.arange(d // 2))
        self.register_buffer("positions", torch.cat([t.sin(), t.cos()], 1), persistent=False)

    def forward(self, features: Tensor, frames: Tensor) -> Tensor:
        """features: (n, mels, k * CHUNK_FRAMES), frames: (n,) real frames of each -> the
        real positions of all n, one after another: (sum of `audio_tokens`, d)."""
        n, mels, width = features.shape
        chunks = width // CHUNK_FRAMES
        x = features.unflatten(2, (chunks, CHUNK_FRAMES)).transpose(1, 2)
        x = x.reshape(n * chunks, 1, mels, CHUNK_FRAMES)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))  # (n * chunks, 13, d)
        x = x + self.positions.to(x.dtype)
        starts = torch.arange(chunks, device=frames.device) * CHUNK_FRAMES
        real = tokens_after_convolutions((frames[:, None] - starts).clamp(0, CHUNK_FRAMES))
        mask = torch.arange(CHUNK_TOKENS, device=frames.device) < real[..., None]  # (n, chunks, 13)
        spare = -chunks % WINDOW_CHUNKS
        x = F.pad(x.unflatten(0, (n, chunks)), (0, 0, 0, 0, 0, spare))
        mask = F.pad(mask, (0, 0, 0, spare))
        width = WINDOW_CHUNKS * CHUNK_TOKENS
        x, mask = x.reshape(-1, width, x.shape[-1]), mask.reshape(-1, width)
        held = mask.any(1)  # windows with something in them
        x, mask = x[held], mask[held]
        keys = mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keys)
        return self.ln_post(x[mask])


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, hd, eps = c["hidden_size"], c["head_dim"], c["rms_norm_eps"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        bias = c.get("attention_bias", False)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        a = self.self_attn = nn.Module()
        a.q_proj = nn.Linear(d, self.heads * hd, bias=bias)
        a.k_proj = nn.Linear(d, self.kv_heads * hd, bias=bias)
        a.v_proj = nn.Linear(d, self.kv_heads * hd, bias=bias)
        a.o_proj = nn.Linear(self.heads * hd, d, bias=bias)
        a.q_norm, a.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
        m = self.mlp = nn.Module()
        m.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        m.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        m.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)

    def fuse(self) -> None:
        """The query, key and value projections as one product, and the gate and up
        projections as another: their weights laid side by side, each projection's weight
        a view of its part (no copy, and the separate products still give what they gave)."""
        a, m = self.self_attn, self.mlp
        for parts, name in (
            ((a.q_proj, a.k_proj, a.v_proj), "qkv"),
            ((m.gate_proj, m.up_proj), "gate_up"),
        ):
            for what in ("weight", "bias"):
                if getattr(parts[0], what) is None:
                    setattr(self, f"{name}_{what}", None)
                    continue
                whole = torch.cat([getattr(p, what) for p in parts])
                setattr(self, f"{name}_{what}", whole)
                for p, view in zip(
                    parts, whole.split([getattr(p, what).shape[0] for p in parts]), strict=True
                ):
                    setattr(p, what, nn.Parameter(view, requires_grad=False))

    def qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor, triton: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: (..., d) -> q (..., heads, hd), k and v (..., kv_heads, hd), q and k rotated.
        triton (x: (rows, d), after `fuse`): one product, and each of the norms and rotations
        a kernel."""
        a = self.self_attn
        if triton and x.is_cuda:
            eps = self.input_layernorm.eps
            _, h = add_rms_norm(x, None, self.input_layernorm.weight, eps, triton)
            y = F.linear(h, self.qkv_weight, self.qkv_bias).unflatten(-1, (-1, cos.shape[-1]))
            q, k, v = y.split([self.heads, self.kv_heads, self.kv_heads], dim=-2)
            norm_rope(q, a.q_norm.weight, a.q_norm.eps, cos, sin, out=q, triton=triton)
            norm_rope(k, a.k_norm.weight, a.k_norm.eps, cos, sin, out=k, triton=triton)
            return q, k, v
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).unflatten(-1, (self.heads, -1)))
        k = a.k_norm(a.k_proj(h).unflatten(-1, (self.kv_heads, -1)))
        v = a.v_proj(h).unflatten(-1, (self.kv_heads, -1))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return rotated(q, cos, sin), rotated(k, cos, sin), v

    def rest(self, x: Tensor, attended: Tensor, triton: bool = False) -> Tensor:
        """The residual after attention (attended: (..., heads, hd)), then the MLP's."""
        m, norm = self.mlp, self.post_attention_layernorm
        y = self.self_attn.o_proj(attended.flatten(-2))
        if triton and x.is_cuda:
            x, h = add_rms_norm(x, y, norm.weight, norm.eps, triton)
            gate_up = F.linear(h, self.gate_up_weight, self.gate_up_bias)
            return x + m.down_proj(silu_mul(gate_up, triton))
        x = x + y
        h = norm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class TextDecoder(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 1e6)
        hd = c["head_dim"]
        with torch.device("cpu"):
            inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat([freqs, freqs], -1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Qwen3ASR(nn.Module):
    """The network, its parts named as transformers names them (less the `model.` prefix)."""

    def __init__(self, config: dict):
        super().__init__()
        a, t = config["audio_config"], config["text_config"]
        self.audio_tower = AudioEncoder(a)
        p = self.multi_modal_projector = nn.Module()
        p.linear_1 = nn.Linear(a["d_model"], a["d_model"])
        p.linear_2 = nn.Linear(a["d_model"], a["output_dim"])
        self.language_model = TextDecoder(t)
        tied = config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        self.lm_head = None if tied else nn.Linear(t["hidden_size"], t["vocab_size"], bias=False)
        self.audio_token = config["audio_token_id"]

    def audio(self, features: Tensor, frames: Tensor) -> Tensor:
        """The audio embeddings of windows' features, as the decoder reads them."""
        p = self.multi_modal_projector
        return p.linear_2(F.gelu(p.linear_1(self.audio_tower(features, frames))))

    def next_tokens(self, x: Tensor, stops: Tensor, quiet: Tensor) -> Tensor:
        """The most likely token after each of the decoder's last hidden states; none of
        `stops` (token ids) for the rows `quiet` holds."""
        lm = self.language_model
        head = lm.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = lm.norm(x) @ head.T
        logits[:, stops] = logits[:, stops].masked_fill(quiet[:, None], -torch.inf)
        return logits.argmax(-1)


@dataclass(eq=False)
class Window:
    """A window in the pool: its request, then what it has generated."""

    key: Hashable
    prompt: list[int]
    language: str | None  # forced by the job, else the model's answer
    least: int = 0  # tokens before an end of turn may come (TranscriptionOptions.min_tokens)
    most: int = MAX_NEW_TOKENS  # tokens at most (TranscriptionOptions.sample_len)
    slot: int = -1
    generated: list[int] = field(default_factory=list)


class SlotDecoder:
    """The decoder's keys and values for `n_slots` windows of up to `context` positions each,
    and the windows in them. A step's attention reads each slot's keys where they lie, up to
    its own length (`engine.kernels.attention`: with `triton`, the Triton kernel, grouped
    query heads reading their key head; else SDPA over a keys bucket). With `graphs` (CUDA),
    the decode step is captured once for each (rows bucket, keys bucket) it meets and
    replayed."""

    def __init__(
        self,
        model: Qwen3ASR,
        n_slots: int,
        context: int,
        stops: set[int],
        graphs: bool = False,
        triton: bool = False,
    ):
        self.model, self.n_slots, self.context, self.stops = model, n_slots, context, stops
        lm = model.language_model
        layer = lm.layers[0]
        p = lm.embed_tokens.weight
        shape = (len(lm.layers), n_slots, layer.kv_heads, context, lm.inv_freq.numel() * 2)
        self.keys = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.values = torch.zeros_like(self.keys)
        self.live: list[Window] = []
        self._free = list(range(n_slots))
        # what a step reads and writes, in place: its graphs hold these addresses
        self._tokens = torch.zeros(n_slots, dtype=torch.long, device=p.device)
        self._at = torch.zeros_like(self._tokens)  # each row's position
        self._count = torch.zeros_like(self._tokens)  # tokens each row has generated
        self._least = torch.zeros_like(self._tokens)  # before which its stops are held back
        self._history = torch.zeros(HORIZON, n_slots, dtype=torch.long, device=p.device)
        self._stops = torch.tensor(sorted(stops), device=p.device)
        self._rows = torch.arange(n_slots, device=p.device)
        self.graphs, self.triton = graphs, triton
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool: tuple | None = None

    @property
    def free(self) -> int:
        return len(self._free)

    @torch.inference_mode()
    def admit(self, windows: list[Window], audio: Tensor) -> list[Window]:
        """Prefill these windows into free slots, their audio tokens replaced by `audio` (the
        embeddings of all their audio, in order); hand back those finished by their first
        token."""
        m, lm = self.model, self.model.language_model
        device = lm.embed_tokens.weight.device
        width = max(len(w.prompt) for w in windows)
        ids = torch.zeros(len(windows), width, dtype=torch.long)
        for row, w in zip(ids, windows, strict=True):
            row[: len(w.prompt)] = torch.tensor(w.prompt)
        ids = ids.to(device)
        x = lm.embed_tokens(ids)
        at = ids == m.audio_token
        if int(at.sum()) != len(audio):
            raise ValueError(f"{int(at.sum())} audio tokens in the prompts, {len(audio)} given")
        x[at] = audio.to(x.dtype)
        lengths = torch.tensor([len(w.prompt) for w in windows], device=device)
        for w in windows:
            w.slot = heapq.heappop(self._free)
        slots = torch.tensor([w.slot for w in windows], device=device)
        # the rows of every prompt one after another: the fused kernels take rows
        n, x = len(windows), x.flatten(0, 1)
        positions = torch.arange(width, device=device)
        cos, sin = lm.rope(positions.repeat(n), x.dtype)
        for i, layer in enumerate(lm.layers):
            q, k, v = (t.unflatten(0, (n, width)) for t in layer.qkv(x, cos, sin, self.triton))
            self.keys[i, slots, :, :width] = k.transpose(1, 2)
            self.values[i, slots, :, :width] = v.transpose(1, 2)
            # causal alone, no mask: the prompts are padded on the right, so a prompt's own
            # positions never see the padding, and what the padding's positions compute is
            # never read (a row's answer starts at its own length); without a mask SDPA can
            # take its flash kernel
            h = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            x = layer.rest(x, h.transpose(1, 2).flatten(0, 1), self.triton)
        last = x.view(n, width, -1)[torch.arange(n, device=device), lengths - 1]
        self.live += windows
        quiet = torch.tensor([w.least > 0 for w in windows], device=device)
        first = m.next_tokens(last, self._stops, quiet).tolist()
        return self._take(windows, [[t] for t in first])

    @torch.inference_mode()
    def step(self) -> list[Window]:
        """HORIZON tokens for every live window (fewer where one nears the end of its slot),
        queued on the device and read back once; hand back the windows that finished (a
        window's tokens after its end are dropped). The steps run over the slots up to the
        highest live one (slots are taken lowest first; rounded up to a bucket), each reading
        its keys where they lie: a free slot among them decodes tokens nobody reads."""
        rows = bucket(max(w.slot for w in self.live) + 1, DECODE_BUCKETS, self.n_slots)
        tokens, at, count, least = ([0] * rows for _ in range(4))
        for w in self.live:
            tokens[w.slot], at[w.slot] = w.generated[-1], len(w.prompt) + len(w.generated) - 1
            count[w.slot], least[w.slot] = len(w.generated), w.least
        steps = HORIZON if max(at) + HORIZON < self.context else 1
        # the Triton kernel stops at each row's length: one keys bucket, the whole slot
        seen = self.context if self.triton else key_bucket(max(at) + steps, self.context)
        buffers = (self._tokens, self._at, self._count, self._least)
        for buffer, values in zip(buffers, (tokens, at, count, least), strict=True):
            buffer[:rows].copy_(torch.tensor(values))
        if self.graphs:
            self._graph(rows, seen, steps).replay()
        else:
            self._decode(rows, seen, steps)
        history = self._history[:steps, :rows].T.tolist()
        return self._take(list(self.live), [history[w.slot] for w in self.live])

    def capture(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture the steps for every (rows, keys) bucket not yet captured, HORIZON of them
        and one, on an idle pool (a capture's warm-up writes each row's keys at its
        positions); how many."""
        if self.live:
            raise RuntimeError("capture() needs an idle pool")
        rows = sorted({bucket(n, DECODE_BUCKETS, self.n_slots) for n in DECODE_BUCKETS})
        seen = sorted({key_bucket(n, self.context) for n in range(1, self.context + 1)})
        if self.triton:
            seen = [self.context]
        shapes = [
            (r, k, n)
            for r in rows
            for k in seen
            for n in (HORIZON, 1)
            if (r, k, n) not in self._graphs
        ]
        self._at.zero_()
        for done, shape in enumerate(shapes, 1):
            self._graph(*shape)
            if progress:
                progress(done, len(shapes))
        return len(shapes)

    def _graph(self, rows: int, seen: int, steps: int) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get((rows, seen, steps))
        if graph is None:
            run = partial(self._decode, rows, seen, steps)
            graph = self._graphs[rows, seen, steps] = capture(run, self._pool)
            self._pool = graph.pool()
        return graph

    def _decode(self, rows: int, seen: int, steps: int) -> None:
        """The steps' device work, from and to their buffers: rows [:rows], keys [:seen];
        each step's tokens into `_history` and back in as the next step's."""
        lm = self.model.language_model
        at, slots = self._at[:rows], self._rows[:rows]
        for step in range(steps):
            x = lm.embed_tokens(self._tokens[:rows])
            cos, sin = lm.rope(at, x.dtype)
            lengths = at + 1
            for i, layer in enumerate(lm.layers):
                q, k, v = layer.qkv(x, cos, sin, self.triton)
                new = k.flatten(-2)[:, None], v.flatten(-2)[:, None]  # one position a row
                store_kv(*new, self.keys[i], self.values[i], slots, at, self.triton)
                keys, values = self.keys[i, :rows, :, :seen], self.values[i, :rows, :, :seen]
                attended = decode_attention(q, keys, values, lengths, self.triton)
                x = layer.rest(x, attended, self.triton)
            quiet = self._count[:rows] < self._least[:rows]
            self._history[step, :rows] = self.model.next_tokens(x, self._stops, quiet)
            self._tokens[:rows] = self._history[step, :rows]
            at += 1
            self._count[:rows] += 1

    def _take(self, windows: list[Window], tokens: list[list[int]]) -> list[Window]:
        """Each window's new tokens, up to its end: a stop, `most` tokens, or a full slot."""
        done = []
        for w, new in zip(windows, tokens, strict=True):
            for token in new:
                w.generated.append(token)
                full = len(w.prompt) + len(w.generated) >= self.context
                if token in self.stops or len(w.generated) >= w.most or full:
                    done.append(w)
                    break
        for w in done:
            self.release(w)
        return done

    def release(self, window: Window) -> None:
        if window in self.live:
            self.live.remove(window)
            heapq.heappush(self._free, window.slot)

    def reset(self) -> None:
        self.live.clear()
        self._free = list(range(self.n_slots))


MAX_PROMPT_TOKENS = 224  # a job's prompt (the request's context) at most, as Whisper's
# positions a slot holds: a 30 s window's audio, the request around it, a prompt, an answer
CONTEXT = 30 * CHUNK_TOKENS + 64 + MAX_PROMPT_TOKENS + MAX_NEW_TOKENS
RUN_STEPS = 2 * HORIZON  # decode steps a `run`, between admissions
MAX_SLOTS = 256


def is_qwen3_asr(source: str) -> bool:
    """Whether a model source is a local transformers Qwen3-ASR directory, which the engine
    runs natively (`hf:/dir` still runs it through transformers)."""
    config = Path(source).expanduser() / "config.json"
    return config.is_file() and read_config(config.parent).get("model_type") == "qwen3_asr"


def _check_extractor(extractor, path: Path) -> None:
    """The directory's feature extractor is the log-mel `requests` computes (engine.mel's,
    Whisper's): refused here otherwise, where `hf:` still runs it through transformers."""
    same = (
        (extractor.hop_length, extractor.n_fft, 2 * extractor.n_window)
        == (HOP_LENGTH, N_FFT, CHUNK_FRAMES)
        and not getattr(extractor, "dither", 0.0)
        and np.allclose(extractor.mel_filters, mel_filters(extractor.feature_size), atol=1e-7)
    )
    if not same:
        raise ValueError(
            f"{path}: its feature extractor is not the log-mel the engine computes; "
            f"run it through transformers with model 'hf:{path}'"
        )


class Qwen3ASREngine(WindowModel):
    """Qwen3-ASR on one device: the engine's network over a transformers directory's weights,
    its decoder slots, and the directory's processor (engine.hf.Chat)."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoProcessor

        from engine.hf import quiet_transformers

        path = Path(config.model).expanduser()
        self.config, self.name, self.english_only = config, config.name or config.model, False
        self.device, self.dtype = config.placement()
        settings = read_config(path)
        with torch.device("meta"):
            model = Qwen3ASR(settings)
        state = {
            name.removeprefix("model."): get().to(self.device, self.dtype)
            for name, get in tensors(path).items()
            if not (model.lm_head is None and name == "lm_head.weight")  # tied: the embedding
        }
        model.load_state_dict(state, assign=True, strict=True)
        self.model = model.to(self.device).eval().requires_grad_(False)
        for layer in self.model.language_model.layers:
            layer.fuse()
        quiet_transformers()
        self.chat = Chat(AutoProcessor.from_pretrained(path))
        _check_extractor(self.chat.processor.feature_extractor, path)
        stops = settings.get("eos_token_id")
        self.stops = set(stops if isinstance(stops, list) else [stops])
        self.triton, self.graphs = config.speedups(self.device)
        self.n_slots = config.slots or self._slots_for(config.slot_memory_bytes)
        self.decoder = self._decoder()

    def _slots_for(self, memory_bytes: int | None) -> int:
        """As many slots as `memory_bytes` of keys and values hold (engine.slots'
        budget), at most MAX_SLOTS."""
        lm = self.model.language_model
        per_position = 2 * len(lm.layers) * lm.layers[0].kv_heads * lm.inv_freq.numel() * 2
        per_slot = per_position * CONTEXT * self.dtype.itemsize
        return slots_within(memory_bytes, self.device, per_slot, MAX_SLOTS)

    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        """Refuse, before any work, what the model cannot do as asked."""
        cannot = window_refusals(options) + self.chat.refusals(options.language)
        if options.task != "transcribe":
            cannot.append(f"task {options.task!r}: Qwen3-ASR transcribes")
        most = options.sample_len or MAX_NEW_TOKENS
        if not 0 < most <= MAX_NEW_TOKENS:
            cannot.append(f"sample_len {options.sample_len} (1 to {MAX_NEW_TOKENS} tokens)")
        if not 0 <= options.min_tokens <= most:
            cannot.append(f"min_tokens {options.min_tokens} (0 to {most})")
        if options.initial_prompt:
            n = len(self.chat.processor.tokenizer(options.initial_prompt)["input_ids"])
            if n > MAX_PROMPT_TOKENS:
                cannot.append(f"a prompt of {n} tokens (at most {MAX_PROMPT_TOKENS})")
        if cannot:
            raise OptionsError(f"{self.name} (Qwen3-ASR) cannot give {'; '.join(cannot)}")
        return options

    def room(self) -> int:
        """Free slots, at most `encoder_batch` a step (EngineConfig): windows join the
        running decode a few at a time, as the Whisper engine's do."""
        return min(self.decoder.free, self.config.encoder_batch)

    def run(self, windows: list[Request]) -> list[tuple[Hashable, Decoded]]:
        """Admit these windows, then RUN_STEPS decode steps of every live window."""
        done = self._admit(windows) if windows else []
        for _ in range(RUN_STEPS // HORIZON):
            if not self.decoder.live:
                break
            done += self.decoder.step()
        return [(w.key, self.chat.answer(w.generated, w.language)) for w in done]

    def _admit(self, requests: list[Request]) -> list[Window]:
        features, frames, ids = self.requests(requests)
        with torch.inference_mode():
            audio = self.model.audio(features.to(self.dtype), frames.to(self.device))
        windows = [
            Window(
                key,
                row,
                options.language,
                options.min_tokens,
                options.sample_len or MAX_NEW_TOKENS,
            )
            for (key, _, options), row in zip(requests, ids, strict=True)
        ]
        return self.decoder.admit(windows, audio)

    def requests(self, requests: list[Request]) -> tuple[Tensor, Tensor, list[list[int]]]:
        """What the processor's requests hold (engine.hf.Chat.requests), made here: each
        window's log-mel on the device (`engine.mel.log_mel`: the extractor's, over the window
        as long as it is, at least `min_length` samples, floored at 8 below its own peak;
        windows of one length in one pass), right-padded with zeros to whole chunks; its real
        frames; and its tokens (the chat's text tokenized once, `Chat.prompt_ids`). The
        processor's requests took 38 % of a batch of 384 windows on an H100, on the host
        (docs/benchmarks.md)."""
        extractor = self.chat.processor.feature_extractor
        counts = [max(len(samples), extractor.min_length) for _, samples, _ in requests]
        frames = [n // HOP_LENGTH for n in counts]
        width = -(-max(frames) // CHUNK_FRAMES) * CHUNK_FRAMES
        features = torch.zeros(len(requests), extractor.feature_size, width, device=self.device)
        for n in set(counts):
            rows = [i for i, c in enumerate(counts) if c == n]
            audio = torch.zeros(len(rows), n)
            for row, i in zip(audio, rows, strict=True):
                row[: len(requests[i][1])] = torch.from_numpy(requests[i][1])
            mel = log_mel(audio.to(self.device), extractor.feature_size)
            features[rows, :, : n // HOP_LENGTH] = mel
        ids = [
            self.chat.prompt_ids(o.language, o.initial_prompt, audio_tokens(f))
            for (_, _, o), f in zip(requests, frames, strict=True)
        ]
        return features, torch.tensor(frames), ids

    def capture(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Every decode step shape, captured now rather than as windows first meet it."""
        return self.decoder.capture(progress) if self.graphs else 0

    def drop(self, keys: set[Hashable]) -> None:
        for w in [w for w in self.decoder.live if w.key in keys]:
            self.decoder.release(w)

    def reset(self) -> None:
        self.decoder.reset()

    def shrink(self) -> bool:
        """Halve the slots (after running out of device memory); False at one."""
        if self.n_slots == 1:
            return False
        self.n_slots //= 2
        del self.decoder
        heap.settle()  # (frozen since `warm`, a cycle among its objects would hold them)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.decoder = self._decoder()
        return True

    def _decoder(self) -> SlotDecoder:
        return SlotDecoder(self.model, self.n_slots, CONTEXT, self.stops, self.graphs, self.triton)
