"""Chain IR: the one representation of a fused region.

Capture produces it, the planner and the code generator read it, the NumPy
evaluator in this module defines what it means, and the inspector prints it.

Model
-----
* **Loops** are named iteration dimensions with extents (``m=512``).
* **Values** are tensors indexed by a set of loops (``s[b,m,n]``). A value has
  no memory layout: it lives on chip inside a fused kernel.
* **Buffers** tie a value to device memory: a region input or output is an
  array of a given shape, addressed by ``offset = sum(stride[l] * i_l)`` over
  the loops that index it. A transposed, batched, split or broadcast operand
  is therefore a different stride map, never a copy.
* **Ops** (topologically ordered): ``Contraction`` (einsum of two values over
  reduced loops, fp32 accumulation), ``Elementwise`` (one scalar function of
  values and literals, with broadcasting by loop name), ``Reduction`` (max or
  sum along one loop) and ``Iota`` (the index of a loop, for masks).

Example (a GEMM chain)::

    region(b=1, m=512, n=256, k=64, h=64)
      in  a: float16[1,512,64]  a[b,m,k]
      in  b: float16[1,64,256]  b[b,k,n]
      in  d: float16[1,256,64]  d[b,n,h]
      c[b,m,n] float16 = sum_k a * b
      e[b,m,h] float16 = sum_n c * d
      out e: float16[1,512,64]  e[b,m,h]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import numpy as np

__all__ = [
    "Loop", "Value", "Buffer", "Literal", "Contraction", "PRECISIONS", "Elementwise",
    "Reduction", "Iota", "Op", "Region", "ELEMENTWISE_FNS", "IRError",
    "evaluate", "simplify", "xla_epilogue_split", "xla_joins", "xla_merged_dots",
    "xla_gemm_copies", "written_intermediates", "coalesce_loops", "drop_unit_loops",
    "vector_dot_dims", "xla_vector_dot", "contraction_loops",
    "contiguous_strides", "dtype_itemsize", "with_shared_arrays",
    "WINDOW_ALIGN",
]


class IRError(ValueError):
    """A region that violates the IR's invariants."""


# --------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ALL_DTYPES = FLOAT_DTYPES + ("bool", "int32", "int64")


def np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    import ml_dtypes  # shipped with jax
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def dtype_itemsize(name: str) -> int:
  return np_dtype(name).itemsize


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
  """Row-major element strides of ``shape``."""
  strides, acc = [], 1
  for d in reversed(shape):
    strides.append(acc)
    acc *= max(int(d), 1)
  return tuple(reversed(strides))


# --------------------------------------------------------------------------
# Elementwise function table: arity and NumPy meaning. The code generator
# keeps its own Triton spelling for each name (one table per backend).
# --------------------------------------------------------------------------

def _erf(x):
  try:
    from scipy.special import erf  # pylint: disable=import-outside-toplevel
    return erf(x)
  except ImportError:  # pragma: no cover - scipy ships with jax
    return np.vectorize(math.erf, otypes=[x.dtype])(x)


def _select(pred, on_false, on_true):
  return np.where(pred, on_true, on_false)


ELEMENTWISE_FNS: dict[str, tuple[int, Callable[..., np.ndarray]]] = {
    "add": (2, np.add),
    "sub": (2, np.subtract),
    "mul": (2, np.multiply),
    "div": (2, np.divide),
    "max": (2, np.maximum),
    "min": (2, np.minimum),
    "pow": (2, np.power),
    "neg": (1, np.negative),
    "abs": (1, np.abs),
    "exp": (1, np.exp),
    "exp2": (1, np.exp2),
    "log": (1, np.log),
    "log1p": (1, np.log1p),
    "expm1": (1, np.expm1),
    "tanh": (1, np.tanh),
    "logistic": (1, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "erf": (1, _erf),
    "sqrt": (1, np.sqrt),
    "rsqrt": (1, lambda x: 1.0 / np.sqrt(x)),
    "square": (1, np.square),
    "sign": (1, np.sign),
    "eq": (2, np.equal),
    "ne": (2, np.not_equal),
    "lt": (2, np.less),
    "le": (2, np.less_equal),
    "gt": (2, np.greater),
    "ge": (2, np.greater_equal),
    "and": (2, np.logical_and),
    "or": (2, np.logical_or),
    "not": (1, np.logical_not),
    # select(pred, on_false, on_true), as lax.select_n with a boolean predicate.
    "select": (3, _select),
    # convert: to the output value's dtype; the evaluator applies the cast.
    "convert": (1, lambda x: x),
}


# --------------------------------------------------------------------------
# Nodes
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Loop:
  name: str
  extent: int

  def __post_init__(self):
    if not self.name or not self.name.isidentifier():
      raise IRError(f"bad loop name {self.name!r}")
    if int(self.extent) < 1:
      raise IRError(f"loop {self.name} has extent {self.extent}")


@dataclasses.dataclass(frozen=True)
class Value:
  """A tensor indexed by loops; ``loops`` is its axis order for evaluation."""
  name: str
  loops: tuple[str, ...]
  dtype: str

  def __post_init__(self):
    if len(set(self.loops)) != len(self.loops):
      raise IRError(f"value {self.name} repeats a loop: {self.loops}")
    if self.dtype not in ALL_DTYPES:
      raise IRError(f"value {self.name}: unsupported dtype {self.dtype}")


# A window's offset is passed to its kernel in multiples of this many
# elements (16 elements: at least 32 bytes for 16-bit types, more than the
# 16-byte alignment Triton assumes of a pointer argument).
WINDOW_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A region input or output in device memory.

  ``shape`` is the array's shape; ``strides`` maps each loop that indexes the
  array to its element stride (row-major strides of ``shape``, possibly
  several loops per axis when a reshape split or merged dims). Loops of the
  value that are absent here broadcast (stride 0).

  ``part_loop``: the buffer is ``shape[0]`` separate arrays of shape
  ``shape[1:]``, one per index of that loop (sibling projections
  ``x @ wq``, ``x @ wk``, ``x @ wv`` read three weights and write three
  results: one region whose loop p picks the part). Its stride over
  ``part_loop`` is virtual, ``prod(shape[1:])``, as if the parts were
  stacked, so the planner's data-movement model sees an ordinary buffer;
  the kernel takes one pointer per part and picks it by p's index.

  ``window``: the buffer is a static window of a larger array (capture's
  slices and splits of a region input, read in place at ``offset``). A
  window's offset reaches the kernel at launch, so windows of the same shape
  at different offsets (the layers of stacked weights, the parts of a packed
  QKV) share one plan and one compiled kernel. Only ``static_offset``, the
  offset modulo ``WINDOW_ALIGN``, is printed into the kernel and keys the
  signature: it fixes the pointer's alignment, which vectorized loads need
  to know when the kernel compiles.

  ``array``: inputs with the same nonzero ``array`` receive one array at
  run time (capture reads one jax array through a buffer per use, so that
  ``q`` in ``q.k^T`` and in ``ds^T.q`` need not share loops). The code
  generator then loads a tile once where both buffers address it alike
  (``tiling.shared_loads``), and the model counts it once. Set by
  ``with_shared_arrays``; ``Region.same_array`` says which inputs it joins.
  """
  value: str
  shape: tuple[int, ...]
  strides: tuple[tuple[str, int], ...]
  offset: int = 0
  window: bool = False
  part_loop: str = ""
  array: int = 0

  @property
  def parts(self) -> int:
    """How many arrays the buffer is: ``shape[0]`` for a part buffer (see
    ``Region.part_loop``), else 1."""
    return int(self.shape[0]) if self.part_loop else 1

  @property
  def operand_shape(self) -> tuple[int, ...]:
    """The shape of each array the kernel takes for this buffer."""
    return tuple(self.shape[1:]) if self.part_loop else tuple(self.shape)

  @property
  def launch_offset(self) -> int:
    """The part of ``offset`` the kernel takes as an argument (a multiple of
    ``WINDOW_ALIGN``; 0 unless ``window``)."""
    return self.offset - self.offset % WINDOW_ALIGN if self.window else 0

  @property
  def static_offset(self) -> int:
    """The part of ``offset`` printed into the kernel."""
    return self.offset - self.launch_offset

  @property
  def loops(self) -> tuple[str, ...]:
    return tuple(l for l, _ in self.strides)

  def stride(self, loop: str) -> int:
    for l, s in self.strides:
      if l == loop:
        return s
    return 0

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclasses.dataclass(frozen=True)
class Literal:
  """A scalar constant operand of an elementwise op."""
  value: Union[float, int, bool]
  dtype: str

  def __str__(self):
    v = self.value
    if isinstance(v, float) and math.isinf(v):
      return "-inf" if v < 0 else "inf"
    return repr(v)


Operand = Union[str, Literal]


# How a contraction multiplies float32 operands (16-bit operands multiply
# exactly either way): "default" as jax.lax's DEFAULT and HIGH precision do
# on NVIDIA GPUs, TensorFloat-32 tensor cores; "tf32x3", three TF32 passes
# (close to float32); "ieee", full float32 products (HIGHEST).
PRECISIONS = ("default", "tf32x3", "ieee")


@dataclasses.dataclass(frozen=True)
class Contraction:
  """``out[out loops] = sum_{reduce} lhs * rhs`` (fp32 accumulation);
  ``precision`` is one of ``PRECISIONS``."""
  out: str
  lhs: str
  rhs: str
  reduce: tuple[str, ...]
  precision: str = "default"

  @property
  def inputs(self) -> tuple[str, ...]:
    return (self.lhs, self.rhs)


@dataclasses.dataclass(frozen=True)
class Elementwise:
  out: str
  fn: str
  args: tuple[Operand, ...]

  @functools.cached_property
  def inputs(self) -> tuple[str, ...]:
    return tuple(a for a in self.args if isinstance(a, str))


@dataclasses.dataclass(frozen=True)
class Reduction:
  """``out = kind over loop of arg``; kind is 'max' or 'sum'."""
  out: str
  kind: str
  arg: str
  loop: str

  @property
  def inputs(self) -> tuple[str, ...]:
    return (self.arg,)


@dataclasses.dataclass(frozen=True)
class Iota:
  """``out[loop] = index of loop`` (int32); used by masks."""
  out: str
  loop: str

  @property
  def inputs(self) -> tuple[str, ...]:
    return ()


Op = Union[Contraction, Elementwise, Reduction, Iota]


# --------------------------------------------------------------------------
# Region
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Region:
  """A fusible chain: loops, values, input/output buffers and ops.

  Regions compare and hash by their canonical signature, so two regions that
  differ only in names are the same key for plan caching.
  """
  loops: tuple[Loop, ...]
  values: tuple[Value, ...]
  inputs: tuple[Buffer, ...]
  outputs: tuple[Buffer, ...]
  ops: tuple[Op, ...]
  name: str = "region"

  def __post_init__(self):
    self.validate()

  def __getstate__(self):
    # The fields alone: the cached lookups and memos (``_op_memo``,
    # ``plan_memo``) are derived, some keyed by string hashes that differ
    # between processes, and the measuring child gets regions pickled.
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  # -- lookup -------------------------------------------------------------
  # The planner looks these up hundreds of thousands of times per search;
  # each Region builds them once (a frozen instance never changes) and
  # hands out copies, so a caller that edits one cannot corrupt another.
  @functools.cached_property
  def _extents(self) -> dict[str, int]:
    return {l.name: int(l.extent) for l in self.loops}

  @functools.cached_property
  def _values(self) -> dict[str, Value]:
    return {v.name: v for v in self.values}

  @functools.cached_property
  def _op_memo(self) -> dict:
    # (function, op or None) -> what ``op_loops``, ``contraction_loops``,
    # ``min_bytes`` or the planner's memos (keyed the same way) derived.
    return {}

  @functools.cached_property
  def plan_memo(self) -> dict:
    """What the planner derives while it searches this region (per placed
    expression and tiles), keyed by (what, ...). A search drops it when it
    ends (``drop_plan_memo``): it holds megabytes on a large region, and a
    region outlives its planning."""
    return {}

  def drop_plan_memo(self) -> None:
    """Forgets ``plan_memo``."""
    self.__dict__.pop("plan_memo", None)

  @property
  def loop_extents(self) -> dict[str, int]:
    return self._extents.copy()

  def extent(self, loop: str) -> int:
    return self._extents[loop]

  @property
  def value_map(self) -> dict[str, Value]:
    return self._values.copy()

  def value(self, name: str) -> Value:
    return self._values[name]

  @functools.cached_property
  def _producers(self) -> dict:
    out: dict = {}
    for op in self.ops:
      out.setdefault(op.out, op)   # the first, as a scan of ops finds it
    return out

  def producer(self, name: str):
    return self._producers.get(name)

  def consumers(self, name: str) -> list:
    got = self._consumers.get(name)
    return list(got) if got is not None else []

  @functools.cached_property
  def _consumers(self) -> dict[str, tuple]:
    # The model asks per plan it prices (``tf32_transposed_elements``).
    out: dict[str, list] = {}
    for op in self.ops:
      for a in dict.fromkeys(op.inputs):
        out.setdefault(a, []).append(op)
    return {k: tuple(v) for k, v in out.items()}

  def computed_from(self, names, target: str, *, through_contractions: bool = True) -> bool:
    """Whether any of ``names`` (a value name or several) is ``target`` or
    is computed from it by the region's ops; ``through_contractions``:
    False stops at a contraction's result (it is not followed back)."""
    todo = [names] if isinstance(names, str) else list(names)
    seen = set()
    while todo:
      v = todo.pop()
      if v == target:
        return True
      if v in seen:
        continue
      seen.add(v)
      op = self.producer(v)
      if op is None or (not through_contractions and isinstance(op, Contraction)):
        continue
      todo.extend(op.inputs)
    return False

  @property
  def contractions(self) -> list[Contraction]:
    return list(self._contractions)

  @functools.cached_property
  def _contractions(self) -> tuple[Contraction, ...]:
    return tuple(op for op in self.ops if isinstance(op, Contraction))

  def same_array(self) -> dict[str, str]:
    """Input value -> the first input that receives the same array, for
    each input after the first of its ``Buffer.array`` group. Only plain
    buffers of equal shape, dtype and offset join (not windows or parts)."""
    return dict(self._same_array)

  @functools.cached_property
  def _same_array(self) -> dict[str, str]:
    # The model asks per plan it prices (``tiling.shared_loads``).
    vm = self.value_map
    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for b in self.inputs:
      if not b.array or b.window or b.part_loop:
        continue
      key = (b.array, b.shape, vm[b.value].dtype, b.offset)
      if first.setdefault(key, b.value) != b.value:
        out[b.value] = first[key]
    return out

  @property
  def part_loop(self) -> str:
    """The loop whose index picks the array of each part buffer
    (``Buffer.part_loop``), or ""."""
    for b in self.inputs + self.outputs:
      if b.part_loop:
        return b.part_loop
    return ""

  # Tuples, built once (see "lookup" above): Rule 1 asks for them per op of
  # every skeleton it places, 25,000 times on a merged dk+dv region.
  @functools.cached_property
  def input_names(self) -> tuple[str, ...]:
    return tuple(b.value for b in self.inputs)

  @functools.cached_property
  def output_names(self) -> tuple[str, ...]:
    return tuple(b.value for b in self.outputs)

  # -- invariants ---------------------------------------------------------
  def validate(self) -> None:
    extents = {}
    for l in self.loops:
      if l.name in extents:
        raise IRError(f"loop {l.name} declared twice")
      extents[l.name] = l.extent
    vals = {}
    for v in self.values:
      if v.name in vals:
        raise IRError(f"value {v.name} declared twice")
      for l in v.loops:
        if l not in extents:
          raise IRError(f"value {v.name} uses unknown loop {l}")
      vals[v.name] = v
    defined = set()
    for b in self.inputs:
      if b.value not in vals:
        raise IRError(f"input buffer of unknown value {b.value}")
      self._check_buffer(b, vals[b.value], extents, is_output=False)
      defined.add(b.value)
    for op in self.ops:
      if op.out not in vals:
        raise IRError(f"op writes unknown value {op.out}")
      if op.out in defined:
        raise IRError(f"value {op.out} defined twice")
      for i in op.inputs:
        if i not in defined:
          raise IRError(f"op {op.out} reads {i} before it is defined")
      self._check_op(op, vals)
      defined.add(op.out)
    for b in self.outputs:
      if b.value not in defined:
        raise IRError(f"output {b.value} is never defined")
      self._check_buffer(b, vals[b.value], extents, is_output=True)
    parts = {b.part_loop for b in self.inputs + self.outputs if b.part_loop}
    if len(parts) > 1:
      raise IRError(f"at most one part loop per region, got {sorted(parts)}")
    if parts and parts & self.reduced_loops():
      raise IRError(f"part loop {next(iter(parts))} is reduced: a program must "
                    "read one part")

  @staticmethod
  def _check_buffer(b: Buffer, v: Value, extents, is_output: bool) -> None:
    for l, s in b.strides:
      if l not in v.loops:
        raise IRError(f"buffer of {v.name} strides over {l}, not a loop of it")
      if s < 0:
        raise IRError(f"buffer of {v.name}: negative stride")
    if is_output and set(b.loops) != set(v.loops):
      raise IRError(f"output {v.name} must store every loop of the value")
    if is_output and b.window:
      raise IRError(f"output {v.name}: only inputs can be windows")
    if b.array < 0 or (is_output and b.array):
      raise IRError(f"buffer of {v.name}: array label {b.array} (inputs only, >= 0)")
    if b.part_loop:
      if b.window or b.offset:
        raise IRError(f"part buffer of {v.name} cannot be a window or have an offset")
      if not b.shape or b.shape[0] != extents.get(b.part_loop):
        raise IRError(f"part buffer of {v.name}: shape {b.shape} does not lead with "
                      f"loop {b.part_loop}'s extent")
      if b.stride(b.part_loop) != int(np.prod(b.shape[1:], dtype=np.int64)):
        raise IRError(f"part buffer of {v.name}: its stride over {b.part_loop} must be "
                      "the size of one part")
    if b.offset < 0:
      raise IRError(f"buffer of {v.name}: negative offset")
    # The highest offset must lie inside the array.
    last = b.offset + sum(s * (extents[l] - 1) for l, s in b.strides)
    if last >= max(b.size, 1):
      raise IRError(f"buffer of {v.name} addresses past its shape {b.shape}")

  @staticmethod
  def _check_op(op, vals) -> None:
    out = vals[op.out]
    if isinstance(op, Contraction):
      a, b = vals[op.lhs], vals[op.rhs]
      union = set(a.loops) | set(b.loops)
      if not set(op.reduce) <= union:
        raise IRError(f"contraction {op.out} reduces a loop of neither operand")
      if set(out.loops) != union - set(op.reduce):
        raise IRError(f"contraction {op.out}: output loops {out.loops} != "
                      f"{sorted(union - set(op.reduce))}")
      if not op.reduce:
        raise IRError(f"contraction {op.out} reduces nothing")
      if op.precision not in PRECISIONS:
        raise IRError(f"contraction {op.out}: precision {op.precision!r} is not one of "
                      f"{PRECISIONS}")
    elif isinstance(op, Elementwise):
      if op.fn not in ELEMENTWISE_FNS:
        raise IRError(f"unknown elementwise fn {op.fn}")
      arity = ELEMENTWISE_FNS[op.fn][0]
      if len(op.args) != arity:
        raise IRError(f"{op.fn} takes {arity} operands, got {len(op.args)}")
      for a in op.inputs:
        if not set(vals[a].loops) <= set(out.loops):
          raise IRError(f"elementwise {op.out}: operand {a} has loops outside "
                        "the output (a reduction must be explicit)")
    elif isinstance(op, Reduction):
      if op.kind not in ("max", "sum"):
        raise IRError(f"unknown reduction {op.kind}")
      arg = vals[op.arg]
      if op.loop not in arg.loops:
        raise IRError(f"reduction {op.out} along {op.loop}, not a loop of {op.arg}")
      if set(out.loops) != set(arg.loops) - {op.loop}:
        raise IRError(f"reduction {op.out}: wrong output loops")
    elif isinstance(op, Iota):
      if out.loops != (op.loop,):
        raise IRError(f"iota {op.out} must be indexed by its loop only")
    else:  # pragma: no cover
      raise IRError(f"unknown op {op!r}")

  # -- loop roles ---------------------------------------------------------
  def reduced_loops(self) -> set[str]:
    """Loops that some op reduces (contraction or reduction)."""
    out = set()
    for op in self.ops:
      if isinstance(op, Contraction):
        out.update(op.reduce)
      elif isinstance(op, Reduction):
        out.add(op.loop)
    return out

  def spatial_loops(self) -> tuple[str, ...]:
    """Loops of the region's outputs that no op reduces: safe program-id loops."""
    red = self.reduced_loops()
    outs = set()
    for b in self.outputs:
      outs.update(self.value(b.value).loops)
    return tuple(l.name for l in self.loops if l.name in outs and l.name not in red)

  def op_loops(self, op) -> tuple[str, ...]:
    """All loops an op iterates over (its output's plus what it reduces)."""
    got = self._op_memo.get(("op_loops", op))
    if got is not None:
      return got
    loops = list(self.value(op.out).loops)
    if isinstance(op, Contraction):
      loops += [l for l in op.reduce if l not in loops]
    elif isinstance(op, Reduction):
      loops.append(op.loop)
    order = [l.name for l in self.loops]
    got = self._op_memo[("op_loops", op)] = tuple(sorted(set(loops), key=order.index))
    return got

  # -- costs --------------------------------------------------------------
  def flops(self) -> int:
    """FLOPs of the contractions (2 per multiply-add); cheap ops ignored."""
    ext = self.loop_extents
    total = 0
    for op in self.contractions:
      total += 2 * math.prod(ext[l] for l in self.op_loops(op))
    return total

  def elementwise_ops(self) -> int:
    ext = self.loop_extents
    return sum(math.prod(ext[l] for l in self.op_loops(op))
               for op in self.ops if not isinstance(op, Contraction))

  def min_bytes(self) -> int:
    """The fewest bytes a fused kernel must move: each input read once, each
    output written once."""
    got = self._op_memo.get(("min_bytes", None))
    if got is not None:
      return got
    total = 0
    vm = self.value_map
    again = self.same_array()
    for b in self.inputs + self.outputs:
      if b.value in again:
        continue
      ext = self.loop_extents
      n = math.prod(ext[l] for l, s in b.strides if s != 0) if b.strides else 1
      total += n * dtype_itemsize(vm[b.value].dtype)
    self._op_memo[("min_bytes", None)] = total
    return total

  def arithmetic_intensity(self) -> float:
    """FLOPs over the fewest bytes a fused kernel moves."""
    return self.flops() / max(self.min_bytes(), 1)

  def unfused_bytes(self) -> int:
    """Bytes the chain moves run op by op: its inputs and outputs, plus each
    contraction's result written once and read once (cheap ops between are
    assumed fused into their neighbours, as XLA does)."""
    vm, ext = self.value_map, self.loop_extents
    inter = 0
    outs = set(self.output_names)
    for op in self.contractions:
      if op.out in outs:
        continue
      v = vm[op.out]
      inter += 2 * math.prod(ext[l] for l in v.loops) * dtype_itemsize(v.dtype)
    return self.min_bytes() + inter

  def unfused_intensity(self) -> float:
    """FLOPs over ``unfused_bytes``: below the ridge point, the chain's ops
    are memory-bound on their own (MCFuser's MBCI chains)."""
    return self.flops() / max(self.unfused_bytes(), 1)

  # -- canonical form -----------------------------------------------------
  def canonical(self) -> "Region":
    """Renames loops (by first use) and values (by definition order) so that
    regions equal up to names print identically."""
    loop_order: list[str] = []

    def see(loops):
      for l in loops:
        if l not in loop_order:
          loop_order.append(l)

    vm = self.value_map
    for b in self.inputs:
      see(l for l, _ in b.strides)
      see(vm[b.value].loops)
    for op in self.ops:
      see(self.op_loops(op))
    see(l.name for l in self.loops)
    lmap = {l: f"l{i}" for i, l in enumerate(loop_order)}
    vmap = {}
    for i, b in enumerate(self.inputs):
      vmap[b.value] = f"x{i}"
    for i, op in enumerate(self.ops):
      vmap[op.out] = f"v{i}"

    def rl(ls):
      return tuple(lmap[l] for l in ls)

    def rv(a):
      return vmap[a] if isinstance(a, str) else a

    loops = tuple(Loop(lmap[l], self.extent(l)) for l in loop_order)
    values = tuple(sorted((Value(vmap[v.name], rl(v.loops), v.dtype)
                           for v in self.values if v.name in vmap),
                          key=lambda v: (v.name[0], int(v.name[1:]))))
    arrays: dict[int, int] = {}   # labels renumbered by first use
    for b in self.inputs:
      if b.array:
        arrays.setdefault(b.array, len(arrays) + 1)
    inputs = tuple(Buffer(vmap[b.value], b.shape,
                          tuple((lmap[l], s) for l, s in b.strides), b.offset, b.window,
                          lmap[b.part_loop] if b.part_loop else "", arrays.get(b.array, 0))
                   for b in self.inputs)
    outputs = tuple(Buffer(vmap[b.value], b.shape,
                           tuple((lmap[l], s) for l, s in b.strides), b.offset,
                           part_loop=lmap[b.part_loop] if b.part_loop else "")
                    for b in self.outputs)
    ops = []
    for op in self.ops:
      if isinstance(op, Contraction):
        ops.append(dataclasses.replace(op, out=vmap[op.out], lhs=vmap[op.lhs],
                                       rhs=vmap[op.rhs], reduce=rl(op.reduce)))
      elif isinstance(op, Elementwise):
        ops.append(Elementwise(vmap[op.out], op.fn, tuple(rv(a) for a in op.args)))
      elif isinstance(op, Reduction):
        ops.append(Reduction(vmap[op.out], op.kind, vmap[op.arg], lmap[op.loop]))
      else:
        ops.append(Iota(vmap[op.out], lmap[op.loop]))
    return Region(loops, values, inputs, outputs, tuple(ops), name=self.name)

  def launch_offsets(self) -> tuple[int, ...]:
    """The offsets a kernel of this region takes at launch: one per window
    input, in input order (``Buffer.launch_offset``)."""
    return tuple(b.launch_offset for b in self.inputs if b.window)

  def signature(self) -> str:
    """Stable hash of the canonical form (names, shapes, dtypes, strides,
    and of a window only its static offset: see ``Buffer.window``)."""
    return self._signature

  @functools.cached_property
  def _signature(self) -> str:
    text = self.canonical().to_text(with_header=True, offsets=False)
    return hashlib.sha256(text.encode()).hexdigest()[:20]

  def __hash__(self):
    return hash(self.signature())

  def __eq__(self, other):
    return isinstance(other, Region) and self.signature() == other.signature()

  # -- printing -----------------------------------------------------------
  def to_text(self, with_header: bool = True, offsets: bool = True) -> str:
    """The region as text. ``offsets=False`` prints a window's static offset
    only (what the signature and the printed kernel depend on)."""
    vm = self.value_map
    lines = []
    if with_header:
      ext = ", ".join(f"{l.name}={l.extent}" for l in self.loops)
      lines.append(f"{self.name}({ext})")

    def idx(v):
      return f"{v}[{','.join(vm[v].loops)}]"

    def at(b):
      if b.array:
        return f"  array({b.array})" + at(dataclasses.replace(b, array=0))
      if b.part_loop:
        return f"  parts({b.part_loop})"
      if b.window:
        return (f"  window(offset {b.offset})" if offsets else
                f"  window(offset {WINDOW_ALIGN}*i+{b.static_offset})")
      return f"  offset({b.offset})" if b.offset else ""

    for b in self.inputs:
      v = vm[b.value]
      st = ",".join(f"{l}:{s}" for l, s in b.strides)
      lines.append(f"  in  {v.name}: {v.dtype}{list(b.shape)}  {idx(v.name)}"
                   f"  strides({st}){at(b)}")
    for op in self.ops:
      out = vm[op.out]
      lhs = f"  {idx(op.out)} {out.dtype} = "
      if isinstance(op, Contraction):
        prec = "" if op.precision == "default" else f"  precision={op.precision}"
        lines.append(lhs + f"sum_{''.join(op.reduce)} {idx(op.lhs)} * {idx(op.rhs)}{prec}")
      elif isinstance(op, Elementwise):
        args = ", ".join(a if isinstance(a, str) else str(a) for a in op.args)
        lines.append(lhs + f"{op.fn}({args})")
      elif isinstance(op, Reduction):
        lines.append(lhs + f"{op.kind}_{op.loop} {idx(op.arg)}")
      else:
        lines.append(lhs + f"iota({op.loop})")
    for b in self.outputs:
      v = vm[b.value]
      st = ",".join(f"{l}:{s}" for l, s in b.strides)
      lines.append(f"  out {v.name}: {v.dtype}{list(b.shape)}  {idx(v.name)}"
                   f"  strides({st}){at(b)}")
    return "\n".join(lines)

  def einsum_summary(self) -> str:
    """One line per contraction, einsum-style: 'bmk,bkn->bmn'."""
    vm = self.value_map
    parts = []
    for op in self.contractions:
      a, b, o = vm[op.lhs], vm[op.rhs], vm[op.out]
      parts.append(f"{''.join(a.loops)},{''.join(b.loops)}->{''.join(o.loops)}")
    return " ; ".join(parts)

  def __str__(self):
    return self.to_text()

  def __repr__(self):
    return f"<Region {self.name} {self.einsum_summary()} sig={self.signature()}>"


def xla_epilogue_split(region: "Region") -> "str | None":
  """Where XLA would cut a single contraction's epilogue out of its GEMM
  kernel: the first value computed from the contraction's result that two
  or more ops read (GELU and SiLU read their input twice), or None.

  Why: XLA fuses an epilogue into its GEMM only as a chain of single-use
  ops. At 512x768x3072 float16 on an H100 (XLA of jax 0.11.2, 2026-11-22)
  bias + relu, tanh or exp ran in the GEMM's kernel; bias + GELU (erf or
  tanh) and SiLU ran as the GEMM plus one or two elementwise kernels over
  its result (6-12 us more). Capture fuses a single contraction only where
  this cut exists; the cost model prices the kernels after it.

  Example::

      xla_epilogue_split(gelu_region)   # 't0' (the biased GEMM result)
  """
  if len(region.contractions) != 1:
    return None
  readers: dict[str, int] = {}
  for op in region.ops:
    for a in set(op.inputs):
      readers[a] = readers.get(a, 0) + 1
  downstream = {region.contractions[0].out}
  for op in region.ops:
    if op.out in downstream or any(a in downstream for a in op.inputs):
      downstream.add(op.out)
      if readers.get(op.out, 0) > 1:
        return op.out
  return None


def vector_dot_dims(lhs_free: int, rhs_free: int, batch: int) -> bool:
  """Is a contraction with these extents (the product of the lhs-only
  output dimensions, of the rhs-only ones, of the shared batch ones) a
  vector-matrix product, which XLA runs as a reduction and not as a GEMM?

  Why: XLA's GPU simplifier strength-reduces a dot with one output row (or
  column) into a multiply and a reduction. On an H100 (jax 0.11.2,
  sixtieth session) ``[1,768] @ [768,3072]`` float16 ran as one reduction
  kernel in 6.2 us and ``[1,3072] @ [3072,768]`` as a multiply kernel that
  writes the whole product plus a reduction in 12.3 us: 0.76 and 0.38 TB/s,
  where 8 rows ran as a Triton GEMM in 4.6 and 5.2 us. Only unbatched
  products were measured, so only those count.

  Example::

      vector_dot_dims(1, 3072, 1)   # True: x[1, 768] @ w[768, 3072]
  """
  return batch == 1 and min(lhs_free, rhs_free) == 1


def contraction_loops(region: "Region", op: "Contraction") -> "tuple[tuple[str, ...], ...]":
  """(rows, cols, batch, red) loops of ``op``: its lhs-only, rhs-only and
  shared output loops, and the contracted ones.

  Example::

      rows, cols, batch, red = contraction_loops(region, region.contractions[0])
  """
  got = region._op_memo.get(("contraction_loops", op))  # pylint: disable=protected-access
  if got is not None:
    return got
  lhs, rhs = set(region.value(op.lhs).loops), set(region.value(op.rhs).loops)
  out = region.value(op.out).loops
  got = (tuple(l for l in out if l in lhs and l not in rhs),
         tuple(l for l in out if l in rhs and l not in lhs),
         tuple(l for l in out if l in lhs and l in rhs),
         tuple(op.reduce))
  region._op_memo[("contraction_loops", op)] = got  # pylint: disable=protected-access
  return got


def xla_vector_dot(region: "Region", op: "Contraction") -> bool:
  """``vector_dot_dims`` of ``op`` at the region's extents.

  Example::

      xla_vector_dot(region, region.contractions[0])
  """
  ext = region.loop_extents
  rows, cols, batch, _ = (math.prod(ext[l] for l in ls) for ls in contraction_loops(region, op))
  return vector_dot_dims(rows, cols, batch)


def xla_joins(region: "Region") -> "dict[str, tuple[str, ...]]":
  """Where the results of independent contractions meet: each value (not a
  contraction's) computed from two or more contractions' results, none of
  which is computed from another's, that none of its operands already
  joins; mapped to those contractions' outputs.

  Why: XLA fuses a GEMM's epilogue into it only as single-use ops of that
  one dot's result, so the join of sibling GEMMs (``silu(x @ wg) * (x @
  wu)``, a gated MLP) runs as a kernel of its own that reads each GEMM's
  result again. The cost model prices that kernel; capture fuses such
  siblings into one region.

  Example::

      xla_joins(gated_mlp_region)   # {'t2': ('c0', 'c1')}
  """
  deps: dict[str, set] = {}     # every contraction a value is computed from
  direct: dict[str, set] = {}   # those reached without crossing a contraction
  joins: dict[str, tuple[str, ...]] = {}
  for op in region.ops:
    ins = [a for a in op.inputs if a in deps]
    d = set().union(*(deps[a] for a in ins)) if ins else set()
    if isinstance(op, Contraction):
      deps[op.out] = d | {op.out}
      direct[op.out] = {op.out}
      continue
    deps[op.out] = d
    direct[op.out] = set().union(*(direct[a] for a in ins)) if ins else set()
    free = sorted(c for c in direct[op.out]
                  if not any(c in deps[o] for o in direct[op.out] if o != c))
    if len(free) >= 2 and not any(len(direct[a]) >= 2 and direct[a] >= set(free) for a in ins):
      joins[op.out] = tuple(free)
  return joins


def _mergeable(strides: "dict[str, int]", ext: "dict[str, int]", loops) -> bool:
  """Whether ``loops`` (those longer than one) index a buffer as one strided
  dimension: each one's stride is the next inner one's times its extent."""
  ls = sorted((l for l in loops if ext[l] > 1), key=lambda l: -strides.get(l, 0))
  return all(strides.get(a, 0) == strides.get(b, 0) * ext[b] for a, b in zip(ls, ls[1:]))


def xla_gemm_copies(region: "Region") -> "list[Buffer]":
  """The region's buffers that XLA copies into another order around a
  library GEMM: a contraction's operand or result held in a buffer whose
  batch, row, column or contracted loops do not each merge into one
  strided dimension there. A contraction with one row or column is left
  out: XLA runs it as a reduction, batched too (a 4 x 32-head decoding step
  ran as reductions in both orders, no copy).

  Why: XLA's GEMM kernels (cuBLAS, its Triton GEMM) take each of those
  four as one dimension with one stride, so XLA transposes such a buffer
  first (or its result after), one kernel that reads and writes it whole.
  Attention in [batch, tokens, heads, dim] order at batch 8: on the H100
  (benchmarks/RESULTS.md, seventieth session) XLA ran a decoding step's key
  and value caches through two 43-44 us transposes before 28-30 us GEMMs,
  and prefill at 2048 tokens through four (q, k, v and the result, 97 us);
  at batch 1 (the heads alone a batch dimension) it ran no copy.

  Example::

      [b.value for b in xla_gemm_copies(region)]   # ['x1', 'x2']
  """
  ext = region.loop_extents
  bufs = {b.value: b for b in list(region.inputs) + list(region.outputs)}
  out: list = []
  for op in region.contractions:
    groups = contraction_loops(region, op)
    if min(math.prod(ext[l] for l in g) for g in groups[:2]) == 1:
      continue   # one row or column: XLA reduces, batched or not, in any order
    for v in (op.lhs, op.rhs, op.out):
      b = bufs.get(v)
      if b is None or b in out or b.part_loop:
        continue
      st = dict(b.strides)
      if not all(_mergeable(st, ext, [l for l in g if l in st]) for g in groups):
        out.append(b)
  return out


def written_intermediates(region: "Region") -> "list[str]":
  """The region's outputs that a later contraction of the region reads
  (through elementwise ops and reductions) and that are as large as the
  largest such intermediate: a training step's forward attention writes
  its exponentials and probabilities ([heads, queries, keys]) for the
  backward. Small ones (an attention's row maxima and sums) are left
  out. Empty for a region that writes only its results.

  Example::

      written_intermediates(region)   # ['t5', 't8']
  """
  ext = region.loop_extents
  # In op order, so that callers and messages see one order run to run.
  feeding = [op.out for op in region.ops
             if any(region.computed_from(c.inputs, op.out) for c in region.contractions)]
  if not feeding:
    return []
  size = lambda v: math.prod(ext[l] for l in region.value(v).loops)
  largest = max(size(v) for v in feeding)
  outs = set(region.output_names)
  return [v for v in feeding if v in outs and size(v) >= largest]


# XLA's DotMerger (run by its GPU compiler) merges two dots that read one
# operand when the input and output bytes of at least one of them are at
# most this many (32 MiB on GPUs).
XLA_DOT_MERGER_BYTES = 32 << 20


def xla_merged_dots(region: "Region") -> "list[tuple[Contraction, ...]]":
  """Groups of the region's contractions that XLA runs as one GEMM: those
  that read one lhs (or one rhs) value alike (same contracted loops, other
  operands of one dtype and rank), none computed from another's result, with at
  least one of them moving at most ``XLA_DOT_MERGER_BYTES``. Each group has
  two or more contractions, in region order.

  Why: XLA's DotMerger turns ``x @ wg`` and ``x @ wu`` (a gated MLP's gate
  and up projections) into one GEMM of ``x`` against both weights side by
  side, so XLA's time for them is one GEMM of the summed columns, not two
  (on the H100, two 8x4864x896 siblings ran as one kernel of 8.06 us, as
  one 8x9728x896 GEMM does; benchmarks/RESULTS.md, fifty-eighth session).
  Dots too large to merge (LLaMA-2-7B's, 90 MB of weight each) ran as two
  kernels.

  Example::

      xla_merged_dots(gated_mlp_region)   # [(c_gate, c_up)]
  """
  vm = region.value_map
  deps: dict[str, set] = {}     # the contractions each value is computed from
  for op in region.ops:
    d = set().union(*(deps.get(a, set()) for a in op.inputs))
    deps[op.out] = d | {op.out} if isinstance(op, Contraction) else d
  cons = region.contractions
  ext = region.loop_extents

  def nbytes(c) -> int:
    return sum(math.prod(ext[l] for l in vm[v].loops) * dtype_itemsize(vm[v].dtype)
               for v in (c.lhs, c.rhs, c.out))

  def shared(a, b) -> bool:
    if a.reduce != b.reduce or vm[a.out].dtype != vm[b.out].dtype:
      return False
    if a.lhs == b.lhs:
      va, vb = vm[a.rhs], vm[b.rhs]
    elif a.rhs == b.rhs:
      va, vb = vm[a.lhs], vm[b.lhs]
    else:
      return False
    return (va.dtype == vb.dtype and len(va.loops) == len(vb.loops)
            and a.precision == b.precision)

  groups: list[list] = []
  for c in cons:
    for g in groups:
      if (all(shared(c, o) and c.out not in deps[o.out] and o.out not in deps[c.out]
              for o in g)
          and min(nbytes(o) for o in g + [c]) <= XLA_DOT_MERGER_BYTES):
        g.append(c)
        break
    else:
      groups.append([c])
  return [tuple(g) for g in groups if len(g) > 1]


def _identity_operand(op, vm) -> "str | None":
  """The operand an elementwise op returns unchanged, if it is an identity.

  ``max(x, -inf)`` (jax.nn.softmax's ``initial=-inf``), ``min(x, inf)``,
  ``x * 1``, ``x / 1``, ``x + 0``, ``x - 0`` and a ``convert`` to the same
  dtype return ``x`` exactly (NaN included); dropping them keeps the
  region's algebra visible to the planner and the streaming analysis.
  """
  if not isinstance(op, Elementwise):
    return None
  out = vm[op.out]
  names = [a for a in op.args if isinstance(a, str)]
  lits = [a for a in op.args if isinstance(a, Literal)]
  if op.fn == "convert" and len(names) == 1:
    x = names[0]
  elif out.dtype == "bool" and op.fn in ("and", "or", "select"):
    # p & True, p | False, select(p, False, True): jax.nn.dot_product_attention
    # builds its causal mask as and(True, select_n(tril, False, True)); the
    # bare compare of two iotas is what lets the code generator skip tiles.
    x = _boolean_identity(op)
    if x is None:
      return None
  elif len(names) == 1 and len(lits) == 1:
    x, c = names[0], float(lits[0].value)
    first = isinstance(op.args[0], str)
    ok = ((op.fn == "max" and c == -math.inf) or (op.fn == "min" and c == math.inf)
          or (op.fn == "mul" and c == 1.0) or (op.fn == "add" and c == 0.0)
          or (op.fn in ("sub", "div") and first and c == (0.0 if op.fn == "sub" else 1.0)))
    if not ok:
      return None
  else:
    return None
  v = vm[x]
  if v.dtype != out.dtype or set(v.loops) != set(out.loops):
    return None
  return x


def _boolean_identity(op: Elementwise) -> "str | None":
  """The operand of a boolean ``and``/``or``/``select`` that it returns
  unchanged: ``p & True``, ``p | False``, ``select(p, False, True)``."""
  def lit(a, value):
    return isinstance(a, Literal) and str(a.dtype) == "bool" and bool(a.value) is value
  if op.fn in ("and", "or"):
    unit = op.fn == "and"
    a, b = op.args
    if isinstance(a, str) and lit(b, unit):
      return a
    if isinstance(b, str) and lit(a, unit):
      return b
    return None
  p, on_false, on_true = op.args
  if isinstance(p, str) and lit(on_false, False) and lit(on_true, True):
    return p
  return None


def simplify(region: Region) -> Region:
  """Removes identity elementwise ops (see ``_identity_operand``), then
  merges loop pairs that ``coalesce_loops`` can merge.

  Example::

      simplify(r)   # max(-inf, max_n s) -> max_n s
  """
  return coalesce_loops(_drop_identities(region))


def _coalescible(region: Region, outer: str, inner: str) -> bool:
  """Whether loops ``outer`` and ``inner`` can become one loop (see
  ``coalesce_loops``)."""
  ext = region.loop_extents
  if region.part_loop in (outer, inner):
    return False   # each part is its own array: no stride joins p to a loop
  for v in region.values:
    if (outer in v.loops) != (inner in v.loops):
      return False
  for b in (*region.inputs, *region.outputs):
    so, si = b.stride(outer), b.stride(inner)
    if so != ext[inner] * si or ((outer in b.loops) != (inner in b.loops)):
      return False
  for op in region.ops:
    if isinstance(op, (Reduction, Iota)) and op.loop in (outer, inner):
      return False   # a softmax axis or a mask's index keeps its own loop
    if isinstance(op, Contraction) and (outer in op.reduce) != (inner in op.reduce):
      return False
  return True


def coalesce_loops(region: Region) -> Region:
  """Merges two loops into one where that turns a contraction's two M (or
  two N) loops into one, which the code generator can feed to ``tl.dot``:
  ``x[b,m,k] @ w[k,n]`` (batched activations times a weight, as
  ``jnp.matmul`` of a [B, T, D] array traces) has M loops b and m, and
  Triton's dot takes one M dim; without the merge the kernel is a broadcast
  product (91-372 s to compile for sm_90, 2026-11-22). Two loops merge when
  every value has both or neither, every buffer addresses them as one
  (``stride(outer) == extent(inner) * stride(inner)``, e.g. the contiguous
  [4, 512] rows of a [4, 512, 80] array), no reduction or iota runs along
  either, and each contraction reduces both or neither. The merged loop
  takes the inner loop's name at the outer loop's place.

  Example::

      coalesce_loops(r)   # region(b=4, m=512, ...) -> region(m=2048, ...)
  """
  while True:
    vm = region.value_map
    pair = None
    for op in region.contractions:
      a, b, o = (set(vm[x].loops) for x in (op.lhs, op.rhs, op.out))
      for side in ((a & o) - b, (b & o) - a):
        for outer in sorted(side):
          for inner in sorted(side - {outer}):
            if pair is None and _coalescible(region, outer, inner):
              pair = (outer, inner)
    if pair is None:
      return region
    region = _merge_loops(region, *pair)


def _merge_loops(region: Region, outer: str, inner: str) -> Region:
  # The merged loop takes the inner loop's name at the outer loop's place:
  # x[b,m,k] @ w merges into rows named m, as a GEMM's rows read.
  ext = region.loop_extents
  loops = tuple(Loop(inner, l.extent * ext[inner]) if l.name == outer else l
                for l in region.loops if l.name != inner)

  def merged(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(inner if l == outer else l for l in names if l != inner)

  values = tuple(Value(v.name, merged(v.loops), v.dtype) for v in region.values)

  def buf(b: Buffer) -> Buffer:
    # stride(outer) == extent(inner) * stride(inner): the merged loop steps
    # by the inner stride.
    strides = tuple((inner, b.stride(inner)) if l == outer else (l, s)
                    for l, s in b.strides if l != inner)
    return dataclasses.replace(b, strides=strides)

  ops = tuple(dataclasses.replace(op, reduce=merged(op.reduce))
              if isinstance(op, Contraction) else op for op in region.ops)
  return Region(loops, values, tuple(buf(b) for b in region.inputs),
                tuple(buf(b) for b in region.outputs), ops, name=region.name)


def _unit_loop_needed(region: Region, loop: str) -> bool:
  """Whether size-1 ``loop`` carries a role its region cannot lose (see
  ``drop_unit_loops``)."""
  if loop == region.part_loop:
    return True
  vm = region.value_map
  if any(vm[v].loops == (loop,) for v in vm):
    return True   # the value would have no loop left
  for op in region.ops:
    if isinstance(op, (Reduction, Iota)) and op.loop == loop:
      return True
    if isinstance(op, Contraction):
      a, b, o = (set(vm[x].loops) for x in (op.lhs, op.rhs, op.out))
      for role in ((a & o) - b, (b & o) - a, set(op.reduce)):
        if role == {loop}:
          return True   # the only row, column or reduced loop of a dot
  return False


def drop_unit_loops(region: Region) -> Region:
  """``region`` without the size-1 loops it does not need. A size-1 loop
  indexes 0 only, so dropping one changes no value; but where it comes from
  depends on how the program spelled its views: ``jax.nn.dot_product_attention``
  gives q a size-1 group axis, so its backward's dk recomputes
  ``s = q @ k.T`` with a loop that dv's recomputation lacks, and the two
  (which ``ir_merge`` joins by their loops) stay two kernels. Kept: a
  contraction's only row, column or reduced loop (a one-row GEMM is still
  a GEMM to the code generator), a reduction's or iota's loop, the part
  loop, and a value's only loop.

  Example::

      drop_unit_loops(r)   # c0[b,g,n,p,m] (p = 1) -> c0[b,g,n,m]
  """
  for l in region.loops:
    if l.extent == 1 and not _unit_loop_needed(region, l.name):
      region = _without_loop(region, l.name)
  return region


def _without_loop(region: Region, loop: str) -> Region:
  def keep(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(l for l in names if l != loop)

  def buf(b: Buffer) -> Buffer:
    return dataclasses.replace(b, strides=tuple((l, s) for l, s in b.strides if l != loop))

  values = tuple(Value(v.name, keep(v.loops), v.dtype) for v in region.values)
  ops = tuple(dataclasses.replace(op, reduce=keep(op.reduce))
              if isinstance(op, Contraction) else op for op in region.ops)
  return Region(tuple(l for l in region.loops if l.name != loop), values,
                tuple(buf(b) for b in region.inputs), tuple(buf(b) for b in region.outputs),
                ops, name=region.name)


def _drop_identities(region: Region) -> Region:
  vm = region.value_map
  outputs = set(region.output_names)
  inputs = set(region.input_names)
  alias: dict[str, str] = {}
  ops = []
  for op in region.ops:
    def a(x):
      return alias.get(x, x) if isinstance(x, str) else x
    if isinstance(op, Contraction):
      op = dataclasses.replace(op, lhs=a(op.lhs), rhs=a(op.rhs))
    elif isinstance(op, Elementwise):
      op = Elementwise(op.out, op.fn, tuple(a(x) for x in op.args))
    elif isinstance(op, Reduction):
      op = Reduction(op.out, op.kind, a(op.arg), op.loop)
    x = _identity_operand(op, vm)
    # An output is renamed to the operand too (a training step's forward
    # writes softmax's max(-inf, max_n s) for its backward: the running max
    # must stay visible), unless that would write one value twice.
    if (x is not None and vm[x].loops == vm[op.out].loops
        and (op.out not in outputs or (x not in outputs and x not in inputs))):
      alias[op.out] = x
      if op.out in outputs:
        outputs.add(x)
      continue
    ops.append(op)
  if not alias:
    return region
  used = set(region.input_names) | {op.out for op in ops}
  values = tuple(v for v in region.values if v.name in used)
  outs = tuple(dataclasses.replace(b, value=alias.get(b.value, b.value)) for b in region.outputs)
  return Region(region.loops, values, region.inputs, outs, tuple(ops), name=region.name)


# --------------------------------------------------------------------------
# Evaluator: the ground truth.
# --------------------------------------------------------------------------

def _align(arr: np.ndarray, loops: Sequence[str], target: Sequence[str]) -> np.ndarray:
  """Transposes/expands ``arr`` (axes = loops) to broadcast against target."""
  perm = [loops.index(l) for l in target if l in loops]
  arr = np.transpose(arr, perm) if perm != list(range(len(perm))) else arr
  shape = []
  present = [l for l in target if l in loops]
  it = iter(arr.shape)
  for l in target:
    shape.append(next(it) if l in present else 1)
  return arr.reshape(shape)


def with_shared_arrays(region: Region, same_as: Sequence[int]) -> Region:
  """``region`` with ``Buffer.array`` labels from ``same_as``: for each
  input, the index of the first input that receives the same array (itself
  when none before it does), as ``capture.CapturedRegion.same_as`` gives.
  Windows and part buffers get no label; every other label is cleared.

  Example::

      r = with_shared_arrays(r, (0, 1, 0))   # inputs 0 and 2: one array
      r.same_array()                          # {r.inputs[2].value: r.inputs[0].value}
  """
  if len(same_as) != len(region.inputs):
    raise IRError(f"with_shared_arrays: {len(same_as)} entries for "
                  f"{len(region.inputs)} inputs")
  plain = [not b.window and not b.part_loop for b in region.inputs]
  count: dict[int, int] = {}
  for i, j in enumerate(same_as):
    if not 0 <= j <= i or same_as[j] != j:
      raise IRError(f"with_shared_arrays: input {i} names input {j}, not an earlier first use")
    if plain[i] and plain[j]:
      count[j] = count.get(j, 0) + 1
  ins = tuple(dataclasses.replace(b, array=(j + 1 if plain[i] and count.get(j, 0) > 1 else 0))
              for i, (b, j) in enumerate(zip(region.inputs, same_as)))
  return dataclasses.replace(region, inputs=ins)


def with_parts(region: Region, parts: int, per_part: Iterable[int],
               loop: str = "p") -> Region:
  """The region of ``parts`` sibling copies of ``region`` that share all
  inputs but those at indices ``per_part``: a part loop ``loop`` of extent
  ``parts`` joins every value computed from a per-part input, and those
  inputs and every output become part buffers (``Buffer.part_loop``).

  Why: XLA merges sibling dots that read one activation (a transformer's
  q/k/v projections) into one GEMM, then runs one kernel per sibling for
  what follows (bias adds, slices); one fused kernel over the parts saves
  those kernels.

  Example::

      with_parts(r, 3, per_part=[1, 2])   # 'mk,kn->mn' -> 'mk,pkn->pmn'
  """
  per_part = set(per_part)
  if parts < 2:
    raise IRError(f"with_parts: parts must be >= 2, got {parts}")
  if not per_part or not per_part <= set(range(len(region.inputs))):
    raise IRError(f"with_parts: per_part {sorted(per_part)} must name inputs of the region")
  if region.part_loop or any(b.window for i, b in enumerate(region.inputs) if i in per_part):
    raise IRError("with_parts: the region already has parts, or a per-part input is a window")
  used = {l.name for l in region.loops}
  while loop in used:
    loop += "_"
  varying = {region.inputs[i].value for i in per_part}
  for op in region.ops:
    if any(a in varying for a in op.inputs):
      varying.add(op.out)

  def buf(b: Buffer) -> Buffer:
    size = int(np.prod(b.shape, dtype=np.int64)) if b.shape else 1
    return Buffer(b.value, (parts, *b.shape), ((loop, size), *b.strides), part_loop=loop)

  ins = tuple(buf(b) if i in per_part else b for i, b in enumerate(region.inputs))
  if any(b.value not in varying for b in region.outputs):
    raise IRError("with_parts: an output does not depend on any per-part input")
  outs = tuple(buf(b) for b in region.outputs)
  values = tuple(Value(v.name, (loop, *v.loops), v.dtype) if v.name in varying else v
                 for v in region.values)
  return Region((Loop(loop, parts), *region.loops), values, ins, outs, region.ops,
                name=region.name)


def operand_buffers(buffers: Sequence[Buffer]) -> list[Buffer]:
  """The buffer of each kernel operand for ``buffers``, in order: a part
  buffer gives ``parts`` operands (each ``operand_shape``), any other one."""
  return [b for b in buffers for _ in range(b.parts)]


def operand_shapes(buffers: Sequence[Buffer]) -> list[tuple[int, ...]]:
  """The shape of each kernel operand for ``buffers`` (``operand_buffers``)."""
  return [b.operand_shape for b in operand_buffers(buffers)]


def stack_parts(buffers: Sequence[Buffer], operands: Sequence[Any], stack=np.stack
                ) -> list[Any]:
  """One array per buffer from the kernel's operands (``operand_shapes``
  order): a part buffer's arrays stacked along a new leading axis with
  ``stack`` (``np.stack``, ``jnp.stack``).

  Example::

      stack_parts(region.inputs, [x, wq, wk, wv])   # [x, stack([wq, wk, wv])]
  """
  want = sum(b.parts for b in buffers)
  if len(operands) != want:
    raise ValueError(f"expected {want} operands for {len(buffers)} buffers, got {len(operands)}")
  out, i = [], 0
  for b in buffers:
    if b.part_loop:
      out.append(stack(list(operands[i:i + b.parts])))
    else:
      out.append(operands[i])
    i += b.parts
  return out


def split_parts(buffers: Sequence[Buffer], arrays: Sequence[Any]) -> list[Any]:
  """The inverse of ``stack_parts``: one operand per part."""
  out = []
  for b, a in zip(buffers, arrays):
    if b.part_loop:
      out.extend(a[i] for i in range(b.parts))
    else:
      out.append(a)
  return out


def _buffer_view(region: Region, buf: Buffer, flat: np.ndarray, loops) -> np.ndarray:
  ext = region.loop_extents
  item = flat.itemsize
  shape = [ext[l] for l in loops]
  strides = [buf.stride(l) * item for l in loops]
  return np.lib.stride_tricks.as_strided(flat[buf.offset:], shape=shape,
                                         strides=strides, writeable=False)


def evaluate(region: Region, inputs: Sequence[np.ndarray], *,
             precision: str = "float64") -> list[np.ndarray]:
  """Evaluates ``region`` on NumPy arrays (one per operand, as a kernel takes
  them: ``operand_shapes(region.inputs)``).

  ``precision='float64'`` computes every op in float64 (the reference);
  ``'native'`` rounds each value to its IR dtype after each op, with
  contractions accumulated in float32, as a fused kernel does.
  Returns one array per output operand, in the output's dtype.
  """
  if precision not in ("float64", "native"):
    raise ValueError(f"precision must be 'float64' or 'native', got {precision!r}")
  n_in = len(operand_buffers(region.inputs))
  if len(inputs) != n_in:
    raise ValueError(f"region takes {n_in} inputs, got {len(inputs)}")
  inputs = stack_parts(region.inputs, [np.asarray(a) for a in inputs])
  vm = region.value_map
  ext = region.loop_extents
  env: dict[str, np.ndarray] = {}

  def rounded(arr, dtype):
    if precision == "native":
      if dtype in FLOAT_DTYPES:
        # Overflowing to inf is what a float16 value does: no warning.
        with np.errstate(over="ignore"):
          return arr.astype(np_dtype(dtype)).astype(np.float32 if dtype != "float64" else np.float64)
      return arr.astype(np_dtype(dtype))
    if dtype in FLOAT_DTYPES:
      return arr.astype(np.float64)
    return arr.astype(np_dtype(dtype))

  work = np.float64 if precision == "float64" else np.float32
  for buf, arr in zip(region.inputs, inputs):
    arr = np.asarray(arr)
    if tuple(arr.shape) != tuple(buf.shape):
      raise ValueError(f"input {buf.value}: shape {arr.shape} != {buf.shape}")
    v = vm[buf.value]
    flat = np.ascontiguousarray(arr).reshape(-1)
    present = [l for l in v.loops if l in buf.loops]
    view = _buffer_view(region, buf, flat, present)
    full = np.broadcast_to(_align(view, present, v.loops),
                           [ext[l] for l in v.loops])
    env[v.name] = rounded(np.array(full), v.dtype)

  for op in region.ops:
    out = vm[op.out]
    if isinstance(op, Contraction):
      a, b = vm[op.lhs], vm[op.rhs]
      letters = {}
      for l in list(a.loops) + list(b.loops):
        letters.setdefault(l, chr(ord("a") + len(letters)))
      spec = (f"{''.join(letters[l] for l in a.loops)},"
              f"{''.join(letters[l] for l in b.loops)}->"
              f"{''.join(letters[l] for l in out.loops)}")
      res = np.einsum(spec, env[op.lhs].astype(work), env[op.rhs].astype(work),
                      optimize=True)
    elif isinstance(op, Elementwise):
      fn = ELEMENTWISE_FNS[op.fn][1]
      args = []
      for a in op.args:
        if isinstance(a, Literal):
          args.append(np.asarray(a.value, dtype=work if a.dtype in FLOAT_DTYPES
                                 else np_dtype(a.dtype)))
        else:
          args.append(_align(env[a], vm[a].loops, out.loops))
      with np.errstate(all="ignore"):
        res = fn(*args)
      res = np.broadcast_to(res, [ext[l] for l in out.loops])
    elif isinstance(op, Reduction):
      arg = vm[op.arg]
      axis = arg.loops.index(op.loop)
      src = env[op.arg]
      res = np.max(src, axis=axis) if op.kind == "max" else np.sum(src, axis=axis)
      rest = [l for l in arg.loops if l != op.loop]
      res = _align(res, rest, out.loops).reshape([ext[l] for l in out.loops])
    else:
      res = np.arange(ext[op.loop], dtype=np.int32)
    env[op.out] = rounded(np.asarray(res), out.dtype)

  results = []
  for buf in region.outputs:
    v = vm[buf.value]
    res = np.zeros(buf.shape, dtype=np.float64 if (precision == "float64" and v.dtype in FLOAT_DTYPES)
                   else np_dtype(v.dtype))
    flat = res.reshape(-1)
    item = flat.itemsize
    view = np.lib.stride_tricks.as_strided(
        flat[buf.offset:], shape=[ext[l] for l in buf.loops],
        strides=[s * item for _, s in buf.strides], writeable=True)
    view[...] = _align(env[v.name], v.loops, buf.loops).astype(res.dtype)
    results.append(res)
  return split_parts(region.outputs, results)
