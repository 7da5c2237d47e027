"""Launching a Gluon kernel (``codegen.gluon_printer``) as an XLA custom call.

jax-triton compiles Triton kernels from their TTIR; a Gluon kernel starts
one stage later (its source is TTGIR), so jax-triton cannot compile it.
This module compiles it with Triton itself (``triton.compile`` of a
``GluonASTSource`` for the GPU's compute capability) and calls it through
jaxfuse's own FFI target (``direct_launch``) with the same attributes a
Triton kernel gets, plus ``scratch``: the kernel makes its TMA descriptors
on the device, in a global scratch buffer of ``kernel.global_scratch``
bytes per program, which the call allocates as an extra result.

Example (what ``launch.triton_launch`` does for ``kernel.plan.form``)::

    outs = launch(kernel, args)
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence

import numpy as np

from jaxfuse import ir
from jaxfuse.codegen import CodegenError, GeneratedKernel

__all__ = ["attributes", "launch", "scratch_bytes"]

_POINTER = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}


def _capability() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    raise CodegenError("a Gluon kernel needs a CUDA GPU")
  major, _, minor = str(getattr(gpus[0], "compute_capability", "0.0")).partition(".")
  return int(major) * 10 + int(minor or 0)


def _call_key(kernel: GeneratedKernel, cc: int) -> Optional[str]:
  """The plan cache key of ``kernel``'s compiled call
  (``triton_call.launch_key``), or None where it is not kept: what the
  compile reads (source, constants, warps, compute capability) and what
  the call reads (grid, planned scratch)."""
  from jaxfuse.runtime import triton_call  # pylint: disable=g-import-not-at-top
  return triton_call.launch_key(tuple(part.encode() for part in (
      "gluon", kernel.source, repr(sorted(kernel.constexprs.items())), str(cc),
      repr(tuple(kernel.grid)), str(kernel.num_warps), str(kernel.global_scratch))))


def attributes(kernel: GeneratedKernel) -> dict:
  """The ``direct_launch`` attributes of ``kernel``, compiled once per
  source, constants and GPU, and kept in the plan cache for later
  processes (``direct_launch``'s compiled-call cache: a fresh process's
  Triton cache hit took 0.35 s for the d=128 kernel, 2-core host, Triton
  3.6, 2026-11-25). Raises
  CodegenError where it does not compile or the GPU is not a Hopper
  (compute capability 9.x)."""
  cc = _capability()
  if cc // 10 != 9:
    raise CodegenError(f"the Gluon kernel needs a Hopper GPU; this one is sm_{cc}")
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  key = _call_key(kernel, cc)
  hit = direct_launch.load_attributes(key)
  if hit is not None and hit.get("scratch") == len(kernel.region.inputs) + len(kernel.region.outputs):
    hit.pop("uses_pdl", None)   # not a Gluon kernel's attribute
    return hit
  attrs = _compile(kernel, cc)
  direct_launch.store_attributes(key, attrs)
  return attrs


def _compile(kernel: GeneratedKernel, cc: int) -> dict:
  """``attributes`` of ``kernel``, compiled now."""
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  try:
    from triton.experimental.gluon._runtime import GluonASTSource  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CodegenError(f"this Triton has no Gluon: {e}") from e
  from jaxfuse.runtime import launch as _launch  # pylint: disable=g-import-not-at-top
  _launch._ensure_triton_cache_dir()  # pylint: disable=protected-access  (triton.compile needs one)
  vm = kernel.region.value_map
  buffers = list(kernel.region.inputs) + list(kernel.region.outputs)
  pointers = [_POINTER[vm[b.value].dtype] for b in buffers]
  names = list(kernel.fn.arg_names)
  signature = {n: (pointers[i] if i < len(pointers) else "constexpr") for i, n in enumerate(names)}
  try:
    compiled = triton.compile(GluonASTSource(kernel.fn, signature, dict(kernel.constexprs)),
                              target=GPUTarget("cuda", cc, 32),
                              options=dict(num_warps=kernel.num_warps))
  except Exception as e:  # pylint: disable=broad-except
    raise CodegenError(f"Gluon kernel failed to compile: {type(e).__name__}: {str(e)[:400]}") from e
  md = compiled.metadata
  scratch = int(getattr(md, "global_scratch_size", 0) or 0)
  if scratch > kernel.global_scratch:
    raise CodegenError(f"the kernel asks for {scratch} bytes of global scratch per program, "
                       f"{kernel.global_scratch} were planned")
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  image = base64.b64encode(compiled.asm["cubin"]).decode("ascii")
  n = len(buffers)
  attrs = {
      "kid": direct_launch.kernel_id(md.name, int(md.shared), 1, image),
      "image": image, "image_kind": 1, "name": md.name,
      "grid": [int(g) for g in (tuple(kernel.grid) + (1, 1, 1))[:3]],
      "block": 32 * int(md.num_warps), "smem": int(md.shared),
      "kinds": [0] * n, "values": [0] * n,
      # The scratch buffer is the call's last result.
      "scratch": n,
  }
  return attrs


def scratch_bytes(kernel: GeneratedKernel, attrs: dict) -> int:
  """Bytes of the global scratch buffer a launch of ``attrs`` takes (at
  least one: XLA allocates no empty buffer)."""
  return max(1, int(np.prod(attrs["grid"])) * kernel.global_scratch)


def launch(kernel: GeneratedKernel, args: Sequence[Any]) -> list[Any]:
  """The kernel's outputs for ``args`` (the region's inputs, in order), as
  a custom call of ``direct_launch.TARGET``."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import direct_launch  # pylint: disable=g-import-not-at-top
  if not direct_launch.available():
    raise CodegenError("a Gluon kernel needs jaxfuse's direct launch (a C compiler)")
  attrs = attributes(kernel)
  vm = kernel.region.value_map
  outs = [jax.ShapeDtypeStruct(b.operand_shape, ir.np_dtype(vm[b.value].dtype))
          for b in kernel.region.outputs]
  scratch = jax.ShapeDtypeStruct((scratch_bytes(kernel, attrs),), np.uint8)
  call_attrs = {k: (np.asarray(v, np.int64) if isinstance(v, list) else v) for k, v in attrs.items()}
  res = jax.ffi.ffi_call(direct_launch.TARGET, outs + [scratch])(*args, **call_attrs)
  return list(res[:-1])
