"""The ``jaxfuse_region`` primitive: one fused region as one jaxpr equation.

Each captured region becomes one equation ``jaxfuse_region[name=..]`` whose
parameters carry the region's Chain IR (``region``, an ``ir.Region``; hashes
by its canonical signature) and the region's original ops (``jaxpr``, a
``ClosedJaxpr`` taking the region inputs in ``region.inputs`` order and
returning the outputs in ``region.outputs`` order).

Rules:

* abstract eval: shapes and dtypes of the region's output buffers;
* lowering: by default the original ops (so on the CPU the result equals
  ``jax.jit``'s exactly); on CUDA with ``config.backend`` in (auto, triton)
  the generated Triton kernel via ``jaxfuse.runtime.launch.fused_call``; on the
  CPU with ``config.backend == 'interpret'`` the same kernel in Triton's
  interpreter. Where the kernel is dropped (a keep-or-drop decision) or
  fails (one log line), the region runs its fallback: a chain's parts with
  fewer contractions, each lowered as a region of its own, else the original
  ops. A keep-or-drop timing compares the kernel with that fallback;
* JVP: the primal through the primitive, tangents through ``jax.jvp`` of the
  original ops (so ``jax.grad`` works; the backward runs the original ops);
* batching: the vmapped original ops are re-captured, so the batch folds into
  the region's loops; when that does not give one region, the vmapped original
  ops run instead.

Example::

    from jaxfuse.runtime.primitive import bind_region
    outs = bind_region(region, closed_jaxpr, *inputs)   # list of arrays
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxfuse import ir
from jaxfuse.config import config

try:  # public home since jax 0.4.3x
  from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
except ImportError:  # pragma: no cover - older jax
  from jax.core import ClosedJaxpr, Primitive, jaxpr_as_fun  # type: ignore

__all__ = ["jaxfuse_region_p", "bind_region", "region_out_avals",
           "count_regions"]

jaxfuse_region_p = Primitive("jaxfuse_region")
jaxfuse_region_p.multiple_results = True
try:
  # A region in a program XLA partitions lowers through custom_partitioning
  # (jaxfuse.runtime.partitioning), whose lowering needs the program's
  # devices; jax passes them only to programs holding such primitives.
  from jax._src import dispatch as _dispatch  # pylint: disable=g-import-not-at-top
  _dispatch.prim_requires_devices_during_lowering.add(jaxfuse_region_p)
except (ImportError, AttributeError):  # pragma: no cover - internal API moved
  pass


def _eval_original(*args: Any, jaxpr: ClosedJaxpr) -> list[Any]:
  """Evaluates the region's original ops on ``args`` (binds them as usual)."""
  return list(jaxpr_as_fun(jaxpr)(*args))


def region_out_avals(region: ir.Region, jaxpr: ClosedJaxpr) -> list[Any]:
  """Output avals from the region's output buffers.

  ``weak_type`` (and sharding, where the shapes agree) come from the original
  ops' avals so that the rest of the program types exactly as it did before
  the rewrite.
  """
  vm = region.value_map
  avals = []
  orig = list(jaxpr.out_avals)
  for i, buf in enumerate(ir.operand_buffers(region.outputs)):
    shape = tuple(int(d) for d in buf.operand_shape)
    dtype = ir.np_dtype(vm[buf.value].dtype)
    if i < len(orig) and tuple(orig[i].shape) == shape and orig[i].dtype == dtype:
      avals.append(orig[i])
    else:
      avals.append(jax.core.ShapedArray(shape, dtype))
  return avals


def check_consistent(region: ir.Region, jaxpr: ClosedJaxpr) -> str | None:
  """Why the region and its original ops disagree on inputs/outputs, or None."""
  ins, outs = ir.operand_buffers(region.inputs), ir.operand_buffers(region.outputs)
  if len(ins) != len(jaxpr.in_avals):
    return (f"region has {len(ins)} inputs, its jaxpr "
            f"{len(jaxpr.in_avals)}")
  if len(outs) != len(jaxpr.out_avals):
    return (f"region has {len(outs)} outputs, its jaxpr "
            f"{len(jaxpr.out_avals)}")
  vm = region.value_map
  for kind, bufs, avals in (("input", ins, jaxpr.in_avals),
                            ("output", outs, jaxpr.out_avals)):
    for buf, aval in zip(bufs, avals):
      shape = tuple(int(d) for d in buf.operand_shape)
      dtype = ir.np_dtype(vm[buf.value].dtype)
      if tuple(aval.shape) != shape or np.dtype(aval.dtype) != dtype:
        return (f"{kind} {buf.value}: region {vm[buf.value].dtype}{list(shape)}"
                f" vs jaxpr {aval.str_short()}")
  return None


def bind_region(region: ir.Region, jaxpr: ClosedJaxpr, *args: Any,
                name: str | None = None) -> list[Any]:
  """Binds ``jaxfuse_region`` on ``args``; returns the list of outputs."""
  return jaxfuse_region_p.bind(*args, region=region, jaxpr=jaxpr,
                               name=name or region.name)


# --------------------------------------------------------------------------
# Impl and abstract eval
# --------------------------------------------------------------------------

def _impl(*args, region, jaxpr, name):
  # Eager: compile the single primitive like any other (this goes through the
  # lowering rules below, so the interpret backend is honoured too).
  try:
    from jax._src.dispatch import apply_primitive  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return _eval_original(*args, jaxpr=jaxpr)
  return apply_primitive(jaxfuse_region_p, *args, region=region, jaxpr=jaxpr,
                         name=name)


def _abstract_eval(*avals, region, jaxpr, name):
  del name
  outs = region_out_avals(region, jaxpr)
  return _body_types(outs, avals)


def _body_types(outs: list, avals: Sequence[Any]) -> list:
  """``outs`` typed as values of a ``shard_map`` body when the inputs
  ``avals`` are (their mesh has manual axes): on that mesh, varying over
  the axes any input varies over, as jax types its own ops there."""
  like = next((a for a in avals if _manual_mesh(a) is not None), None)
  if like is None:
    return outs
  axes = frozenset().union(*(_varying(a) for a in avals))
  mesh = _manual_mesh(like)
  res = []
  for o in outs:
    o = o.update(sharding=NamedSharding(mesh, PartitionSpec(*([None] * len(o.shape)))))
    res.append(_with_varying(o, axes))
  return res


def _manual_mesh(aval: Any) -> Any:
  """The mesh of ``aval``'s sharding when it has manual axes (a value of a
  ``shard_map`` body), else None."""
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  manual = getattr(AxisType, "Manual", None)
  return mesh if any(t == manual for t in getattr(mesh, "axis_types", ())) else None


jaxfuse_region_p.def_impl(_impl)
jaxfuse_region_p.def_abstract_eval(_abstract_eval)


# --------------------------------------------------------------------------
# Lowering
# --------------------------------------------------------------------------

def _varying(aval: Any) -> frozenset:
  """The mesh axes ``aval`` varies over inside a ``shard_map`` body (jax's
  ``manual_axis_type.varying``; ``vma`` before jax 0.10)."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def _with_varying(aval: Any, axes: frozenset) -> Any:
  """``aval`` varying over exactly ``axes``."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return aval.update(manual_axis_type=mat.update(varying=frozenset(axes)))
  return aval.update(vma=frozenset(axes))


def _vma_free(ctx):
  """``ctx`` with its avals' manual-axis types dropped. Why: inside a
  ``shard_map`` body a region's values vary over the mesh axes, but the
  region's ops and kernel call were traced apart from it, without those
  types, and jax refuses ops that mix the two. The types only check the
  program; what is lowered is the same."""
  if not any(_varying(a) for a in (*ctx.avals_in, *ctx.avals_out)):
    return ctx
  strip = lambda a: _with_varying(a, frozenset()) if _varying(a) else a
  return ctx.replace(avals_in=[strip(a) for a in ctx.avals_in],
                     avals_out=[strip(a) for a in ctx.avals_out])


def _lower_original(ctx, *args, region, jaxpr, name):
  del region, name
  return mlir.lower_fun(functools.partial(_eval_original, jaxpr=jaxpr),
                        multiple_results=True)(_vma_free(ctx), *args)


_warned: set[tuple[str, str]] = set()


def _is_decision(err: BaseException) -> bool:
  try:
    from jaxfuse.runtime.launch import LeftToXLA  # pylint: disable=g-import-not-at-top
  except Exception:  # pylint: disable=broad-except  (no triton: no decision either)
    return False
  return isinstance(err, LeftToXLA)


def _first_time(region: ir.Region, what: str) -> bool:
  """True once per (region, what): a region is lowered again for every
  program that holds it (each layer, each K-call benchmark program), and
  its log line should appear once."""
  key = (region.signature(), what)
  if key in _warned:
    return False
  _warned.add(key)
  return True


def _warn_fallback(region: ir.Region, name: str, what: str,
                   err: BaseException) -> None:
  """One log line per (region, what); repeated lowerings stay quiet."""
  if not _first_time(region, what):
    return
  msg = str(err).splitlines()[0] if str(err) else ""
  if _is_decision(err):
    # A decision (compute-bound, or predicted/measured slower), not a fault.
    logging.info("jaxfuse: region %s (%s) left to XLA: %s", name,
                 region.einsum_summary(), msg[:300])
    return
  logging.warning("jaxfuse: region %s (%s) runs its original ops: %s "
                  "failed: %s: %s", name, region.einsum_summary(), what,
                  type(err).__name__, msg[:300])


# (region signature, original ops) -> (fallback jaxpr, regions in it); see _fallback.
_fallbacks: dict[tuple[str, Any], tuple[ClosedJaxpr, int]] = {}
_MAX_FALLBACKS = 512


def _fallback(region: ir.Region, jaxpr: ClosedJaxpr, name: str) -> tuple[ClosedJaxpr, int]:
  """What runs where the region's kernel is not used: for a chain, its
  original ops captured again with fewer contractions per region, so that a
  part worth fusing still is (an FFN's GEMM-GELU-GEMM is compute-bound, its
  first GEMM with the GELU is worth a kernel); else the original ops. Also
  the region's keep-or-drop timing runs against it: a chain is kept only
  when it beats what would replace it. Returns the jaxpr and how many
  regions it holds (0: XLA's plain ops). Memoized: a region is lowered once
  per program that holds it, and a capture takes milliseconds."""
  if len(region.contractions) < 2:
    return jaxpr, 0
  key = (region.signature(), jaxpr)
  hit = _fallbacks.get(key)
  if hit is not None:
    return hit
  try:
    from jaxfuse import capture  # pylint: disable=g-import-not-at-top
    parts = capture.rewrite(jaxpr, _bind_captured,
                            max_contractions=len(region.contractions) - 1)
    found = (jaxpr, 0) if parts is jaxpr else (parts, count_regions(parts.jaxpr))
  except Exception as e:  # pylint: disable=broad-except
    _warn_fallback(region, name, "re-capture of its parts", e)
    found = (jaxpr, 0)
  if len(_fallbacks) >= _MAX_FALLBACKS:
    _fallbacks.clear()
  _fallbacks[key] = found
  return found


def _lower_fused(ctx, *args, region, jaxpr, name, backend: str):
  """Lowers through the generated kernel, or the fallback (``_fallback``)
  when the kernel is dropped or fails."""
  fallback, parts = _fallback(region, jaxpr, name)
  try:
    # Imported lazily: launch pulls in codegen/triton (and jax_triton on CUDA).
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top

    def fused(*xs):
      outs = launch.fused_call(region, list(xs), backend=backend,
                               original=functools.partial(_eval_original, jaxpr=fallback),
                               original_parts=parts)
      outs = list(outs)
      want = region_out_avals(region, jaxpr)
      if len(outs) != len(want):
        raise ValueError(f"fused_call returned {len(outs)} outputs, "
                         f"expected {len(want)}")
      for o, w in zip(outs, want):
        if tuple(o.shape) != tuple(w.shape) or o.dtype != w.dtype:
          raise ValueError(f"fused_call output {o.shape}/{o.dtype} != "
                           f"{w.shape}/{w.dtype}")
      return outs

    # lower_fun traces ``fused`` to a jaxpr before it emits anything, so a
    # planning/codegen error here leaves the module untouched.
    return mlir.lower_fun(fused, multiple_results=True)(_vma_free(ctx), *args)
  except Exception as e:  # pylint: disable=broad-except
    _warn_fallback(region, name, f"{backend} kernel", e)
    if parts:
      # Left to XLA whole (decided, or no plan worked): its parts are
      # lowered, and decided, like any region.
      return _lower_parts(ctx, *args, region=region, jaxpr=jaxpr, parts=parts,
                          fallback=fallback, name=name)
    return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)


def _lower_parts(ctx, *args, region, jaxpr, parts, fallback, name):
  """A chain left to XLA as a whole: its ``parts`` regions (``fallback``,
  from ``_fallback``), else, where they fail to lower, its original ops."""
  try:
    if _first_time(region, "parts"):
      logging.info("jaxfuse: region %s (%s) lowers as %d part(s) with fewer contractions",
                   name, region.einsum_summary(), parts)
    return _lower_original(ctx, *args, region=region, jaxpr=fallback, name=name)
  except Exception as e:  # pylint: disable=broad-except
    _warn_fallback(region, name, "lowering of its parts", e)
    return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)


def partitioned_over(ctx) -> int:
  """How many devices XLA's SPMD partitioner splits the lowered program
  over (``ctx``: a lowering context); 1 where it runs whole on one device,
  or per device (every mesh axis of a ``shard_map`` body manual, a ``pmap``
  body)."""
  ac = ctx.module_context.axis_context
  n = getattr(ac, "num_devices", None)   # jit over a device assignment
  if n is not None:
    return int(n)
  mesh = getattr(ac, "mesh", None)       # shard_map: its axes not manual
  if mesh is None:
    return 1
  manual = frozenset(getattr(ac, "manual_axes", ()) or ())
  return int(np.prod([size for axis, size in dict(mesh.shape).items() if axis not in manual]))


def _lower_partitioned(ctx, *args, region, name, backend: str):
  """The region's kernel on each device's shards, through a partitioning
  rule (``jaxfuse.runtime.partitioning``), in a program XLA partitions.
  Returns ``(outs, None, None)``, or ``(None, decision, None)`` where the
  model leaves the whole region to XLA (a ``LeftToXLA``), or ``(None, None,
  why)`` where the region cannot take a partitioning rule."""
  if getattr(ctx.module_context.axis_context, "manual_axes", None):
    return None, None, "its shard_map is manual over only some mesh axes"
  if backend != "triton":
    # The interpreter runs through a host callback, which XLA's partitioner
    # callback does not keep alive (the program crashed on 4 CPU devices).
    return None, None, f"it runs in the {backend} backend"
  try:
    from jaxfuse.runtime import launch, partitioning  # pylint: disable=g-import-not-at-top
    spec = partitioning.partition_spec(region)
    if spec is None:
      return None, None, ("no loop of it can be split across devices (each is "
                          "reduced, masked or read through a window)")
    # The whole region's model verdict (compute-bound, predicted slower:
    # XLA); its plans are not run, so no measured tuning of them.
    launch._candidate_plans(region, None, backend=backend, timing=False,  # pylint: disable=protected-access
                            measured=False)
    outs = mlir.lower_fun(
        lambda *xs: partitioning.partitioned_call(spec, xs, backend=backend),
        multiple_results=True)(_vma_free(ctx), *args)
  except Exception as e:  # pylint: disable=broad-except
    if _is_decision(e):
      return None, e, None
    _warn_fallback(region, name, "partitioned lowering", e)
    return None, None, "its partitioned lowering failed"
  if _first_time(region, "partitioned"):
    split = sorted({l for axes in spec.in_axes for l in axes if l is not None})
    logging.info("jaxfuse: region %s (%s) is partitioned with its program: each device "
                 "runs the kernel on its shards (loops that may be split: %s)",
                 name, region.einsum_summary(), ", ".join(split))
  return outs, None, None


def _lower_kernel(ctx, *args, region, jaxpr, name, backend: str):
  """The region's kernel (``_lower_fused``). Where XLA partitions the
  program over several devices, the kernel call carries a partitioning
  rule (``_lower_partitioned``); a region that cannot take one is left to
  XLA: without a rule XLA would gather its operands and run the whole
  region on every device. Inside ``shard_map`` the regions see per-device
  shapes and fuse as on one device."""
  n = partitioned_over(ctx)
  if n > 1:
    outs, decision, why = _lower_partitioned(ctx, *args, region=region, name=name,
                                             backend=backend)
    if outs is not None:
      return outs
    if decision is not None:
      _warn_fallback(region, name, "partitioned kernel", decision)
      fallback, parts = _fallback(region, jaxpr, name)
      if parts:
        return _lower_parts(ctx, *args, region=region, jaxpr=jaxpr, parts=parts,
                            fallback=fallback, name=name)
      return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)
    if _first_time(region, "partitioned"):
      logging.info("jaxfuse: region %s (%s) left to XLA: its program is partitioned "
                   "over %d devices by XLA and %s; fuse it per device inside "
                   "jax.shard_map", name, region.einsum_summary(), n, why)
    return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)
  return _lower_fused(ctx, *args, region=region, jaxpr=jaxpr, name=name, backend=backend)


def _lower_cuda(ctx, *args, region, jaxpr, name):
  if not config.disable and config.backend in ("auto", "triton"):
    return _lower_kernel(ctx, *args, region=region, jaxpr=jaxpr, name=name,
                         backend="triton")
  return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)


def _lower_cpu(ctx, *args, region, jaxpr, name):
  if not config.disable and config.backend == "interpret":
    return _lower_kernel(ctx, *args, region=region, jaxpr=jaxpr, name=name,
                         backend="interpret")
  return _lower_original(ctx, *args, region=region, jaxpr=jaxpr, name=name)


mlir.register_lowering(jaxfuse_region_p, _lower_original)
mlir.register_lowering(jaxfuse_region_p, _lower_cuda, platform="cuda")
mlir.register_lowering(jaxfuse_region_p, _lower_cpu, platform="cpu")


# --------------------------------------------------------------------------
# JVP: primal through the primitive, tangents through the original ops.
# --------------------------------------------------------------------------

def _eval_varying(closed: ClosedJaxpr, axes: frozenset, *args: Any) -> list[Any]:
  """The region's original ops on values of a ``shard_map`` body that vary
  over ``axes``. The ops were traced apart from the body, so they lack the
  casts (``pvary``) that jax inserts where a value varies over fewer axes
  than another operand of an op (a literal, a replicated weight); they are
  inserted here, as jax's own ops do."""
  from jaxfuse.capture_flat import bind_eqn, is_lit  # pylint: disable=g-import-not-at-top

  def vary(x: Any, want: frozenset) -> Any:
    missing = tuple(sorted(want - _varying(_typeof(x))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  env: dict = {}
  read = lambda a: jax.numpy.asarray(a.val, a.aval.dtype) if is_lit(a) else env[a]
  jx = closed.jaxpr
  env.update(zip(jx.constvars, closed.consts))
  env.update(zip(jx.invars, (vary(a, axes) for a in args)))
  for eqn in jx.eqns:
    vals = [read(a) for a in eqn.invars]
    want = frozenset().union(*(_varying(_typeof(v)) for v in vals))
    outs = bind_eqn(eqn, [vary(v, want) for v in vals])
    env.update(zip(eqn.outvars, outs))
  return [read(a) for a in jx.outvars]


def _typeof(x: Any) -> Any:
  typeof = getattr(jax, "typeof", None)
  return typeof(x) if typeof is not None else jax.core.get_aval(x)


def _jvp(primals, tangents, *, region, jaxpr, name):
  primals_out = jaxfuse_region_p.bind(*primals, region=region, jaxpr=jaxpr,
                                      name=name)
  live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
  axes = frozenset().union(*(_varying(_typeof(p)) for p in primals))
  fun = jaxpr_as_fun(jaxpr) if not axes else functools.partial(_eval_varying, jaxpr, axes)

  def restricted(*live_primals):
    full = list(primals)
    for i, p in zip(live, live_primals):
      full[i] = p
    return list(fun(*full))

  # Only the differentiated inputs get tangents: integer/bool inputs (masks)
  # never need float0 zeros this way.
  _, tangents_out = jax.jvp(restricted, [primals[i] for i in live],
                            [tangents[i] for i in live])
  outs = []
  for p, t in zip(primals_out, tangents_out):
    if getattr(t, "dtype", None) == jax.dtypes.float0:
      aval = _typeof(p)
      outs.append(ad.Zero(aval.to_tangent_aval()))
    else:
      outs.append(t)
  return primals_out, outs


ad.primitive_jvps[jaxfuse_region_p] = _jvp


# --------------------------------------------------------------------------
# Batching: re-capture the vmapped original ops so the batch becomes a loop.
# --------------------------------------------------------------------------

_NOT_MAPPED = getattr(batching, "not_mapped", None)


def _unmapped(d: Any) -> bool:
  return d is None or d is _NOT_MAPPED


def _batch(axis_size, args, dims, *, region, jaxpr, name):
  in_axes = tuple(None if _unmapped(d) else d for d in dims)
  fun = jaxpr_as_fun(jaxpr)
  vfun = jax.vmap(lambda *xs: list(fun(*xs)), in_axes=in_axes, out_axes=0,
                  axis_size=axis_size)
  vjaxpr = jax.make_jaxpr(vfun)(*args)
  outs = None
  try:
    from jaxfuse import capture  # pylint: disable=g-import-not-at-top
    found = capture.find_regions(vjaxpr)
    if len(found) == 1 and not found[0].path:
      if _covers_all(found[0], vjaxpr):
        rewritten = capture.rewrite(vjaxpr, _bind_captured)
        if count_regions(rewritten) == 1:
          outs = jaxpr_as_fun(rewritten)(*args)
  except Exception as e:  # pylint: disable=broad-except
    _warn_fallback(region, name, "batching re-capture", e)
    outs = None
  if outs is None:
    outs = jaxpr_as_fun(vjaxpr)(*args)
  return list(outs), [0] * len(outs)


def _covers_all(captured, closed: ClosedJaxpr) -> bool:
  """True when every contraction of ``closed`` belongs to the one region."""
  n_dots = sum(1 for e in closed.jaxpr.eqns if e.primitive.name == "dot_general")
  return n_dots == len(captured.region.contractions)


_warned_inconsistent: set[str] = set()


def _bind_captured(captured, *xs):
  """``bind_region`` callback for capture.rewrite (shared with the api)."""
  why = check_consistent(captured.region, captured.jaxpr)
  if why is not None:
    if why not in _warned_inconsistent:
      _warned_inconsistent.add(why)
      logging.warning("jaxfuse: region left to XLA, capture inconsistent: %s",
                      why)
    return None
  name = captured.region.name
  source = getattr(captured, "source", "") or ""
  if source:  # a label for printed jaxprs and log lines: where the chain is
    name = f"{name}@{os.path.basename(source)}"
  return bind_region(captured.region, captured.jaxpr, *xs, name=name)


def _fancy_batcher(axis_data, args, dims, **params):
  if all(_unmapped(d) for d in dims):
    outs = jaxfuse_region_p.bind(*args, **params)
    return outs, [None] * len(outs)
  return _batch(axis_data.size, args, dims, **params)


if hasattr(batching, "fancy_primitive_batchers"):
  batching.fancy_primitive_batchers[jaxfuse_region_p] = _fancy_batcher
else:  # pragma: no cover - older jax
  def _old_batcher(args, dims, **params):
    size = next(np.shape(a)[d] for a, d in zip(args, dims) if not _unmapped(d))
    return _batch(size, args, dims, **params)
  batching.primitive_batchers[jaxfuse_region_p] = _old_batcher


# --------------------------------------------------------------------------
# Printing and counting
# --------------------------------------------------------------------------

def _pp_rule(eqn, context, settings):
  """Prints the region's name and einsum instead of its whole sub-jaxpr."""
  from jax._src import core as _core  # pylint: disable=g-import-not-at-top
  try:
    region = eqn.params["region"]
    params = {"name": eqn.params["name"], "einsum": region.einsum_summary(),
              "loops": ",".join(f"{l.name}={l.extent}" for l in region.loops)}
    return _core._pp_eqn(eqn.replace(params=params), context, settings)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    # A jax whose printer changed: print the equation the default way.
    return _core._pp_eqn(eqn, context, settings)  # pylint: disable=protected-access


try:
  from jax._src import core as _jcore  # pylint: disable=g-import-not-at-top
  if hasattr(_jcore, "pp_eqn_rules") and hasattr(_jcore, "_pp_eqn"):
    _jcore.pp_eqn_rules[jaxfuse_region_p] = _pp_rule
except Exception:  # pragma: no cover - printing falls back to the default
  pass


def _sub_jaxprs(params: dict) -> list:
  subs = []
  for v in params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if isinstance(x, ClosedJaxpr):
        subs.append(x.jaxpr)
      elif hasattr(x, "eqns") and hasattr(x, "invars"):
        subs.append(x)
  return subs


def count_regions(jaxpr: Any) -> int:
  """Number of ``jaxfuse_region`` equations in a (Closed)Jaxpr, nested too.

  The original ops inside a region are not searched.
  """
  jx = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  n = 0
  for eqn in jx.eqns:
    if eqn.primitive is jaxfuse_region_p:
      n += 1
      continue
    for sub in _sub_jaxprs(eqn.params):
      n += count_regions(sub)
  return n
