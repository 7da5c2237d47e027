"""How a generated kernel becomes an XLA custom call on the GPU.

jax-triton compiles the kernel and serializes the call (a zlib-compressed
``jax_triton.TritonAnyKernelCall`` protobuf, jaxlib/gpu/triton.proto); this
module changes two things about the custom call it emits for jaxfuse's
kernels, and nothing for other jax-triton users:

* Form (``config.launch``): jaxfuse's own FFI target (``direct``, see
  ``direct_launch``: the call decoded once into attributes, no per-call
  lookup), else jaxlib's typed-FFI target ``triton_kernel_call_ffi``
  instead of jax-triton's legacy ``triton_kernel_call``. A legacy call
  cannot join XLA's command buffers; the typed one saved 1-1.7 us per call
  on small GEMM chains (H200, fourth session).
* Size: the serialized kernel is slimmed (``slim_kernel_call``): no line
  info in the PTX, no comment lines, no TTIR. jaxlib's FFI handler rebuilds
  the kernel from its serialized state on every execution (it copies the
  PTX and TTIR strings and hashes the PTX to find the loaded module,
  jaxlib/gpu/triton_kernels.cc), so host time per call grows with their
  size: 25-55 KB of PTX and 19-37 KB of TTIR for the paper cases, 15-33 KB
  and none once slimmed (an H200 A/B gave 0.1-1.3 us less per call, within
  run-to-run noise). Neither is needed to run: jaxlib compiles the PTX once
  and never reads the TTIR.

Example (what ``launch.triton_launch`` does)::

    jt = jax_triton_module()
    out = jt.triton_call(*args, kernel=k.fn, out_shape=..., grid=k.grid,
                         custom_call_target_name=call_target(jt), ...)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import zlib
from typing import Iterator, Optional, Sequence

from absl import logging

__all__ = ["jax_triton_module", "call_target", "gpu_name", "versions", "ffi_available",
           "as_typed_ffi", "set_typed_ffi",
           "slim_kernel_call", "strip_ptx_comments", "FFI_TARGET", "LEGACY_TARGET"]

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
DIRECT = "direct"   # jaxfuse's own FFI target (direct_launch)
# Target names jax-triton is handed for jaxfuse's kernels; only the lowering
# below understands them (it substitutes the real target).
# _CAPTURED: a direct launch XLA captures from a stream even where it
# records others as kernel nodes (``call_target(record=False)``).
_CAPTURED = "jaxfuse." + DIRECT + ".captured"
_SENTINEL = {"jaxfuse." + FFI_TARGET: FFI_TARGET, "jaxfuse." + LEGACY_TARGET: LEGACY_TARGET,
             "jaxfuse." + DIRECT: DIRECT, _CAPTURED: DIRECT}
_lock = threading.Lock()
_registered = False
_collecting = threading.local()   # collect_calls' list, per lowering thread


def jax_triton_module():
  import jax_triton  # pylint: disable=g-import-not-at-top  (fails on CPU jaxlib)
  return jax_triton


def ffi_available() -> bool:
  """jaxlib registers the typed-FFI Triton target after 0.10.2 (Pallas
  switched to it then)."""
  from jax._src.lib import version  # pylint: disable=g-import-not-at-top
  return tuple(version) > (0, 10, 2)


def call_target(jt, record: bool = True) -> str:
  """The ``custom_call_target_name`` to hand ``jt.triton_call`` for a
  jaxfuse kernel (registers the lowering that understands it). ``record``:
  a direct launch may be recorded as a kernel node of XLA's command
  buffers (``direct_launch.records``); False asks for a stream capture."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  _register_lowering(jt)
  if config.launch == DIRECT and direct_launch.available():
    return "jaxfuse." + DIRECT if record else _CAPTURED
  target = FFI_TARGET if config.launch in ("ffi", DIRECT) and ffi_available() else LEGACY_TARGET
  return "jaxfuse." + target


# ----------------------------------------------------------- protobuf wire
# The call is rewritten at the wire level: jaxlib exposes no parser for it,
# and the field numbers are part of its serialized format (stable).

def _varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = value = 0
  while True:
    if i >= len(buf) or shift > 63:
      raise ValueError("truncated varint")
    b = buf[i]
    i += 1
    value |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return value, i


def _put_varint(value: int) -> bytes:
  out = bytearray()
  while True:
    b = value & 0x7F
    value >>= 7
    out.append(b | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _decode(buf: bytes) -> list[tuple[int, int, bytes]]:
  """Top-level fields of a message: (number, wire type, payload); for
  length-delimited fields the payload is the content, otherwise the encoded
  value."""
  fields, i = [], 0
  while i < len(buf):
    tag, j = _varint(buf, i)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      _, k = _varint(buf, j)
      payload, i = buf[j:k], k
    elif wire == 1:
      payload, i = buf[j:j + 8], j + 8
    elif wire == 2:
      n, k = _varint(buf, j)
      payload, i = buf[k:k + n], k + n
    elif wire == 5:
      payload, i = buf[j:j + 4], j + 4
    else:
      raise ValueError(f"unsupported wire type {wire}")
    if i > len(buf) or number == 0:
      raise ValueError("truncated message")
    fields.append((number, wire, payload))
  return fields


def _encode(fields: list[tuple[int, int, bytes]]) -> bytes:
  out = bytearray()
  for number, wire, payload in fields:
    out += _put_varint(number << 3 | wire)
    if wire == 2:
      out += _put_varint(len(payload))
    out += payload
  return bytes(out)


def _rewrite(buf: bytes, number: int, fn) -> bytes:
  """``buf`` with each length-delimited field ``number`` replaced by
  ``fn(content)`` (None drops the field)."""
  out = []
  for f, wire, payload in _decode(buf):
    if f == number and wire == 2:
      payload = fn(payload)
      if payload is None:
        continue
    out.append((f, wire, payload))
  return _encode(out)


# TritonAnyKernelCall.kernel_call = 1; TritonKernelCall.kernel = 1;
# TritonKernel.ptx = 4, .ttir = 5 (jaxlib/gpu/triton.proto).
_ANY_KERNEL_CALL, _CALL_KERNEL, _KERNEL_PTX, _KERNEL_TTIR = 1, 1, 4, 5


def strip_ptx_comments(ptx: str) -> str:
  """PTX without whole-line ``//`` comments and blank lines (same program)."""
  return "\n".join(l for l in ptx.splitlines()
                   if l.strip() and not l.lstrip().startswith("//")) + "\n"


def slim_kernel_call(opaque: bytes) -> bytes:
  """The serialized call (zlib-compressed ``TritonAnyKernelCall``) without
  the kernel's TTIR and PTX comment lines. Anything it does not recognise
  (an autotuned call, a format it cannot parse) is returned unchanged."""
  try:
    any_call = zlib.decompress(opaque)

    def kernel(k: bytes) -> bytes:
      k = _rewrite(k, _KERNEL_TTIR, lambda _: None)
      return _rewrite(k, _KERNEL_PTX,
                      lambda p: strip_ptx_comments(p.decode("utf-8")).encode("utf-8"))

    slim = _rewrite(any_call, _ANY_KERNEL_CALL, lambda c: _rewrite(c, _CALL_KERNEL, kernel))
  except (zlib.error, ValueError, UnicodeDecodeError):
    return opaque
  return zlib.compress(slim)


@contextlib.contextmanager
def _without_line_info() -> Iterator[None]:
  """Triton compiles without debug line info inside (``.loc``/``.file``
  and DWARF sections are half of a kernel's PTX)."""
  try:
    from triton import knobs  # pylint: disable=g-import-not-at-top
    scope = knobs.compilation.scope()
  except (ImportError, AttributeError):   # Triton without knobs: keep line info
    yield
    return
  with scope:
    knobs.compilation.disable_line_info = True
    yield


# Modules Triton's native argument specializer imports when it first runs
# (python/src/specialize.cc, init_globals): imported normally before torch is
# hidden, so that none of them can see torch missing.
_SPECIALIZER_IMPORTS = ("triton._utils", "triton.runtime.jit", "triton.tools.tensor_descriptor",
                        "triton.experimental.gluon.nvidia.hopper", "triton.language")


class _HiddenFromThread:
  """A ``sys.meta_path`` finder that makes ``import torch`` fail in one thread only."""

  def __init__(self, thread: int):
    self.thread = thread

  def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
    if threading.get_ident() == self.thread and name.split(".")[0] == "torch":
      raise ModuleNotFoundError(f"jaxfuse hides {name} while Triton's specializer starts",
                                name=name)
    return None


@functools.lru_cache(maxsize=None)
def start_specializer_without_torch() -> bool:
  """Starts Triton's native argument specializer with torch hidden; True
  when it started so (once per process).

  The specializer imports torch the first time it runs (Triton 3.6), only
  to recognise ``torch.Tensor`` arguments, which jax-triton never passes.
  That import was 2-3 s of a cold ``jaxfuse.jit`` first call on the H100
  image (session 32). Started without torch, the specializer still takes
  torch tensors later, by their ``data_ptr`` attribute, to the same
  result. Where torch is already imported, or the specializer is missing or
  fails to start, nothing is done and jax-triton starts it as before."""
  import importlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if "torch" in sys.modules:
    return False
  try:
    from triton._C.libtriton import native_specialize_impl  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  for name in _SPECIALIZER_IMPORTS:
    try:
      importlib.import_module(name)
    except Exception:  # pylint: disable=broad-except  (absent in this Triton)
      pass
  if "torch" in sys.modules:   # one of those imported it
    return False
  hide = _HiddenFromThread(threading.get_ident())
  sys.meta_path.insert(0, hide)
  try:
    native_specialize_impl(None, 1, False, False, False)
  except Exception as e:  # pylint: disable=broad-except
    logging.info("jaxfuse: Triton's specializer did not start without torch (%s: %s)",
                 type(e).__name__, str(e)[:200])
    return False
  finally:
    sys.meta_path.remove(hide)
  return True


def set_typed_ffi(results, target: str, backend_config: dict) -> None:
  """Makes the custom call producing ``results`` a typed-FFI call
  (api_version 4) of ``target`` with ``backend_config`` (name -> MLIR
  attribute) as its attributes, in place."""
  from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
  op = _op(results)
  op.attributes["call_target_name"] = mlir_ir.StringAttr.get(target)
  op.attributes["api_version"] = mlir_ir.IntegerAttr.get(
      mlir_ir.IntegerType.get_signless(32), 4)
  op.attributes["backend_config"] = mlir_ir.DictAttr.get(backend_config)


def as_typed_ffi(results, target: str, name: str) -> None:
  """Turns the legacy custom call producing ``results`` (its opaque string
  in ``backend_config``) into a typed-FFI call of ``target`` whose backend
  config is ``{name, opaque}``, in place."""
  from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
  set_typed_ffi(results, target, {"name": mlir_ir.StringAttr.get(name),
                                  "opaque": _op(results).attributes["backend_config"]})


def slim_backend_config(results) -> None:
  """Replaces the serialized call in the legacy custom call producing
  ``results`` by ``slim_kernel_call`` of it, in place."""
  from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
  op = _op(results)
  attr = mlir_ir.StringAttr(op.attributes["backend_config"])
  op.attributes["backend_config"] = mlir_ir.StringAttr.get(slim_kernel_call(attr.value_bytes))


def _op(results):
  op = results[0].owner
  return getattr(op, "operation", op)


def _direct(results, record: bool = True) -> Optional[dict]:
  """Rewrites the call for jaxfuse's direct launcher (recorded where
  ``record`` and ``direct_launch.records``) and returns the launcher's
  attributes; None (with one log line) where the launcher does not take
  it, leaving the op unchanged."""
  from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  opaque = mlir_ir.StringAttr(_op(results).attributes["backend_config"]).value_bytes
  try:
    return direct_launch.rewrite_call(results, opaque, record=record)
  except direct_launch.UnsupportedCall as e:
    logging.info("jaxfuse: kernel launched through jaxlib, not directly: %s", e)
    return None


@contextlib.contextmanager
def collect_calls() -> Iterator[list]:
  """Within it, each jaxfuse kernel call lowered on this thread appends the
  launcher's attributes for its kernel (``direct_launch.kernel_attributes``'
  dict, the kernel compiled as the program will run it; None where they
  cannot be read), in lowering order: what ``kernel_sandbox`` launches.

  Example::

      with collect_calls() as calls:
        jax.jit(lambda *a: launch.triton_launch(k, a)).lower(*structs)
  """
  prev = getattr(_collecting, "calls", None)
  _collecting.calls = calls = []
  try:
    yield calls
  finally:
    _collecting.calls = prev


def _collect(results, attrs: Optional[dict] = None) -> None:
  """Hands ``collect_calls`` the attributes of the call producing
  ``results``: ``attrs`` when the direct launcher took it, else read from
  its serialized kernel (the PTX, which jaxlib's launcher loads too)."""
  calls = getattr(_collecting, "calls", None)
  if calls is None:
    return
  if attrs is None:
    from jax._src.lib.mlir import ir as mlir_ir  # pylint: disable=g-import-not-at-top
    from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
    op = _op(results)
    try:
      opaque = mlir_ir.StringAttr(op.attributes["backend_config"]).value_bytes
      attrs = direct_launch.kernel_attributes(opaque, len(op.operands) + len(op.results))
    except Exception as e:  # pylint: disable=broad-except  (UnsupportedCall, an odd op)
      logging.info("jaxfuse: kernel call not readable for the checking process: %s", e)
  calls.append(attrs)


def gpu_name() -> Optional[str]:
  """jax's first device's kind when it is a GPU (jax-triton compiles for
  device 0), else None."""
  try:
    import jax  # pylint: disable=g-import-not-at-top
    dev = jax.devices()[0]
  except Exception:  # pylint: disable=broad-except
    return None
  return str(dev.device_kind) if dev.platform == "gpu" else None


@functools.lru_cache(maxsize=None)
def _gpu_identity() -> Optional[str]:
  """``gpu_name()`` with its compute capability and the CUDA driver's
  version, or None without a GPU (once per process: it is read at every
  lowering of a kernel call)."""
  name = gpu_name()
  if name is None:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  cc = getattr(jax.devices()[0], "compute_capability", "?")
  return f"{name}|{cc}|{_driver_version()}"


def _driver_version() -> str:
  """The CUDA driver's version ("?" when it cannot be read): a cubin that
  one driver loads, an older one may refuse."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  try:
    lib = ctypes.CDLL(os.environ.get("JAXFUSE_CUDA_DRIVER") or "libcuda.so.1")
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
      return str(v.value)
  except (OSError, AttributeError):
    pass
  return "?"


@functools.lru_cache(maxsize=None)
def versions() -> str:
  """The jax, jaxlib, Triton and jax-triton versions ("-" for one not
  installed), which key what the plan cache keeps about compiled kernels."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  out = [jax.__version__, getattr(jaxlib, "__version__", "-")]
  for dist in ("triton", "jax-triton"):
    try:
      out.append(metadata.version(dist))
    except metadata.PackageNotFoundError:
      out.append("-")
  return "|".join(out)


@functools.lru_cache(maxsize=None)
def _handler_source() -> Optional[bytes]:
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  try:
    with open(direct_launch.SOURCE, "rb") as f:
      return f.read()
  except OSError:
    return None


# Knobs that name places, not code: measured tuning sets TRITON_CACHE_DIR,
# and keyed on it a tuned process stored calls that no later process found
# (H100, session 32).
_PLACE_KNOBS = frozenset({"TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR",
                          "TRITON_OVERRIDE_DIR", "TRITON_CACHE_MANAGER"})


def _compile_env() -> list[tuple[str, str]]:
  """The environment variables that change what Triton compiles: Triton's
  own list where it has one (what keys its cache), else every TRITON_*
  variable except those naming places."""
  import os  # pylint: disable=g-import-not-at-top
  try:
    from triton._C.libtriton import get_cache_invalidating_env_vars  # pylint: disable=g-import-not-at-top
    return sorted((str(k), str(v)) for k, v in get_cache_invalidating_env_vars().items())
  except Exception:  # pylint: disable=broad-except  (a Triton without it)
    return sorted((k, v) for k, v in os.environ.items()
                  if k.startswith("TRITON_") and k not in _PLACE_KNOBS)


def launch_key(parts: Sequence[bytes]) -> Optional[str]:
  """The plan cache key of a compiled kernel call described by ``parts``
  (what its compile and launch read of the kernel), with what every such
  key holds appended: the GPU and its driver, Triton's environment knobs
  (``_compile_env``), the jax, jaxlib, Triton and jax-triton versions and
  the launch handler's source. None without a GPU or the handler's source."""
  import hashlib  # pylint: disable=g-import-not-at-top
  gpu = _gpu_identity()
  handler = _handler_source()
  if gpu is None or handler is None:
    return None
  h = hashlib.sha256()
  for part in (*parts, gpu.encode(), repr(_compile_env()).encode(), versions().encode(), handler):
    h.update(hashlib.sha256(part).digest())
  return h.hexdigest()[:32]


def compiled_call_key(ctx, params: dict) -> Optional[str]:
  """The plan cache key of the direct launcher's attributes for a jax-triton
  call lowered with ``params`` (``triton_kernel_call_p``'s), or None where
  they are not kept: no GPU, an autotuned or heuristic kernel, zeroed
  outputs chosen by a function, a kernel without a source file.

  It hashes (``launch_key``) everything the compile and the call read: the
  kernel's whole source file (jaxfuse's kernels live in files named by
  their source, and a kernel may call other functions of its file), every
  lowering parameter, the operand and result types."""
  import inspect  # pylint: disable=g-import-not-at-top
  fn = params.get("fn")
  py_fn = getattr(fn, "fn", None)
  if not inspect.isfunction(py_fn) or callable(params.get("zeroed_outputs")):
    return None
  try:
    with open(inspect.getsourcefile(py_fn), "rb") as f:
      source = f.read()
  except (OSError, TypeError):
    return None
  rest = sorted((k, repr(v)) for k, v in params.items() if k != "fn")
  avals = [(tuple(a.shape), str(a.dtype)) for a in (*ctx.avals_in, *ctx.avals_out)]
  return launch_key((source, py_fn.__name__.encode(), repr(rest).encode(), repr(avals).encode()))


def jaxfuse_lowering(tl):
  """The lowering of ``tl.triton_kernel_call_p`` (``tl``: jax-triton's
  ``triton_lib``) that ``_register_lowering`` installs: calls that name a
  jaxfuse sentinel target are compiled by jax-triton (without line info)
  and given the slim serialized kernel and, for the FFI target, the typed
  form; for the direct target, a call compiled before (this process or the
  plan cache, ``compiled_call_key``) is emitted without compiling. Calls
  with any other target go to jax-triton's lowering untouched."""
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  legacy = tl.triton_kernel_call_lowering

  def lowering(ctx, *args, custom_call_target_name, **params):
    target: Optional[str] = _SENTINEL.get(custom_call_target_name)
    if target is None:
      return legacy(tl.get_cuda_backend, ctx, *args,
                    custom_call_target_name=custom_call_target_name, **params)
    record = custom_call_target_name != _CAPTURED
    key = compiled_call_key(ctx, params) if target == DIRECT else None
    attrs = direct_launch.load_attributes(key)
    if attrs is not None:
      import jax  # pylint: disable=g-import-not-at-top
      results = jax.ffi.ffi_lowering(
          LEGACY_TARGET, api_version=2, backend_config=b"",
          operand_output_aliases=dict(params.get("input_output_aliases") or ()))(ctx, *args)
      direct_launch.apply_attributes(results, attrs, record=record)
      _collect(results, attrs)
      return results
    start_specializer_without_torch()
    with _without_line_info():
      results = legacy(tl.get_cuda_backend, ctx, *args,
                       custom_call_target_name=LEGACY_TARGET if target == DIRECT else target,
                       **params)
    # The direct launcher reads the call once, at lowering: only the
    # calls left to jaxlib are slimmed.
    if target == DIRECT:
      attrs = _direct(results, record)
      if attrs is not None:
        direct_launch.store_attributes(key, attrs)
        _collect(results, attrs)
        return results
      target = FFI_TARGET if ffi_available() else LEGACY_TARGET
    _collect(results)
    slim_backend_config(results)
    if target == FFI_TARGET:
      as_typed_ffi(results, FFI_TARGET, params.get("name") or "jaxfuse_kernel")
    return results

  return lowering


def _register_lowering(jt) -> None:
  """Installs ``jaxfuse_lowering`` for jax-triton's calls on CUDA (once)."""
  global _registered
  with _lock:
    if _registered:
      return
    from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top
    tl = jt.triton_lib
    mlir.register_lowering(tl.triton_kernel_call_p, jaxfuse_lowering(tl), platform="cuda")
    _registered = True
