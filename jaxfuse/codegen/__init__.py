"""Triton code generation for planned Chain IR regions.

``generate(region, plan)`` prints a Triton kernel that follows the plan (grid,
loop order, tiles, statement placement), writes it to a file and imports it.

Example::

    from jaxfuse import codegen
    k = codegen.generate(region, plan)
    print(k.source)            # readable Triton
    k.fn, k.grid, k.launch_options  # what the launcher needs
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from jaxfuse import ir
from jaxfuse.codegen.triton_printer import (PDL_FLAG, CodegenError, PrintedKernel, ScratchSpec,
                                           print_kernel)
from jaxfuse.planner.plan import Plan

__all__ = ["CodegenError", "GeneratedKernel", "ScratchSpec", "generate", "source"]


@dataclasses.dataclass(frozen=True, eq=False)
class GeneratedKernel:
  """A generated kernel (and, for split plans, its combine pass).

  ``fn`` takes the region's input pointers, then (split plans) the scratch
  pointers, then the output pointers, and ``**constexprs``. For a split plan
  ``fn`` writes only scratch and ``combine_fn`` (inputs, scratch, outputs)
  finishes the reduction; it takes ``**combine_constexprs`` (its own tiles).
  """
  region: ir.Region
  plan: Plan
  source: str
  module_path: str
  fn: Any
  grid: tuple[int, ...]
  num_warps: int
  num_stages: int
  constexprs: dict
  interpret: bool
  combine_fn: Any = None
  combine_grid: Optional[tuple[int, ...]] = None
  scratch: tuple[ScratchSpec, ...] = ()
  combine_constexprs: Optional[dict] = None
  # Bytes of global scratch each program of ``fn`` needs (the Gluon form's
  # TMA descriptors); 0: none.
  global_scratch: int = 0

  @property
  def launch_options(self) -> dict:
    """Triton's compile options for every launch of this kernel, by
    jax-triton and by measured tuning alike, so that tuning times the kernel
    that runs. FP fusion is asked for explicitly: the printed softmax shift
    ``s*c - max`` and the rescales rely on mul+add contracting into one FMA,
    and Triton 3.9 warns that its default turns it off from 3.10 on."""
    return dict(num_warps=self.num_warps, num_stages=self.num_stages, enable_fp_fusion=True)


def source(region: ir.Region, plan: Plan) -> str:
  """The kernel's Triton (or, for ``plan.form``, Gluon) source, without
  compiling or importing it."""
  if plan.form:
    return _print_form(region, plan).source
  return print_kernel(region, plan).source


def _print_form(region: ir.Region, plan: Plan):
  from jaxfuse.codegen import gluon_printer  # pylint: disable=g-import-not-at-top
  from jaxfuse.devices import get_device  # pylint: disable=g-import-not-at-top
  if plan.form != gluon_printer.GLUON_ATTENTION:
    raise CodegenError(f"unknown kernel form {plan.form!r}")
  return gluon_printer.print_kernel(region, plan, sm_count=get_device().sm_count)


def _generate_form(region: ir.Region, plan: Plan, *, interpret: bool,
                   cache_dir: Optional[str]) -> GeneratedKernel:
  """``generate`` for a plan of another kernel form than Triton's."""
  from jaxfuse.codegen import compile as _compile  # pylint: disable=g-import-not-at-top
  if interpret:
    raise CodegenError(f"kernel form {plan.form} runs on Hopper GPUs only, not in Triton's "
                       "interpreter")
  pk = _print_form(region, plan)
  try:
    mod, path = _compile.load_module(pk.source, interpret=False, cache_dir=cache_dir)
  except Exception as e:  # pylint: disable=broad-except   (no Gluon in this Triton, ...)
    raise CodegenError(f"generated kernel failed to import: {type(e).__name__}: {e}") from e
  return GeneratedKernel(
      region=region, plan=plan, source=pk.source, module_path=path,
      fn=getattr(mod, pk.kernel_name), grid=pk.grid, num_warps=pk.num_warps,
      num_stages=pk.num_stages, constexprs=dict(pk.constexprs), interpret=False,
      global_scratch=pk.global_scratch)


def generate(region: ir.Region, plan: Plan, *, interpret: Optional[bool] = None,
             cache_dir: Optional[str] = None, grid_wait: bool = False) -> GeneratedKernel:
  """Prints, writes and imports the kernel of ``plan`` for ``region``.

  ``interpret``: import it for Triton's interpreter (CPU); default: whether
  ``TRITON_INTERPRET`` is set. ``grid_wait``: the kernel (and its combine
  pass) first waits until the grids it depends on have finished
  (``PDL_FLAG``), for launches that may start under their predecessor
  (programmatic dependent launch); ignored by the interpreter and where the
  GPU or Triton lacks the instruction (``compile.grid_dependency_supported``).
  Raises ``CodegenError`` when the plan cannot be printed or imported.

  Example::

      k = generate(region, plan, interpret=True)
      k.fn[k.grid](*inputs, *outputs, **k.constexprs)
  """
  from jaxfuse.codegen import compile as _compile  # pylint: disable=g-import-not-at-top
  if interpret is None:
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
  if plan.form:
    return _generate_form(region, plan, interpret=interpret, cache_dir=cache_dir)
  pk: PrintedKernel = print_kernel(region, plan)
  try:
    mod, path = _compile.load_module(pk.source, interpret=interpret, cache_dir=cache_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise CodegenError(f"generated kernel failed to import: {type(e).__name__}: {e}") from e
  constexprs, combine_constexprs = dict(pk.constexprs), dict(pk.combine_constexprs)
  if grid_wait and not interpret and _compile.grid_dependency_supported():
    constexprs[PDL_FLAG] = combine_constexprs[PDL_FLAG] = 1
  return GeneratedKernel(
      region=region, plan=plan, source=pk.source, module_path=path,
      fn=getattr(mod, pk.kernel_name), grid=pk.grid, num_warps=pk.num_warps,
      num_stages=pk.num_stages, constexprs=constexprs, interpret=interpret,
      combine_fn=getattr(mod, pk.combine_name) if pk.combine_name else None,
      combine_grid=pk.combine_grid, scratch=pk.scratch,
      combine_constexprs=combine_constexprs if pk.combine_name else None)
