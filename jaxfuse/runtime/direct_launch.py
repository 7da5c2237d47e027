"""jaxfuse's own XLA FFI target for launching a compiled Triton kernel.

jax-triton compiles and serializes each kernel call; jaxlib's handler for
that call finds the kernel again on every execution (it hashes the
serialized call, then checks module and context caches under locks). On an
H100 host a fused call cost 4.3 us of host time that way, against 0.7 us for
each kernel XLA launches itself (benchmarks/RESULTS.md, eighth session),
which made small fused calls no faster per call than XLA's 2-3 kernels.

This module keeps jax-triton's compilation and replaces the call: the
serialized call is decoded once, at lowering, into plain FFI attributes
(``kernel_attributes``) of the target ``jaxfuse_direct_launch``, whose
handler (``direct_launch.c``, built here with the system C compiler and
cached) finds the kernel by a 64-bit id and launches it. The attributes
(with the cubin) are kept in the plan cache (``store_attributes``), so a
later process emits the call without compiling the kernel.

Where the installed jaxlib's FFI has the record stage (jaxlib 0.11) and
``config.record`` is on, the handler also has that stage and calls lower to
``RECORD_TARGET``: inside XLA's command buffers the launch is then a kernel
node that XLA creates and updates itself, and a kernel that waits on its
grid dependency (``waits_before_memory``) may start under its predecessor,
as XLA's own kernels do (``records``).

Example (what ``triton_call``'s lowering does with ``config.launch ==
"direct"``)::

    if direct_launch.available():
      direct_launch.rewrite_call(results, opaque)   # the custom call, in place
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import zlib
from typing import Any, Callable, Optional

from absl import logging

from jaxfuse.runtime import triton_call as _wire

__all__ = ["TARGET", "SOURCE", "available", "records", "build", "kernel_attributes", "kernel_id",
           "waits_before_memory", "rewrite_call",
           "apply_attributes", "load_attributes", "store_attributes", "UnsupportedCall",
           "grid_waits"]

TARGET = "jaxfuse_direct_launch"
# The same handler with XLA's record stage (``records()``).
RECORD_TARGET = "jaxfuse_direct_launch_rec"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "direct_launch.c")

# Parameter kinds of the handler's ``kinds`` attribute (direct_launch.c).
BUFFER, I32, U32, I64, U64, F32, F64, BOOL = range(8)

_lock = threading.Lock()
_state: dict[str, Any] = {}


class UnsupportedCall(ValueError):
  """A serialized call this launcher does not take (autotuned, clusters)."""


# ------------------------------------------------------------------ build
def _compiler() -> Optional[str]:
  cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
  return cc or None


RECORD_HEADER = os.path.join("xla", "ffi", "api", "record_c_api.h")


def build(cache_dir: Optional[str] = None, record: bool = False) -> str:
  """Compiles ``direct_launch.c`` into a shared library (once per source,
  FFI headers and compiler) and returns its path. ``record``: with the
  record stage (``jaxfuse_direct_record``) where the installed jaxlib's
  FFI headers have it and it compiles against them; otherwise, and when
  False, without. Raises RuntimeError when there is no C compiler or the
  compile fails."""
  import jax  # pylint: disable=g-import-not-at-top
  include = jax.ffi.include_dir()
  if record and os.path.exists(os.path.join(include, RECORD_HEADER)):
    try:
      return _build(cache_dir, include, ["-DJAXFUSE_RECORD"])
    except RuntimeError as e:
      # The record extension is still changing in XLA: a jaxlib whose API
      # differs from the one this source was written for keeps capture.
      logging.info("jaxfuse: direct launch without the record stage (%s)", e)
  return _build(cache_dir, include, [])


def _build(cache_dir: Optional[str], include: str, defines: list[str]) -> str:
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  cc = _compiler()
  if cc is None:
    raise RuntimeError("no C compiler (set CC or install cc)")
  h = hashlib.sha256()
  headers = [os.path.join(include, "xla", "ffi", "api", "c_api.h")]
  if defines:
    headers.append(os.path.join(include, RECORD_HEADER))
  for path in [SOURCE] + headers:
    with open(path, "rb") as f:
      h.update(f.read())
  h.update(cc.encode())
  h.update(" ".join(defines).encode())
  out_dir = os.path.join(cache_dir or config.cache_dir, "direct_launch")
  lib = os.path.join(out_dir, f"jaxfuse_direct_launch_{h.hexdigest()[:16]}.so")
  if os.path.exists(lib):
    return lib
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [cc, "-O2", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE", *defines, "-I", include,
         SOURCE, "-o", tmp, "-ldl", "-lpthread"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"compiling {os.path.basename(SOURCE)} failed: {proc.stderr.strip()[-800:]}")
  os.replace(tmp, lib)   # atomic: concurrent builders agree on the result
  return lib


def available() -> bool:
  """Whether the target is registered with XLA for CUDA (builds and
  registers it on first use; on failure logs one line and returns False,
  so that callers keep jaxlib's launcher)."""
  with _lock:
    if "ok" in _state:
      return _state["ok"]
    try:
      import jax  # pylint: disable=g-import-not-at-top
      from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top
      from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
      lib = ctypes.CDLL(build(record=config.record))
      # A launch is a pure function of the attributes and buffers, so XLA
      # may record it into its command buffers (CUDA graphs). Without this
      # trait every call split the graph and cost more host time than
      # jaxlib's call (H100, 2026-11-21).
      traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
      lib.jaxfuse_direct_launch_set_traits(ctypes.c_uint32(int(traits)))
      _state["record"] = _register(jax, lib, traits)
      _state["lib"] = lib   # keeps the library loaded for XLA
      _state["ok"] = True
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("jaxfuse: direct kernel launch unavailable (%s); using jaxlib's "
                      "Triton call", e)
      _state["ok"] = False
    return _state["ok"]


def _register(jax, lib, traits) -> bool:
  """Registers ``TARGET``; where the library has the record stage, also
  ``RECORD_TARGET`` with it, and returns whether that worked.

  jax registers a target's handlers through the GPU plugin, which passes on
  the instantiate, prepare, initialize and execute stages only (jax 0.11.2),
  so the record stage cannot be registered from here. The handler's
  instantiate stage can register it through XLA's own FFI API: compiling a
  call of ``TARGET`` whose ``register_record`` attribute names
  ``RECORD_TARGET`` does that (``direct_launch.c``)."""
  execute = jax.ffi.pycapsule(lib.jaxfuse_direct_launch)
  if not hasattr(lib, "jaxfuse_direct_record_registered"):
    jax.ffi.register_ffi_target(TARGET, execute, platform="CUDA", traits=traits)
    return False
  jax.ffi.register_ffi_target(TARGET, {"instantiate": execute, "execute": execute},
                              platform="CUDA", traits=traits)
  try:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    byte = jax.ShapeDtypeStruct((1,), jnp.uint8)
    call = jax.ffi.ffi_call(TARGET, byte)
    jax.jit(lambda x: call(x, register_record=RECORD_TARGET)).lower(byte).compile()
  except Exception as e:  # pylint: disable=broad-except   (launches are then captured)
    logging.info("jaxfuse: direct launch without the record stage (%s)", e)
  return bool(lib.jaxfuse_direct_record_registered())


def records() -> bool:
  """Whether XLA records the direct launches lowered now as kernel nodes:
  ``config.record`` is on (read at each lowering, so turning it off later
  in the process takes effect) and the record target is registered."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  return bool(config.record) and available() and bool(_state.get("record"))


def grid_waits() -> bool:
  """Whether kernels generated now should wait on their grid dependency
  (``codegen.generate(grid_wait=True)``): they launch directly, XLA records
  the launches (so it may start them under their predecessor), and the GPU
  and Triton have the instruction. One decision for both sides, so that a
  kernel carries the wait exactly when its launch can use it."""
  from jaxfuse.codegen import compile as _compile  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  return (config.launch == _wire.DIRECT and _compile.grid_dependency_supported()
          and records())


# --------------------------------------------------------------- attributes
def _fields(buf: bytes) -> dict[int, list[bytes]]:
  out: dict[int, list[bytes]] = {}
  for number, _, payload in _wire._decode(buf):  # pylint: disable=protected-access
    out.setdefault(number, []).append(payload)
  return out


def _uint(fields: dict[int, list[bytes]], number: int, default: int = 0) -> int:
  if number not in fields:
    return default
  return _wire._varint(fields[number][-1], 0)[0]  # pylint: disable=protected-access


def _signed(v: int, bits: int) -> int:
  return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _parameter(buf: bytes) -> tuple[int, int]:
  """(kind, value) of a ``TritonKernelCall.Parameter`` (jaxlib/gpu/
  triton.proto): for an array the bytes to zero, for a scalar its bits as
  a signed 64-bit integer (the handler reads the low bytes)."""
  f = _fields(buf)
  if 1 in f:
    return BUFFER, _uint(_fields(f[1][-1]), 1)
  if 2 in f:
    return BOOL, _uint(f, 2) & 1
  if 3 in f:
    return I32, _signed(_uint(f, 3) & 0xFFFFFFFF, 32)
  if 4 in f:
    return U32, _uint(f, 4) & 0xFFFFFFFF
  if 5 in f:
    return I64, _signed(_uint(f, 5), 64)
  if 6 in f:
    return U64, _signed(_uint(f, 6), 64)
  if 7 in f:
    return F32, struct.unpack("<i", f[7][-1])[0]
  if 8 in f:
    return F64, struct.unpack("<q", f[8][-1])[0]
  raise UnsupportedCall("kernel parameter of unknown type")


# PTX instructions that may touch memory a previous kernel wrote (any load or
# store but a parameter load, async and bulk copies, atomics, reductions,
# prefetches), after an optional predicate guard.
_MEMORY_OPS = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:ld\.(?!param)|st\.|cp\.|atom\.|red\.|"
                         r"prefetch|multimem\.)", re.M)
_GRID_WAIT = re.compile(r"^\s*griddepcontrol\.wait\b", re.M)   # unpredicated
_BRANCH = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:bra|brx|call)\b", re.M)


def waits_before_memory(ptx: str) -> bool:
  """Whether the kernel in ``ptx`` waits on its grid dependency
  (``griddepcontrol.wait``, on every path) before its first memory
  instruction. Only such a kernel may be started while the kernel before
  it still runs (programmatic dependent launch): the wait keeps it from
  reading that kernel's results, or overwriting its inputs, early."""
  wait = _GRID_WAIT.search(ptx)
  if wait is None:
    return False
  branch = _BRANCH.search(ptx)
  if branch is not None and branch.start() < wait.start():
    return False       # some path might skip the wait
  first = _MEMORY_OPS.search(ptx)
  return first is None or wait.start() < first.start()


def kernel_attributes(opaque: bytes, n_buffers: int,
                      cubin: Optional[Callable[[str, int, int], bytes]] = None) -> dict:
  """The handler's attributes for a serialized jax-triton call (zlib of a
  ``TritonAnyKernelCall``). ``n_buffers``: operands plus results of the
  custom call, which the kernel's pointer parameters take in order.
  ``cubin(ptx, compute_capability, num_warps)`` compiles the PTX ahead of
  time; without it (or when it fails) the driver compiles the PTX on first
  launch. ``uses_pdl``: the kernel waits on its grid dependency before it
  touches memory (``waits_before_memory``). Raises UnsupportedCall for
  what the handler cannot launch."""
  try:
    any_call = _fields(zlib.decompress(opaque))
  except (zlib.error, ValueError) as e:
    raise UnsupportedCall(f"unreadable kernel call: {e}") from e
  if 1 not in any_call:
    raise UnsupportedCall("not a single kernel call (autotuned?)")
  call = _fields(any_call[1][-1])
  kernel = _fields(call[1][-1]) if 1 in call else {}
  if 1 not in kernel or 4 not in kernel:
    raise UnsupportedCall("kernel call without a kernel name or PTX")
  if _uint(kernel, 10, 1) != 1:
    raise UnsupportedCall("kernels on thread-block clusters are launched by jaxlib")
  name = kernel[1][-1].decode()
  ptx = kernel[4][-1].decode()
  num_warps = _uint(kernel, 2)
  smem = _uint(kernel, 3)
  cc = _uint(kernel, 6)
  grid = [_uint(call, n) for n in (2, 3, 4)]
  if 0 in grid:
    raise UnsupportedCall(f"empty grid {grid}")
  params = [_parameter(p) for p in call.get(5, [])]
  if sum(1 for k, _ in params if k == BUFFER) != n_buffers:
    raise UnsupportedCall(f"{sum(1 for k, _ in params if k == BUFFER)} pointer parameters "
                          f"for {n_buffers} buffers (aliased outputs?)")
  if len(params) > 128:
    raise UnsupportedCall("more than 128 kernel parameters")
  image, image_kind = ptx, 0
  if cubin is not None:
    try:
      image, image_kind = base64.b64encode(cubin(ptx, cc, num_warps)).decode("ascii"), 1
    except Exception as e:  # pylint: disable=broad-except
      logging.info("jaxfuse: ahead-of-time cubin failed (%s); the driver compiles the PTX", e)
  return {
      "kid": kernel_id(name, smem, image_kind, image),
      "image": image,
      "image_kind": image_kind,
      "name": name,
      "grid": grid,
      "block": 32 * num_warps,
      "smem": smem,
      "kinds": [k for k, _ in params],
      "values": [v for _, v in params],
      "uses_pdl": waits_before_memory(ptx),
  }


def kernel_id(name: str, smem: int, image_kind: int, image: str) -> int:
  """The handler's table key of a kernel image (the ``kid`` attribute)."""
  kid = hashlib.blake2b(f"{name}\0{smem}\0{image_kind}\0".encode() + image.encode(),
                        digest_size=8).digest()
  return int.from_bytes(kid, "little") & ((1 << 63) - 1)


def triton_cubin(ptx: str, compute_capability: int, num_warps: int) -> bytes:
  """PTX to cubin with Triton's own ``ptxas`` (the step Triton itself runs
  after PTX), so the kernel is the one Triton would launch."""
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  from triton.backends.nvidia.compiler import CUDABackend  # pylint: disable=g-import-not-at-top
  backend = CUDABackend(GPUTarget("cuda", compute_capability, 32))
  opt = backend.parse_options({"num_warps": num_warps})
  return backend.make_cubin(ptx, {}, opt, compute_capability)


def rewrite_call(results, opaque: bytes, record: bool = True) -> dict:
  """Turns the jax-triton custom call producing ``results`` into a typed
  FFI call of ``TARGET`` with ``kernel_attributes`` of ``opaque``, in
  place (see ``apply_attributes`` for ``record``), and returns those
  attributes. Raises UnsupportedCall (the op is left unchanged)."""
  op = _wire._op(results)  # pylint: disable=protected-access
  attrs = kernel_attributes(opaque, len(op.operands) + len(op.results), cubin=triton_cubin)
  apply_attributes(results, attrs, record=record)
  return attrs


def apply_attributes(results, attrs: dict, record: bool = True) -> None:
  """Makes the custom call producing ``results`` a typed FFI call of
  ``TARGET`` with ``attrs`` (``kernel_attributes``' dict), in place: of
  ``RECORD_TARGET`` where ``record`` and ``records()``, so that XLA
  records the launch as a kernel node; else XLA captures it from a stream."""
  from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
  i64 = mlir_ir.IntegerType.get_signless(64)
  recorded = record and records()
  config = {}
  for k, v in attrs.items():
    if k == "uses_pdl":
      # XLA starts a kernel node that says so before its predecessor ends;
      # only recorded launches are such nodes.
      if v and recorded:
        config[k] = mlir_ir.BoolAttr.get(True)
    elif isinstance(v, str):
      config[k] = mlir_ir.StringAttr.get(v)
    elif isinstance(v, list):
      config[k] = mlir_ir.DenseI64ArrayAttr.get(v)
    else:
      config[k] = mlir_ir.IntegerAttr.get(i64, v)
  _wire.set_typed_ffi(results, RECORD_TARGET if recorded else TARGET, config)


# ------------------------------------------------------- compiled-call cache
# Why: a new process compiled every kernel again at lowering (Triton's
# front end and LLVM inside jax-triton, which bypasses Triton's own cache,
# then ptxas here), although its plan, timing and self-check came from the
# plan cache: 0.4-0.7 s per kernel of a warm first call (H100, session 32).
_COMPILED = "compiled"     # the plan cache's folder of compiled kernel calls
_compiled: dict[str, dict] = {}   # this process's, by key
_STR_FIELDS = ("image", "name")
_INT_FIELDS = ("kid", "image_kind", "block", "smem")
_LIST_FIELDS = ("grid", "kinds", "values")


def _checked_attributes(value: dict) -> dict:
  """``value`` as ``kernel_attributes``' dict; ValueError when a field is
  missing or of the wrong type (a damaged entry must not reach the
  handler, which trusts its attributes)."""
  out = {}
  for k in _STR_FIELDS:
    if not isinstance(value.get(k), str) or not value[k]:
      raise ValueError(f"field {k!r} is not a non-empty string")
    out[k] = value[k]
  for k in _INT_FIELDS:
    if type(value.get(k)) is not int:   # pylint: disable=unidiomatic-typecheck  (not bool)
      raise ValueError(f"field {k!r} is not an integer")
    out[k] = value[k]
  for k in _LIST_FIELDS:
    v = value.get(k)
    if not isinstance(v, list) or any(type(x) is not int for x in v):  # pylint: disable=unidiomatic-typecheck
      raise ValueError(f"field {k!r} is not a list of integers")
    out[k] = list(v)
  if not isinstance(value.get("uses_pdl", False), bool):
    raise ValueError("field 'uses_pdl' is not a boolean")
  out["uses_pdl"] = value.get("uses_pdl", False)
  if "scratch" in value:   # a Gluon kernel's global scratch buffer (gluon_launch)
    if type(value["scratch"]) is not int or value["scratch"] < 0:  # pylint: disable=unidiomatic-typecheck
      raise ValueError("field 'scratch' is not a buffer index")
    out["scratch"] = value["scratch"]
  if (len(out["grid"]) != 3 or min(out["grid"]) < 1 or len(out["kinds"]) != len(out["values"])
      or any(not BUFFER <= k <= BOOL for k in out["kinds"]) or out["image_kind"] not in (0, 1)
      or out["block"] < 32 or out["smem"] < 0 or not 0 <= out["kid"] < 2**63):
    raise ValueError("fields out of range")
  return out


def load_attributes(key: Optional[str]) -> Optional[dict]:
  """The attributes ``store_attributes`` kept under ``key`` in this process
  or the plan cache, or None (a miss; a malformed entry is logged and
  ignored)."""
  if key is None:
    return None
  with _lock:
    hit = _compiled.get(key)
  if hit is not None:
    return dict(hit)
  from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
  value = cache.load_entry(_COMPILED, key)
  if value is None:
    return None
  try:
    attrs = _checked_attributes(value)
  except ValueError as e:
    logging.warning("jaxfuse: malformed compiled kernel call %s ignored (%s)", key, e)
    return None
  with _lock:
    _compiled[key] = attrs
  return dict(attrs)


def store_attributes(key: Optional[str], attrs: dict) -> None:
  """Keeps ``attrs`` under ``key`` (None: not kept), in this process and
  in the plan cache."""
  if key is None:
    return
  attrs = _checked_attributes(attrs)
  with _lock:
    _compiled[key] = attrs
  from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
  cache.store_entry(_COMPILED, key, attrs)
