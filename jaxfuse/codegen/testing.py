"""Small region builders for tests, examples and benchmarks of the generator.

They build the Chain IR that capture produces for common chains, with
row-major buffers unless asked otherwise.

Example::

    r = gemm_chain(M=77, N=200, K=32, H=80, dtype="float16")
    r2 = attention(M=64, N=96, D=80, causal=True)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence, Union

from jaxfuse import ir
from jaxfuse.ir import Buffer, Contraction, Elementwise, Iota, Literal, Loop, Reduction, Region, Value
from jaxfuse.planner.tiling import next_pow2

__all__ = ["gemm_chain", "attention", "mlp", "reread_chain", "simple_plan", "with_precision",
           "issue_order"]


def _buf(name: str, loops: Sequence[str], ext: dict[str, int], order: Optional[Sequence[str]] = None) -> Buffer:
  """Buffer of value ``name`` stored with axes ``order`` (default ``loops``)."""
  order = list(order or loops)
  shape = tuple(ext[l] for l in order)
  strides = ir.contiguous_strides(shape)
  return Buffer(name, shape, tuple((l, s) for l, s in zip(order, strides)))


def gemm_chain(M: int = 64, N: int = 64, K: int = 32, H: int = 32, B: int = 1, *,
               dtype: str = "float32", transpose_b: bool = False, transpose_d: bool = False) -> Region:
  """``E[b,m,h] = (A[b,m,k] B[b,k,n]) D[b,n,h]`` (MCFuser's GEMM chain).

  ``transpose_b`` stores B as ``[b,n,k]`` (read through strides, no copy).
  """
  ext = dict(b=B, m=M, n=N, k=K, h=H)
  loops = tuple(Loop(l, ext[l]) for l in "bmnkh")
  vals = (Value("A", ("b", "m", "k"), dtype), Value("B", ("b", "k", "n"), dtype),
          Value("D", ("b", "n", "h"), dtype), Value("C", ("b", "m", "n"), dtype),
          Value("E", ("b", "m", "h"), dtype))
  ins = (_buf("A", "bmk", ext), _buf("B", "bkn", ext, "bnk" if transpose_b else "bkn"),
         _buf("D", "bnh", ext, "bhn" if transpose_d else "bnh"))
  ops = (Contraction("C", "A", "B", ("k",)), Contraction("E", "C", "D", ("n",)))
  return Region(loops, vals, ins, (_buf("E", "bmh", ext),), ops, name="gemm_chain")


def attention(M: int = 64, N: int = 64, D: int = 32, Dv: Optional[int] = None, B: int = 1, *,
              dtype: str = "float32", scale: float = 0.125, bias: bool = False,
              mask: bool = False, causal: Union[bool, str] = False, heads: int = 1) -> Region:
  """Softmax attention ``O = softmax(Q K^T * scale [+ bias] [masked]) V``.

  Q: ``[b,m,g,d]`` (g = heads, stored as [b,m,g,d] so heads are strided),
  K: ``[b,n,g,d]``, V: ``[b,n,g,e]``; bias ``[m,n]``; boolean mask ``[b,m,n]``;
  causal: keep ``iota(m) >= iota(n)``, or ``cmp(iota(m), iota(n))`` for
  ``causal=cmp`` in ('ge', 'gt', 'le', 'lt').
  """
  Dv = Dv or D
  ext = dict(b=B, g=heads, m=M, n=N, d=D, e=Dv)
  loops = tuple(Loop(l, ext[l]) for l in "bgmnde")
  f32 = "float32"
  vals = [Value("Q", ("b", "g", "m", "d"), dtype), Value("K", ("b", "g", "n", "d"), dtype),
          Value("V", ("b", "g", "n", "e"), dtype),
          Value("s", ("b", "g", "m", "n"), f32), Value("t", ("b", "g", "m", "n"), f32)]
  ins = [_buf("Q", "bgmd", ext, "bmgd"), _buf("K", "bgnd", ext, "bngd"), _buf("V", "bgne", ext, "bnge")]
  ops = [Contraction("s", "Q", "K", ("d",)), Elementwise("t", "mul", ("s", Literal(scale, f32)))]
  cur = "t"
  if bias:
    vals += [Value("bias", ("m", "n"), dtype), Value("tb", ("b", "g", "m", "n"), f32)]
    ins.append(_buf("bias", "mn", ext))
    ops.append(Elementwise("tb", "add", (cur, "bias")))
    cur = "tb"
  if mask:
    vals += [Value("keep", ("b", "m", "n"), "bool"), Value("tm", ("b", "g", "m", "n"), f32)]
    ins.append(_buf("keep", "bmn", ext))
    ops.append(Elementwise("tm", "select", ("keep", Literal(float("-inf"), f32), cur)))
    cur = "tm"
  if causal:
    vals += [Value("im", ("m",), "int32"), Value("in_", ("n",), "int32"),
             Value("tri", ("m", "n"), "bool"), Value("tc", ("b", "g", "m", "n"), f32)]
    cmp = "ge" if causal is True else causal
    if cmp not in ("ge", "gt", "le", "lt"):
      raise ValueError(f"causal must be a bool or one of ge, gt, le, lt; got {causal!r}")
    ops += [Iota("im", "m"), Iota("in_", "n"), Elementwise("tri", cmp, ("im", "in_")),
            Elementwise("tc", "select", ("tri", Literal(float("-inf"), f32), cur))]
    cur = "tc"
  vals += [Value("mx", ("b", "g", "m"), f32), Value("z", ("b", "g", "m", "n"), f32),
           Value("p", ("b", "g", "m", "n"), f32), Value("l", ("b", "g", "m"), f32),
           Value("pn", ("b", "g", "m", "n"), f32), Value("ph", ("b", "g", "m", "n"), dtype),
           Value("O", ("b", "g", "m", "e"), dtype)]
  ops += [Reduction("mx", "max", cur, "n"), Elementwise("z", "sub", (cur, "mx")),
          Elementwise("p", "exp", ("z",)), Reduction("l", "sum", "p", "n"),
          Elementwise("pn", "div", ("p", "l")), Elementwise("ph", "convert", ("pn",)),
          Contraction("O", "ph", "V", ("n",))]
  return Region(loops, tuple(vals), tuple(ins), (_buf("O", "bgme", ext, "bmge"),), tuple(ops),
                name="attention")


def mlp(M: int = 32, dims: Sequence[int] = (32, 64, 32, 16), *, dtype: str = "float32",
        acts: Sequence[str] = ("gelu", "relu")) -> Region:
  """``Y = act2(act1(X W1) W2) W3`` (len(dims)-1 GEMMs; acts between them).

  Activations: 'relu' (max with 0), 'gelu' (erf form), 'tanh', 'silu'
  (x * logistic(x)), 'none'.
  """
  nl = len(dims) - 1
  names = ["m"] + [f"k{i}" for i in range(len(dims))]
  ext = dict(m=M, **{f"k{i}": d for i, d in enumerate(dims)})
  loops = tuple(Loop(l, ext[l]) for l in names)
  f32 = "float32"
  vals = [Value("X", ("m", "k0"), dtype)]
  ins = [_buf("X", ("m", "k0"), ext)]
  ops = []
  cur = "X"
  for i in range(nl):
    w = f"W{i + 1}"
    vals.append(Value(w, (f"k{i}", f"k{i + 1}"), dtype))
    ins.append(_buf(w, (f"k{i}", f"k{i + 1}"), ext))
    h = f"H{i + 1}"
    lo = ("m", f"k{i + 1}")
    vals.append(Value(h, lo, dtype if i == nl - 1 else f32))
    ops.append(Contraction(h, cur, w, (f"k{i}",)))
    cur = h
    if i < nl - 1:
      act = acts[i % len(acts)] if acts else "none"
      a = f"a{i + 1}"
      if act == "relu":
        vals.append(Value(a, lo, dtype))
        ops.append(Elementwise(a, "max", (cur, Literal(0.0, f32))))
      elif act == "gelu":
        vals += [Value(a + "_s", lo, f32), Value(a + "_e", lo, f32), Value(a + "_p", lo, f32),
                 Value(a + "_h", lo, f32), Value(a, lo, dtype)]
        ops += [Elementwise(a + "_s", "mul", (cur, Literal(0.7071067811865476, f32))),
                Elementwise(a + "_e", "erf", (a + "_s",)),
                Elementwise(a + "_p", "add", (a + "_e", Literal(1.0, f32))),
                Elementwise(a + "_h", "mul", (cur, Literal(0.5, f32))),
                Elementwise(a, "mul", (a + "_h", a + "_p"))]
      elif act == "tanh":
        vals.append(Value(a, lo, dtype))
        ops.append(Elementwise(a, "tanh", (cur,)))
      elif act == "silu":
        vals += [Value(a + "_g", lo, f32), Value(a, lo, dtype)]
        ops += [Elementwise(a + "_g", "logistic", (cur,)), Elementwise(a, "mul", (cur, a + "_g"))]
      else:
        vals.append(Value(a, lo, dtype))
        ops.append(Elementwise(a, "convert", (cur,)))
      cur = a
  outs = (_buf(cur, ("m", f"k{nl}"), ext),)
  return Region(loops, tuple(vals), tuple(ins), outs, tuple(ops), name="mlp")


def reread_chain(M: int = 32, N: int = 48, K: int = 32, H: int = 32, *,
                 dtype: str = "float32", one_array: bool = True) -> Region:
  """``E[m,h] = (A[m,k] W[n,k]) W2[n,h]``: attention's ``dq = ds @ k`` after
  ``s = q @ k.T`` in small. With ``one_array`` (and ``K == H``), ``W`` and
  ``W2`` receive one array (``ir.Buffer.array``), as capture reads ``k``.
  """
  ext = dict(m=M, n=N, k=K, h=H)
  loops = tuple(Loop(l, ext[l]) for l in "mnkh")
  vals = (Value("A", ("m", "k"), dtype), Value("W", ("n", "k"), dtype),
          Value("W2", ("n", "h"), dtype), Value("C", ("m", "n"), dtype),
          Value("E", ("m", "h"), dtype))
  ins = (_buf("A", "mk", ext), _buf("W", "nk", ext), _buf("W2", "nh", ext))
  ops = (Contraction("C", "A", "W", ("k",)), Contraction("E", "C", "W2", ("n",)))
  region = Region(loops, vals, ins, (_buf("E", "mh", ext),), ops, name="reread_chain")
  return ir.with_shared_arrays(region, (0, 1, 1)) if one_array else region


def with_precision(region: Region, precision: str) -> Region:
  """``region`` with every contraction at ``precision`` (``ir.PRECISIONS``)."""
  ops = tuple(dataclasses.replace(op, precision=precision) if isinstance(op, Contraction) else op
              for op in region.ops)
  return Region(region.loops, region.values, region.inputs, region.outputs, ops,
                name=region.name)


def simple_plan(region: Region, grid: Sequence[str], tree, tiles: dict, *, num_warps: int = 4,
                num_stages: int = 2, split=None):
  """A plan with statements placed at the deepest sequential loop they depend on.

  ``tree``: the sequential loops as nested ``(loop, [children])`` tuples
  (a list of them at the top), e.g. ``[("n", [("k", [])])]`` for ``n(k)`` or
  ``[("n", [("k", []), ("h", [])])]`` for ``n(k,h)``. Loops not in ``grid``
  or ``tree`` must fit one tile. A stand-in for the planner's placement, for
  tests and examples.
  """
  from jaxfuse.planner.plan import Plan  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner.tiling import LoopNode, Stmt, TilingExpr  # pylint: disable=g-import-not-at-top

  parent: dict[str, Optional[str]] = {}

  def reg(nodes, par):
    for l, ch in nodes:
      parent[l] = par
      reg(ch, l)
  reg(tree, None)

  def depth(l):
    d = 0
    while parent[l] is not None:
      l, d = parent[l], d + 1
    return d

  def path(l):
    p = []
    while l is not None:
      p.append(l)
      l = parent[l]
    return set(p)

  def target(deps):
    deps = [l for l in deps if l in parent]
    if not deps:
      return None
    t = max(deps, key=depth)
    if not set(deps) <= path(t):
      raise ValueError(f"no loop of the tree covers {deps}")
    return t

  vm = region.value_map
  where: dict[str, Optional[str]] = {}
  seq: list[tuple[Stmt, Optional[str]]] = []
  inputs = {b.value: b for b in region.inputs}
  outs = set(region.output_names)
  for op in region.ops:
    for a in op.inputs:
      if a in inputs and a not in where:
        where[a] = target(inputs[a].loops)
        seq.append((Stmt("L", a), where[a]))
    deps = set(region.op_loops(op))
    for a in op.inputs:
      w = where[a]
      while w is not None:
        deps.add(w)
        w = parent[w]
    # An op reading a finished reduction over loop r is placed outside r.
    red = set(op.reduce) if isinstance(op, Contraction) else ({op.loop} if isinstance(op, Reduction) else set())
    deps = {l for l in deps if l in vm[op.out].loops or l in red or
            any(l in path(where[a]) and l in vm[a].loops and l not in _reduced_before(region, a, l)
                for a in op.inputs if where[a] is not None)}
    where[op.out] = target(deps)
    seq.append((Stmt("C", op.out), where[op.out]))
    if op.out in outs:
      seq.append((Stmt("S", op.out), target(vm[op.out].loops)))

  def build(loop):
    items = []
    for i, (s, w) in enumerate(seq):
      if w == loop:
        items.append((i, s))
    for l, p in parent.items():
      if p == loop:
        first = min((i for i, (s, w) in enumerate(seq) if w is not None and l in path(w)), default=len(seq))
        items.append((first, LoopNode(l, build(l))))
    items.sort(key=lambda x: x[0])
    return tuple(n for _, n in items)

  tiles = tuple((l.name, int(tiles.get(l.name, next_pow2(l.extent)))) for l in region.loops)
  return Plan(expr=TilingExpr(build(None)), grid=tuple(grid), tiles=tiles, num_warps=num_warps,
              num_stages=num_stages, split=split)


def _reduced_before(region: Region, v: str, loop: str) -> set:
  """{loop} when ``v`` depends on a reduction over ``loop`` (so ``v`` is complete only
  after that loop), else the empty set."""
  seen, stack = set(), [v]
  while stack:
    x = stack.pop()
    if x in seen:
      continue
    seen.add(x)
    op = region.producer(x)
    if op is None:
      continue
    if isinstance(op, Contraction) and loop in op.reduce or isinstance(op, Reduction) and op.loop == loop:
      return {loop}
    stack.extend(op.inputs)
  return set()


# The printer's intermediate program-id names (not a grid loop's).
_PID_TEMPS = ("pid_lpt", "pid_chunk", "pid_rest")


def issue_order(source: str, grid: Sequence[int], kernel_name: Optional[str] = None
                ) -> list[dict[str, int]]:
  """The grid positions a printed kernel's programs take, in the order the
  GPU issues them (axis 0 fastest): for each program, its ``pid_<loop>``
  (and ``part``) values, computed by running the kernel's program-id lines.

  Example::

      k = generate(attention(M=64, N=64, B=2, causal=True), plan)
      [p["pid_m"] for p in issue_order(k.source, k.grid)]
  """
  import itertools  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  if kernel_name is None:
    # The main kernel (named by ``kernel_name_for``) precedes a combine pass.
    kernel_name = re.search(r"^def (jaxfuse_\w+)\(", source, re.M).group(1)
  body = source.split(f"def {kernel_name}(", 1)[1].splitlines()[1:]
  lines = []
  from jaxfuse.codegen.triton_printer import GRID_WAIT_LINES  # pylint: disable=g-import-not-at-top
  wait = {l.strip() for l in GRID_WAIT_LINES}
  for line in body:
    stmt = line.strip()
    if stmt in wait:
      continue             # the grid dependency wait comes before the program ids
    if not stmt.startswith(("pid", "part")):
      break
    lines.append(stmt)
  code = compile("\n".join(lines), "<program ids>", "exec")
  out = []
  axes = [range(n) for n in grid]
  for idx in itertools.product(*reversed(axes)):   # the last axis slowest
    ids = tuple(reversed(idx))
    tl = types.SimpleNamespace(program_id=lambda a, ids=ids: ids[a], minimum=min, maximum=max)
    env = {"tl": tl}
    exec(code, env)  # pylint: disable=exec-used
    out.append({k: v for k, v in env.items()
                if (k == "part" or k.startswith("pid_")) and k not in _PID_TEMPS})
  return out

