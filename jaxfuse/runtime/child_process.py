"""The caller's side of a child process that runs kernels before this process does.

Both children (``measure_worker``: measured tuning; ``kernel_sandbox``: a
kernel's self-check) speak pickled tuples on their stdin and stdout, say
``("ready", pid, status, {step: seconds})`` once started, and may die at
any time: a kernel that faults ends its process. This class starts one,
reads its messages on a thread (so that a caller can wait with a timeout),
sends, and says how it ended.

Example::

    class Worker(ChildProcess):
      def _on_ready(self, msg):
        self.usable = bool(msg[2])

    w = Worker([sys.executable, "child.py"], dict(os.environ), "jaxfuse-x-")
    w._send(("quit",))
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Optional, Sequence

__all__ = ["ChildProcess"]


class ChildProcess:
  """One child process (``argv``, environment ``env``) and scratch folders
  for the files it exchanges (``folder_for``).
  Messages other than "ready" arrive in ``self._inbox``, then ``("exit",)``
  when the child's output ends."""

  def __init__(self, argv: Sequence[str], env: dict, tmp_prefix: str):
    self.started = time.perf_counter()
    self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=env)
    self._inbox: queue.Queue = queue.Queue()
    self._send_lock = threading.Lock()
    self._ready = threading.Event()
    self.startup: dict = {}   # seconds of the child's start, by step
    self._jobs = itertools.count()
    self._tmp_prefix = tmp_prefix
    self._tmp = tempfile.mkdtemp(prefix=tmp_prefix,
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    self._disk_tmp: Optional[str] = None
    threading.Thread(target=self._read, name=f"{tmp_prefix}reader", daemon=True).start()

  def folder_for(self, nbytes: int) -> str:
    """A folder for files of ``nbytes`` in all: the one in ``/dev/shm``
    while it has room for them twice over, else one on disk (a container's
    ``/dev/shm`` is often 64 MiB, less than one large attention's inputs)."""
    try:
      st = os.statvfs(self._tmp)
      free = st.f_bavail * st.f_frsize
    except OSError:
      free = 0
    if free >= 2 * nbytes:
      return self._tmp
    if self._disk_tmp is None:
      self._disk_tmp = tempfile.mkdtemp(prefix=self._tmp_prefix)
    return self._disk_tmp

  def _on_ready(self, msg: tuple) -> None:
    """The child's "ready" message (``self.startup`` is set)."""

  def _on_no_start(self) -> None:
    """The child's output ended before it said "ready"."""

  def _read(self) -> None:
    try:
      while True:
        msg = pickle.load(self._proc.stdout)
        if msg[0] == "ready":
          self.startup = dict(msg[3]) if len(msg) > 3 else {}
          self.startup["ready_s"] = time.perf_counter() - self.started
          self._on_ready(msg)
          self._ready.set()
        else:
          self._inbox.put(msg)
    except Exception:  # pylint: disable=broad-except  (EOF: the child ended)
      pass
    if not self._ready.is_set():
      self._on_no_start()
    self._inbox.put(("exit",))
    self._ready.set()

  def _send(self, msg: tuple) -> None:
    with self._send_lock:
      pickle.dump(msg, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
      self._proc.stdin.flush()

  def alive(self) -> bool:
    return self._proc.poll() is None

  def how_it_ended(self) -> str:
    """The child's exit, in words (it has ended or is ending)."""
    try:
      code = self._proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
      return "still running"
    return f"signal {-code}" if code < 0 else f"exit code {code}"

  def close(self, kill: bool = False) -> None:
    """Ends the child (asked to quit first unless ``kill``) and removes its folders."""
    if self.alive():
      if not kill:
        try:
          self._send(("quit",))
          self._proc.wait(timeout=2.0)
        except Exception:  # pylint: disable=broad-except
          pass
      if self.alive():
        self._proc.kill()
        try:
          self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
          pass
    for folder in (self._tmp, self._disk_tmp):
      if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
