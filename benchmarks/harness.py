"""Shared benchmark harness: timing, kernel profiling, reference checks, output.

Every benchmark binary describes its workloads as :class:`Case` objects and
its competitors as :class:`Impl` objects, then calls :func:`main`. For each
case the harness, in one run:

* draws ``4K`` independent sets of random inputs (never zeros);
* computes a float32 reference (float64 on the CPU) of the case's plain JAX
  function on the first and last of the first ``K`` sets;
* for every implementation: compiles a function that makes ``K`` independent
  unrolled calls on distinct inputs, checks the outputs of that very
  function against the reference, measures the per-call time by the slope
  method (time ``K`` and ``4K`` calls, ``(t4K - tK) / 3K``, median of
  ``--reps``), and, on a GPU, the kernel time and kernel count per call from a
  profiler trace (``jax.profiler`` perfetto trace, or ``torch.profiler``);
* derives TFLOP/s, GB/s, the roofline floor ``max(flops/peak, bytes/bw)`` and
  the fraction of the floor reached;
* for ``jaxfuse`` also records the regions found, the chosen plans, the
  model's predicted time, planning and tuning time (``jaxfuse.inspect``,
  ``jaxfuse.planner.plan_region``).

Results go to ``<out>.json`` and ``<out>.csv``, a markdown table on stdout,
and with ``--plot`` to ``<out>_roofline.png`` and ``<out>_speedup.png``.

Example (a binary)::

    from benchmarks import harness
    harness.define_flags(default_cases="all")

    def cases():
      return {"G1": harness.Case("G1", fn, make_inputs, flops, nbytes, {...})}

    def impls(case):
      return [harness.xla_impl(case), harness.jaxfuse_impl(case)]

    if __name__ == "__main__":
      app.run(lambda argv: harness.main("gemm_chain", cases(), impls))
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import math
import re
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence

from absl import flags
from absl import logging
import numpy as np

import jax
import jax.numpy as jnp

FLAGS = flags.FLAGS

DTYPES = ("float16", "bfloat16", "float32")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Normwise relative error allowed against the float32 reference. A result is
# also accepted when it is within 2x of XLA's own error at the same dtype
# (the reference check is about wrong answers, not about rounding).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-3}
# Where XLA's own error is over this many tolerances, the reference no
# longer tells rounding from a wrong answer (a training step's float16
# softmax backward put jax.jit at 2.4), so no implementation of the row is
# vouched for: each is marked unchecked (correct=None) instead.
UNINFORMATIVE_ERROR = 10
# A leaf (``judge_errors``) on which XLA's own error is over the tolerance is
# ill-conditioned at the dtype: rounding, amplified by cancellation, sets its
# error, and a correct computation that rounds in another order lands within
# a few times XLA's. There a leaf passes within this many times XLA's error,
# elsewhere within 2x. Why: on the H100 (eighty-sixth session) XLA's own
# error on BERT-Small b8's training loss ranged 2.5e-3 to 8.6e-3 over three
# processes (its GEMMs are autotuned per process), and jaxfuse's on
# BERT-Base's last-layer query/key weight gradients 1.5-2.2x XLA's
# (1.0e-2 to 1.7e-2, XLA 6.6e-3 to 7.6e-3) over four.
NOISY_LEAF_FACTOR = 4


def judge_errors(impls: dict, tol: float, leaf_names: Optional[Sequence[str]] = None) -> None:
  """Sets each result's ``correct``: its error within ``tol`` or within 2x
  of XLA's at the same dtype; None (unchecked) for every result where
  XLA's own error is over ``UNINFORMATIVE_ERROR`` tolerances.

  Where the outputs are several arrays (``leaf_err``, from ``leaf_errors``)
  and XLA's are known leaf by leaf, each leaf is judged the same way
  against XLA's error on that leaf (within ``NOISY_LEAF_FACTOR`` times it
  where XLA's is over ``tol``), and a leaf XLA itself gets wrong by
  over ``UNINFORMATIVE_ERROR`` tolerances is left unchecked (a gradient
  that is zero in exact arithmetic, such as a key bias's under softmax, is
  rounding noise in both). Why: the normwise error over all leaves is the
  largest leaves' error; a training step's 193 gradients could hide a wrong
  small one. ``leaf_err`` is replaced by the summary ``leaf_check``."""
  xla = impls.get("xla", {})
  xla_err = xla.get("rel_err")
  known = xla_err is not None and math.isfinite(xla_err)
  xla_leaves = xla.get("leaf_err")
  for res in impls.values():
    if "rel_err" not in res:
      continue
    if known and xla_err > UNINFORMATIVE_ERROR * tol:
      res["correct"] = None
      res["unchecked"] = (f"XLA's own error {xla_err:.1e} is over {UNINFORMATIVE_ERROR}x "
                          f"the tolerance {tol:g}: the reference check cannot tell")
    else:
      res["correct"] = bool(res["rel_err"] <= (max(tol, 2 * xla_err) if known else tol))
    leaves = res.get("leaf_err")
    if leaves and xla_leaves and len(xla_leaves) == len(leaves) and res["correct"] is not None:
      _judge_leaves(res, leaves, xla_leaves, tol, leaf_names)
  for res in impls.values():
    res.pop("leaf_err", None)


def _judge_leaves(res: dict, leaves: Sequence[float], xla_leaves: Sequence[float], tol: float,
                  leaf_names: Optional[Sequence[str]]) -> None:
  """``judge_errors``'s leaf-by-leaf check of one result."""
  def name(i):
    return leaf_names[i] if leaf_names and len(leaf_names) == len(leaves) else f"leaf {i}"
  unchecked, worst, wrong = 0, None, []
  for i, (e, x) in enumerate(zip(leaves, xla_leaves)):
    if not math.isfinite(x) or x > UNINFORMATIVE_ERROR * tol:
      unchecked += 1
      continue
    bound = max(tol, (NOISY_LEAF_FACTOR if x > tol else 2) * x)
    if worst is None or e / bound > worst[0]:
      worst = (e / bound, i, e, x)
    if not e <= bound:
      wrong.append(f"{name(i)} {e:.1e} (XLA {x:.1e})")
  parts = [f"{len(leaves)} leaves"]
  if worst is not None:
    parts.append(f"worst {name(worst[1])} {worst[2]:.1e} (XLA {worst[3]:.1e}, "
                 f"{worst[0]:.2f} of its bound)")
  if unchecked:
    parts.append(f"{unchecked} unchecked (XLA's own error over {UNINFORMATIVE_ERROR}x the "
                 "tolerance)")
  res["leaf_check"] = ", ".join(parts)
  if wrong:
    res["correct"] = False
    res["leaf_mismatch"] = "; ".join(wrong[:5]) + (f"; {len(wrong) - 5} more" if len(wrong) > 5
                                                   else "")


# ---------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------

# --call_outputs: returning every call's outputs from the timed program adds
# a per-output cost of the program itself (output buffers, command-buffer
# updates): 2-3 us per call for jax.jit and jaxfuse alike on 2-5 us kernels
# (H200, fifth session), more than some whole calls cost inside a program.
CALL_OUTPUTS = ("consumed", "returned")
SLOPE_INPUTS = ("separate", "stacked")
SLOPE_ORDERS = ("interleaved", "sequential")


def define_flags(default_cases: str = "all", default_baselines: str = "all",
                 shapes_help: Optional[str] = None) -> None:
  """Defines the flags every benchmark binary shares (idempotent)."""
  if "reps" in FLAGS:
    return
  flags.DEFINE_string("cases", default_cases,
                      "Comma-separated case names or groups ('all').")
  flags.DEFINE_enum("dtype", "float16", list(DTYPES), "Input dtype.")
  flags.DEFINE_string("baselines", default_baselines,
                      "Comma-separated implementations to compare with jaxfuse "
                      "('all', or 'none' for jaxfuse alone).")
  flags.DEFINE_integer("reps", 10, "Timing repetitions (median is reported).")
  flags.DEFINE_integer("max_reps", 10,
                       "While an implementation's per-call repetitions disagree "
                       "(interquartile range, or range below 4 of them, over 10% of "
                       "their median) it is repeated again, up to this many "
                       "repetitions in all; at most --reps: exactly --reps.")
  flags.DEFINE_float("min_window_ms", 50.0,
                     "Each slope window repeats its program until it lasts this "
                     "long (a BERT forward program runs several ms).")
  flags.DEFINE_integer("calls", 0, "K, the unrolled calls per timed function "
                       "(the slope uses K and 4K); 0 picks from the memory "
                       "budget (at most 16) and 2 for calls with a roofline "
                       "floor of 50 us or more.")
  flags.DEFINE_float("mem_budget_gb", 4.0,
                     "Device memory for the 4K input sets of one implementation.")
  flags.DEFINE_string("out", "", "Output path prefix for .json/.csv/.png "
                      "(default benchmarks/results/<binary>-<device>-<dtype>).")
  flags.DEFINE_bool("plot", False, "Write a roofline chart and a speedup chart.")
  flags.DEFINE_enum("call_outputs", "consumed", list(CALL_OUTPUTS),
                    "What the timed K-call function does with each call's "
                    "outputs: 'consumed' keeps them on the device (behind an "
                    "optimization barrier, one element of each returned), "
                    "'returned' returns them all from the program.")
  flags.DEFINE_enum("slope_inputs", "separate", list(SLOPE_INPUTS),
                    "How the K-call programs get their K input sets: "
                    "'separate' passes each set's arrays as arguments (3 "
                    "buffers per call for a GEMM chain; jax spends ~2 us of "
                    "host time per argument buffer on an H100 host), "
                    "'stacked' passes one array per input holding every set, "
                    "and call i reads x[i] (jax and jaxfuse programs only; "
                    "torch baselines keep separate inputs).")
  flags.DEFINE_enum("slope_order", "sequential", list(SLOPE_ORDERS),
                    "When the per-call windows of jax.jit, jaxfuse.jit and the "
                    "other JAX programs that take the case's inputs as they are "
                    "run: 'sequential' times each implementation whole, one "
                    "after another; 'interleaved' times each repetition's "
                    "windows of all of them in turn, so that drift of the host "
                    "during a case falls on all alike (on the H100 it did not "
                    "narrow the spread of host-bound calls: "
                    "benchmarks/RESULTS.md, fifty-sixth session). Torch "
                    "baselines and programs on other layouts or stacked "
                    "inputs are always timed on their own.")
  flags.DEFINE_enum("tune", "auto", ["model", "auto", "measure"],
                    "jaxfuse's config.tune: the analytical model alone; auto "
                    "(jaxfuse's default): the model, with keep-or-drop timed "
                    "on the GPU where the model is unsure; or measured "
                    "refinement of the top candidates and keep-or-drop timed "
                    "for every region.")
  flags.DEFINE_enum("profile", "auto", ["auto", "on", "off"],
                    "Profiler kernel times (auto: on a GPU).")
  flags.DEFINE_integer("seed", 0, "Random seed for the inputs.")
  flags.DEFINE_bool("fresh_cache", True, "Plan into an empty jaxfuse cache dir "
                    "so planning/tuning time is measured, not read from disk.")
  flags.DEFINE_bool("fail_on_mismatch", True, "Exit 1 when jaxfuse's output "
                    "fails the reference check or cannot be checked (XLA's own error over "
                    "10 tolerances).")
  flags.DEFINE_float("tol", 0.0, "Override the relative-error tolerance.")
  flags.DEFINE_bool("jaxfuse_details", True, "Record jaxfuse's regions, plans, "
                    "predictions and planning/tuning time (jaxfuse.inspect, "
                    "plan_region); off saves the planning it repeats.")
  if shapes_help is not None:
    flags.DEFINE_string("shapes", "", shapes_help)


def define_step_flag() -> None:
  """``--step``, for binaries that also time a training step (one
  definition: a process may import several of them)."""
  if "step" not in flags.FLAGS:
    flags.DEFINE_enum("step", "forward", ["forward", "train"],
                      "forward: the workload's forward pass; train: a training step, "
                      "the float32 loss sum(f(...) * g) for a random cotangent g and its "
                      "gradients (jax.value_and_grad; see the binary's docstring).")


# ---------------------------------------------------------------------------
# Platform, device roofline
# ---------------------------------------------------------------------------

def on_gpu() -> bool:
  try:
    return jax.default_backend() in ("gpu", "cuda", "rocm")
  except Exception:  # pragma: no cover - no backend at all
    return False


# Peaks: dense fp16/bf16 matmul and copy bandwidth measured on the team's
# machines (../shared/DESIGN.md); other entries from vendor sheets scaled by
# the same ~80% achievable fraction. float32 assumes TF32 tensor cores (XLA's
# default matmul precision on Ampere and later).
_DEVICE_TABLE = {
    "h100": dict(peak={"float16": 790e12, "bfloat16": 790e12, "float32": 395e12},
                 bw=3.0e12, sms=132),
    "h200": dict(peak={"float16": 790e12, "bfloat16": 790e12, "float32": 395e12},
                 bw=4.3e12, sms=132),
    "a100": dict(peak={"float16": 250e12, "bfloat16": 250e12, "float32": 125e12},
                 bw=1.4e12, sms=108),
    "rtx3080": dict(peak={"float16": 48e12, "bfloat16": 48e12, "float32": 24e12},
                    bw=0.65e12, sms=68),
}


@dataclasses.dataclass(frozen=True)
class Roof:
  """The roofline the floor is computed against."""
  name: str
  peak_flops: float
  bandwidth: float
  source: str
  timed_on: str

  @property
  def ridge(self) -> float:
    return self.peak_flops / self.bandwidth

  def floor_s(self, flops: float, nbytes: float) -> float:
    return max(flops / self.peak_flops, nbytes / self.bandwidth)


def _device_kind() -> str:
  try:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"
  except Exception:
    return "unknown"


def _table_name(kind: str) -> str:
  k = kind.lower()
  for name in ("h200", "h100", "a100"):
    if name in k:
      return name
  if "3080" in k:
    return "rtx3080"
  return "h100"


def get_roof(dtype: str) -> Roof:
  """Peak FLOP/s and bandwidth of the device: jaxfuse.devices, else a table."""
  kind = _device_kind()
  gpu = on_gpu()
  timed_on = kind
  try:
    from jaxfuse import devices as jf_devices  # pylint: disable=g-import-not-at-top
    spec = jf_devices.get_device(None)
    peaks = dict(spec.peak_flops)
    peak = None
    for key in (dtype, np.dtype(jnp.dtype(dtype)), jnp.dtype(dtype)):
      if key in peaks:
        peak = float(peaks[key])
        break
    if peak is None:
      peak = float(max(peaks.values()))
    note = "jaxfuse.devices" + ("" if gpu else " (model of a GPU; timings are CPU)")
    return Roof(str(spec.name), peak, float(spec.mem_bandwidth_Bps), note, timed_on)
  except Exception as e:  # planner part not there yet, or a device it lacks
    logging.info("jaxfuse.devices unavailable (%s); using the harness table", e)
  name = _table_name(kind) if gpu else "h100"
  t = _DEVICE_TABLE[name]
  note = "harness table" + ("" if gpu else " (h100 model; timings are CPU)")
  return Roof(name, t["peak"][dtype], t["bw"], note, timed_on)


def versions() -> dict[str, str]:
  """Versions of everything that affects the numbers."""
  out = {"python": platform.python_version(), "jax": jax.__version__}
  for mod in ("jaxlib", "triton", "jax_triton", "torch", "jaxfuse", "numpy"):
    if mod == "jax_triton" and not on_gpu():
      out[mod] = "not imported (CPU jaxlib)"
      continue
    try:
      m = __import__(mod)
      out[mod] = str(getattr(m, "__version__", "?"))
    except Exception as e:  # pragma: no cover - optional deps
      out[mod] = f"unavailable ({type(e).__name__})"
  try:
    git = lambda *a: subprocess.run(["git", "-C", REPO_ROOT, *a], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    # A copied work tree can be ahead of its git metadata: say so.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "jaxfuse", "benchmarks")
    out["jaxfuse_commit"] = commit + ("+modified" if commit and changed else "")
  except Exception:
    out["jaxfuse_commit"] = "?"
  return out


# ---------------------------------------------------------------------------
# jaxfuse, imported defensively (parts are written concurrently)
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class JaxfuseAPI:
  jit: Optional[Callable] = None
  inspect: Optional[Callable] = None
  fused_jaxpr: Optional[Callable] = None
  plan_region: Optional[Callable] = None
  find_regions: Optional[Callable] = None
  config: Any = None
  errors: dict = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def jaxfuse_api() -> JaxfuseAPI:
  """Whatever of jaxfuse's public API imports, each part on its own."""
  api = JaxfuseAPI()
  try:
    import jaxfuse  # pylint: disable=g-import-not-at-top
  except Exception as e:
    api.errors["jaxfuse"] = repr(e)
    return api
  api.config = getattr(jaxfuse, "config", None)

  def pick(names: Sequence[tuple[str, str]], key: str):
    for mod, attr in names:
      try:
        m = __import__(mod, fromlist=[attr])
        f = getattr(m, attr, None)
        if f is not None:
          return f
      except Exception as e:
        api.errors[f"{key}:{mod}"] = repr(e)
    return None

  api.jit = pick([("jaxfuse", "jit"), ("jaxfuse.api", "jit")], "jit")
  api.fused_jaxpr = pick([("jaxfuse", "fused_jaxpr"), ("jaxfuse.api", "fused_jaxpr")],
                         "fused_jaxpr")
  api.inspect = pick([("jaxfuse", "inspect"), ("jaxfuse.inspection", "inspect")],
                     "inspect")
  if api.inspect is not None and not callable(api.inspect):
    api.inspect = getattr(api.inspect, "inspect", None)
  api.plan_region = pick([("jaxfuse.planner", "plan_region")], "plan_region")
  api.find_regions = pick([("jaxfuse.capture", "find_regions")], "find_regions")
  return api


def jaxfuse_path_note() -> str:
  """One line saying which path jaxfuse's regions take on this machine."""
  api = jaxfuse_api()
  if api.jit is None:
    return ("jaxfuse unavailable: jaxfuse.jit does not import "
            f"({api.errors}); the jaxfuse column is skipped")
  cfg = api.config
  if cfg is not None and getattr(cfg, "disable", False):
    return "jaxfuse disabled (JAXFUSE_DISABLE=1): jaxfuse.jit is exactly jax.jit"
  backend = getattr(cfg, "backend", "auto") if cfg is not None else "auto"
  if not on_gpu():
    if backend == "interpret":
      return ("jaxfuse on CPU: regions run the generated Triton kernels in "
              "Triton's interpreter (backend=interpret); times are meaningless")
    return ("jaxfuse on CPU: no GPU, so jaxfuse runs its fallback path "
            "(each captured region lowers to its original ops through XLA; "
            "no Triton kernels); times are not GPU numbers")
  if backend == "xla":
    return "jaxfuse on GPU with backend=xla: regions run their original ops"
  record = "off"
  if getattr(cfg, "launch", None) == "direct" and getattr(cfg, "record", False):
    try:
      from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
      record = "on" if direct_launch.records() else "off (this jaxlib cannot record launches)"
    except Exception as e:  # pylint: disable=broad-except  (a note, never the run)
      record = f"unknown ({type(e).__name__})"
  return (f"jaxfuse on GPU: regions lower to generated Triton kernels via "
          f"jax-triton (backend={backend}, tune={getattr(cfg, 'tune', '?')}, "
          f"launch={getattr(cfg, 'launch', '?')}, record={record})")


def count_regions(fn: Callable, args: tuple) -> Optional[int]:
  """Number of ``jaxfuse_region`` equations in jaxfuse's rewritten jaxpr."""
  api = jaxfuse_api()
  if api.fused_jaxpr is None:
    return None
  try:
    jaxpr = api.fused_jaxpr(fn)(*args)
    return str(jaxpr).count("jaxfuse_region")
  except Exception as e:
    logging.warning("fused_jaxpr failed: %s", e)
    return None


@contextlib.contextmanager
def jaxfuse_settings(tune: str, fresh_cache: bool):
  """jaxfuse's config for a run: the search mode and (optionally) a new cache."""
  api = jaxfuse_api()
  cfg = api.config
  if cfg is None:
    yield
    return
  kwargs = {}
  tmp = None
  if hasattr(cfg, "tune"):
    kwargs["tune"] = tune
  if fresh_cache and hasattr(cfg, "cache_dir"):
    tmp = tempfile.mkdtemp(prefix="jaxfuse-bench-cache-")
    kwargs["cache_dir"] = tmp
  try:
    with cfg.override(**kwargs):
      yield
  finally:
    if tmp:
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Cases and implementations
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
  """One workload.

  fn: the plain JAX function (what jax.jit and jaxfuse.jit compile); takes
    the arrays (pytrees allowed) that ``make_inputs`` returns.
  make_inputs(key, dtype) -> tuple of args; random, never zeros.
  flops / nbytes: useful FLOPs and the fewest bytes a call must move (inputs
    and outputs once), for the roofline.
  ref_fn: the reference (defaults to fn), evaluated on upcast inputs.
  """
  name: str
  fn: Callable[..., Any]
  make_inputs: Callable[[jax.Array, str], tuple]
  flops: float
  nbytes: float
  params: dict = dataclasses.field(default_factory=dict)
  ref_fn: Optional[Callable[..., Any]] = None
  group: str = ""

  @property
  def intensity(self) -> float:
    return self.flops / max(self.nbytes, 1.0)


class Impl:
  """A competitor. Subclasses say how to compile/run K calls and profile them."""
  name: str = "impl"
  needs_gpu: bool = False
  note: str = ""

  def unavailable(self) -> Optional[str]:
    """A reason the implementation cannot run here, or None."""
    if self.needs_gpu and not on_gpu():
      return "needs a GPU"
    return None

  def prepare(self, args: tuple) -> Any:
    return args

  def build(self) -> Callable[[list], Any]:
    raise NotImplementedError

  def build_timed(self, call_outputs: str) -> Optional[Callable[[list], Any]]:
    """The program the slope times, when it differs from ``build()``'s:
    for ``call_outputs='consumed'``, the same K calls with their outputs
    kept on the device, returning one element of each output leaf (call
    by call, leaf by leaf) so that the check can see it computed them."""
    return None

  def block(self, out: Any) -> None:
    raise NotImplementedError

  def per_call_numpy(self, out: Any, idx: Sequence[int]) -> dict[int, list[np.ndarray]]:
    """Output of the K-call function -> for calls ``idx``, leaves in case layout."""
    raise NotImplementedError

  def profile(self, runner: Callable, sets: list, iters: int) -> Optional["KernelStats"]:
    raise NotImplementedError


class JaxImpl(Impl):
  """A JAX function compiled by jax.jit or jaxfuse.jit.

  ``prepare`` maps the case's args to this implementation's (e.g. another
  layout; done once, outside timing); ``restore`` maps one call's output back
  to the case's layout for the reference check.
  """

  def __init__(self, name: str, fn: Callable, *, compiler: str = "jax",
               prepare: Optional[Callable] = None,
               restore: Optional[Callable] = None, needs_gpu: bool = False,
               note: str = "", check: Optional[Callable[[], Optional[str]]] = None):
    self.name = name
    self.fn = fn
    self.compiler = compiler
    self._prepare = prepare
    self._restore = restore
    self.needs_gpu = needs_gpu
    self.note = note
    self._check = check

  def unavailable(self) -> Optional[str]:
    r = super().unavailable()
    if r:
      return r
    if self.compiler == "jaxfuse" and jaxfuse_api().jit is None:
      return f"jaxfuse.jit does not import: {jaxfuse_api().errors}"
    if self._check is not None:
      return self._check()
    return None

  def prepare(self, args: tuple) -> Any:
    return tuple(self._prepare(*args)) if self._prepare else tuple(args)

  @property
  def reads_case_inputs(self) -> bool:
    """Whether ``prepare`` passes the case's arrays on as they are (no
    copies: the program can be timed alongside others on the same arrays)."""
    return self._prepare is None

  def build(self) -> Callable[[list], Any]:
    fn = self.fn

    def many(*sets):
      # Independent calls, unrolled: XLA sees K separate computations.
      return [fn(*s) for s in sets]

    compiled = self._jit(many)
    return lambda sets: compiled(*sets)

  def build_timed(self, call_outputs: str) -> Optional[Callable[[list], Any]]:
    from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
    if call_outputs == "returned":
      return None
    fn = self.fn

    def many_consumed(*sets):
      return timing.consume_outputs([fn(*s) for s in sets])

    compiled = self._jit(many_consumed)
    return lambda sets: compiled(*sets)

  def build_stacked(self, stacked: Any, consumed: bool) -> Callable[[list], Any]:
    """``build`` (``build_timed`` when ``consumed``) for
    ``--slope_inputs=stacked``: the program for n calls takes ``stacked``
    (``stack_sets`` of the prepared sets) and call i reads ``x[i]`` of each
    input, a static window. The runner takes the same ``sets[:n]`` as
    ``build``'s and uses only their count: set i is ``x[i]``.
    Why: jax's host work grows with a program's argument buffers (about 2 us
    each on the H100 host, twenty-fourth session), which the slope does not
    remove because K calls pass 3K of them."""
    from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
    fn = self.fn
    compiled: dict[int, Callable] = {}

    def program(n: int) -> Callable:
      def many(st):
        outs = [stacked_call(fn, i)(st) for i in range(n)]
        return timing.consume_outputs(outs) if consumed else outs
      return self._jit(many)

    def runner(sets: list) -> Any:
      n = len(sets)
      if n not in compiled:
        compiled[n] = program(n)
      return compiled[n](stacked)
    return runner

  def _jit(self, f: Callable) -> Callable:
    return jaxfuse_api().jit(f) if self.compiler == "jaxfuse" else jax.jit(f)

  def block(self, out: Any) -> None:
    jax.block_until_ready(out)

  def per_call_numpy(self, out: Any, idx: Sequence[int]) -> dict[int, list[np.ndarray]]:
    res = {}
    for i in idx:
      o = out[i]
      if self._restore is not None:
        o = self._restore(o)
      res[i] = [np.asarray(jnp.asarray(l, jnp.float32), np.float64)
                for l in jax.tree_util.tree_leaves(o)]
    return res

  def profile(self, runner, sets, iters):
    return jax_kernel_profile(lambda: self.block(runner(sets)), iters)


def stack_sets(sets: Sequence[Any]) -> Any:
  """One array per input leaf holding every set (``--slope_inputs=stacked``)."""
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *sets)


def stacked_call(fn: Callable, i: int) -> Callable[[Any], Any]:
  """``fn`` on set ``i`` of ``stack_sets``' result, read as static windows."""
  return lambda st: fn(*jax.tree_util.tree_map(lambda a: a[i], st))


class TorchImpl(Impl):
  """A PyTorch CUDA function timed by a Python loop (eager dispatch included)."""
  needs_gpu = True

  def __init__(self, name: str, fn: Callable, *, prepare: Callable,
               restore: Optional[Callable] = None, note: str = "",
               check: Optional[Callable[[], Optional[str]]] = None,
               context: Optional[Callable[[], Any]] = None):
    self.name = name
    self.fn = fn
    self._prepare = prepare
    self._restore = restore
    self.note = note
    self._check = check
    self._context = context   # e.g. a torch SDPA backend selector, entered per batch

  def unavailable(self) -> Optional[str]:
    r = torch_cuda_unavailable()
    if r:
      return r
    return self._check() if self._check else None

  def prepare(self, args: tuple) -> Any:
    return tuple(self._prepare(*args))

  def build(self):
    fn, context = self.fn, self._context

    def run(sets):
      with (context() if context else contextlib.nullcontext()):
        return [fn(*s) for s in sets]
    return run

  def block(self, out):
    import torch  # pylint: disable=g-import-not-at-top
    torch.cuda.synchronize()

  def per_call_numpy(self, out, idx):
    res = {}
    for i in idx:
      o = out[i]
      if self._restore is not None:
        o = self._restore(o)
      outs = o if isinstance(o, (tuple, list)) else [o]
      res[i] = [x.detach().float().cpu().numpy().astype(np.float64) for x in outs]
    return res

  def profile(self, runner, sets, iters):
    return torch_kernel_profile(lambda: self.block(runner(sets)), iters)


def torch_cuda_unavailable() -> Optional[str]:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except Exception as e:
    return f"torch does not import ({type(e).__name__})"
  if not torch.cuda.is_available():
    return "torch has no CUDA here"
  return None


def jax_to_torch(x):
  """Same values, zero-copy where possible (DLPack)."""
  import torch  # pylint: disable=g-import-not-at-top
  try:
    return torch.from_dlpack(x)
  except Exception:
    return torch.from_dlpack(jax.dlpack.to_dlpack(x))  # older jax


def xla_impl(fn: Callable, **kw) -> JaxImpl:
  """``jax.jit`` of the case's plain JAX function."""
  return JaxImpl("xla", fn, compiler="jax", note="jax.jit", **kw)


def jaxfuse_impl(fn: Callable, **kw) -> JaxImpl:
  """``jaxfuse.jit`` of the case's plain JAX function."""
  return JaxImpl("jaxfuse", fn, compiler="jaxfuse", note="jaxfuse.jit", **kw)


# ---------------------------------------------------------------------------
# Kernel profiles
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class KernelStats:
  total_us: float
  count: int
  memcpy_us: float = 0.0
  names: dict = dataclasses.field(default_factory=dict)   # name -> (count, us)
  # Per profiled execution: first kernel start to last kernel end (µs).
  spans_us: list = dataclasses.field(default_factory=list)


def execution_spans(kernels: Sequence[tuple[float, float]], executions: int) -> list[float]:
  """Device span of each execution (µs): from its first kernel's start to its
  last kernel's end, overlapping kernels and the gaps between dependent ones
  included. ``kernels`` are (start, duration) of ``executions`` runs of one
  program made one after the other (each waited for), so in start order the
  i-th equal slice belongs to the i-th run; no spans when they do not split
  evenly (a run's kernels could not be told apart).

  Why: on a host slower than the GPU (the H100 host of the seventh and eighth
  sessions), the slope per-call time of small kernels measures the host's
  launch work; the span measures what one call costs the GPU.
  """
  if executions < 1 or not kernels or len(kernels) % executions:
    return []
  ks = sorted(kernels)
  n = len(ks) // executions
  return [max(t + d for t, d in ks[i * n:(i + 1) * n]) - ks[i * n][0]
          for i in range(executions)]


_NON_KERNEL_THREADS = ("xla modules", "xla ops", "tensorflow ops", "steps",
                       "source", "framework", "launch stats", "tf ops")


def parse_perfetto(path: str, device: str = "/device:GPU:0",
                   executions: int = 0) -> Optional[KernelStats]:
  """Kernel time and count on ``device`` from a jax.profiler perfetto trace.

  Kernel events are ``"ph": "X"`` events (``dur`` in µs) on the process named
  ``device``. Annotation tracks on that process (XLA Ops/Modules, Steps) would
  double count, so when stream threads exist only they are read. Memcpy and
  memset events are reported apart from kernels. With ``executions`` (how
  many runs were traced), ``spans_us`` holds each run's device span
  (``execution_spans``). None when the device has no process in the trace
  (e.g. on a CPU).
  """
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  pids, threads = set(), {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name" and device in str(e.get("args", {}).get("name", "")):
      pids.add(e.get("pid"))
  if not pids:
    return None
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in pids:
      threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
  streams = {k for k, v in threads.items() if "stream" in v.lower()}

  def keep(e) -> bool:
    key = (e.get("pid"), e.get("tid"))
    if streams:
      return key in streams
    tname = threads.get(key, "").lower()
    return not any(t in tname for t in _NON_KERNEL_THREADS)

  stats = KernelStats(0.0, 0)
  intervals = []
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in pids or not keep(e):
      continue
    name = str(e.get("name", ""))
    dur = float(e.get("dur", 0.0))
    if name.lower().startswith(("memcpy", "memset")):
      stats.memcpy_us += dur
      continue
    stats.total_us += dur
    stats.count += 1
    intervals.append((float(e.get("ts", 0.0)), dur))
    c, u = stats.names.get(name, (0, 0.0))
    stats.names[name] = (c + 1, u + dur)
  stats.spans_us = execution_spans(intervals, executions)
  return stats


def jax_kernel_profile(run_once: Callable[[], None], iters: int) -> Optional[KernelStats]:
  """Runs ``run_once`` ``iters`` times under jax.profiler; GPU kernel totals."""
  with tempfile.TemporaryDirectory(prefix="jaxfuse-trace-") as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(iters):
        run_once()
    paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      return None
    return parse_perfetto(sorted(paths)[-1], executions=iters)


def parse_torch_trace(path: str) -> KernelStats:
  """Kernel totals from a torch.profiler chrome trace (``cat == "kernel"``)."""
  with open(path) as f:
    data = json.load(f)
  stats = KernelStats(0.0, 0)
  for e in data.get("traceEvents", []):
    cat = str(e.get("cat", "")).lower()
    if e.get("ph") != "X":
      continue
    if cat in ("gpu_memcpy", "gpu_memset"):
      stats.memcpy_us += float(e.get("dur", 0.0))
    elif cat == "kernel":
      stats.total_us += float(e.get("dur", 0.0))
      stats.count += 1
      name = str(e.get("name", ""))
      c, u = stats.names.get(name, (0, 0.0))
      stats.names[name] = (c + 1, u + float(e.get("dur", 0.0)))
  return stats


def torch_kernel_profile(run_once: Callable[[], None], iters: int) -> Optional[KernelStats]:
  """Device time of ``iters`` runs from CUDA events around the whole batch.

  torch.profiler is not used: it subscribes CUPTI for the rest of the
  process, after which jax.profiler fails (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_
  NOT_SUPPORTED, seen on the H200 on 2026-11-21) and every later case would
  lose its kernel times. Back-to-back launches keep the GPU busy, so events
  around them bound the kernel time from above; the kernel count is unknown
  (reported as 0).
  """
  import torch  # pylint: disable=g-import-not-at-top
  run_once()
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(iters):
    run_once()
  end.record()
  torch.cuda.synchronize()
  return KernelStats(float(start.elapsed_time(end)) * 1e3, 0)


# ---------------------------------------------------------------------------
# Inputs, reference, errors
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def _x64():
  """float64 in JAX for the CPU reference (jax.enable_x64 moved over time)."""
  cm = None
  try:
    cm = jax.enable_x64(True)
  except Exception:
    try:
      from jax.experimental import enable_x64  # pylint: disable=g-import-not-at-top
      cm = enable_x64()
    except Exception:
      cm = None
  if cm is None:
    yield False
    return
  with cm:
    yield True


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def reference(case: Case, args: tuple) -> tuple[list[np.ndarray], str, list[str]]:
  """The case's function on upcast inputs: float32 on GPU, float64 on CPU.
  Returns its output leaves, how they were computed, and the leaves'
  pytree paths (``[1][0]['wq']``; ``output`` for a single array), which
  name the leaves in ``judge_errors``' report."""
  fn = case.ref_fn or case.fn
  host = jax.tree_util.tree_map(lambda a: np.asarray(jnp.asarray(a, jnp.float32))
                                if _is_float(a) else np.asarray(a), args)
  if not on_gpu():
    with _x64() as ok:
      if ok:
        up = jax.tree_util.tree_map(
            lambda a: jnp.asarray(a, jnp.float64) if a.dtype.kind == "f" else jnp.asarray(a),
            host)
        out = jax.jit(fn)(*up)
        leaves, names = _named_leaves(out)
        return leaves, "float64", names
  up = jax.tree_util.tree_map(jnp.asarray, host)
  with jax.default_matmul_precision("highest"):
    out = jax.jit(fn)(*up)
  leaves, names = _named_leaves(out)
  return leaves, "float32 (highest matmul precision)", names


def _named_leaves(out: Any) -> tuple[list[np.ndarray], list[str]]:
  flat = jax.tree_util.tree_flatten_with_path(out)[0]
  return ([np.asarray(l, np.float64) for _, l in flat],
          [jax.tree_util.keystr(p) or "output" for p, _ in flat])


def check_consumed(samples: Any, out: Any, tol: float) -> None:
  """The timed (outputs consumed) program computed what the checked one
  returned: its samples are the first element of each call's output leaves
  (``Impl.build_timed``). Raises on a mismatch."""
  leaves = [np.asarray(jnp.asarray(l, jnp.float32), np.float64)
            for o in out for l in jax.tree_util.tree_leaves(o)]
  got = np.asarray(samples, np.float64)
  want = np.array([l.reshape(-1)[0] for l in leaves])
  scale = np.array([max(float(np.max(np.abs(l))), 1e-30) for l in leaves])
  if got.shape != want.shape or not np.all(np.abs(got - want) <= 2 * tol * scale):
    raise AssertionError(f"timed program's samples {got[:4]} differ from the checked "
                         f"outputs {want[:4]}")


def leaf_errors(outs: Sequence[np.ndarray], refs: Sequence[np.ndarray]) -> list[float]:
  """Each output leaf's normwise relative error (``rel_error`` of that leaf
  alone; a leaf whose reference is all zeros is measured against 1e-30)."""
  if len(outs) != len(refs):
    return [math.inf] * len(refs)
  return [rel_error([o], [r])[0] for o, r in zip(outs, refs)]


def rel_error(outs: Sequence[np.ndarray], refs: Sequence[np.ndarray]) -> tuple[float, float]:
  """(normwise relative error, max abs error / max |ref|) over all leaves."""
  if len(outs) != len(refs):
    return math.inf, math.inf
  num = den = 0.0
  mx = mref = 0.0
  for o, r in zip(outs, refs):
    o = np.asarray(o, np.float64)
    r = np.asarray(r, np.float64)
    if o.shape != r.shape:
      return math.inf, math.inf
    if not np.all(np.isfinite(o)) and np.all(np.isfinite(r)):
      return math.inf, math.inf
    fin = np.isfinite(r)
    d = np.where(fin, o - r, 0.0)
    num += float(np.sum(d * d))
    den += float(np.sum(np.where(fin, r, 0.0) ** 2))
    mx = max(mx, float(np.max(np.abs(d))) if d.size else 0.0)
    mref = max(mref, float(np.max(np.abs(np.where(fin, r, 0.0)))) if r.size else 0.0)
  return math.sqrt(num / max(den, 1e-300)), mx / max(mref, 1e-300)


def normal(key, shape, dtype: str, scale: float = 1.0) -> jax.Array:
  """Random normal input in ``dtype`` (never zeros)."""
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def tree_nbytes(tree) -> int:
  return int(sum(getattr(l, "nbytes", 0) for l in jax.tree_util.tree_leaves(tree)))


# ---------------------------------------------------------------------------
# Running one case
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Settings:
  dtype: str = "float16"
  reps: int = 10
  max_reps: int = 10
  min_window_ms: float = 50.0
  calls: int = 0
  mem_budget_gb: float = 4.0
  profile: str = "auto"
  tune: str = "auto"
  call_outputs: str = "consumed"
  slope_inputs: str = "separate"
  slope_order: str = "sequential"
  seed: int = 0
  fresh_cache: bool = True
  tol: float = 0.0
  profile_iters: int = 3
  details: bool = True

  @classmethod
  def from_flags(cls) -> "Settings":
    return cls(dtype=FLAGS.dtype, reps=max(1, FLAGS.reps), max_reps=FLAGS.max_reps,
               calls=FLAGS.calls,
               min_window_ms=max(0.0, FLAGS.min_window_ms),
               mem_budget_gb=FLAGS.mem_budget_gb, profile=FLAGS.profile,
               tune=FLAGS.tune, call_outputs=FLAGS.call_outputs,
               slope_inputs=FLAGS.slope_inputs, slope_order=FLAGS.slope_order,
               seed=FLAGS.seed, fresh_cache=FLAGS.fresh_cache,
               tol=FLAGS.tol, details=FLAGS.jaxfuse_details)

  @property
  def do_profile(self) -> bool:
    return self.profile == "on" or (self.profile == "auto" and on_gpu())


# A call whose roofline floor is at least this long is timed with K=2: its
# 8-call program runs 0.4 ms or more (and each timing window repeats it to
# 10 ms), while the unrolled program grows
# with K (BERT-Base b1 at K=6, 24 forwards in one program, compiled for more
# than 200 s on the H100 host; at K=2 both compilers took 123 s together).
HEAVY_CALL_FLOOR_S = 50e-6


def choose_calls(bytes_per_set: int, settings: Settings, floor_s: float = 0.0) -> int:
  """K for the slope method: as many calls as fit 4K input sets in the
  budget, at most 16, and 2 for calls whose floor is ``HEAVY_CALL_FLOOR_S``
  or more; ``--calls`` overrides."""
  if settings.calls > 0:
    return settings.calls
  if not on_gpu():
    return 2   # CPU runs are smoke tests
  budget = settings.mem_budget_gb * 2**30
  k = int(budget // max(4 * bytes_per_set, 1))
  if floor_s >= HEAVY_CALL_FLOOR_S:
    k = min(k, 2)
  return int(min(16, max(1, k)))


def slope_time(runner: Callable[[list], Any], block: Callable[[Any], None],
               sets: list, k: int, reps: int, min_window_ms: float = 50.0,
               max_reps: int = 0) -> dict:
  """Per-call seconds: slope between K and 4K calls, median over reps
  (``jaxfuse.runtime.timing.slope``: each window repeats the program until
  it lasts ``min_window_ms``, at most 256 times).

  Why 50 ms (10 ms before the twenty-fourth session): a BERT-Base forward
  program of 8 calls runs 8 ms, so a 10 ms window held one or two
  executions, and one slow execution decided the rep (jaxfuse per-call
  spread 0.70 on the H100, benchmarks/RESULTS.md).

  ``max_reps``: repetitions taken while they disagree (``timing.slopes``).
  """
  return slope_times([(runner, block, sets)], k, reps, min_window_ms, max_reps)[0]


def slope_times(timed: Sequence[tuple[Callable[[list], Any], Callable[[Any], None], list]],
                k: int, reps: int, min_window_ms: float = 50.0,
                max_reps: int = 0) -> list[dict]:
  """``slope_time`` of several (runner, block, sets), their windows
  interleaved repetition by repetition (``jaxfuse.runtime.timing.slopes``)."""
  from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
  return timing.slopes([lambda n, r=r, s=s: r(s[:n]) for r, _, s in timed],
                       [b for _, b, _ in timed], lo=k, hi=4 * k, reps=reps,
                       min_window_s=min_window_ms * 1e-3, max_reps=max_reps)


def _derived(res: dict, case: Case, roof: Roof) -> None:
  floor = roof.floor_s(case.flops, case.nbytes)
  for key, t in (("per_call", res.get("per_call_s")), ("kernel", res.get("kernel_s"))):
    if t and t > 0:
      res[f"{key}_tflops"] = case.flops / t / 1e12
      res[f"{key}_gbs"] = case.nbytes / t / 1e9
      res[f"{key}_floor_frac"] = floor / t


def region_outcomes(case: Case, args: tuple, fn: Optional[Callable] = None
                    ) -> Optional[list[tuple[Any, Any]]]:
  """The regions jaxfuse captures in ``case`` (``fn``, default ``case.fn``,
  traced once on ``args``), each with how this process's compile lowered it
  (``jaxfuse.runtime.launch.Outcome``; None for a region it did not: the
  CPU path runs regions' original ops without lowering them). None when
  jaxfuse's capture does not import."""
  api = jaxfuse_api()
  if api.find_regions is None:
    return None
  launch = sys.modules.get("jaxfuse.runtime.launch")   # imported by a lowering only
  caps = api.find_regions(jax.make_jaxpr(fn or case.fn)(*args))
  return [(cap, launch.outcome(cap.region) if hasattr(launch, "outcome") else None)
          for cap in caps]


def join_counted(texts: Iterable[str]) -> str:
  """``texts`` joined by "; ", each distinct text once, in first-seen order,
  with " (xN)" where it came N > 1 times (a model's layers repeat a region).

  Example::

    join_counted(["a", "b", "a"]) == "a (x2); b"
  """
  counts = collections.Counter()
  order = []
  for t in texts:
    if t not in counts:
      order.append(t)
    counts[t] += 1
  return "; ".join(t if counts[t] == 1 else f"{t} (x{counts[t]})" for t in order)


def lowered(regions: Optional[list[tuple[Any, Any]]]) -> Optional[list[str]]:
  """What jaxfuse.jit ran for each of ``regions`` (``region_outcomes``): its
  kernel's plan or why XLA's ops run (under --tune=measure with the
  keep-or-drop timing); None where nothing was lowered."""
  if not regions or all(o is None for _, o in regions):
    return None
  return [str(o) + _parts_lowered(cap, o) if o is not None else "not lowered"
          for cap, o in regions]


def _parts_lowered(cap: Any, outcome: Any) -> str:
  """For a chain left to XLA: how its parts (captured again with fewer
  contractions, ``jaxfuse.runtime.primitive._lower_parts``) were lowered."""
  launch = sys.modules.get("jaxfuse.runtime.launch")
  n = len(cap.region.contractions)
  if outcome.fused or n < 2 or not hasattr(launch, "outcome"):
    return ""
  try:
    parts = jaxfuse_api().find_regions(cap.jaxpr, max_contractions=n - 1)
  except TypeError:   # a jaxfuse without parts
    return ""
  done = [launch.outcome(p.region) for p in parts]
  return "".join(f"; part {p.region.einsum_summary()}: {o}" for p, o in zip(parts, done)
                 if o is not None)


def plans_run(regions: Optional[list[tuple[Any, Any]]]) -> Optional[str]:
  """The plans jaxfuse.jit compiled for ``regions`` (``region_outcomes``),
  "XLA's ops" for a region it left to XLA: under ``--tune=measure`` they are
  the measured choices, which can differ from the model's plans in
  ``plans``. Regions not lowered in this process (the CPU path) read the
  plan cache the compile filled."""
  api = jaxfuse_api()
  if api.plan_region is None or regions is None:
    return None
  names = []
  for cap, o in regions:
    if o is not None:
      names.append(o.plan if o.fused else "XLA's ops")
    else:
      best = api.plan_region(cap.region).best
      if best is not None:
        names.append(str(best))
  return "; ".join(names) or None


def jaxfuse_details(fn: Callable, args: tuple, settings: Settings) -> dict:
  """Regions, plans, predictions, planning and tuning time for one call of
  ``fn`` (an implementation's function) on ``args``."""
  api = jaxfuse_api()
  info: dict[str, Any] = {"path": jaxfuse_path_note()}
  n = count_regions(fn, args)
  if n is not None:
    info["regions"] = n
  if api.inspect is not None:
    try:
      rep = api.inspect(fn, *args)
      regs = []
      for r in getattr(rep, "regions", []) or []:
        g = lambda a, r=r: getattr(r, a, None)
        plan = g("plan")
        # What this process's compile ran, where it differs from the
        # planner's first plan (a plan whose self-check failed, a kernel
        # form switched off by JAXFUSE_KERNEL_FORMS=0).
        lowered = str(g("lowered") or "")
        if lowered.startswith("fused") and ": " in lowered:
          plan = lowered.split(": ", 1)[1]
        regs.append({
            "einsum": str(g("einsum")), "source": str(g("source")),
            "loops": dict(g("loops") or {}), "flops": g("flops"),
            "min_bytes": g("min_bytes"), "intensity": g("intensity"),
            "ridge": g("ridge"), "mbci": g("mbci"), "device": str(g("device")),
            "plan": None if plan is None else str(plan),
            "predicted_time_s": g("predicted_time_s"),
            "floor_time_s": g("floor_time_s"), "unfused_time_s": g("unfused_time_s"),
            "why_not": g("why_not"),
            "plan_time_s": g("plan_time_s"), "tune_time_s": g("tune_time_s"),
            "notes": [str(x) for x in (g("notes") or [])],
        })
      info["inspect"] = regs
      # What the model says runs: a region it leaves to XLA costs its
      # separate kernels, not the fused plan it rejected (BERT-Base b1 summed
      # 11 rejected 63.9 us MLP plans into an 858 us "prediction").
      preds = [(r["unfused_time_s"] if r["why_not"] and r["unfused_time_s"] else
                r["predicted_time_s"]) for r in regs]
      preds = [p for p in preds if p]
      if preds:
        info["predicted_s"] = float(sum(preds))
      info["plans"] = "; ".join(r["plan"] for r in regs if r["plan"]) or None
      info["why_not"] = join_counted(str(r["why_not"]) for r in regs if r["why_not"]) or None
    except Exception as e:
      info["inspect_error"] = f"{type(e).__name__}: {e}"
  # This runs before the first compile, on the run's fresh cache, so the
  # inspector's planning is cold and its plan_time_s is the planning time.
  regs = info.get("inspect") or []
  if regs and all(r["plan_time_s"] is not None for r in regs):
    info["plan_s"] = float(sum(r["plan_time_s"] for r in regs))
  need_plan = "plan_s" not in info
  need_tune = settings.tune == "measure" and on_gpu()
  if (need_plan or need_tune) and api.plan_region is not None and api.find_regions is not None:
    try:
      caps = api.find_regions(jax.make_jaxpr(fn)(*args))
      plan_s, tune_s = 0.0, 0.0
      for cap in caps:
        if need_plan:
          t0 = time.perf_counter()
          res = api.plan_region(cap.region, use_cache=False)
          plan_s += float(getattr(res, "plan_time_s", None) or time.perf_counter() - t0)
        if need_tune:
          # Measured refinement (MCFuser Alg. 1) with the code generator's
          # measuring function, as jaxfuse.jit runs it under tune=measure.
          measure = make_plan_measure(cap.region)
          t0 = time.perf_counter()
          api.plan_region(cap.region, measure=measure, use_cache=False)
          tune_s += time.perf_counter() - t0
      if need_plan:
        info["plan_s"] = plan_s
      if need_tune:
        info["tune_s"] = tune_s
    except Exception as e:
      info["plan_error"] = f"{type(e).__name__}: {e}"
  return info


def run_case(case: Case, impls: Sequence[Impl], settings: Settings, roof: Roof) -> dict:
  """Measures every implementation on one case; returns the row."""
  row: dict[str, Any] = {
      "case": case.name, "group": case.group, "params": case.params,
      "dtype": settings.dtype, "flops": case.flops, "bytes": case.nbytes,
      "intensity": case.intensity,
      "floor_s": roof.floor_s(case.flops, case.nbytes), "impls": {},
  }
  key = jax.random.PRNGKey(settings.seed)
  key = jax.random.fold_in(key, abs(hash(case.name)) % (2**31))
  first = case.make_inputs(jax.random.fold_in(key, 0), settings.dtype)
  k = choose_calls(tree_nbytes(first), settings, row["floor_s"])
  row["calls"] = k
  sets = [first] + [case.make_inputs(jax.random.fold_in(key, i), settings.dtype)
                    for i in range(1, 4 * k)]
  jax.block_until_ready(sets)
  check_idx = sorted({0, k - 1})
  refs = {i: reference(case, sets[i]) for i in check_idx}
  row["reference"] = refs[0][1]
  tol = settings.tol or TOLERANCE[settings.dtype]
  if not on_gpu() and settings.dtype == "float32":
    tol = settings.tol or 1e-4

  # JAX programs that read the case's inputs as they are: their per-call
  # windows are timed together after the loop (``--slope_order``).
  together: list[tuple[Impl, Callable, list, dict]] = []
  for impl in impls:
    res: dict[str, Any] = {"note": impl.note}
    row["impls"][impl.name] = res
    why = impl.unavailable()
    if why:
      res["status"] = f"skipped: {why}"
      continue
    try:
      prepared = [impl.prepare(s) for s in sets]
      stacked = (stack_sets(prepared) if settings.slope_inputs == "stacked"
                 and isinstance(impl, JaxImpl) else None)
      runner = impl.build_stacked(stacked, False) if stacked is not None else impl.build()
      # jaxfuse plans at compile time: both the K and the 4K function (and
      # the inspection) must see the same settings.
      is_jaxfuse = isinstance(impl, JaxImpl) and impl.compiler == "jaxfuse"
      ctx = (jaxfuse_settings(settings.tune, settings.fresh_cache)
             if is_jaxfuse else contextlib.nullcontext())
      with ctx:
        if is_jaxfuse:
          # The implementation's own function and inputs: a jaxfuse
          # baseline may compile another form of the case (attention.py's
          # jaxfuse-dpa) in another layout.
          res["jaxfuse"] = (jaxfuse_details(impl.fn, prepared[0], settings) if settings.details
                            else {"path": jaxfuse_path_note(),
                                  "regions": count_regions(impl.fn, prepared[0])})
        t0 = time.perf_counter()
        out = runner(prepared[:k])
        impl.block(out)
        res["compile_s"] = time.perf_counter() - t0
        # The reference check reads the outputs of the very function we time.
        per_call = impl.per_call_numpy(out, check_idx)
        errs = [rel_error(per_call[i], refs[i][0]) for i in check_idx]
        res["rel_err"] = max(e[0] for e in errs)
        res["max_err"] = max(e[1] for e in errs)
        if len(refs[check_idx[0]][0]) > 1:
          res["leaf_err"] = [max(es) for es in zip(*(leaf_errors(per_call[i], refs[i][0])
                                                    for i in check_idx))]
        timed = impl.build_timed(settings.call_outputs)
        if stacked is not None and timed is not None:
          timed = impl.build_stacked(stacked, True)
        if timed is not None:
          check_consumed(timed(prepared[:k]), out, tol)
        else:
          timed = runner
        impl.block(timed(prepared[:4 * k]))   # compile/warm 4K
        if is_jaxfuse and "jaxfuse" in res:
          try:
            # What ran: in stacked mode the regions read windows of x[i].
            regions = (region_outcomes(case, prepared[0], impl.fn) if stacked is None else
                       region_outcomes(case, (stacked,), stacked_call(impl.fn, 0)))
            res["jaxfuse"]["lowered"] = lowered(regions)
            if settings.tune == "measure":
              res["jaxfuse"]["plans_run"] = plans_run(regions)
          except Exception as e:  # pylint: disable=broad-except  (a report, never the run)
            res["jaxfuse"]["lowered"] = [f"unknown ({type(e).__name__}: {e})"]
        if (settings.slope_order == "interleaved" and stacked is None
            and isinstance(impl, JaxImpl) and impl.reads_case_inputs):
          together.append((impl, timed, prepared, res))
          res["slope_order"] = "interleaved"
        else:
          res.update(slope_time(timed, impl.block, prepared, k, settings.reps,
                                settings.min_window_ms, settings.max_reps))
          res["slope_order"] = "alone"
        res["call_outputs"] = settings.call_outputs if timed is not runner else "returned"
        res["slope_inputs"] = "separate" if stacked is None else "stacked"
        if settings.do_profile:
          ks = impl.profile(runner, prepared[:k], settings.profile_iters)
          if ks is not None and (ks.count > 0 or ks.total_us > 0):
            n = settings.profile_iters * k
            res["kernel_s"] = ks.total_us / n * 1e-6
            # CUDA-event timing (torch) knows the time but not the count.
            res["kernels"] = ks.count / n if ks.count else None
            res["memcpy_s"] = ks.memcpy_us / n * 1e-6
            if ks.spans_us:
              # What one call costs the GPU, host launch work aside.
              res["device_call_s"] = statistics.median(ks.spans_us) / k * 1e-6
            top = sorted(ks.names.items(), key=lambda kv: -kv[1][1])[:6]
            res["kernel_names"] = {nm[:80]: round(u / n, 3) for nm, (c, u) in top}
          else:
            res["kernel_s"] = None
      _derived(res, case, roof)
      res["status"] = "ok"
      del prepared, out
    except Exception as e:  # one broken baseline must not end the run
      res["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
      logging.warning("%s/%s failed:\n%s", case.name, impl.name, traceback.format_exc())
  _time_together(together, k, settings, case, roof)

  judge_errors(row["impls"], tol, refs[check_idx[0]][2])
  row["tolerance"] = tol
  _speedups(row)
  return row


def _time_together(together: list[tuple["Impl", Callable, list, dict]], k: int,
                   settings: Settings, case: Case, roof: Roof) -> None:
  """Per-call times of ``run_case``'s deferred implementations, their
  windows interleaved (``slope_times``). Where that fails, each is timed
  alone, and one that fails then too gets an error status."""
  ok = [(impl, timed, prepared, res) for impl, timed, prepared, res in together
        if res.get("status") == "ok"]
  if not ok:
    return
  try:
    times = slope_times([(t, impl.block, p) for impl, t, p, _ in ok], k, settings.reps,
                        settings.min_window_ms, settings.max_reps)
  except Exception as e:  # pylint: disable=broad-except  (then one by one)
    logging.warning("%s: interleaved timing failed (%s: %s); timing each alone",
                    case.name, type(e).__name__, e)
    times = None
  for i, (impl, timed, prepared, res) in enumerate(ok):
    try:
      if times is None:
        res["slope_order"] = "alone"
        res.update(slope_time(timed, impl.block, prepared, k, settings.reps,
                              settings.min_window_ms, settings.max_reps))
      else:
        res.update(times[i])
      _derived(res, case, roof)
    except Exception as e:  # pylint: disable=broad-except
      res["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
      logging.warning("%s/%s failed:\n%s", case.name, impl.name, traceback.format_exc())


def _speedups(row: dict) -> None:
  jf = row["impls"].get("jaxfuse", {})
  sp = {}
  for name, res in row["impls"].items():
    if name == "jaxfuse":
      continue
    for key in ("per_call_s", "kernel_s", "device_call_s"):
      a, b = jf.get(key), res.get(key)
      if a and b and a > 0 and b > 0:
        sp.setdefault(name, {})[key.replace("_s", "")] = b / a
  row["jaxfuse_speedup"] = sp


# ---------------------------------------------------------------------------
# Summary, output, plots
# ---------------------------------------------------------------------------

def geomean(xs: Iterable[float]) -> Optional[float]:
  xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
  if not xs:
    return None
  return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(rows: list[dict]) -> dict:
  """Geometric-mean speedups of jaxfuse over each baseline, and losses."""
  names = sorted({n for r in rows for n in r["jaxfuse_speedup"]})
  out: dict[str, Any] = {"geomean_speedup": {}, "slower_than": {}}
  for n in names:
    for key in ("per_call", "kernel", "device_call"):
      vals = [r["jaxfuse_speedup"].get(n, {}).get(key) for r in rows]
      g = geomean(v for v in vals if v)
      if g is not None:
        out["geomean_speedup"].setdefault(n, {})[key] = g
        out["geomean_speedup"][n][f"{key}_cases"] = sum(1 for v in vals if v)
    out["slower_than"][n] = [r["case"] for r in rows
                             if r["jaxfuse_speedup"].get(n, {}).get("per_call", 2) < 1.0]
  out["mismatches"] = [f"{r['case']}/{n}" for r in rows for n, res in r["impls"].items()
                       if res.get("correct") is False]
  out["leaf_mismatches"] = [f"{r['case']}/{n}: {res['leaf_mismatch']}" for r in rows
                            for n, res in r["impls"].items() if "leaf_mismatch" in res]
  out["unchecked"] = [f"{r['case']}/{n}" for r in rows for n, res in r["impls"].items()
                      if "unchecked" in res]
  out["errors"] = [f"{r['case']}/{n}: {res['status']}" for r in rows
                   for n, res in r["impls"].items() if res.get("status", "").startswith("error")]
  return out


def _us(x) -> str:
  if x is None:
    return "-"
  us = x * 1e6
  return f"{us:.1f}" if abs(us) >= 10 else f"{us:.2f}"


def _f(x, fmt="{:.2f}") -> str:
  return "-" if x is None else fmt.format(x)


def markdown_table(rows: list[dict]) -> str:
  hdr = ("| case | impl | per-call µs | kernel µs | device µs/call | kernels | TFLOP/s | GB/s | "
         "floor µs | % of floor | rel err | jaxfuse speedup (call / kernel / device) | status |")
  lines = [hdr, "|" + " --- |" * (hdr.count("|") - 1)]
  for r in rows:
    for name, res in r["impls"].items():
      sp = r["jaxfuse_speedup"].get(name, {})
      spd = (f"{_f(sp.get('per_call'))}x / {_f(sp.get('kernel'))}x / "
             f"{_f(sp.get('device_call'))}x" if sp else "")
      frac = res.get("per_call_floor_frac")
      status = res.get("status", "")
      if res.get("correct") is False:
        status = "WRONG ANSWER"
      elif "unchecked" in res:
        status = "UNCHECKED"
      lines.append(
          f"| {r['case']} | {name} | {_us(res.get('per_call_s'))} | "
          f"{_us(res.get('kernel_s'))} | {_us(res.get('device_call_s'))} | "
          f"{_f(res.get('kernels'), '{:.1f}')} | "
          f"{_f(res.get('per_call_tflops'))} | {_f(res.get('per_call_gbs'), '{:.0f}')} | "
          f"{_us(r['floor_s'])} | {_f(None if frac is None else 100 * frac, '{:.1f}')} | "
          f"{_f(res.get('rel_err'), '{:.1e}')} | {spd} | {status} |")
  return "\n".join(lines)


def run_in_child(script: str, case: str, prefix: str, isolate_flag: str,
                 timeout_s: float) -> tuple[Optional[dict], str, str]:
  """Binary ``script`` for one ``case`` in a fresh process (a kernel fault
  poisons the CUDA context for the rest of a process): this process's own
  flags but ``--cases``, ``--out`` and ``--[no]<isolate_flag>``, writing
  ``<prefix>.<case>.json``. Returns (its first row or None, why not, its
  stdout)."""
  child = f"{prefix}.{case}"
  drop = ("--cases", "--out", f"--{isolate_flag}", f"--no{isolate_flag}")
  keep = [a for a in sys.argv[1:] if a.split("=")[0] not in drop]
  argv = [sys.executable, os.path.abspath(script), *keep, f"--cases={case}", f"--out={child}",
          f"--no{isolate_flag}"]
  try:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return None, "child process timed out", ""
  try:
    with open(child + ".json") as f:
      return json.load(f)["rows"][0], "", p.stdout
  except (OSError, ValueError, KeyError, IndexError):
    return None, f"child exited {p.returncode}: {(p.stderr or p.stdout or '')[-800:]}", p.stdout


def default_out(binary: str, dtype: str) -> str:
  dev = _table_name(_device_kind()) if on_gpu() else "cpu"
  return os.path.join(REPO_ROOT, "benchmarks", "results", f"{binary}-{dev}-{dtype}")


def _flat(prefix: str, d: dict, out: dict) -> None:
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      _flat(key + ".", v, out)
    elif isinstance(v, (list, tuple)):
      out[key] = json.dumps(v, default=str)
    else:
      out[key] = v


def write_outputs(prefix: str, meta: dict, rows: list[dict], summary: dict) -> list[str]:
  """Writes <prefix>.json (everything) and <prefix>.csv (one line per case x impl)."""
  os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1,
              default=str)
  flat_rows = []
  for r in rows:
    for name, res in r["impls"].items():
      d = {"case": r["case"], "group": r["group"], "impl": name, "dtype": r["dtype"],
           "flops": r["flops"], "bytes": r["bytes"], "intensity": r["intensity"],
           "floor_s": r["floor_s"], "calls": r.get("calls")}
      _flat("param.", r["params"], d)
      res2 = {k: v for k, v in res.items() if k not in ("kernel_names",)}
      jf = res2.pop("jaxfuse", None)
      _flat("", res2, d)
      if jf:
        d.update({f"jaxfuse.{k}": "; ".join(v) if isinstance(v, list) else v
                  for k, v in jf.items()
                  if k in ("regions", "plans", "predicted_s", "plan_s", "tune_s", "why_not",
                           "plans_run", "lowered")})
      for k, v in r["jaxfuse_speedup"].get(name, {}).items():
        d[f"jaxfuse_speedup.{k}"] = v
      flat_rows.append(d)
  keys: list[str] = []
  for d in flat_rows:
    for k in d:
      if k not in keys:
        keys.append(k)
  with open(prefix + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    for d in flat_rows:
      w.writerow(d)
  return [prefix + ".json", prefix + ".csv"]


_MARKERS = "o^sDv<>pP*hX"


def plot(prefix: str, rows: list[dict], roof: Roof, title: str) -> list[str]:
  """Roofline chart of every case x impl, and a bar chart of jaxfuse speedups."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = []
  for r in rows:
    for n in r["impls"]:
      if n not in names:
        names.append(n)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  paths = []

  fig, ax = plt.subplots(figsize=(9, 6))
  xs = [r["intensity"] for r in rows] or [1.0]
  lo, hi = min(xs + [1.0]) / 2, max(xs + [roof.ridge * 4]) * 2
  grid = np.geomspace(lo, hi, 200)
  ax.plot(grid, np.minimum(roof.peak_flops, roof.bandwidth * grid) / 1e12, "k-",
          lw=1.5, label=f"roof {roof.name}: {roof.peak_flops/1e12:.0f} TFLOP/s, "
          f"{roof.bandwidth/1e12:.1f} TB/s")
  for i, n in enumerate(names):
    px, py, kx, ky = [], [], [], []
    for r in rows:
      res = r["impls"].get(n, {})
      if res.get("per_call_tflops"):
        px.append(r["intensity"]); py.append(res["per_call_tflops"])
      if res.get("kernel_tflops"):
        kx.append(r["intensity"]); ky.append(res["kernel_tflops"])
    c, m = colors[i % len(colors)], _MARKERS[i % len(_MARKERS)]
    if px:
      ax.scatter(px, py, color=c, marker=m, label=f"{n} (per call)", alpha=0.85)
    if kx:
      ax.scatter(kx, ky, facecolors="none", edgecolors=c, marker=m,
                 label=f"{n} (kernel time)", alpha=0.85)
  for r in rows:
    res = r["impls"].get("jaxfuse", {})
    if res.get("per_call_tflops"):
      ax.annotate(r["case"], (r["intensity"], res["per_call_tflops"]), fontsize=6,
                  xytext=(3, 3), textcoords="offset points")
  ax.set_xscale("log"); ax.set_yscale("log")
  ax.set_xlabel("arithmetic intensity (FLOP / byte, minimum traffic)")
  ax.set_ylabel("achieved TFLOP/s")
  ax.set_title(f"{title}: roofline ({roof.timed_on})")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  p = prefix + "_roofline.png"
  fig.savefig(p, dpi=120)
  plt.close(fig)
  paths.append(p)

  base = [n for n in names if n != "jaxfuse"]
  fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.6 * len(rows) * max(1, len(base)) / 2), 11),
                           sharex=True)
  xi = np.arange(len(rows))
  for ax, key, lab in ((axes[0], "per_call", "per-call time"),
                       (axes[1], "kernel", "GPU kernel time"),
                       (axes[2], "device_call", "device span per call")):
    have = [n for n in base
            if any(r["jaxfuse_speedup"].get(n, {}).get(key) for r in rows)]
    width = 0.8 / max(1, len(have))
    for j, n in enumerate(have):
      vals = [r["jaxfuse_speedup"].get(n, {}).get(key, np.nan) for r in rows]
      g = geomean(v for v in vals if not np.isnan(v))
      ax.bar(xi + j * width - 0.4 + width / 2, vals, width,
             color=colors[(names.index(n)) % len(colors)],
             label=f"vs {n}" + (f" (geomean {g:.2f}x)" if g else ""))
    ax.axhline(1.0, color="k", lw=1)
    if not have:
      ax.text(0.5, 0.5, f"no {lab} for jaxfuse and a baseline in this run",
              transform=ax.transAxes, ha="center", va="center")
      ax.set_ylabel(f"jaxfuse speedup\n({lab})")
      continue
    ax.set_yscale("log")
    ax.set_ylabel(f"jaxfuse speedup\n({lab})")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
  axes[-1].set_xticks(xi)
  axes[-1].set_xticklabels([r["case"] for r in rows], rotation=60, ha="right", fontsize=7)
  axes[0].set_title(f"{title}: jaxfuse speedup over each baseline ({roof.timed_on})")
  fig.tight_layout()
  p = prefix + "_speedup.png"
  fig.savefig(p, dpi=120)
  plt.close(fig)
  paths.append(p)
  return paths


# ---------------------------------------------------------------------------
# Case selection and the main loop
# ---------------------------------------------------------------------------

def parse_shapes(spec: str, form: str, suffixes: Sequence[str] = ("",)
                 ) -> list[tuple[tuple[int, ...], str]]:
  """``--shapes``: comma-separated ``AxBx...`` tokens with as many positive
  ints as ``form`` has fields (e.g. ``form='BxMxNxKxH'``), each followed by
  one of ``suffixes`` (e.g. ``c`` for causal). Returns (dims, suffix)
  pairs; a bad token is a ValueError naming ``--shapes``."""
  n = len(form.split("x"))
  out = []
  for tok in [t.strip() for t in spec.split(",") if t.strip()]:
    m = re.fullmatch(r"([0-9x]+?)([a-z]*)", tok.lower())
    parts = m.group(1).split("x") if m else []
    if (len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts)
        or m.group(2) not in suffixes):
      sfx = "[" + "|".join(x for x in suffixes if x) + "]" if any(suffixes) else ""
      raise ValueError(f"--shapes: {tok!r} is not {form}{sfx} with positive ints")
    out.append((tuple(int(p) for p in parts), m.group(2)))
  return out


def select_from_flags(cases: dict[str, Any], groups: dict[str, list[str]]) -> list[str]:
  """Case names from ``--cases``; with only ``--shapes`` given, just those
  shapes (the binaries' shared convention)."""
  spec = FLAGS.cases
  if getattr(FLAGS, "shapes", "") and not FLAGS["cases"].present:
    spec = "shapes"
  return select(cases, spec, groups)


def select(available: dict[str, Any], spec: str, groups: Optional[dict[str, list[str]]] = None
           ) -> list[str]:
  """Names from a comma-separated spec of names/groups ('all'), case-insensitive."""
  groups = groups or {}
  lower = {n.lower(): n for n in available}
  glower = {g.lower(): v for g, v in groups.items()}
  out: list[str] = []
  for tok in [t.strip() for t in spec.split(",") if t.strip()]:
    t = tok.lower()
    if t in glower:        # a binary may define its own 'all'
      names = glower[t]
    elif t == "all":
      names = list(available)
    elif t in lower:
      names = [lower[t]]
    else:
      raise ValueError(f"--cases: unknown case or group {tok!r}; known: "
                       f"{', '.join(list(groups) + list(available))}")
    for n in names:
      if n not in out:
        out.append(n)
  return out


def filter_impls(impls: list[Impl], spec: str) -> list[Impl]:
  """jaxfuse plus the baselines named in --baselines ('all' / 'none')."""
  if spec.strip().lower() == "all":
    return impls
  want = {s.strip().lower() for s in spec.split(",") if s.strip()}
  known = {i.name.lower() for i in impls}
  unknown = want - known - {"none"}
  if unknown:
    raise ValueError(f"--baselines: unknown {sorted(unknown)}; known: {sorted(known)}")
  return [i for i in impls if i.name == "jaxfuse" or i.name.lower() in want]


def main(binary: str, cases: Sequence[Case], impls_for: Callable[[Case], list[Impl]],
         settings: Optional[Settings] = None, *, out: Optional[str] = None,
         do_plot: Optional[bool] = None, baselines: Optional[str] = None,
         title: Optional[str] = None) -> int:
  """Runs every case, prints the table and summary, writes outputs. Exit code."""
  settings = settings or Settings.from_flags()
  out = out if out is not None else FLAGS.out
  do_plot = FLAGS.plot if do_plot is None else do_plot
  baselines = FLAGS.baselines if baselines is None else baselines
  fail_on_mismatch = (FLAGS.fail_on_mismatch
                      if "fail_on_mismatch" in FLAGS and FLAGS.is_parsed() else True)
  roof = get_roof(settings.dtype)
  prefix = out or default_out(binary, settings.dtype)
  with jaxfuse_settings(settings.tune, False):   # the note names this run's --tune
    note = jaxfuse_path_note()
  meta = {
      "binary": binary, "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "device": _device_kind(), "backend": jax.default_backend(),
      "host": platform.node(), "versions": versions(), "settings": dataclasses.asdict(settings),
      "roof": dataclasses.asdict(roof), "jaxfuse_path": note, "argv": sys.argv,
      "jaxfuse_config": (dataclasses.asdict(cfg) if dataclasses.is_dataclass(
          cfg := jaxfuse_api().config) else None),
      "method": ("per-call = slope between K and 4K unrolled independent calls "
                 f"(median of {settings.reps} reps, up to {max(settings.reps, settings.max_reps)} "
                 f"while they disagree; call outputs {settings.call_outputs}; inputs "
                 f"{settings.slope_inputs}); kernel = "
                 "profiler GPU kernel time per call (outputs returned)"),
  }
  print(f"[{binary}] device {meta['device']} (backend {meta['backend']}), dtype "
        f"{settings.dtype}, floor vs {roof.name} ({roof.source})")
  print(f"[{binary}] {note}")
  rows = []
  for case in cases:
    impls = filter_impls(impls_for(case), baselines)
    t0 = time.perf_counter()
    row = run_case(case, impls, settings, roof)
    jf = row["impls"].get("jaxfuse", {}).get("jaxfuse", {})
    extra = ""
    if jf:
      extra = (f" regions={jf.get('regions')} plan_s={_f(jf.get('plan_s'), '{:.3f}')}"
               f" predicted_us={_us(jf.get('predicted_s'))}")
      if jf.get("why_not"):
        extra += f" why_not={jf['why_not']}"
      left = [l for l in jf.get("lowered") or () if not l.startswith("fused")]
      if left:
        extra += f" lowered={join_counted(left)}"
    print(f"[{binary}] {case.name}: K={row['calls']} done in "
          f"{time.perf_counter() - t0:.1f}s{extra}")
    for name, res in row["impls"].items():
      if not res.get("status", "").startswith("ok"):
        print(f"[{binary}]   {name}: {res.get('status')}")
    rows.append(row)
    if len(rows) < len(cases):
      # A run killed later (a device time limit) keeps the cases it finished.
      write_outputs(prefix, {**meta, "partial": f"{len(rows)} of {len(cases)} cases"}, rows,
                    summarize(rows))
  summary = summarize(rows)
  print()
  print(markdown_table(rows))
  print()
  for n, g in summary["geomean_speedup"].items():
    print(f"[{binary}] jaxfuse geomean speedup vs {n}: per-call "
          f"{_f(g.get('per_call'))}x over {g.get('per_call_cases', 0)} cases, kernel "
          f"{_f(g.get('kernel'))}x over {g.get('kernel_cases', 0)} cases, device per call "
          f"{_f(g.get('device_call'))}x over {g.get('device_call_cases', 0)} cases")
  for n, lst in summary["slower_than"].items():
    if lst:
      print(f"[{binary}] jaxfuse slower than {n} (per call) on: {', '.join(lst)}")
  files = write_outputs(prefix, meta, rows, summary)
  if do_plot and rows:
    try:
      files += plot(prefix, rows, roof, title or binary)
    except Exception as e:
      print(f"[{binary}] plot failed: {type(e).__name__}: {e}")
  print(f"[{binary}] wrote {', '.join(files)}")
  print(f"[{binary}] {note}")
  bad = [m for m in summary["mismatches"] if m.endswith("/jaxfuse")]
  if summary["mismatches"]:
    print(f"[{binary}] REFERENCE MISMATCH: {', '.join(summary['mismatches'])}")
    for m in summary.get("leaf_mismatches", []):
      print(f"[{binary}]   output leaves off float32 beyond XLA's own error: {m}")
  unchecked = [m for m in summary.get("unchecked", []) if m.endswith("/jaxfuse")]
  if unchecked:
    print(f"[{binary}] UNCHECKED (XLA's own error is over {UNINFORMATIVE_ERROR}x the "
          f"tolerance, so the reference cannot tell a wrong answer): {', '.join(unchecked)}")
  jf_errors = [e for e in summary["errors"] if "/jaxfuse:" in e]
  if jf_errors:
    print(f"[{binary}] jaxfuse errors: {'; '.join(jf_errors)}")
  return 1 if (bad or unchecked or jf_errors) and fail_on_mismatch else 0


# ---------------------------------------------------------------------------
# Measuring planned candidates (tuning and model fidelity)
# ---------------------------------------------------------------------------

def region_inputs(region, key, dtype_override: Optional[str] = None) -> list[jax.Array]:
  """Random arrays for a Chain IR region's input buffers, in order."""
  vm = region.value_map
  arrs = []
  for i, buf in enumerate(region.inputs):
    dt = vm[buf.value].dtype
    kk = jax.random.fold_in(key, i)
    if dt in ("float16", "bfloat16", "float32", "float64"):
      arrs.append(normal(kk, buf.shape, dtype_override or dt,
                         1.0 / math.sqrt(max(1, buf.shape[-1] if buf.shape else 1)) * 4))
    elif dt == "bool":
      arrs.append(jax.random.bernoulli(kk, 0.7, buf.shape))
    else:
      arrs.append(jax.random.randint(kk, buf.shape, 0, 16).astype(dt))
  return arrs


def find_codegen_measure() -> Optional[tuple[str, Callable]]:
  """The code generator's own measuring-function factory, if it has one."""
  for mod, attr in (("jaxfuse.runtime.launch", "make_measure"),
                    ("jaxfuse.runtime.launch", "measure_fn"),
                    ("jaxfuse.codegen", "make_measure"),
                    ("jaxfuse.codegen.measure", "make_measure")):
    try:
      m = __import__(mod, fromlist=[attr])
      f = getattr(m, attr, None)
      if f is not None:
        return f"{mod}.{attr}", f
    except Exception:
      continue
  return None


def fused_call_fn(region, plan, backend: str = "triton") -> Callable:
  """A jitted function running the region through jaxfuse.runtime.launch.fused_call."""
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top

  @jax.jit
  def f(*args):
    return launch.fused_call(region, list(args), backend=backend, plan=plan)
  return f


def measure_plan(region, plan, args: list, refs: Optional[list[np.ndarray]] = None,
                 backend: str = "triton", iters: int = 10) -> dict:
  """Compiles one plan, checks it, times it (profiler kernel time, else wall)."""
  res: dict[str, Any] = {"plan": str(plan)}
  f = fused_call_fn(region, plan, backend)
  t0 = time.perf_counter()
  out = f(*args)
  jax.block_until_ready(out)
  res["compile_s"] = time.perf_counter() - t0
  if refs is not None:
    outs = [np.asarray(jnp.asarray(o, jnp.float32), np.float64)
            for o in jax.tree_util.tree_leaves(out)]
    res["rel_err"], res["max_err"] = rel_error(outs, refs)
  if on_gpu():
    ks = jax_kernel_profile(lambda: jax.block_until_ready(f(*args)), iters)
    if ks is not None and ks.count:
      res["kernel_s"] = ks.total_us / iters * 1e-6
      res["kernels"] = ks.count / iters
  walls = []
  for _ in range(max(3, iters // 2)):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    walls.append(time.perf_counter() - t0)
  res["wall_s"] = statistics.median(walls)
  res["time_s"] = res.get("kernel_s") or res["wall_s"]
  return res


def make_plan_measure(region, prefer: str = "auto") -> Callable[[Sequence], list[float]]:
  """``measure(plans) -> seconds`` for plan_region: codegen's, else the harness's."""
  if prefer in ("auto", "codegen"):
    found = find_codegen_measure()
    if found is not None:
      name, factory = found
      try:
        return factory(region)
      except Exception as e:
        logging.warning("%s(region) failed (%s); using the harness's measure", name, e)
  args = region_inputs(region, jax.random.PRNGKey(0))

  def measure(plans):
    times = []
    for p in plans:
      try:
        times.append(float(measure_plan(region, p, args, iters=5)["time_s"]))
      except Exception as e:
        logging.info("plan failed to measure (%s); scored inf", e)
        times.append(math.inf)
    return times
  return measure
