"""Flat view of a jaxpr for capture: calls inlined, variables renamed.

Capture analyses one "level" of a program at a time: the equations of a
jaxpr with every ``pjit``/``closed_call`` inlined and every
``custom_jvp_call``/``custom_vjp_call`` looked through (recorded as a
*group*, so that it can be re-emitted as the original call, custom rule and
all, when no region absorbs it). Bodies of ``scan``, ``while``, ``cond`` and
``remat`` are separate levels, analysed recursively.

Because the same inner jaxpr object can be called from several places (a
jitted helper called twice), every inlined instance gets fresh variables:
``FVar`` objects, one per value of the level.

Closed-over constants that hold ``0, 1, ..., n-1`` (``jnp.array(range(n))``,
as ``jax.nn.dot_product_attention`` builds its window masks) become ``iota``
items, so that masks built from them are index compares a kernel computes
rather than arrays it reads (``_is_arange``).

Example::

    level = flatten(jax.make_jaxpr(f)(x))
    for item in level.items:
      print(item.idx, item.prim, item.groups)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

try:  # jax >= 0.4.30
  from jax.extend import core as jex_core
except ImportError:  # pragma: no cover
  from jax import core as jex_core  # type: ignore

Literal = jex_core.Literal
Var = jex_core.Var
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr

# Call primitives that are plain function calls: inlined for analysis and
# emission (jax 0.10 prints pjit as "jit").
INLINE_CALLS = ("pjit", "jit", "closed_call", "core_call")
# Calls with a custom differentiation rule: looked through for analysis,
# re-emitted as the original call unless a region absorbs them whole.
CUSTOM_CALLS = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                "custom_lin")

_ids = itertools.count()


class FVar:
  """A value of a flattened level. ``const`` holds the array of a closed-over
  constant (None otherwise)."""
  __slots__ = ("aval", "id", "const", "is_const")

  def __init__(self, aval, const: Any = None, is_const: bool = False):
    self.aval = aval
    self.id = next(_ids)
    self.const = const
    self.is_const = is_const

  def __repr__(self):
    return f"%{self.id}:{self.aval.str_short() if hasattr(self.aval, 'str_short') else self.aval}"


Atom = Any  # FVar | Literal


def is_lit(a) -> bool:
  return isinstance(a, Literal)


@dataclasses.dataclass(eq=False)
class Item:
  """One primitive equation of a level (never a pjit; maybe a custom call
  that was made opaque)."""
  idx: int
  eqn: Any
  invars: list
  outvars: list
  groups: tuple  # keys of enclosing (non-opaque) custom-call groups, outermost first
  # Where the equation sits in the program (equation indices through the
  # inlined calls): stable when the level is flattened again.
  path: tuple = ()

  @property
  def prim(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> dict:
    return self.eqn.params


@dataclasses.dataclass(eq=False)
class Group:
  """A custom_jvp/custom_vjp call looked through at this level."""
  key: tuple
  eqn: Any
  invars: list   # call-site atoms
  outs: list     # atoms (inner outputs, renamed)
  items: list = dataclasses.field(default_factory=list)  # item indices, contiguous
  parent: tuple | None = None


@dataclasses.dataclass(eq=False)
class Level:
  invars: list
  constvars: list
  outvars: list
  items: list
  groups: dict
  # Item idx of a new window or contraction -> its ``capture_slices.Pushdown``.
  pushdowns: dict = dataclasses.field(default_factory=dict)

  # -- derived maps (built lazily) -----------------------------------------
  def build_maps(self) -> None:
    self.producer: dict[FVar, Item] = {}
    self.consumers: dict[FVar, list[Item]] = {}
    for it in self.items:
      for o in it.outvars:
        self.producer[o] = it
      for a in it.invars:
        if isinstance(a, FVar):
          self.consumers.setdefault(a, []).append(it)
    self.out_set = {a for a in self.outvars if isinstance(a, FVar)}

  def group_items(self, key) -> set[int]:
    return set(self.groups[key].items)

  def depends(self, removed: set) -> Callable[[Item], bool]:
    """A predicate: does an item depend (transitively) on an item in
    ``removed``? Walks back only through items after the first removed one,
    so a query costs the span of the region, not the program."""
    lo = min(removed) if removed else len(self.items)
    memo: dict[int, bool] = {}
    producer = self.producer

    def dep(item: Item) -> bool:
      if item.idx in removed:
        return True
      if item.idx <= lo:
        return False
      if item.idx in memo:
        return memo[item.idx]
      stack = [item]
      order = []
      seen = {item.idx}
      while stack:  # iterative DFS; then resolve in reverse topological order
        it = stack.pop()
        order.append(it)
        for a in it.invars:
          p = producer.get(a) if isinstance(a, FVar) else None
          if (p is not None and p.idx > lo and p.idx not in removed
              and p.idx not in memo and p.idx not in seen):
            seen.add(p.idx)
            stack.append(p)
      order.sort(key=lambda it: it.idx)
      for it in order:
        r = False
        for a in it.invars:
          p = producer.get(a) if isinstance(a, FVar) else None
          if p is not None and (p.idx in removed or (p.idx > lo and memo.get(p.idx, False))):
            r = True
            break
        memo[it.idx] = r
      return memo[item.idx]

    return dep


def _sub_closed(eqn) -> ClosedJaxpr:
  p = eqn.params
  j = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
  if isinstance(j, ClosedJaxpr):
    return j
  return ClosedJaxpr(j, ())


# Integer constants longer than this are not compared with a range: a
# mask's positions are at most a few hundred thousand long, and a large
# integer table (token ids, say) is not worth reading through.
_ARANGE_MAX = 1 << 20


def _is_arange(value, aval) -> bool:
  """Whether constant ``value`` (of abstract value ``aval``) is the vector
  ``0, 1, ..., n-1`` of a signed or unsigned integer type, n >= 2."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if (shape is None or len(shape) != 1 or not 2 <= shape[0] <= _ARANGE_MAX
      or dtype is None or not np.issubdtype(dtype, np.integer)):
    return False
  try:
    v = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return False     # not concrete
  n = shape[0]
  if v.shape != (n,) or v[0] != 0 or v[-1] != n - 1:
    return False
  return bool(np.array_equal(v, np.arange(n, dtype=v.dtype)))


@functools.lru_cache(maxsize=256)
def _iota_eqn(dtype: np.dtype, n: int):
  """A traced ``iota`` equation (the parameters of this jax version)."""
  dtype = np.dtype(dtype)
  eqns = jax.make_jaxpr(lambda: jax.lax.iota(dtype, n))().jaxpr.eqns
  assert len(eqns) == 1 and eqns[0].primitive.name == "iota", eqns
  return eqns[0]


def flatten(closed: ClosedJaxpr, opaque: frozenset = frozenset()) -> Level:
  """Flattens ``closed`` into a Level; custom calls whose key is in
  ``opaque`` stay single items."""
  items: list[Item] = []
  groups: dict[tuple, Group] = {}
  jaxpr = closed.jaxpr
  env: dict = {}
  invars = [FVar(v.aval) for v in jaxpr.invars]
  constvars = []
  env.update(zip(jaxpr.invars, invars))

  # Each reader of an iota gets its own: ``i = jnp.arange(T)`` read as rows
  # and as columns (``i[:, None] >= i[None, :]``, a causal mask) is two
  # loops, which one shared value cannot index (capture_ir would unify them).
  iota_eqns: dict = {}     # an iota item's output -> its equation
  iota_read: set = set()   # those some equation has read

  def iota_of(aval, value, gpath: tuple) -> FVar | None:
    """The output of a new iota item when constant ``value`` is a range."""
    if not _is_arange(value, aval):
      return None
    out = FVar(aval)
    eqn = _iota_eqn(np.dtype(aval.dtype), aval.shape[0])
    items.append(Item(len(items), eqn, [], [out], gpath))
    iota_eqns[out] = eqn
    return out

  def own_iota(v, gpath: tuple):
    """``v``, or a fresh copy of it for a second reader of an iota."""
    eqn = iota_eqns.get(v) if isinstance(v, FVar) else None
    if eqn is None:
      return v
    if v not in iota_read:
      iota_read.add(v)
      return v
    out = FVar(v.aval)
    items.append(Item(len(items), eqn, [], [out], gpath))
    iota_eqns[out] = eqn
    iota_read.add(out)
    return out

  def const(aval, value, gpath: tuple) -> FVar:
    return iota_of(aval, value, gpath) or FVar(aval, value, True)

  for v, c in zip(jaxpr.constvars, closed.consts):
    env[v] = const(v.aval, c, ())
    if env[v].is_const:
      constvars.append(env[v])

  def read(e, a):
    return a if is_lit(a) else e[a]

  def walk(jx, e, gpath: tuple, keypath: tuple):
    for i, eqn in enumerate(jx.eqns):
      name = eqn.primitive.name
      key = keypath + (i,)
      invals = [(is_lit(a) and iota_of(a.aval, a.val, gpath)) or read(e, a)
                for a in eqn.invars]
      if name in INLINE_CALLS or (name in CUSTOM_CALLS and key not in opaque
                                  and "call_jaxpr" in eqn.params):
        inner = _sub_closed(eqn)
        ie: dict = {}
        for v, c in zip(inner.jaxpr.constvars, inner.consts):
          ie[v] = const(v.aval, c, gpath)
        for v, a in zip(inner.jaxpr.invars, invals):
          ie[v] = a
        if name in CUSTOM_CALLS:
          g = Group(key, eqn, invals, [], [], gpath[-1] if gpath else None)
          groups[key] = g
          start = len(items)
          walk(inner.jaxpr, ie, gpath + (key,), key)
          g.items = list(range(start, len(items)))
          g.outs = [read(ie, a) for a in inner.jaxpr.outvars]
        else:
          walk(inner.jaxpr, ie, gpath, key)
        outs = [read(ie, a) for a in inner.jaxpr.outvars]
        for v, o in zip(eqn.outvars, outs):
          if not _is_drop(v):
            e[v] = o
        continue
      invals = [own_iota(a, gpath) for a in invals]
      outs = [FVar(v.aval) for v in eqn.outvars]
      for v, o in zip(eqn.outvars, outs):
        if not _is_drop(v):
          e[v] = o
      if name == "iota":
        iota_eqns[outs[0]] = eqn
      items.append(Item(len(items), eqn, invals, outs, gpath, key))

  walk(jaxpr, env, (), ())
  outvars = [read(env, a) for a in jaxpr.outvars]
  lvl = Level(invars, constvars, outvars, items, groups)
  lvl.build_maps()
  return lvl


def _is_drop(v) -> bool:
  return type(v).__name__ == "DropVar"


# --------------------------------------------------------------------------
# Emission helpers
# --------------------------------------------------------------------------

def spec_of(aval) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              weak_type=bool(getattr(aval, "weak_type", False)))


def bind_eqn(eqn, invals: Sequence, params: dict | None = None) -> list:
  """Binds ``eqn``'s primitive on ``invals`` (like jax.core.eval_jaxpr)."""
  params = eqn.params if params is None else params
  bp = eqn.primitive.get_bind_params(params)
  if isinstance(bp, tuple):  # older jax: (subfuns, params)
    subfuns, bind_params = bp
  else:
    subfuns, bind_params = (), bp
  with _source_context(eqn):
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _source_context(eqn):
  """Keeps the equation's source location on the re-emitted equation, so
  that regions found in rewritten bodies still report file:line."""
  try:
    from jax._src import source_info_util as siu  # pylint: disable=import-outside-toplevel
    return siu.user_context(eqn.source_info.traceback,
                            name_stack=siu.current_name_stack() + eqn.source_info.name_stack)
  except Exception:  # pragma: no cover - internal API moved
    return contextlib.nullcontext()


def eval_jaxpr(jaxpr, consts: Sequence, *args) -> list:
  """Evaluates an open jaxpr by binding its equations (traceable)."""
  env: dict = {}

  def read(a):
    return a.val if is_lit(a) else env[a]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    outs = bind_eqn(eqn, [read(a) for a in eqn.invars])
    for v, o in zip(eqn.outvars, outs):
      if not _is_drop(v):
        env[v] = o
  return [read(a) for a in jaxpr.outvars]


def trace(fn: Callable, avals: Sequence) -> ClosedJaxpr:
  """``jax.make_jaxpr(fn)`` over abstract values (weak types kept)."""
  return jax.make_jaxpr(fn)(*[spec_of(a) for a in avals])


def live_code(closed: ClosedJaxpr) -> ClosedJaxpr:
  """``closed`` without equations whose results nothing reads.

  ``jax.grad`` leaves dead equations in the jaxpr it traces (the JVP of a
  ``reduce_max`` compares the whole input against its maximum, and
  nothing reads the result). XLA drops them later, but a region that
  absorbs their producer would write its value for them: a whole
  [B, T, T] score tensor in an attention's training step. Equations with
  effects stay; so do all inputs, so the signature does not change. Where
  jax's dead-code pass is missing or fails, ``closed`` comes back as is.
  """
  try:
    from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
    jx, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                         instantiate=True)
  except Exception as e:  # pylint: disable=broad-except
    logging.vlog(1, "jaxfuse capture: dead-code pass skipped (%s: %s)", type(e).__name__, e)
    return closed
  if len(jx.eqns) == len(closed.jaxpr.eqns):
    return closed
  return ClosedJaxpr(jx, closed.consts)


def hoist_consts(closed: ClosedJaxpr, in_avals: Sequence | None = None
                 ) -> tuple[ClosedJaxpr, list]:
  """Returns an equivalent ClosedJaxpr without consts that takes the consts as
  leading arguments, and the consts."""
  consts = list(closed.consts)
  if not consts:
    return closed, []
  n = len(consts)
  jx = closed.jaxpr
  const_avals = [aval_of(c) for c in consts]
  in_avals = list(in_avals) if in_avals is not None else [v.aval for v in jx.invars]
  new = trace(lambda *a: eval_jaxpr(jx, a[:n], *a[n:]), const_avals + in_avals)
  assert not new.consts, "hoisting left consts behind"
  return new, consts


def shard_map_like(eqn, body: Callable) -> Callable:
  """``jax.shard_map(body, ...)`` with the mesh, specs, manual axes and
  checking of the ``shard_map`` equation ``eqn`` (its parameters are named
  differently across jax versions)."""
  p = eqn.params
  sm = getattr(jax, "shard_map", None)
  if sm is None:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as sm  # pylint: disable=g-import-not-at-top
  mesh = p["mesh"]
  axes = next((p[k] for k in ("newly_manual_axes", "manual_axes", "axis_names") if k in p),
              None)
  if axes is None:  # pragma: no cover - older jax: every axis not left "auto"
    axes = frozenset(mesh.axis_names) - frozenset(p.get("auto", ()))
  kw = {"check_vma": p["check_vma"]} if "check_vma" in p else {"check_rep": p.get("check_rep", True)}
  return sm(body, mesh=mesh, in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
            axis_names=frozenset(axes), **kw)


def aval_of(x):
  """The abstract value of a concrete array (a jaxpr constant)."""
  typeof = getattr(jax, "typeof", None)
  if typeof is not None:
    return typeof(x)
  return jax.core.get_aval(x)  # pragma: no cover - older jax
