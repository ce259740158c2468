"""Triton source of `engine.kernels.norm` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def add_norm_kernel(x_ptr, y_ptr, gamma_ptr, beta_ptr, s_ptr, h_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * D
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x = tl.load(x_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
    s = (x + y).to(s_ptr.dtype.element_ty)  # rounded as torch's add writes it
    tl.store(s_ptr + row + cols, s, mask=inside)
    s = s.to(tl.float32)
    mean = tl.sum(s, axis=0) / D
    centred = tl.where(inside, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
    gamma = tl.load(gamma_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    h = centred * rstd * gamma + beta
    tl.store(h_ptr + row + cols, h.to(h_ptr.dtype.element_ty), mask=inside)
