"""A Triton compile worker process for measured tuning (``compile_pool``).

Run as a script (``python compile_worker.py``), never imported by the
library: it must start without importing jax or jaxfuse, and it needs no GPU.
It reads one JSON job per line on stdin and answers one JSON line on stdout:

    {"path": ".../jaxfuse_kernel_<h>.py", "module": "jaxfuse_kernel_<h>",
     "target": ["cuda", 90, 32], "env": {...}, "cache_dir": "...",
     "fns": [["jaxfuse_mk_kn_mn__mn_nh_mh", "<spec>"], ...]}
    -> {"ok": true}  or  {"ok": false, "error": "..."}

``<spec>`` is Triton's own serialized specialization (the
``specialization_data`` its ``jit_cache_hook`` receives), and the kernel is
compiled with ``JITFunction.preload``, so the result lands in the shared
Triton cache directory under the very key the parent's own launch looks up
(``env``: the parent's cache-invalidating Triton variables, which are part
of that key; ``cache_dir``: the parent's ``TRITON_CACHE_DIR``).
Why a process: Triton's front end (Python AST to TTIR) holds the GIL, so a
batch of kernels compiled on threads ran mostly one after another.
"""

import importlib.util
import json
import os
import sys
import traceback


class _CompileOnlyDriver:
  """What ``JITFunction.preload`` asks of Triton's active driver, answered
  from the job's target: the worker never touches the GPU."""

  def __init__(self, target):
    self._target = target

  def get_current_device(self):
    return 0

  def get_current_stream(self, device=None):  # pylint: disable=unused-argument
    return 0

  def get_current_target(self):
    return self._target

  def get_device_capability(self, device=None):  # pylint: disable=unused-argument
    return divmod(int(self._target.arch), 10)


_modules = {}


def _module(path, name):
  mod = _modules.get(name)
  if mod is None:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    _modules[name] = mod
  return mod


def _set_env(env):
  from triton._C.libtriton import get_cache_invalidating_env_vars  # pylint: disable=import-outside-toplevel
  for name in set(get_cache_invalidating_env_vars()) - set(env):
    os.environ.pop(name, None)
  os.environ.update({str(k): str(v) for k, v in env.items()})


def run_job(job):
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.runtime.driver import driver  # pylint: disable=import-outside-toplevel
  _set_env(job.get("env") or {})
  if job.get("cache_dir"):
    os.environ["TRITON_CACHE_DIR"] = job["cache_dir"]
  else:
    os.environ.pop("TRITON_CACHE_DIR", None)
  backend, arch, warp = job["target"]
  driver.set_active(_CompileOnlyDriver(GPUTarget(backend, int(arch), int(warp))))
  mod = _module(job["path"], job["module"])
  for name, spec in job["fns"]:
    getattr(mod, name).preload(spec)


def main():
  # Replies go to the original stdout; anything Triton or LLVM prints goes
  # to stderr, so it cannot corrupt the protocol.
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  # The kernels are compiled for the GPU even where the parent runs others
  # in Triton's interpreter.
  os.environ.pop("TRITON_INTERPRET", None)
  import triton  # pylint: disable=import-outside-toplevel,unused-import  (warm start)
  # The compiler too: a first job that imported it took seconds on a
  # cold machine, and the caller's readiness wait is the place for that.
  try:
    import triton.compiler.compiler  # pylint: disable=import-outside-toplevel,unused-import
    import triton.backends.nvidia.compiler  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pass
  out.write(json.dumps({"ok": True, "ready": True}) + "\n")
  out.flush()
  for line in sys.stdin:
    if not line.strip():
      continue
    try:
      run_job(json.loads(line))
      reply = {"ok": True}
    except Exception as e:  # pylint: disable=broad-except
      reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
               "trace": traceback.format_exc()[-2000:]}
    out.write(json.dumps(reply) + "\n")
    out.flush()


if __name__ == "__main__":
  main()
