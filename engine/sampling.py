"""Sampling that depends only on the input, never on the batch (issue 12, finding 5).

A sampled token is the Gumbel-max draw `argmax(logits / temperature + g)`, which picks token i
with probability softmax(logits / temperature)[i]. The noise g comes from a counter-based
generator: an integer hash of (the input's seed, the window's first frame, the attempt, the
step, the vocabulary index), so a row draws the same tokens alone or among any others, in any
slot, after any earlier work, on any worker. A stateful `torch.Generator` shared by the pool
gave each row whatever its neighbours and the stream's history left.

The hash works on 32-bit words held in int64 tensors (or Python ints: the same function), each
product of a word and a constant below 2**31 staying below 2**63, so CPU and CUDA compute the
same bits with no overflow.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK = 0xFFFFFFFF
SEED_LIMIT = 2**63  # seeds are 0 <= seed < SEED_LIMIT (they fit a signed 64-bit integer)
_START = 0x2545F491  # a nonzero start, so that key 0 does not hash to 0


def mix32(x):
    """A bijection of 32-bit words that spreads every input bit over the output (a two-round
    xorshift-multiply hash with constants below 2**31). Takes an int, or an int64 tensor, which
    it mixes in place (a pass over a row's whole vocabulary makes no copy per operation)."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= MASK
    x ^= x >> 15
    x *= 0x735A2D97
    x &= MASK
    x ^= x >> 15
    return x


def window_key(seed: int, seek: int, attempt: int) -> int:
    """The 32-bit key of one decode of one window: its input's seed, its first frame, and the
    attempt (index into the temperatures). seed: 0 <= seed < SEED_LIMIT (`Engine.check`)."""
    h = _START
    for word in (seed & MASK, seed >> 32, seek & MASK, attempt & MASK):
        h = mix32(h ^ word)
    return h


def gumbel(keys: Tensor, steps: Tensor, n_vocab: int) -> Tensor:
    """Standard Gumbel noise, shape = (rows, n_vocab) float32, for rows with these window keys
    (int64, < 2**32) at these steps (tokens sampled so far in the window)."""
    k1 = mix32(keys ^ mix32(steps & MASK))  # two words a step: a row's noise at one step is
    k2 = mix32(k1 ^ _START)  # never a permutation of another's
    bits = torch.arange(n_vocab, device=keys.device) ^ k1[:, None]
    mix32(bits)
    bits ^= k2[:, None]
    mix32(bits)
    return gumbel_from_bits(bits)


def gumbel_from_bits(bits: Tensor) -> Tensor:
    """-log(-log(u)) of the uniform u that 32 random bits stand for. u keeps 23 of them: the
    top value, (2**23 - 0.5) / 2**23, is the largest float32 below 1. With 24, (2**24 - 0.5) /
    2**24 rounded to 1.0, whose noise is infinite, which turned a token every rule forbids
    (-inf) into NaN, the largest value argmax finds: once a window in about 200 steps."""
    uniform = (bits >> 9).float().add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_()


def draw(logits: Tensor, temperature: Tensor, keys: Tensor, steps: Tensor) -> Tensor:
    """Each row's token sampled from softmax(logits / temperature), from its own noise.

    logits: shape = (rows, n_vocab) float32, filtered (-inf where a rule forbids a token)
    temperature: shape = (rows,), above 0; keys, steps: shape = (rows,) int64 (`gumbel`)
    """
    noise = gumbel(keys, steps, logits.shape[-1])
    return noise.add_(logits / temperature[:, None]).argmax(dim=-1)
