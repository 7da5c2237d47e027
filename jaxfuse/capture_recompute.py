"""Recompute: each contraction gets its own copy of a shared wide intermediate.

A region fuses one chain of contractions. When a wide intermediate (a value
the size of a contraction's operand, attention's [B, H, T, T] scores and
probabilities) is read by several contractions, every chain but one must
read it from memory, so the chain that computes it must write it. In a
training step that is the rule, not the exception: autodiff saves the
forward's probabilities ``p``, and the backward reads them in ``dv = p.T @ do``
and, through ``ds = p * (dp - D)``, in ``dq`` and ``dk``. Written out, the
[T, T] tensors are most of the step's traffic.

FlashAttention's answer, applied here to any chain: recompute. Each
contraction after the first that reads a wide value gets a copy of the ops
that compute it (its *cone*): back through wide values to narrow ones,
which it reads as they are. Row statistics (a reduction's result: a
softmax's max and sum) are narrow, so copies read them instead of
recomputing them: the first chain computes them once, the copies use them,
exactly as a FlashAttention backward reads the forward's row max and sum.
Capture then sees one chain per contraction, each fusible on its own.

A cone is copied only when it is cheap to recompute: its contractions
contract at most ``MAX_RECOMPUTE_CONTRACTION`` elements (attention's head
dimension; recomputing such a product costs less than reading its result
back), its other ops are ones a region fuses, and nothing in it has effects
or sits inside a custom-derivative call. Where a copy is not fused after
all, XLA's common-subexpression pass merges it with the original, so the
program computes what it did before.

Before the copies are planned, a row sum of a product against such a
value is taken from a product the first chain already forms, where the
algebra allows (``reassociate``): autodiff's ``rowsum(p * (do @ v.T))``
becomes ``rowsum(do * o)``, FlashAttention-2's D, so it needs no copy.

Example::

    lvl = reassociate(flatten(jax.make_jaxpr(train_step)(q, k, v, g)))
    copies = plan(lvl)      # consumer idx -> the cone items it recomputes
    new_lvl = apply(lvl, copies)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxfuse.capture_flat import FVar, Item, Level, is_lit, spec_of
from jaxfuse.capture_ir import PRIMITIVES, REDUCE_PRIMS, contraction_size, is_contraction

__all__ = ["MAX_RECOMPUTE_CONTRACTION", "apply", "plan", "reassociate"]

# Largest contraction a copy recomputes. Recomputing a product of K-element
# dot products costs 2K flops per element; writing it and reading it back
# moves 4-8 bytes per element, the time of 1200-2400 tensor-core flops on an
# H100 (about 300 flops per byte of HBM). At K <= 256 (head dims, 512 flops)
# recomputing is the cheaper side; a projection's K of 768 and more is not.
MAX_RECOMPUTE_CONTRACTION = 256
# Most items in one cone: keeps the copies (and the analysis) small.
_MAX_CONE = 64


def _size(a) -> int:
  return math.prod(getattr(a.aval, "shape", ()))


def _copyable(it: Item) -> bool:
  if it.groups or it.eqn.effects or len(it.outvars) != 1:
    return False
  if it.prim == "dot_general":
    # Only a product wider than its operands (q @ k.T): recomputing one
    # that reduces a wide operand (p @ v) would read that operand again.
    return (is_contraction(it) and contraction_size(it) <= MAX_RECOMPUTE_CONTRACTION
            and all(_size(a) < _size(it.outvars[0]) for a in it.invars))
  return it.prim in PRIMITIVES and it.prim not in REDUCE_PRIMS


def _cone(lvl: Level, operand) -> set[int] | None:
  """Items that compute ``operand`` from narrower values (those with fewer
  elements than it) and from values no copy may recompute; None when the
  cone has no contraction (nothing worth recomputing) or is too large."""
  if not isinstance(operand, FVar):
    return None
  wide = _size(operand)
  seen: set[int] = set()
  stack = [operand]
  while stack:
    a = stack.pop()
    if not isinstance(a, FVar) or a.is_const or _size(a) < wide:
      continue
    p = lvl.producer.get(a)
    if p is None or p.idx in seen or not _copyable(p):
      continue
    seen.add(p.idx)
    if len(seen) > _MAX_CONE:
      return None
    stack.extend(p.invars)
  if not any(lvl.items[i].prim == "dot_general" for i in seen):
    return None
  return seen


def plan(lvl: Level) -> dict[int, set[int]]:
  """Which consumers get copies: consumer idx -> the items it recomputes.

  Consumers are contractions, and reductions that bring in a contraction of
  their own. The first contraction (in program order) to read a cone keeps
  the original; each later one whose cone shares an item with an earlier
  kept cone gets a copy of its whole cone. A reduction reading a kept cone
  stays with it (a softmax's max and sum belong to the chain that keeps the
  scores) unless its cone holds a contraction no kept cone has: autodiff's
  ``rowsum(p * dp)`` with ``dp = do @ v.T``, which then gets a copy too (a
  reduction region of its own) rather than making the kept chain write
  ``p``."""
  claimed: set[int] = set()
  copies: dict[int, set[int]] = {}
  reductions: list[tuple[Item, set[int]]] = []
  for it in lvl.items:
    if it.groups:
      continue
    if it.prim in REDUCE_PRIMS:
      cone = _cone(lvl, it.invars[0])
      if cone:
        reductions.append((it, cone))
      continue
    if not is_contraction(it):
      continue
    cone = set()
    for a in it.invars:
      cone |= _cone(lvl, a) or set()
    if not cone:
      continue
    if cone & claimed:
      copies[it.idx] = cone
    else:
      claimed |= cone
  for it, cone in reductions:
    own = {i for i in cone if lvl.items[i].prim == "dot_general"} - claimed
    if cone & claimed and own:
      copies[it.idx] = cone
  return copies


def apply(lvl: Level, copies: dict[int, set[int]]) -> Level:
  """``lvl`` with each consumer reading its own copy of its cone, the copy's
  items placed just before the consumer. Items nothing reads any more stay
  (the emitter drops dead items)."""
  items: list[Item] = []
  renum: dict[int, int] = {}

  def add(it: Item, invars: list, outvars: list, old: int | None) -> None:
    new = Item(len(items), it.eqn, invars, outvars, it.groups, it.path)
    if old is not None:
      renum[old] = new.idx
    items.append(new)

  for it in lvl.items:
    cone = copies.get(it.idx)
    env: dict = {}
    if cone:
      for i in sorted(cone):
        c = lvl.items[i]
        outs = [FVar(o.aval) for o in c.outvars]
        env.update(zip(c.outvars, outs))
        add(c, [env.get(a, a) if isinstance(a, FVar) else a for a in c.invars], outs, None)
    add(it, [env.get(a, a) if isinstance(a, FVar) else a for a in it.invars],
        list(it.outvars), it.idx)
  groups = {k: dataclasses.replace(g, items=[renum[i] for i in g.items])
            for k, g in lvl.groups.items()}
  new = Level(lvl.invars, lvl.constvars, lvl.outvars, items, groups)
  new.build_maps()
  return new


# --------------------------------------------------------------------------
# Row sums of a product against the probabilities (FlashAttention-2's D)
# --------------------------------------------------------------------------

@dataclasses.dataclass
class _RowSum:
  """``sum_n (A @ B)[.., m, n] * X[.., m, n] * f[.., m]`` where a product
  ``O = P @ B`` over n exists with ``P = cast(X / S)`` (or ``X * S``), ``S``
  a row factor: the sum is ``f * S^(+-1) * sum_h A[.., m, h] * O[.., m, h]``."""
  reduce: Item
  a: FVar
  o: FVar
  spec: str               # einsum of A and O giving the sum's axes
  factors: list           # row factors (FVar or literal) multiplying it
  divisors: list          # row factors dividing it


def _producer(lvl: Level, a):
  return lvl.producer.get(a) if isinstance(a, FVar) else None


def _row_factor(a, y_shape, axes) -> bool:
  """A scalar, or a value of ``y_shape``'s rank of size 1 along ``axes``
  and equal elsewhere (a keepdims row statistic)."""
  shape = tuple(getattr(getattr(a, "aval", None), "shape", ()))
  if not shape:
    return True
  return (len(shape) == len(y_shape)
          and all((d == 1) if i in axes else (d == y_shape[i]) for i, d in enumerate(shape)))


def _factors(lvl: Level, y, y_shape, axes, depth: int = 0):
  """``y`` as (wide factors, row factors, row divisors) of a product tree of
  ``mul`` and ``div`` by row factors; None where it is not one."""
  p = _producer(lvl, y)
  if p is not None and not p.groups and depth < 8:
    if p.prim == "mul":
      parts = [_factors(lvl, x, y_shape, axes, depth + 1) for x in p.invars]
      if all(parts):
        return tuple(sum((q[i] for q in parts), []) for i in range(3))
    if p.prim == "div" and _row_factor(p.invars[1], y_shape, axes):
      q = _factors(lvl, p.invars[0], y_shape, axes, depth + 1)
      if q:
        return q[0], q[1], q[2] + [p.invars[1]]
  if _row_factor(y, y_shape, axes):
    return [], [y], []
  return [y], [], []


def _through_converts(lvl: Level, a):
  p = _producer(lvl, a)
  while p is not None and p.prim == "convert_element_type" and not p.groups:
    a = p.invars[0]
    p = _producer(lvl, a)
  return a


def _row_sum(lvl: Level, r: Item) -> "_RowSum | None":
  """``r`` as a ``_RowSum``, or None."""
  if r.prim != "reduce_sum" or r.groups or not isinstance(r.invars[0], FVar):
    return None
  y = r.invars[0]
  y_shape = tuple(y.aval.shape)
  axes = set(r.params["axes"])
  parts = _factors(lvl, y, y_shape, axes)
  if not parts or len(parts[0]) != 2:
    return None
  wide, factors, divisors = parts
  for i in (0, 1):
    dp = _producer(lvl, _through_converts(lvl, wide[i]))
    # The product may reach the sum through a transpose (jax.nn.
    # dot_product_attention's backward moves its size-1 group axis).
    perm = None
    if dp is not None and dp.prim == "transpose" and not dp.groups:
      perm = tuple(int(j) for j in dp.params["permutation"])
      dp = _producer(lvl, dp.invars[0])
    if dp is not None and is_contraction(dp) and not dp.groups:
      x = wide[1 - i]
      break
  else:
    return None
  (lc, rc), (lb, rb) = dp.params["dimension_numbers"]
  a, b = dp.invars
  na, nb = len(a.aval.shape), len(b.aval.shape)
  # Labels: batch, A's free (m), B's free (n), the contracted (h).
  labels = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
  la, lb_ = [None] * na, [None] * nb
  for i, j in zip(lb, rb):
    la[i] = lb_[j] = next(labels)
  for i, j in zip(lc, rc):
    la[i] = lb_[j] = next(labels)
  for i in range(na):
    la[i] = la[i] or next(labels)
  for j in range(nb):
    lb_[j] = lb_[j] or next(labels)
  dp_out = ([la[i] for i in lb] + [la[i] for i in range(na) if i not in lc and i not in lb]
            + [lb_[j] for j in range(nb) if j not in rc and j not in rb])
  dp_shape = tuple(dp.outvars[0].aval.shape)
  if perm is not None:
    # From here on every axis is the sum's: label the transposed product.
    dp_out = [dp_out[j] for j in perm]
    dp_shape = tuple(dp_shape[j] for j in perm)
  n_labels = {lb_[j] for j in range(nb) if j not in rc and j not in rb}
  h_labels = {lb_[j] for j in rc}
  if (not isinstance(x, FVar)
      or not tuple(x.aval.shape) == dp_shape == y_shape
      or {dp_out[i] for i in axes} != n_labels):
    return None
  # A product O of P (X over a row factor, cast) and the same B over n.
  after_r = lvl.depends({r.idx})
  for o_it in lvl.consumers.get(b, ()):
    if o_it is dp or not is_contraction(o_it) or o_it.groups or after_r(o_it):
      continue
    pos_b = o_it.invars.index(b)
    pvar = o_it.invars[1 - pos_b]
    src = _through_converts(lvl, pvar)
    s_op = _producer(lvl, src)
    scale = None
    if src is x:
      scale = ("none", None)
    elif (s_op is not None and s_op.prim in ("div", "mul") and s_op.invars[0] is x
          and _row_factor(s_op.invars[1], y_shape, axes) and not s_op.groups):
      scale = (s_op.prim, s_op.invars[1])
    if scale is None or tuple(pvar.aval.shape) != y_shape:
      continue
    (oc0, oc1), (ob0, ob1) = o_it.params["dimension_numbers"]
    cp, cb = (oc1, oc0) if pos_b == 0 else (oc0, oc1)
    bp_, bb_ = (ob1, ob0) if pos_b == 0 else (ob0, ob1)
    if (any(dp_out[i] != lb_[j] for i, j in zip(cp, cb))
        or any(dp_out[i] != lb_[j] for i, j in zip(bp_, bb_))
        or {dp_out[i] for i in cp} != n_labels
        or {lb_[j] for j in range(nb) if j not in cb and j not in bb_} != h_labels):
      continue
    p_free = [dp_out[i] for i in range(len(y_shape)) if i not in cp and i not in bp_]
    b_free = [lb_[j] for j in range(nb) if j not in cb and j not in bb_]
    o_out = [dp_out[i] for i in bp_] + (b_free + p_free if pos_b == 0 else p_free + b_free)
    out = "".join(dp_out[i] for i in range(len(y_shape)) if i not in axes)
    spec = f"{''.join(la)},{''.join(o_out)}->{out}"
    factors, divisors = list(factors), list(divisors)
    if scale[0] == "div":
      factors.append(scale[1])    # X = P * S
    elif scale[0] == "mul":
      divisors.append(scale[1])   # X = P / S
    return _RowSum(r, a, o_it.outvars[0], spec, factors, divisors)
  return None


def _row_sum_item(rs: _RowSum) -> Item:
  """An item computing ``rs``'s sum from A, O and the row factors (one
  ``jit`` call equation, inlined when the level is flattened again)."""
  out = rs.reduce.outvars[0]
  row = [f for f in (*rs.factors, *rs.divisors) if not is_lit(f)]
  ins = [rs.a, rs.o, *row]
  nf = len(rs.factors)

  def fn(a, o, *vals):
    it = iter(vals)
    t = jnp.einsum(rs.spec, a.astype(jnp.float32), o.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    for i, f in enumerate((*rs.factors, *rs.divisors)):
      v = f.val if is_lit(f) else next(it)
      v = jnp.reshape(jnp.asarray(v, jnp.float32), t.shape) if jnp.ndim(v) else v
      t = t * v if i < nf else t / v
    return t.astype(out.aval.dtype)

  closed = jax.make_jaxpr(jax.jit(fn))(*[spec_of(v.aval) for v in ins])
  [eqn] = closed.jaxpr.eqns
  r = rs.reduce
  return Item(r.idx, eqn, ins, [out], (), r.path)


def reassociate(lvl: Level) -> Level:
  """``lvl`` with each row sum of a product against the probabilities of a
  product over the same operand computed from that product instead
  (``_RowSum``): autodiff's ``rowsum(p * (do @ v.T))`` becomes
  ``rowsum(do * o)``, FlashAttention-2's D. Why: the sum otherwise needs
  the whole [T, T] ``do @ v.T`` (a region of its own, recomputing ``p``);
  from ``o`` it is a [T, D] product. It rounds ``p`` as the forward did
  (to the dtype of ``p @ v``), where the original sums it unrounded."""
  new: dict[int, Item] = {}
  for it in lvl.items:
    rs = _row_sum(lvl, it)
    if rs is not None:
      try:
        new[it.idx] = _row_sum_item(rs)
      except Exception:  # pylint: disable=broad-except
        continue   # left as written
  if not new:
    return lvl
  items = [new.get(it.idx, it) for it in lvl.items]
  out = Level(lvl.invars, lvl.constvars, lvl.outvars, items, lvl.groups)
  out.build_maps()
  return out
