"""Algebraic rewrites the code generator applies before printing a kernel.

``fold_exp2``: a softmax ``exp(a - max_n a)`` whose ``a`` is a positive
scale ``c * x`` (possibly through masks) becomes ``exp2(a' - max_n a')``
with ``a' = (c * log2 e) * x``. The value is the same (max commutes with a
positive scale); the kernel saves one multiply per score element, because
``tl.exp`` itself is ``exp2(x * log2 e)`` on the GPU. FlashAttention
kernels fold the softmax scale the same way.

A mask between the scale and the softmax is rescaled with it: its fill, a
literal at most 0, is multiplied by ``log2 e`` too, in ``select(mask,
fill, .)`` and in an added ``select(mask, fill, 0)``. ``-inf`` stays
``-inf``; a finite fill stays finite, clamped to its dtype's lowest value
(``jax.nn.dot_product_attention`` fills with -0.7x float32's max, which
``log2 e`` would overflow): a row whose scores are all masked still
averages its values, and elsewhere a masked score's weight, ``exp2(fill' -
max')``, is 0 as before.

The rewrite keeps every value name, op count and loop, so a plan made for
the original region places the rewritten one unchanged. It only fires when
each rescaled value feeds nothing but the softmax (no region output, no
other consumer).

Example::

    r2 = fold_exp2(region)   # mul(s0, 0.125) ... exp(t)  ->  mul(s0, 0.18033688) ... exp2(t)
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import ml_dtypes

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


def _scaled_fill(x) -> Optional[ir.Literal]:
  """A mask's fill times ``log2 e`` (see the module docstring), or None when
  ``x`` is not a float literal at most 0."""
  if not (isinstance(x, ir.Literal) and x.dtype in ir.FLOAT_DTYPES
          and isinstance(x.value, (int, float)) and not isinstance(x.value, bool)):
    return None
  v = float(x.value)
  if not v <= 0.0:
    return None
  if math.isinf(v) or v == 0.0:
    return x
  lowest = float(ml_dtypes.finfo(ir.np_dtype(x.dtype)).min)
  return ir.Literal(max(v * _LOG2E, lowest), x.dtype)


def _masked_input(op, producer: Callable, private: Callable
                  ) -> Optional[tuple[str, ir.Elementwise]]:
  """``(x, mask)`` when ``op`` masks ``x``: ``select(cond, fill, x)``,
  ``select(cond, x, fill)`` (``mask`` is ``op``), or ``x + m`` with a
  private ``m = select(cond, f0, f1)`` of two fills (``mask`` is ``m``).
  ``mask`` comes back with its fills rescaled (``_scaled_fill``)."""
  if not isinstance(op, ir.Elementwise):
    return None
  if op.fn == "select" and len(op.args) == 3:
    cond, a, b = op.args
    for fill, x, args in ((a, b, (cond, _scaled_fill(a), b)), (b, a, (cond, a, _scaled_fill(b)))):
      if isinstance(x, str) and _scaled_fill(fill) is not None:
        return x, ir.Elementwise(op.out, "select", args)
    return None
  if op.fn == "add" and len(op.args) == 2 and all(isinstance(a, str) for a in op.args):
    for i, m in enumerate(op.args):
      sel = producer(m)
      if not (isinstance(sel, ir.Elementwise) and sel.fn == "select" and private(m)):
        continue
      f0, f1 = (_scaled_fill(f) for f in sel.args[1:])
      if f0 is not None and f1 is not None:
        return op.args[1 - i], ir.Elementwise(m, "select", (sel.args[0], f0, f1))
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
    masks = []
    while cur is not None and _scale_literal(cur) is None:
      found = _masked_input(cur, region.producer, private)
      if found is None or not private(found[0]):
        cur = None
        break
      masks.append(found[1])
      cur = region.producer(found[0])
    if cur is None:
      continue
    for m in masks:
      new_ops[m.out] = m
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
