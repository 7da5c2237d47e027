"""Measured tuning in a child process: a candidate that faults ends it, not the caller.

Why: a miscompiled Triton kernel can read or write out of bounds, and the
illegal memory access that follows poisons its process's CUDA context for
good. Measured tuning runs 16-24 candidate kernels per region that nobody
has run before; in the forty-sixth session 5 of 16 processes that each ran
27 kernels of a miscompiled family died that way (H100, 2026-11-24). The
pruning rules keep the families we know out of the search; this keeps the
ones we do not know out of the user's process. One long-lived child
compiles, self-checks and times the candidates (``launch.measure_here`` on
torch CUDA tensors, exactly as in-process measuring does); a plan whose run
ends the child, or leaves its CUDA context unusable, is dropped as failed,
and the next batch gets a fresh child. The child imports jax for the CPU
only: the float32 reference the candidates are checked against is computed
here, on the GPU, and handed over in ``.npy`` files.

Protocol: pickled tuples on the child's stdin and stdout.

* to the child: ``("measure", job, region, plans, seed, reps, budget_s,
  gpu_name, config)``, ``("ref", key, paths, error)``, ``("quit",)``;
* from the child: ``("ready", pid, usable)``, ``("start", job, i)``,
  ``("end", job, i, seconds, reason, check_key)``, ``("done", job, times,
  reasons, info, refused)``, ``("failed", job, text)``.

Example::

    res = measure_worker.measure(region, plans, seed=7, reps=20,
                                 t_end=time.perf_counter() + 4.0)
    if res is not None:      # None: no child could be used; measure here
      times, reasons, info = res
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import os
import pickle
import queue
import sys
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np
from absl import logging

from jaxfuse.runtime import child_process

__all__ = ["MeasureWorker", "measure", "prestart", "start", "shutdown", "wait_until_ready"]

# Seconds a child may take to start (import jax, torch and Triton, create its
# CUDA context and compile workers) before it is given up on.
START_TIMEOUT_S = 120.0
# Past a job's deadline, seconds the child has to report before it is
# killed: a compile or a kernel that hangs must not hang the caller.
JOB_GRACE_S = 30.0
# Children started per process at most; after that many ended abnormally,
# measured tuning measures nothing (the model ranks every plan).
MAX_STARTS = 4

_DEVICE_ENV = "JAXFUSE_MEASURE_DEVICE"
DIED = "the measuring process died while running this plan"


def _died(how: str) -> str:
  return f"{DIED} ({how})"


class MeasureWorker(child_process.ChildProcess):
  """One measuring child process and the caller's side of its protocol.

  ``argv``: the child's command (default: this module run by the current
  Python); ``device``: ``cuda``, or ``cpu`` for interpreted kernels (tests).
  """

  def __init__(self, argv: Optional[Sequence[str]] = None, device: str = "cuda"):
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
    launch._ensure_triton_cache_dir()  # pylint: disable=protected-access  (the child inherits it)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"   # the child's jax never touches the GPU
    env[_DEVICE_ENV] = device
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    self.device = device
    self.usable = False
    self._job_lock = threading.Lock()   # one job at a time: they share the inbox
    self._ref_key = None   # the reference last handed over (the child keeps one)
    super().__init__(list(argv) if argv else [sys.executable, "-m", "jaxfuse.runtime.measure_worker"],
                     env, "jaxfuse-measure-")

  def _on_ready(self, msg: tuple) -> None:
    self.usable = bool(msg[2])
    logging.info("jaxfuse: measuring process %s in %.2f s (%s)",
                 "ready" if self.usable else "cannot measure", self.startup["ready_s"],
                 ", ".join(f"{k} {v:.2f}" for k, v in msg[3].items()) if len(msg) > 3 else "")

  def wait_ready(self, timeout: float) -> bool:
    """Whether the child started and can measure, waiting up to ``timeout`` s."""
    self._ready.wait(max(0.0, timeout))
    return self._ready.is_set() and self.usable and self.alive()

  def _hand_over_reference(self, region, seed: int) -> None:
    """Sends the child this region's float32 reference (computed here on the
    GPU, ``launch.start_reference``) once it is ready, from a thread."""
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
    key = (region.signature(), seed, region.launch_offsets())
    if key == self._ref_key:
      return
    self._ref_key = key
    tag = next(self._jobs)

    def ship():
      try:
        refs = launch.start_reference(region, seed).result()
        paths = []
        for j, r in enumerate(refs):
          r = np.asarray(r, dtype=np.float32)
          paths.append(os.path.join(self.folder_for(r.nbytes), f"ref{tag}-{j}.npy"))
          np.save(paths[-1], r)
        msg = ("ref", key, paths, None)
      except Exception as e:  # pylint: disable=broad-except
        msg = ("ref", key, None, f"{type(e).__name__}: {e}"[:500])
      try:
        self._send(msg)
      except Exception:  # pylint: disable=broad-except  (the child ended)
        pass
    threading.Thread(target=ship, name="jaxfuse-measure-reference", daemon=True).start()

  # ------------------------------------------------------------ measuring
  def measure(self, region, plans: Sequence[Any], *, seed: int, reps: int, t_end: float
              ) -> tuple[list[float], list[Optional[str]], dict]:
    """``launch.measure_here``'s ``(times, reasons, info)`` for ``plans``,
    run in the child until ``t_end`` (a ``time.perf_counter()`` value).
    Plans the child refused (a wrong answer, a compile error) and a plan
    whose run ended the child are recorded as failed in ``launch._kernels``,
    so that this process never launches them; ``info["died"]`` says how
    the child ended when it did."""
    with self._job_lock:
      return self._measure(region, plans, seed=seed, reps=reps, t_end=t_end)

  def _measure(self, region, plans: Sequence[Any], *, seed: int, reps: int, t_end: float
               ) -> tuple[list[float], list[Optional[str]], dict]:
    from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
    from jaxfuse.codegen import CodegenError  # pylint: disable=g-import-not-at-top
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
    plans = list(plans)
    n = len(plans)
    times = [float("inf")] * n
    why: list[Optional[str]] = [launch._BUDGET_SPENT] * n  # pylint: disable=protected-access
    info: dict = {}
    job = next(self._jobs)
    self._hand_over_reference(region, seed)
    try:
      self._send(("measure", job, region, plans, seed, reps,
                  max(0.0, t_end - time.perf_counter()), launch._gpu_name(),  # pylint: disable=protected-access
                  dataclasses.asdict(config)))
    except Exception as e:  # pylint: disable=broad-except
      info["died"] = f"{self.how_it_ended()} ({type(e).__name__})"
      return times, why, info
    running: Optional[int] = None
    refused: dict[int, str] = {}
    while True:
      try:
        msg = self._inbox.get(timeout=max(0.0, t_end + JOB_GRACE_S - time.perf_counter()))
      except queue.Empty:
        self.close(kill=True)
        info["died"] = f"killed {JOB_GRACE_S:.0f} s past the deadline"
        if running is not None:
          why[running] = _died(info["died"])
          refused[running] = why[running]
        break
      kind = msg[0]
      if kind == "exit":
        info["died"] = self.how_it_ended()
        if running is not None:
          why[running] = _died(info["died"])
          refused[running] = why[running]
        break
      if msg[1] != job:
        continue
      if kind == "start":
        running = msg[2]
      elif kind == "end":
        _, _, i, t, w, check_key = msg
        times[i], why[i] = t, w
        if w is not None and w.startswith(DIED):
          refused[i] = w
        if check_key:
          launch._passed_checks.add(check_key)  # pylint: disable=protected-access
        running = None
      elif kind == "done":
        _, _, times, why, info, more = msg
        refused.update(more)
        break
      elif kind == "failed":
        logging.warning("jaxfuse: the measuring process failed: %s", msg[2])
        break
    sig = region.signature()
    with launch._lock:  # pylint: disable=protected-access
      for i, text in refused.items():
        launch._kernels[(sig, str(plans[i]), "triton")] = CodegenError(text)  # pylint: disable=protected-access
    return list(times), list(why), info


# ------------------------------------------------------------ the process's child
_lock = threading.Lock()
_worker: Optional[MeasureWorker] = None
_starts = 0
_gave_up = False
_unusable = False   # a child found no torch CUDA: this process measures itself


def start(device: str = "cuda") -> Optional[MeasureWorker]:
  """The measuring child, started now (not waited for) unless running;
  None once ``MAX_STARTS`` children were started."""
  global _worker, _starts, _gave_up
  with _lock:
    if _unusable:
      return None
    if _worker is not None and _worker.alive() and _worker.device == device:
      return _worker
    if _worker is not None:
      _worker.close(kill=True)
      _worker = None
    if _starts >= MAX_STARTS:
      if not _gave_up:
        _gave_up = True
        logging.warning("jaxfuse: %d measuring processes ended abnormally; measured tuning "
                        "now ranks plans by the model alone", _starts)
      return None
    _starts += 1
    try:
      _worker = MeasureWorker(device=device)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("jaxfuse: could not start the measuring process (%s: %s)",
                      type(e).__name__, e)
      _worker = None
    return _worker


def prestart() -> None:
  """Starts the measuring child in the background when measured tuning in a
  child applies (``tune='measure'``, ``tune_isolate``, a GPU under jax),
  so that its start (imports, CUDA context, compile workers: seconds)
  overlaps the caller's own work before the first region is tuned. Called
  when ``jaxfuse.jit`` wraps a function and when the config changes."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  if (config.tune != "measure" or not config.tune_isolate or config.disable
      or config.backend not in ("auto", "triton")):
    return

  def go():
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
    if launch._isolated():  # pylint: disable=protected-access  (a GPU under jax)
      start("cuda")
  threading.Thread(target=go, name="jaxfuse-measure-prestart", daemon=True).start()


def _wait(w: MeasureWorker) -> float:
  """Seconds spent waiting for ``w`` to be ready (or to fail to start)."""
  if w._ready.is_set():  # pylint: disable=protected-access
    return 0.0
  t = time.perf_counter()
  w.wait_ready(START_TIMEOUT_S - (t - w.started))
  return time.perf_counter() - t


def wait_until_ready(device: str = "cuda") -> float:
  """Seconds spent waiting for the child (started if needed) to be ready,
  at most ``START_TIMEOUT_S``; 0 when it is ready or cannot be used."""
  w = start(device)
  return 0.0 if w is None else _wait(w)


def measure(region, plans: Sequence[Any], *, seed: int, reps: int, t_end: float,
            device: str = "cuda") -> Optional[tuple[list[float], list[Optional[str]], dict]]:
  """``MeasureWorker.measure`` in the process's child (started if needed).
  The wait for a child to start does not count against the budget: it is
  once per process, like jax's own start. None when no child could start
  or measure (the caller measures in its own process: no kernel ran in a
  child that never became ready); every plan reads 'budget spent' once
  children were given up on after ``MAX_STARTS``."""
  global _unusable
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  w = start(device)
  if w is None:
    if _gave_up:
      n = len(plans)
      return [float("inf")] * n, [launch._BUDGET_SPENT] * n, {}  # pylint: disable=protected-access
    return None
  waited = _wait(w)
  if not w.wait_ready(0.0):
    _unusable = True
    logging.warning("jaxfuse: the measuring process %s; measuring in this process",
                    "has no CUDA device through torch" if w.startup
                    else f"did not start ({w.how_it_ended() if not w.alive() else 'timed out'})")
    shutdown()
    return None
  res = w.measure(region, plans, seed=seed, reps=reps, t_end=t_end + waited)
  if "died" in res[2]:
    logging.warning("jaxfuse: the measuring process ended (%s) while measuring %s; its plan "
                    "is dropped", res[2]["died"], region.einsum_summary())
    start(device)   # the next batch finds a fresh child, started now
  return res


def shutdown() -> None:
  global _worker
  with _lock:
    if _worker is not None:
      _worker.close()
      _worker = None


atexit.register(shutdown)


# ------------------------------------------------------------ the child
def _context_ok(torch) -> bool:
  """Whether this process's CUDA context still runs work (a fault poisons it)."""
  try:
    x = torch.ones(1, device="cuda")
    return float((x + 1).item()) == 2.0
  except Exception:  # pylint: disable=broad-except
    return False


def main() -> None:
  """The child: reads jobs from stdin until it closes or says quit."""
  out = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)   # stray prints must not corrupt the protocol
  send_lock = threading.Lock()

  def send(msg: tuple) -> None:
    with send_lock:
      pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
      out.flush()

  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import compile_pool  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  launch._IN_MEASURE_WORKER = True  # pylint: disable=protected-access

  def no_reference(region, xs):
    del region, xs
    raise RuntimeError("the caller's reference was not received")
  # The reference always comes from the caller (this jax has no GPU).
  launch._reference_on_gpu = no_reference  # pylint: disable=protected-access
  device = os.environ.get(_DEVICE_ENV, "cuda")
  torch = None
  usable = True
  steps: dict[str, float] = {}   # the rest of the start: Python, jax, jaxfuse
  if device == "cuda":
    # torch first: with the 16 compile workers importing Triton beside it,
    # its import took 5.0 s of a 7.0-7.2 s start (H100 host, 2026-11-24).
    t = time.perf_counter()
    import torch  # pylint: disable=g-import-not-at-top,redefined-outer-name
    steps["torch"] = time.perf_counter() - t
    t = time.perf_counter()
    usable = bool(torch.cuda.is_available()) and _context_ok(torch)
    steps["cuda"] = time.perf_counter() - t
    if usable:
      t = time.perf_counter()
      pool = compile_pool.get()
      steps["compile workers"] = time.perf_counter() - t
      # While the workers start: Triton's CUDA utilities, a C module its
      # driver builds with the host compiler on a cold cache, else on the
      # first region's first compile, inside its tuning budget.
      t = time.perf_counter()
      try:
        from triton.runtime.driver import driver  # pylint: disable=g-import-not-at-top
        driver.active.get_current_target()
      except Exception:  # pylint: disable=broad-except  (the first compile tries again)
        pass
      steps["triton driver"] = time.perf_counter() - t
      t = time.perf_counter()
      if pool is not None:
        pool.wait_started()
      steps["compile workers"] += time.perf_counter() - t
  send(("ready", os.getpid(), usable, steps))
  if not usable:
    return

  refs: dict[Any, concurrent.futures.Future] = {}
  refs_lock = threading.Lock()
  jobs: queue.Queue = queue.Queue()

  def ref_future(key) -> concurrent.futures.Future:
    with refs_lock:
      if key not in refs:
        refs.clear()   # one region at a time, as the caller hands them over
        refs[key] = concurrent.futures.Future()
      return refs[key]

  def read() -> None:
    try:
      while True:
        msg = pickle.load(sys.stdin.buffer)
        if msg[0] == "ref":
          _, key, paths, err = msg
          fut = ref_future(key)
          try:
            if err is not None:
              raise RuntimeError(f"the caller's reference failed: {err}")
            arrays = [np.load(p) for p in paths]
            for p in paths:
              os.unlink(p)
            fut.set_result(arrays)
          except Exception as e:  # pylint: disable=broad-except
            if not fut.done():
              fut.set_exception(e)
        elif msg[0] == "measure":
          jobs.put(msg)
        else:
          break
    except Exception:  # pylint: disable=broad-except  (EOF: the caller ended)
      pass
    jobs.put(None)
  threading.Thread(target=read, name="jaxfuse-measure-jobs", daemon=True).start()

  while True:
    msg = jobs.get()
    if msg is None:
      break
    _, job, region, plans, seed, reps, budget_s, gpu, cfg = msg
    t_end = time.perf_counter() + budget_s
    try:
      for name, value in cfg.items():
        setattr(config, name, value)
      launch._gpu_name_override = gpu  # pylint: disable=protected-access
      key = (region.signature(), seed, region.launch_offsets())
      fut = ref_future(key)
      with launch._lock:  # pylint: disable=protected-access
        launch._last_reference.clear()  # pylint: disable=protected-access
        launch._last_reference[key] = fut  # pylint: disable=protected-access

      def on_start(i: int) -> None:
        send(("start", job, i))

      def on_result(i: int, t: float, w: Optional[str], k: Any) -> None:
        check_key = (launch._check_key(k)  # pylint: disable=protected-access
                     if w is None and k is not None and device == "cuda" else None)
        send(("end", job, i, t, w, check_key))
        if w is not None and torch is not None and not _context_ok(torch):
          # The plan left the context unusable: every later plan would fail
          # here for its sake. The caller drops this plan and starts afresh.
          send(("end", job, i, float("inf"), _died("its CUDA context failed: " + w[:300]), None))
          out.flush()
          os._exit(3)  # pylint: disable=protected-access

      times, why, info = launch.measure_here(region, plans, seed=seed, reps=reps, t_end=t_end,
                                             device=device, on_start=on_start,
                                             on_result=on_result)
      sig = region.signature()
      refused = {}
      with launch._lock:  # pylint: disable=protected-access
        for i, p in enumerate(plans):
          hit = launch._kernels.get((sig, str(p), "triton"))  # pylint: disable=protected-access
          if isinstance(hit, Exception):
            refused[i] = str(hit)[:500]
      send(("done", job, times, why, dict(info), refused))
    except Exception as e:  # pylint: disable=broad-except
      send(("failed", job, f"{type(e).__name__}: {e}"[:1000]))


if __name__ == "__main__":
  main()
