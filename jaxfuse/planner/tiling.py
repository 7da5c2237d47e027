"""Tiling expressions (MCFuser III-A/B): loop structure and statement placement.

``mhnk`` is a deep tiling (each loop nested in the previous); ``mn(k,h)`` a
flat one (``k`` and ``h`` run one after the other inside ``n``); placed
statements print as ``mh(n(k(La,Lb,Cc),Ld,Ce),Se)``. When a loop name is
longer than one character, loops in a chain are separated by ``.``
(``m.hd(...)`` is not ambiguous then: ``m.hd``).

This module owns three things:

* the data structure (``Stmt``, ``LoopNode``, ``TilingExpr``) with its printed
  form and ``parse``;
* the enumeration of skeletons (bare loop structures) for ANY region:
  every permutation of the region's tiled loops (deep tilings) and every tree
  in which loops used by disjoint groups of ops run as sequential siblings
  (flat tilings), see ``enumerate_skeletons``;
* ``place``: the per-program expression the code generator prints, with
  Load/Compute/Store statements at the rightmost (innermost) related loop,
  grid loops removed, and loops of a single tile removed so that their
  statements hoist to the next enclosing loop they really depend on (the
  DAG-based hoisting of MCFuser Fig. 4(b)/5(b)).

Example::

    from jaxfuse.planner import tiling
    sk = tiling.parse("mhnk")
    expr = tiling.place(region, sk, {"m": 64, "n": 64, "k": 64, "h": 64}, grid=("m",))
    str(expr)   # 'h(n(k(La,Lb,Cc),Ld,Ce),Se)'
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

from absl import logging

from jaxfuse import ir

__all__ = [
    "Stmt", "LoopNode", "TilingExpr", "Node", "PlacementError", "parse",
    "batch_loops", "free_spatial_loops", "dot_loops", "scalar_dot_loops", "tiled_loops",
    "default_grid", "enumerate_skeletons", "strip_loops", "place",
    "streamable_loops", "statement_contexts", "reduced_by", "next_pow2",
    "loop_pieces", "pieced_loops", "piece_sizes", "shared_loads",
]


def next_pow2(x: int) -> int:
  """The smallest power of two >= ``x`` (1 for x <= 1): Triton blocks are
  powers of two, so every tile is one."""
  return 1 << max(int(x) - 1, 0).bit_length()


# A loop that stays in one tile but whose extent is not a power of two
# (head dims of 80) is printed as power-of-two pieces (64 + 16) instead of
# one tile padded to 128: every plan of Chimera G6/G9 and attention S6
# measured ran 3-12% faster, 27-32% where the output width is split on the
# grid (H100, 2026-11-22, benchmarks/RESULTS.md, twenty-third session).
# Pieces are >= MIN_PIECE (tl.dot's K); at most MAX_PIECES of them.
MIN_DOT_TILE = 16   # tl.dot's smallest M, N and K tile
MIN_PIECE = MIN_DOT_TILE
MAX_PIECES = 3
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def dot_roles(lhs: Iterable[str], rhs: Iterable[str], out: Iterable[str],
              reduced: Iterable[str], block: Mapping[str, int],
              dtypes: Sequence[str]) -> Optional[tuple[set, set, set, set]]:
  """The (batch, M, N, K) loop sets of a contraction the code generator
  prints as one ``tl.dot``, or None when it prints a broadcast product.

  ``lhs``, ``rhs``, ``out``: the loops of its operand and result tiles that
  are larger than 1; ``reduced``: its reduced loops larger than 1;
  ``block``: each loop's tile; ``dtypes``: the operands' dtypes. One place
  for the test, so that the planner's pieces rule (``pieced_loops``) and the
  printer agree on which contractions are dots.

  Example::

      dot_roles("mk", "kn", "mn", "k", {"m": 64, "n": 64, "k": 32},
                ("float16", "float16"))   # (set(), {"m"}, {"n"}, {"k"})
  """
  a, b, o, red = set(lhs), set(rhs), set(out), set(reduced)
  bat, m, n, k = a & b & o, (a & o) - b, (b & o) - a, a & b & red
  if (len(m) == 1 and len(n) == 1 and len(k) == 1 and len(bat) <= 1
      and red <= a & b and a == bat | m | k and b == bat | k | n
      and all(block[x] >= MIN_DOT_TILE for x in m | n | k)
      and all(dt in FLOAT_DTYPES for dt in dtypes)):
    return bat, m, n, k
  return None


def loop_pieces(extent: int) -> tuple[int, ...]:
  """Power-of-two pieces, largest first, that cover ``extent`` (the last one
  padded up to ``MIN_PIECE``), or ``()`` when pieces would not beat one
  padded tile (a power-of-two extent, more than ``MAX_PIECES`` pieces, or
  no padding saved).

  Example::

      loop_pieces(80)    # (64, 16)
      loop_pieces(208)   # (128, 64, 16)
      loop_pieces(64)    # ()
  """
  out, rest = [], int(extent)
  while rest > 0:
    p = max(MIN_PIECE, 1 << (rest.bit_length() - 1))
    out.append(p)
    rest -= p
  if len(out) < 2 or len(out) > MAX_PIECES or sum(out) >= next_pow2(extent):
    return ()
  return tuple(out)


def pieced_loops(region, block: Mapping[str, int], single: Iterable[str]
                 ) -> dict[str, tuple[int, ...]]:
  """The loops the code generator prints as pieces (``loop_pieces``), with
  their pieces. ``block``: each loop's printed (power-of-two) tile;
  ``single``: the loops held in one tile (neither program ids nor
  sequential). A loop qualifies when it is in ``single``, its tile is its
  padded extent, and it is a K dim only: every value along it is a region
  input that only contractions reducing it read, each printed as one
  ``tl.dot`` (one M, N and K loop of tile >= 16, at most one batch loop).
  Then a piece is one load and one ``tl.dot`` into the same accumulator,
  and nothing else sees the loop."""
  ext = region.loop_extents
  # The search asks for every candidate plan: most regions have no loop to
  # piece, and say so before the readers are collected.
  cands = {l: p for l in single if (p := loop_pieces(ext[l])) and block[l] == next_pow2(ext[l])}
  if not cands:
    return {}
  vm = region.value_map
  inputs = {b.value for b in region.inputs}
  outputs = {b.value for b in region.outputs}
  readers: dict[str, list] = {}
  for op in region.ops:
    for v in op.inputs:
      readers.setdefault(v, []).append(op)

  def blocked(v):
    return {l for l in vm[v].loops if block[l] > 1}

  def one_dot(op, l) -> bool:
    roles = dot_roles(blocked(op.lhs), blocked(op.rhs), blocked(op.out),
                      [x for x in op.reduce if block[x] > 1], block,
                      (vm[op.lhs].dtype, vm[op.rhs].dtype))
    return roles is not None and roles[3] == {l}

  out = {}
  for l, pieces in cands.items():
    along = [v.name for v in region.values if l in v.loops]
    if all(v in inputs and v not in outputs and readers.get(v)
           and all(isinstance(op, ir.Contraction) and l in op.reduce and one_dot(op, l)
                   for op in readers[v])
           for v in along):
      out[l] = pieces
  return out


def piece_sizes(region, expr: "TilingExpr", tiles: Mapping[str, int],
                grid: Sequence[str]) -> dict[str, int]:
  """``tiles`` with each loop the code generator prints as pieces
  (``pieced_loops``) at the pieces' total: the work, registers and shared
  memory the printed kernel has for it (80 for 64 + 16, not 128)."""
  ext = region.loop_extents
  seq = set(expr.loops())
  single = [l for l in ext if l not in seq and l not in grid]
  block = {l: (min(next_pow2(tiles[l]), next_pow2(ext[l])) if l in single
               else next_pow2(tiles[l])) for l in ext}
  sized = dict(tiles)
  for l, pieces in pieced_loops(region, block, single).items():
    sized[l] = sum(pieces)
  return sized


class PlacementError(ValueError):
  """A skeleton/tile/grid combination that no correct kernel realises."""


class _Node:
  """Pickles a node without what it caches (``_cached_hash``,
  ``statement_contexts``, the text): string hashes differ between
  processes, and the rest is derived."""

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclasses.dataclass(frozen=True)
class Stmt:
  """A Load ('L'), Compute ('C') or Store ('S') of the named IR value."""
  kind: str
  value: str

  def __post_init__(self):
    if self.kind not in ("L", "C", "S"):
      raise ValueError(f"statement kind must be L, C or S, got {self.kind!r}")

  def __str__(self) -> str:
    return f"{self.kind}{self.value}"


def _cached_hash(node, fields: tuple) -> int:
  """``hash(fields)``, kept on the frozen ``node``: the planner keys dicts
  by whole expressions thousands of times per region, and the generated
  hash walks the tree each time. ``_Node.__getstate__`` leaves it out of
  pickles (string hashes differ between processes)."""
  h = node.__dict__.get("_hash")
  if h is None:
    h = hash(fields)
    object.__setattr__(node, "_hash", h)
  return h


@dataclasses.dataclass(frozen=True)
class LoopNode(_Node):
  """A sequential loop over tiles of ``loop``; ``body`` runs in order."""
  loop: str
  body: tuple["Node", ...] = ()

  def __hash__(self) -> int:
    return _cached_hash(self, (self.loop, self.body))


Node = Union[LoopNode, Stmt]


def _fmt_body(body: tuple[Node, ...], sep: str) -> str:
  if len(body) == 1 and isinstance(body[0], LoopNode):
    return _fmt_node(body[0], sep)
  return "(" + ",".join(_fmt_node(n, sep) for n in body) + ")"


def _fmt_node(node: Node, sep: str) -> str:
  if isinstance(node, Stmt):
    return str(node)
  if not node.body:
    return node.loop
  return node.loop + sep + _fmt_body(node.body, sep)


@dataclasses.dataclass(frozen=True)
class TilingExpr(_Node):
  """A scope of nodes (the per-program body, or a whole expression)."""
  body: tuple[Node, ...] = ()

  def __hash__(self) -> int:
    return _cached_hash(self, self.body)

  def __str__(self) -> str:
    # Cached: the search sorts and deduplicates plans by their text,
    # thousands of times per region.
    text = self.__dict__.get("_text")
    if text is None:
      multi = any(len(l) > 1 for l in self.loops())
      sep = "." if multi else ""
      if len(self.body) == 1:
        text = _fmt_node(self.body[0], sep)
      elif not self.body:
        text = "()"
      else:
        text = "(" + ",".join(_fmt_node(n, sep) for n in self.body) + ")"
      object.__setattr__(self, "_text", text)
    return text

  def loops(self) -> list[str]:
    """Loop names in pre-order."""
    got = self.__dict__.get("_loops")
    if got is None:
      out: list[str] = []
      stack = list(reversed(self.body))
      while stack:
        n = stack.pop()
        if isinstance(n, LoopNode):
          out.append(n.loop)
          stack.extend(reversed(n.body))
      got = tuple(out)
      object.__setattr__(self, "_loops", got)
    return list(got)

  def statements(self) -> list[Stmt]:
    """Statements in program order."""
    return [s for s, _ in statement_contexts(self)]

  def is_deep(self) -> bool:
    """True when every scope holds at most one loop (a single chain)."""
    stack = [self.body]
    while stack:
      loops = [n for n in stack.pop() if isinstance(n, LoopNode)]
      if len(loops) > 1:
        return False
      stack.extend(l.body for l in loops)
    return True


def statement_contexts(expr: TilingExpr) -> list[tuple[Stmt, tuple[str, ...]]]:
  """Each statement with the loops that enclose it (outermost first)."""
  # Cached on the expression: the model reads a placed plan's statements
  # several times per prediction, and the search predicts one placement
  # under many tiles.
  got = expr.__dict__.get("_contexts")
  if got is None:
    out: list[tuple[Stmt, tuple[str, ...]]] = []
    stack = [(n, ()) for n in reversed(expr.body)]
    while stack:
      n, enclosing = stack.pop()
      if isinstance(n, Stmt):
        out.append((n, enclosing))
      else:
        inner = enclosing + (n.loop,)
        stack.extend((c, inner) for c in reversed(n.body))
    got = tuple(out)
    object.__setattr__(expr, "_contexts", got)
  return list(got)


def shared_loads(region, expr: TilingExpr, tiles: Mapping[str, int]
                 ) -> dict[str, tuple[str, dict[str, str]]]:
  """The loads a plan issues once for two inputs: input ``v`` -> ``(u,
  loops)``, an earlier input ``u`` of the same array
  (``ir.Region.same_array``) whose tile the kernel already holds, and the
  map from ``v``'s loops to ``u``'s: ``v``'s tile is ``u``'s.

  Where: ``u``'s Load comes before ``v``'s in the same loop body, and the
  two buffers address the same elements. Their loops pair up by stride
  (each loop of either value indexes the array); a pair is one loop, or two
  loops the plan keeps whole (neither a grid nor a sequential loop) of one
  power-of-two extent of at least 16, so that both print as
  ``tl.arange(0, extent)`` without masks or pieces. Autodiff's attention
  backward reads ``q`` as ``q[n,k]`` for ``q.k^T`` and as ``q[n,h]`` for
  ``ds^T.q``: one tile in the key loop, not two (H100, eightieth session:
  the dk+dv kernel ran 944.6 us with both loads, 890.5 us with one).

  The code generator prints the one load (``triton_printer``); the model
  counts its bytes and shared memory once (``movement``, ``pruning``)."""
  again = region._same_array  # pylint: disable=protected-access
  if not again:
    return {}
  # Tiles matter only through which loops are whole: memoized on that,
  # since the model asks several times per prediction.
  key = ("shared_loads", expr,
         tuple(l for l, e in region._extents.items() if tiles.get(l) == e))  # pylint: disable=protected-access
  got = region.plan_memo.get(key)
  if got is None:
    got = region.plan_memo[key] = _shared_loads(region, expr, tiles, again)
  return dict(got)


def _shared_loads(region, expr: TilingExpr, tiles: Mapping[str, int],
                  again: Mapping[str, str]) -> dict[str, tuple[str, dict[str, str]]]:
  """``shared_loads`` where some inputs are views of one array (``again``:
  ``ir.Region.same_array``)."""
  ext = region.loop_extents
  seq = set(expr.loops())
  bufs = {b.value: b for b in region.inputs}
  vm = region.value_map

  def whole(l):
    return (l not in seq and tiles[l] == ext[l] and ext[l] >= 16
            and ext[l] & (ext[l] - 1) == 0)

  def by_stride(v):
    b = bufs[v]
    st = {l: b.stride(l) for l in vm[v].loops}
    if 0 in st.values() or len(set(st.values())) != len(st):
      return None
    return {s: l for l, s in st.items()}

  def pairing(u, v):
    su, sv = by_stride(u), by_stride(v)
    if su is None or sv is None or su.keys() != sv.keys():
      return None
    pairs = {sv[s]: su[s] for s in sv}
    if all(lv == lu or (whole(lv) and whole(lu) and ext[lv] == ext[lu])
           for lv, lu in pairs.items()):
      return pairs
    return None

  out: dict[str, tuple[str, dict[str, str]]] = {}

  def walk(body):
    loaded: list[str] = []
    for n in body:
      if isinstance(n, LoopNode):
        walk(n.body)
      elif n.kind == "L" and n.value in bufs:
        root = again.get(n.value, n.value)
        for u in loaded:
          if again.get(u, u) == root and u not in out:
            pairs = pairing(u, n.value)
            if pairs is not None:
              out[n.value] = (u, pairs)
              break
        loaded.append(n.value)
  walk(expr.body)
  return out


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------

class _Parser:
  """Recursive descent over the printed form.

  ``item := stmt | chain``; ``chain := loop [sep] [chain | '(' item,... ')']``;
  ``stmt := ('L'|'C'|'S') value``. Without ``.`` separators loop names are
  single characters (the papers' notation); statements start with an
  upper-case L, C or S, so loops must not.
  """

  def __init__(self, text: str, loops: Optional[Iterable[str]]):
    self.s = text.replace(" ", "")
    self.i = 0
    self.loops = set(loops) if loops is not None else None
    self.dotted = "." in self.s

  def peek(self) -> str:
    return self.s[self.i] if self.i < len(self.s) else ""

  def expect(self, ch: str) -> None:
    if self.peek() != ch:
      raise ValueError(f"tiling expression {self.s!r}: expected {ch!r} at {self.i}")
    self.i += 1

  def ident(self) -> str:
    j = self.i
    while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] == "_"):
      self.i += 1
    if j == self.i:
      raise ValueError(f"tiling expression {self.s!r}: expected a name at {j}")
    return self.s[j:self.i]

  def items(self) -> tuple[Node, ...]:
    self.expect("(")
    out: list[Node] = []
    if self.peek() == ")":
      self.i += 1
      return ()
    while True:
      out.append(self.item())
      if self.peek() == ",":
        self.i += 1
        continue
      self.expect(")")
      return tuple(out)

  def item(self) -> Node:
    c = self.peek()
    if c in ("L", "C", "S") and (self.loops is None or c not in self.loops):
      self.i += 1
      return Stmt(c, self.ident())
    return self.chain()

  def loop_name(self) -> str:
    if self.dotted:
      j = self.i
      while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] == "_"):
        self.i += 1
      name = self.s[j:self.i]
      if not name:
        raise ValueError(f"tiling expression {self.s!r}: expected a loop at {j}")
    else:
      name = self.s[self.i]
      if not (name.isalnum() or name == "_"):
        raise ValueError(f"tiling expression {self.s!r}: expected a loop at {self.i}")
      self.i += 1
    if self.loops is not None and name not in self.loops:
      raise ValueError(f"tiling expression {self.s!r}: unknown loop {name!r}")
    return name

  def chain(self) -> LoopNode:
    name = self.loop_name()
    c = self.peek()
    if c == ".":
      self.i += 1
      c = self.peek()
    if c == "(":
      return LoopNode(name, self.items())
    if c in ("", ",", ")"):
      return LoopNode(name, ())
    if c in ("L", "C", "S") and (self.loops is None or c not in self.loops):
      # 'kLa' is not a form the printer makes; statements need parentheses.
      raise ValueError(f"tiling expression {self.s!r}: statement without "
                       f"parentheses at {self.i}")
    return LoopNode(name, (self.chain(),))


def parse(text: str, loops: Optional[Iterable[str]] = None) -> TilingExpr:
  """Parses the printed form: ``parse('mn(k,h)')``, ``parse('m.hd(n,k)')``.

  ``loops`` (optional) is the set of valid loop names, checked when given.
  ``str(parse(s)) == s`` for every string the printer makes.
  """
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"tiling expression must be a non-empty string, got {text!r}")
  p = _Parser(text, loops)
  if p.peek() == "(":
    body = p.items()
  else:
    body = (p.item(),)
  if p.i != len(p.s):
    raise ValueError(f"tiling expression {text!r}: trailing text at {p.i}")
  return TilingExpr(body)


# --------------------------------------------------------------------------
# Loop roles
# --------------------------------------------------------------------------

def reduced_by(op) -> tuple[str, ...]:
  """The loops an op reduces (contraction axes or the reduction's loop)."""
  if isinstance(op, ir.Contraction):
    return tuple(op.reduce)
  if isinstance(op, ir.Reduction):
    return (op.loop,)
  return ()


def batch_loops(region) -> tuple[str, ...]:
  """Loops that index both operands and the result of every contraction and
  that nothing reduces (batch and head dims). They are not ``tl.dot`` dims:
  they always bind to program ids with tile 1 and take no part in tiling
  expressions (MCFuser's chain has four loops, not five). A region's part
  loop (``ir.Region.part_loop``) is one too: each program reads one part."""
  contr = region.contractions
  if not contr:
    return ()
  red = region.reduced_loops()
  out = []
  for l in region.loops:
    name = l.name
    if name in red:
      continue
    if name == region.part_loop or all(
        name in region.value(op.lhs).loops and name in region.value(op.rhs).loops
        and name in region.value(op.out).loops for op in contr):
      out.append(name)
  return tuple(out)


# A loop this short is always one tile (tl.dot tiles are >= 16), so where
# it would sit in an expression never matters: leaving it out of the
# enumeration keeps a region with many short loops (heads of size 1, a
# split of 2) from multiplying the space by their factorial.
_ALWAYS_ONE_TILE = 16


def tiled_loops(region) -> tuple[str, ...]:
  """The loops that tiling expressions order (all but the batch loops and
  loops short enough to be one tile at every candidate size)."""
  b = set(batch_loops(region))
  return tuple(l.name for l in region.loops
               if l.name not in b and l.extent > _ALWAYS_ONE_TILE)


def dot_loops(region) -> tuple[str, ...]:
  """Loops that are an M, N or K dim of some ``tl.dot`` (tiles >= 16)."""
  b = set(batch_loops(region))
  out = set()
  for op in region.contractions:
    for v in (op.lhs, op.rhs, op.out):
      out.update(l for l in region.value(v).loops if l not in b)
  return tuple(l.name for l in region.loops if l.name in out)


def scalar_dot_loops(region) -> tuple[str, ...]:
  """Dot loops that may take a tile of 1 and bind to program ids, each
  program then reading one index of them, as of a batch loop.

  A loop qualifies when no op reduces it and, in every contraction it is an
  M (or N) loop of, a longer loop of at least ``MIN_DOT_TILE`` shares that
  role (of two as long, the first in region order), so the contraction
  stays one ``tl.dot`` over it: the longest loop of a role never takes a
  tile of one. Why:
  grouped-query attention (``jax.nn.dot_product_attention`` with fewer key
  and value heads than query heads) has two M loops, the query tokens and
  the query heads of a key head (4 for 32 heads over 8). Both tiled, its
  first contraction was a broadcast product, and with a head group of 4
  padded to 16 rows every plan lost to XLA."""
  b = set(batch_loops(region))
  red = set(region.reduced_loops())
  ext = region.loop_extents
  rank = {x.name: (x.extent, -i) for i, x in enumerate(region.loops)}
  out = []
  for l in dot_loops(region):
    if l in red or ext[l] == 1:
      continue
    ok, seen = True, False
    for op in region.contractions:
      lhs, rhs = set(region.value(op.lhs).loops) - b, set(region.value(op.rhs).loops) - b
      res = set(region.value(op.out).loops) - b
      for side, other in ((lhs, rhs), (rhs, lhs)):
        role = (side & res) - other
        if l in role:
          seen = True
          ok = ok and any(ext[x] >= MIN_DOT_TILE and rank[x] > rank[l] for x in role)
    if seen and ok:
      out.append(l)
  return tuple(out)


def free_spatial_loops(region) -> tuple[str, ...]:
  """Spatial loops (of the outputs, never reduced) that every contraction
  iterates: binding them to program ids recomputes nothing (``m`` of the
  GEMM chain). Other spatial loops (``h``) bind only with recomputation of
  the producers' tiles."""
  spatial = region.spatial_loops()
  b = set(batch_loops(region))
  contr = region.contractions
  return tuple(l for l in spatial if l not in b and all(
      l in region.op_loops(op) for op in contr))


def default_grid(region) -> tuple[str, ...]:
  """Batch loops then the free spatial loops, in region loop order."""
  g = set(batch_loops(region)) | set(free_spatial_loops(region))
  return tuple(l.name for l in region.loops if l.name in g)


def streamable_loops(region) -> frozenset[str]:
  """Loops along which a reduction may run online (streaming softmax).

  Asked of ``jaxfuse.codegen.streaming.analyze(region)`` (written by the
  code generator, which must implement what it declares); when that module
  is absent or fails, no loop is streamable, which keeps such loops in a
  single tile: conservative, never wrong.
  """
  try:
    from jaxfuse.codegen import streaming  # pylint: disable=import-outside-toplevel
  except Exception:  # pylint: disable=broad-except
    return frozenset()
  try:
    res = streaming.analyze(region)
  except Exception as e:  # pylint: disable=broad-except
    logging.info("jaxfuse planner: streaming.analyze failed (%s); no streaming", e)
    return frozenset()
  return _streamable_from(res)


def masked_tile_relations(region) -> dict:
  """Streamed loop -> ``streaming.Band`` where the code generator skips the
  loop's tiles whose indices all fall outside the band (a causal mask or a
  sliding window hides them; ``jaxfuse.codegen.streaming.masked_tile_relation``).
  Empty when the code generator's analysis is absent or fails, which
  prices every tile: conservative, never wrong."""
  try:
    from jaxfuse.codegen import streaming  # pylint: disable=import-outside-toplevel
    return dict(streaming.masked_tile_relations(region))
  except Exception as e:  # pylint: disable=broad-except
    logging.info("jaxfuse planner: masked tiles unknown (%s); every tile priced", e)
    return {}


def _streamable_from(res) -> frozenset[str]:
  if res is None:
    return frozenset()
  for attr in ("streamable_loops", "streamable", "loops"):
    if hasattr(res, attr) and not callable(getattr(res, attr)):
      return _streamable_from(getattr(res, attr))
  if isinstance(res, Mapping):
    return frozenset(str(k) for k, v in res.items() if v)
  if isinstance(res, str):
    return frozenset((res,))
  try:
    return frozenset(str(x) for x in res)
  except TypeError:
    return frozenset()


# --------------------------------------------------------------------------
# Enumeration of skeletons (MCFuser III-A, generalised to any region)
# --------------------------------------------------------------------------

def enumerate_skeletons(region, loops: Optional[Sequence[str]] = None, *,
                        flat: bool = True, limit: int = 5040) -> list[TilingExpr]:
  """All deep and flat tiling expressions over ``loops`` (default: the
  region's tiled loops), deep ones first, in a deterministic order.

  A scope either nests one loop (deep step) or, when the ops that still have
  loops to iterate split into groups that share no loop, runs one subtree
  per group sequentially, producers first (flat step; MCFuser's ``mn(k,h)``).
  For the GEMM chain this gives 4! = 24 deep and 2 flat expressions.
  """
  loops = tuple(loops) if loops is not None else tiled_loops(region)
  order = [l.name for l in region.loops]
  ops = list(region.ops)
  op_loops = [set(region.op_loops(op)) for op in ops]
  idx = {op.out: i for i, op in enumerate(ops)}
  # deps[i]: ops that op i depends on (transitively), for sequential order.
  deps: list[set[int]] = []
  for i, op in enumerate(ops):
    d = set()
    for a in op.inputs:
      if a in idx:
        d.add(idx[a])
        d |= deps[idx[a]]
    deps.append(d)

  out: list[TilingExpr] = []

  # _components of each loop set: gen reaches one set from many prefixes.
  components: dict[frozenset[str], list] = {}

  def gen(ls: frozenset[str]) -> Iterator[tuple[tuple[Node, ...], bool]]:
    """(body, whether it is deep: ``TilingExpr.is_deep``) over ``ls``."""
    if not ls:
      yield (), True
      return
    for l in sorted(ls, key=order.index):
      for sub, deep in gen(ls - {l}):
        yield (LoopNode(l, sub),), deep
    if not flat:
      return
    groups = components.get(ls)
    if groups is None:
      groups = components[ls] = _components(ls, op_loops)
    if len(groups) < 2:
      return
    for perm in itertools.permutations(range(len(groups))):
      if not _respects(perm, groups, deps):
        continue
      subs = [[body for body, _ in gen(frozenset(groups[g][0]))] for g in perm]
      for combo in itertools.product(*subs):
        # two or more loops side by side at this scope
        yield tuple(itertools.chain.from_iterable(combo)), False

  deep: list[TilingExpr] = []
  flats: list[TilingExpr] = []
  for body, is_deep in gen(frozenset(loops)):
    (deep if is_deep else flats).append(TilingExpr(body))
    if len(deep) + len(flats) >= limit:
      logging.info("jaxfuse planner: tiling expressions capped at %d", limit)
      break
  return deep + flats


def _components(ls: frozenset[str], op_loops: list[set[str]]):
  """Groups of ops connected by shared loops within ``ls``: [(loops, ops)]."""
  parent: dict[int, int] = {}

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  rel = {i: s & ls for i, s in enumerate(op_loops) if s & ls}
  for i in rel:
    parent[i] = i
  owner: dict[str, int] = {}
  for i, s in rel.items():
    for l in s:
      if l in owner:
        parent[find(i)] = find(owner[l])
      else:
        owner[l] = i
  groups: dict[int, tuple[set[str], set[int]]] = {}
  for i, s in rel.items():
    g = groups.setdefault(find(i), (set(), set()))
    g[0].update(s)
    g[1].add(i)
  return sorted(groups.values(), key=lambda g: min(g[1]))


def _respects(perm, groups, deps) -> bool:
  seen: set[int] = set()
  for g in perm:
    ops = groups[g][1]
    for i in ops:
      for d in deps[i]:
        for h, (_, other) in enumerate(groups):
          if d in other and h != g and h not in seen:
            return False
    seen.add(g)
  return True


def strip_loops(expr: TilingExpr, drop: Iterable[str]) -> TilingExpr:
  """Removes loop nodes in ``drop``, splicing their bodies into the parent."""
  return TilingExpr(_strip(expr.body, frozenset(drop)))


def _strip(nodes: tuple[Node, ...], drop: frozenset) -> tuple[Node, ...]:
  # A module function, not a recursive closure (a closure's reference to
  # itself is a cycle only the collector frees; Rule 1 strips thousands).
  out: list[Node] = []
  changed = False
  for n in nodes:
    if isinstance(n, LoopNode):
      body = _strip(n.body, drop)
      if n.loop in drop:
        out.extend(body)
        changed = True
      elif body is n.body:
        out.append(n)
      else:
        out.append(LoopNode(n.loop, body))
        changed = True
    else:
      out.append(n)
  # Unchanged subtrees are kept, with their cached hashes (Rule 1 strips
  # each placement once per grid and keys a dict by the result).
  return tuple(out) if changed else nodes


# --------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------

class _T:
  """Mutable tree node used while placing."""
  __slots__ = ("loop", "children", "parent", "depth", "items")

  def __init__(self, loop, parent):
    self.loop = loop
    self.parent = parent
    self.depth = 0 if parent is None else parent.depth + 1
    self.children: list[_T] = []
    self.items: list = []  # (key, Stmt) for statements, (key, _T) for loops

  def ancestors(self) -> list["_T"]:
    """Self and enclosing loop nodes (not the root), innermost first."""
    out, n = [], self
    while n is not None and n.loop is not None:
      out.append(n)
      n = n.parent
    return out


def single_tile_loops(region, tiles: Mapping[str, int],
                      split: Optional[tuple[str, int]] = None) -> frozenset[str]:
  """Loops that ``tiles`` cover in one tile (a split loop never is one).

  ``place`` reads ``tiles`` only through this set, so it is part of
  ``placement_key``."""
  ext = region.loop_extents
  split_loop = split[0] if split else None
  return frozenset(l for l in ext if int(tiles[l]) >= ext[l] and l != split_loop)


def place(region, skeleton: Union[TilingExpr, str], tiles: Mapping[str, int],
          grid: Optional[Sequence[str]] = None, *,
          streamable: Optional[Iterable[str]] = None,
          split: Optional[tuple[str, int]] = None) -> TilingExpr:
  """The per-program expression for ``skeleton`` at ``tiles``.

  ``grid`` loops (default ``default_grid(region)``) bind to program ids and
  leave the expression; loops with one tile (tile >= extent) leave it too,
  so every statement hoists to the innermost remaining loop it depends on.
  Compute statements sit at the innermost loop of their op; a Load of an
  input at the innermost loop indexing that input on its consumer's path;
  the Store of an output just after the scope in which the output is
  complete. ``split=(loop, parts)`` keeps ``loop`` a sequential loop (each
  program runs its share of it; codegen adds the second pass).

  Raises ``PlacementError`` (with the reason) when no correct kernel has
  this structure: a consumer inside a loop its producer still reduces
  (unless the loop is streamable), several tiles of a value needed at once
  (MCFuser Rule 2), loops of one op not nested, or statements out of order.

  Example::

      place(chain, "mhnk", {"m": 64, "n": 64, "k": 512, "h": 64}, grid=("m",))
      # K=512 fits one tile: -> (La,h(n(Lb,Cc,Ld,Ce),Se)), A loads once per program
  """
  sk, grid, _ = _placement_input(region, skeleton, tiles, grid, split)
  stream = frozenset(streamable_loops(region) if streamable is None else streamable)
  return _place_stripped(region, sk, stream)


def placement_key(region, skeleton: Union[TilingExpr, str], tiles: Mapping[str, int],
                  grid: Optional[Sequence[str]] = None,
                  split: Optional[tuple[str, int]] = None) -> tuple:
  """What ``place``'s expression depends on besides the region and its
  streamable loops: the skeleton with the grid's and the single-tile loops
  stripped, the grid, those single-tile loops and the split. Raises what
  ``place`` raises before it places (a loop with no place, a duplicate
  loop, bad tiles or grid), so a memo keyed by it rejects each candidate
  for its own reason. Why: skeletons that differ only where their grid and
  single-tile loops sit place alike (a search of a merged dk+dv region
  placed 856 keys of ``single_tile_loops`` that were 210 of these).

  Example::

      key = placement_key(chain, "mhnk", {"m": 64, "n": 64, "k": 512, "h": 64}, ("m",))
  """
  sk, grid, single = _placement_input(region, skeleton, tiles, grid, split)
  return (str(sk), grid, single, split)


def _placement_input(region, skeleton, tiles, grid, split):
  """``place``'s checks of the skeleton, the tiles and the grid; returns
  (the skeleton with the grid's and the single-tile loops stripped, the
  grid, the single-tile loops)."""
  if isinstance(skeleton, str):
    skeleton = parse(skeleton, [l.name for l in region.loops])
  ext = region.loop_extents
  missing = [l for l in ext if l not in tiles]
  if missing:
    raise ValueError(f"tiles: no tile for loop(s) {missing}")
  for l, t in tiles.items():
    if l in ext and (int(t) < 1):
      raise ValueError(f"tiles: tile of {l} must be >= 1, got {t}")
  grid = tuple(default_grid(region) if grid is None else grid)
  for g in grid:
    if g not in ext:
      raise ValueError(f"grid: unknown loop {g!r}")
  red_all = region.reduced_loops()
  bad = [g for g in grid if g in red_all]
  if bad:
    raise PlacementError(f"grid loop(s) {bad} are reduced; only spatial loops "
                         "bind to program ids (use split for reductions)")
  in_skel = skeleton.loops()
  dup = {l for l in in_skel if in_skel.count(l) > 1}
  if dup:
    raise PlacementError(f"loop(s) {sorted(dup)} appear twice in {skeleton}")
  single = single_tile_loops(region, tiles, split)
  for l in ext:
    if l not in grid and l not in single and l not in in_skel:
      raise PlacementError(f"loop {l} has {math.ceil(ext[l] / tiles[l])} tiles "
                           f"but no place in {skeleton} or the grid")
  return strip_loops(skeleton, set(grid) | single), grid, single


def _place_stripped(region, sk: TilingExpr, stream: frozenset[str]) -> TilingExpr:
  """``place`` from its stripped skeleton on."""
  # Build the mutable tree.
  root = _T(None, None)
  nodes: dict[str, _T] = {}

  def build(body, parent):
    for n in body:
      if isinstance(n, LoopNode):
        t = _T(n.loop, parent)
        parent.children.append(t)
        nodes[n.loop] = t
        build(n.body, t)
  build(sk.body, root)

  ops = list(region.ops)
  idx = {op.out: i for i, op in enumerate(ops)}
  vm = region.value_map

  # Compute anchors.
  anchor: dict[str, _T] = {}
  for op in ops:
    rel = [nodes[l] for l in region.op_loops(op) if l in nodes]
    if not rel:
      anchor[op.out] = root
      continue
    deepest = max(rel, key=lambda t: t.depth)
    chain = set(map(id, deepest.ancestors()))
    for t in rel:
      if id(t) not in chain:
        raise PlacementError(f"op {op.out}: loops {t.loop} and {deepest.loop} "
                             "are not nested")
    anchor[op.out] = deepest

  def anc(name: str) -> set[str]:
    return {t.loop for t in anchor[name].ancestors()}

  # Dependence checks (producer Y -> consumer X).
  for op in ops:
    ax = anc(op.out)
    for y in op.inputs:
      if y not in idx:
        continue
      ay = anc(y)
      for r in reduced_by(ops[idx[y]]):
        if r in ay and r in ax and r not in stream:
          raise PlacementError(
              f"{op.out} uses {y} inside loop {r} while {y} is still being "
              f"reduced over {r} ({r} is not streamable)")
      for l in ay - ax:
        if l in vm[y].loops:
          raise PlacementError(
              f"{op.out} needs every tile of {y} along {l} at once "
              "(several partial tiles on chip; MCFuser Rule 2)")

  # Stores.
  store_scope: dict[str, _T] = {}
  for b in region.outputs:
    y = b.value
    a = anchor[y]
    reds = [t for t in a.ancestors() if t.loop in reduced_by(ops[idx[y]])]
    scope = min(reds, key=lambda t: t.depth).parent if reds else a
    for t in a.ancestors():
      if t.depth > scope.depth and t.loop in vm[y].loops:
        raise PlacementError(
            f"output {y} is complete only outside loop "
            f"{min(reds, key=lambda t: t.depth).loop} but has several tiles "
            f"along {t.loop} inside it (MCFuser Rule 2)")
    store_scope[y] = scope

  # Minimum op index under each node (for ordering).
  sub_min: dict[int, float] = {}

  def fill_min(t: _T) -> float:
    m = math.inf
    for c in t.children:
      m = min(m, fill_min(c))
    for op in ops:
      if anchor[op.out] is t:
        m = min(m, idx[op.out])
    sub_min[id(t)] = m
    return m
  fill_min(root)

  def sub_min_of(t: _T) -> float:
    return sub_min[id(t)]

  # Loads: one per (input, target scope).
  loads: dict[tuple[str, int], tuple[_T, int]] = {}
  for b in region.inputs:
    x = b.value
    xl = set(b.loops) | set(vm[x].loops)
    for op in ops:
      if x not in op.inputs:
        continue
      a = anchor[op.out]
      cand = [t for t in a.ancestors() if t.loop in xl]
      target = max(cand, key=lambda t: t.depth) if cand else root
      # The load goes before the child of ``target`` that holds the consumer.
      first: float = idx[op.out]
      child = a
      while child is not target and child.parent is not target:
        child = child.parent
      if child is not target:
        first = min(first, sub_min_of(child))
      key = (x, id(target))
      if key in loads:
        loads[key] = (target, min(loads[key][1], first))
      else:
        loads[key] = (target, first)

  for c in _all_nodes(root):
    for ch in c.children:
      c.items.append(((sub_min[id(ch)], 1, 0), ch))
  for op in ops:
    anchor[op.out].items.append(((idx[op.out], 1, 1), Stmt("C", op.out)))
  for (x, _), (t, first) in loads.items():
    t.items.append(((first, 0, 0), Stmt("L", x)))
  for y, t in store_scope.items():
    t.items.append(((idx[y], 2, 0), Stmt("S", y)))

  deferred = _deferred_pairs(region) if stream else frozenset()

  subtree_defs_uses: dict[int, tuple[set[str], set[str]]] = {}

  def defs_uses(it) -> tuple[set[str], set[str]]:
    """Values an item (statement or loop subtree) defines and reads."""
    if isinstance(it, Stmt):
      if it.kind == "C":
        op = ops[idx[it.value]]
        return {it.value}, {a for a in op.inputs if (it.value, a) not in deferred}
      return ({it.value}, set()) if it.kind == "L" else (set(), {it.value})
    got = subtree_defs_uses.get(id(it))
    if got is None:
      d, u = set(), set()
      for _, sub in it.items:
        sd, su = defs_uses(sub)
        d |= sd
        u |= su
      got = subtree_defs_uses[id(it)] = (d, u - d)
    return got

  def emit(t: _T) -> tuple[Node, ...]:
    # Op-index order, except that an item never precedes one that defines a
    # value it reads (an iota or scale at this scope feeding a loop below):
    # each step takes the first pending item that no other pending item
    # defines a value for (``defined`` counts the pending definers).
    pending = sorted(t.items, key=lambda p: p[0])
    info = [defs_uses(it) for _, it in pending]
    defined: dict[str, int] = {}
    for d, _ in info:
      for v in d:
        defined[v] = defined.get(v, 0) + 1
    out: list[Node] = []
    while pending:
      pick = 0
      for i, (d, u) in enumerate(info):
        if all(defined.get(v, 0) - (v in d) == 0 for v in u):
          pick = i
          break
      _, it = pending.pop(pick)
      for v in info.pop(pick)[0]:
        defined[v] -= 1
      if isinstance(it, Stmt):
        out.append(it)
      else:
        out.append(LoopNode(it.loop, emit(it)))
    return tuple(out)

  expr = TilingExpr(emit(root))
  _check_order(region, expr, deferred)
  return expr


def _deferred_pairs(region) -> frozenset[tuple[str, str]]:
  """(value, factor) pairs where the streaming analysis defers ``factor``
  (the softmax denominator) past the loop: inside the loop ``value`` is its
  operand's tile, so it may be computed before ``factor`` exists."""
  try:
    from jaxfuse.codegen import streaming  # pylint: disable=import-outside-toplevel
    info = streaming.analyze(region)
  except Exception:  # pylint: disable=broad-except
    return frozenset()
  pairs = set()
  for st in info.streamed.values():
    for v, _ in st.deferred:
      sc = st.scale_of(v)
      factors = [factor for _, factor in (sc.deferred if sc else ())]
      pairs.update((v, factor) for factor in factors)
      # The factors' own producers after the loop (a convert of the sum, ...)
      # may follow the deferred value too. Other post values, such as an
      # epilogue of the P.V accumulator (``o * mask``, ``o + x``), read the
      # result and so must come after it.
      pairs.update((v, p) for p in st.post if region.computed_from(factors, p))
  return frozenset(pairs)


def _all_nodes(root: _T) -> list[_T]:
  out, stack = [], [root]
  while stack:
    t = stack.pop()
    out.append(t)
    stack.extend(t.children)
  return out


def _check_order(region, expr: TilingExpr,
                 deferred: frozenset[tuple[str, str]] = frozenset()) -> None:
  """Every statement's operands are produced earlier in program order
  (except factors the streaming analysis defers past their loop)."""
  inputs = set(region.input_names)
  # A contraction of a deferred value (the softmax numerator feeding P.V)
  # is final only once the deferred factors exist: the kernel divides its
  # accumulator by them when the streamed loop closes. Nothing may read or
  # store it before them (a denominator placed after an outer loop of
  # output tiles, past the store, made plans no kernel could follow).
  finals: dict[str, set[str]] = {}
  for op in region.ops:
    for v, f in deferred:
      if v in op.inputs and v != op.out:
        finals.setdefault(op.out, set()).add(f)
  seen: set[str] = set()
  loaded: set[str] = set()
  for st, _ in statement_contexts(expr):
    if st.kind == "L":
      loaded.add(st.value)
    elif st.kind == "C":
      op = region.producer(st.value)
      for a in op.inputs:
        if a in inputs and a not in loaded:
          raise PlacementError(f"C{st.value} before L{a}")
        if a not in inputs and a not in seen and (st.value, a) not in deferred:
          raise PlacementError(f"C{st.value} before C{a} in {expr}")
        late = finals.get(a, set()) - seen
        if late:
          raise PlacementError(f"C{st.value} reads {a} before its deferred factor(s) "
                               f"{sorted(late)} in {expr}")
      seen.add(st.value)
    elif st.value not in seen:
      raise PlacementError(f"S{st.value} before C{st.value}")
    elif finals.get(st.value, set()) - seen:
      raise PlacementError(f"S{st.value} before its deferred factor(s) "
                           f"{sorted(finals[st.value] - seen)} in {expr}")
