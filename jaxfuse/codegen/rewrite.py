"""Algebraic rewrites the code generator applies before printing a kernel.

``fold_exp2``: a softmax ``exp(a - max_n a)`` whose ``a`` is a positive
scale ``c * x`` (possibly through ``select(mask, -inf, .)``) becomes
``exp2(a' - max_n a')`` with ``a' = (c * log2 e) * x``. The value is the
same (max commutes with a positive scale and ``-inf`` stays ``-inf``);
the kernel saves one multiply per score element, because ``tl.exp``
itself is ``exp2(x * log2 e)`` on the GPU. FlashAttention kernels fold
the softmax scale the same way.

The rewrite keeps every value name, op count and loop, so a plan made for
the original region places the rewritten one unchanged. It only fires when
each rescaled value feeds nothing but the softmax (no region output, no
other consumer).

Example::

    r2 = fold_exp2(region)   # mul(s0, 0.125) ... exp(t)  ->  mul(s0, 0.18033688) ... exp2(t)
"""

from __future__ import annotations

import math
from typing import Optional

from jaxfuse import ir

__all__ = ["fold_exp2", "positive_scale"]

_LOG2E = 1.0 / math.log(2.0)


def _scale_literal(op) -> Optional[int]:
  """Index of a positive literal factor of ``mul(x, c)`` / ``mul(c, x)``."""
  if not (isinstance(op, ir.Elementwise) and op.fn == "mul" and len(op.args) == 2):
    return None
  for i, a in enumerate(op.args):
    other = op.args[1 - i]
    if isinstance(a, ir.Literal) and isinstance(other, str) and a.dtype in ir.FLOAT_DTYPES:
      v = a.value
      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return i
  return None


def positive_scale(op) -> Optional[tuple[str, ir.Literal]]:
  """``(x, c)`` when ``op`` is ``mul(x, c)`` or ``mul(c, x)`` with ``c`` a
  finite positive float literal, else None."""
  i = _scale_literal(op)
  if i is None:
    return None
  return op.args[1 - i], op.args[i]


def _masked_input(op) -> Optional[str]:
  """``x`` of ``select(cond, -inf, x)`` or ``select(cond, x, -inf)``."""
  if not (isinstance(op, ir.Elementwise) and op.fn == "select" and len(op.args) == 3):
    return None
  _, a, b = op.args
  def neg_inf(x):
    return isinstance(x, ir.Literal) and isinstance(x.value, float) and x.value == -math.inf
  if neg_inf(a) and isinstance(b, str):
    return b
  if neg_inf(b) and isinstance(a, str):
    return a
  return None


def fold_exp2(region: ir.Region) -> ir.Region:
  """Returns ``region`` with each foldable softmax ``exp`` turned into
  ``exp2`` and its scale multiplied by ``log2 e`` (see the module
  docstring); ``region`` itself when nothing folds."""
  outputs = set(region.output_names)
  uses: dict[str, int] = {}
  for op in region.ops:
    for x in op.inputs:
      uses[x] = uses.get(x, 0) + 1

  def private(name: str, n: int = 1) -> bool:
    return name not in outputs and uses.get(name, 0) == n

  new_ops = {op.out: op for op in region.ops}
  changed = False
  for op in region.ops:
    if not (isinstance(op, ir.Elementwise) and op.fn == "exp" and len(op.args) == 1
            and isinstance(op.args[0], str)):
      continue
    z = region.producer(op.args[0])
    if not (isinstance(z, ir.Elementwise) and z.fn == "sub" and len(z.args) == 2
            and all(isinstance(a, str) for a in z.args) and private(z.out)):
      continue
    a, mx = z.args
    red = region.producer(mx)
    if not (isinstance(red, ir.Reduction) and red.kind == "max" and red.arg == a
            and private(mx)):
      continue
    # a feeds the max and the sub only; walk down to the scale through masks
    if not private(a, 2):
      continue
    cur = region.producer(a)
    chain_ok = True
    while cur is not None and _scale_literal(cur) is None:
      x = _masked_input(cur)
      if x is None or not private(x):
        chain_ok = False
        break
      cur = region.producer(x)
    if not chain_ok or cur is None:
      continue
    i = _scale_literal(cur)
    lit = cur.args[i]
    args = list(cur.args)
    args[i] = ir.Literal(float(lit.value) * _LOG2E, lit.dtype)
    new_ops[cur.out] = ir.Elementwise(cur.out, "mul", tuple(args))
    new_ops[op.out] = ir.Elementwise(op.out, "exp2", op.args)
    changed = True
  if not changed:
    return region
  return ir.Region(region.loops, region.values, region.inputs, region.outputs,
                   tuple(new_ops[op.out] for op in region.ops), name=region.name)
