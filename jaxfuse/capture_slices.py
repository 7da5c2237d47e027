"""Slices of a contraction's result, rewritten as contractions of windows.

A packed projection computes several results with one GEMM and splits them
apart afterwards::

    g, u = jnp.split(x @ w_gu, 2, axis=-1)      # a gated MLP's gate and up
    y = (jax.nn.silu(g) * u) @ w_down

Each part equals the contraction of a *window* of the packed operand
(``g == x @ w_gu[:, :F]``), and in that form capture sees what it fuses
already: sibling contractions joined by cheap ops, reading windows of one
input in place (``capture_ir.WINDOW_PRIMS``). The split in between had cut
the chain, so such MLPs ran as XLA's ops.

``push_slices`` rewrites a flattened level that way before analysis. The
rewrite only pays inside a fused region: for XLA, two GEMMs over strided
weight windows cost more than the one packed GEMM. So capture keeps a
pushed contraction only when one region absorbs all its parts
(``unabsorbed`` names the others, and capture analyses the level again
without them), and wherever a region's original ops are emitted (its
fallback jaxpr, a region the planner leaves to XLA) the parts become the
packed contraction and its slices again (``emit_original``). The windows
of one layer ``w_gu[l]`` of stacked weights are taken of the stack itself,
so that a region reads them in place at the layer's offset.

Example::

    lvl = flatten(jax.make_jaxpr(packed_mlp)(x, w_gu, w_down))
    pushes = push_slices(lvl)        # lvl now holds x @ w_gu[:, :F], ...
    found = ...                      # capture's analysis of lvl
    retry = unabsorbed(pushes, found)   # keys to leave packed next time
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxfuse.capture_flat import FVar, Item, Level, bind_eqn, is_lit
from jaxfuse.capture_ir import window_starts

__all__ = ["Pushdown", "push_slices", "unabsorbed", "emit_original"]


@dataclasses.dataclass(eq=False)
class Pushdown:
  """One contraction whose sliced result became contractions of windows.

  Attributes:
    key: the contraction's place in the program (``Item.path``), stable
      across re-flattening.
    dot: the original contraction (no longer an item of the level).
    uses: the original ``slice``/``split`` items of its result.
    side: the operand the windows are taken of (0: lhs, 1: rhs).
    cuts: per used slice output, ``(output, [(operand axis, start, size)])``:
      what ``_plan`` found, from which ``push_slices`` makes the items.
    parts: the new contraction items, one per cut (each produces that
      output's value).
    windows: per part, the new items computing its window of operand
      ``side``: a ``slice``, then the ``squeeze`` of a layer index when the
      operand is one layer ``w[l]`` of a stacked array (see ``via``).
    via: the original equations from the windows' source to operand
      ``side`` (the layer's ``slice`` and ``squeeze``), or () when the
      windows slice the operand itself.
  """
  key: tuple
  dot: Item
  uses: list
  side: int
  cuts: list = dataclasses.field(default_factory=list)
  parts: list = dataclasses.field(default_factory=list)
  windows: list = dataclasses.field(default_factory=list)
  via: tuple = ()

  def window_items(self) -> list:
    return [w for ws in self.windows for w in ws]


def _free_axes(dot: Item) -> list[tuple[int, int] | None]:
  """For each axis of a ``dot_general``'s result: (operand, operand axis)
  for a free axis, None for a batch axis."""
  (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
  out: list = [None] * len(lb)
  for side, (c, b) in enumerate(((lc, lb), (rc, rb))):
    rank = len(dot.invars[side].aval.shape)
    out += [(side, ax) for ax in range(rank) if ax not in c and ax not in b]
  return out


def _plan(lvl: Level, d: Item, group_atoms: set) -> Pushdown | None:
  """The pushdown of ``d`` when every use of its result is a static window
  along free axes of one operand; None otherwise."""
  if d.prim != "dot_general" or len(d.invars) != 2 or any(is_lit(a) for a in d.invars):
    return None
  (out,) = d.outvars
  if out in lvl.out_set or out in group_atoms:
    return None
  uses = lvl.consumers.get(out, [])
  if not uses or len({u.idx for u in uses}) != len(uses):
    return None   # none, or one op reading the result twice
  axes = _free_axes(d)
  shape = tuple(out.aval.shape)
  side = None
  parts = []
  for u in uses:
    if u.prim not in ("slice", "split") or u.groups != d.groups or u.invars[0] is not out:
      return None
    starts = window_starts(u)
    if starts is None:
      return None
    for o, st in zip(u.outvars, starts):
      if o not in lvl.consumers and o not in lvl.out_set and o not in group_atoms:
        continue   # an unused part of a split
      size = tuple(o.aval.shape)
      cut = [ax for ax, (s, n, full) in enumerate(zip(st, size, shape)) if s != 0 or n != full]
      if not cut:
        return None   # a whole copy: nothing to push
      sides = {axes[ax][0] if axes[ax] is not None else None for ax in cut}
      if None in sides or len(sides) != 1:
        return None   # a batch axis, or windows of both operands
      (s_side,) = sides
      if side is not None and s_side != side:
        return None
      side = s_side
      parts.append((o, [(axes[ax][1], st[ax], size[ax]) for ax in cut]))
  if side is None or not parts or not isinstance(d.invars[side], FVar):
    return None
  return Pushdown(d.path, d, list(uses), side, parts)


def _layer_of(lvl: Level, operand: FVar, groups: tuple):
  """``(source, layer)``: when ``operand`` is one layer ``w[l]`` of a
  stacked array (a unit-stride ``slice`` of ``w``, then a ``squeeze`` of the
  sliced unit axes), the windows are taken of ``w`` itself, so that a region
  reads them in place as it reads ``w[l]`` (``capture_ir.WINDOW_PRIMS``):
  ``(w, (slice item, squeeze item), axis of w for each operand axis)``.
  Otherwise ``(operand, (), identity axes)``."""
  plain = operand, (), list(range(len(operand.aval.shape)))
  sq = lvl.producer.get(operand)
  if sq is None or sq.prim != "squeeze" or sq.groups != groups:
    return plain
  sl = lvl.producer.get(sq.invars[0])
  if (sl is None or sl.prim != "slice" or sl.groups != groups or window_starts(sl) is None
      or not isinstance(sl.invars[0], FVar)):
    return plain
  dims = tuple(int(a) for a in sq.params["dimensions"])
  rank = len(sl.outvars[0].aval.shape)
  return sl.invars[0], (sl, sq), [a for a in range(rank) if a not in dims]


@functools.lru_cache(maxsize=512)
def _slice_eqn(shape: tuple, dtype: str, weak: bool, start: tuple, limit: tuple):
  """A traced ``slice`` equation (the parameters of this jax version)."""
  spec = jax.ShapeDtypeStruct(shape, np.dtype(dtype), weak_type=weak)
  eqns = jax.make_jaxpr(lambda b: jax.lax.slice(b, start, limit))(spec).jaxpr.eqns
  assert len(eqns) == 1 and eqns[0].primitive.name == "slice", eqns
  return eqns[0]


def push_slices(lvl: Level, skip: frozenset | set = frozenset()) -> list[Pushdown]:
  """Rewrites ``lvl`` in place: each contraction whose result is only read
  through static windows along free axes of one operand (and whose
  ``Item.path`` is not in ``skip``) becomes one contraction per window
  read, of the matching window of that operand. Returns the pushdowns."""
  group_atoms = set()
  for g in lvl.groups.values():
    group_atoms.update(a for a in (*g.invars, *g.outs) if isinstance(a, FVar))
  pushes: dict[int, Pushdown] = {}
  for d in lvl.items:
    if d.prim == "dot_general" and d.path not in skip:
      p = _plan(lvl, d, group_atoms)
      if p is not None:
        pushes[d.idx] = p
  if not pushes:
    return []
  dropped = {u.idx for p in pushes.values() for u in p.uses}
  items: list[Item] = []
  for it in lvl.items:
    if it.idx in dropped:
      continue
    p = pushes.get(it.idx)
    if p is None:
      it.idx = len(items)
      items.append(it)
      continue
    src, layer, axis_of = _layer_of(lvl, it.invars[p.side], it.groups)
    p.via = tuple(x.eqn for x in layer)
    full = tuple(src.aval.shape)
    for o, cut in p.cuts:
      if layer:
        start = list(layer[0].params["start_indices"])
        limit = list(layer[0].params["limit_indices"])
      else:
        start, limit = [0] * len(full), list(full)
      for ax, s, n in cut:
        a = axis_of[ax]
        start[a] += s
        limit[a] = start[a] + n
      eqn = _slice_eqn(full, np.dtype(src.aval.dtype).name,
                       bool(getattr(src.aval, "weak_type", False)), tuple(start), tuple(limit))
      win = FVar(eqn.outvars[0].aval)
      path = it.path + ("window", len(p.parts))
      chain = [Item(len(items), eqn, [src], [win], it.groups, path)]
      items.append(chain[0])
      if layer:
        # The layer index's squeeze; its parameters do not depend on shapes.
        squeeze = layer[1]
        kept = [n for a, n in enumerate(win.aval.shape) if a not in squeeze.params["dimensions"]]
        sq = FVar(win.aval.update(shape=tuple(kept)))
        chain.append(Item(len(items), squeeze.eqn, [win], [sq], it.groups, path + ("squeeze",)))
        items.append(chain[-1])
        win = sq
      ops = list(it.invars)
      ops[p.side] = win
      # The same parameters: a dot_general's do not depend on its shapes.
      d_item = Item(len(items), it.eqn, ops, [o], it.groups, it.path + ("part", len(p.parts)))
      items.append(d_item)
      p.windows.append(chain)
      p.parts.append(d_item)
  lvl.items[:] = items
  for key, g in lvl.groups.items():
    g.items = [it.idx for it in items if key in it.groups]
  lvl.build_maps()
  lvl.pushdowns = {it.idx: p for p in pushes.values() for it in (*p.window_items(), *p.parts)}
  return list(pushes.values())


def unabsorbed(pushes: Sequence[Pushdown], found: Sequence[Any]) -> set:
  """Keys of pushdowns that no single region takes whole together with a
  contraction of its own (``found``: capture's regions, each with its
  ``removed`` item set and ``region``).

  Why the further contraction: a region of the parts alone prices XLA's
  side as one GEMM per part, while XLA runs the one packed GEMM. Packed
  gate/up GEMMs with their join fused that way ran 0.90-0.97x `jax.jit`
  per call at 128 tokens (H100, 2026-11-24; the separate form's same kernel
  beats XLA's two GEMMs by 1.05-1.09x). A chain's further contraction is
  what the packed GEMM's slices had cut."""
  lost = set()
  for p in pushes:
    idxs = {d.idx for d in p.parts}
    if not any(idxs <= f.removed and len(f.region.contractions) > len(idxs) for f in found):
      lost.add(p.key)
  return lost


def emit_original(p: Pushdown, env: dict, read: Callable, item_of: Callable[[Item], Item]
                  ) -> bool:
  """Emits ``p``'s packed contraction and its slices, binding every part's
  output in ``env``; ``read(env, atom)`` reads a value and ``item_of`` maps
  a level item to the one a region emits (reading its input aliases).
  Returns False, emitting nothing, when the operands are not in ``env``
  (the caller then emits the part as it is)."""
  part, win = item_of(p.parts[0]), item_of(p.windows[0][0])
  try:
    ops = [read(env, win.invars[0]) if pos == p.side else read(env, a)
           for pos, a in enumerate(part.invars)]
  except KeyError:
    return False
  for eqn in p.via:   # the layer w[l] again, from the stacked w
    (ops[p.side],) = bind_eqn(eqn, [ops[p.side]])
  (full,) = bind_eqn(p.dot.eqn, ops)
  for u in p.uses:
    for o, v in zip(u.outvars, bind_eqn(u.eqn, [full])):
      env[o] = v
  return True
