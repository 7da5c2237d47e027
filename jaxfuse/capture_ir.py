"""Builds a Chain IR region from a set of jaxpr equations (capture's back end).

Every array axis of every value in the candidate region is factored into
*dims* (union-find nodes with an extent). Ops unify dims: a contraction
unifies its batch and contracting axes, an elementwise op its equal-sized
axes, a transpose permutes them, a reshape that splits or merges axes splits
dims into row-major parts. After unification each leaf dim is one IR loop, and
every layout op (transpose, reshape, broadcast, squeeze) is only a different
view (list of loops per axis) of the same IR value, so region inputs and
outputs become Buffers with stride maps instead of copies (SOUFFLE-style
affine composition). Size-1 axes introduced by layout ops carry no dim;
jax's implicit size-1 broadcasting in elementwise ops is a broadcast.

Anything the IR cannot express raises ``Reject`` with a reason; capture then
leaves those ops to XLA.

Example::

    region = build_region(items, inputs, outputs, chain)   # ir.Region
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

import numpy as np

from jaxfuse import ir
from jaxfuse.capture_flat import FVar, Item, is_lit

__all__ = ["Reject", "build_region", "dot_precision", "window_starts", "CONTRACTION_DTYPES",
           "PRIMITIVES", "LAYOUT_PRIMS", "POINTWISE_PRIMS", "REDUCE_PRIMS", "WINDOW_PRIMS"]


class Reject(Exception):
  """The candidate cannot be expressed in the IR (the message says why)."""


CONTRACTION_DTYPES = ("float16", "bfloat16", "float32")

_UNARY = {
    "neg": "neg", "abs": "abs", "exp": "exp", "exp2": "exp2", "log": "log",
    "log1p": "log1p", "expm1": "expm1", "tanh": "tanh", "logistic": "logistic",
    "erf": "erf", "sqrt": "sqrt", "rsqrt": "rsqrt", "square": "square",
    "sign": "sign", "not": "not",
}
_BINARY = {
    "add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div",
    "max": "max", "min": "min", "pow": "pow", "eq": "eq", "ne": "ne",
    "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "and": "and", "or": "or",
}
_SPECIAL_POINTWISE = ("erfc", "integer_pow", "is_finite", "clamp", "select_n",
                      "convert_element_type")
POINTWISE_PRIMS = frozenset(_UNARY) | frozenset(_BINARY) | frozenset(_SPECIAL_POINTWISE)
# Ops that only re-index (views): they fold into index maps.
LAYOUT_PRIMS = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze",
                          "expand_dims", "copy", "copy_p", "stop_gradient",
                          "optimization_barrier_identity",
                          # shard_map's type cast to per-device-varying: the value as is
                          "pvary"})
REDUCE_PRIMS = frozenset({"reduce_max", "reduce_sum", "reduce_min"})
PRIMITIVES = POINTWISE_PRIMS | LAYOUT_PRIMS | REDUCE_PRIMS | {"iota", "dot_general"}
# Static windows of a region input (x[:, :64], jnp.split(qkv, 3, -1)): the
# kernel reads them in place, an offset into the whole input, where XLA
# would otherwise copy each window out for the custom call.
WINDOW_PRIMS = frozenset({"slice", "split"})


def is_contraction(it: Item) -> bool:
  """Whether ``it`` is a ``dot_general`` a region can take: two non-empty
  array operands of a contraction dtype, a float result."""
  if it.prim != "dot_general" or len(it.invars) != 2:
    return False
  if any(is_lit(a) for a in it.invars):
    return False
  # An empty array computes nothing to fuse (and the IR has no empty loops).
  if any(0 in tuple(getattr(v.aval, "shape", ())) for v in (*it.invars, *it.outvars)):
    return False
  name = lambda a: np.dtype(a.aval.dtype).name
  return (all(name(a) in CONTRACTION_DTYPES for a in it.invars)
          and name(it.outvars[0]) in ("float16", "bfloat16", "float32", "float64"))


def contraction_size(it: Item) -> int:
  """Elements each result element of ``dot_general`` ``it`` sums over."""
  (lc, _), _ = it.params["dimension_numbers"]
  shape = tuple(it.invars[0].aval.shape)
  return math.prod(shape[i] for i in lc)


def window_starts(it: Item) -> list[tuple[int, ...]] | None:
  """Start index of each output of a unit-stride ``slice`` or a ``split``
  into its operand, or None when ``it`` is not such a window."""
  if len(it.invars) != 1 or is_lit(it.invars[0]):
    return None
  rank = len(it.invars[0].aval.shape)
  if it.prim == "slice":
    if any(s not in (None, 1) for s in (it.params.get("strides") or ())):
      return None
    return [tuple(int(x) for x in it.params["start_indices"])]
  if it.prim == "split":
    axis = int(it.params["axis"]) % max(rank, 1)
    out, at = [], 0
    for size in it.params["sizes"]:
      out.append(tuple(at if i == axis else 0 for i in range(rank)))
      at += int(size)
    return out
  return None


# jax.lax.DotAlgorithmPreset names -> ir.PRECISIONS for float32 operands.
# A preset asking less than TF32 (bfloat16 rounding, 16-bit accumulation)
# gets TF32 with float32 accumulation: more accurate than asked, never less.
_PRESET_PRECISION = {
    "DEFAULT": "default", "TF32_TF32_F32": "default", "TF32_TF32_F32_X3": "tf32x3",
    "F32_F32_F32": "ieee", "BF16_BF16_F32_X3": "tf32x3", "BF16_BF16_F32_X6": "ieee",
    "BF16_BF16_F32_X9": "ieee", "F16_F16_F16": "default", "F16_F16_F32": "default",
    "BF16_BF16_BF16": "default", "BF16_BF16_F32": "default",
}
_LEVELS = {"DEFAULT": 0, "HIGH": 1, "HIGHEST": 2}
# Algorithms that multiply 16-bit operands: the dtype each operand is
# rounded to first.
_OPERAND_ROUNDING = {"F16_F16_F16": "float16", "F16_F16_F32": "float16",
                     "BF16_BF16_BF16": "bfloat16", "BF16_BF16_F32": "bfloat16"}


def dot_precision(precision: Any, operand_dtypes: Sequence[str]) -> str:
  """``ir.PRECISIONS`` entry for a ``dot_general``'s ``precision`` param
  (None, a pair of ``lax.Precision``, or a ``lax.DotAlgorithmPreset``).

  jax's DEFAULT and HIGH multiply float32 operands in TF32 on NVIDIA GPUs
  (jax's "Matmul precision" docs), HIGHEST in full float32; a mixed pair
  takes the higher. 16-bit operands multiply exactly whatever is asked, so
  they are always "default" (one plan-cache entry). Raises ``Reject`` for
  algorithms a Triton dot does not compute (float64, float8, custom).
  """
  if precision is None:
    level = "default"
  elif isinstance(precision, (tuple, list)):
    names = [getattr(p, "name", str(p)).upper() for p in precision if p is not None]
    if any(n not in _LEVELS for n in names):
      raise Reject(f"dot precision {precision}")
    top = max((_LEVELS[n] for n in names), default=0)
    level = "ieee" if top == 2 else "default"
  else:
    name = getattr(precision, "name", None)
    if name not in _PRESET_PRECISION:
      raise Reject(f"dot algorithm {precision}")
    level = _PRESET_PRECISION[name]
  return level if "float32" in operand_dtypes else "default"


def _dtype_name(dt) -> str:
  return np.dtype(dt).name


# --------------------------------------------------------------------------
# Dims: union-find with row-major splitting.
# --------------------------------------------------------------------------

class Dim:
  __slots__ = ("ext", "parent", "parts", "name")

  def __init__(self, ext: int):
    self.ext = int(ext)
    self.parent: Dim | None = None
    self.parts: list[Dim] | None = None
    self.name: str | None = None

  def __repr__(self):  # pragma: no cover - debugging aid
    return f"Dim({self.ext})"


def find(d: Dim) -> Dim:
  root = d
  while root.parent is not None:
    root = root.parent
  while d.parent is not None and d.parent is not root:
    d.parent, d = root, d.parent
  return root


def leaves(d: Dim) -> list[Dim]:
  r = find(d)
  if r.parts is None:
    return [r]
  out = []
  for p in r.parts:
    out.extend(leaves(p))
  return out


def _split(d: Dim, first: int) -> tuple[Dim, Dim]:
  r = find(d)
  assert r.parts is None and r.ext % first == 0
  r.parts = [Dim(first), Dim(r.ext // first)]
  return r.parts[0], r.parts[1]


def union(a: Dim, b: Dim) -> None:
  ra, rb = find(a), find(b)
  if ra is rb:
    return
  if ra.ext != rb.ext:
    raise Reject(f"dims of extent {ra.ext} and {rb.ext} meet")
  if ra.parts is not None and rb.parts is not None:
    pa, pb = ra.parts, rb.parts
    rb.parent = ra
    unify_seq(pa, pb)
  elif rb.parts is not None:
    ra.parent = rb
  else:
    rb.parent = ra


def unify_seq(xs: Sequence[Dim], ys: Sequence[Dim]) -> None:
  """Unifies two row-major factorizations of the same index range (size-1
  dims ignored), splitting dims where one side is finer."""
  qx = deque(l for d in xs for l in leaves(d) if l.ext != 1)
  qy = deque(l for d in ys for l in leaves(d) if l.ext != 1)
  while qx and qy:
    a, b = find(qx.popleft()), find(qy.popleft())
    if a.parts is not None:
      qx.extendleft(reversed(leaves(a)))
      qy.appendleft(b)
      continue
    if b.parts is not None:
      qy.extendleft(reversed(leaves(b)))
      qx.appendleft(a)
      continue
    if a is b:
      continue
    if a.ext == b.ext:
      union(a, b)
    elif a.ext % b.ext == 0:
      p0, p1 = _split(a, b.ext)
      union(p0, b)
      qx.appendleft(p1)
    elif b.ext % a.ext == 0:
      p0, p1 = _split(b, a.ext)
      union(a, p0)
      qy.appendleft(p1)
    else:
      raise Reject(f"reshape of extents {a.ext} and {b.ext} is not an affine split")
  if any(find(d).ext != 1 for d in qx) or any(find(d).ext != 1 for d in qy):
    raise Reject("reshape sizes do not match")


def unify_axis(xs: list[Dim], ys: list[Dim], size: int) -> None:
  if size == 1:
    if xs and ys:
      union(xs[0], ys[0])
    return
  unify_seq(xs, ys)


def _unit_cuts(shape: Sequence[int]) -> dict[int, list[int]]:
  """The size-1 axes of ``shape`` by where they cut its row-major index:
  the product of the extents before them."""
  cuts: dict[int, list[int]] = {}
  before = 1
  for i, s in enumerate(shape):
    if s == 1:
      cuts.setdefault(before, []).append(i)
    before *= s
  return cuts


def _fresh(size: int) -> list[Dim]:
  return [Dim(size)] if size > 1 else []


# --------------------------------------------------------------------------
# Region builder
# --------------------------------------------------------------------------

class _Builder:
  """Two passes over the candidate's items: unify dims, then emit IR."""

  def __init__(self, items: Sequence[Item], inputs: Sequence[FVar],
               outputs: Sequence[FVar], chain: Sequence[Item], name: str):
    self.items = list(items)
    self.inputs = list(inputs)
    self.outputs = list(outputs)
    self.chain = list(chain)
    self.name = name
    self.axes: dict[Any, list[list[Dim]]] = {}
    # pass 2 state
    self.val: dict[Any, Any] = {}        # FVar -> value name | ir.Literal
    self.values: dict[str, ir.Value] = {}
    self.ops: list = []
    self.counters: dict[str, int] = {}
    self.squeezed: dict[tuple, str] = {}
    self.iotas: dict[str, str] = {}      # loop -> its Iota's value
    # Window inputs: the outputs each input's window op yields to the
    # region, in input order, and each such output's start index.
    self.window_outs: dict[Any, list] = {}
    self.input_names: set[str] = set()
    self.window_start: dict[Any, tuple[int, ...]] = {}

  # ---- pass 1 -----------------------------------------------------------
  def ax(self, a) -> list[list[Dim]]:
    if is_lit(a):
      if np.ndim(a.val) != 0:
        raise Reject("non-scalar literal")
      return []
    return self.axes[a]

  def find_windows(self) -> None:
    """Records the window ops reading region inputs (see WINDOW_PRIMS). A
    windowed input must be read by window ops alone, and appear in
    ``inputs`` once per window the region reads (capture lists it so)."""
    read: dict = {}
    for it in self.items:
      for a in it.invars:
        if not is_lit(a):
          read.setdefault(a, []).append(it)
    ins = set(self.inputs)
    for it in self.items:
      if it.prim not in WINDOW_PRIMS:
        continue
      src = it.invars[0]
      starts = window_starts(it)
      if starts is None or src not in ins:
        raise Reject(f"{it.prim} of a value other than a region input")
      if any(r.prim not in WINDOW_PRIMS for r in read[src]):
        raise Reject(f"a region input is read both whole and through {it.prim}")
      used = [(o, st) for o, st in zip(it.outvars, starts) if o in read]
      self.window_outs.setdefault(src, []).extend(o for o, _ in used)
      for o, st in used:
        self.window_start[o] = st
    for src, outs in self.window_outs.items():
      if not outs or self.inputs.count(src) != len(outs):
        raise Reject("one region input per window read")

  def unify(self) -> None:
    self.find_windows()
    for v in self.inputs:
      if v not in self.window_outs:
        self.axes[v] = [[Dim(s)] for s in v.aval.shape]
    for it in self.items:
      fn = getattr(self, "u_" + it.prim, None)
      if it.prim in POINTWISE_PRIMS:
        fn = self.u_pointwise
      elif it.prim in LAYOUT_PRIMS and fn is None:
        fn = self.u_identity
      elif it.prim in REDUCE_PRIMS:
        fn = self.u_reduce
      if fn is None:
        raise Reject(f"{it.prim} is not expressible in the IR")
      for o in it.outvars:
        if _dtype_name(o.aval.dtype) not in ir.ALL_DTYPES:
          raise Reject(f"{it.prim} produces unsupported dtype {o.aval.dtype}")
      fn(it)

  def u_identity(self, it: Item) -> None:
    for a, o in zip(it.invars, it.outvars):
      self.axes[o] = self.ax(a)

  def u_pointwise(self, it: Item) -> None:
    out = it.outvars[0]
    shape = out.aval.shape
    res = []
    for d, size in enumerate(shape):
      cand = None
      for a in it.invars:
        if is_lit(a) or len(a.aval.shape) == 0:
          continue
        if len(a.aval.shape) != len(shape):
          raise Reject(f"{it.prim}: rank mismatch")
        if a.aval.shape[d] != size:
          if a.aval.shape[d] != 1:
            raise Reject(f"{it.prim}: shape mismatch")
          continue  # implicit size-1 broadcast
        axd = self.axes[a][d]
        if cand is None:
          cand = axd
        elif size == 1 and not cand:
          cand = axd
        else:
          unify_axis(cand, axd, size)
      res.append(cand if cand is not None else _fresh(size))
    self.axes[out] = res

  def u_dot_general(self, it: Item) -> None:
    lhs, rhs = it.invars
    (lc, rc), (lb, rb) = it.params["dimension_numbers"]
    la, ra = self.ax(lhs), self.ax(rhs)
    for i, j in zip(lb, rb):
      unify_axis(la[i], ra[j], lhs.aval.shape[i])
    for i, j in zip(lc, rc):
      unify_axis(la[i], ra[j], lhs.aval.shape[i])
    lf = [i for i in range(len(la)) if i not in lc and i not in lb]
    rf = [j for j in range(len(ra)) if j not in rc and j not in rb]
    # A size-1 batch axis may carry a dim on one side only (a layout op's
    # unit axis carries none): the result keeps the one there is, as the
    # operand's other readers index it (jax.nn.dot_product_attention's
    # size-1 group axis).
    batch = [la[i] or ra[j] for i, j in zip(lb, rb)]
    self.axes[it.outvars[0]] = batch + [la[i] for i in lf] + [ra[j] for j in rf]

  def u_reduce(self, it: Item) -> None:
    axes = tuple(it.params["axes"])
    a = self.ax(it.invars[0])
    self.axes[it.outvars[0]] = [x for i, x in enumerate(a) if i not in axes]

  def u_iota(self, it: Item) -> None:
    shape = it.params["shape"]
    self.axes[it.outvars[0]] = [_fresh(s) for s in shape]

  def u_broadcast_in_dim(self, it: Item) -> None:
    a = it.invars[0]
    shape = it.params["shape"]
    bd = tuple(it.params["broadcast_dimensions"])
    if len(it.invars) != 1:
      raise Reject("dynamic broadcast")
    src = self.ax(a)
    res = []
    for d, size in enumerate(shape):
      if d in bd:
        i = bd.index(d)
        res.append(src[i] if a.aval.shape[i] == size else _fresh(size))
      else:
        res.append(_fresh(size))
    self.axes[it.outvars[0]] = res

  def u_reshape(self, it: Item) -> None:
    if it.params.get("dimensions") is not None or len(it.invars) != 1:
      raise Reject("reshape with dimensions")
    src = self.ax(it.invars[0])
    shape = it.outvars[0].aval.shape
    res = [_fresh(s) for s in shape]
    unify_seq([d for ax in src for d in ax], [d for ax in res for d in ax])
    # Size-1 axes at the same cut of the row-major index, as many on each
    # side, are the same axis: [1, T, H, D] -> [1, T, H, 1, D] keeps the
    # batch axis (jax.nn.dot_product_attention adds a group axis), where
    # a fresh one would part its loop from the batch loop of the arrays
    # it meets.
    cuts_in = _unit_cuts(it.invars[0].aval.shape)
    cuts_out = _unit_cuts(shape)
    for cut, outs in cuts_out.items():
      ins = cuts_in.get(cut, [])
      if len(ins) == len(outs):
        for i, o in zip(ins, outs):
          res[o] = src[i]
    self.axes[it.outvars[0]] = res

  def u_transpose(self, it: Item) -> None:
    src = self.ax(it.invars[0])
    self.axes[it.outvars[0]] = [src[p] for p in it.params["permutation"]]

  def u_squeeze(self, it: Item) -> None:
    dims = tuple(d % max(len(it.invars[0].aval.shape), 1) for d in it.params["dimensions"])
    src = self.ax(it.invars[0])
    self.axes[it.outvars[0]] = [x for i, x in enumerate(src) if i not in dims]

  def u_slice(self, it: Item) -> None:
    for o in it.outvars:
      if o in self.window_start:
        self.axes[o] = [_fresh(s) for s in o.aval.shape]

  u_split = u_slice

  def u_expand_dims(self, it: Item) -> None:  # pragma: no cover - not a jax primitive today
    raise Reject("expand_dims")

  # ---- loop naming -------------------------------------------------------
  def name_loops(self) -> dict[int, str]:
    names: dict[int, str] = {}
    used: set[str] = set()
    pools = {
        "batch": list("bgace"), "row": list("mij"), "red": list("klo"),
        "mid": list("npqrj"), "free": list("hdstuvw"),
    }

    def take(dim: Dim, role: str):
      if id(dim) in names:
        return
      for cand in pools[role]:
        if cand not in used:
          break
      else:
        cand = next(c for c in (list("abcdefghijklmnopqrstuvwxyz")
                                + [f"l{i}" for i in range(1000)]) if c not in used)
      names[id(dim)] = cand
      used.add(cand)
      dim.name = cand

    def lv(axes_list):
      return [l for ax in axes_list for d in ax for l in leaves(d)]

    for ci, it in enumerate(self.chain):
      lhs, rhs = it.invars
      (lc, rc), (lb, rb) = it.params["dimension_numbers"]
      la, ra = self.ax(lhs), self.ax(rhs)
      batch = lv([la[i] for i in lb])
      red = lv([la[i] for i in lc])
      lf = lv([la[i] for i in range(len(la)) if i not in lc and i not in lb])
      rf = lv([ra[j] for j in range(len(ra)) if j not in rc and j not in rb])
      nxt = self.chain[ci + 1] if ci + 1 < len(self.chain) else None
      nred: set[int] = set()
      if nxt is not None:
        (nlc, nrc), _ = nxt.params["dimension_numbers"]
        for side, cdims in ((0, nlc), (1, nrc)):
          a = nxt.invars[side]
          if not is_lit(a) and a in self.axes:
            nred.update(id(l) for l in lv([self.axes[a][i] for i in cdims]))
      for d in batch:
        take(d, "batch")
      if ci == 0:
        # A lone contraction's right-hand free dims are its columns (n), not
        # batch loops: x @ w reads m, n, k like a GEMM.
        rows = [d for d in (lf + rf if nxt is not None else lf) if id(d) not in nred]
        for d in rows[:-1]:
          take(d, "batch")
        for d in rows[-1:]:
          take(d, "row")
        for d in red:
          take(d, "red")
        for d in lf + rf:
          take(d, "mid")
      else:
        for d in red:
          take(d, "red")
        for d in lf + rf:
          take(d, "mid" if id(d) in nred else "free")
    for v, axl in self.axes.items():
      for d in lv(axl):
        take(d, "free")
    return names

  # ---- pass 2 -----------------------------------------------------------
  def loops_of(self, a) -> list[str]:
    if is_lit(a):
      return []
    ls = [l.name for ax in self.axes[a] for d in ax for l in leaves(d)]
    if len(set(ls)) != len(ls):
      raise Reject("a value is indexed twice by the same loop (e.g. x + x.T)")
    return ls

  def fresh(self, prefix: str, loops: Sequence[str], dtype: str) -> str:
    n = self.counters.get(prefix, 0)
    self.counters[prefix] = n + 1
    name = f"{prefix}{n}"
    if dtype not in ir.ALL_DTYPES:
      raise Reject(f"dtype {dtype} not supported by the IR")
    self.values[name] = ir.Value(name, tuple(loops), dtype)
    return name

  def fit(self, opnd, allowed: Sequence[str]):
    """Squeezes size-1 loops of a value that the consumer does not index."""
    if isinstance(opnd, ir.Literal):
      return opnd
    v = self.values[opnd]
    extra = [l for l in v.loops if l not in allowed]
    if not extra:
      return opnd
    for l in extra:
      if self.ext[l] != 1:
        raise Reject("operand has a loop its consumer does not index")
    key = (opnd, tuple(extra))
    if key in self.squeezed:
      return self.squeezed[key]
    cur = opnd
    for l in extra:
      cv = self.values[cur]
      new = self.fresh("t", [x for x in cv.loops if x != l], cv.dtype)
      self.ops.append(ir.Reduction(new, "max", cur, l))
      cur = new
    self.squeezed[key] = cur
    return cur

  def opnd(self, a):
    if is_lit(a):
      val = np.asarray(a.val)
      dt = _dtype_name(val.dtype if not hasattr(a, "aval") else a.aval.dtype)
      if dt not in ir.ALL_DTYPES:
        raise Reject(f"literal of dtype {dt}")
      return ir.Literal(val.item(), dt)
    return self.val[a]

  def dtype_of(self, opnd) -> str:
    return opnd.dtype if isinstance(opnd, ir.Literal) else self.values[opnd].dtype

  def ew(self, fn: str, args: Sequence, out_dtype: str, out_loops: Sequence[str]):
    """Emits one elementwise op; constant-folds literal-only ops."""
    args = [self.fit(a, out_loops) for a in args]
    if all(isinstance(a, ir.Literal) for a in args):
      f = ir.ELEMENTWISE_FNS[fn][1]
      # Folding follows the dtype's arithmetic: -1e9 in float16 is -inf, as in XLA.
      with np.errstate(all="ignore"):
        r = np.asarray(f(*[np.asarray(a.value, dtype=ir.np_dtype(a.dtype)) for a in args]))
        r = r.astype(ir.np_dtype(out_dtype))
      return ir.Literal(r.item(), out_dtype)
    present = set()
    for a in args:
      if isinstance(a, str):
        present.update(self.values[a].loops)
    loops = [l for l in out_loops if l in present]
    name = self.fresh("t", loops, out_dtype)
    self.ops.append(ir.Elementwise(name, fn, tuple(args)))
    return name

  def emit(self) -> ir.Region:
    names = self.name_loops()
    del names
    # Loop extents from the named leaves.
    self.ext: dict[str, int] = {}
    for axl in self.axes.values():
      for ax in axl:
        for d in ax:
          for l in leaves(d):
            self.ext[l.name] = l.ext
    # Size-1 loops that only an input's own shape carries (e.g. the axis that
    # x[0] slices away) are dropped from that input: index 0 is implied.
    carriers: dict[str, int] = {}
    for var, axl in self.axes.items():
      for name in {l.name for ax in axl for d in ax for l in leaves(d) if l.ext == 1}:
        carriers[name] = carriers.get(name, 0) + 1
    shared_unit = {n for n, c in carriers.items() if c > 1}
    in_bufs = []
    seen_windows: dict = {}
    for i, v in enumerate(self.inputs):
      dt = _dtype_name(v.aval.dtype)
      view, offset, window = v, 0, v in self.window_outs
      if window:
        k = seen_windows[v] = seen_windows.get(v, -1) + 1
        view = self.window_outs[v][k]
        base = ir.contiguous_strides(v.aval.shape)
        offset = sum(s * b for s, b in zip(self.window_start[view], base))
      loops = [l for l in self.loops_of(view) if self.ext[l] != 1 or l in shared_unit]
      name = self.fresh("x", loops, dt)
      self.input_names.add(name)
      self.val[view] = name
      in_bufs.append(ir.Buffer(name, tuple(v.aval.shape),
                               self._strides(view, loops, v.aval.shape), offset, window))
    for it in self.items:
      fn = getattr(self, "e_" + it.prim, None)
      if fn is None:
        if it.prim in _UNARY or it.prim in _BINARY:
          fn = self.e_simple
        elif it.prim in LAYOUT_PRIMS:
          fn = self.e_view
        elif it.prim in REDUCE_PRIMS:
          fn = self.e_reduce
      fn(it)
    out_bufs = []
    for o in self.outputs:
      vname = self.val.get(o)
      if not isinstance(vname, str) or not vname.startswith(("t", "c")):
        raise Reject("an output is not computed in the region")
      v = self.values[vname]
      view = self.loops_of(o)
      for l in view:
        if l not in v.loops and self.ext[l] != 1:
          raise Reject("an output is a broadcast view")
      st = dict(self._strides(o, [l for l in view if l in v.loops]))
      buf = ir.Buffer(vname, tuple(o.aval.shape), tuple((l, st.get(l, 0)) for l in v.loops))
      if any(b.value == vname for b in out_bufs):
        # Two views of one value (``d[..., None]`` written twice): a kernel
        # stores each value once; a less inclusive epilogue writes it once.
        raise Reject(f"two outputs are views of one value ({vname})")
      out_bufs.append(buf)
    used_loops = set()
    for v in self.values.values():
      used_loops.update(v.loops)
    for op in self.ops:
      if isinstance(op, (ir.Contraction,)):
        used_loops.update(op.reduce)
    order = self._loop_order()
    loops = tuple(ir.Loop(l, self.ext[l]) for l in order if l in used_loops)
    vals = tuple(self.values.values())
    try:
      return ir.Region(loops, vals, tuple(in_bufs), tuple(out_bufs),
                       tuple(self.ops), name=self.name)
    except ir.IRError as e:
      raise Reject(f"IR check: {e}") from e

  def _loop_order(self) -> list[str]:
    pref = "bgacemijnklohpqrstuvw"
    names = list(self.ext)
    return sorted(names, key=lambda n: (pref.index(n) if len(n) == 1 and n in pref
                                        else len(pref), n))

  def _strides(self, v, loops: Sequence[str], shape=None) -> tuple:
    """Element strides of ``loops`` in ``v``'s row-major layout, or in that
    of ``shape`` (the whole input a window ``v`` lies in)."""
    base = ir.contiguous_strides(v.aval.shape if shape is None else shape)
    out = {}
    for ax, s in zip(self.axes[v], base):
      ls = [l for d in ax for l in leaves(d)]
      acc = s
      for l in reversed(ls):
        out[l.name] = acc
        acc *= l.ext
    return tuple((l, out[l]) for l in loops)

  # -- pass-2 handlers ----------------------------------------------------
  def e_view(self, it: Item) -> None:
    for a, o in zip(it.invars, it.outvars):
      self.val[o] = self.opnd(a)

  def e_slice(self, it: Item) -> None:
    """Nothing to emit: ``emit`` bound each window the region reads to its
    own input buffer (find_windows rejects any other slice or split)."""
  e_split = e_slice

  def _out(self, it: Item):
    o = it.outvars[0]
    return o, self.loops_of(o), _dtype_name(o.aval.dtype)

  def e_simple(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    fn = _UNARY.get(it.prim) or _BINARY[it.prim]
    args = [self.opnd(a) for a in it.invars]
    if fn in ("and", "or", "not") and any(self.dtype_of(a) != "bool" for a in args):
      raise Reject("bitwise op on integers")
    if fn == "div" and dt not in ir.FLOAT_DTYPES:
      raise Reject("integer division")
    self.val[o] = self.ew(fn, args, dt, loops)

  def e_erfc(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    t = self.ew("erf", [self.opnd(it.invars[0])], dt, loops)
    self.val[o] = self.ew("sub", [ir.Literal(1.0, dt), t], dt, loops)

  def e_is_finite(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    x = self.opnd(it.invars[0])
    xd = self.dtype_of(x)
    t = self.ew("sub", [x, x], xd, loops)
    self.val[o] = self.ew("eq", [t, ir.Literal(0.0, xd)], "bool", loops)

  def e_integer_pow(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    y = int(it.params["y"])
    x = self.opnd(it.invars[0])
    if y == 0:
      self.val[o] = ir.Literal(1.0 if dt in ir.FLOAT_DTYPES else 1, dt)
      return
    # Square-and-multiply, as XLA expands integer_pow.
    acc, base, n = None, x, abs(y)
    while n:
      if n & 1:
        acc = base if acc is None else self.ew("mul", [acc, base], dt, loops)
      n >>= 1
      if n:
        base = self.ew("mul", [base, base], dt, loops)
    if y < 0:
      acc = self.ew("div", [ir.Literal(1.0, dt), acc], dt, loops)
    if isinstance(acc, str) and acc == x:
      acc = self.ew("convert", [x], dt, loops)
    self.val[o] = acc

  def e_clamp(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    lo, x, hi = (self.opnd(a) for a in it.invars)
    t = self.ew("max", [x, lo], dt, loops)
    self.val[o] = self.ew("min", [t, hi], dt, loops)

  def e_select_n(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    if len(it.invars) != 3:
      raise Reject("select_n with more than two cases")
    p, a, b = (self.opnd(x) for x in it.invars)
    if self.dtype_of(p) != "bool":
      p = self.ew("ne", [p, ir.Literal(0, self.dtype_of(p))], "bool", loops)
    self.val[o] = self.ew("select", [p, a, b], dt, loops)

  def e_convert_element_type(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    x = self.opnd(it.invars[0])
    if self.dtype_of(x) == dt:
      self.val[o] = x
      return
    self.val[o] = self.ew("convert", [x], dt, loops)

  def e_iota(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    d = it.params["dimension"]
    ls = [l for dd in self.axes[o][d] for l in leaves(dd)]
    idx = None
    for l in ls:
      # One index value per loop: capture gives each reader of an iota its
      # own (capture_flat), which here may land on the same loop again.
      t = self.iotas.get(l.name)
      if t is None:
        t = self.iotas[l.name] = self.fresh("i", [l.name], "int32")
        self.ops.append(ir.Iota(t, l.name))
      if idx is None:
        idx = t
      else:
        idx = self.ew("mul", [idx, ir.Literal(int(l.ext), "int32")], "int32", loops)
        idx = self.ew("add", [idx, t], "int32", loops)
    if idx is None:
      idx = ir.Literal(0, "int32")
    if dt != "int32":
      idx = self.ew("convert", [idx], dt, loops)
    self.val[o] = idx

  def e_dot_general(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    lhs, rhs = it.invars
    if is_lit(lhs) or is_lit(rhs):
      raise Reject("contraction of a literal")
    for a in (lhs, rhs):
      if _dtype_name(a.aval.dtype) not in CONTRACTION_DTYPES:
        raise Reject(f"contraction of {a.aval.dtype}")
    if dt not in ir.FLOAT_DTYPES:
      raise Reject(f"contraction producing {dt}")
    (lc, rc), _ = it.params["dimension_numbers"]
    l = self.fit(self.val[lhs], self.loops_of(lhs))
    r = self.fit(self.val[rhs], self.loops_of(rhs))
    if isinstance(l, ir.Literal) or isinstance(r, ir.Literal):
      raise Reject("contraction of a literal")
    operand_dtypes = [_dtype_name(a.aval.dtype) for a in (lhs, rhs)]
    rounded = _OPERAND_ROUNDING.get(getattr(it.params.get("precision"), "name", None))
    if rounded is not None:
      # The algorithm multiplies 16-bit operands: a wider one is rounded
      # first, as XLA does. (Autodiff's transpose of a float16 product with a
      # float32 result, jax.nn.dot_product_attention's scores, multiplies the
      # float32 ds by float16 q and k: as TF32 on float32 tiles, its dq and
      # dk kernels ran slower than XLA's.)
      l, r = (self.ew("convert", [x], rounded, self.values[x].loops)
              if self.values[x].dtype != rounded else x for x in (l, r))
      operand_dtypes = [rounded, rounded]
    # Both sides' contracted leaves: a size-1 axis may carry a dim on one
    # side only (u_dot_general).
    red = list(dict.fromkeys(
        [x.name for i in lc for d in self.axes[lhs][i] for x in leaves(d)]
        + [x.name for j in rc for d in self.axes[rhs][j] for x in leaves(d)]))
    if l in self.input_names and r not in self.input_names:
      # The operands commute. The code generator feeds tl.dot's left operand
      # from registers and its right one from shared memory (wgmma's B), so a
      # value computed here (softmax weights) goes left of a loaded input:
      # jnp.einsum("bhqk,bkhd->bqhd", p, v) is traced as dot(v, p), which
      # stored p to shared memory every step (token-major attention ran
      # 20-26% slower, H100, twenty-fourth session).
      l, r = r, l
    union_loops = set(self.values[l].loops) | set(self.values[r].loops)
    red = [x for x in red if x in union_loops]
    if not red:
      raise Reject("contraction reduces nothing")
    keep = union_loops - set(red)
    if not keep <= set(loops):
      raise Reject("contraction output loops do not match its view")
    precision = dot_precision(it.params.get("precision"), operand_dtypes)
    name = self.fresh("c", [x for x in loops if x in keep], dt)
    self.ops.append(ir.Contraction(name, l, r, tuple(red), precision))
    self.val[o] = name

  def e_reduce(self, it: Item) -> None:
    o, loops, dt = self._out(it)
    a = it.invars[0]
    x = self.opnd(a)
    axes = tuple(it.params["axes"])
    kind = {"reduce_max": "max", "reduce_sum": "sum", "reduce_min": "min"}[it.prim]
    if isinstance(x, ir.Literal):
      raise Reject("reduction of a literal")
    if kind == "min":
      x = self.ew("neg", [x], self.values[x].dtype, self.values[x].loops)
    for i in axes:
      for l in [ll.name for d in self.axes[a][i] for ll in leaves(d)]:
        cur = self.values[x]
        if l in cur.loops:
          new = self.fresh("t", [y for y in cur.loops if y != l], cur.dtype)
          self.ops.append(ir.Reduction(new, "sum" if kind == "sum" else "max", x, l))
          x = new
        elif kind == "sum" and self.ext[l] != 1:
          x = self.ew("mul", [x, ir.Literal(float(self.ext[l]), cur.dtype)],
                      cur.dtype, cur.loops)
    if kind == "min":
      x = self.ew("neg", [x], self.values[x].dtype, self.values[x].loops)
    if isinstance(x, str) and self.values[x].dtype != dt:
      x = self.ew("convert", [x], dt, self.values[x].loops)
    self.val[o] = x


def build_region(items: Sequence[Item], inputs: Sequence[FVar], outputs: Sequence[FVar],
                 chain: Sequence[Item], name: str = "region") -> ir.Region:
  """Builds the IR region for ``items`` (topologically ordered), reading
  ``inputs`` (region input buffers, in order) and storing ``outputs``.

  Raises Reject when the items cannot be expressed (unsupported op or dtype,
  non-affine reshape, broadcast output, ...).
  """
  b = _Builder(items, inputs, outputs, chain, name)
  b.unify()
  region = ir.drop_unit_loops(b.emit())
  if len(region.contractions) < len(chain):
    raise Reject(f"fewer than {len(chain)} contractions")
  _check_reduced_loops_stay_reduced(region)
  _check_connected(region)
  return region


def _check_connected(region: ir.Region) -> None:
  """The region's ops must share loops: contractions in parts with no loop
  in common are separate computations that one kernel cannot share
  anything between, and the planner's space is the product of theirs.
  Sibling dots joined because they read one array in two roles (the
  backward pass of self-attention over one input, ``attn(x, x, x)``) came
  out so: 11 loops, whose search space took 6 minutes to build (sixty-ninth
  session). Capture then tries the dots without the join."""
  parent: dict[str, str] = {}

  def find(l: str) -> str:
    while parent.get(l, l) != l:
      l = parent[l]
    return l
  vm = region.value_map
  for op in region.ops:
    loops = [l for v in (*op.inputs, op.out) if v in vm for l in vm[v].loops]
    for a, b in zip(loops, loops[1:]):
      ra, rb = find(a), find(b)
      if ra != rb:
        parent[rb] = ra
  parts = {find(l) for op in region.contractions
           for v in (op.lhs, op.rhs, op.out) for l in vm[v].loops}
  if len(parts) > 1:
    raise Reject(f"its contractions fall into {len(parts)} parts that share no loop")


def _check_reduced_loops_stay_reduced(region: ir.Region) -> None:
  """A loop a contraction reduces must not index anything computed from its
  result (as in (x @ w) @ w.T read through one buffer): the planner treats
  a loop as either reduced or kept downstream of the op that reduces it."""
  downstream: dict[str, set] = {}
  batch: dict[str, set] = {}
  for op in region.ops:
    gone, kept = set(), set()
    for a in op.inputs:
      gone |= downstream.get(a, set())
      kept |= batch.get(a, set())
    if gone & set(region.value(op.out).loops):
      raise Reject("a reduced loop is reused downstream")
    if isinstance(op, ir.Contraction):
      # A batch loop (e.g. attention heads) reduced later, as in
      # merge-heads @ wo, would couple the programs of the batch loop.
      if kept & set(op.reduce):
        raise Reject("a contraction reduces an upstream batch loop")
      gone = gone | set(op.reduce)
      lhs, rhs = region.value(op.lhs).loops, region.value(op.rhs).loops
      kept = kept | (set(lhs) & set(rhs) & set(region.value(op.out).loops))
    downstream[op.out] = gone
    batch[op.out] = kept
