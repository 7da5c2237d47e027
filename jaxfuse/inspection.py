"""``jaxfuse.inspect``: what would be fused, and what the model thinks of it.

For each region that capture finds in ``fun``'s program the report gives its
source location, the Chain IR (einsum-like), loop extents, FLOPs, the fewest
bytes a fused kernel must move, the arithmetic intensity against the device's
ridge point (MBCI or not), the planner's chosen plan with its predicted time
and the roofline floor, the next five plans, why a region would be left to
XLA, and the generated kernel's source when code generation is available.

Example::

    import jaxfuse
    report = jaxfuse.inspect(attention, q, k, v, device="h100")
    print(report)                       # readable, one section per region
    report.regions[0].mbci              # True
    report.to_dict()                    # plain data (JSON-serialisable)

The planner (``jaxfuse.planner``), device models (``jaxfuse.devices``) and code
generator (``jaxfuse.codegen``) are imported lazily; when one is missing or
fails, the fields it would fill are None and the report says why in
``notes``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

import jax

from jaxfuse import ir

__all__ = ["inspect", "Report", "RegionReport", "Alternative"]


@dataclasses.dataclass
class Alternative:
  """A runner-up plan and the model's prediction for it."""
  plan: str
  predicted_time_s: Optional[float]


@dataclasses.dataclass
class RegionReport:
  """One captured region. Times in seconds, sizes in bytes."""
  name: str
  source: str
  path: str
  ir_text: str
  einsum: str
  loops: dict[str, int]
  dtype: str
  flops: int
  min_bytes: int
  intensity: float
  device: Optional[str] = None
  unfused_intensity: Optional[float] = None
  ridge: Optional[float] = None
  mbci: Optional[bool] = None
  # The analytical model's plan, prediction and verdict: what tune='model'
  # runs, and tune='auto' where the model is sure (where it is not, notes
  # or why_not say so and the kernel is timed against XLA's ops).
  # ``lowered`` says what a compile ran (under tune='measure', the tuned
  # plan and the measured keep-or-drop).
  plan: Any = None
  predicted_time_s: Optional[float] = None
  floor_time_s: Optional[float] = None
  # The model's time for the region's ops run one by one (what XLA runs when
  # the region is not fused); keep-or-drop compares the two.
  unfused_time_s: Optional[float] = None
  alternatives: list[Alternative] = dataclasses.field(default_factory=list)
  # The model's best plan of each other structure (grid, split, output
  # tiles; PlanningResult.alternatives): the runner-ups above are mostly
  # the pick's structure with other tiles.
  other_structures: list[Alternative] = dataclasses.field(default_factory=list)
  why_not: Optional[str] = None
  # How a compile in this process lowered the region (``launch.Outcome`` as
  # text): the kernel's plan, or why XLA's ops run (with the keep-or-drop
  # timing where one was taken). None until a GPU compile (or one with
  # JAXFUSE_BACKEND=interpret) lowered it; a CPU compile runs the original ops.
  lowered: Optional[str] = None
  plan_time_s: Optional[float] = None
  space: Optional[dict] = None
  kernel_source: Optional[str] = None
  notes: list[str] = dataclasses.field(default_factory=list)
  # A chain the model leaves to XLA as a whole is captured again with fewer
  # contractions per region, as its lowering does: its parts, each reported
  # like a region (e.g. the GEMM and GELU of a compute-bound FFN chain).
  parts: list["RegionReport"] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["parts"] = [p.to_dict() for p in self.parts]
    d["plan"] = None if self.plan is None else str(self.plan)
    d["alternatives"] = [dataclasses.asdict(a) for a in self.alternatives]
    d["other_structures"] = [dataclasses.asdict(a) for a in self.other_structures]
    d["space"] = None if self.space is None else {str(k): _plain(v)
                                                   for k, v in self.space.items()}
    return d

  def __str__(self) -> str:
    return "\n".join(self._lines(1, 1))

  def _lines(self, i: int, n: int) -> list[str]:
    where = self.source or "unknown location"
    lines = [f"== region {i}/{n}: {self.name} at {where} "
             f"({'in ' + self.path if self.path else 'top level'})"]
    lines.append("IR:")
    lines += ["  " + l for l in self.ir_text.splitlines()]
    lines.append(f"einsum:        {self.einsum}")
    lines.append("loops:         " + " ".join(f"{k}={v}" for k, v in self.loops.items()))
    lines.append(f"dtype:         {self.dtype}")
    lines.append(f"FLOPs:         {self.flops:,} ({_si(self.flops)}FLOP)")
    lines.append(f"min bytes:     {self.min_bytes:,} ({_si(self.min_bytes)}B)")
    if self.ridge is not None:
      lines.append(f"intensity:     {self.intensity:.2f} FLOP/B vs ridge "
                   f"{self.ridge:.2f} FLOP/B on {self.device}")
    else:
      lines.append(f"intensity:     {self.intensity:.2f} FLOP/B (ridge unknown)")
    if self.unfused_intensity is not None:
      lines.append(f"unfused:       {self.unfused_intensity:.2f} FLOP/B with each "
                   "contraction's result through memory (MBCI when below the ridge)")
    lines.append("MBCI:          " + ("unknown" if self.mbci is None
                                      else "yes" if self.mbci else "no"))
    lines.append(f"plan:          {self.plan if self.plan is not None else '-'}")
    lines.append(f"predicted:     {_us(self.predicted_time_s)}    floor: "
                 f"{_us(self.floor_time_s)}"
                 + (f"    XLA ops (model): {_us(self.unfused_time_s)}"
                    if self.unfused_time_s is not None else "")
                 + (f"    (planned in {self.plan_time_s * 1e3:.1f} ms)"
                    if self.plan_time_s is not None else ""))
    if self.space:
      lines.append("search space:  " + ", ".join(f"{k}={_plain(v)}"
                                                 for k, v in self.space.items()))
    for title, alts in (("alternatives:", self.alternatives),
                        ("other structures:", self.other_structures)):
      if alts:
        lines.append(title)
        for j, a in enumerate(alts, 1):
          lines.append(f"  {j}. {_us(a.predicted_time_s):>10}  {a.plan}")
    lines.append(f"why not fused: {self.why_not or '-'}")
    lines.append(f"lowered:       {self.lowered or '- (no lowering to a kernel recorded in this process)'}")
    for note in self.notes:
      lines.append(f"note: {note}")
    if self.kernel_source:
      lines.append("kernel source:")
      lines += ["  " + l for l in self.kernel_source.splitlines()]
    if self.parts:
      lines.append(f"parts:         {len(self.parts)} region(s) with fewer contractions, "
                   "lowered on their own when the whole chain is left to XLA")
      for j, part in enumerate(self.parts, 1):
        lines += ["  " + l for l in part._lines(j, len(self.parts))]  # pylint: disable=protected-access
    return lines


@dataclasses.dataclass
class Report:
  """What ``jaxfuse.inspect`` found in one function for one set of inputs."""
  function: str
  device: Optional[str]
  regions: list[RegionReport]
  notes: list[str] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    return {"function": self.function, "device": self.device,
            "regions": [r.to_dict() for r in self.regions],
            "notes": list(self.notes)}

  def __str__(self) -> str:
    lines = [f"jaxfuse.inspect({self.function}): {len(self.regions)} region(s)"
             f" on device model {self.device or 'unknown'}"]
    for note in self.notes:
      lines.append(f"note: {note}")
    if not self.regions:
      lines.append("no chain of contractions to fuse; everything stays with XLA")
    for i, r in enumerate(self.regions, 1):
      lines.append("")
      lines += r._lines(i, len(self.regions))  # pylint: disable=protected-access
    return "\n".join(lines)

  __repr__ = __str__


# --------------------------------------------------------------------------

def _plain(v: Any) -> Any:
  if isinstance(v, (int, float, str, bool)) or v is None:
    return v
  try:
    return int(v)
  except (TypeError, ValueError):
    return str(v)


def _si(x: float) -> str:
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {unit}"
  return f"{x:.3g} "


def _us(t: Optional[float]) -> str:
  return "-" if t is None else f"{t * 1e6:.3f} us"


def _err(e: BaseException) -> str:
  msg = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {msg[:200]}"


def _region_dtype(region: ir.Region) -> str:
  """The first contraction's input dtype (when jaxfuse.devices is missing)."""
  vm = region.value_map
  for op in region.contractions:
    return vm[op.lhs].dtype
  return region.values[0].dtype if region.values else "float32"


def _unwrap(fun: Callable) -> Callable:
  """A ``jaxfuse.jit``/``fuse`` function is inspected as the user's function
  (its traced program already holds the fused regions)."""
  for _ in range(3):
    inner = getattr(fun, "__wrapped__", None)
    if getattr(fun, "__jaxfuse_fused__", False) and inner is not None:
      fun = inner
    elif inner is not None and getattr(inner, "__jaxfuse_fused__", False):
      fun = inner
    else:
      break
  return fun


def _trace(fun: Callable, args: tuple, kwargs: dict):
  # The same split as jaxfuse.api.fuse: arrays are traced, the rest is
  # static; ShapeDtypeStructs are fine here too since nothing runs.
  from jaxfuse.api import _is_dynamic, split_arguments  # pylint: disable=g-import-not-at-top
  flat_fun, dyn = split_arguments(
      fun, args, kwargs,
      dynamic=lambda x: _is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct))
  return jax.make_jaxpr(flat_fun)(*dyn)


def _device(device: Any, notes: list[str]):
  """(DeviceSpec or None, devices module or None)."""
  try:
    from jaxfuse import devices  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"device models unavailable ({_err(e)}): ridge, MBCI and "
                 "floor are not reported")
    return None, None
  try:
    if device is None or isinstance(device, str):
      return devices.get_device(device), devices
    return device, devices
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"device {device!r}: {_err(e)}")
    return None, devices


def inspect(fun: Callable, *args: Any, device: Any = None,
            **kwargs: Any) -> Report:
  """Reports the regions jaxfuse finds in ``fun(*args, **kwargs)``.

  ``device`` is a device model name (``'h100'``, ``'h200'``, ``'a100'``,
  ``'rtx3080'``), a ``jaxfuse.devices.DeviceSpec``, or None for the attached
  GPU / the configured default. Nothing is compiled or run; after
  ``jaxfuse.jit`` compiled ``fun`` in this process, each region's
  ``lowered`` says what ran (its kernel's plan, or XLA's ops and why).

  Example::

    print(jaxfuse.inspect(attention, q, k, v, device="h100"))
  """
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top

  notes: list[str] = []
  target = _unwrap(fun)
  fname = getattr(target, "__name__", type(target).__name__)
  closed = _trace(target, args, kwargs)  # bad input: jax's own error
  try:
    found = capture.find_regions(closed)
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"capture failed ({_err(e)}): the function would run unfused")
    found = []
  spec, devices = _device(device, notes)
  dev_name = getattr(spec, "name", None) if spec is not None else None

  planner = None
  if found:
    try:
      from jaxfuse import planner as planner_mod  # pylint: disable=g-import-not-at-top
      planner = planner_mod if hasattr(planner_mod, "plan_region") else None
      if planner is None:
        notes.append("planner unavailable (no plan_region): plans not reported")
    except Exception as e:  # pylint: disable=broad-except
      notes.append(f"planner unavailable ({_err(e)}): plans not reported")

  regions = [_region_report(c, spec, devices, planner, dev_name)
             for c in found]
  return Report(function=fname, device=dev_name, regions=regions, notes=notes)


def _region_report(captured: Any, spec: Any, devices: Any, planner: Any,
                   dev_name: Optional[str]) -> RegionReport:
  region: ir.Region = captured.region
  flops = region.flops()
  min_bytes = region.min_bytes()
  dtype = _region_dtype(region)
  if devices is not None and hasattr(devices, "region_dtype"):
    try:
      dtype = devices.region_dtype(region)  # the dtype the ridge is read for
    except Exception:  # pylint: disable=broad-except
      pass
  rr = RegionReport(
      name=region.name, source=getattr(captured, "source", "") or "",
      path=getattr(captured, "path", "") or "", ir_text=region.to_text(),
      einsum=region.einsum_summary(), loops=region.loop_extents, dtype=dtype,
      flops=flops, min_bytes=min_bytes,
      intensity=flops / max(min_bytes, 1), device=dev_name,
      unfused_intensity=region.unfused_intensity())

  bandwidth = None
  if spec is not None and devices is not None:
    try:
      rr.ridge = float(devices.ridge_point(spec, dtype))
      mbci, _, ridge = devices.is_mbci(region, spec)
      rr.mbci = bool(mbci)
      rr.ridge = float(ridge) if ridge is not None else rr.ridge
      bandwidth = float(spec.mem_bandwidth_Bps)
      # Roofline floor: the larger of compute at peak and traffic at full
      # bandwidth (peak = ridge * bandwidth, the ridge's definition; the
      # region's peak weighs each contraction's dtype and precision).
      peak = rr.ridge * bandwidth
      rr.floor_time_s = max(flops / peak if peak > 0 else 0.0,
                            min_bytes / bandwidth)
    except Exception as e:  # pylint: disable=broad-except
      rr.notes.append(f"device model failed: {_err(e)}")

  # Only a process that lowered regions has imported launch (it pulls in
  # Triton); importing it here would cost that and could find nothing.
  launch = sys.modules.get("jaxfuse.runtime.launch")
  if launch is not None:
    done = launch.outcome(region)
    rr.lowered = None if done is None else str(done)

  if planner is None:
    return rr
  if spec is not None:
    try:
      from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
      rr.unfused_time_s = float(cost_model.unfused_time(region, spec))
    except Exception as e:  # pylint: disable=broad-except
      rr.notes.append(f"unfused estimate failed: {_err(e)}")
  try:
    res = planner.plan_region(region, spec if spec is not None else None)
  except Exception as e:  # pylint: disable=broad-except
    rr.notes.append(f"planner failed: {_err(e)}")
    return rr
  rr.why_not = getattr(res, "why_not", None)
  rr.plan_time_s = getattr(res, "plan_time_s", None)
  space = getattr(res, "space", None)
  rr.space = dict(space) if space else None
  best = getattr(res, "best", None)
  ranked = list(getattr(res, "ranked", ()) or ())
  rr.plan = best
  if best is not None and getattr(best, "predicted", None) is not None:
    rr.predicted_time_s = float(best.predicted.time_s)
    if spec is not None and rr.why_not is None:
      try:
        from jaxfuse.planner import cost_model, search  # pylint: disable=g-import-not-at-top
        written = cost_model.writes_its_intermediates(region)
        why = cost_model.slower_than_unfused(region, best, spec)
        alternatives = getattr(res, "alternatives", ())
        rival = search.unsplit_rival(region, best, alternatives)
        unsure = cost_model.verdict_uncertain(region, best, spec, rival=rival)
        tied = search.tied_rival(region, best, alternatives) if rival is None else None
        if unsure and rival is not None:
          unsure += (f"; the model's best unsplit plan is timed beside it, predicted "
                     f"{_us(rival.predicted.time_s)}: {rival}")
        elif unsure and tied is not None:
          unsure += (f"; a plan the model predicts as fast is timed beside it, predicted "
                     f"{_us(tied.predicted.time_s)}: {tied}")
        if written:
          rr.why_not = f"{written}; left to XLA under tune='model' and 'auto'"
        elif why:
          rr.why_not = f"{why}; left to XLA under tune='model'"
          if unsure:
            rr.why_not += (f"; tune='auto' times it on the GPU against the ops that "
                           f"would run instead first ({unsure})")
        elif unsure:
          rr.notes.append(f"tune='auto' times this kernel on the GPU against the ops "
                          f"that would run instead before keeping it ({unsure})")
      except Exception as e:  # pylint: disable=broad-except
        rr.notes.append(f"unfused estimate failed: {_err(e)}")
  def alternative(p) -> Alternative:
    pred = getattr(p, "predicted", None)
    return Alternative(plan=str(p), predicted_time_s=None if pred is None else float(pred.time_s))
  rr.alternatives = [alternative(p) for p in ranked if p is not best and p != best][:5]
  rr.other_structures = [alternative(p) for p in getattr(res, "alternatives", ())][:3]
  if best is not None:
    rr.kernel_source = _kernel_source(region, best, rr.notes)
  if len(region.contractions) > 1 and (rr.why_not or rr.mbci is False):
    rr.parts = _parts(captured, spec, devices, planner, dev_name, rr.notes)
  return rr


def _parts(captured: Any, spec: Any, devices: Any, planner: Any,
           dev_name: Optional[str], notes: list[str]) -> list[RegionReport]:
  """Reports of the regions found again in a region's own ops with fewer
  contractions (``primitive._lower_parts`` lowers those)."""
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  try:
    found = capture.find_regions(
        captured.jaxpr, max_contractions=len(captured.region.contractions) - 1)
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"capture of its parts failed ({_err(e)})")
    return []
  return [_region_report(c, spec, devices, planner, dev_name) for c in found]


def _kernel_source(region: ir.Region, plan: Any, notes: list[str]) -> Optional[str]:
  try:
    from jaxfuse import codegen  # pylint: disable=g-import-not-at-top
    generate = getattr(codegen, "generate", None)
    if generate is None:
      notes.append("code generator unavailable: no kernel source")
      return None
    return generate(region, plan).source
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"code generation failed: {_err(e)}")
    return None

