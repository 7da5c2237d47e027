"""The child process of ``kernel_sandbox``: runs compiled kernels for its parent.

It imports neither jax, Triton nor torch (its start is Python, NumPy and a
CUDA context, well under a second): it loads each kernel from the
attributes ``direct_launch.kernel_attributes`` decoded (a cubin or PTX, the
symbol, grid, block, shared memory and parameters), launches it through the
CUDA driver with ``ctypes`` exactly as ``direct_launch.c`` does in XLA's
program, and hands the outputs back. A kernel that faults poisons this
process's CUDA context, so after any CUDA error the child reports it and
exits; the parent starts a fresh one for the next kernel.

Run as a script (``python sandbox_child.py``), never imported by jaxfuse:
the parent package's import would bring jax in.

Protocol (pickled tuples on stdin and stdout):

* from the parent: ``("run", job, program)``, ``("quit",)``; a program is a
  dict: ``device`` (CUDA ordinal), ``buffers`` (bytes of each device
  buffer), ``inputs`` (``(buffer, path)``: the file's bytes are copied
  into the buffer), ``steps`` (``(attributes, buffer ids)``: one launch,
  its pointer parameters bound to the buffers in order), ``outputs``
  (``(buffer, path)``: the buffer's bytes written after the last launch).
  Raw bytes, so that no dtype (bfloat16) needs more than NumPy here;
* to the parent: ``("ready", pid, error or None, {step: seconds})``,
  ``("done", job, seconds)``, ``("fault", job, text)`` (then it exits),
  ``("unavailable", job, text)`` (not the kernel's doing: out of memory).
"""

import base64
import ctypes
import os
import pickle
import sys
import time

import numpy as np

# Parameter kinds (direct_launch.BUFFER ... BOOL).
BUFFER = 0
# Constants of the CUDA driver API (cuda.h).
FUNC_ATTR_SHARED_SIZE_BYTES = 1
FUNC_ATTR_MAX_DYNAMIC_SHARED = 8
DEV_ATTR_MAX_SHARED_PER_BLOCK_OPTIN = 97
STATIC_SHARED_LIMIT = 49152
OUT_OF_MEMORY = 2
# Bytes the outputs and temporaries start as: all ones is a NaN in every
# float type, so an output element the kernel never writes fails the check
# (XLA's fresh buffers often hold zeros, which could pass it).
POISON = 0xFF


class CudaError(RuntimeError):

  def __init__(self, call: str, code: int, text: str):
    super().__init__(f"{call} failed: CUDA error {code} ({text})")
    self.code = code


class Driver:
  """The CUDA driver calls the child makes, through ctypes."""

  def __init__(self, path: str = ""):
    self.lib = ctypes.CDLL(path or os.environ.get("JAXFUSE_CUDA_DRIVER") or "libcuda.so.1")
    self.ptr_args = {"cuMemAlloc_v2": [ctypes.c_void_p, ctypes.c_size_t],
                     "cuMemcpyHtoD_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t],
                     "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
                     "cuMemsetD8_v2": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t],
                     "cuMemFree_v2": [ctypes.c_uint64],
                     "cuModuleLoadData": [ctypes.c_void_p, ctypes.c_char_p],
                     "cuModuleGetFunction": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p],
                     "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
                     "cuFuncGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p],
                     "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7
                                       + [ctypes.c_void_p] * 3}
    for name, types in self.ptr_args.items():
      getattr(self.lib, name).argtypes = types

  def __call__(self, name: str, *args) -> None:
    r = getattr(self.lib, name)(*args)
    if r != 0:
      text = ctypes.c_char_p()
      self.lib.cuGetErrorString(r, ctypes.byref(text))
      raise CudaError(name, r, (text.value or b"?").decode(errors="replace"))


class Runner:
  """One CUDA context (the device's primary one) and the kernels loaded in it."""

  def __init__(self, driver: Driver, device: int):
    self.cu = driver
    self.cu("cuInit", 0)
    self.dev = ctypes.c_int()
    self.cu("cuDeviceGet", ctypes.byref(self.dev), device)
    self.ctx = ctypes.c_void_p()
    self.cu("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.dev)
    self.cu("cuCtxSetCurrent", self.ctx)
    self.device = device
    self.functions: dict[int, ctypes.c_void_p] = {}

  def function(self, attrs: dict) -> ctypes.c_void_p:
    """The kernel of ``attrs``, loaded once (``attrs['kid']`` names it)."""
    fn = self.functions.get(attrs["kid"])
    if fn is not None:
      return fn
    image = attrs["image"]
    image = base64.b64decode(image) if attrs["image_kind"] == 1 else image.encode() + b"\0"
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    self.cu("cuModuleLoadData", ctypes.byref(mod), image)
    self.cu("cuModuleGetFunction", ctypes.byref(fn), mod, attrs["name"].encode())
    if attrs["smem"] > STATIC_SHARED_LIMIT:
      # Over 48 KiB of shared memory must be opted into per function.
      optin, fixed = ctypes.c_int(), ctypes.c_int()
      self.cu("cuDeviceGetAttribute", ctypes.byref(optin), DEV_ATTR_MAX_SHARED_PER_BLOCK_OPTIN,
              self.dev)
      if attrs["smem"] > optin.value:
        raise CudaError("launch", 1, "the kernel needs more shared memory than the device has")
      self.cu("cuFuncGetAttribute", ctypes.byref(fixed), FUNC_ATTR_SHARED_SIZE_BYTES, fn)
      self.cu("cuFuncSetAttribute", fn, FUNC_ATTR_MAX_DYNAMIC_SHARED, optin.value - fixed.value)
    self.functions[attrs["kid"]] = fn
    return fn

  def launch(self, attrs: dict, pointers: list[int]) -> None:
    """One launch of ``attrs``' kernel, its pointer parameters bound to
    ``pointers`` in order, then Triton's two hidden scratch pointers, as
    ``direct_launch.c`` does: the global scratch is the pointer at
    ``attrs['scratch']`` (taken out of the parameters' order) or null, the
    profile scratch null."""
    kinds, values = attrs["kinds"], attrs["values"]
    n = len(kinds)
    slots = (ctypes.c_uint64 * (n + 2))()
    pointers = list(pointers)
    scratch = int(attrs.get("scratch", -1))
    if scratch >= 0:
      slots[n] = pointers.pop(scratch)
    ptrs = iter(pointers)
    for i, (kind, value) in enumerate(zip(kinds, values)):
      if kind == BUFFER:
        slots[i] = next(ptrs)
        if value > 0:   # a buffer the call zeroes first
          self.cu("cuMemsetD8_v2", slots[i], 0, value)
      else:
        slots[i] = value & (2**64 - 1)   # a scalar's bits; the kernel reads the low bytes
    params = (ctypes.c_void_p * (n + 2))(
        *[ctypes.addressof(slots) + 8 * i for i in range(n + 2)])
    g = attrs["grid"]
    self.cu("cuLaunchKernel", self.function(attrs), g[0], g[1], g[2], attrs["block"], 1, 1,
            attrs["smem"], None, params, None)

  def run(self, program: dict) -> None:
    """Runs ``program`` (the module docstring's form) and writes its outputs."""
    ptrs: list[int] = []
    try:
      for nbytes in program["buffers"]:
        p = ctypes.c_uint64()
        self.cu("cuMemAlloc_v2", ctypes.byref(p), max(int(nbytes), 1))
        ptrs.append(p.value)
      loaded = {b for b, _ in program["inputs"]}
      for b, nbytes in enumerate(program["buffers"]):
        if b not in loaded:
          self.cu("cuMemsetD8_v2", ptrs[b], POISON, max(int(nbytes), 1))
      for b, path in program["inputs"]:
        a = np.fromfile(path, dtype=np.uint8)
        if a.nbytes != program["buffers"][b]:
          raise ValueError(f"input {path}: {a.nbytes} bytes for a buffer of "
                           f"{program['buffers'][b]}")
        self.cu("cuMemcpyHtoD_v2", ptrs[b], a.ctypes.data, a.nbytes)
      for attrs, bound in program["steps"]:
        self.launch(attrs, [ptrs[b] for b in bound])
      self.cu("cuCtxSynchronize")
      for b, path in program["outputs"]:
        a = np.empty(program["buffers"][b], dtype=np.uint8)
        self.cu("cuMemcpyDtoH_v2", a.ctypes.data, ptrs[b], a.nbytes)
        a.tofile(path)
    finally:
      for p in ptrs:
        try:
          self.cu("cuMemFree_v2", p)
        except CudaError:
          pass


def main() -> None:
  out = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)   # stray prints must not corrupt the protocol

  def send(msg: tuple) -> None:
    pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()

  runner = None
  steps = {}
  try:
    t = time.perf_counter()
    driver = Driver()
    runner = Runner(driver, int(os.environ.get("JAXFUSE_SANDBOX_DEVICE", "0")))
    steps["cuda"] = time.perf_counter() - t
    send(("ready", os.getpid(), None, steps))
  except Exception as e:  # pylint: disable=broad-except  (no driver, no device)
    send(("ready", os.getpid(), f"{type(e).__name__}: {e}"[:500], steps))
    return
  while True:
    try:
      msg = pickle.load(sys.stdin.buffer)
    except Exception:  # pylint: disable=broad-except  (EOF: the parent ended)
      return
    if msg[0] != "run":
      return
    _, job, program = msg
    t = time.perf_counter()
    try:
      runner.run(program)
    except CudaError as e:
      if e.code == OUT_OF_MEMORY and "cuMemAlloc" in str(e):
        send(("unavailable", job, str(e)))
        continue
      send(("fault", job, str(e)))
      return   # the context may be poisoned: the next kernel gets a fresh child
    except Exception as e:  # pylint: disable=broad-except  (unreadable input, full disk)
      send(("unavailable", job, f"{type(e).__name__}: {e}"[:500]))
      continue
    send(("done", job, time.perf_counter() - t))


if __name__ == "__main__":
  main()
