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

Example::

    pool = compile_pool.get()              # None when switched off
    errors = pool.precompile([(fn, grid, args, kwargs), ...], target)
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

__all__ = ["CompilePool", "get", "shutdown", "specializations", "WORKER_SCRIPT"]

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
# A worker answers within this many seconds of its start or of a job (and
# within the caller's deadline), else it is killed: a compile that hangs
# must not hang the user's program.
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 120.0

_hook_lock = threading.Lock()


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
      raise TimeoutError(f"compile worker silent for {timeout_s:.0f} s")
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

  def _take(self) -> _Worker:
    w = self._idle.get()
    if not w.alive():
      w.kill()
      w = _Worker()
    return w

  def _give(self, w: _Worker) -> None:
    if self._closed:
      w.kill()
    else:
      self._idle.put(w)

  def _run(self, job: dict, timeout_s: float) -> Optional[str]:
    w = self._take()
    try:
      reply = w.run(job, timeout_s)
    except Exception as e:  # pylint: disable=broad-except
      w.kill()
      self._give(_Worker())
      return f"{type(e).__name__}: {e}"
    self._give(w)
    return None if reply.get("ok") else str(reply.get("error"))

  def precompile(self, launches: Sequence[tuple[Any, Any, Sequence[Any], dict]], target: Any,
                 timeout_s: float = JOB_TIMEOUT_S) -> list[Optional[str]]:
    """Compiles each ``(fn, grid, args, kwargs)`` launch (``fn`` a kernel of a
    module that ``codegen.compile.load_module`` imported) for ``target``
    (Triton's ``GPUTarget``) into the Triton cache. Returns per launch None
    or why it was not compiled (the caller then compiles it itself)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars  # pylint: disable=g-import-not-at-top
    specs = specializations(launches)
    env = dict(get_cache_invalidating_env_vars())
    # Where this process's launch will look: the workers may have started
    # before the caller chose the directory.
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    jobs: list[Optional[dict]] = []
    for (fn, _, _, _), spec in zip(launches, specs):
      if spec is None:
        jobs.append(None)
        continue
      mod = sys.modules.get(fn.fn.__module__)
      path = getattr(mod, "__file__", None)
      if path is None:
        jobs.append(None)
        continue
      jobs.append({"path": path, "module": fn.fn.__module__,
                   "target": [target.backend, int(target.arch), int(target.warp_size)], "env": env,
                   "cache_dir": cache_dir,
                   "fns": [[fn.fn.__name__, spec]]})
    errors: list[Optional[str]] = [None] * len(jobs)
    t_end = time.perf_counter() + timeout_s
    todo = [i for i, j in enumerate(jobs) if j is not None]
    if not todo:
      return errors
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.size, len(todo))) as ex:
      futs = {ex.submit(self._run, jobs[i], max(1.0, t_end - time.perf_counter())): i
              for i in todo}
      for f in concurrent.futures.as_completed(futs):
        errors[futs[f]] = f.result()
    return errors

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
