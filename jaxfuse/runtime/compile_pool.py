"""Compiles a batch of generated Triton kernels in worker processes.

Measured tuning compiles one batch of about 16 kernels per region before it
times any. Triton's front end (Python AST to TTIR) holds the GIL, so on
threads those compiles ran mostly one after another: a batch took 2-4 s of
a region's tuning on the H100 host (twelfth session, 2026-11-21). Here each
kernel is compiled by a long-lived worker process (``compile_worker.py``, run
as a script: no jax, no GPU), which writes it into the Triton cache
directory this process uses; the caller's own Triton launch then finds it
there.

How the worker gets exactly what the caller's launch will look up: the
caller runs ``fn.warmup`` with Triton's ``jit_cache_hook`` set, which hands
over Triton's serialized specialization and skips the compile; the worker
compiles that specialization with ``JITFunction.preload``. A kernel that a
worker fails to compile, or any failure of the pool, only means the caller
compiles it itself, as before.

A compile that is not done by the caller's deadline is abandoned (its
worker is killed and replaced): measured tuning drops that candidate rather
than wait for it. Why: one float32 attention candidate (S7, m=16 rows,
n=256) compiled for 13 s, and tuning its region took 15.6 s against a 4 s
budget (H100, 2026-11-22, seventeenth session).

Example::

    pool = compile_pool.get()              # None when switched off
    errors = pool.precompile([(fn, grid, args, kwargs), ...], target)
    # or, to use each kernel as soon as it is built:
    futs = pool.submit([[launch_a], [launch_b, launch_b_combine]], target, deadline)
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

from absl import logging

__all__ = ["CompilePool", "CompileTimeout", "get", "shutdown", "specializations",
           "WORKER_SCRIPT"]

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
# A worker answers within this many seconds of its start or of a job (and
# within the caller's deadline), else it is killed: a compile that hangs
# must not hang the user's program.
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 120.0

_hook_lock = threading.Lock()


class CompileTimeout(TimeoutError):
  """A compile was not done by the caller's deadline (it was abandoned)."""


def _describe(e: Optional[Exception]) -> Optional[str]:
  """A job's failure as text (a worker's own error as it reported it)."""
  if e is None:
    return None
  return str(e) if type(e) is RuntimeError else f"{type(e).__name__}: {e}"


def specializations(launches: Sequence[tuple[Any, Any, Sequence[Any], dict]]
                    ) -> list[Optional[str]]:
  """Triton's serialized specialization of each ``(fn, grid, args, kwargs)``
  launch, taken from ``fn.warmup`` without compiling (None where Triton
  already holds the kernel in memory, so nothing needs compiling)."""
  from triton import knobs  # pylint: disable=g-import-not-at-top
  out: list[Optional[str]] = []
  with _hook_lock:
    prev = knobs.runtime.jit_cache_hook
    current: list = [None, None]   # (the JITFunction being warmed, its spec)

    def hook(*args, **kwargs):
      info = kwargs.get("fn")
      if current[0] is not None and getattr(info, "jit_function", None) is current[0]:
        current[1] = kwargs["compile"]["specialization_data"]
        return True   # skip the compile: a worker does it
      return prev(*args, **kwargs) if prev is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
      for fn, grid, args, kw in launches:
        current[0], current[1] = fn, None
        fn.warmup(*args, grid=grid, **kw)
        out.append(current[1])
    finally:
      current[0] = None
      knobs.runtime.jit_cache_hook = prev
  return out


class _Worker:
  """One ``compile_worker.py`` process and its pipes."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [sys.executable, WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, close_fds=True)
    self.ready = False

  def _read(self, timeout_s: float) -> dict:
    r, _, _ = select.select([self.proc.stdout], [], [], max(timeout_s, 0.0))
    if not r:
      raise CompileTimeout(f"compile worker silent for {timeout_s:.0f} s")
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"compile worker exited (code {self.proc.poll()})")
    return json.loads(line)

  def run(self, job: dict, timeout_s: float) -> dict:
    """The worker's reply to ``job``, within ``timeout_s`` (its start included)."""
    t_end = time.perf_counter() + timeout_s
    if not self.ready:
      self._read(min(START_TIMEOUT_S, timeout_s))
      self.ready = True
    self.proc.stdin.write((json.dumps(job) + "\n").encode())
    self.proc.stdin.flush()
    return self._read(t_end - time.perf_counter())

  def alive(self) -> bool:
    return self.proc.poll() is None

  def kill(self) -> None:
    try:
      self.proc.kill()
      self.proc.wait(timeout=5)
    except Exception:  # pylint: disable=broad-except
      pass


class CompilePool:
  """``size`` compile worker processes, started in the background."""

  def __init__(self, size: int):
    if size < 1:
      raise ValueError(f"size must be >= 1, got {size}")
    self.size = size
    self._idle: "queue.Queue[_Worker]" = queue.Queue()
    self._closed = False
    for _ in range(size):
      self._idle.put(_Worker())

  def _take(self, timeout_s: float) -> _Worker:
    try:
      w = self._idle.get(timeout=max(timeout_s, 0.0))
    except queue.Empty:
      raise CompileTimeout("no compile worker was free before the deadline") from None
    if not w.alive():
      w.kill()
      w = _Worker()
    return w

  def _give(self, w: _Worker) -> None:
    if self._closed:
      w.kill()
    else:
      self._idle.put(w)

  def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> int:
    """Waits (at most ``timeout_s``) until every idle worker has started;
    returns how many have. Why: the measuring process (``measure_worker``)
    says it is ready only when its first batch can compile at once; a cold
    machine's workers took longer to start than that batch's budget."""
    t_end = time.perf_counter() + timeout_s
    taken = []
    while True:
      try:
        taken.append(self._idle.get_nowait())
      except queue.Empty:
        break
    started = 0
    for w in taken:
      if not w.ready:
        try:
          w._read(min(START_TIMEOUT_S, t_end - time.perf_counter()))  # pylint: disable=protected-access
          w.ready = True
        except Exception:  # pylint: disable=broad-except  (a job replaces it)
          pass
      started += w.ready
      self._idle.put(w)
    return started

  def _job(self, job: dict, deadline: float) -> Optional[Exception]:
    """Runs ``job`` on a free worker; None when it compiled, else why not
    (``CompileTimeout`` when ``deadline``, a ``time.perf_counter()`` value,
    came first: the worker is then killed and replaced)."""
    try:
      w = self._take(deadline - time.perf_counter())
    except CompileTimeout as e:
      return e
    try:
      reply = w.run(job, deadline - time.perf_counter())
    except Exception as e:  # pylint: disable=broad-except
      w.kill()
      self._give(_Worker())
      return e
    self._give(w)
    return None if reply.get("ok") else RuntimeError(str(reply.get("error")))

  def submit(self, groups: Sequence[Sequence[tuple[Any, Any, Sequence[Any], dict]]],
             target: Any, deadline: float) -> list[Optional[concurrent.futures.Future]]:
    """Starts compiling each group of ``(fn, grid, args, kwargs)`` launches
    (the kernels of one module, e.g. a split plan's main kernel and its
    combine pass) for ``target`` (Triton's ``GPUTarget``) into the Triton
    cache, and returns at once. Per group: None when nothing needs
    compiling, else a future of None (compiled) or the exception saying why
    not (``CompileTimeout`` past ``deadline``, a ``time.perf_counter()``
    value). Each ``fn`` is a kernel of a module that
    ``codegen.compile.load_module`` imported."""
    from triton._C.libtriton import get_cache_invalidating_env_vars  # pylint: disable=g-import-not-at-top
    if any(len({fn.fn.__module__ for fn, _, _, _ in g}) > 1 for g in groups):
      raise ValueError("groups: each group's launches must be kernels of one module")
    flat = [l for g in groups for l in g]
    specs = iter(specializations(flat))
    env = dict(get_cache_invalidating_env_vars())
    # Where this process's launch will look: the workers may have started
    # before the caller chose the directory.
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    jobs: list[Optional[dict]] = []
    for g in groups:
      fns, path, module = [], None, None
      for fn, _, _, _ in g:
        spec = next(specs)
        mod = sys.modules.get(fn.fn.__module__)
        if spec is None or getattr(mod, "__file__", None) is None:
          continue
        path, module = mod.__file__, fn.fn.__module__
        fns.append([fn.fn.__name__, spec])
      jobs.append(None if not fns else {
          "path": path, "module": module,
          "target": [target.backend, int(target.arch), int(target.warp_size)], "env": env,
          "cache_dir": cache_dir, "fns": fns})
    todo = [j for j in jobs if j is not None]
    if not todo:
      return [None] * len(jobs)
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=min(self.size, len(todo)),
                                               thread_name_prefix="jaxfuse-compile")
    try:
      return [None if j is None else ex.submit(self._job, j, deadline) for j in jobs]
    finally:
      ex.shutdown(wait=False)   # each job ends by the deadline

  def precompile(self, launches: Sequence[tuple[Any, Any, Sequence[Any], dict]], target: Any,
                 timeout_s: float = JOB_TIMEOUT_S) -> list[Optional[str]]:
    """Compiles each ``(fn, grid, args, kwargs)`` launch for ``target`` into
    the Triton cache and waits (at most ``timeout_s``). Returns per launch
    None or why it was not compiled (the caller then compiles it itself)."""
    futs = self.submit([[l] for l in launches], target, time.perf_counter() + timeout_s)
    return [None if f is None else _describe(f.result()) for f in futs]

  def close(self) -> None:
    self._closed = True
    while True:
      try:
        w = self._idle.get_nowait()
      except queue.Empty:
        break
      try:
        w.proc.stdin.close()
      except Exception:  # pylint: disable=broad-except
        pass
      w.kill()


_pool: Optional[CompilePool] = None
_pool_lock = threading.Lock()


def get() -> Optional[CompilePool]:
  """The process's pool (started on first use), or None when
  ``config.compile_workers`` is 0 or the pool cannot start."""
  global _pool
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  n = int(config.compile_workers)
  if n <= 0:
    return None
  with _pool_lock:
    if _pool is None or _pool.size != n:
      if _pool is not None:
        _pool.close()
      try:
        _pool = CompilePool(n)
      except Exception as e:  # pylint: disable=broad-except
        logging.info("jaxfuse: compile workers unavailable (%s); compiling in-process", e)
        _pool = None
    return _pool


def shutdown() -> None:
  global _pool
  with _pool_lock:
    if _pool is not None:
      _pool.close()
      _pool = None


atexit.register(shutdown)
