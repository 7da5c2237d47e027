"""A kernel's first run in a light child process: a fault ends the child, not the caller.

Why: under ``tune='auto'`` and ``'model'`` the planner's pick is
self-checked on the GPU before the user's program uses it. Run in the
user's process, a kernel Triton miscompiled into an illegal memory access
poisons that process's CUDA context and ends it: in the fiftieth session
a 4-layer transformer at 128 tokens died so under the default tuning
(H100, 2026-11-24). Pruning keeps the families we know out of the search;
this keeps the ones we do not know out of the user's process.

The child (``sandbox_child.py``) imports neither jax, Triton nor torch, so
it starts in well under a second, against 6-8 s for measured tuning's
child (``measure_worker``). This process compiles the kernel (lowering its
call gives the launcher's attributes, ``triton_call.collect_calls``) and
computes the reference; the child loads the compiled kernel through the
CUDA driver, runs the launches on the check's inputs and hands the
outputs back through files of raw bytes. A kernel that faults, hangs past
``timeout_s`` or kills the child raises ``KernelFault``, and the plan is
dropped like any plan that fails its check. The child's buffers are
separate driver allocations, so an out-of-bounds access faults there; in
the user's process three such kernels returned wrong answers instead, their
accesses landing in XLA's memory pool (H100, fifty-first session).

Example (``launch._run_on_gpu`` does this)::

    outs = kernel_sandbox.run(program, arrays)   # None: no child; run here
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np
from absl import logging

from jaxfuse.runtime import child_process

__all__ = ["KernelFault", "Program", "Sandbox", "run", "prestart", "shutdown", "CHILD"]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
# Seconds a child may take to create its CUDA context before it is given up on.
START_TIMEOUT_S = 60.0
# Seconds a run may take (copies in and out, the launches) before the child
# is killed and the kernel taken to hang.
RUN_TIMEOUT_S = 60.0
_DEVICE_ENV = "JAXFUSE_SANDBOX_DEVICE"


class KernelFault(RuntimeError):
  """The kernel failed in the child: a CUDA error, a hang, or the child died."""


class _ChildGone(RuntimeError):
  """The child had ended before the program was sent: not the kernel's doing."""


@dataclasses.dataclass
class Program:
  """What the child runs: device ``buffers`` (shape, NumPy dtype), each launch as
  (the launcher's attributes, the buffer ids of its operands then results),
  which buffers the caller's arrays fill, and which it gets back."""
  buffers: list[tuple[tuple[int, ...], np.dtype]]
  steps: list[tuple[dict, list[int]]]
  inputs: list[int]
  outputs: list[int]


class Sandbox(child_process.ChildProcess):
  """One child process and the caller's side of its protocol.

  ``argv``: the child's command (default: ``sandbox_child.py`` run by the
  current Python); ``device``: the CUDA ordinal it runs kernels on.
  """

  def __init__(self, argv: Optional[Sequence[str]] = None, device: int = 0):
    env = dict(os.environ)
    env[_DEVICE_ENV] = str(int(device))
    self.device = int(device)
    self.error: Optional[str] = None   # why the child cannot run kernels
    self._lock = threading.Lock()      # one run at a time
    super().__init__(list(argv) if argv else [sys.executable, "-s", CHILD], env,
                     "jaxfuse-sandbox-")

  def _on_ready(self, msg: tuple) -> None:
    self.error = msg[2]
    logging.info("jaxfuse: checking process %s in %.2f s", "ready" if self.error is None
                 else f"unusable ({self.error})", self.startup["ready_s"])

  def _on_no_start(self) -> None:
    self.error = f"the checking process ended at its start ({self.how_it_ended()})"

  def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
    """Whether the child started and can run kernels, waiting up to ``timeout`` s."""
    if not self._ready.wait(max(0.0, timeout)):
      self.error = f"the checking process did not start in {timeout:.0f} s"
      self.close(kill=True)
    return self.error is None and self.alive()

  def run(self, program: Program, arrays: Sequence[np.ndarray],
          timeout_s: float = RUN_TIMEOUT_S) -> Optional[list[np.ndarray]]:
    """The program's outputs on ``arrays`` (one per ``program.inputs``).
    Raises KernelFault when the kernel fails or ends the child; returns None
    when the child could not run it for other reasons (no memory left)."""
    with self._lock:
      return self._run(program, arrays, timeout_s)

  def _run(self, program: Program, arrays: Sequence[np.ndarray],
           timeout_s: float) -> Optional[list[np.ndarray]]:
    if len(arrays) != len(program.inputs):
      raise ValueError(f"arrays: the program takes {len(program.inputs)} inputs, "
                       f"got {len(arrays)}")
    job = next(self._jobs)
    for b, a in zip(program.inputs, arrays):
      shape, dtype = program.buffers[b]
      if tuple(np.shape(a)) != tuple(shape) or np.asarray(a).dtype != np.dtype(dtype):
        raise ValueError(f"arrays: buffer {b} is {dtype}{list(shape)}, "
                         f"got {np.asarray(a).dtype}{list(np.shape(a))}")
    sizes = [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in program.buffers]
    folder = self.folder_for(sum(sizes[b] for b in (*program.inputs, *program.outputs)))
    inputs = [(b, os.path.join(folder, f"in{job}-{b}.bin")) for b in program.inputs]
    outputs = [(b, os.path.join(folder, f"out{job}-{b}.bin")) for b in program.outputs]
    wire = {"buffers": sizes, "inputs": inputs, "steps": program.steps, "outputs": outputs}
    try:
      try:
        for (_, path), a in zip(inputs, arrays):
          np.ascontiguousarray(a).tofile(path)
      except OSError as e:   # a full disk is not the kernel's fault
        logging.info("jaxfuse: the checking process's inputs could not be written (%s)", e)
        return None
      try:
        self._send(("run", job, wire))
      except Exception as e:  # pylint: disable=broad-except  (it ended before this kernel ran)
        raise _ChildGone(self.how_it_ended()) from e
      t_end = time.perf_counter() + timeout_s
      while True:
        try:
          msg = self._inbox.get(timeout=max(0.0, t_end - time.perf_counter()))
        except queue.Empty:
          self._proc.kill()
          raise KernelFault(f"the kernel ran past {timeout_s:.0f} s in the checking "
                            "process (killed)") from None
        if msg[0] == "exit":
          raise KernelFault(f"the checking process died while running the kernel "
                            f"({self.how_it_ended()})")
        if msg[1] != job:
          continue
        if msg[0] == "fault":
          raise KernelFault(f"in the checking process: {msg[2]}")
        if msg[0] == "unavailable":
          logging.info("jaxfuse: the checking process could not run a kernel (%s)", msg[2])
          return None
        return [np.fromfile(path, dtype=program.buffers[b][1]).reshape(program.buffers[b][0])
                for b, path in outputs]
    finally:
      for _, path in (*inputs, *outputs):
        try:
          os.unlink(path)
        except OSError:
          pass


# ------------------------------------------------------------ the process's child
# Seconds without a run after which the child is closed: it holds a CUDA
# context (hundreds of MB of GPU memory) that the user's program could use,
# and checks come only with a region's first compile on a machine.
IDLE_CLOSE_S = 60.0

_lock = threading.Lock()
_sandbox: Optional[Sandbox] = None
_unusable: Optional[str] = None   # why no child can run kernels here (then: run in-process)
_active = 0                       # runs under way (the idle close waits for them)
_idle: Optional[threading.Timer] = None


def _close_if_idle() -> None:
  global _sandbox
  with _lock:
    if _active == 0 and _sandbox is not None:
      _sandbox.close()
      _sandbox = None


def _arm_idle_close() -> None:
  """(Re)starts the countdown to closing an idle child; callers hold _lock."""
  global _idle
  if _idle is not None:
    _idle.cancel()
  _idle = threading.Timer(IDLE_CLOSE_S, _close_if_idle)
  _idle.daemon = True
  _idle.start()


def _get(device: int) -> Optional[Sandbox]:
  """The child for ``device``, started now (not waited for) unless running."""
  global _sandbox
  with _lock:
    if _unusable is not None:
      return None
    _arm_idle_close()
    if _sandbox is not None and _sandbox.alive() and _sandbox.device == device:
      return _sandbox
    if _sandbox is not None:
      _sandbox.close()
    try:
      _sandbox = Sandbox(device=device)
    except Exception as e:  # pylint: disable=broad-except
      _give_up(f"{type(e).__name__}: {e}")
      return None
    return _sandbox


def _give_up(why: str) -> None:
  global _unusable
  if _unusable is None:
    _unusable = why
    logging.warning("jaxfuse: kernels are self-checked in this process: the checking "
                    "process cannot run them (%s)", why)


def prestart(device: int = 0) -> None:
  """Starts the child in the background, so that its start overlaps the
  caller's compile of the first kernel."""
  _get(device)


def run(program: Program, arrays: Sequence[np.ndarray], *, device: int = 0,
        timeout_s: float = RUN_TIMEOUT_S) -> Optional[list[np.ndarray]]:
  """``Sandbox.run`` in the process's child (started if needed), or None
  when no child can run it: the caller runs the kernel itself. A fault is
  logged once here and raised (KernelFault); the next run gets a fresh child."""
  global _active
  with _lock:
    _active += 1
  try:
    return _run(program, arrays, device, timeout_s)
  finally:
    with _lock:
      _active -= 1
      _arm_idle_close()


def _run(program: Program, arrays: Sequence[np.ndarray], device: int,
         timeout_s: float) -> Optional[list[np.ndarray]]:
  sb = _get(device)
  if sb is None:
    return None
  if not sb.wait_ready():
    _give_up(sb.error or "it did not start")
    shutdown()
    return None
  try:
    try:
      return sb.run(program, arrays, timeout_s)
    except _ChildGone as e:
      logging.info("jaxfuse: the checking process had ended (%s); starting another", e)
      sb = _get(device)
      if sb is None or not sb.wait_ready():
        return None
      return sb.run(program, arrays, timeout_s)
  except _ChildGone:
    return None
  except KernelFault as e:
    logging.warning("jaxfuse: a kernel failed its self-check's run (%s); this process is "
                    "unaffected and the plan is dropped", e)
    with _lock:
      if _sandbox is sb:
        # Killed, not asked to quit: tearing down a faulted CUDA context can
        # take the child seconds, and nothing it holds is worth keeping.
        sb.close(kill=True)
    _get(device)   # the next plan's check finds a fresh child, started now
    raise


def shutdown() -> None:
  global _sandbox
  with _lock:
    if _idle is not None:
      _idle.cancel()
    if _sandbox is not None:
      _sandbox.close()
      _sandbox = None


atexit.register(shutdown)

