"""Tile sizes from Lagrange multipliers (Chimera IV-B).

Minimise the data movement volume DV(T) subject to the memory usage
MU(T) <= MC (on-chip capacity, in elements) over real tiles, then round to
legal Triton tiles and keep the best integer neighbour.

* ``chain_closed_form``: Chimera's solution for the GEMM chain in order
  ``mlkn``: ``T_M* = T_L* = -a + sqrt(a^2 + MC)``, ``T_N* = a`` (``a`` the
  lower bound of the free tiles ``T_N, T_K``), ``DV* = 2ML(K+N)/T_M*``.
* ``solve``: the same problem for any region and order, numerically
  (SLSQP in log-space on the continuous DV of Chimera's Alg. 1).
* ``round_tiles``: floor/ceil to the legal candidates (``pruning``) and the
  best feasible neighbour by integer DV.

Example::

    t = lagrange_tiles(region, "mlkn", device)   # {'m': 128, 'l': 128, ...}
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from jaxfuse import ir
from jaxfuse.planner import movement, pruning, tiling

__all__ = ["chain_closed_form", "solve", "solve_greedy", "round_tiles", "lagrange_tiles",
           "capacity_elements"]


def chain_closed_form(mc: float, alpha: float) -> tuple[float, float, float]:
  """``(T_M*, T_L*, T_N*)`` for the two-GEMM chain (Chimera IV-B).

  With T_K = T_N = a the binding constraint is ``T_M T_L + a(T_M + T_L) =
  MC`` and DV is symmetric in T_M, T_L, hence the root of
  ``T^2 + 2aT - MC = 0``.
  """
  if mc <= 0 or alpha <= 0:
    raise ValueError(f"mc and alpha must be positive, got {mc}, {alpha}")
  t = -alpha + math.sqrt(alpha * alpha + mc)
  return t, t, alpha


def capacity_elements(region: ir.Region, device) -> float:
  """On-chip capacity in elements of the region's widest input dtype."""
  item = max(ir.dtype_itemsize(region.value(v).dtype) for v in region.input_names)
  return device.smem_per_block_bytes / item


def solve(region: ir.Region, perm: Union[str, Sequence[str]], mc: float, *,
          lower: float = 16.0, loops: Optional[Sequence[str]] = None
          ) -> dict[str, float]:
  """Real tiles minimising Chimera's continuous DV s.t. MU <= ``mc``.

  ``loops`` are the variables (default: the region's tiled loops); others
  (batch loops) are fixed at 1. Each variable lies in ``[lower, extent]``
  (``lower`` capped at the extent).
  """
  from scipy import optimize  # pylint: disable=import-outside-toplevel
  ext = region.loop_extents
  loops = list(tiling.tiled_loops(region) if loops is None else loops)
  fixed = {l: 1.0 for l in ext if l not in loops}
  lo = np.array([math.log(min(lower, ext[l])) for l in loops])
  hi = np.array([math.log(ext[l]) for l in loops])

  def tiles_of(x):
    t = dict(fixed)
    t.update({l: float(math.exp(v)) for l, v in zip(loops, x)})
    return t

  scale = None

  def f(x):
    dv, _, _ = movement.chimera_volume(region, perm, tiles_of(x), continuous=True)
    return dv / scale

  def g(x):
    _, mu, _ = movement.chimera_volume(region, perm, tiles_of(x), continuous=True)
    return 1.0 - mu / mc

  x0 = lo.copy()
  scale = movement.chimera_volume(region, perm, tiles_of(x0), continuous=True)[0] or 1.0
  best = None
  # A few starts: the lower corner and points along the diagonal.
  for frac in (0.0, 0.25, 0.5):
    start = lo + frac * (hi - lo)
    if g(start) < 0:
      start = lo.copy()
    res = optimize.minimize(f, start, method="SLSQP",
                            bounds=list(zip(lo, hi)),
                            constraints=[{"type": "ineq", "fun": g}],
                            options={"ftol": 1e-12, "maxiter": 500})
    if g(res.x) >= -1e-6 and (best is None or res.fun < best.fun):
      best = res
  if best is None:
    return tiles_of(lo)
  return tiles_of(best.x)


def solve_greedy(region: ir.Region, perm: Union[str, Sequence[str]], mc: float, *,
                 lower: float = 16.0, loops: Optional[Sequence[str]] = None,
                 step: float = 1.04) -> dict[str, float]:
  """A dependency-free approximation of ``solve`` used while planning.

  From the lower corner, repeatedly grows (by ``step``) the tile with the
  largest DV decrease per unit of MU increase while MU stays <= mc: at the
  optimum of the relaxed problem those marginal ratios are equal (the KKT
  condition), which this walk approaches to within one step.
  """
  ext = region.loop_extents
  loops = list(tiling.tiled_loops(region) if loops is None else loops)
  t = {l: 1.0 for l in ext}
  t.update({l: float(min(lower, ext[l])) for l in loops})

  def ev(tt):
    dv, mu, _ = movement.chimera_volume(region, perm, tt, continuous=True)
    return dv, mu

  dv, mu = ev(t)
  if mu > mc:
    return t
  for _ in range(2000):
    best, best_ratio, best_state = None, 0.0, None
    for l in loops:
      if t[l] >= ext[l]:
        continue
      tt = dict(t)
      tt[l] = min(ext[l], t[l] * step)
      dv2, mu2 = ev(tt)
      if mu2 > mc:
        continue
      gain = dv - dv2
      cost = max(mu2 - mu, 1e-9)
      if gain > 0 and gain / cost > best_ratio:
        best, best_ratio, best_state = l, gain / cost, (tt, dv2, mu2)
    if best is None:
      break
    t, dv, mu = best_state
  return t


def round_tiles(region: ir.Region, perm: Union[str, Sequence[str]],
                real: Mapping[str, float], mc: float) -> Optional[dict[str, int]]:
  """Legal tiles around ``real``: for each loop the largest candidate <= the
  real tile and the next one up; the feasible (MU <= mc) neighbour with the
  smallest integer DV wins. None when no neighbour fits."""
  ext = region.loop_extents
  opts = {}
  for l in ext:
    cands = pruning.tile_candidates(region, l)
    below = [c for c in cands if c <= real.get(l, 1)]
    above = [c for c in cands if c > real.get(l, 1)]
    o = []
    if below:
      o.append(below[-1])
    if above:
      o.append(above[0])
    opts[l] = o or [cands[0]]
  names = list(ext)
  best, best_dv = None, math.inf
  for combo in itertools.product(*(opts[l] for l in names)):
    t = dict(zip(names, combo))
    dv, mu, _ = movement.chimera_volume(region, perm, t)
    if mu <= mc and dv < best_dv:
      best, best_dv = t, dv
  return best


def lagrange_tiles(region: ir.Region, perm: Union[str, Sequence[str]], device,
                   *, lower: float = 16.0, exact: bool = False) -> Optional[dict[str, int]]:
  """Chimera's tiles for ``perm`` on ``device``: the relaxed optimum
  (``solve`` when ``exact``, else ``solve_greedy``, which avoids importing
  SciPy's optimiser while planning) rounded to legal Triton tiles (None when
  nothing fits)."""
  mc = capacity_elements(region, device)
  real = (solve if exact else solve_greedy)(region, perm, mc, lower=lower)
  return round_tiles(region, perm, real, mc)
