"""The Plan: what the planner hands to the code generator.

Contract between ``jaxfuse.planner`` and ``jaxfuse.codegen`` (both read it):

* ``grid``: loops bound to program ids, outermost first. Each program owns one
  tile of each grid loop.
* ``tiles``: a tile size for every loop of the region (powers of two; a tile
  >= the loop's extent means the whole loop sits in one tile, masked past
  the extent).
* ``expr``: the per-program tiling expression, statements already placed
  and hoisted (``jaxfuse.planner.tiling.place``). Grid loops do not appear in
  it. Every ``LoopNode`` is a sequential ``for`` over tiles of its loop;
  loops with one tile appear nowhere (hoisted away). Statements run in body
  order: ``L x`` loads a tile of input ``x``, ``C v`` computes (or, inside
  the loop of one of its reduced loops, accumulates) op ``v``, ``S y``
  stores output ``y``.
* ``split``: optional ``(loop, parts)``: a reduction loop divided among
  ``parts`` programs whose partial results a second pass combines (for
  grids too small for the GPU, MCFuser's alpha). The planner proposes it
  only for loops that ``planner.search.splittable_loops`` allows (reduced
  only by contractions whose results are outputs, maybe through a convert),
  with the split loop a top-level loop of ``expr`` and every store after it.
* ``skeleton``: the full (unplaced) tiling expression the plan came from,
  e.g. ``mhnk``; informational.

``tiling.place(region, skeleton, tiles, grid=None, *, streamable=None,
split=None)`` builds ``expr``; grid loops may include spatial loops that
some producer does not use (``h`` of the GEMM chain): each program then
recomputes its producer tiles.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional

from jaxfuse.planner.tiling import TilingExpr


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The performance model's estimate for one plan (MCFuser eq. 2-5 with
  the per-program path of ``cost_model``): ``alpha`` is the factor the
  grid costs over ``t_mem + t_comp``; ``t_program_s`` one program's time,
  ``steps`` its serial loop steps; ``t_dot_s`` and ``t_vector_s`` split
  ``t_comp_s`` into tensor-core and vector/SFU work, ``t_traffic_s`` is the
  L2/HBM traffic bound and ``waves`` the program waves; ``smem_bytes`` the
  shared memory the kernel asks for at its pipeline depth
  (``pruning.pipelined_smem_bytes``; MCFuser's eq. (1) also counted the
  register-held accumulators)."""
  time_s: float
  t_mem_s: float
  t_comp_s: float
  alpha: float
  bytes_moved: int
  flops: int
  smem_bytes: int
  programs: int
  t_program_s: float = 0.0
  steps: int = 1
  t_dot_s: float = 0.0
  t_vector_s: float = 0.0
  t_traffic_s: float = 0.0
  waves: int = 1


@dataclasses.dataclass(frozen=True)
class Plan:
  expr: TilingExpr
  grid: tuple[str, ...]
  tiles: tuple[tuple[str, int], ...]
  skeleton: str = ""
  num_warps: int = 4
  num_stages: int = 2
  split: Optional[tuple[str, int]] = None
  predicted: Optional[Prediction] = None
  # Which kernel form prints the plan: "" the Triton printer
  # (codegen.triton_printer); GLUON_ATTENTION the warp-specialized Hopper
  # attention kernel (codegen.gluon_printer).
  form: str = ""

  @property
  def tile_map(self) -> dict[str, int]:
    return dict(self.tiles)

  def tile(self, loop: str) -> int:
    return self.tile_map[loop]

  def __str__(self) -> str:
    # Cached: the search's sort keys read it (see TilingExpr.__str__).
    s = self.__dict__.get("_text")
    if s is None:
      tiles = ", ".join(f"{l}={t}" for l, t in self.tiles)
      grid = ",".join(self.grid) or "-"
      s = (f"grid({grid}) {self.expr}  tiles({tiles})  warps={self.num_warps} "
           f"stages={self.num_stages}")
      if self.split:
        s += f"  split={self.split[0]}x{self.split[1]}"
      if self.form:
        s += f"  form={self.form}"
      object.__setattr__(self, "_text", s)
    return s


_PLAN_RE = re.compile(r"grid\((?P<grid>[^)]*)\) (?P<expr>.+?)  tiles\((?P<tiles>[^)]*)\)  "
                      r"warps=(?P<warps>\d+) stages=(?P<stages>\d+)"
                      r"(?:  split=(?P<sl>\w+)x(?P<sp>\d+))?"
                      r"(?:  form=(?P<form>[\w-]+))?$")


def parse_plan(text: str, loops: Optional[Iterable[str]] = None) -> Plan:
  """The plan ``str(plan)`` printed (without its prediction), e.g. from a
  benchmark's JSON: ``str(parse_plan(str(p))) == str(p)``. ``loops``: the
  region's loop names, checked when given.

  Example::

      p = parse_plan("grid(m) (La,n(Lb,Cc,Ld,Ce),Se)  tiles(m=64, n=64, k=64, h=64)  "
                     "warps=4 stages=3")
  """
  from jaxfuse.planner import tiling  # pylint: disable=import-outside-toplevel
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  m = _PLAN_RE.match(text.strip())
  if m is None:
    raise ValueError(f"not a printed plan: {text!r}")
  grid = tuple(g for g in m["grid"].split(",") if g and g != "-")
  tiles = []
  for item in m["tiles"].split(", "):
    name, _, size = item.partition("=")
    tiles.append((name, int(size)))
  split = (m["sl"], int(m["sp"])) if m["sl"] else None
  return Plan(expr=tiling.parse(m["expr"], loops), grid=grid, tiles=tuple(tiles),
              num_warps=int(m["warps"]), num_stages=int(m["stages"]), split=split,
              form=m["form"] or "")
