"""Streaming (online) reductions, derived from a region's ops.

A reduction along loop ``n`` whose result is broadcast back along ``n`` (the
``x - max_n(x)`` of a softmax) needs the whole ``n`` row before its consumers
can run. When ``n`` is tiled sequentially inside a program that row is never on
chip at once; the reduction can still run *online* when everything between it
and the contractions over ``n`` follows the algebra of softmax (FlashAttention,
Chimera's deferred division):

* ``M = max_n X`` is kept as a running max;
* ``Z = X - M`` (optionally times a positive literal ``c``) is a *shift*: with
  the running max it differs from the final value by ``M_cur - M_fin``;
* ``E = exp(Z)`` / ``exp2(Z)`` is *scaled*: ``E_fin = E_cur * r`` with
  ``r = exp(c (M_cur - M_fin))``, one factor per row of ``M``;
* linear ops keep a value scaled: ``convert``, ``neg``, ``mul``/``div`` by a value
  that does not depend on an ``n`` reduction, ``select(p, 0, E)``;
* ``mul``/``div`` by an ``n``-free value that *does* depend on an ``n``
  reduction (the softmax denominator ``l = sum_n E``) commutes with the
  contraction over ``n``: it is *deferred* and applied once after the loop;
* ``sum_n`` of a scaled value and a contraction over ``n`` with one scaled
  operand are *accumulators*: each tile rescales them by
  ``alpha = exp(c (M_old - M_new))`` before adding its contribution; the
  deferred factors multiply/divide the final accumulator.

A running max that reads a causal mask or a sliding window
(``masked_value``: a literal fill far below any score where compares of two
iotas, each plus a constant, do not all hold, ``keep_predicate``) makes the
tiles of ``n`` that the mask hides contribute exactly nothing: the code
generator skips them and the cost model does not price them
(``masked_tile_relation``).

Anything else that reads an ``n`` reduction back along ``n`` cannot stream:
the loop must then be a single tile (``StreamingInfo.single_tile``). Nothing
here looks for "attention": the rules apply to any chain of IR ops.

Example::

    info = analyze(region)
    info.single_tile          # {} for softmax attention
    info.streamed["n"].running_max   # ('mx',)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jaxfuse import ir

__all__ = ["Band", "Compare", "Keep", "LengthBound", "Masked", "Scale", "StreamedLoop",
           "StreamingInfo", "analyze", "iota_relation", "keep_predicate", "length_bound",
           "output_length_bound", "length_inputs", "guarded_band", "length_mask",
           "masked_value", "masked_tile_relation", "masked_tile_relations", "relation_to"]


@dataclasses.dataclass(frozen=True)
class Scale:
  """How a value computed with the running max relates to its final value.

  ``final = current * base**(coef * (M_cur - M_fin)) * prod(deferred)`` where
  ``deferred`` are ``('mul'|'div', value)`` factors applied after the loop.
  ``base`` is ``'e'`` (``exp``) or ``'2'`` (``exp2``). For a *shift* value
  (``X - M`` itself) ``base`` is ``''``.
  """
  max: str
  coef: float = 1.0
  base: str = "e"
  deferred: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class StreamedLoop:
  """What the code generator does for loop ``loop`` when it is sequential.

  running_max: max reductions along the loop, kept as running maxima.
  accumulators: every reduction/contraction over the loop, in op order, mapped
    to its ``Scale`` (rescaled per tile, deferred factors at the end) or None
    (a plain accumulator: sum, dot or max of values that do not depend on a
    reduction over the loop).
  shifted: values ``X - M`` computed with the running max (-> ``Scale``).
  scaled: values ``exp(shift)`` and their linear images (-> ``Scale``).
  deferred: values whose in-loop tile is just their operand's tile because the
    factor they apply is deferred (value -> the operand it aliases).
  post: values without the loop that depend on a reduction over it; they can
    only be computed after the loop (in op order).
  """
  loop: str
  running_max: tuple[str, ...] = ()
  accumulators: tuple[tuple[str, Optional[Scale]], ...] = ()
  shifted: tuple[tuple[str, Scale], ...] = ()
  scaled: tuple[tuple[str, Scale], ...] = ()
  deferred: tuple[tuple[str, str], ...] = ()
  post: tuple[str, ...] = ()

  @property
  def online(self) -> bool:
    """True when some value needs rescaling (not just plain accumulation)."""
    return bool(self.scaled or self.shifted)

  def accumulator_scale(self, value: str) -> Optional[Scale]:
    return dict(self.accumulators).get(value)

  def scale_of(self, value: str) -> Optional[Scale]:
    d = dict(self.scaled)
    d.update(self.shifted)
    return d.get(value)


@dataclasses.dataclass(frozen=True)
class StreamingInfo:
  """Per reduced loop: how it may be tiled sequentially.

  ``streamed[l]`` exists for every loop some op reduces and that may be tiled
  sequentially (possibly with online rescaling); ``single_tile[l]`` gives the
  reason a reduced loop must instead sit in one tile.
  """
  streamed: dict[str, StreamedLoop]
  single_tile: dict[str, str]

  @property
  def streamable_loops(self) -> frozenset[str]:
    """Loops along which values may read a running (online) reduction: the
    planner lets consumers sit inside such a loop while it is reduced."""
    return frozenset(l for l, s in self.streamed.items() if s.online)

  def can_tile(self, loop: str) -> bool:
    """Whether ``loop`` may have several tiles inside a program."""
    return loop not in self.single_tile

  def is_online(self, loop: str) -> bool:
    s = self.streamed.get(loop)
    return bool(s and s.online)

  def masked_tiles(self, region: ir.Region) -> dict[str, "Band"]:
    """``masked_tile_relation`` of every streamed loop that has one."""
    out = {}
    for l, st in self.streamed.items():
      r = masked_tile_relation(region, st)
      if r is not None:
        out[l] = r
    return out


class _NotStreamable(Exception):
  pass


def _reduces(op, loop: str) -> bool:
  if isinstance(op, ir.Contraction):
    return loop in op.reduce
  if isinstance(op, ir.Reduction):
    return op.loop == loop
  return False


def _is_zero(a) -> bool:
  return isinstance(a, ir.Literal) and float(a.value) == 0.0


def _analyze_loop(region: ir.Region, n: str) -> StreamedLoop:
  vm = region.value_map
  # dep[v]: v depends (transitively) on an op that reduces n.
  dep: dict[str, bool] = {b.value: False for b in region.inputs}
  for op in region.ops:
    dep[op.out] = _reduces(op, n) or any(dep[i] for i in op.inputs)

  def has_n(v: str) -> bool:
    return n in vm[v].loops

  def mixed(v: str) -> bool:
    return has_n(v) and dep[v]

  def post(v: str) -> bool:
    return (not has_n(v)) and dep[v]

  running_max: list[str] = []
  accumulators: list[tuple[str, Optional[Scale]]] = []
  shifted: dict[str, Scale] = {}
  scaled: dict[str, Scale] = {}
  deferred: dict[str, str] = {}
  posts: list[str] = []
  outputs = set(region.output_names)

  for op in region.ops:
    out = op.out
    if _reduces(op, n):
      ins = list(op.inputs)
      mixed_in = [i for i in ins if mixed(i)]
      if not mixed_in:
        if isinstance(op, ir.Reduction) and op.kind == "max":
          running_max.append(out)
        accumulators.append((out, None))
      else:
        if isinstance(op, ir.Reduction) and op.kind == "max":
          raise _NotStreamable(f"max_{n} of {op.arg}, which depends on a reduction over {n}")
        if len(mixed_in) != 1 or mixed_in[0] not in scaled:
          raise _NotStreamable(f"{out} reduces {n} over {mixed_in}, not one rescalable value")
        sc = scaled[mixed_in[0]]
        other = [i for i in ins if i != mixed_in[0]]
        if any(post(o) for o in other):
          raise _NotStreamable(f"{out} multiplies by {other}, a result of a reduction over {n}")
        if isinstance(op, ir.Contraction):
          extra = set(op.reduce) - {n}
          need = set(vm[sc.max].loops)
          for _, d in sc.deferred:
            need |= set(vm[d].loops)
          if extra & need:
            raise _NotStreamable(f"{out} also reduces {sorted(extra & need)}, "
                                 "which the rescaling factor varies along")
        accumulators.append((out, sc))
      continue
    if post(out):
      posts.append(out)
      continue
    if not mixed(out):
      continue
    # A value along n that reads a reduction over n: must fit the algebra.
    if out in outputs:
      raise _NotStreamable(f"{out} is a region output along {n} that needs the full reduction")
    if isinstance(op, ir.Elementwise):
      fn, args = op.fn, op.args
      names = [a for a in args if isinstance(a, str)]
      if fn == "sub" and isinstance(args[0], str) and isinstance(args[1], str):
        x, m = args
        mop = region.producer(m)
        if (not mixed(x) and isinstance(mop, ir.Reduction) and mop.kind == "max"
            and mop.loop == n and m in running_max):
          shifted[out] = Scale(max=m, coef=1.0, base="")
          continue
      if fn == "mul" and len(names) == 1 and names[0] in shifted:
        lit = [a for a in args if isinstance(a, ir.Literal)][0]
        if float(lit.value) > 0:
          s = shifted[names[0]]
          shifted[out] = dataclasses.replace(s, coef=s.coef * float(lit.value))
          continue
      if fn in ("exp", "exp2") and names[0] in shifted:
        s = shifted[names[0]]
        scaled[out] = dataclasses.replace(s, base="e" if fn == "exp" else "2")
        continue
      src = [a for a in names if mixed(a)]
      if len(src) == 1 and src[0] in scaled:
        s = scaled[src[0]]
        others = [a for a in args if a != src[0]]
        if fn in ("convert", "neg"):
          scaled[out] = s
          continue
        if fn in ("mul", "div") and len(others) == 1 and (fn == "mul" or args[0] == src[0]):
          o = others[0]
          if isinstance(o, str) and post(o):
            scaled[out] = dataclasses.replace(s, deferred=s.deferred + ((fn, o),))
            deferred[out] = src[0]
          else:
            scaled[out] = s
          continue
        if fn == "select" and isinstance(args[0], str) and not mixed(args[0]):
          rest = args[1:]
          if src[0] in rest and any(_is_zero(a) for a in rest):
            scaled[out] = s
            continue
    raise _NotStreamable(f"{out} = {_describe(op)} reads a reduction over {n} along {n} "
                         "outside the softmax algebra")
  for v in list(shifted) + list(scaled):
    for c in region.consumers(v):
      if not (c.out in shifted or c.out in scaled or any(a == c.out for a, _ in accumulators)):
        raise _NotStreamable(f"{c.out} reads {v} outside the softmax algebra")
  return StreamedLoop(loop=n, running_max=tuple(running_max),
                      accumulators=tuple(accumulators),
                      shifted=tuple(shifted.items()), scaled=tuple(scaled.items()),
                      deferred=tuple(deferred.items()), post=tuple(posts))


def _describe(op) -> str:
  if isinstance(op, ir.Elementwise):
    return f"{op.fn}({', '.join(str(a) for a in op.args)})"
  if isinstance(op, ir.Reduction):
    return f"{op.kind}_{op.loop}({op.arg})"
  if isinstance(op, ir.Contraction):
    return f"sum_{''.join(op.reduce)}({op.lhs} * {op.rhs})"
  return f"iota({op.loop})"


def analyze(region: ir.Region) -> StreamingInfo:
  """Which reduced loops can be tiled sequentially, and how.

  Example::

      info = analyze(attention_region)
      assert info.can_tile("n") and info.is_online("n")
  """
  streamed: dict[str, StreamedLoop] = {}
  single: dict[str, str] = {}
  for loop in region.loops:
    if not any(_reduces(op, loop.name) for op in region.ops):
      continue
    try:
      streamed[loop.name] = _analyze_loop(region, loop.name)
    except _NotStreamable as e:
      single[loop.name] = str(e)
  return StreamingInfo(streamed=streamed, single_tile=single)


# a cmp b  <=>  b _FLIP[cmp] a
_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}


@dataclasses.dataclass(frozen=True)
class Compare:
  """``iota(a) cmp iota(b) + offset`` of two different loops (cmp in 'le',
  'lt', 'ge', 'gt')."""
  cmp: str
  a: str
  b: str
  offset: int = 0


# A mask's keep predicate: a conjunction of compares (a causal mask is one,
# a sliding window two).
Keep = tuple[Compare, ...]


@dataclasses.dataclass(frozen=True)
class Band:
  """The indices ``i`` of a loop that a mask keeps against index ``o`` of
  loop ``other``: ``o + lower <= i <= o + upper`` (None: no bound on that
  side). A causal mask ``i <= o`` is ``Band(other, upper=0)``; a window of
  ``w`` keys before each query and none after is ``Band(other, -w, 0)``."""
  other: str
  lower: Optional[int] = None
  upper: Optional[int] = None

  def keeps_some(self, ext: int, ext_other: int) -> bool:
    """Whether every index of ``other`` (extent ``ext_other``) keeps at
    least one of the loop's ``ext`` indices. The kept range's ends grow with
    ``o``, so its first and last index decide."""
    lo, hi = self.lower, self.upper
    if lo is not None and hi is not None and lo > hi:
      return False
    if hi is not None and hi < 0:                  # o = 0 keeps i <= hi
      return False
    if lo is not None and ext_other - 1 + lo > ext - 1:   # the last o keeps i >= o + lo
      return False
    return ext >= 1


def _index_form(region: ir.Region, v, depth: int = 0) -> Optional[tuple[dict, int]]:
  """``({loop: coefficient}, k)`` when value ``v`` is a sum of iotas and
  integer literals, ``sum(c * iota(loop)) + k`` (``add``, ``sub``, ``neg``
  and int converts, seen through); None otherwise."""
  if isinstance(v, ir.Literal):
    if isinstance(v.value, bool) or not float(v.value).is_integer():
      return None
    return {}, int(v.value)
  op = region.producer(v) if isinstance(v, str) else None
  if isinstance(op, ir.Iota):
    return {op.loop: 1}, 0
  if not isinstance(op, ir.Elementwise) or depth > 8:
    return None
  if op.fn == "convert" and region.value_map[op.out].dtype.startswith(("int", "uint")):
    return _index_form(region, op.args[0], depth + 1)
  if op.fn == "neg":
    f = _index_form(region, op.args[0], depth + 1)
    return None if f is None else ({l: -c for l, c in f[0].items()}, -f[1])
  if op.fn in ("add", "sub") and len(op.args) == 2:
    x, y = (_index_form(region, a, depth + 1) for a in op.args)
    if x is None or y is None:
      return None
    sign = 1 if op.fn == "add" else -1
    terms = dict(x[0])
    for l, c in y[0].items():
      terms[l] = terms.get(l, 0) + sign * c
    return {l: c for l, c in terms.items() if c}, x[1] + sign * y[1]
  return None


def _iota_compare(region: ir.Region, v) -> Optional[Compare]:
  """The ``Compare`` value ``v`` is: a compare of two sums of iotas and
  literals that differ by one iota minus another plus a constant
  (``i >= j``, ``i <= j + w``, ``i - j < w``)."""
  op = region.producer(v) if isinstance(v, str) else None
  if not (isinstance(op, ir.Elementwise) and op.fn in _FLIP and len(op.args) == 2):
    return None
  x, y = (_index_form(region, a) for a in op.args)
  if x is None or y is None:
    return None
  # x cmp y  <=>  x - y cmp 0  <=>  iota(a) - iota(b) + k cmp 0  <=>  iota(a) cmp iota(b) - k
  terms = dict(x[0])
  for l, c in y[0].items():
    terms[l] = terms.get(l, 0) - c
  terms = {l: c for l, c in terms.items() if c}
  if sorted(terms.values()) != [-1, 1]:
    return None
  a = next(l for l, c in terms.items() if c == 1)
  b = next(l for l, c in terms.items() if c == -1)
  return Compare(op.fn, a, b, -(x[1] - y[1]))


def _abs_window(region: ir.Region, op) -> Optional[Keep]:
  """``abs(iota(a) - iota(b) + c) <= k`` (or ``<``, either side) as the two
  compares it is: ``a - b + c <= k`` and ``b - a - c <= k``."""
  if not (isinstance(op, ir.Elementwise) and op.fn in _FLIP and len(op.args) == 2):
    return None
  for i in (0, 1):
    e, k = op.args[i], op.args[1 - i]
    cmp = op.fn if i == 0 else _FLIP[op.fn]     # e cmp k
    a = region.producer(e) if isinstance(e, str) else None
    if cmp not in ("le", "lt") or not (isinstance(a, ir.Elementwise) and a.fn == "abs"):
      continue
    f, lim = _index_form(region, a.args[0]), _index_form(region, k)
    if f is None or lim is None or lim[0] or sorted(f[0].values()) != [-1, 1]:
      return None
    p = next(l for l, c in f[0].items() if c == 1)
    q = next(l for l, c in f[0].items() if c == -1)
    c, k = f[1], lim[1]
    # p - q + c cmp k  <=>  p cmp q + (k - c);  q - p - c cmp k  <=>  q cmp p + (k + c)
    return (Compare(cmp, p, q, k - c), Compare(cmp, q, p, k + c))
  return None


def relation_to(keep: Optional[Keep], loop: str) -> Optional[Band]:
  """The ``Band`` of ``loop`` that keep predicate ``keep`` allows; None
  when a compare does not relate ``loop`` to one same other loop."""
  if not keep:
    return None
  other, lower, upper = None, None, None
  for c in keep:
    if c.a == loop:
      cmp, o, off = c.cmp, c.b, c.offset
    elif c.b == loop:   # a cmp loop + off  <=>  loop flip(cmp) a - off
      cmp, o, off = _FLIP[c.cmp], c.a, -c.offset
    else:
      return None
    if other is not None and o != other:
      return None
    other = o
    if cmp == "lt":     # integers: i < x  <=>  i <= x - 1
      cmp, off = "le", off - 1
    elif cmp == "gt":
      cmp, off = "ge", off + 1
    if cmp == "le":
      upper = off if upper is None else min(upper, off)
    else:
      lower = off if lower is None else max(lower, off)
  return Band(other, lower, upper)


def iota_relation(region: ir.Region, pred, loop: str) -> Optional[Band]:
  """The ``Band`` of ``loop`` that value ``pred`` keeps when it is one
  compare of two iotas (plus literals); None otherwise."""
  c = _iota_compare(region, pred)
  return None if c is None else relation_to((c,), loop)


# A finite fill at or below this stands for -inf in a mask (jax's
# dot_product_attention fills with -0.7 x the dtype's max, Flax with its
# min): a kept score s gives a masked one the weight exp(fill - s), which is
# 0 in float32 whenever s > fill + 104, i.e. for any score above -9,896.
MASK_FILL_MAX = -1e4


# not (a cmp b)  <=>  a _NEGATE[cmp] b
_NEGATE = {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge"}


def _negate(keep: Optional[Keep]) -> Optional[Keep]:
  """``not keep`` where it is one compare (the negation of a conjunction
  of two is a disjunction, which no ``Keep`` states)."""
  if keep is None or len(keep) != 1:
    return None
  c = keep[0]
  return (Compare(_NEGATE[c.cmp], c.a, c.b, c.offset),)


def _literal(a) -> Optional[float]:
  return float(a.value) if isinstance(a, ir.Literal) else None


def keep_predicate(region: ir.Region, v, depth: int = 0, partial: bool = False
                   ) -> Optional[Keep]:
  """The ``Keep`` (a conjunction of ``Compare``) that boolean value ``v``
  is, seen through the forms masks take: a compare of two iotas, each plus
  an integer literal; ``and``; ``not``; ``select(c, False, True)`` /
  ``select(c, True, False)``; and ``x == k`` / ``x != k`` of
  ``x = select(c, k0, k1)`` with literal ``k``, ``k0``, ``k1``
  (``jnp.tril(jnp.ones((T, T))) == 0``). None otherwise.

  ``partial``: conjuncts of an ``and`` that are none of these (a padding
  mask's ``j < lengths[b]``) are dropped, so the result keeps a superset of
  what ``v`` keeps: enough to know where nothing is kept, never what is."""
  op = region.producer(v) if isinstance(v, str) else None
  if not isinstance(op, ir.Elementwise) or depth > 8:
    return None
  args = op.args
  bare = _iota_compare(region, v)
  if bare is not None:
    return (bare,)
  window = _abs_window(region, op)
  if window is not None:
    return window
  if op.fn in _FLIP or op.fn in ("eq", "ne"):
    # a compare of a two-valued select with a literal: c itself, or not c
    lits = [a for a in args if isinstance(a, ir.Literal)]
    names = [a for a in args if isinstance(a, str)]
    sel = region.producer(names[0]) if len(names) == 1 and len(lits) == 1 else None
    if (isinstance(sel, ir.Elementwise) and sel.fn == "select"
        and _literal(sel.args[1]) is not None and _literal(sel.args[2]) is not None):
      k, k0, k1 = _literal(lits[0]), _literal(sel.args[1]), _literal(sel.args[2])
      fns = {"eq": lambda x: x == k, "ne": lambda x: x != k}
      if op.fn not in fns:
        return None
      when_c, when_not_c = fns[op.fn](k1), fns[op.fn](k0)
      return _predicate_of_select(region, sel.args[0], when_c, when_not_c, depth, partial)
    return None
  if op.fn == "not":
    # The negation of a superset is no superset: strict below.
    return _negate(keep_predicate(region, args[0], depth + 1))
  if op.fn == "and" and len(args) == 2:
    parts = []
    for a in args:
      if _literal(a) is not None:
        if not _literal(a):
          return None      # keeps nothing
        continue
      k = keep_predicate(region, a, depth + 1, partial)
      if k is None and not partial:
        return None
      parts.extend(k or ())
    return tuple(parts) or None
  if op.fn == "select" and _literal(args[1]) is not None and _literal(args[2]) is not None:
    return _predicate_of_select(region, args[0], bool(_literal(args[2])),
                                bool(_literal(args[1])), depth, partial)
  return None


def _predicate_of_select(region, c, when_c: bool, when_not_c: bool, depth: int,
                         partial: bool = False):
  if when_c == when_not_c:
    return None
  if when_c:
    return keep_predicate(region, c, depth + 1, partial)
  return _negate(keep_predicate(region, c, depth + 1))


@dataclasses.dataclass(frozen=True)
class Masked:
  """A masked score (``masked_value``): ``kept`` where ``keep`` holds,
  ``fill`` elsewhere."""
  fill: float
  keep: Keep
  kept: str


def masked_value(region: ir.Region, x, partial: bool = False) -> Optional[Masked]:
  """How value ``x`` keeps a score ``s`` where ``keep`` (a
  ``keep_predicate``) holds and replaces it by literal ``fill`` otherwise:
  ``select(p, fill, s)``, ``select(p, s, fill)`` (fill where p), or the
  additive ``s + select(p, fill, 0)`` / ``s + select(p, 0, fill)``; None
  for anything else (a fill where a conjunction holds keeps a
  disjunction, which is not read). ``partial``: ``keep`` may be a superset
  (``keep_predicate``)."""
  op = region.producer(x) if isinstance(x, str) else None
  if not isinstance(op, ir.Elementwise):
    return None
  if op.fn == "convert" and isinstance(op.args[0], str):
    # A float cast of a masked score (autodiff's softmax in float32 of
    # float16 scores) masks the same, when it keeps the fill.
    m = masked_value(region, op.args[0], partial)
    # (By name: numpy gives bfloat16 kind 'V', not 'f'.)
    names = [region.value_map[a].dtype for a in (op.args[0], x)]
    if m is None or not all(n in ir.FLOAT_DTYPES for n in names):
      return None
    src, dst = (ir.np_dtype(n) for n in names)
    if not (m.fill == -math.inf or dst.itemsize >= src.itemsize):
      return None
    return m
  if op.fn == "select" and isinstance(op.args[0], str):
    p, on_false, on_true = op.args
    if _literal(on_false) is not None and isinstance(on_true, str):
      keep = keep_predicate(region, p, partial=partial)
      if keep is None and partial and _literal(on_false) == -math.inf:
        # Masks applied one after the other (two jnp.where): an outer mask
        # this cannot read only masks more, to the same -inf.
        inner = masked_value(region, on_true, partial=True)
        return inner if inner is not None and inner.fill == -math.inf else None
      return None if keep is None else Masked(_literal(on_false), keep, on_true)
    if _literal(on_true) is not None and isinstance(on_false, str):
      keep = _negate(keep_predicate(region, p))
      return None if keep is None else Masked(_literal(on_true), keep, on_false)
    return None
  if op.fn == "add" and all(isinstance(a, str) for a in op.args):
    for i, s in enumerate(op.args):
      sel = region.producer(s)
      if not (isinstance(sel, ir.Elementwise) and sel.fn == "select"
              and isinstance(sel.args[0], str)):
        continue
      f0, f1 = _literal(sel.args[1]), _literal(sel.args[2])
      if f0 is None or f1 is None or 0.0 not in (f0, f1) or f0 == f1:
        continue
      kept = op.args[1 - i]
      if f1 == 0.0:     # 0 where p: p keeps
        keep = keep_predicate(region, sel.args[0], partial=partial)
        return None if keep is None else Masked(f0, keep, kept)
      keep = _negate(keep_predicate(region, sel.args[0]))
      return None if keep is None else Masked(f1, keep, kept)
  return None


def masked_tile_relation(region: ir.Region, st: StreamedLoop) -> Optional[Band]:
  """The ``Band`` of the streamed loop ``st.loop`` outside which every
  contribution of an index is masked out: each running max reads a
  ``masked_value`` whose keep predicate bounds the loop's iota by those of
  one same other loop, every shift by it subtracts from that masked value,
  and every accumulator is rescaled by one of those maxima (so a masked
  score adds exp(-inf) = 0 everywhere). A tile of the loop whose indices
  all fall outside contributes nothing and may be skipped (a causal mask,
  a sliding window). None otherwise.

  The fill is -inf, or finite at most ``MASK_FILL_MAX`` when every index
  of the other loop keeps at least one index of this loop: a row that keeps
  none averages all its masked values, skipped tiles included."""
  if not st.online:
    return _zero_tile_relation(region, st)
  accs = dict(st.accumulators)
  for v, sc in accs.items():
    if sc is None and v not in st.running_max:
      return None     # a plain accumulator would see the masked tiles
  res = None
  finite = False
  for mx in st.running_max:
    x = region.producer(mx).arg
    m = masked_value(region, x)
    if m is None:
      # A mask with more conjuncts than the band (a causal mask and a
      # padding mask): tiles outside the band are masked all the same. Only
      # with -inf: a row the other conjuncts empty is NaN whatever runs,
      # where a finite fill would average every value, skipped ones too.
      m = masked_value(region, x, partial=True)
      if m is None or m.fill != -math.inf:
        return None
    fill, keep = m.fill, m.keep
    if not fill <= MASK_FILL_MAX:
      return None
    finite = finite or math.isfinite(fill)
    for z, s in st.shifted:
      if s.max == mx and region.producer(z).args[0] != x:
        return None
    r = relation_to(keep, st.loop)
    if r is None or (res is not None and res != r):
      return None
    res = r
  for v, sc in accs.items():
    if sc is not None and sc.max not in st.running_max:
      return None
  if res is not None and finite:
    ext = region.loop_extents
    if not res.keeps_some(ext[st.loop], ext[res.other]):
      return None
  return res


def zero_outside(region: ir.Region, v, depth: int = 0) -> Optional[tuple[Keep, bool]]:
  """``(keep, finite)``: the keep predicate outside which value ``v`` is
  zero, and whether that rests on a finite fill. ``exp`` of a score masked
  to -inf (less a finite shift: ``exp(s - m)`` with the forward's row max),
  a select of 0 where a keep predicate fails, and their products,
  quotients, casts and negations; None where that cannot be read. (A
  recomputing attention backward's probabilities, ``exp(where(keep, s,
  -inf) - m) / l``, and its ``ds = p * (dp - D)``.) Other factors and
  divisors are taken as finite and nonzero, as the forward's skipped tiles
  take the values they would multiply by exp(-inf) = 0.

  A finite fill at most ``MASK_FILL_MAX`` (``jax.nn.dot_product_attention``
  fills with -0.7 x float32's max) gives ``exp(fill - m) = 0`` too, where
  the shift ``m`` is a kept score: so only for rows that keep some index,
  which ``finite`` tells the caller to check (a row that keeps none has
  ``m = fill`` and weighs every index alike)."""
  op = region.producer(v) if isinstance(v, str) else None
  if not isinstance(op, ir.Elementwise) or depth > 16:
    return None
  if op.fn == "exp":
    x = op.args[0]
    sub = region.producer(x) if isinstance(x, str) else None
    if (isinstance(sub, ir.Elementwise) and sub.fn == "sub" and isinstance(sub.args[0], str)
        and masked_value(region, sub.args[1], partial=True) is None):
      x = sub.args[0]
    m = masked_value(region, x)
    if m is not None and m.fill != -math.inf:
      # A partial keep is not read with a finite fill: a row the other
      # conjuncts empty would weigh every index.
      return (m.keep, True) if m.fill <= MASK_FILL_MAX else None
    m = m or masked_value(region, x, partial=True)
    return (m.keep, False) if m is not None and m.fill == -math.inf else None
  if op.fn in ("convert", "neg") or (op.fn == "div" and isinstance(op.args[0], str)):
    return zero_outside(region, op.args[0], depth + 1)
  if op.fn == "select" and isinstance(op.args[0], str):
    # where(keep, x, 0): autodiff's gradient through a mask's jnp.where.
    p, on_false, on_true = op.args
    keep = None
    if _literal(on_false) == 0.0 and isinstance(on_true, str):
      keep = keep_predicate(region, p)
    elif _literal(on_true) == 0.0 and isinstance(on_false, str):
      keep = _negate(keep_predicate(region, p))
    return None if keep is None else (keep, False)
  if op.fn == "mul":
    for a in op.args:
      z = zero_outside(region, a, depth + 1) if isinstance(a, str) else None
      if z is not None:
        return z
  return None


def _zero_tile_relation(region: ir.Region, st: StreamedLoop) -> Optional[Band]:
  """``masked_tile_relation`` of a loop without an online softmax: every
  accumulator is a contraction or a sum over it of a value that is zero
  outside one same band (``zero_outside``), so a tile wholly outside adds
  nothing (a FlashAttention-style backward's dq, dk and dv under a causal
  mask)."""
  res = None
  finite: list[Keep] = []
  for v, sc in st.accumulators:
    op = region.producer(v)
    if sc is not None:
      return None
    if isinstance(op, ir.Contraction):
      zs = [zero_outside(region, a) for a in (op.lhs, op.rhs)]
    elif isinstance(op, ir.Reduction) and op.kind == "sum":
      zs = [zero_outside(region, op.arg)]
    else:
      return None
    zs = [z for z in zs if z is not None]
    bands = {relation_to(k, st.loop) for k, _ in zs} - {None}
    if len(bands) != 1:
      return None
    (r,) = bands
    if res is not None and res != r:
      return None
    res = r
    # The band's zero rests on a finite fill unless an operand is zero
    # outside it by a -inf fill or a select of 0.
    ours = [(k, f) for k, f in zs if relation_to(k, st.loop) == r]
    if all(f for _, f in ours):
      finite.extend(k for k, _ in ours)
  ext = region.loop_extents
  for keep in finite if res is not None else ():
    # Each row's shift must be a kept score, whichever of the two loops
    # the rows are (the query loop is streamed in dk and dv, not in dq):
    # every index of each loop keeps one of the other's.
    back = relation_to(keep, res.other)
    if (back is None or not res.keeps_some(ext[st.loop], ext[res.other])
        or not back.keeps_some(ext[res.other], ext[st.loop])):
      return None
  return res


def masked_tile_relations(region: ir.Region) -> dict[str, Band]:
  """Loop -> ``Band`` for every streamed loop of ``region`` whose
  masked tiles the code generator skips (``masked_tile_relation``)."""
  return analyze(region).masked_tiles(region)


@dataclasses.dataclass(frozen=True)
class LengthBound:
  """A streamed loop's indices ``i`` that a mask keeps while ``i < length +
  offset``, where ``length`` is a region input read at run time (each
  sequence's own length in a padded batch). Its tiles past the bound
  contribute nothing and may be skipped, as ``masked_tile_relation``'s may;
  the bound is a value, not a constant, so only the kernel knows how many."""
  length: str
  offset: int = 0


def _length_compare(region: ir.Region, p, loop: str) -> Optional[tuple[str, str, int]]:
  """``(cmp, length, k)`` when boolean ``p`` is ``iota(loop) + k cmp length``
  (either side), ``length`` an integer region input."""
  op = region.producer(p) if isinstance(p, str) else None
  if not (isinstance(op, ir.Elementwise) and op.fn in _FLIP and len(op.args) == 2):
    return None
  inputs = set(region.input_names)
  for i in (0, 1):
    idx, other = _index_form(region, op.args[i]), op.args[1 - i]
    if (idx is None or idx[0] != {loop: 1} or not isinstance(other, str) or other not in inputs
        or not region.value_map[other].dtype.startswith(("int", "uint"))):
      continue
    return (op.fn if i == 0 else _FLIP[op.fn]), other, idx[1]
  return None


def length_inputs(region: ir.Region) -> dict[str, int]:
  """Integer inputs that bound a loop's indices from above (``iota(l) + k <
  n`` or ``<=``: a sequence's length), each with a value at which every
  index of every loop it bounds is kept. Measured tuning times kernels on
  such lengths: the whole work, which the cost model prices; random small
  integers would let a kernel that stops at the length skip most of it."""
  out: dict[str, int] = {}
  for op in region.ops:
    if not isinstance(op, ir.Elementwise):
      continue
    for l in region.value_map[op.out].loops:
      c = _length_compare(region, op.out, l)
      if c is not None and c[0] in ("lt", "le"):
        out[c[1]] = max(out.get(c[1], 0), region.extent(l) + abs(c[2]) + 1)
  return out


def _upper_bound(region: ir.Region, p, loop: str, keep_when: bool = True
                 ) -> Optional[LengthBound]:
  """The ``LengthBound`` that boolean ``p`` (or ``not p`` when
  ``keep_when`` is False) keeps along ``loop``: ``iota(loop) + k < n`` or
  ``<=`` (``_length_compare``). A lower bound (>, >=) keeps the far end:
  not a length."""
  c = _length_compare(region, p, loop)
  if c is None:
    return None
  cmp, length, k = c
  if not keep_when:
    cmp = _NEGATE[cmp]
  # i + k < n  <=>  i < n - k;  i + k <= n  <=>  i < n - k + 1.
  if cmp == "lt":
    return LengthBound(length, -k)
  if cmp == "le":
    return LengthBound(length, 1 - k)
  return None


def _conjuncts(region: ir.Region, p, depth: int = 0) -> list:
  """The operands of a tree of ``and``s (``p`` itself when it is none)."""
  op = region.producer(p) if isinstance(p, str) else None
  if (depth < 8 and isinstance(op, ir.Elementwise) and op.fn == "and"
      and all(isinstance(a, str) for a in op.args)):
    return [c for a in op.args for c in _conjuncts(region, a, depth + 1)]
  return [p]


def _select_parts(region: ir.Region, x) -> Optional[tuple[str, ir.Literal, str, bool]]:
  """``(predicate, fill, kept, keep_when)`` of ``x = select(..)`` with one
  literal side: ``kept`` where the predicate is ``keep_when``."""
  op = region.producer(x) if isinstance(x, str) else None
  if not (isinstance(op, ir.Elementwise) and op.fn == "select" and isinstance(op.args[0], str)):
    return None
  p, on_false, on_true = op.args
  if isinstance(on_false, ir.Literal) and isinstance(on_true, str):
    return p, on_false, on_true, True
  if isinstance(on_true, ir.Literal) and isinstance(on_false, str):
    return p, on_true, on_false, False
  return None


def output_length_bound(region: ir.Region) -> Optional[tuple[str, LengthBound, str]]:
  """``(loop, bound, how)`` when every output of ``region`` discards its
  entries past one length along ``loop`` (the rows of a padded batch's
  result past each sequence's length): ``how`` is 'select' where each
  output is a literal there (``select(i < n, 0, o)``), 'mul' where some
  output is a product with the mask (``o * (i < n)``, as
  ``jax.nn.dot_product_attention`` writes it). None otherwise.

  A program whose tile of ``loop`` lies wholly past the length keeps
  nothing its reduction loops compute. Under 'select' they may run no
  tile: a select drops even the NaN of an empty softmax. Under 'mul' they
  must run one, so that the product is 0 x a finite value."""
  res, how = None, "select"
  for b in region.outputs:
    hits = []
    sel = _select_parts(region, b.value)
    for l in region.value_map[b.value].loops:
      bound = sel and _upper_bound(region, sel[0], l, sel[3])
      if bound is not None:
        hits.append((l, bound, "select"))
        continue
      op = region.producer(b.value)
      if isinstance(op, ir.Elementwise) and op.fn == "mul" and len(op.args) == 2:
        for a in op.args:
          cv = region.producer(a) if isinstance(a, str) else None
          pred = cv.args[0] if isinstance(cv, ir.Elementwise) and cv.fn == "convert" else None
          bound = pred is not None and _upper_bound(region, pred, l)
          if bound:
            hits.append((l, bound, "mul"))
            break
    if len(hits) != 1 or (res is not None and res != hits[0][:2]):
      return None
    res = hits[0][:2]
    if hits[0][2] == "mul":
      how = "mul"
  return None if res is None else (*res, how)


def _length_masked(region: ir.Region, x, loop: str
                   ) -> Optional[tuple[float, LengthBound, list[tuple[str, LengthBound]],
                                       Optional[Band]]]:
  """``(fill, bound, rows, band)`` when value ``x`` is a score kept below a
  length along ``loop`` and a literal ``fill`` past it: ``select(keep, fill,
  s)`` where ``keep`` is ``i + k < n`` (or ``<=``), or the negation of a
  lower bound on the other side; or a conjunction of such a compare with
  upper length bounds on other loops, ``rows`` (``jax.nn.dot_product_
  attention``'s query and key masks, joined by ``and``), and with compares
  of indices, whose ``band`` along ``loop`` it gives (a causal mask).

  Under a finite fill the band must keep index 0 of every row (no lower
  bound, upper >= 0): with a positive length every row then keeps a score
  and the fill weighs nothing; the kernel runs every tile where the length
  is not positive (``triton_printer``)."""
  sel = _select_parts(region, x)
  if sel is None:
    return None
  p, fill, kept, keep_when = sel
  finite = float(fill.value) != -math.inf
  parts = _conjuncts(region, p) if keep_when else [p]
  bound, rows, keeps = None, [], []
  for c in parts:
    b = _upper_bound(region, c, loop, keep_when)
    if b is not None and bound is None:
      bound = b
      continue
    other = [(l, _upper_bound(region, c, l)) for l in region.value_map[c].loops if l != loop]
    other = [(l, ob) for l, ob in other if ob is not None]
    k = keep_predicate(region, c) if keep_when else None
    if len(other) == 1:
      rows.append(other[0])
    elif k is not None:
      keeps.extend(k)
    elif finite:
      # Any other conjunct only masks more: past the length nothing is kept
      # either way. With -inf a row it empties is NaN whatever runs; a
      # finite fill would average what the loop reads.
      return None
  band = relation_to(tuple(keeps), loop) if keeps else None
  if finite and keeps and (band is None or band.lower is not None or band.upper is None
                           or band.upper < 0):
    return None
  if bound is not None and finite and (
      _select_parts(region, kept) is not None or masked_value(region, kept) is not None):
    # A finite fill over another mask: a row that one empties averages
    # every value, past the length too.
    return None
  if bound is None:
    if finite:
      return None
    # Masks applied one after the other: the length may be an inner one.
    inner = _length_masked(region, kept, loop)
    if inner is None or inner[0] != -math.inf:
      return None
    return inner[0], inner[1], rows + inner[2], inner[3]
  return float(fill.value), bound, rows, band


def length_bound(region: ir.Region, st: StreamedLoop) -> Optional[LengthBound]:
  """See ``length_mask``: its bound."""
  a = length_mask(region, st)
  return None if a is None else a[0]


def guarded_band(region: ir.Region, st: StreamedLoop) -> Optional[tuple[Band, LengthBound]]:
  """``(band, bound)`` for a mask with a finite fill (the library's, -0.7 x
  the dtype's max) that joins index compares (a causal mask) with a length
  (``_length_masked``): tiles outside the band may be skipped, as
  ``masked_tile_relation``'s, but only where the length is positive (then
  every row keeps index 0, and the fill weighs nothing); the kernel checks
  that at run time. None where ``masked_tile_relation`` applies already,
  or there is no such mask."""
  a = length_mask(region, st)
  if a is None or a[1] is None or masked_tile_relation(region, st) is not None:
    return None
  return a[1], a[0]


def length_mask(region: ir.Region, st: StreamedLoop
                     ) -> Optional[tuple[LengthBound, Optional[Band]]]:
  """``(bound, band)``: the ``LengthBound`` of streamed loop ``st.loop``
  past which every contribution is masked out, and the ``Band`` of index
  compares its mask joins (``_length_masked``; None: none), under the
  conditions of ``masked_tile_relation``: every running max reads the one length-masked
  score, every shift subtracts from it, and every accumulator is rescaled
  by those maxima. None otherwise.

  A finite fill (at most ``MASK_FILL_MAX``) stands for -inf only where a
  row keeps some index, i.e. where the length is positive; the kernel runs
  every tile where it is not (``triton_printer``), which is exact for
  either fill. A mask that also bounds the rows by a length
  (``_length_masked``) needs every output to discard the rows past it
  (``output_length_bound``)."""
  if not st.online:
    return None
  for v, sc in st.accumulators:
    if sc is None and v not in st.running_max:
      return None
    if sc is not None and sc.max not in st.running_max:
      return None
  res, band, discarded = None, None, output_length_bound(region)
  for mx in st.running_max:
    x = region.producer(mx).arg
    m = _length_masked(region, x, st.loop)
    if m is None or not m[0] <= MASK_FILL_MAX:
      return None
    # Rows that another length keeps nothing of average what the loop
    # reads (a finite fill): stopping at this length changes them, so
    # every output must discard them.
    for l, b in m[2]:
      if discarded is None or discarded[:2] != (l, b):
        return None
    for z, s in st.shifted:
      if s.max == mx and region.producer(z).args[0] != x:
        return None
    if res is not None and (res != m[1] or band != m[3]):
      return None
    res, band = m[1], m[3]
  return None if res is None else (res, band)
