"""Launching generated kernels: jax-triton on the GPU, Triton's interpreter on the CPU.

``fused_call(region, args, backend=...)`` plans the region (unless a plan is
given), generates the kernel and runs it:

* ``backend='triton'``: ``jax_triton.triton_call`` (imported lazily) with the
  plan's grid, ``num_warps`` and ``num_stages``; usable inside a lowering
  (``mlir.lower_fun``) and inside ``jax.jit``.
* ``backend='interpret'``: ``jax.pure_callback`` that runs the same kernel in
  Triton's interpreter on torch CPU tensors.

Plans are tried best first: a plan that fails to generate, to compile, to fit
in shared memory, or to pass a numerical self-check against the IR evaluator
is dropped for the next; when none works ``CodegenError`` is raised and the
caller runs the original ops.

Example::

    outs = fused_call(region, [q, k, v], backend="interpret")
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from absl import logging

from jaxfuse import ir
from jaxfuse.codegen import CodegenError, GeneratedKernel, generate
from jaxfuse.codegen.compile import interpret_env

__all__ = ["fused_call", "run_interpreted", "select_kernel", "measure_plans", "self_check"]

_lock = threading.Lock()
# (region signature, plan str, backend) -> GeneratedKernel, or the error that dropped it.
_kernels: dict[tuple, Any] = {}
# (region signature, backend) -> the kernel chosen by the fallback chain.
_chosen: dict[tuple, GeneratedKernel] = {}


# ------------------------------------------------------------------ CPU path
def _to_torch(a: np.ndarray):
  import torch  # pylint: disable=g-import-not-at-top
  a = np.ascontiguousarray(a)
  if a.dtype.name == "bfloat16":
    return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
  if a.dtype == np.bool_:
    return torch.from_numpy(a.copy())
  return torch.from_numpy(a.copy())


def _from_torch(t, dtype: str) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top
  if dtype == "bfloat16":
    return t.view(torch.uint16).numpy().view(ir.np_dtype("bfloat16")) if hasattr(torch, "uint16") \
        else t.view(torch.int16).numpy().view(ir.np_dtype("bfloat16"))
  return t.numpy()


def _torch_dtype(name: str):
  import torch  # pylint: disable=g-import-not-at-top
  return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "bool": torch.bool}[name]


_bf16_patched = False


def _patch_interpreter_bf16_dot() -> None:
  """Triton's interpreter multiplies bfloat16 dot operands as raw uint16 bits
  (seen in 3.9); widen them to float32 first. GPU compilation is unaffected."""
  global _bf16_patched
  if _bf16_patched:
    return
  _bf16_patched = True
  try:
    from triton.runtime import interpreter as interp  # pylint: disable=g-import-not-at-top
    import triton.language as tl  # pylint: disable=g-import-not-at-top
    builder_cls = type(interp.interpreter_builder)
    orig = builder_cls.create_dot
  except Exception:  # pylint: disable=broad-except
    return

  def widen(h):
    if h.dtype.scalar == tl.bfloat16 or getattr(h.dtype, "name", "") == "bf16":
      bits = h.data.astype(np.uint32) << 16
      return interp.TensorHandle(bits.view(np.float32), tl.float32)
    return h

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

  builder_cls.create_dot = create_dot


def run_interpreted(kernel: GeneratedKernel, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Runs ``kernel`` in Triton's interpreter on NumPy inputs; returns outputs.

  Float outputs start as NaN, so elements the kernel does not write show up.

  Example::

      k = generate(region, plan, interpret=True)
      (e,) = run_interpreted(k, [a, b, d])
  """
  import torch  # pylint: disable=g-import-not-at-top
  if not kernel.interpret:
    raise ValueError("kernel was not generated for the interpreter (interpret=False)")
  r = kernel.region
  if len(arrays) != len(r.inputs):
    raise ValueError(f"region takes {len(r.inputs)} inputs, got {len(arrays)}")
  vm = r.value_map
  ins = []
  for b, a in zip(r.inputs, arrays):
    a = np.asarray(a)
    want = ir.np_dtype(vm[b.value].dtype)
    if tuple(a.shape) != tuple(b.shape):
      raise ValueError(f"input {b.value}: shape {a.shape} != {b.shape}")
    ins.append(_to_torch(a.astype(want, copy=False)))
  outs = []
  for b in r.outputs:
    dt = vm[b.value].dtype
    fill = float("nan") if dt in ir.FLOAT_DTYPES else 0
    outs.append(torch.full(tuple(b.shape), fill, dtype=_torch_dtype(dt)))
  scratch = [torch.full((max(s.numel, 1),), float("nan"), dtype=torch.float32)
             for s in kernel.scratch]
  _patch_interpreter_bf16_dot()
  with interpret_env(True):
    if kernel.combine_fn is None:
      kernel.fn[kernel.grid](*ins, *outs, **kernel.constexprs)
    else:
      kernel.fn[kernel.grid](*ins, *scratch, **kernel.constexprs)
      kernel.combine_fn[kernel.combine_grid](*ins, *scratch, *outs, **kernel.constexprs)
  return [_from_torch(o, vm[b.value].dtype) for o, b in zip(outs, r.outputs)]
