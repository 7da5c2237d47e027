"""jaxfuse configuration: a small object read from ``JAXFUSE_*`` variables.

Example::

    import jaxfuse
    jaxfuse.config.update("backend", "interpret")   # run kernels in Triton's interpreter
    with jaxfuse.config.override(disable=True):
      ...                                           # jaxfuse.jit is jax.jit here
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

_BACKENDS = ("auto", "xla", "interpret", "triton")
TUNE_MODES = ("model", "auto", "measure")


def _env_bool(name: str, default: bool) -> bool:
  v = os.environ.get(name)
  if v is None or v == "":
    return default
  return v.strip().lower() in ("1", "true", "yes", "on")


def _env_number(name: str, default, kind=float):
  """``kind(os.environ[name])``, or ``default`` when unset."""
  v = os.environ.get(name)
  try:
    return kind(v) if v not in (None, "") else default
  except ValueError as e:
    raise ValueError(f"{name}={v!r} is not {'an integer' if kind is int else 'a number'}") from e


@dataclasses.dataclass
class Config:
  """Settings; each field has a ``JAXFUSE_<FIELD>`` environment variable.

  disable: ``jaxfuse.jit`` becomes exactly ``jax.jit``.
  backend: how a region runs. ``auto``: generated Triton kernel on CUDA, the
    original ops elsewhere; ``xla``: always the original ops; ``interpret``:
    the generated kernel in Triton's interpreter on the CPU (slow; for
    tests); ``triton``: the Triton kernel, failing over to ``xla`` where
    there is no CUDA device.
  cache_dir: where plans, kernels, keep-or-drop timings, passed GPU
    self-checks and compiled kernel calls are cached.
  device: the device model the planner uses when no GPU is attached
    (``h100``, ``h200``, ``a100``, ``rtx3080``) or ``auto``.
  tune: ``model``: the analytical model alone plans each region and
    decides whether it runs fused; ``auto`` (default): the model plans, and
    where its keep-or-drop verdict is uncertain (float32 dots, or a 16-bit
    prediction near its bound, below 2x of XLA's separate kernels; a pick
    that splits an online-softmax key loop and has an unsplit plan to time
    beside it: ``cost_model.verdict_uncertain``) the kernel
    is timed on the GPU against what would run instead (XLA's ops; for a
    chain, its parts with fewer contractions, each fused where that pays)
    once per machine and cache, the faster kept (where the model's pick
    splits an online-softmax key loop across programs, its best unsplit
    plan, or with none in reach a plan it ties with the pick, is timed
    beside it: ``launch.rival_plan``); ``measure``: also time the
    model's top candidates and its best plan of each other structure on the
    GPU (MCFuser Alg. 1's measured step), and time every region so.
  tune_budget_s: seconds of measured tuning allowed per region.
  tune_isolate: measured tuning compiles, checks and times its candidate
    kernels in a child process (``jaxfuse.runtime.measure_worker``), so
    that a candidate that faults on the GPU (an illegal memory access
    poisons a process's CUDA context) ends that process, not the caller's;
    the candidate is then dropped. Off: they run in this process.
  check_isolate: a kernel's self-check on the GPU (the first time this
    machine and plan cache see it) runs the kernel in a light child process
    (``jaxfuse.runtime.kernel_sandbox``: no jax, Triton or torch there; it
    starts in well under a second), so that a miscompiled kernel that
    faults ends that process, not the caller's; the plan is then dropped.
    Off, or where the child cannot run it: in this process.
  compile_workers: processes that compile measured tuning's candidate
    kernels (``jaxfuse.runtime.compile_pool``); 0 compiles them in this
    process, on threads. Default: all but 2 CPUs (at least 8, at most 16,
    never more than the CPU count). On the 16-core H100 host, 14 workers
    against 8 cut the median tuning time of 37 regions from 2.36 to 1.85 s
    (benchmarks/RESULTS.md, fifteenth session).
  allow_split: let the planner split a reduction loop across programs (a
    second pass combines the partials) for grids too small for the GPU;
    the model picks such a plan only when it predicts it faster.
  launch: how a Triton kernel is called on the GPU. ``direct``: jaxfuse's
    own FFI target (``jaxfuse.runtime.direct_launch``, built with the
    system C compiler on first use); ``ffi``: jaxlib's typed FFI target
    ``triton_kernel_call_ffi``; ``legacy``: jax-triton's own
    ``triton_kernel_call`` custom call. ``direct`` falls back to ``ffi``
    where it cannot be built or cannot take a kernel, ``ffi`` to
    ``legacy`` where the installed jaxlib lacks the target.
  record: with ``launch='direct'``, inside XLA's command buffers (CUDA
    graphs) a launch is recorded as a kernel node that XLA creates and
    updates itself (the FFI record stage, where the installed jaxlib has
    it), not captured from a stream; and a generated kernel waits on its
    grid dependency before it touches memory, so that XLA may start it
    while the previous kernel finishes, as it does its own kernels
    (programmatic dependent launch, Hopper and newer). On an H100 this
    cut the device time per call of the papers' GEMM chains by 2-12%
    (6% geomean) and BERT-Base's by about 3% (benchmarks/RESULTS.md,
    fifty-fifth session). Off: every launch is captured.
  kernel_forms: let the GPU run kernel forms other than the Triton
    printer's where the planner ranks them first (``Plan.form``; today
    the warp-specialized Gluon attention kernel on Hopper,
    ``jaxfuse.codegen.gluon_printer``). Off: the Triton form runs
    everywhere.
  recompute: a contraction that reads a wide intermediate (attention's
    [T, T] probabilities) which an earlier contraction also reads gets its
    own copy of the ops that compute it, from narrower values and row
    statistics (FlashAttention's recomputation, for any chain:
    ``jaxfuse.capture_recompute``), so that no fused region has to write
    it; a row sum of a product against such a value is taken from the
    product the first chain already forms where the algebra allows
    (FlashAttention-2's ``rowsum(do * o)``). On an H100 this took
    ``jax.grad`` of plain attention from ``jax.jit``'s speed to 2.53x
    (4.55x causal) at 8 x 16 heads x 2048 tokens (benchmarks/RESULTS.md,
    seventy-eighth session). Off: each reads the shared value. Read when a
    function is traced.
  merge: two regions of one program that compute a common part from the
    same inputs (attention's backward: dk and dv both from the recomputed
    probabilities) become one region with the outputs of both, computing
    the common part once (``jaxfuse.ir_merge``), where the planner's model
    predicts the one kernel faster than the two. Off: each runs its own.
    Read when a function is traced.
  """
  disable: bool = False
  backend: str = "auto"
  cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "jaxfuse")
  device: str = "auto"
  tune: str = "auto"
  tune_budget_s: float = 4.0
  tune_isolate: bool = True
  check_isolate: bool = True
  compile_workers: int = min(16, os.cpu_count() or 1, max(8, (os.cpu_count() or 1) - 2))
  allow_split: bool = True
  launch: str = "direct"
  record: bool = True
  kernel_forms: bool = True
  recompute: bool = True
  merge: bool = True

  @classmethod
  def from_env(cls) -> "Config":
    c = cls()
    c.disable = _env_bool("JAXFUSE_DISABLE", c.disable)
    c.backend = os.environ.get("JAXFUSE_BACKEND", c.backend) or c.backend
    c.cache_dir = os.environ.get("JAXFUSE_CACHE_DIR", c.cache_dir) or c.cache_dir
    c.device = os.environ.get("JAXFUSE_DEVICE", c.device) or c.device
    c.tune = os.environ.get("JAXFUSE_TUNE", c.tune) or c.tune
    c.tune_budget_s = _env_number("JAXFUSE_TUNE_BUDGET_S", c.tune_budget_s)
    c.tune_isolate = _env_bool("JAXFUSE_TUNE_ISOLATE", c.tune_isolate)
    c.check_isolate = _env_bool("JAXFUSE_CHECK_ISOLATE", c.check_isolate)
    c.compile_workers = _env_number("JAXFUSE_COMPILE_WORKERS", c.compile_workers, int)
    c.allow_split = _env_bool("JAXFUSE_ALLOW_SPLIT", c.allow_split)
    c.launch = os.environ.get("JAXFUSE_LAUNCH", c.launch) or c.launch
    c.record = _env_bool("JAXFUSE_RECORD", c.record)
    c.kernel_forms = _env_bool("JAXFUSE_KERNEL_FORMS", c.kernel_forms)
    c.recompute = _env_bool("JAXFUSE_RECOMPUTE", c.recompute)
    c.merge = _env_bool("JAXFUSE_MERGE", c.merge)
    c._check()
    return c

  def _check(self) -> None:
    if self.backend not in _BACKENDS:
      raise ValueError(f"jaxfuse config 'backend' must be one of {_BACKENDS}, "
                       f"got {self.backend!r}")
    if self.tune not in TUNE_MODES:
      raise ValueError(f"jaxfuse config 'tune' must be one of {TUNE_MODES}, "
                       f"got {self.tune!r}")
    if self.launch not in ("direct", "ffi", "legacy"):
      raise ValueError(f"jaxfuse config 'launch' must be 'direct', 'ffi' or 'legacy', "
                       f"got {self.launch!r}")
    if self.tune_budget_s < 0:
      raise ValueError("jaxfuse config 'tune_budget_s' must be >= 0")
    if not isinstance(self.compile_workers, int) or self.compile_workers < 0:
      raise ValueError(f"jaxfuse config 'compile_workers' must be an int >= 0, "
                       f"got {self.compile_workers!r}")

  def update(self, name: str, value: Any) -> None:
    """Sets one field, e.g. ``config.update("backend", "interpret")``."""
    if name not in {f.name for f in dataclasses.fields(self)}:
      raise AttributeError(f"jaxfuse config has no field {name!r}")
    old = getattr(self, name)
    setattr(self, name, value)
    try:
      self._check()
    except ValueError:
      setattr(self, name, old)
      raise
    for fn in list(_on_update):
      fn(name)

  @contextlib.contextmanager
  def override(self, **kwargs: Any) -> Iterator["Config"]:
    """Temporarily sets fields: ``with config.override(backend="xla"): ...``."""
    old = {k: getattr(self, k) for k in kwargs}
    try:
      for k, v in kwargs.items():
        self.update(k, v)
      yield self
    finally:
      for k, v in old.items():
        setattr(self, k, v)


# Called with a field's name after ``Config.update`` sets it (e.g. to start
# the measuring process once ``tune`` becomes 'measure').
_on_update: list = []


def on_update(fn) -> None:
  """Registers ``fn(name)``, called after each ``config.update``."""
  _on_update.append(fn)


config = Config.from_env()
