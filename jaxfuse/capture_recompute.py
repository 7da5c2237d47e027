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

Example::

    lvl = flatten(jax.make_jaxpr(train_step)(q, k, v, g))
    copies = plan(lvl)      # consumer dot idx -> the cone items it recomputes
    new_lvl = apply(lvl, copies)
"""

from __future__ import annotations

import dataclasses
import math

from jaxfuse.capture_flat import FVar, Item, Level
from jaxfuse.capture_ir import CONTRACTION_DTYPES, PRIMITIVES, REDUCE_PRIMS

__all__ = ["MAX_RECOMPUTE_CONTRACTION", "apply", "plan"]

# Largest contraction a copy recomputes. Recomputing a product of K-element
# dot products costs 2K flops per element; reading it back costs its bytes
# (2-4) at a tenth to a third of a flop per byte on a GPU (H100: ~300
# tensor-core flops per byte of HBM). At K <= 256 (head dims) recomputing is
# the cheaper side by far; a projection's K of 768 and more is not.
MAX_RECOMPUTE_CONTRACTION = 256
# Most items in one cone: keeps the copies (and the analysis) small.
_MAX_CONE = 64


def _size(a) -> int:
  return math.prod(getattr(a.aval, "shape", ()))


def _contraction(it: Item) -> int:
  (lc, _), _ = it.params["dimension_numbers"]
  shape = tuple(it.invars[0].aval.shape)
  return math.prod(shape[i] for i in lc)


def _is_product(it: Item) -> bool:
  return (it.prim == "dot_general" and len(it.invars) == 2
          and all(isinstance(a, FVar) for a in it.invars)
          and all(str(a.aval.dtype) in CONTRACTION_DTYPES for a in it.invars))


def _copyable(it: Item) -> bool:
  if it.groups or it.eqn.effects or len(it.outvars) != 1:
    return False
  if it.prim == "dot_general":
    # Only a product wider than its operands (q @ k.T): recomputing one
    # that reduces a wide operand (p @ v) would read that operand again.
    return (_is_product(it) and _contraction(it) <= MAX_RECOMPUTE_CONTRACTION
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
    if not _is_product(it):
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
