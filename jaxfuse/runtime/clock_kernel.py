"""The Triton kernel behind ``device_clock.stamp`` (its own module so that
Triton is imported only when a stamp is made)."""

import triton
import triton.language as tl


@triton.jit
def jaxfuse_clock_stamp(dep_ptr, out_ptr):  # pylint: disable=unused-argument
  """Writes %globaltimer (ns, the same clock on every SM) to out_ptr[0:2] as
  low and high 32-bit words. dep_ptr is never read: it only orders the
  launch after its producer."""
  t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                is_pure=False, pack=1)
  tl.store(out_ptr, (t & 0xFFFFFFFF).to(tl.int32))
  tl.store(out_ptr + 1, (t >> 32).to(tl.int32))
