"""Turns printed Triton source into importable kernels.

``triton.jit`` needs its function's source in a file, so the source is written
under ``<cache_dir>/kernels/`` (named by its hash, written atomically) and
imported. The same file is imported twice at most: once compiled for the GPU
and once under Triton's interpreter (``TRITON_INTERPRET=1`` is set while the
interpreted copy is imported, which is when ``triton.jit`` reads it).

Example::

    mod = load_module(source, interpret=True)
    getattr(mod, pk.kernel_name)[grid](*tensors, **constexprs)   # pk = print_kernel(...)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import types
from typing import Iterator, Optional

__all__ = ["load_module", "kernel_dir", "interpret_env", "grid_dependency_supported"]

_lock = threading.Lock()
_modules: dict[tuple[str, bool], types.ModuleType] = {}


def kernel_dir(cache_dir: Optional[str] = None) -> str:
  if cache_dir is None:
    from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
    cache_dir = config.cache_dir
  d = os.path.join(cache_dir, "kernels")
  os.makedirs(d, exist_ok=True)
  return d


@contextlib.contextmanager
def interpret_env(interpret: bool) -> Iterator[None]:
  """Sets/clears TRITON_INTERPRET while a kernel module is imported or run."""
  old = os.environ.get("TRITON_INTERPRET")
  if interpret:
    os.environ["TRITON_INTERPRET"] = "1"
  else:
    os.environ.pop("TRITON_INTERPRET", None)
  try:
    yield
  finally:
    if old is None:
      os.environ.pop("TRITON_INTERPRET", None)
    else:
      os.environ["TRITON_INTERPRET"] = old


def _write_atomic(path: str, text: str) -> None:
  d = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".py")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def load_module(source: str, *, interpret: bool, cache_dir: Optional[str] = None
                ) -> tuple[types.ModuleType, str]:
  """Writes ``source`` to a file (once) and imports it; returns (module, path)."""
  h = hashlib.sha256(source.encode()).hexdigest()[:24]
  key = (h, bool(interpret))
  with _lock:
    mod = _modules.get(key)
    if mod is not None:
      return mod, mod.__file__
    path = os.path.join(kernel_dir(cache_dir), f"jaxfuse_kernel_{h}.py")
    try:
      with open(path) as f:
        same = f.read() == source
    except OSError:
      same = False
    if not same:
      _write_atomic(path, source)
    name = f"jaxfuse_kernel_{h}" + ("_interp" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    with interpret_env(interpret):
      spec.loader.exec_module(mod)
    sys.modules[name] = mod
    _modules[key] = mod
    return mod, path


@functools.lru_cache(maxsize=None)
def grid_dependency_supported() -> bool:
  """Whether kernels compiled for the GPU in this process can wait on their
  grid dependency (``triton_printer.PDL_FLAG``): this Triton has the
  instruction and jax's first GPU is a CUDA device of compute capability
  9.0 or newer. Whether they should is the launcher's call
  (``runtime.direct_launch.grid_waits``)."""
  # Only where jax is already loaded: a child process that compiles or
  # checks kernels without jax must not start a GPU backend for this.
  jax = sys.modules.get("jax")
  if jax is None:
    return False
  try:
    from triton.language.extra.cuda import gdc_wait  # pylint: disable=g-import-not-at-top,unused-import
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    major = int(str(getattr(gpus[0], "compute_capability", "0")).split(".")[0]) if gpus else 0
  except Exception:  # pylint: disable=broad-except   # no GPU backend, an older Triton
    return False
  return major >= 9

