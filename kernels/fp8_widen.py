"""Widening float8 e4m3 to float16 with integer instructions instead of Hopper's FP8 conversion.

Hopper converts FP8 to float16 with `cvt.rn.f16x2.e4m3x2` (F2FP in the machine code), which
issues on a narrow pipe: a kernel that widens every weight byte it streams (the skinny FP8
product at one row, attention over an FP8 cache) can be bound by the conversions rather than
by memory. The same values come out of byte moves and bit masks on the integer pipe:

an e4m3 byte `s eeee mmm`, put in the high byte of a 16-bit word and its 7 magnitude bits
moved right by one, reads as the float16 `s 0eeee mmm0000000`: the same sign, mantissa and
exponent field, under float16's exponent bias of 15 instead of e4m3's 7. So the float16 is
the e4m3 value times 2^-8, exactly, subnormals included (an e4m3 subnormal lands on a
float16 subnormal of the same digits). Callers fold the 2^8 into a scale they apply anyway.
e4m3fn's NaN bytes (0x7f, 0xff) come out as +-1.875 (times 2^8: 480), not NaN: the callers
only widen weights and cache values written by a saturating quantizer, which holds none.

`e4m3_to_f16_scaled(u, ASM)`: on the GPU (ASM true) four bytes at a time in inline PTX, two
byte permutes and three logic operations for four values; under Triton's interpreter (ASM
false, inline assembly does not run there) the same bit operations on 16-bit integers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The widened value is the e4m3 value times 2^-SHIFT.
SHIFT = 8

# Four e4m3 bytes in $2 (byte i = value i) -> float16 pairs $0 (values 0, 1) and $1 (2, 3).
# prmt puts byte i in the high byte of a 16-bit half (low byte zero): s eeee mmm 00000000;
# shifting right by one and keeping bits 13..7 gives 0 0eeee mmm 0000000; or-ing the sign
# bits back in gives the float16.
_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 lo, hi, mlo, mhi;
prmt.b32 lo, 0, $2, 0x5140;
prmt.b32 hi, 0, $2, 0x7362;
shr.b32 mlo, lo, 1;
shr.b32 mhi, hi, 1;
and.b32 mlo, mlo, 0x3f803f80;
and.b32 mhi, mhi, 0x3f803f80;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x80008000;
or.b32 $0, mlo, lo;
or.b32 $1, mhi, hi;
}""")


@triton.jit
def e4m3_to_f16_scaled(w, ASM: tl.constexpr):
    """w (a float8e4nv or uint8 tile of e4m3 bytes) -> float16 tile of w * 2^-8, exactly."""
    u = w.to(tl.uint8, bitcast=True)
    if ASM:
        out = tl.inline_asm_elementwise(_ASM, "=r,=r,r", [u], dtype=tl.float16, is_pure=True,
                                        pack=4)
    else:
        h = u.to(tl.uint16)
        out = (((h & 0x7F) << 7) | ((h & 0x80) << 8)).to(tl.float16, bitcast=True)
    return out


def use_asm(device: torch.device) -> bool:
    """Whether kernels launched for `device` take the inline-PTX widening: on CUDA devices;
    the interpreter (CPU tensors) takes the integer version (inline assembly runs on NVIDIA
    GPUs only)."""
    return device.type == "cuda"
