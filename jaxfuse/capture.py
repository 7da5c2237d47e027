"""Capture: find fusible chains of contractions in a jaxpr and rewrite them.

A *region* is a linear chain of two or more ``dot_general``s (float16,
bfloat16 or float32), each consuming the previous one's output through cheap
ops (scale, bias, casts, masks incl. causal masks from iota, activations, row
reductions forming softmax, layout ops), plus the pointwise epilogue of the
last contraction and the pointwise/layout prologue of its other operands. A
single contraction is a region too when XLA would run part of its epilogue
in kernels of its own after the GEMM (GELU, SiLU; ``ir.xla_epilogue_split``):
fusing the epilogue saves those kernels' passes over the GEMM's result.
So is a vector-matrix product (one row, e.g. a decoding step at batch 1),
which XLA runs as a reduction (``ir.vector_dot_dims``). Regions are
expressed in the Chain IR (:mod:`jaxfuse.ir`); layout ops fold into the
index maps of the region's input/output buffers.

Capture inlines ``pjit``/``closed_call`` for analysis, looks through
``custom_jvp_call``/``custom_vjp_call`` (a call a region does not absorb whole
is re-emitted as the original call, keeping its custom rule) and recurses
into the bodies of ``remat``, ``scan``, ``cond`` and ``while`` (regions there
are rewritten inside the bodies).

Example::

    closed = jax.make_jaxpr(attention)(q, k, v)
    for r in find_regions(closed):
      print(r.path or "<top>", r.source)
      print(r.region)                        # the Chain IR
    new = rewrite(closed, lambda cap, *xs: None)   # None: keep the original ops
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

from jaxfuse import capture_recompute, ir, ir_merge
from jaxfuse.config import config
from jaxfuse.capture_flat import (
    CUSTOM_CALLS, ClosedJaxpr, FVar, Item, Level, aval_of, bind_eqn, eval_jaxpr,
    flatten, hoist_consts, is_lit, live_code, shard_map_like, trace)
from jaxfuse.capture_ir import (
    LAYOUT_PRIMS, POINTWISE_PRIMS, PRIMITIVES, REDUCE_PRIMS, WINDOW_PRIMS,
    Reject, build_region, contraction_size, is_contraction, window_starts)
from jaxfuse.capture_slices import emit_original, push_slices, unabsorbed

__all__ = ["CapturedRegion", "find_regions", "rewrite"]

# Limits that keep analysis linear-ish on big programs.
_MAX_REACH = 512       # items explored forward/backward from one contraction
_MAX_PROLOGUE = 64     # prologue items pulled into one region
_MAX_BARRIER_ROUNDS = 32
# Longest chain fused into one region: MCFuser/Chimera plan chains of 2-3
# contractions; longer chains are split into several regions.
_MAX_CONTRACTIONS = 4
# Most sibling contractions one region takes (``_LevelAnalysis.sibling_regions``).
_MAX_PARTS = 8
# Most sibling contractions joined into one chain link (``joined_groups``).
_MAX_JOINED = 4
# Candidate variants tried per chain, most inclusive first:
# (epilogue, one input buffer per use, prologue).
_VARIANTS = (("rows", False, True), ("all", False, True), ("all", True, True),
             ("pointwise", False, True),
             ("none", False, True), ("none", True, True), ("all", False, False),
             ("none", True, False))


@dataclasses.dataclass
class CapturedRegion:
  """One fusible region found in a jaxpr.

  Attributes:
    region: the Chain IR (inputs/outputs in operand order).
    jaxpr: the region's original ops as a ClosedJaxpr: takes the inputs in
      ``region.inputs`` order, returns the outputs in ``region.outputs`` order.
    source: ``file:line`` of the first contraction, or "".
    path: where it was found, e.g. ``"scan/body"``; "" for the top level.
    same_as: for each region input, the index of the first region input
      that receives the same array (itself when none before it does): the
      windows of one array (``jnp.split(qkv, 3, -1)``) are one input each.

  Example::

    [r] = find_regions(jax.make_jaxpr(lambda a, b, d: (a @ b) @ d)(a, b, d))
    r.region.einsum_summary()     # 'mk,kn->mn ; mn,nh->mh'
  """
  region: ir.Region
  jaxpr: ClosedJaxpr
  source: str
  path: str
  same_as: tuple[int, ...] = ()


# --------------------------------------------------------------------------
# Level analysis
# --------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Found:
  chain: list            # dot items
  items: list            # all item indices in the region (sorted)
  removed: set           # item indices replaced by the region
  inputs: list           # FVars, one per input buffer
  input_src: list        # the level's FVar each input reads (repeats allowed)
  outputs: list          # FVars
  region: ir.Region
  sub_items: dict = dataclasses.field(default_factory=dict)   # idx -> Item reading inputs
  group_invars: dict = dataclasses.field(default_factory=dict)  # custom call -> its args
  captured: CapturedRegion | None = None
  # A merged region's input FVars that another of its inputs stands for
  # (``_LevelAnalysis.merge_regions``): alias -> the one in ``inputs``.
  aliases: dict = dataclasses.field(default_factory=dict)


# An op with several operands computed outside joins a region's prologue when
# each is at most this fraction of its result (``prologue_ok``).
_SMALL_OPERAND_RATIO = 16


def _dtype(a) -> str:
  return np.dtype(a.aval.dtype).name


def _is_vector_dot(it: Item) -> bool:
  """A dot XLA runs as a reduction (``ir.vector_dot_dims``): fused on its
  own even with no epilogue to cut, since one kernel that streams the
  matrix beats XLA's multiply and reduction kernels."""
  (lc, rc), (lb, rb) = it.params["dimension_numbers"]
  ls, rs = (tuple(v.aval.shape) for v in it.invars)
  free = lambda shape, used: math.prod(d for i, d in enumerate(shape) if i not in used)
  return ir.vector_dot_dims(free(ls, set(lc) | set(lb)), free(rs, set(rc) | set(rb)),
                            math.prod(ls[i] for i in lb))


_CHEAP = PRIMITIVES - {"dot_general"}


def _row_reduction(r: Item, d: Item) -> bool:
  """Whether ``r`` reduces a value of ``d``'s result shape over free axes
  of one of ``d``'s operands only (rows of ``rowsum(p * dp)``): a kernel
  tiles the other operand's axes across programs and streams the reduced
  ones, so the reduction is one more accumulator. A reduction over both
  sides' axes (a loss summed to a scalar) crosses programs and is not."""
  if r.prim not in REDUCE_PRIMS or tuple(r.invars[0].aval.shape) != tuple(d.outvars[0].aval.shape):
    return False
  (lc, rc), (lb, _) = d.params["dimension_numbers"]
  nl = len(d.invars[0].aval.shape) - len(lc) - len(lb)
  lhs = set(range(len(lb), len(lb) + nl))
  rhs = set(range(len(lb) + nl, len(r.invars[0].aval.shape)))
  axes = set(r.params["axes"])
  return bool(axes) and (axes <= lhs or axes <= rhs)


def _nbytes(v) -> int:
  return math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize


def _fewest_written(lvl: Level, items: Sequence[Item], fixed: set[int], epilogue: set[int],
                    inside: set[int]) -> set[int]:
  """The ops of ``epilogue`` a region keeps: the epilogue-closed subset (an
  op kept keeps its epilogue producers) under which the region writes, and
  the ops after it read back, the fewest bytes; the largest such subset
  where several tie.

  Why: XLA fuses an elementwise op into the reduction or loop fusion that
  reads it, so the values a region's epilogue hands to such ops are written
  and read back only because the region drew its edge there. BERT-Small's
  backward GEMM with its LayerNorm-backward epilogue wrote five float32
  [8, 512, 512] products (40 MiB) where its float16 sum (4 MiB) suffices;
  the isolated keep-or-drop timing could not see it (37.2 against 37.9 us),
  and kept fused it cost the training step 10% (H100, eighty-sixth
  session). A value returned by the program or read by a contraction
  outside is written either way, so its producer is kept.

  ``items``: the level's items by index; ``fixed``: the region's ops
  before its epilogue (kept); ``inside``: every op of the region. A
  minimum cut (Edmonds-Karp) over producer -> value -> consumer edges:
  each value written costs its bytes once, and once more for each op
  outside that reads it back (a row dot of a returned output stays in the
  region, where it costs no second pass over that output)."""
  src, snk = ("src",), ("snk",)
  cap: dict = {}

  def edge(a, b, c):
    cap.setdefault(a, {})
    cap.setdefault(b, {})
    cap[a][b] = cap[a].get(b, 0) + c
    cap[b].setdefault(a, 0)

  inf = math.inf
  for i in fixed:
    edge(src, ("op", i), inf)
  for i in fixed | epilogue:
    it = items[i]
    for k, v in enumerate(it.outvars):
      node = ("v", i, k)
      edge(("op", i), node, _nbytes(v))
      if v in lvl.out_set:
        edge(node, snk, inf)
        edge(src, ("op", i), inf)
      for c in lvl.consumers.get(v, ()):
        if c.idx in epilogue:
          edge(node, ("op", c.idx), inf)
          edge(("op", i), ("op", c.idx), _nbytes(v))   # read back if c is left out
        elif c.idx in inside or is_contraction(c):
          edge(src, ("op", i), inf)
          if c.idx not in inside:
            edge(node, snk, inf)
        else:
          edge(node, snk, inf)
          edge(("op", i), snk, _nbytes(v))
    if i in epilogue:
      for a in it.invars:
        q = lvl.producer.get(a) if isinstance(a, FVar) else None
        if q is not None and q.idx in epilogue:
          edge(("op", i), ("op", q.idx), inf)
  while True:   # augmenting paths, shortest first
    prev = {src: None}
    todo = [src]
    while todo and snk not in prev:
      nxt = []
      for a in todo:
        for b, c in cap[a].items():
          if c > 0 and b not in prev:
            prev[b] = a
            nxt.append(b)
      todo = nxt
    if snk not in prev:
      break
    path, b = [], snk
    while prev[b] is not None:
      path.append((prev[b], b))
      b = prev[b]
    f = min(cap[a][b] for a, b in path)
    if f == inf:   # cannot happen: every path crosses a value's finite edge
      return set(epilogue)
    for a, b in path:
      cap[a][b] -= f
      cap[b][a] += f
  # The largest minimum cut: every node that cannot reach the sink in the
  # residual graph stays.
  reach, todo = {snk}, [snk]
  while todo:
    b = todo.pop()
    for a in cap.get(b, {}):
      if a not in reach and cap[a].get(b, 0) > 0:
        reach.add(a)
        todo.append(a)
  return {i for i in epilogue if ("op", i) not in reach}


def _is_cheap(it: Item) -> bool:
  return it.eqn.primitive.name in _CHEAP


class _LevelAnalysis:
  """Finds the regions of one flattened level."""

  def __init__(self, lvl: Level, limit: int = _MAX_CONTRACTIONS):
    self.lvl = lvl
    self.limit = limit   # most contractions per region
    self.items = lvl.items
    self._const_like: dict[int, bool] = {}
    self.taken: set[int] = set()   # items replaced by regions found so far
    self._bwd: dict = {}
    self._fwd: dict = {}
    self.joined: dict[int, list[Item]] = {}   # chains(): joined sibling groups
    self.no_join: set[int] = set()   # dots of groups no region took
    self.middles: dict[int, set] = {}   # chains(): chain -> ops between its dots
    self._whole: dict[int, tuple[set, dict]] = {}   # whole_reach() per dot
    self.chain_index: dict[int, int] = {}   # chains(): dot idx -> its chain

  # ---- reachability -------------------------------------------------------
  def fwd(self, d: Item, through_reductions: bool = True) -> tuple[set, dict]:
    """Cheap items reachable from ``d``'s outputs, and the dots they reach
    (dot idx -> operand positions reached); without ``through_reductions``,
    only along paths that reduce nothing."""
    seen: set[int] = set()
    fvars = set(d.outvars)
    stack = list(d.outvars)
    dots: dict[int, set] = {}
    while stack:
      v = stack.pop()
      for c in self.lvl.consumers.get(v, ()):
        if c.idx in seen:
          continue
        if is_contraction(c):
          dots.setdefault(c.idx, set())
          continue
        if (_is_cheap(c) and len(seen) < _MAX_REACH
            and (through_reductions or c.prim not in REDUCE_PRIMS)):
          seen.add(c.idx)
          fvars.update(c.outvars)
          stack.extend(c.outvars)
    reached = {}
    for x in dots:
      pos = {p for p in (0, 1) if self.items[x].invars[p] in fvars}
      reached[x] = pos
    return seen, reached

  def whole_reach(self, d: Item) -> tuple[set, dict]:
    """``fwd(d)`` along paths that reduce nothing (cached)."""
    if d.idx not in self._whole:
      self._whole[d.idx] = self.fwd(d, through_reductions=False)
    return self._whole[d.idx]

  def bwd(self, atom) -> set:
    """Cheap items that ``atom`` is computed from (through cheap items)."""
    key = atom if isinstance(atom, FVar) else None
    if key is not None and key in self._bwd:
      return self._bwd[key]
    seen: set[int] = set()
    stack = [atom]
    while stack:
      a = stack.pop()
      if not isinstance(a, FVar):
        continue
      p = self.lvl.producer.get(a)
      if p is None or p.idx in seen or not _is_cheap(p) or len(seen) >= _MAX_REACH:
        continue
      seen.add(p.idx)
      stack.extend(p.invars)
    if key is not None:
      self._bwd[key] = seen
    return seen

  # ---- chains ------------------------------------------------------------
  def sibling_keys(self, d: Item) -> list:
    """Keys under which ``d`` is a sibling of other dots: an operand it
    shares, at the same position, with the same shapes, dtypes and
    dimension numbers (``x @ wq``, ``x @ wk``)."""
    keys = []
    for pos in (0, 1):
      a = d.invars[pos]
      if isinstance(a, FVar) and not self.const_like(a):
        keys.append((a, pos, tuple(tuple(x.aval.shape) for x in d.invars),
                     tuple(_dtype(x) for x in d.invars),
                     repr(sorted(d.params.items(), key=str))))
    return keys

  @staticmethod
  def parallel_key(d: Item) -> tuple:
    """Key under which ``d`` may be joined with a dot that shares no operand
    with it: the same result extents in any axis order, each contracting
    the same number of elements (``q @ k.T`` and ``do @ v.T`` in
    attention's backward, whose results meet in ``p * (dp - D)``; in
    ``jax.nn.dot_product_attention``'s they come out [B, H, T, 1, T] in
    float32 and [B, H, 1, T, T] in float16, and the join is on their
    transposes). Whether they meet is ``joined_groups``'s test."""
    return ("parallel", tuple(sorted(d.outvars[0].aval.shape)),
            contraction_size(d))

  def joined_groups(self, dots: list[Item], fwd: dict) -> dict[int, list[Item]]:
    """Dots whose results meet in cheap ops: siblings reading one operand
    (``silu(x @ wg) * (x @ wu)``, a gated MLP) or parallel dots of one result
    shape (``p * (dp - D)`` with ``s = q @ k.T`` and ``dp = do @ v.T``):
    first dot's idx -> the group, first dot first.

    Why: XLA runs the join as a kernel of its own after the GEMMs (it fuses
    an epilogue into a GEMM only as single-use ops of one dot's result); one
    region computes the contractions in one loop, over the shared operand
    where there is one, and applies the join on chip, so neither result is
    written. A group is one link of a chain."""
    by_key: dict = {}
    for d in dots:
      if d.idx not in self.taken and d.idx not in self.no_join:
        for key in (*self.sibling_keys(d), self.parallel_key(d)):
          by_key.setdefault(key, []).append(d)
    full: dict[int, set] = {}

    def meet(d1: Item, d2: Item) -> bool:
      # Where their whole results meet, not through a row statistic of
      # either: a training step's forward q @ k.T reaches the backward's
      # p * (dp - D) through its softmax's row max and sum (the forward's
      # probabilities), where a recomputing backward's q @ k.T reads the
      # forward's statistics as inputs.
      for d in (d1, d2):
        if d.idx not in full:
          stats = self.lvl.depends({i for i in fwd[d.idx][0]
                                    if self.items[i].prim in REDUCE_PRIMS})
          full[d.idx] = {i for i in self.whole_reach(d)[0] if not stats(self.items[i])}
      return bool(full[d1.idx] & full[d2.idx])
    parent: dict[int, int] = {}

    def find(i: int) -> int:
      while parent.get(i, i) != i:
        i = parent[i]
      return i

    for ds in by_key.values():
      for i, d1 in enumerate(ds):
        _, r1 = fwd[d1.idx]
        for d2 in ds[i + 1:]:
          _, r2 = fwd[d2.idx]
          if (meet(d1, d2) and d2.idx not in r1 and d1.idx not in r2
              and not self.lvl.depends({min(d1.idx, d2.idx)})(
                  self.items[max(d1.idx, d2.idx)])):
            # (Not a dot computed from the other's result through further
            # dots: BERT's output projection and the MLP's down projection
            # after it meet in the residual add.)
            a, b = find(d1.idx), find(d2.idx)
            if a != b:
              parent[max(a, b)] = min(a, b)
    groups: dict[int, list[Item]] = {}
    for d in dots:
      groups.setdefault(find(d.idx), []).append(d)
    return {l: ms for l, ms in groups.items() if 2 <= len(ms) <= _MAX_JOINED}

  def members(self, d: Item) -> list[Item]:
    """The dots a chain element stands for: its joined group, or itself."""
    return self.joined.get(d.idx, [d])

  def chains(self) -> list[list[Item]]:
    dots = [it for it in self.items if is_contraction(it)]
    fwd = {d.idx: self.fwd(d) for d in dots}
    self._fwd = fwd
    self.joined = self.joined_groups(dots, fwd)
    follower = {m.idx for ms in self.joined.values() for m in ms[1:]}
    for lead, ms in self.joined.items():
      # The group's reach is its members' together.
      seen = set().union(*(fwd[m.idx][0] for m in ms))
      reached: dict[int, set] = {}
      for m in ms:
        for x, pos in fwd[m.idx][1].items():
          reached.setdefault(x, set()).update(pos)
      fwd[lead] = (seen, reached)
    dots = [d for d in dots if d.idx not in follower]
    if len(dots) < 2:
      return []
    incoming: dict[int, list] = {}
    for d in dots:
      seen, reached = fwd[d.idx]
      for x, pos in sorted(reached.items()):
        if len(pos) != 1 or x in follower:
          continue
        p = next(iter(pos))
        mids = seen & self.bwd(self.items[x].invars[p])
        trivial = all(self.items[i].prim in LAYOUT_PRIMS
                      or self.items[i].prim == "convert_element_type" for i in mids)
        reduces = any(self.items[i].prim in ("reduce_max", "reduce_sum") for i in mids)
        incoming.setdefault(x, []).append((d.idx, trivial, reduces))
    pred: dict[int, int] = {}
    size = lambda a: math.prod(a.aval.shape)
    for x, cands in incoming.items():
      if len(cands) > 1:
        # A dot reaching x only through a row statistic (a training step's
        # forward q @ k.T, whose row max and sum the backward's products
        # read) or through a broadcast of a narrower result (the backward's
        # rowsum(do * o)) is not x's chain predecessor when one other dot
        # reaches x's operand whole.
        operand = self.items[x].invars[next(iter(fwd[cands[0][0]][1][x]))]
        whole = [c for c in cands
                 if size(self.items[c[0]].outvars[0]) >= size(operand)
                 and any(x in self.whole_reach(m)[1]
                         for m in self.members(self.items[c[0]]))]
        if len(whole) == 1:
          cands = whole
      if len(cands) == 1:
        pred[x] = cands[0][0]
      else:
        # The chain's intermediate is the operand that went through a row
        # reduction (softmax, normalisation); projections feeding the other
        # operands (x @ wv + bv, reshaped to heads) are plain inputs.
        reducing = [c for c, _, r in cands if r]
        nontrivial = [c for c, t, _ in cands if not t]
        if len(reducing) == 1:
          pred[x] = reducing[0]
        elif len(nontrivial) == 1:
          pred[x] = nontrivial[0]
    succ: dict[int, int] = {}
    for x in sorted(pred):
      succ.setdefault(pred[x], x)
    pred = {x: d for d, x in succ.items()}
    chains = []
    for d in dots:
      if d.idx in pred or d.idx not in succ:
        continue
      ch = [d]
      while ch[-1].idx in succ:
        ch.append(self.items[succ[ch[-1].idx]])
      chains.append(ch)
    # Each chain's middle ops, which another chain's epilogue must not take.
    self.middles, self.chain_index = {}, {}
    for i, ch in enumerate(chains):
      self.middles[i] = set().union(*(self.link_middles(d, x) for d, x in zip(ch, ch[1:])))
      for d in ch:
        self.chain_index[d.idx] = i
    return chains

  def link_middles(self, d: Item, x: Item) -> set:
    """The cheap ops between chain link ``d`` and the next, ``x``: those
    ``d``'s result reaches that ``x``'s intermediate operand is computed
    from. Raises Reject when ``d`` no longer reaches one operand of ``x``."""
    seen, reached = self._fwd[d.idx]
    pos = reached.get(x.idx, set())
    if len(pos) != 1:
      raise Reject("chain link lost")
    return seen & self.bwd(x.invars[next(iter(pos))])

  # ---- candidate regions --------------------------------------------------
  def const_like(self, a, depth: int = 0) -> bool:
    """Literals, scalars and values computed from them and iotas alone."""
    if is_lit(a) or len(a.aval.shape) == 0:
      return True
    p = self.lvl.producer.get(a)
    if p is None:
      return False
    if p.idx in self._const_like:
      return self._const_like[p.idx]
    ok = False
    if depth < 16 and (p.prim == "iota" or (
        (p.prim in POINTWISE_PRIMS or p.prim in LAYOUT_PRIMS)
        and all(self.const_like(x, depth + 1) for x in p.invars))):
      ok = True
    self._const_like[p.idx] = ok
    return ok

  def read_outside(self, v: FVar, members: set[int]) -> bool:
    """Is ``v`` read by an op outside ``members`` (or returned)?"""
    lvl = self.lvl
    return v in lvl.out_set or any(c.idx not in members for c in lvl.consumers.get(v, ()))

  def narrow_read_outside(self, p: Item, members: set[int]) -> bool:
    """Is ``p``'s result, or a view of it the region takes (a transpose
    to heads), read outside ``members``? Then XLA writes that narrow
    value anyway. (Autodiff's float16 cotangent is cast once and
    transposed once for dv, dq and dk: a region that took the cast read
    float32 on every step of its loop; 943 against 443 us for dk,
    token-major against head-major, H100, seventy-eighth session.)"""
    stack = list(p.outvars)
    seen: set = set()
    while stack:
      v = stack.pop()
      if v in seen:
        continue
      seen.add(v)
      if self.read_outside(v, members):
        return True
      for c in self.lvl.consumers.get(v, ()):
        if c.idx in members and c.prim in LAYOUT_PRIMS:
          stack.extend(c.outvars)
    return False

  def view_of_several_dots(self, p: Item, removed: set[int]) -> bool:
    """Is ``p`` a layout op whose result several of the region's
    contractions read? Taken, it would be one value inside the region and
    give its readers one set of loops, undoing the split of inputs per use:
    ``jax.nn.dot_product_attention`` reshapes q to add a group axis, and
    its backward's dk = ds.T @ q keeps the head dim that the recomputed
    s = q @ k.T reduces. Left out, each reads the view (free in XLA)
    through its own buffer."""
    if p.prim not in LAYOUT_PRIMS:
      return False
    return sum(1 for o in p.outvars for c in self.lvl.consumers.get(o, ())
               if c.idx in removed and is_contraction(c)) > 1

  def narrows(self, p: Item) -> bool:
    """Does ``p`` read more bytes than it writes (a float32 -> float16 cast)?"""
    def nbytes(a) -> int:
      return int(np.prod(a.aval.shape, dtype=np.int64)) * np.dtype(a.aval.dtype).itemsize
    try:
      read = sum(nbytes(a) for a in p.invars if isinstance(a, FVar) and not self.const_like(a))
      return read > sum(nbytes(o) for o in p.outvars)
    except TypeError:   # an extended dtype (PRNG keys) has no itemsize
      return False

  def prologue_ok(self, p: Item, dep, members: set[int]) -> bool:
    if p.prim in WINDOW_PRIMS:
      # A static window of a value computed outside: the kernel reads it in
      # place (the value becomes the region input; capture_ir.window_starts).
      return (p.idx not in self.taken and not dep(p) and window_starts(p) is not None
              and not self.const_like(p.invars[0]))
    if not _is_cheap(p) or p.prim in REDUCE_PRIMS or p.idx in self.taken:
      return False
    if dep(p):
      return False
    if self.narrows(p) and self.narrow_read_outside(p, members):
      # XLA writes the narrow result for its other readers anyway (fused into
      # its producer); the kernel reads that instead of the wide operand. A
      # BERT training step's float32 residual cast for the q/k/v projection
      # is also the weight gradient's operand: absorbed, the kernel read
      # float32 and XLA ran the cast as a kernel of its own (H100, seventy-
      # second session).
      return False
    if p.prim in LAYOUT_PRIMS or p.prim in ("convert_element_type", "iota"):
      return True
    big = [a for a in p.invars if not self.const_like(a)]
    # Several operands computed outside are taken only where each is a small
    # broadcast of the result (a padding mask's row and key halves, [B, T, 1]
    # and [B, 1, T] for [B, T, T]): the kernel then computes what XLA would
    # otherwise write and it would read.
    size = lambda a: int(np.prod(a.aval.shape, dtype=np.int64))
    return len(big) <= 1 or all(size(a) * _SMALL_OPERAND_RATIO <= size(p.outvars[0])
                                for a in big)

  def candidate(self, chain: list[Item], epilogue: str, split_inputs: bool,
                prologue: bool = True) -> _Found:
    """The region of ``chain``: its middle ops, an epilogue ('rows': 'all'
    and row reductions (``_row_reduction``) where they leave every output
    narrower than the last contraction's result; 'all', 'pointwise',
    'elementwise' (no layout ops) or 'none'), the prologue of
    its other operands (when ``prologue``), inputs (one buffer per use when ``split_inputs``) and
    outputs. Raises Reject when it is not valid to fuse."""
    lvl = self.lvl
    removed: set[int] = {m.idx for d in chain for m in self.members(d)}
    for d, x in zip(chain, chain[1:]):
      removed |= self.link_middles(d, x)
    # Epilogue: pointwise/layout consumers of the last contraction.
    rows_taken = False
    if epilogue == "rows" and not self.row_reduced(chain[-1]):
      raise Reject("no row reduction of the result")
    if epilogue != "none":
      last = self.members(chain[-1])
      tail = {m.idx for m in last}
      stack = [o for m in last for o in m.outvars]
      allowed = PRIMITIVES - REDUCE_PRIMS - {"dot_general", "iota"}
      if epilogue == "pointwise":
        allowed = allowed - {"broadcast_in_dim"}
      elif epilogue == "elementwise":
        allowed = allowed & POINTWISE_PRIMS
      dep = lvl.depends(removed)   # sees the items added below (same set)
      # Not the ops between another chain's dots (a training step's forward
      # attention, whose rowsum(do * o) the backward's p * (dp - D) reads,
      # would take the middle of the backward's chain).
      own = self.chain_index.get(chain[0].idx)
      others = set().union(*(m for i, m in self.middles.items() if i != own))
      while stack:
        v = stack.pop()
        for c in sorted(lvl.consumers.get(v, ()), key=lambda c: c.idx):
          if c.idx in removed or c.idx in others:
            continue
          if c.prim not in allowed and not (epilogue == "rows" and _row_reduction(c, last[0])):
            continue
          ok = True
          for a in c.invars:
            if not isinstance(a, FVar):
              continue
            q = lvl.producer.get(a)
            if q is None:
              continue
            if q.idx in removed:
              if q.idx not in tail:
                ok = False
            elif dep(q):
              ok = False
          if ok:
            removed.add(c.idx)
            tail.add(c.idx)
            stack.extend(c.outvars)
      epi = tail - {m.idx for m in last}
      if epi:
        keep = _fewest_written(lvl, self.items, removed - epi, epi, removed)
        removed -= epi - keep
        rows_taken = any(self.items[i].prim in REDUCE_PRIMS for i in keep)
    dep = lvl.depends(removed)
    # Prologue: cheap producers of the other operands.
    members = set(removed)
    stack = [self.items[i] for i in sorted(removed)]
    while stack:
      it = stack.pop()
      for a in it.invars:
        if not isinstance(a, FVar):
          continue
        p = lvl.producer.get(a)
        if p is None or p.idx in members:
          continue
        if (prologue and len(members) - len(removed) < _MAX_PROLOGUE
            and self.prologue_ok(p, dep, members)
            and not (split_inputs and self.view_of_several_dots(p, removed))):
          members.add(p.idx)
          if p.prim not in WINDOW_PRIMS:   # a window's operand stays an input
            stack.append(p)
    # A window is read in place only when its operand is read by nothing else
    # in the region (else it stays XLA's copy, as before).
    for i in sorted(members - removed):
      w = self.items[i]
      if w.prim in WINDOW_PRIMS:
        src = w.invars[0]
        p = lvl.producer.get(src)
        if (p is not None and p.idx in members) or any(
            src in self.items[j].invars for j in members
            if self.items[j].prim not in WINDOW_PRIMS):
          members.discard(i)
    # A custom call (e.g. jax.nn.softmax on jax >= 0.11) whose ops are all in
    # the region and partly replaced is absorbed whole: its chain-independent
    # ops (such as a cast of its -inf argument) are replaced too.
    for g in lvl.groups.values():
      gi = set(g.items)
      if gi and gi & removed and gi <= members and not gi <= removed:
        removed |= gi
    # A result read outside only by one transpose is written in the
    # transpose's layout: XLA would copy it (autodiff's forward attention
    # writes o for the backward and transposes it for the loss, 43 us at
    # 8 x 16 heads x 2048 tokens on an H100).
    for i in sorted(removed):
      for o in self.items[i].outvars:
        outside = [c for c in lvl.consumers.get(o, ()) if c.idx not in removed]
        if (len(outside) == 1 and outside[0].prim == "transpose" and o not in lvl.out_set
            and not outside[0].groups):
          removed.add(outside[0].idx)
          members.add(outside[0].idx)
    dep = lvl.depends(removed)
    order = sorted(members)
    produced = set()
    for i in order:
      for a in self.items[i].invars:
        if isinstance(a, FVar) and a not in produced:
          q = lvl.producer.get(a)
          if q is not None and dep(q):
            raise Reject("the region is not convex (an input depends on it)")
      produced.update(self.items[i].outvars)
    # Region inputs. With split_inputs, one buffer per use (per item operand,
    # or per argument of a custom call absorbed whole): the same array read
    # through different index maps (e.g. (x @ w) @ w) must not force its
    # loops equal. The region's jaxpr reads each use from its own input.
    inputs: list[FVar] = []
    input_src: list[FVar] = []
    alias: dict = {}

    def use(a, key):
      if key not in alias:
        alias[key] = FVar(a.aval) if split_inputs else a
        inputs.append(alias[key])
        input_src.append(a)
      return alias[key]

    def internal(a) -> bool:
      p = lvl.producer.get(a)
      return p is not None and p.idx in members

    sub_items: dict[int, Item] = {}
    group_invars: dict = {}
    for i in order:
      it = self.items[i]
      g = it.groups[0] if it.groups else None
      if g is not None and g not in group_invars:
        group_invars[g] = [
            use(a, (g, a) if split_inputs else a)
            if isinstance(a, FVar) and not internal(a) else a
            for a in lvl.groups[g].invars]
      nv = []
      for pos, a in enumerate(it.invars):
        if isinstance(a, FVar) and not internal(a):
          key = a if not split_inputs else ((g, a) if g is not None else (i, pos))
          if it.prim in WINDOW_PRIMS:
            key = ("window", i)
          nv.append(use(a, key))
        else:
          nv.append(a)
      if it.prim in WINDOW_PRIMS and not internal(it.invars[0]):
        # One input buffer per window the region reads, all of them the
        # same array (capture_ir gives each its offset).
        reads = {x for j in order if j != i for x in self.items[j].invars if isinstance(x, FVar)}
        for _ in range(sum(o in reads for o in it.outvars) - 1):
          inputs.append(nv[0])
          input_src.append(it.invars[0])
      sub_items[i] = Item(it.idx, it.eqn, nv, it.outvars, it.groups)
    outputs: list[FVar] = []
    for i in sorted(removed):
      for o in self.items[i].outvars:
        if self.read_outside(o, removed):
          outputs.append(o)
    if not outputs:
      raise Reject("the region's results are unused")
    if epilogue == "rows":
      # Row reductions are taken where they keep a product off memory
      # (rowsum(p * dp)), not where the region writes a value as large
      # anyway (a LayerNorm after a GEMM: that is the 'all' variant's).
      size = math.prod(chain[-1].outvars[0].aval.shape)
      if not rows_taken or any(math.prod(o.aval.shape) >= size for o in outputs):
        raise Reject("no row reduction narrows the outputs")
    region = build_region([sub_items[i] for i in order], inputs, outputs,
                          [sub_items[d.idx] for d in chain])
    return _Found(chain, order, removed, inputs, input_src, outputs, region,
                  sub_items, group_invars)

  def row_reduced(self, d: Item) -> bool:
    """Whether a ``_row_reduction`` reads ``d``'s (or its joined group's)
    result through cheap ops that reduce nothing."""
    for m in self.members(d):
      for i in (m.idx, *self.whole_reach(m)[0]):
        for o in self.items[i].outvars:
          if any(_row_reduction(c, m) for c in self.lvl.consumers.get(o, ())):
            return True
    return False

  def reread_after(self, d: Item) -> bool:
    """Cheap pre-check for single contractions: is a value computed
    pointwise from ``d``'s result read by two or more ops? (Building the
    region of every lone GEMM of a large program would cost seconds.)"""
    stack = list(d.outvars)
    seen: set = set()
    while stack:
      v = stack.pop()
      users = [c for c in self.lvl.consumers.get(v, ()) if c.prim not in WINDOW_PRIMS]
      if len({c.idx for c in users}) > 1:
        return True
      for c in users:
        if c.idx not in seen and c.prim in POINTWISE_PRIMS | LAYOUT_PRIMS and len(seen) < _MAX_REACH:
          seen.add(c.idx)
          stack.extend(c.outvars)
    return False

  def separate_epilogue(self, f: _Found) -> bool:
    """Does ``f`` replace an op that XLA would run after its GEMM, in a
    kernel of its own? (A join of sibling GEMMs' results always is.)"""
    return (len(self.members(f.chain[0])) > 1
            or ir.xla_epilogue_split(ir.simplify(f.region)) is not None)

  def sibling_regions(self) -> list[_Found]:
    """Regions of sibling contractions: dots left to XLA that read one
    operand the same way (``x @ wq``, ``x @ wk``, ``x @ wv``), none reading
    another's result, whose single-contraction regions (with their
    pointwise epilogues) are alike up to the arrays they read. Each group
    becomes one region with a part loop (``ir.with_parts``): XLA would merge
    their dots into one GEMM and then run one kernel per sibling."""
    groups: dict = {}
    for d in self.items:
      if not is_contraction(d) or d.idx in self.taken:
        continue
      for key in self.sibling_keys(d):
        groups.setdefault(key, []).append(d)
    out: list[_Found] = []
    used: set[int] = set()
    for ds in groups.values():
      ds = [d for d in ds if d.idx not in used]
      if not 2 <= len(ds) <= _MAX_PARTS:
        continue
      try:
        f = self.parts_candidate(ds)
      except Reject as e:
        logging.vlog(1, "jaxfuse capture: %d sibling contractions at eqn %d left to XLA: %s",
                     len(ds), ds[0].idx, e)
        continue
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("jaxfuse capture: sibling contractions at eqn %d left to XLA after an "
                        "internal error (%s: %s)", ds[0].idx, type(e).__name__, e)
        continue
      if f.removed & (self.taken | set().union(*(g.removed for g in out))):
        continue
      used.update(d.idx for d in ds)
      out.append(f)
    return out

  def parts_candidate(self, ds: list[Item]) -> _Found:
    """One region over the sibling dots ``ds`` (see ``sibling_regions``), or
    Reject."""
    members = None
    # Elementwise epilogues first: a layout op after the GEMM (the reshape
    # and transpose to heads) would split its N loop in the output, and the
    # kernel would no longer be one tl.dot; the consumer reads the layout
    # through its own strides instead.
    for epi, pro in (("elementwise", True), ("pointwise", True), ("all", True),
                     ("elementwise", False)):
      try:
        fs = [self.candidate([d], epi, False, pro) for d in ds]   # arrays read once each
      except Reject:
        continue
      # One signature: the same ops, loops, dtypes and layouts, so input j
      # and output o play the same role in every sibling.
      if len({ir.simplify(f.region).signature() for f in fs}) == 1:
        members = fs
        break
    if members is None:
      raise Reject("the siblings' regions differ")
    if any(f.removed & g.removed or f.removed & set(g.items)
           for i, f in enumerate(members) for g in members[i + 1:]):
      raise Reject("the siblings share ops")
    produced = {o for f in members for i in f.items for o in self.items[i].outvars}
    if any(a in produced for f in members for a in f.input_src):
      raise Reject("a sibling reads another's result")
    first = members[0]

    def shared(j: int) -> bool:
      # The same array read at the same place: windows of one array
      # (x @ W[0], x @ W[1]) differ by their offsets.
      b0 = first.region.inputs[j]
      return all(f.input_src[j] is first.input_src[j]
                 and (f.region.inputs[j].offset, f.region.inputs[j].strides) == (b0.offset, b0.strides)
                 for f in members[1:])

    per_part = [j for j in range(len(first.inputs)) if not shared(j)]
    if len(per_part) == len(first.inputs):
      raise Reject("the siblings share no input")
    if any(first.region.inputs[j].window for j in per_part):
      raise Reject("a per-sibling input is a window of an array")
    inputs, input_src = [], []
    for j in range(len(first.inputs)):
      for f in (members if j in per_part else members[:1]):
        inputs.append(f.inputs[j])
        input_src.append(f.input_src[j])
    outputs = [f.outputs[o] for o in range(len(first.outputs)) for f in members]
    try:
      region = ir.with_parts(first.region, len(members), per_part)
    except ir.IRError as e:
      raise Reject(str(e)) from e
    sub_items, group_invars, items, removed = {}, {}, set(), set()
    for f in members:
      sub_items.update(f.sub_items)
      group_invars.update(f.group_invars)
      items.update(f.items)
      removed |= f.removed
    return _Found(list(ds), sorted(items), removed, inputs, input_src, outputs, region,
                  sub_items, group_invars)

  def regions(self) -> list[_Found]:
    found: list[_Found] = []
    taken = self.taken
    chained: dict[int, _Found] = {}   # the regions attempt() found, by id() (kept alive)
    dropped: set[tuple] = set()   # chains whose region the final check dropped

    def attempt(chain: list[Item]):
      n = len(chain)
      for length in range(min(n, self.limit), 0, -1):
        for start in range(n - length + 1):
          sub = chain[start:start + length]
          if sum(len(self.members(d)) for d in sub) > self.limit:
            continue   # a joined group counts all its contractions
          if tuple(d.idx for d in sub) in dropped:
            continue
          f = None
          why = None
          for epi, split, pro in _VARIANTS:
            if length == 1 and epi == "none" and not _is_vector_dot(sub[0]):
              continue   # a single contraction is fused for its epilogue only
            try:
              f = self.candidate(sub, epi, split, pro)
              if (length == 1 and not _is_vector_dot(sub[0])
                  and not self.separate_epilogue(f)):
                # Less inclusive variants have no more epilogue to cut.
                why = "a single contraction whose epilogue XLA fuses into its GEMM"
                f = None
                break
              if f.removed & taken:
                # Its epilogue/prologue overlaps a region already formed (the
                # layout ops between attention and an output projection): a
                # less inclusive variant may not.
                why = "overlaps a neighbouring region"
                f = None
                continue
              break
            except Reject as e:
              why = str(e)
            except Exception as e:  # pylint: disable=broad-except
              # A capture bug must not break the user's program: leave it to XLA.
              why = f"{type(e).__name__}: {e}"
              logging.warning("jaxfuse capture: chain at eqn %d left to XLA after an "
                              "internal error (%s)", sub[0].idx, why)
              break
          if f is None:
            logging.vlog(1, "jaxfuse capture: chain of %d contractions at eqn %d "
                         "left to XLA: %s", len(sub), sub[0].idx, why)
            continue
          if f.removed & taken:
            continue
          taken.update(f.removed)
          found.append(f)
          chained[id(f)] = f
          attempt(chain[:start])
          attempt(chain[start + length:])
          return

    chains = self.chains()
    for ch in chains:
      attempt(ch)
    in_chains = {d.idx for ch in chains for d in ch}
    followers = {m.idx for ms in self.joined.values() for m in ms[1:]}
    for d in self.items:
      if (is_contraction(d) and d.idx not in in_chains | followers and d.idx not in taken
          and (d.idx in self.joined or self.reread_after(d) or _is_vector_dot(d))):
        attempt([d])
    # A joined group no region took: its dots are tried one by one, as
    # dots that join nothing.
    # (Not a group over the contraction limit: XLA merges its GEMMs, and a
    # kernel for one of them alone would break that merge.)
    failed = [l for l, ms in self.joined.items()
              if len(ms) <= self.limit and not any(m.idx in taken for m in ms)]
    if failed:
      for l in failed:
        logging.vlog(1, "jaxfuse capture: joined contractions at eqn %d tried one by one", l)
        self.no_join.update(m.idx for m in self.joined[l])
      for c in self.chains():
        if not any(d.idx in taken for d in c) and any(d.idx in failed for d in c):
          attempt(c)
      grouped = {m.idx for ms in self.joined.values() for m in ms}   # still joined
      for d in self.items:
        if (is_contraction(d) and d.idx not in taken and d.idx not in grouped
            and (self.reread_after(d) or _is_vector_dot(d))):
          attempt([d])
    for f in self.sibling_regions():
      taken.update(f.removed)
      found.append(f)
    # Each region's inputs must exist outside every region, or be another
    # region's output; drop regions that would read a value a neighbour
    # computes internally, and try a dropped chain's shorter parts. (BERT's
    # first layer chains its output projection, LayerNorm and MLP; that
    # region read the attention's result before the layout ops the attention
    # region took, and dropping it whole lost the layer's MLP region.)
    while True:
      removed = set().union(*(f.removed for f in found)) if found else set()
      exported = {o for f in found for o in f.outputs}
      bad = [f for f in found
             if any((p := self.lvl.producer.get(a)) is not None and p.idx in removed
                    and a not in exported for a in f.input_src)]
      if not bad:
        break
      f = bad[0]
      found = [g for g in found if g is not f]
      taken.difference_update(f.removed)
      if id(f) in chained:
        logging.vlog(1, "jaxfuse capture: chain at eqn %d reads a value inside a neighbouring "
                     "region; its shorter parts are tried", f.chain[0].idx)
        dropped.add(tuple(d.idx for d in f.chain))
        attempt(f.chain)
    found.sort(key=lambda f: f.chain[0].idx)
    return self.merge_regions(found)

  def merge_regions(self, found: list[_Found]) -> list[_Found]:
    """``found`` with pairs of regions that compute a common part from the
    same inputs joined into one region with the outputs of both
    (``ir_merge``), where the planner's model predicts the one kernel
    faster than the two (``_merge_pays``). Regions of which either reads
    what the other computes stay apart (one kernel cannot wait for
    itself), as do merges over the contraction limit."""
    if not config.merge or len(found) < 2:
      return found
    found = list(found)
    i = 0
    while i < len(found):
      j = i + 1
      while j < len(found):
        f = self.merged(found[i], found[j])
        if f is not None:
          found[i] = f
          del found[j]
        else:
          j += 1
      i += 1
    return found

  def memory_of(self, a):
    """The array whose memory ``a`` is: ``a`` seen through the reshapes and
    unit-axis squeezes and broadcasts that made it (row-major relabellings,
    free in XLA). ``jax.nn.dot_product_attention``'s backward reads q in dv
    as is and in dk through its 5-D view: one array to ``ir_merge``."""
    while isinstance(a, FVar):
      p = self.lvl.producer.get(a)
      if p is None or not _relabels(p):
        break
      a = p.invars[0]
    return a

  def merged(self, f1: _Found, f2: _Found) -> _Found | None:
    """``f1`` and ``f2`` as one region, or None (``merge_regions``)."""
    mem = lambda f: {id(self.memory_of(a)) for a in f.input_src}
    if not mem(f1) & mem(f2):
      return None   # no common input: nothing to compute once
    for x, y in ((f1, f2), (f2, f1)):
      dep = self.lvl.depends(set(x.removed))
      if any((p := self.lvl.producer.get(a)) is not None and dep(p) for a in y.input_src):
        return None
    if len(f2.region.ops) > len(f1.region.ops):
      # The larger region's ops go first, the other's own ops after them:
      # Triton schedules in program order, and autodiff's dk+dv kernel ran
      # 1245 us with dv's ops first against 936 us with dk's (H100,
      # seventy-ninth session).
      f1, f2 = f2, f1
    keys = lambda f: [(id(self.memory_of(a)), b.offset)
                      for a, b in zip(f.input_src, f.region.inputs)]
    try:
      m = ir_merge.merge(f1.region, f2.region, keys(f1), keys(f2))
    except ir.IRError as e:
      logging.vlog(1, "jaxfuse capture: regions at eqns %d and %d not merged: %s",
                   f1.chain[0].idx, f2.chain[0].idx, e)
      return None
    if (not m.shared_contractions or len(m.region.contractions) > self.limit
        or min(m.b_outputs) < len(f1.outputs)):
      return None
    inputs, input_src = list(f1.inputs), list(f1.input_src)
    b_src = [f2.input_src[j] for j, k in enumerate(m.b_inputs) if k >= len(inputs)]
    # The regions as the runtime plans them: with their inputs of one array
    # labelled (their tiles load once, which the merged dk+dv plan of a
    # causal attention needs to fit two programs per SM).
    if _writes_a_product(m.region) or not _merge_pays(
        _labelled(m.region, input_src + b_src), _labelled(f1.region, f1.input_src),
        _labelled(f2.region, f2.input_src)):
      return None
    aliases = {**f1.aliases, **f2.aliases}
    for j, k in enumerate(m.b_inputs):
      if k == len(inputs):
        inputs.append(f2.inputs[j])
        input_src.append(f2.input_src[j])
      elif inputs[k] is not f2.inputs[j]:
        aliases[f2.inputs[j]] = inputs[k]
    logging.vlog(1, "jaxfuse capture: regions at eqns %d and %d merged (%d shared ops)",
                 f1.chain[0].idx, f2.chain[0].idx, m.shared_ops)
    return _Found(f1.chain + f2.chain, sorted(set(f1.items) | set(f2.items)),
                  f1.removed | f2.removed, inputs, input_src, f1.outputs + f2.outputs,
                  m.region, {**f1.sub_items, **f2.sub_items},
                  {**f1.group_invars, **f2.group_invars}, aliases=aliases)


def _relabels(it: Item) -> bool:
  """Whether ``it`` gives its operand's row-major memory another shape
  (the same elements in the same order)."""
  if len(it.invars) != 1 or is_lit(it.invars[0]) or len(it.outvars) != 1:
    return False
  src, out = it.invars[0].aval, it.outvars[0].aval
  if src.dtype != out.dtype or math.prod(src.shape) != math.prod(out.shape):
    return False
  if it.prim == "reshape":
    return it.params.get("dimensions") is None
  if it.prim == "squeeze":
    return True
  if it.prim == "broadcast_in_dim":   # adds size-1 axes, in order
    bd = tuple(it.params["broadcast_dimensions"])
    return list(bd) == sorted(bd)
  return False


def _alias(value, var):
  """``value`` (the input an alias stands for) in ``var``'s shape: a merged
  region's inputs may view one array through different shapes
  (``memory_of``)."""
  shape = tuple(var.aval.shape)
  return value if tuple(np.shape(value)) == shape else jax.lax.reshape(value, shape)


def _same_as(input_src: Sequence) -> tuple[int, ...]:
  """For each input, the first input of the same source array (inputs of
  one source may be separate FVars: split-input variants, merged regions)."""
  first: dict = {}
  return tuple(first.setdefault(id(v), i) for i, v in enumerate(input_src))


def _labelled(region: ir.Region, input_src: Sequence) -> ir.Region:
  """``region`` simplified, its inputs that read one source array labelled
  (``ir.with_shared_arrays``; not a region with part buffers, whose inputs
  are one per part)."""
  region = ir.simplify(region)
  return region if region.part_loop else ir.with_shared_arrays(region, _same_as(input_src))


def _merge_pays(merged: ir.Region, r1: ir.Region, r2: ir.Region) -> bool:
  """Whether the planner's model predicts ``merged`` faster than ``r1``
  and ``r2`` apart (model-only plans of the regions as the runtime plans
  them, ``_labelled``: the plan cache keeps them for it)."""
  from jaxfuse import planner  # pylint: disable=import-outside-toplevel
  times, nests = [], []
  for r in (merged, r1, r2):
    best = planner.plan_region(r).best
    if best is None or best.predicted is None:
      return False
    times.append(best.predicted.time_s)
    nests.append(_nested_loops(best.expr))
  logging.vlog(1, "jaxfuse capture: merged region predicted %.1f us, apart %.1f + %.1f us",
               *(t * 1e6 for t in times))
  # A merged plan that nests a loop neither part's plan nests is where the
  # model errs most: the dk+dv plans that split the head dimension of
  # q @ k.T or do @ v.T inside the query loop ran 1.3-1.5x their predicted
  # time (1692 against 1111 us, 790 against 583 us causal), the plans that
  # keep it whole 0.9-1.1x (H100, seventy-ninth session).
  if nests[0] > max(nests[1:]):
    return False
  return times[0] < times[1] + times[2]


def _writes_a_product(region: ir.Region) -> bool:
  """Whether ``region`` writes an output as large as its largest product.

  Why: merging pays by computing a product once without writing it. BERT
  training's region that writes ds = p * (dp - D) for XLA's dq and dk GEMMs
  merged with dv's took the step from 9828 to 10114 us of kernel time
  (H100, seventy-ninth session; the model underprices such regions about
  1.6x, seventy-eighth session)."""
  ext = region.loop_extents
  size = lambda loops: math.prod(ext[l] for l in loops)
  widest = max(size(region.value(op.out).loops) for op in region.contractions)
  return any(size(region.value(b.value).loops) >= widest for b in region.outputs)


def _nested_loops(expr) -> int:
  """How many loops of a plan's expression sit inside another loop."""
  from jaxfuse.planner import tiling  # pylint: disable=import-outside-toplevel
  count = 0

  def walk(nodes, depth):
    nonlocal count
    for n in nodes:
      if isinstance(n, tiling.LoopNode):
        count += depth > 0
        walk(n.body, depth + 1)
  walk(expr.body, 0)
  return count


def _laminar_violations(lvl: Level, found: Sequence[_Found]) -> set:
  """Custom-call groups that a region cuts: they must become opaque."""
  bad = set()
  for key, g in lvl.groups.items():
    gi = set(g.items)
    if not gi:
      continue
    for f in found:
      s = set(f.items)
      if (gi & s and not gi <= s) or (gi & f.removed and not gi <= f.removed):
        bad.add(key)
  return bad


def _recompute_shared(closed: ClosedJaxpr, path: str, unchanged: dict | None = None
                      ) -> ClosedJaxpr:
  """``closed`` with each contraction reading its own copy of the wide
  intermediates it shares with an earlier one (``capture_recompute``).
  Where nothing changes, ``unchanged["level"]`` gets the flat level it
  analysed (the caller's first flatten, saved)."""
  if not config.recompute:
    return closed
  try:
    flat = flatten(closed)
    lvl = capture_recompute.reassociate(flat)
    copies = capture_recompute.plan(lvl)
    if not copies and lvl is flat:
      if unchanged is not None:
        unchanged["level"] = flat
      return closed
    lvl = capture_recompute.apply(lvl, copies)
    em = _Emitter(lvl, [], None, path)
    em.verbatim = True

    def fn(*args):
      env = dict(zip(lvl.invars, args))
      em.emit_level(env)
      return [_read(env, a) for a in lvl.outvars]

    new = trace(fn, [v.aval for v in lvl.invars])
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse capture: recomputation skipped (%s: %s)", type(e).__name__, e)
    return closed
  logging.vlog(1, "jaxfuse capture: %d contraction(s) recompute shared intermediates",
               len(copies))
  return new


def _analyze(closed: ClosedJaxpr, path: str,
             limit: int = _MAX_CONTRACTIONS) -> tuple[Level, list[_Found]]:
  unchanged: dict = {}
  closed = _recompute_shared(closed, path, unchanged)
  opaque: frozenset = frozenset()
  packed: set = set()   # pushdowns no region took whole: left as written
  for _ in range(_MAX_BARRIER_ROUNDS):
    lvl = unchanged.pop("level", None) or flatten(closed, opaque)
    pushes = push_slices(lvl, packed)
    found = _LevelAnalysis(lvl, limit).regions()
    bad = _laminar_violations(lvl, found)
    lost = unabsorbed(pushes, found)
    if not bad and not lost:
      break
    opaque = opaque | bad
    packed |= lost
  else:  # pragma: no cover - pathological nesting
    return flatten(closed, opaque), []
  for f in found:
    # ir.simplify drops identity ops such as softmax's max(-inf, .).
    f.captured = CapturedRegion(_labelled(f.region, f.input_src), _region_jaxpr(lvl, f),
                                _source(f.chain[0]), path, _same_as(f.input_src))
  return lvl, found


def _source(it: Item) -> str:
  try:
    from jax.extend import source_info_util  # pylint: disable=import-outside-toplevel
    s = source_info_util.summarize(it.eqn.source_info)
  except Exception:  # pragma: no cover - API moved
    return ""
  s = s.split(" (")[0]
  parts = s.rsplit(":", 2)
  if len(parts) == 3 and parts[1].isdigit():
    return f"{parts[0]}:{parts[1]}"
  return s


# --------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------

def _join(path: str, sub: str) -> str:
  return sub if not path else f"{path}/{sub}"


def _read(env: dict, a):
  if is_lit(a):
    return a.val
  if isinstance(a, FVar) and a.is_const:
    return env.get(a, a.const)
  return env[a]


class _Emitter:
  """Re-emits a level by binding primitives inside a jax.make_jaxpr trace."""

  def __init__(self, lvl: Level, found: Sequence[_Found], bind_region, path: str,
               limit: int = _MAX_CONTRACTIONS):
    self.lvl = lvl
    self.limit = limit
    self.found = list(found)
    self.bind_region = bind_region
    self.path = path
    self.changed = False
    # Emitting a region's own jaxpr, traced apart from the program: a
    # shard_map's pvary (a type cast; its axes are unbound there) passes its
    # value through.
    self.standalone = False
    # Emit every item and call as written (no regions, bodies untouched).
    self.verbatim = False

  # -- items and groups --------------------------------------------------
  def emit_item(self, it: Item, env: dict, original: bool = False) -> None:
    invals = [_read(env, a) for a in it.invars]
    params = None
    outs = None
    if not original and it.prim == "shard_map":
      outs = self._emit_shard_map(it, invals)
    if outs is None and self.standalone and it.prim == "pvary":
      outs = invals
    if outs is None:
      if not original:
        invals, params = self._rewrite_bodies(it, invals)
      outs = bind_eqn(it.eqn, invals, params)
    for o, v in zip(it.outvars, outs):
      env[o] = v

  def _emit_shard_map(self, it: Item, invals: list) -> list | None:
    """A ``shard_map``'s body, regions rewritten, bound through
    ``jax.shard_map`` again: the body must be traced where its mesh axes are
    bound (its ``pvary``s and varying types need them), so it cannot be
    re-traced on its own as other bodies are. Regions there see per-device
    shapes. None: bind the original equation (no dots, or the body failed
    to trace)."""
    p = it.params
    body = ClosedJaxpr(p["jaxpr"], ())
    if _count_dots(body.jaxpr, 1) < 1:
      return None
    path = _join(self.path, "shard_map")
    try:
      fn, em = _level_emitter(body, self.bind_region, path, self.limit)
      outs = list(shard_map_like(it.eqn, lambda *a: tuple(fn(*a)))(*invals))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("jaxfuse capture: regions inside shard_map left to XLA (%s: %s)",
                      type(e).__name__, e)
      return None
    # Already bound in the trace: kept even when no region was found (then
    # it is the original equation again), as binding that too would leave a
    # dead copy of the body in the program.
    self.changed = self.changed or em.changed
    return outs

  def _rewrite_bodies(self, it: Item, invals: list):
    p = it.params
    prim = it.prim
    bind = self.bind_region
    if prim == "scan":
      body, ch = _rewrite_closed(p["jaxpr"], bind, _join(self.path, "scan/body"),
                                 self.limit)
      if not ch:
        return invals, None
      self.changed = True
      body, consts = hoist_consts(body)
      params = dict(p, jaxpr=body, num_consts=p["num_consts"] + len(consts))
      if "linear" in p:
        params["linear"] = (False,) * len(consts) + tuple(p["linear"])
      return list(consts) + invals, params
    if prim == "while":
      cj, c1 = _rewrite_closed(p["cond_jaxpr"], bind, _join(self.path, "while/cond"),
                               self.limit)
      bj, c2 = _rewrite_closed(p["body_jaxpr"], bind, _join(self.path, "while/body"),
                               self.limit)
      if not (c1 or c2):
        return invals, None
      self.changed = True
      cj, cc = hoist_consts(cj)
      bj, bc = hoist_consts(bj)
      nc, nb = p["cond_nconsts"], p["body_nconsts"]
      new_in = (list(cc) + invals[:nc] + list(bc) + invals[nc:nc + nb] + invals[nc + nb:])
      params = dict(p, cond_jaxpr=cj, body_jaxpr=bj, cond_nconsts=nc + len(cc),
                    body_nconsts=nb + len(bc))
      return new_in, params
    if prim == "cond":
      branches = p["branches"]
      res = [_rewrite_closed(b, bind, _join(self.path, f"cond/branch{i}"), self.limit)
             for i, b in enumerate(branches)]
      if not any(ch for _, ch in res):
        return invals, None
      self.changed = True
      all_consts: list = []
      offsets = []
      for b, _ in res:
        offsets.append((len(all_consts), len(b.consts)))
        all_consts.extend(b.consts)
      const_avals = [aval_of(c) for c in all_consts]
      op_avals = [v.aval for v in branches[0].jaxpr.invars]
      nall = len(all_consts)
      new_branches = []
      for (b, _), (off, n) in zip(res, offsets):
        jx = b.jaxpr
        new_branches.append(trace(
            lambda *a, jx=jx, off=off, n=n: eval_jaxpr(jx, a[off:off + n], *a[nall:]),
            const_avals + op_avals))
      params = dict(p, branches=tuple(new_branches))
      return [invals[0]] + all_consts + invals[1:], params
    if prim in ("remat2", "checkpoint", "remat"):
      body, ch = _rewrite_closed(ClosedJaxpr(p["jaxpr"], ()), bind, _join(self.path, "remat"),
                                 self.limit)
      if not ch:
        return invals, None
      self.changed = True
      body, consts = hoist_consts(body)
      return list(consts) + invals, dict(p, jaxpr=body.jaxpr)
    if prim in CUSTOM_CALLS and "call_jaxpr" in p:
      body, ch = _rewrite_closed(p["call_jaxpr"], bind, _join(self.path, prim), self.limit)
      if not ch:
        return invals, None
      self.changed = True
      return invals, dict(p, call_jaxpr=body)
    return invals, None

  def emit_group(self, key, env: dict, original: bool = False,
                 found: _Found | None = None) -> None:
    g = self.lvl.groups[key]
    args = found.group_invars[key] if found is not None else g.invars
    invals = [_read(env, a) for a in args]
    if original:
      outs = bind_eqn(g.eqn, invals)
    else:
      call = g.eqn.params["call_jaxpr"]
      before = self.changed
      self.changed = False

      def inner(*args):
        ienv = {}
        for a, v in zip(g.invars, args):
          if isinstance(a, FVar):
            ienv[a] = v
        self.emit_seq(g.items, ienv, key)
        return [_read(ienv, a) for a in g.outs]

      new_call = trace(inner, call.in_avals)
      inner_changed = self.changed
      self.changed = before or inner_changed
      if inner_changed:
        outs = bind_eqn(g.eqn, invals, dict(g.eqn.params, call_jaxpr=new_call))
      else:
        outs = bind_eqn(g.eqn, invals)
    for a, v in zip(g.outs, outs):
      if isinstance(a, FVar) and not a.is_const:
        env[a] = v

  def emit_seq(self, idxs: Sequence[int], env: dict, parent, original: bool = False,
               found: _Found | None = None) -> None:
    """Emits items in order; items of a sub-group become one group call.
    Within a region (``found``), items read the region's input aliases."""
    done = set()

    def item_of(it: Item) -> Item:
      return found.sub_items.get(it.idx, it) if found is not None else it

    for i in idxs:
      it = self.lvl.items[i]
      gs = it.groups
      if parent is None:
        child = gs[0] if gs else None
      else:
        k = gs.index(parent)
        child = gs[k + 1] if k + 1 < len(gs) else None
      if child is None:
        push = self.lvl.pushdowns.get(i) if original else None
        if push is not None:
          # The packed contraction and its slices, as the program wrote
          # them (capture_slices): emitted at its first part's place.
          if it in push.window_items() or all(o in env for o in it.outvars):
            continue
          if emit_original(push, env, _read, item_of):
            continue
          for w in push.windows[push.parts.index(it)]:
            self.emit_item(item_of(w), env, original)
        self.emit_item(item_of(it), env, original)
      elif child not in done:
        done.add(child)
        self.emit_group(child, env, original, found if parent is None else None)

  # -- regions -------------------------------------------------------------
  def emit_region(self, f: _Found, env: dict) -> None:
    invals = [_read(env, a) for a in f.input_src]
    res = self.bind_region(f.captured, *invals)
    if res is None:
      renv = dict(zip(f.inputs, invals))
      renv.update((a, _alias(renv[b], a)) for a, b in f.aliases.items())
      self.emit_seq(f.items, renv, None, original=True, found=f)
      res = [renv[o] for o in f.outputs]
    else:
      res = list(res)
      if len(res) != len(f.outputs):
        raise ValueError(f"bind_region returned {len(res)} outputs, the region has "
                         f"{len(f.outputs)}")
      self.changed = True
    for o, v in zip(f.outputs, res):
      env[o] = v

  # -- the level -----------------------------------------------------------
  def emit_level(self, env: dict) -> None:
    lvl = self.lvl
    removed = set()
    for f in self.found:
      removed |= f.removed
    units = []  # (pos, kind, payload, ins, outs, effects)
    seen_groups = set()
    for it in lvl.items:
      if it.idx in removed:
        continue
      if it.groups:
        key = it.groups[0]
        if key in seen_groups:
          continue
        seen_groups.add(key)
        g = lvl.groups[key]
        units.append((it.idx, "group", key, list(g.invars),
                      [a for a in g.outs if isinstance(a, FVar)], bool(g.eqn.effects)))
      else:
        units.append((it.idx, "item", it, list(it.invars), list(it.outvars),
                      bool(it.eqn.effects)))
    for f in self.found:
      units.append((max(f.removed), "region", f, list(f.input_src), list(f.outputs), False))
    prod = {}
    for u, unit in enumerate(units):
      for o in unit[4]:
        prod.setdefault(o, u)
    # Liveness: keep only units whose results are needed (or have effects).
    live = set()
    work = [prod[a] for a in lvl.outvars if isinstance(a, FVar) and a in prod]
    work += [u for u, unit in enumerate(units) if unit[5]]
    while work:
      u = work.pop()
      if u in live:
        continue
      live.add(u)
      for a in units[u][3]:
        if isinstance(a, FVar) and a in prod and prod[a] not in live:
          work.append(prod[a])
    # Kahn's algorithm, original order first.
    deps = {u: {prod[a] for a in units[u][3] if isinstance(a, FVar) and a in prod
                and prod[a] != u} for u in live}
    users: dict[int, list] = {}
    for u, ds in deps.items():
      for d in ds:
        users.setdefault(d, []).append(u)
    pending = {u: len(ds) for u, ds in deps.items()}
    heap = [(units[u][0], u) for u, n in pending.items() if n == 0]
    heapq.heapify(heap)
    emitted = 0
    while heap:
      _, u = heapq.heappop(heap)
      pos, kind, payload, *_ = units[u]
      if kind == "item":
        self.emit_item(payload, env, self.verbatim)
      elif kind == "group":
        self.emit_group(payload, env, self.verbatim)
      else:
        self.emit_region(payload, env)
      emitted += 1
      for w in users.get(u, ()):
        pending[w] -= 1
        if pending[w] == 0:
          heapq.heappush(heap, (units[w][0], w))
    if emitted != len(live):  # pragma: no cover - would be a capture bug
      raise RuntimeError("jaxfuse capture: cyclic schedule")


def _region_jaxpr(lvl: Level, f: _Found) -> ClosedJaxpr:
  em = _Emitter(lvl, [], None, "")
  em.standalone = True

  def fn(*args):
    env = dict(zip(f.inputs, args))
    env.update((a, _alias(env[b], a)) for a, b in f.aliases.items())
    em.emit_seq(f.items, env, None, original=True, found=f)
    return [env[o] for o in f.outputs]

  return trace(fn, [v.aval for v in f.inputs])


def _count_dots(jaxpr, limit: int = 2) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      n += 1
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, ClosedJaxpr):
          n += _count_dots(sub.jaxpr, limit)
        elif type(sub).__name__ == "Jaxpr":
          n += _count_dots(sub, limit)
    if n >= limit:
      return n
  return n


def _level_emitter(closed: ClosedJaxpr, bind_region, path: str, limit: int
                   ) -> tuple[Callable[..., list], "_Emitter"]:
  """A function that emits ``closed`` with its regions rewritten (to be
  traced), and its emitter (``.changed`` once traced)."""
  lvl, found = _analyze(closed, path, limit)
  em = _Emitter(lvl, found, bind_region, path, limit)

  def fn(*args):
    env = dict(zip(lvl.invars, args))
    em.emit_level(env)
    return [_read(env, a) for a in lvl.outvars]

  return fn, em


def _rewrite_closed(closed: ClosedJaxpr, bind_region, path: str,
                    limit: int = _MAX_CONTRACTIONS) -> tuple[ClosedJaxpr, bool]:
  if _count_dots(closed.jaxpr, 1) < 1:
    return closed, False
  fn, em = _level_emitter(closed, bind_region, path, limit)
  new = trace(fn, [v.aval for v in closed.jaxpr.invars])
  if not em.changed:
    return closed, False
  return new, True


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------

def _check_limit(max_contractions: int | None) -> int:
  if max_contractions is None:
    return _MAX_CONTRACTIONS
  if isinstance(max_contractions, bool) or not isinstance(max_contractions, int) \
      or max_contractions < 1:
    raise ValueError(f"max_contractions must be a positive int, got {max_contractions!r}")
  return min(max_contractions, _MAX_CONTRACTIONS)


def find_regions(closed_jaxpr: ClosedJaxpr, *,
                 max_contractions: int | None = None) -> list[CapturedRegion]:
  """Returns every fusible region of ``closed_jaxpr``, nested bodies included.

  ``max_contractions`` caps the contractions per region (default: the
  longest chain capture fuses); a chain left to XLA is captured again below
  its length, so that its parts can still be fused.

  Example::

    closed = jax.make_jaxpr(lambda a, b, d: (a @ b) @ d)(a, b, d)
    [r] = find_regions(closed)
    print(r.region)
  """
  if not isinstance(closed_jaxpr, ClosedJaxpr):
    raise TypeError(f"find_regions: closed_jaxpr must be a ClosedJaxpr, got "
                    f"{type(closed_jaxpr).__name__}")
  limit = _check_limit(max_contractions)
  out: list[CapturedRegion] = []
  _collect(live_code(closed_jaxpr), "", out, limit)
  return out


def _collect(closed: ClosedJaxpr, path: str, out: list, limit: int) -> None:
  if _count_dots(closed.jaxpr, 1) < 1:
    return
  lvl, found = _analyze(closed, path, limit)
  out.extend(f.captured for f in found)
  for it in lvl.items:
    p = it.params
    if it.prim == "scan":
      _collect(p["jaxpr"], _join(path, "scan/body"), out, limit)
    elif it.prim == "while":
      _collect(p["cond_jaxpr"], _join(path, "while/cond"), out, limit)
      _collect(p["body_jaxpr"], _join(path, "while/body"), out, limit)
    elif it.prim == "cond":
      for i, b in enumerate(p["branches"]):
        _collect(b, _join(path, f"cond/branch{i}"), out, limit)
    elif it.prim == "shard_map":
      _collect(ClosedJaxpr(p["jaxpr"], ()), _join(path, "shard_map"), out, limit)
    elif it.prim in ("remat2", "checkpoint", "remat"):
      _collect(ClosedJaxpr(p["jaxpr"], ()), _join(path, "remat"), out, limit)
    elif it.prim in CUSTOM_CALLS and "call_jaxpr" in p:
      _collect(p["call_jaxpr"], _join(path, it.prim), out, limit)


def rewrite(closed_jaxpr: ClosedJaxpr,
            bind_region: Callable[..., Sequence[Any] | None], *,
            max_contractions: int | None = None) -> ClosedJaxpr:
  """Returns ``closed_jaxpr`` with each region replaced by ``bind_region``.

  ``bind_region(captured, *inputs)`` is called while tracing the new jaxpr,
  with the region's inputs (tracers) in ``captured.region.inputs`` order; it
  returns the outputs (``captured.region.outputs`` order) or None to keep the
  region's original ops. Regions inside scan/while/cond/remat bodies and
  custom-derivative calls are rewritten inside those bodies. When no
  region is replaced, ``closed_jaxpr`` itself is returned.
  ``max_contractions`` as in ``find_regions``.

  Example::

    new = rewrite(jax.make_jaxpr(f)(x), lambda cap, *xs: my_prim.bind(*xs, region=cap.region))
  """
  if not isinstance(closed_jaxpr, ClosedJaxpr):
    raise TypeError(f"rewrite: closed_jaxpr must be a ClosedJaxpr, got "
                    f"{type(closed_jaxpr).__name__}")
  if not callable(bind_region):
    raise TypeError("rewrite: bind_region must be callable")
  limit = _check_limit(max_contractions)
  try:
    new, changed = _rewrite_closed(live_code(closed_jaxpr), bind_region, "", limit)
  except Exception as e:  # pylint: disable=broad-except
    # Never break the user's program: keep the original ops.
    logging.warning("jaxfuse capture: rewrite failed, regions left to XLA (%s: %s)",
                    type(e).__name__, e, exc_info=True)
    return closed_jaxpr
  return new if changed else closed_jaxpr
