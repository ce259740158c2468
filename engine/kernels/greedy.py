"""The greedy choice under Whisper's rules, with its log-probability, in one kernel.

Applied one by one in torch, the rules (`engine.decoding`) and the choice make about a dozen
passes over the step's logits: at batch 512 that is 512 x 51865 floats each time, more time
than the decoder's matrix work for the small models. The Triton kernel reads each row's
logits once (twice when the row predicts timestamps: the timestamp rule weighs the others'
result first), applies the same rules in registers, and writes only the chosen token and its
log-probability; given a buffer, it also writes the filtered logits of the rows that sample
(they draw from them), so one kernel, and one CUDA graph, serves steps with and without them.

One program a row leaves a few rows' step to as many SMs: at batch 1 a program scanned tiny's
51,865 logits in 50.9 us, a sixth of its decode step (H100 profile, 2026-12-07). So a few
rows' vocabularies are shared out over programs (`TARGET_PROGRAMS`): each writes its blocks'
partial results, and a second kernel merges them in vocabulary order, as the one-program path
merges its blocks (a launch of the same kernel before them gives the timestamp rule the
numbers of every block, which the choice needs). A row's token and kept logits do not depend
on the path, nor its log-probability but for how the compiler fuses the merge's
multiply-adds. Not yet timed on a GPU (compiled for sm_90 and run in Triton's interpreter
only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.decoding import (
    ApplyTimestampRules,
    DecodeState,
    LogitFilter,
    SuppressBlank,
    SuppressEarlyEnd,
    SuppressTokens,
)
from engine.kernels import ceil_div

BLOCK = 2048  # vocabulary entries per loop iteration
TARGET_PROGRAMS = 128  # share a few rows' vocabularies out until about this many programs run


class GreedyRules:
    """A list of `engine.decoding` filters, as the fused kernel's arguments."""

    def __init__(
        self, filters: list[LogitFilter], n_vocab: int, device: torch.device, triton: bool
    ):
        """triton: choose with the fused kernel (on CUDA), else with the filters in torch."""
        self.filters, self.n_vocab, self.triton = filters, n_vocab, triton
        self.suppress = torch.zeros(n_vocab, dtype=torch.uint8, device=device)
        self.blank: Tensor | None = None
        self.eot, self.timestamp_rules = -1, None
        for i, f in enumerate(filters):
            if isinstance(f, SuppressEarlyEnd):
                self.eot = f.eot
            elif isinstance(f, SuppressTokens):
                self.suppress |= f.mask.to(device, torch.uint8)
            elif isinstance(f, SuppressBlank):
                if self.blank is None:
                    self.blank = torch.zeros(n_vocab, dtype=torch.uint8, device=device)
                self.blank[f.token_ids.to(device)] = 1
            elif isinstance(f, ApplyTimestampRules) and i == len(filters) - 1:
                self.timestamp_rules = f
            else:
                raise TypeError(f"the fused kernel does not know {f!r} at position {i}")

    def select(
        self,
        logits: Tensor,
        state: DecodeState,
        timestamps: bool,
        keep: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Greedy token and its log-probability for each row.

        logits: shape = (batch, n_vocab), any float dtype, rows may be strided
        timestamps: whether any row predicts timestamps (else the timestamp rules are skipped)
        keep: (filtered, temperature): each row whose temperature is above 0 gets its filtered
            float32 logits in `filtered` (batch, n_vocab), to sample from
        """
        if self.triton and logits.is_cuda:
            return self.triton_select(logits, state, timestamps, keep)
        return self.torch_select(logits, state, timestamps, keep)

    def apply(self, logits: Tensor, state: DecodeState, timestamps: bool) -> Tensor:
        """The rules applied one by one: a new float32 tensor of filtered logits."""
        logits = logits.to(torch.float32, copy=True)
        for f in self.filters:
            if timestamps or not f.only_with_timestamps:
                f.apply(logits, state)
        return logits

    @staticmethod
    def choose(filtered: Tensor) -> tuple[Tensor, Tensor]:
        token = filtered.argmax(dim=-1)
        return token, filtered.log_softmax(dim=-1).gather(1, token[:, None])[:, 0]

    def torch_select(
        self,
        logits: Tensor,
        state: DecodeState,
        timestamps: bool,
        keep: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        filtered = self.apply(logits, state, timestamps)
        if keep is not None:
            keep[0].copy_(filtered)  # every row: the greedy ones ignore theirs
        return self.choose(filtered)

    def triton_select(
        self,
        logits: Tensor,
        state: DecodeState,
        timestamps: bool,
        keep: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        from engine.kernels._greedy import choice_kernel, greedy_kernel

        if logits.stride(-1) != 1 or (keep is not None and keep[0].stride(-1) != 1):
            raise ValueError("each row of logits must be contiguous")
        filtered, sampling = keep if keep is not None else (logits, logits)
        b = logits.shape[0]
        token = torch.empty(b, dtype=torch.long, device=logits.device)
        logprob = torch.empty(b, dtype=torch.float32, device=logits.device)
        ts = self.timestamp_rules
        timestamps = timestamps and ts is not None
        last_initial = self.n_vocab
        if ts is not None and ts.max_initial_index is not None:
            last_initial = ts.begin + ts.max_initial_index
        n_blocks = ceil_div(self.n_vocab, BLOCK)
        splits = min(n_blocks, max(1, TARGET_PROGRAMS // b))
        # each block's partial results, where the vocabulary is shared out
        mass = part = token
        if splits > 1:
            part = torch.empty(b, n_blocks, 3, dtype=torch.float32, device=logits.device)
            mass = torch.empty_like(part) if timestamps else part
        args = (
            logits, logits.stride(0), self.suppress,
            self.blank if self.blank is not None else self.suppress,
            state.n_sampled, state.last, state.penultimate, state.last_timestamp,
            state.timestamps, state.min_tokens, token, logprob, filtered, filtered.stride(0),
            sampling, mass, part, self.eot, ts.no_timestamps if ts else -1,
            ts.begin if ts else self.n_vocab, last_initial,
        )  # fmt: skip
        constants = dict(
            N_VOCAB=self.n_vocab, HAS_BLANK=self.blank is not None, TIMESTAMPS=timestamps,
            KEEP=keep is not None, BLOCK=BLOCK, SPLITS=splits, num_warps=8,
        )  # fmt: skip
        if splits > 1 and timestamps:  # the timestamp rule's numbers, which the choice needs
            greedy_kernel[(b, splits)](*args, **constants, MASS=True)
        greedy_kernel[(b, splits)](*args, **constants, MASS=False)
        if splits > 1:
            choice_kernel[(b,)](part, token, logprob, N_BLOCKS=n_blocks)
        return token, logprob
