"""Kernel forms beyond the Triton printer's, offered where they are faster.

The search (``search.search``) plans the Triton form: tiling expressions,
tiles, warps and stages. Some regions have a hand-structured kernel that
the Triton compiler cannot express; this module puts its plan in front of
the search's ranking where the region is that kernel's and the device runs
it:

* ``gluon_printer.GLUON_ATTENTION``: softmax attention on Hopper, with two
  consumer warpgroups, a TMA loader warp and FlashAttention-3's overlap of
  one block's softmax with the next block's Q.K^T (see
  ``codegen.gluon_printer``). Its time is priced from its own schedule
  (``gluon_attention_time``): each program's tiles, each tile's key
  blocks, each block's two dots against its softmax, with the constants
  fitted on the kernels measured on an H100. It is offered only where it
  was measured to win: its
  persistent programs have at least ``MIN_TILES_PER_SM`` tiles each, and
  each tile at least ``MIN_KEY_BLOCKS`` key blocks; tiles of fewer than
  ``SHORT_ROW_BLOCKS`` key blocks need ``MIN_SHORT_ROW_TILES_PER_SM`` tiles
  per SM, as the first tile's prologue and the last one's epilogue weigh
  more there.
  Under a causal mask or a sliding window (the kernel skips the key blocks
  the band hides) its tiles need ``MIN_MASKED_KEY_BLOCKS`` kept key blocks
  on average: causal tiles are paired so that every program has the same
  work, where the Triton form's last wave runs the longest rows alone.
  A soft cap ``b * tanh(a * s)`` (Gemma 2), with or without a mask, is
  offered as the masked form: capped causal attention measured 0.73-0.75x
  the Triton form's time, a capped 4096-key window 0.87x.

Under measured tuning (``plan_region(..., measure=)`` with a measurer
whose ``kernel_forms`` attribute is true) the price only decides whether
the form is a candidate: ``FormTiming`` times its kernel in the search's
first batch, beside the Triton candidates, and the form goes first only
where it ran faster than the Triton form's measured best.

Example::

    ranked = with_kernel_forms(region, get_device("h100"), ranked)
    ranked[0].form     # 'gluon-ws' for large softmax attention
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

from absl import logging

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec
from jaxfuse.planner.plan import Plan, Prediction

__all__ = ["FormTiming", "GLUON_MMA_EFFICIENCY", "GLUON_OVERLAP",
           "GLUON_TILE_S", "HOPPER", "MIN_KEY_BLOCKS", "MIN_MASKED_KEY_BLOCKS",
           "MIN_SHORT_ROW_TILES_PER_SM", "MIN_TILES_PER_SM", "SHORT_ROW_BLOCKS",
           "gluon_attention_plan", "gluon_attention_time", "with_kernel_forms"]

# Head dimensions the form is offered at without a mask.
UNMASKED_HEAD_DIMS = (64, 128, 256)
# Key blocks (of 128) per tile below which the form is not offered (none
# shorter was measured).
MIN_KEY_BLOCKS = {64: 4, 128: 4, 256: 16}
# Below SHORT_ROW_BLOCKS key blocks per tile, the tiles per SM it needs:
# 512 keys at d=64 measured 1.01x the Triton pick with 384 tiles (2.9 per
# SM, BERT-Base at batch 8), 0.88x with 1024; at d=128 0.83x with 512
# tiles (3.9 per SM).
SHORT_ROW_BLOCKS = 8
MIN_SHORT_ROW_TILES_PER_SM = 3.5
# The fewest kept key blocks (of 128) per tile, on average, where the form
# is offered (session 67, queries in registers): d=64 a 256-key window
# (2.9 blocks) 0.90x the Triton pick, causal 512 tokens (2.5) 1.01x; d=128
# causal 512 tokens 0.85x, a 256-key window 0.76x, a 128-key window (1.97)
# 0.95x. d=256 as measured in session 66 (4.5 won).
MIN_MASKED_KEY_BLOCKS = {64: 2.75, 128: 1.9, 256: 4.0}
# Devices with wgmma and TMA (the kernel is compiled for sm_90a).
HOPPER = ("h100", "h200")
# Tiles per SM below which the form is not offered: the fewest measured
# (and won) were 256 tiles on 132 SMs (Gemma 2 2B, causal, session 66;
# 0.73x the Triton form's time).
MIN_TILES_PER_SM = 1.9


# The form's price (``gluon_attention_time``), fitted on the 23 kernels of
# the form measured on an H100 (sixty-seventh to seventy-fourth sessions:
# d=64, 128 and 256; 512-8192 keys; causal, sliding windows, soft caps;
# benchmarks/RESULTS.md, seventy-fifth session): predicted over measured
# 0.91-1.10, log-rms 0.051. The price it replaces, the Triton form's
# times a measured ratio, read 0.90-1.84x the measured time, 1.11-1.84x
# without a mask (the Triton form's own price is pessimistic there).
# The tensor cores' rate on each block's two dots, of the device's peak.
GLUON_MMA_EFFICIENCY = 0.94
# The fraction of the shorter of a block's dots and its softmax that runs
# under the longer: each of the two consumer warpgroups does one while the
# other does the other, but not in perfect alternation.
GLUON_OVERLAP = 0.48
# Each tile's own time (its queries' load, its output's store, the
# pipeline filling for its first block).
GLUON_TILE_S = 2.0e-6
# Work per score (vector ops, SFU results): the scale and the row maximum
# in one FMA, exp2, the maximum, the sum and the cast to 16 bits; a soft
# cap (one exp2 and one fast division); the mask, in key blocks the band
# cuts (vector ops).
GLUON_SOFTMAX_OPS = (4, 1)
GLUON_CAP_OPS = (4, 2)
GLUON_MASK_OPS = 5


def gluon_attention_time(form, dev: DeviceSpec) -> Prediction:
  """The model's price of the Gluon attention kernel for ``form``
  (``gluon_printer.attention_form``) on ``dev``: the printed schedule's
  longest program (its tiles round-robin, or causal tiles in pairs of
  equal work), each tile ``GLUON_TILE_S`` (and a training forward's
  epilogue) plus its kept key blocks, each
  block its two dots overlapped with its softmax.

  Example::

      pred = gluon_attention_time(gluon_printer.attention_form(region), dev)
      pred.time_s
  """
  from jaxfuse.codegen import gluon_printer  # pylint: disable=g-import-not-at-top
  _, _, d_ext, e_ext = form.extents
  bm = gluon_printer.BLOCK_M
  bn, stages = gluon_printer.tile_sizes(form)
  sms = dev.sm_count
  peak = dev.peak(form.dtype) / sms * GLUON_MMA_EFFICIENCY
  vector = dev.vector_flops / sms
  sfu = dev.sfu_ops / sms
  t_dots = 2 * bm * bn * (d_ext + e_ext) / peak
  ops, sfu_ops = GLUON_SOFTMAX_OPS
  if form.cap is not None:
    ops, sfu_ops = ops + GLUON_CAP_OPS[0], sfu_ops + GLUON_CAP_OPS[1]

  def softmax(extra_ops: int) -> float:
    return bm * bn * ((ops + extra_ops) / vector + sfu_ops / sfu)

  def block(extra_ops: int) -> float:
    t_soft = softmax(extra_ops)
    return max(t_dots, t_soft) + (1.0 - GLUON_OVERLAP) * min(t_dots, t_soft)

  t_block, t_cut = block(0), block(GLUON_MASK_OPS)
  # A training forward's tile also loads its dout tile and writes its row
  # statistics (gluon_printer._row_code), at the SM's share of the memory
  # bandwidth: its epilogue has no key block's work to hide under.
  item = 2
  row_bytes = bm * 4 * len(form.rows_out) + (bm * e_ext * item if form.dout is not None else 0)
  t_tile = GLUON_TILE_S + row_bytes / (dev.mem_bandwidth_Bps / sms)
  band = form.band
  per_tile, blocks, cuts = [], 0, 0.0
  for (lo, hi), cut in zip(gluon_printer.key_blocks(form, bn), gluon_printer.masked_blocks(form, bn)):
    per_tile.append((hi - lo - cut) * t_block + cut * t_cut + t_tile)
    blocks += hi - lo
    cuts += cut
  heads = math.prod(x for _, x in form.batch)
  causal = band is not None and band.upper is not None and band.lower is None
  if causal and gluon_printer.CAUSAL_TILE_ORDER == "pairs" and len(per_tile) % 2 == 0:
    half = len(per_tile) // 2
    units = [per_tile[i] + per_tile[-1 - i] for i in range(half)] * heads
  else:
    units = per_tile * heads
  programs = max(1, min(sms, len(per_tile) * heads))
  # Round-robin: program p runs units p, p + programs, ...
  t_program = max(sum(units[p::programs]) for p in range(min(programs, len(units))))
  flops = 2 * bm * bn * (d_ext + e_ext) * blocks * heads
  moved = heads * (len(per_tile) * (bm * (d_ext + e_ext) * item + row_bytes)
                   + blocks * bn * (d_ext + e_ext) * item)
  # Tensor-core and vector work of the whole grid spread over the SMs.
  t_dot = t_dots * blocks * heads / sms
  t_vec = (softmax(0) * (blocks - cuts) + softmax(GLUON_MASK_OPS) * cuts) * heads / sms
  t_mem = moved / dev.mem_bandwidth_Bps
  return Prediction(time_s=t_program, t_mem_s=t_mem, t_comp_s=t_dot + t_vec,
                    alpha=t_program / (t_mem + t_dot + t_vec), bytes_moved=int(moved),
                    flops=int(flops), smem_bytes=gluon_printer.smem_bytes(form, bn, stages),
                    programs=programs, t_program_s=t_program, steps=len(units[::programs]),
                    t_dot_s=t_dot, t_vector_s=t_vec, t_traffic_s=t_mem,
                    waves=1)


def gluon_attention_plan(region: ir.Region, dev: DeviceSpec, base: Plan):
  """The Gluon attention plan of ``region``, priced from ``base`` (the
  Triton form's best plan), or a string saying why there is none."""
  from jaxfuse.codegen import gluon_printer  # pylint: disable=g-import-not-at-top
  if dev.name not in HOPPER:
    return f"device {dev.name} is not a Hopper GPU"
  form = gluon_printer.attention_form(region)
  if isinstance(form, str):
    return form
  m_ext, _, d_ext, _ = form.extents
  tiles = (m_ext // gluon_printer.BLOCK_M) * math.prod(x for _, x in form.batch)
  if tiles < MIN_TILES_PER_SM * dev.sm_count:
    return f"{tiles} tiles: fewer than {MIN_TILES_PER_SM} per SM"
  if base.predicted is None:
    return "the Triton form's plan has no prediction"
  bn, stages = gluon_printer.tile_sizes(form)
  if form.band is None and form.cap is None:
    if d_ext not in UNMASKED_HEAD_DIMS:
      return f"head dimension {d_ext} without a mask, where the form was measured no faster"
    blocks = form.extents[1] // 128
    if blocks < MIN_KEY_BLOCKS[d_ext]:
      return (f"{form.extents[1]} keys: fewer than {MIN_KEY_BLOCKS[d_ext] * 128} at d={d_ext}, "
              "where the form was measured slower")
    if blocks < SHORT_ROW_BLOCKS and tiles < MIN_SHORT_ROW_TILES_PER_SM * dev.sm_count:
      return (f"{tiles} tiles of {form.extents[1]} keys: fewer than "
              f"{MIN_SHORT_ROW_TILES_PER_SM} per SM, where the form was measured no faster")
  else:
    spans = gluon_printer.key_blocks(form, 128)
    kept = sum(hi - lo for lo, hi in spans) / len(spans)
    if kept < MIN_MASKED_KEY_BLOCKS[d_ext]:
      return (f"{kept:.2f} key blocks per query tile kept by the mask: fewer than "
              f"{MIN_MASKED_KEY_BLOCKS[d_ext]} at d={d_ext}, where the form was not measured to win")
  sizes = {form.m: gluon_printer.BLOCK_M, form.n: bn, form.d: d_ext, form.e: form.extents[3]}
  plan_tiles = tuple((l.name, sizes.get(l.name, 1)) for l in region.loops)
  pred = gluon_attention_time(form, dev)
  return dataclasses.replace(base, tiles=plan_tiles, num_warps=8, num_stages=stages, split=None,
                             form=gluon_printer.GLUON_ATTENTION, predicted=pred)


class FormTiming:
  """The tuner's ``measure(plans) -> seconds`` with the kernel form's plan
  timed too: the first batch the search measures (the model's best plan
  first) gets the form plan priced from that plan put in front, so its
  kernel compiles first, beside the Triton candidates', within the tuning
  budget (appended last, it was still compiling at the deadline in 4 of 5
  large attention regions, H100, session 67). The search sees only its
  own plans' times.

  After the search, ``times`` holds every Triton plan's measured seconds by
  ``str(plan)`` (None: not measured, ``inf``: failed), ``form_time`` the
  form plan's (None: not measured or not a candidate, then ``form_why``
  says why not a candidate).

  Example::

      timing = FormTiming(region, dev, measure)
      res = search.search(region, dev, measure=timing)
      ranked = with_kernel_forms(region, dev, res.ranked, timing=timing)
  """

  def __init__(self, region: ir.Region, dev: DeviceSpec,
               measure: Callable[[Sequence[Plan]], Sequence[Optional[float]]]):
    self._region, self._dev, self._measure = region, dev, measure
    self.times: dict[str, Optional[float]] = {}
    self.form_time: Optional[float] = None
    self.form_why: Optional[str] = None
    self._asked = False
    begin = getattr(measure, "begin", None)
    if callable(begin):
      self.begin = begin   # plan_region starts the measurer's budget with it

  def __call__(self, plans: Sequence[Plan]) -> list[Optional[float]]:
    plans = list(plans)
    extra: list[Plan] = []
    if not self._asked and plans:
      self._asked = True
      form = gluon_attention_plan(self._region, self._dev, plans[0])
      if isinstance(form, str):
        self.form_why = form
      else:
        extra = [form]
    times = list(self._measure(extra + plans))
    if len(times) != len(plans) + len(extra):
      raise ValueError(f"measure returned {len(times)} times for {len(plans) + len(extra)} plans")
    if extra:
      self.form_time = times[0]
      if self.form_time is None:
        logging.info("jaxfuse planner: kernel form %s not measured within the tuning budget; "
                     "its price decides", extra[0].form)
    times = times[len(extra):]
    for p, t in zip(plans, times):
      self.times[str(p)] = t
    return times

  def triton_time(self, best: Plan) -> Optional[float]:
    """The Triton form's measured seconds to beat: ``best``'s (the
    search's first plan), else the fastest measured, else None."""
    t = self.times.get(str(best))
    if t is not None and math.isfinite(t):
      return t
    done = [t for t in self.times.values() if t is not None and math.isfinite(t)]
    return min(done) if done else None


def with_kernel_forms(region: ir.Region, dev: DeviceSpec, ranked: Sequence[Plan],
                      timing: Optional[FormTiming] = None) -> tuple:
  """``ranked`` with the plans of other kernel forms put in front where
  they fit and are priced faster than its first plan, or, with ``timing``
  (measured tuning), where they ran faster than the Triton form's
  measured best; the price decides only where either was not measured
  (the tuning budget ran out)."""
  ranked = tuple(ranked)
  if not ranked or ranked[0].form:
    return ranked
  plan = gluon_attention_plan(region, dev, ranked[0])
  if isinstance(plan, str):
    return ranked
  if timing is not None and timing.form_time is not None:
    t_form, t_base = timing.form_time, timing.triton_time(ranked[0])
    if not math.isfinite(t_form):
      logging.info("jaxfuse planner: kernel form %s failed to run or check under measured "
                   "tuning; the Triton form stays", plan.form)
      return ranked
    if t_base is not None:
      won = t_form < t_base
      logging.info("jaxfuse planner: kernel form %s measured %.1f us against the Triton form's "
                   "%.1f us: %s", plan.form, t_form * 1e6, t_base * 1e6,
                   "put first" if won else "the Triton form stays")
      return (plan,) + ranked if won else ranked
  if plan.predicted.time_s >= ranked[0].predicted.time_s:
    return ranked
  return (plan,) + ranked
