"""Merging two Chain IR regions into one multi-output region.

``merge(a, b, a_keys, b_keys)`` returns one region computing the outputs of
both, with every op of ``b`` that computes what an op of ``a`` computes (the
same function of the same values over corresponding loops) taken once: a
common-subexpression merge. Input buffers are the same array where the
caller's keys say so (capture: the same memory at the same window, which
two buffers may view through different shapes of one size).

Why: after capture's recomputation (``capture_recompute``) an attention
training step's dk and dv products each recompute ``p = softmax(q k^T)``
from the same inputs. Two regions run two kernels that compute it twice;
one region over both runs one loop over the queries, computes ``p`` once
per tile and accumulates dk and dv side by side (FlashAttention-2's
backward kernel). Whether the merged region is worth it is the planner's
call (capture asks its model).

Example::

    m = merge(dk_region, dv_region, ["q", "k", "v", "do"], ["q", "k", "do"])
    m.region.outputs        # dk's output, then dv's
    m.shared_contractions   # 1: q @ k.T computed once
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional, Sequence

from jaxfuse import ir
from jaxfuse.ir import Buffer, Contraction, Elementwise, Iota, Loop, Reduction, Region, Value

__all__ = ["Merged", "merge"]


@dataclasses.dataclass(frozen=True)
class Merged:
  """The result of ``merge``.

  Attributes:
    region: inputs are ``a``'s, then ``b``'s that match none of them;
      outputs are ``a``'s, then ``b``'s that are not already among them.
    b_inputs: for each input of ``b``, its index in ``region.inputs``.
    b_outputs: for each output of ``b``, its index in ``region.outputs``.
    shared_ops: how many of ``b``'s ops the region takes from ``a``.
    shared_contractions: how many of those are contractions.
  """
  region: Region
  b_inputs: tuple[int, ...]
  b_outputs: tuple[int, ...]
  shared_ops: int
  shared_contractions: int


def _op_sig(op) -> tuple:
  """What two ops must have in common beyond their operands and loops."""
  if isinstance(op, Contraction):
    return ("C", op.precision, len(op.reduce))
  if isinstance(op, Elementwise):
    return ("E", op.fn, tuple(a if not isinstance(a, str) else None for a in op.args))
  if isinstance(op, Reduction):
    return ("R", op.kind)
  return ("I",)


def _op_loops(op) -> tuple[str, ...]:
  if isinstance(op, Contraction):
    return tuple(op.reduce)
  if isinstance(op, Reduction):
    return (op.loop,)
  if isinstance(op, Iota):
    return (op.loop,)
  return ()


class _Matcher:
  """Grows a value map and an injective loop map from ``b`` to ``a``."""

  def __init__(self, a: Region, b: Region, a_keys, b_keys):
    self.a_in = {buf.value: (i, buf) for i, buf in enumerate(a.inputs)}
    self.b_in = {buf.value: (i, buf) for i, buf in enumerate(b.inputs)}
    self.a_keys, self.b_keys = list(a_keys), list(b_keys)
    self.av, self.bv = a.value_map, b.value_map
    self.aext, self.bext = a.loop_extents, b.loop_extents
    self.loops: dict[str, str] = {}
    self.values: dict[str, str] = {}

  def _bind_loops(self, lmap: dict, inv: dict, lb: str, la: str) -> bool:
    if self.bext[lb] != self.aext[la]:
      return False
    if lmap.get(lb, la) != la or inv.get(la, lb) != lb:
      return False
    lmap[lb] = la
    inv[la] = lb
    return True

  def _bind_value(self, lmap, inv, vb: str, va: str) -> bool:
    """Binds the loops of ``b``'s value ``vb`` to those of ``a``'s ``va``
    (same dtype, loops in the same order) where that is consistent so far."""
    xb, xa = self.bv[vb], self.av[va]
    if xb.dtype != xa.dtype or len(xb.loops) != len(xa.loops):
      return False
    return all(self._bind_loops(lmap, inv, lb, la) for lb, la in zip(xb.loops, xa.loops))

  def _same_input(self, lmap, inv, vb: str, va: str) -> bool:
    """Input buffers: one array (the caller's key), one window, strides
    that correspond under the loop map."""
    ib, bb = self.b_in[vb]
    ia, ba = self.a_in[va]
    if self.b_keys[ib] is None or self.b_keys[ib] != self.a_keys[ia]:
      return False
    # One key is one memory: the buffers may give it different row-major
    # shapes of one size (a view); part buffers are arrays per part.
    shape = lambda buf: buf.shape if buf.part_loop else buf.size
    if (shape(bb), bb.offset, bb.window, bool(bb.part_loop)) != (
        shape(ba), ba.offset, ba.window, bool(ba.part_loop)):
      return False
    if not self._bind_value(lmap, inv, vb, va):
      return False
    if len(bb.strides) != len(ba.strides):
      return False
    if bb.part_loop and not self._bind_loops(lmap, inv, bb.part_loop, ba.part_loop):
      return False
    return all(ba.stride(lmap[lb]) == s for lb, s in bb.strides)

  def match(self, ob, oa) -> bool:
    """Whether ``oa`` computes what ``ob`` computes; binds on success."""
    if type(ob) is not type(oa) or _op_sig(ob) != _op_sig(oa):
      return False
    ins_b, ins_a = ob.inputs, oa.inputs
    if len(ins_b) != len(ins_a):
      return False
    lmap, inv, vmap = dict(self.loops), {v: k for k, v in self.loops.items()}, dict(self.values)
    for vb, va in zip(ins_b, ins_a):
      if vb in vmap:
        if vmap[vb] != va:
          return False
      elif vb in self.b_in and va in self.a_in:
        if not self._same_input(lmap, inv, vb, va):
          return False
        vmap[vb] = va
      else:
        return False
    if not all(self._bind_loops(lmap, inv, lb, la)
               for lb, la in zip(_op_loops(ob), _op_loops(oa))):
      return False
    if not self._bind_value(lmap, inv, ob.out, oa.out):
      return False
    vmap[ob.out] = oa.out
    self.loops, self.values = lmap, vmap
    return True


def _named(mapping: dict, names: Sequence[str], taken: set) -> dict:
  """``mapping`` with each of ``names`` it lacks mapped to itself, or to
  ``name_i`` where ``taken`` (or an earlier new name) has it."""
  out, taken = dict(mapping), set(taken)
  for name in names:
    if name not in out:
      new, i = name, 0
      while new in taken:
        i += 1
        new = f"{name}_{i}"
      taken.add(new)
      out[name] = new
  return out


def merge(a: Region, b: Region, a_keys: Sequence[Optional[Hashable]],
          b_keys: Sequence[Optional[Hashable]], *, name: Optional[str] = None) -> Merged:
  """One region computing the outputs of ``a`` and ``b`` (see the module
  docstring). ``a_keys[i]`` / ``b_keys[j]``: which array input i of ``a`` /
  input j of ``b`` is (equal keys: the same array; None: none other).
  Raises ``ir.IRError`` where the union is not a valid region.
  """
  if len(a_keys) != len(a.inputs) or len(b_keys) != len(b.inputs):
    raise ValueError(f"a_keys/b_keys: {len(a_keys)}/{len(b_keys)} keys for "
                     f"{len(a.inputs)}/{len(b.inputs)} inputs")
  m = _Matcher(a, b, a_keys, b_keys)
  shared_ops = shared_dots = 0
  for ob in b.ops:
    if any(x not in m.values and x not in m.b_in for x in ob.inputs):
      continue   # reads a value of b's own: computed anew
    for oa in a.ops:
      if m.match(ob, oa):
        shared_ops += 1
        shared_dots += isinstance(ob, Contraction)
        break
  for buf in b.inputs:
    # An input only unmatched ops read is still one array: read it once
    # where its loops already correspond (binding new loops here could make a
    # loop that a's ops reduce index one of b's results).
    if buf.value not in m.values:
      for va in m.a_in:
        lmap, inv = dict(m.loops), {v: k for k, v in m.loops.items()}
        if m._same_input(lmap, inv, buf.value, va) and len(lmap) == len(m.loops):
          m.values[buf.value] = va
          break
  # b's loops, values and buffers that match nothing get names of their own.
  lmap = _named(m.loops, [l.name for l in b.loops], {l.name for l in a.loops})
  new_loops = [Loop(lmap[l.name], l.extent) for l in b.loops if l.name not in m.loops]
  vmap = _named(m.values, [v.name for v in b.values], {v.name for v in a.values})
  new_values = [Value(vmap[v.name], tuple(lmap[x] for x in v.loops), v.dtype)
                for v in b.values if v.name not in m.values]

  # b's array labels (ir.Buffer.array) stay apart from a's: the keys say
  # which arrays the two share, and the caller labels the merged region.
  a_labels = max((buf.array for buf in a.inputs), default=0)

  def buffer(buf: Buffer) -> Buffer:
    return dataclasses.replace(
        buf, value=vmap[buf.value], strides=tuple((lmap[l], s) for l, s in buf.strides),
        part_loop=lmap[buf.part_loop] if buf.part_loop else "",
        array=buf.array + a_labels if buf.array else 0)

  def rename(op):
    if isinstance(op, Contraction):
      return dataclasses.replace(op, out=vmap[op.out], lhs=vmap[op.lhs], rhs=vmap[op.rhs],
                                 reduce=tuple(lmap[l] for l in op.reduce))
    if isinstance(op, Elementwise):
      return dataclasses.replace(op, out=vmap[op.out], args=tuple(
          vmap[x] if isinstance(x, str) else x for x in op.args))
    if isinstance(op, Reduction):
      return dataclasses.replace(op, out=vmap[op.out], arg=vmap[op.arg], loop=lmap[op.loop])
    return dataclasses.replace(op, out=vmap[op.out], loop=lmap[op.loop])

  a_in_index = {buf.value: i for i, buf in enumerate(a.inputs)}
  inputs = list(a.inputs)
  b_inputs = []
  for buf in b.inputs:
    if buf.value in m.values:
      b_inputs.append(a_in_index[m.values[buf.value]])
    else:
      b_inputs.append(len(inputs))
      inputs.append(buffer(buf))
  out_index = {buf.value: i for i, buf in enumerate(a.outputs)}
  outputs = list(a.outputs)
  b_outputs = []
  for buf in b.outputs:
    v = vmap[buf.value]
    if v not in out_index:
      out_index[v] = len(outputs)
      outputs.append(buffer(buf))
    b_outputs.append(out_index[v])
  new_ops = [rename(op) for op in b.ops if op.out not in m.values]
  region = Region(a.loops + tuple(new_loops), a.values + tuple(new_values), tuple(inputs),
                  tuple(outputs), a.ops + tuple(new_ops), name=name or a.name)
  return Merged(region, tuple(b_inputs), tuple(b_outputs), shared_ops, shared_dots)
