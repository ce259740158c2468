"""Triton source of `engine.kernels.fp8` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def rowwise_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One row a program: its largest magnitude, then the row over its scale as e4m3. The
    row's division is IEEE's (`div_rn`), as torch's is: Triton's `/` of two fp32 tensors is
    the GPU's approximate one, which moved about 2 in 100,000 values to the next e4m3 step.
    (Its division by the constant already gave torch's scale, bit for bit; `div_rn` there
    did not.)"""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
    q = tl.div_rn(x, scale)
    tl.store(q_ptr + row * K + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    tl.store(scale_ptr + row, scale)
