"""Device parameters for the planner's performance model (MCFuser IV-A).

One table of GPUs (SM count, shared memory per block, L2, memory bandwidth,
peak FLOP/s per dtype); every entry is overridable, and a live GPU that JAX
exposes refines the table entry it matches (its SM count, its name).

Example::

    from jaxfuse import devices
    h100 = devices.get_device("h100")
    devices.ridge_point(h100, "float16")          # ~263 FLOP/byte
    small = devices.get_device("h100", sm_count=66)   # an override
    devices.register_device(small.replace(name="h100-half"))
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Mapping, Optional

from absl import logging

__all__ = ["DeviceSpec", "get_device", "register_device", "known_devices",
           "ridge_point", "is_mbci", "region_dtype", "contraction_dtype", "region_peak"]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """What the performance model needs to know about a GPU.

  ``peak_flops`` maps an input dtype to the dense tensor-core FLOP/s of
  ``tl.dot`` on it (float32 means TF32, Triton's default); ``vector_flops``
  is the non-tensor fp32 rate used for elementwise ops and reductions;
  ``sfu_ops`` the rate of transcendental results (``exp``: 16 per clock per
  SM); ``mma_rows`` the row count below which ``tl.dot`` cannot use the
  widest tensor-core instruction (64 for Hopper's wgmma, 16 before).
  Bandwidths and peaks are what was measured on such a GPU where known
  (see DESIGN.md), otherwise about 80% of the data sheet.
  """
  name: str
  sm_count: int
  smem_per_block_bytes: int
  l2_bytes: int
  mem_bandwidth_Bps: float
  peak_flops: Mapping[str, float]
  vector_flops: float = 50e12
  sfu_ops: float = 3.9e12
  mma_rows: int = 16
  kernel_launch_s: float = 2e-6
  # What one program (one CTA on one SM) streams from L2/HBM, and the fixed
  # cost of one pipelined loop step; cost_model's per-program path.
  sm_bandwidth_Bps: float = 0.0
  loop_step_s: float = 150e-9
  # The shortest a launched kernel runs (launch latency and ramp): XLA's
  # smallest GEMM kernels took 1.5-1.6 us on an H200.
  min_kernel_s: float = 1.0e-6
  regs_per_sm: int = 65536
  live: bool = False

  def __post_init__(self):
    if not self.sm_bandwidth_Bps:
      # One SM streams ~2.3x its fair share of HBM bandwidth (H200, 75 GB/s
      # against 4.3 TB/s / 132 SMs; benchmarks/RESULTS.md, fourth session).
      object.__setattr__(self, "sm_bandwidth_Bps",
                         2.3 * self.mem_bandwidth_Bps / max(self.sm_count, 1))

  def peak(self, dtype: str) -> float:
    """Tensor-core FLOP/s for inputs of ``dtype`` (float16 when unknown)."""
    if dtype in self.peak_flops:
      return float(self.peak_flops[dtype])
    return float(self.peak_flops.get("float16", max(self.peak_flops.values())))

  def dot_peak(self, dtype: str, precision: str = "default") -> float:
    """FLOP/s of a contraction whose widest input is ``dtype``, computed at
    ``precision`` (``ir.PRECISIONS``): float32 operands run TF32 tensor
    cores by default, three TF32 passes for "tf32x3", and fp32 FMAs (no
    tensor cores) for "ieee". 16-bit operands ignore ``precision``."""
    if dtype == "float32" and precision == "tf32x3":
      return self.peak("float32") / 3.0
    if dtype in ("float32", "float64") and precision == "ieee":
      return float(self.vector_flops)
    return self.peak(dtype)

  def replace(self, **changes: Any) -> "DeviceSpec":
    """A copy with some fields changed, e.g. ``spec.replace(sm_count=66)``."""
    return dataclasses.replace(self, **changes)


_KB = 1024
_MB = 1024 * 1024

_TABLE: dict[str, DeviceSpec] = {
    # H100 SXM: 132 SMs, 227 KB opt-in shared memory per block, 50 MB L2;
    # copy bandwidth ~3.0 TB/s and ~790 TFLOP/s fp16 measured (DESIGN.md).
    "h100": DeviceSpec(
        name="h100", sm_count=132, smem_per_block_bytes=227 * _KB,
        l2_bytes=50 * _MB, mem_bandwidth_Bps=3.0e12,
        peak_flops={"float16": 790e12, "bfloat16": 790e12, "float32": 395e12,
                    "float64": 54e12},
        vector_flops=60e12, sfu_ops=3.9e12, mma_rows=64,
        # the H200's SMs and L2 (fitted there); with them the model met the
        # fidelity targets on an H100 too (benchmarks/RESULTS.md, seventh
        # session: Spearman 0.93-0.96, regret <= 2.6%)
        sm_bandwidth_Bps=75e9),
    # H200: the H100 die with HBM3e; ~4.3 TB/s measured.
    "h200": DeviceSpec(
        name="h200", sm_count=132, smem_per_block_bytes=227 * _KB,
        l2_bytes=60 * _MB, mem_bandwidth_Bps=4.3e12,
        peak_flops={"float16": 790e12, "bfloat16": 790e12, "float32": 395e12,
                    "float64": 54e12},
        vector_flops=60e12, sfu_ops=3.9e12, mma_rows=64, sm_bandwidth_Bps=75e9),
    # A100 PCIe 40 GB (MCFuser's and Chimera's GPU): 108 SMs, 163 KB per block.
    "a100": DeviceSpec(
        name="a100", sm_count=108, smem_per_block_bytes=163 * _KB,
        l2_bytes=40 * _MB, mem_bandwidth_Bps=1.3e12,
        peak_flops={"float16": 250e12, "bfloat16": 250e12, "float32": 125e12,
                    "float64": 15.6e12},
        vector_flops=15.6e12, sfu_ops=2.4e12),
    # RTX 3080 (GA102): 68 SMs, 99 KB per block, 5 MB L2; fp16 with fp32
    # accumulation runs at half the fp16-accumulate rate on GeForce parts.
    "rtx3080": DeviceSpec(
        name="rtx3080", sm_count=68, smem_per_block_bytes=99 * _KB,
        l2_bytes=5 * _MB, mem_bandwidth_Bps=0.65e12,
        peak_flops={"float16": 48e12, "bfloat16": 48e12, "float32": 24e12,
                    "float64": 0.47e12},
        vector_flops=24e12, sfu_ops=1.9e12),
}
_ALIASES = {"h100": "h100", "h200": "h200", "a100": "a100", "rtx3080": "rtx3080",
            "3080": "rtx3080", "rtx_3080": "rtx3080", "gh200": "h200"}
_LOCK = threading.Lock()
_LIVE: Optional[DeviceSpec] = None
_LIVE_CHECKED = False


def known_devices() -> tuple[str, ...]:
  """Names in the table (``register_device`` adds more)."""
  return tuple(_TABLE)


def register_device(spec: DeviceSpec) -> None:
  """Adds or replaces a table entry (the override hook)."""
  if not isinstance(spec, DeviceSpec):
    raise TypeError(f"spec must be a DeviceSpec, got {type(spec).__name__}")
  with _LOCK:
    _TABLE[spec.name.lower()] = spec
    _ALIASES[spec.name.lower()] = spec.name.lower()


def _match_kind(kind: str) -> Optional[str]:
  k = kind.lower().replace(" ", "").replace("-", "")
  for key in ("h200", "gh200", "h100", "a100", "3080"):
    if key in k:
      return _ALIASES[key]
  return None


def _live_device() -> Optional[DeviceSpec]:
  """The table entry for the first JAX GPU, refined from what JAX exposes."""
  global _LIVE, _LIVE_CHECKED
  with _LOCK:
    if _LIVE_CHECKED:
      return _LIVE
    _LIVE_CHECKED = True
  try:
    import jax  # pylint: disable=import-outside-toplevel
    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm")]
  except Exception:  # pylint: disable=broad-except
    gpus = []
  if not gpus:
    return None
  dev = gpus[0]
  kind = str(getattr(dev, "device_kind", ""))
  key = _match_kind(kind)
  base = _TABLE[key] if key else _TABLE["h100"]
  changes: dict[str, Any] = {"live": True}
  cores = getattr(dev, "core_count", None)
  if isinstance(cores, int) and cores > 0:
    changes["sm_count"] = cores
  if not key:
    changes["name"] = kind or "gpu"
    logging.info("jaxfuse: unknown GPU %r; using h100 parameters with its SM "
                 "count", kind)
  live = base.replace(**changes)
  with _LOCK:
    _LIVE = live
  return live


def get_device(name: Optional[str | DeviceSpec] = None, **overrides: Any) -> DeviceSpec:
  """The DeviceSpec for ``name`` ('h100', 'h200', 'a100', 'rtx3080', a name
  given to ``register_device``, or a DeviceSpec itself).

  ``None`` or ``'auto'``: ``jaxfuse.config.device`` when set, else the live
  GPU JAX exposes, else h100 (the CPU default). Keyword overrides replace
  fields: ``get_device('h100', sm_count=66)``.
  """
  if isinstance(name, DeviceSpec):
    spec = name
  else:
    if name is None or name == "auto":
      from jaxfuse.config import config  # pylint: disable=import-outside-toplevel
      name = config.device if config.device not in (None, "", "auto") else None
    if name is None:
      spec = _live_device() or _TABLE["h100"]
    else:
      if not isinstance(name, str):
        raise TypeError(f"device must be a name or DeviceSpec, got {name!r}")
      key = _ALIASES.get(name.lower()) or _match_kind(name)
      if key is None or key not in _TABLE:
        raise ValueError(f"unknown device {name!r}; known: {sorted(_TABLE)}")
      spec = _TABLE[key]
  if overrides:
    bad = set(overrides) - {f.name for f in dataclasses.fields(DeviceSpec)}
    if bad:
      raise ValueError(f"unknown DeviceSpec field(s) {sorted(bad)}")
    spec = spec.replace(**overrides)
  return spec


_WIDTH = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


def contraction_dtype(region, op) -> str:
  """The dtype that sets a contraction's tensor-core rate: its widest input."""
  dts = [region.value(v).dtype for v in (op.lhs, op.rhs)]
  dts = [d for d in dts if d in _WIDTH]
  return max(dts, key=_WIDTH.__getitem__) if dts else "float16"


def region_dtype(region) -> str:
  """The widest contraction input of the region."""
  dts = [contraction_dtype(region, op) for op in region.contractions]
  return max(dts, key=_WIDTH.__getitem__) if dts else "float16"


def region_peak(region, device: DeviceSpec | str | None) -> float:
  """FLOP/s of the region's contractions together: each at its own dtype and
  precision (``DeviceSpec.dot_peak``), weighted by its FLOPs."""
  dev = get_device(device)
  ext = region.loop_extents
  flops, seconds = 0.0, 0.0
  for op in region.contractions:
    f = 2.0 * math.prod(ext[l] for l in region.op_loops(op))
    flops += f
    seconds += f / dev.dot_peak(contraction_dtype(region, op), op.precision)
  return flops / seconds if seconds > 0 else dev.peak(region_dtype(region))


def ridge_point(device: DeviceSpec | str | None, dtype: str = "float16") -> float:
  """Roofline ridge point P/W in FLOP per byte."""
  dev = get_device(device)
  return dev.peak(dtype) / dev.mem_bandwidth_Bps


def is_mbci(region, device: DeviceSpec | str | None = None) -> tuple[bool, float, float]:
  """Is ``region`` a memory-bound compute-intensive chain on ``device``?

  Returns ``(intensity < ridge, intensity, ridge)`` where intensity is the
  chain's FLOPs over the bytes its ops move when run one by one (each
  contraction's result through memory): MCFuser's criterion, compute-
  intensive ops that are memory-bound at the shapes in use. (The fused
  kernel's own intensity, over the fewest bytes, is
  ``region.arithmetic_intensity()``; attention at 2048 tokens is far above
  the ridge there, which is the point of fusing it.)

  Example::

      ok, phi, ridge = is_mbci(region, "h100")
  """
  dev = get_device(device)
  phi = region.unfused_intensity()
  ridge = region_peak(region, dev) / dev.mem_bandwidth_Bps
  return phi < ridge, phi, ridge
