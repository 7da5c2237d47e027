"""A fused region in a program that XLA partitions over several devices.

A custom call has no partitioning rule of its own: XLA would gather its
operands and run the whole region on every device (on two H200s, a d128
attention took 443 us that way against XLA's 176; benchmarks/RESULTS.md,
forty-ninth session). Here the region call carries one, through
``jax.experimental.custom_partitioning``:

* the sharding rule names each operand axis by the region loop it indexes.
  A loop may be split across devices when no op reduces it, no iota (a
  mask) reads it, and every output indexes it: batch, heads, query rows.
  Every other axis must stay whole (a need-replication factor), so XLA
  gathers it first when it arrives split;
* the partition callback builds the region at the per-device extents
  (``local_region``), plans it and runs its kernel on each device's shards.
  If that fails, each device evaluates the IR with ``jax.numpy``
  (``reference.evaluate``), each value rounded to its dtype as XLA rounds
  it: the region's jaxpr is fixed at the global shapes.

Only regions whose operands are whole arrays qualify (no windows, no part
buffers, no launch offsets); the others stay with XLA, as before.

Example (what ``primitive._lower_kernel`` lowers in a partitioned program)::

    spec = partition_spec(region)
    if spec is not None:
      outs = partitioned_call(spec, args, backend="triton")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

from absl import logging

from jaxfuse import ir

__all__ = ["PartitionSpec", "partition_spec", "local_region", "partitioned_call"]


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
  """How a region's call may be split: ``in_axes``/``out_axes`` give, per
  operand, the loop each array axis indexes where that loop may be split
  (None where the axis must stay whole)."""
  region: ir.Region
  in_axes: tuple[tuple[Optional[str], ...], ...]
  out_axes: tuple[tuple[Optional[str], ...], ...]

  def rule(self) -> tuple[str, tuple[str, ...]]:
    """The Shardy rule string and its need-replication factors."""
    whole: list[str] = []

    loops = set(self.region.loop_extents)

    def names(i: int, axes) -> str:
      out = []
      for a, l in enumerate(axes):
        if l is None:
          l = f"x{i}_{a}"
          while l in loops:
            l += "_"
          whole.append(l)
        out.append(l)
      return " ".join(out)

    ins = [names(i, a) for i, a in enumerate(self.in_axes)]
    outs = [names(len(ins) + i, a) for i, a in enumerate(self.out_axes)]
    return f"{', '.join(ins)} -> {', '.join(outs)}", tuple(whole)


def _axis_of(buf: ir.Buffer, stride: int) -> int:
  """The array axis of ``buf`` (row-major, contiguous) that ``stride`` falls in."""
  cs = ir.contiguous_strides(buf.shape)
  for a, c in enumerate(cs):
    if stride >= c and (a == 0 or stride < cs[a - 1]):
      return a
  raise ValueError(f"stride {stride} outside buffer {buf.value}")


def _axis_loops(buf: ir.Buffer, ext: dict) -> Optional[list[Optional[str]]]:
  """Per array axis, the one loop it indexes (None: several, or none);
  None when the buffer is not a whole array laid out by its loops."""
  if buf.window or buf.part_loop or buf.offset:
    return None
  cs = ir.contiguous_strides(buf.shape)
  per_axis: list[list[str]] = [[] for _ in buf.shape]
  for l, s in buf.strides:
    if ext[l] == 1:
      continue
    if s <= 0:
      return None
    a = _axis_of(buf, s)
    per_axis[a].append(l)
  # Every axis longer than 1 is exactly its loops' extents.
  for a, n in enumerate(buf.shape):
    if math.prod(ext[l] for l in per_axis[a]) != n:
      return None
  return [ls[0] if len(ls) == 1 and buf.stride(ls[0]) == cs[a] else None
          for a, ls in enumerate(per_axis)]


def partition_spec(region: ir.Region) -> Optional[PartitionSpec]:
  """The region's ``PartitionSpec``, or None where no loop may be split (or
  an operand is a window or part buffer)."""
  ext = region.loop_extents
  ins = [_axis_loops(b, ext) for b in region.inputs]
  outs = [_axis_loops(b, ext) for b in region.outputs]
  if any(a is None for a in ins + outs) or region.launch_offsets():
    return None
  blocked = set(region.reduced_loops())
  blocked |= {op.loop for op in region.ops if isinstance(op, ir.Iota)}
  free = set(ext) - blocked
  for axes, b in zip(outs, region.outputs):
    free &= {l for l in axes if l is not None}
  for axes, b in zip(ins, region.inputs):
    # A loop the buffer reads must be one of its axes to be split.
    free -= {l for l in b.loops if ext[l] > 1 and l not in axes}
  if not free:
    return None
  keep = lambda axes: tuple(l if l in free else None for l in axes)
  return PartitionSpec(region, tuple(keep(a) for a in ins), tuple(keep(a) for a in outs))


def local_region(region: ir.Region, extents: dict[str, int]) -> ir.Region:
  """``region`` with the loops in ``extents`` shortened to those extents
  (a device's shard); every buffer keeps its layout."""
  ext = region.loop_extents
  loops = tuple(ir.Loop(l.name, extents.get(l.name, l.extent)) for l in region.loops)

  def buf(b: ir.Buffer) -> ir.Buffer:
    cs = ir.contiguous_strides(b.shape)
    axis = {l: _axis_of(b, s) for l, s in b.strides if ext[l] > 1}
    shape = list(b.shape)
    for l, a in axis.items():
      if l in extents:
        shape[a] = shape[a] // ext[l] * extents[l]
    new_cs = ir.contiguous_strides(shape)
    strides = tuple((l, s // cs[axis[l]] * new_cs[axis[l]] if l in axis else s)
                    for l, s in b.strides)
    return dataclasses.replace(b, shape=tuple(shape), strides=strides)

  return ir.Region(loops, region.values, tuple(buf(b) for b in region.inputs),
                   tuple(buf(b) for b in region.outputs), region.ops, region.name)


def _spec_entries(sharding, ndim: int) -> list:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return list(spec) + [None] * (ndim - len(spec))


def _size(mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  shape = dict(mesh.shape)
  return math.prod(shape[n] for n in names)


def _run_local(region: ir.Region, xs: Sequence[Any], backend: str) -> list[Any]:
  """The kernel of ``region`` (a device's shard) on ``xs``; its IR through
  jax.numpy where no kernel works."""
  from jaxfuse.runtime import launch, reference  # pylint: disable=g-import-not-at-top
  try:
    # The whole region was judged worth fusing; its shard runs fused too.
    return launch.fused_call(region, list(xs), backend=backend,
                             plan=launch.ranked_plans(region)[:8])
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse: region %s (%s) per device: %s: %s; its ops run through "
                    "jax.numpy", region.name, region.einsum_summary(), type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "")
    return list(reference.evaluate(region, list(xs)))


def partitioned_call(spec: PartitionSpec, args: Sequence[Any], *, backend: str) -> list[Any]:
  """The region's call on ``args`` with its partitioning rule (traceable;
  used inside a lowering of a program XLA partitions)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.custom_partitioning import custom_partitioning  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import reference  # pylint: disable=g-import-not-at-top
  region = spec.region
  ext = region.loop_extents
  n_out = len(region.outputs)

  @custom_partitioning
  def call(*xs):
    # Not partitioned after all (one device): the IR, as a device would run it.
    outs = reference.evaluate(region, list(xs))
    return tuple(outs) if n_out > 1 else outs[0]

  def split_loops(mesh, arg_shapes) -> dict[str, Any]:
    loops: dict[str, Any] = {}
    for axes, a in zip(spec.in_axes, arg_shapes):
      for l, entry in zip(axes, _spec_entries(a.sharding, len(axes))):
        if l is not None and entry is not None:
          if loops.setdefault(l, entry) != entry:
            raise ValueError(f"loop {l} split two ways: {loops[l]} and {entry}")
    return loops

  def out_shardings(mesh, loops):
    sh = [NamedSharding(mesh, P(*[loops.get(l) if l is not None else None for l in axes]))
          for axes in spec.out_axes]
    return tuple(sh) if n_out > 1 else sh[0]

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    try:
      loops = split_loops(mesh, arg_shapes)
      extents = {}
      for l, entry in loops.items():
        n = _size(mesh, entry)
        if ext[l] % n:
          raise ValueError(f"loop {l} of extent {ext[l]} does not split {n} ways")
        extents[l] = ext[l] // n
      local = local_region(region, extents)
    except Exception as e:  # pylint: disable=broad-except
      # This runs inside XLA's compile: an error here would end the user's
      # program. Every device runs the whole region on gathered operands.
      logging.warning("jaxfuse: region %s (%s) runs whole on every device: %s: %s",
                      region.name, region.einsum_summary(), type(e).__name__, e)
      loops, local = {}, region

    def lower_fn(*xs):
      outs = _run_local(local, xs, backend)
      return tuple(outs) if n_out > 1 else outs[0]

    arg_shardings = tuple(NamedSharding(mesh, P(*[loops.get(l) if l is not None else None
                                                  for l in axes]))
                          for axes in spec.in_axes)
    return mesh, lower_fn, out_shardings(mesh, loops), arg_shardings

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    try:
      return out_shardings(mesh, split_loops(mesh, arg_shapes))
    except ValueError:
      return out_shardings(mesh, {})

  rule, whole = spec.rule()
  call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule, need_replication_factors=whole)
  out = call(*args)
  return list(out) if n_out > 1 else [out]
