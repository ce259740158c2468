"""The Whisper encoder-decoder network, written for serving.

Layout choices, compared with Hugging Face's `WhisperForConditionalGeneration`:

- pre-norm Transformer blocks; a stride-2 convolution stem in the encoder; GELU (erf) MLPs;
  learned positional embeddings in both stacks (the encoder's are fixed sinusoids in practice);
- self-attention q, k, v are fused into one linear (`qkv`) and cross-attention k, v into another
  (`kv`); Whisper's key projections carry no bias, so the fused bias holds zeros for k;
- the output head is tied to the token embedding, whose rows are padded to a multiple of 64
  (`VOCAB_ALIGN`) so that the logits matrix product runs on aligned, fast kernels (51865
  columns rule them out); the padding is never read;
- caches are explicit tensors owned by the caller (`KVCache`): the self-attention cache
  `[layer, slot, head, n_text_ctx, d_head]` and the cross-attention cache
  `[layer, slot, head, n_audio_ctx, d_head]`, which a window's first decoder pass projects
  from the encoder output (`xa`) and stores, and decode steps only read. A decode step's batch
  is a contiguous range of slots (`rows`), so every read is a view of the cache, never a
  gathered copy; the slot pool keeps live sequences packed at the front. Writes go to any
  slots (`engine.kernels.store`). No hooks, no hidden state: this is what CUDA graphs and
  continuous batching need. The cross-attention cache may be fp8 (half the bytes that large
  models' decode steps read); it is widened as it is read.
- a decode step (one token per row) attends through `engine.kernels.attention`: a split-K
  Triton kernel on CUDA (cuDNN for large fp16 batches of the cross-attention),
  `scaled_dot_product_attention` elsewhere; a pass that keeps cross-attention weights (word
  timestamps', whose sizes are new each time) spells its attention out (`attention`);
- a decoder pass over a few rows (batch-1 latency) runs each projection with its layer norm,
  GELU and residual add in one Triton kernel (`engine.kernels.linear`); the encoder makes
  each residual add and the layer norm after it one kernel (`engine.kernels.norm`).

The network knows nothing of requests, tokens' meaning or decoding policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.attention import decode_attention
from engine.kernels.linear import fused_linear
from engine.kernels.norm import add_norm
from engine.kernels.store import store_kv

VOCAB_ALIGN = 64


@dataclass(frozen=True)
class ModelDimensions:
    n_mels: int  # mel bins of the input spectrogram (80, or 128 for large-v3)
    n_audio_ctx: int  # encoder positions: 1500 for a 30 s window
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int  # decoder positions: 448
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_audio_ff: int
    n_text_ff: int

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelDimensions:
        """Read the dimensions from a Hugging Face `WhisperConfig` dictionary."""
        return cls(
            n_mels=config["num_mel_bins"],
            n_audio_ctx=config["max_source_positions"],
            n_audio_state=config["d_model"],
            n_audio_head=config["encoder_attention_heads"],
            n_audio_layer=config["encoder_layers"],
            n_vocab=config["vocab_size"],
            n_text_ctx=config["max_target_positions"],
            n_text_state=config["d_model"],
            n_text_head=config["decoder_attention_heads"],
            n_text_layer=config["decoder_layers"],
            n_audio_ff=config["encoder_ffn_dim"],
            n_text_ff=config["decoder_ffn_dim"],
        )


@dataclass
class KVCache:
    """Slot-indexed attention caches, preallocated once and reused by every request.

    self_k, self_v: shape = (n_text_layer, n_slots, n_text_head, text_ctx, d_head), where
        text_ctx <= n_text_ctx is the most positions a sequence will use
    cross_k, cross_v: shape = (n_text_layer, n_slots, n_text_head, n_audio_ctx, d_head)
    """

    self_k: Tensor
    self_v: Tensor
    cross_k: Tensor
    cross_v: Tensor

    @classmethod
    def allocate(
        cls,
        dims: ModelDimensions,
        n_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        text_ctx: int | None = None,
        cross_dtype: torch.dtype | None = None,
    ) -> KVCache:
        """cross_dtype: of the cross-attention K/V (default `dtype`; fp8: torch.float8_e4m3fn)"""
        cross_dtype = cross_dtype or dtype
        d_head = dims.n_text_state // dims.n_text_head
        text_ctx = min(text_ctx or dims.n_text_ctx, dims.n_text_ctx)
        self_shape = (dims.n_text_layer, n_slots, dims.n_text_head, text_ctx, d_head)
        cross_shape = (dims.n_text_layer, n_slots, dims.n_text_head, dims.n_audio_ctx, d_head)
        return cls(
            self_k=torch.zeros(self_shape, device=device, dtype=dtype),
            self_v=torch.zeros(self_shape, device=device, dtype=dtype),
            cross_k=torch.zeros(cross_shape, device=device, dtype=cross_dtype),
            cross_v=torch.zeros(cross_shape, device=device, dtype=cross_dtype),
        )

    @property
    def n_slots(self) -> int:
        return self.self_k.shape[1]


def padded_vocab(n_vocab: int) -> int:
    return -(-n_vocab // VOCAB_ALIGN) * VOCAB_ALIGN


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """(batch, time, n_state) -> (batch, n_head, time, d_head)"""
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(batch, n_head, time, d_head) -> (batch, time, n_state)"""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class SelfAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_state, 3 * n_state)
        self.out = nn.Linear(n_state, n_state)


class CrossAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(n_state, n_state)
        self.kv = nn.Linear(n_state, 2 * n_state)
        self.out = nn.Linear(n_state, n_state)


class EncoderBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, n_ff: int):
        super().__init__()
        self.attn_ln = nn.LayerNorm(n_state)
        self.attn = SelfAttention(n_state, n_head)
        self.mlp_ln = nn.LayerNorm(n_state)
        self.fc1 = nn.Linear(n_state, n_ff)
        self.fc2 = nn.Linear(n_ff, n_state)

    def forward(
        self, x: Tensor, h: Tensor, next_norm: nn.LayerNorm, triton: bool = False
    ) -> tuple[Tensor, Tensor]:
        """x: the residual stream; h: this block's attn_ln(x), made with x by whatever made x
        (each residual add and the layer norm after it are one pass, `add_norm`)
        returns: the stream after the block, and next_norm of it (the next block's attn_ln,
            or the encoder's ln_post)"""
        q, k, v = self.attn.qkv(h).chunk(3, dim=-1)
        n = self.attn.n_head
        a = F.scaled_dot_product_attention(split_heads(q, n), split_heads(k, n), split_heads(v, n))
        x, h = add_norm(x, self.attn.out(merge_heads(a)), self.mlp_ln, triton)
        return add_norm(x, self.fc2(F.gelu(self.fc1(h))), next_norm, triton)


class AudioEncoder(nn.Module):
    def __init__(self, dims: ModelDimensions):
        super().__init__()
        d = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Parameter(torch.empty(dims.n_audio_ctx, d))
        self.blocks = nn.ModuleList(
            EncoderBlock(d, dims.n_audio_head, dims.n_audio_ff) for _ in range(dims.n_audio_layer)
        )
        self.ln_post = nn.LayerNorm(d)

    def forward(self, mel: Tensor, triton: bool = False) -> Tensor:
        """
        mel: shape = (batch, n_mels, 2 * n_audio_ctx), the log-mel spectrogram of 30 s windows
        triton: each residual add and the layer norm after it in one Triton kernel
        returns: shape = (batch, n_audio_ctx, n_audio_state)
        """
        x = F.gelu(self.conv1(mel))
        # (batch, time, state) made contiguous once here: left as a transposed view, every
        # later element-wise kernel would inherit its strides and run unvectorised, and each
        # layer norm would copy it (a quarter of large-v3's encoder time, measured on an H200)
        x = F.gelu(self.conv2(x)).transpose(1, 2).contiguous()
        x = x + self.positional_embedding
        h = self.blocks[0].attn_ln(x)
        norms = [block.attn_ln for block in self.blocks[1:]] + [self.ln_post]
        for block, next_norm in zip(self.blocks, norms, strict=True):
            x, h = block(x, h, next_norm, triton)
        return h


@dataclass(frozen=True)
class Where:
    """Where a decoder pass's tokens sit, worked out once for every layer.

    positions: shape = (batch, n_tokens); slots: shape = (batch,), each row's cache slot, where
    its new keys and values are written. A decode step (one token a row, at its own position)
    reads n_keys self-attention positions of the cache, each row up to its own length:
    lengths, shape = (batch,); triton: through the Triton kernel (`engine.kernels.attention`).
    A prompt pass (tokens from position 0: a prompt, or a whole text to align) attends to its
    own keys: mask, shape = (batch, 1, n_tokens, n_tokens), True where a query may see a key.
    """

    positions: Tensor
    slots: Tensor
    n_keys: int
    mask: Tensor | None
    lengths: Tensor | None
    triton: bool = False

    @classmethod
    def of(
        cls, positions: Tensor, slots: Tensor, n_keys: int, triton: bool = False, prompt=False
    ) -> Where:
        if not prompt and positions.shape[1] == 1:
            return cls(positions, slots, n_keys, None, positions[:, 0] + 1, triton)
        keys = torch.arange(positions.shape[1], device=positions.device)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]
        return cls(positions, slots, positions.shape[1], mask, None, triton)


@dataclass
class CrossWeights:
    """Cross-attention weights to keep from a pass over several tokens a row (word timestamps,
    `engine.timing`): heads, layer -> the heads of it to keep; qk, filled in by the pass, per
    layer in `heads` in order: the scaled query-key products before the softmax, shape =
    (batch, len(heads[layer]), n_tokens, n_audio_ctx)."""

    heads: dict[int, list[int]]
    qk: list[Tensor] = field(default_factory=list)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spelt: bool) -> Tensor:
    """Scaled dot-product attention (mask: True where a query may see a key). spelt: in plain
    products and a softmax, for a pass whose sizes are new each time (word timestamps'): on
    Hopper torch prefers cuDNN's fused attention, which builds a plan for each new shape."""
    if not spelt:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    qk = scores(q, k)
    if mask is not None:
        qk = qk.masked_fill(~mask, float("-inf"))
    return weighed(qk, v)


def scores(q: Tensor, k: Tensor) -> Tensor:
    """Each query's scaled products with the keys, before the softmax."""
    return (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5


def weighed(qk: Tensor, v: Tensor) -> Tensor:
    """The values weighed by the softmax of the scores (taken in float)."""
    return qk.float().softmax(dim=-1).to(v.dtype) @ v


class DecoderBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, n_ff: int):
        super().__init__()
        self.attn_ln = nn.LayerNorm(n_state)
        self.attn = SelfAttention(n_state, n_head)
        self.cross_attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = CrossAttention(n_state, n_head)
        self.mlp_ln = nn.LayerNorm(n_state)
        self.fc1 = nn.Linear(n_state, n_ff)
        self.fc2 = nn.Linear(n_ff, n_state)

    def forward(
        self,
        x: Tensor,
        at: Where,
        rows: slice | None,
        cache: KVCache,
        layer: int,
        xa: Tensor | None = None,
        weights: CrossWeights | None = None,
    ) -> Tensor:
        h, fast = self.attn.n_head, at.triton
        q, k, v = fused_linear(x, self.attn.qkv, self.attn_ln, triton=fast).chunk(3, dim=-1)
        b, t, d = k.shape
        # this pass's keys and values go into each row's slot, at its own positions
        start = at.positions[:, 0] if at.mask is None else None
        store_kv(k, v, cache.self_k[layer], cache.self_v[layer], at.slots, start, fast)
        if at.mask is None:  # a decode step: the cache holds the keys before this one
            keys = cache.self_k[layer, rows, :, : at.n_keys]
            values = cache.self_v[layer, rows, :, : at.n_keys]
            q = q.view(b, h, d // h)
            a = decode_attention(q, keys, values, at.lengths, fast).view(b, 1, d)
            x = fused_linear(a, self.attn.out, residual=x, triton=fast)
            q = fused_linear(x, self.cross_attn.q, self.cross_attn_ln, triton=fast)
            cross_k, cross_v = cache.cross_k[layer, rows], cache.cross_v[layer, rows]
            a = decode_attention(q.view(b, h, d // h), cross_k, cross_v, triton=fast).view(b, 1, d)
        else:  # a prompt pass: its own keys are all there is
            spelt = weights is not None  # an alignment pass: sizes of its own each time
            a = attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), at.mask, spelt)
            x = fused_linear(merge_heads(a), self.attn.out, residual=x, triton=fast)
            q = fused_linear(x, self.cross_attn.q, self.cross_attn_ln, triton=fast)
            q = split_heads(q, h)
            if xa is None:
                cross_k = cache.cross_k[layer, rows].to(q.dtype)
                cross_v = cache.cross_v[layer, rows].to(q.dtype)
            else:  # a window's first pass projects its cross-attention K/V, kept for the rest
                ck, cv = self.cross_attn.kv(xa).chunk(2, dim=-1)
                store_kv(ck, cv, cache.cross_k[layer], cache.cross_v[layer], at.slots, None, fast)
                cross_k, cross_v = split_heads(ck, h), split_heads(cv, h)
            keep = weights.heads.get(layer) if weights else None
            if keep is None:
                a = attention(q, cross_k, cross_v, None, spelt)
            else:  # spelt out to keep its weights
                qk = scores(q, cross_k)
                weights.qk.append(qk[:, keep])
                a = weighed(qk, cross_v)
            a = merge_heads(a)
        x = fused_linear(a, self.cross_attn.out, residual=x, triton=fast)
        hidden = fused_linear(x, self.fc1, self.mlp_ln, gelu=True, triton=fast)
        return fused_linear(hidden, self.fc2, residual=x, triton=fast)


class TextDecoder(nn.Module):
    def __init__(self, dims: ModelDimensions):
        super().__init__()
        d = dims.n_text_state
        self.n_vocab = dims.n_vocab
        # no initial values: weights are loaded or drawn by the caller, and drawing normal ones
        # on the meta device would import torch._dynamo (seconds at every worker start)
        vocab = padded_vocab(dims.n_vocab)
        self.token_embedding = nn.Embedding(vocab, d, _weight=torch.empty(vocab, d))
        self.positional_embedding = nn.Parameter(torch.empty(dims.n_text_ctx, d))
        self.blocks = nn.ModuleList(
            DecoderBlock(d, dims.n_text_head, dims.n_text_ff) for _ in range(dims.n_text_layer)
        )
        self.ln = nn.LayerNorm(d)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        rows: slice | Tensor,
        cache: KVCache,
        n_keys: int | None = None,
        triton: bool = False,
        weights: CrossWeights | None = None,
        xa: Tensor | None = None,
    ) -> Tensor:
        """
        tokens, positions: shape = (batch, n_tokens), each row's next tokens and their positions
            (several tokens a row, or a pass given `xa`: a prompt from position 0)
        rows: the batch's cache slots: a contiguous range of `batch` slots; or, for a pass
            given `xa`, any slots, as a tensor of shape (batch,) (a CUDA graph's slots can then
            be chosen after capture)
        n_keys: self-attention positions a decode step reads (a fixed bucket under CUDA
            graphs); default: the furthest position in the batch + 1
        triton: the Triton kernels (on CUDA)
        weights: cross-attention weights to keep (several tokens a row only)
        xa: shape = (batch, n_audio_ctx, n_audio_state), the windows' encoder output, for their
            first pass: it projects and stores their cross-attention K/V (else read from the
            cache)
        returns: logits, shape = (batch, n_tokens, n_vocab), in the model's dtype: a view of
            the padded head's output, so rows are strided
        """
        if isinstance(rows, slice):
            slots = torch.arange(rows.start, rows.stop, device=tokens.device)
        elif xa is None:
            raise ValueError(
                "slots as a tensor need xa: the cross-attention cache is read by range"
            )
        else:
            slots, rows = rows, None
        x = self.token_embedding(tokens) + self.positional_embedding[positions]
        n_keys = n_keys or int(positions.max()) + 1
        at = Where.of(positions, slots, n_keys, triton, prompt=xa is not None)
        for layer, block in enumerate(self.blocks):
            x = block(x, at, rows, cache, layer, xa, weights)
        x = self.ln(x)
        return F.linear(x, self.token_embedding.weight)[..., : self.n_vocab]


class Whisper(nn.Module):
    def __init__(self, dims: ModelDimensions):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)
