"""On-disk plan cache (DESIGN conventions).

One JSON file per key under ``<cache_dir>/plans/``; the key hashes the
region's canonical signature (names-independent; includes shapes, dtypes,
strides), the device (name and SM count), the jaxfuse version and this
file's format version. Writes are atomic (temporary file + ``os.replace``);
a corrupt, unreadable or stale entry is logged once and ignored, never
raised. ``store_entry``/``load_entry`` keep other JSON values beside the
plans (``<cache_dir>/<kind>/``: the runtime's keep-or-drop timings, passed
GPU self-checks and compiled kernel calls), under keys their callers hash.

Example::

    key = plan_key(region, device)
    store(key, region, ranked_plans)
    entry = load(key, region)      # None on a miss
    entry.plans[0]                 # the best plan
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import NamedTuple, Optional, Sequence

from absl import logging

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec
from jaxfuse.planner import tiling
from jaxfuse.planner.plan import Plan, Prediction

__all__ = ["Entry", "plan_key", "load", "store", "cache_path", "load_entry", "store_entry",
           "FORMAT_VERSION"]

# 2: the per-program cost model (plans cached by 1 were ranked by alpha);
# 3: its L2 and co-residency terms; 4: the nested-loop refill term;
# 5: the 192-register budget of 128-row tiles; 6: the overlap terms;
# 7: predictions carry the pipelined shared-memory request; 8: split
# reductions on by default (the key also carries ``config.allow_split``);
# 9: padded tiles up to a quarter (Rule 3), split moves in the descent;
# 10: tile 1 for every loop of extent 1; 11: a deferred softmax denominator
# precedes every reader of its accumulator, and Rule 5 drops dots Triton
# miscompiles (fewer plans, all printable); 12: loop-invariant TF32
# operand tiles count against the register budget; 13: the TF32 transpose
# term on wgmma dots only, and Rule 5 drops TF32 dots of a computed tile
# over a 256-wide reduction (they spill registers); 14: single tiles of
# K-only loops priced as the power-of-two pieces the printer emits; 15: the
# key tiles a causal mask hides priced as skipped (grids of 4+ waves); 16:
# the kernels of masks with finite fills or written through not/selects/adds
# changed (exp2 fold, whole tiles unmasked), so their stored keep-or-drop
# timings are stale; 17: sliding windows (iota compares with offsets) skip
# the key tiles outside them and are priced so, at few waves too; 18:
# elementwise ops priced at the instructions their spellings compile to
# (cost_model.ELEMENTWISE_COST); 19: a smaller register budget where key
# tiles are masked (cost_model.MASKED_ACC_REGS_PER_THREAD); 20: looped loads
# partly hidden under one warpgroup's dots, hoisted loads priced apart
# (cost_model.LOOP_LOAD_OVERLAP, HOISTED_LOAD_EXTRA); 21: mma.sync warps
# that repeat each other's rows priced (cost_model.mma_sync_warps), the
# narrow-row dot rate refitted, descent from other structures' leaders;
# 22: a GEMM's epilogue temporaries count against the register budget
# (cost_model.epilogue_live_tiles); 23: XLA's GEMMs priced as fitted on the H100
# (cost_model._library_gemm_time, ir.xla_merged_dots), keep-or-drop bounds refitted;
# 24: one-row plans priced as unpipelined streams (cost_model.is_unpipelined),
# those that would sum a product every step dropped (pruning.deferred_sums),
# narrow rows of weights over the L2 priced (cost_model.NARROW_RUN_FACTOR);
# 25: a region with no legal plan over Rule 3's tiles is searched again over
# padded ones (search.search), so a cached "no plan" may now have one; a
# float32 contraction's 16-bit computed operand is rounded (the printer's
# float32_operand) and the self-check's tolerance counts intermediates and
# exponentials of large rounded arguments (launch.tolerance); 26-27: the
# register budget does not go below the narrowest whole-row plan
# (cost_model.unsplit_floor_regs, padded head dimensions from 27), and the
# search seeds that plan: head dimensions of 160-256 no longer split;
# 28: plans carry their kernel form (Plan.form): softmax attention on Hopper
# may rank the warp-specialized Gluon kernel (planner.kernel_forms) first;
# 29: measured tuning times that kernel too (kernel_forms.FormTiming); 30:
# entries keep the model's best plan of each other structure (``Entry.alternatives``);
# 31: the Gluon attention form priced from its own schedule
# (``kernel_forms.gluon_attention_time``); 32: XLA's softmax priced as the
# one row kernel it runs (cached verdicts compare against that price); 33: an
# epilogue on attention's result no longer makes every plan illegal (cached
# "no legal plan" verdicts would keep such regions on XLA); 34: the model's
# pick may run at 2 pipeline stages where a third costs a program per SM
# (search.fewer_stages); 35: a row dot's vector result is not counted as an
# accumulator tile, and masked tiles over 4 warps' budget take 8 warps
# (cost_model.accumulator_bytes, choose_warps); 36: the Gluon attention form
# takes a training forward (row statistics, the row dot; a cast between the
# mask and the max); 37: a mask is read through a cast from bfloat16
# (streaming.masked_value), so such regions skip masked tiles; 38: a
# backward's exp of a score under a finite fill is zero outside the mask
# (streaming.zero_outside), so dpa's dv skips masked tiles, and capture drops
# size-1 loops (ir.drop_unit_loops).
FORMAT_VERSION = 38


def _version() -> str:
  try:
    import jaxfuse  # pylint: disable=import-outside-toplevel
    return str(getattr(jaxfuse, "__version__", "0"))
  except Exception:  # pylint: disable=broad-except
    return "0"


def _cache_dir() -> str:
  from jaxfuse.config import config  # pylint: disable=import-outside-toplevel
  return os.environ.get("JAXFUSE_CACHE_DIR") or config.cache_dir


def plan_key(region: ir.Region, device: DeviceSpec, measured: bool = False) -> str:
  """``measured``: the key of the measured search's ranking, kept apart from
  the model's: served to a model-only planning, a measured ranking put the
  tuned plan first, whose model prediction the keep-or-drop bound then
  judged, and left to XLA under tune='model' regions that run faster fused
  (BERT-Base b1's QKV projections on a cache a tuned run had filled, H100,
  session 32)."""
  from jaxfuse.config import config  # pylint: disable=import-outside-toplevel
  # The planner's options change its space, so they key the cache too.
  parts = [region.signature(), device.name, str(device.sm_count),
           str(device.smem_per_block_bytes), _version(), str(FORMAT_VERSION),
           f"split={bool(config.allow_split)}"]
  if measured:
    # Whether the other kernel forms were measured (config.kernel_forms)
    # decides whether a measured ranking may hold them.
    parts += ["measured", f"forms={bool(config.kernel_forms)}"]
  return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def cache_path(key: str, cache_dir: Optional[str] = None) -> str:
  return os.path.join(cache_dir or _cache_dir(), "plans", f"{key}.json")


def _plan_to_json(p: Plan) -> dict:
  return {
      "expr": str(p.expr), "grid": list(p.grid), "tiles": [list(t) for t in p.tiles],
      "skeleton": p.skeleton, "num_warps": p.num_warps, "num_stages": p.num_stages,
      "split": list(p.split) if p.split else None, "form": p.form,
      "predicted": None if p.predicted is None else {
          f: getattr(p.predicted, f) for f in Prediction.__dataclass_fields__},
  }


def _plan_from_json(d: dict, region: ir.Region) -> Plan:
  loops = [l.name for l in region.loops]
  expr = tiling.parse(d["expr"], loops) if d["expr"] != "()" else tiling.TilingExpr(())
  tiles = tuple((str(l), int(t)) for l, t in d["tiles"])
  if sorted(l for l, _ in tiles) != sorted(loops):
    raise ValueError("tiles do not match the region's loops")
  pred = Prediction(**d["predicted"]) if d.get("predicted") else None
  return Plan(expr=expr, grid=tuple(d["grid"]), tiles=tiles, skeleton=d.get("skeleton", ""),
              num_warps=int(d["num_warps"]), num_stages=int(d["num_stages"]),
              split=tuple(d["split"]) if d.get("split") else None, predicted=pred,
              form=str(d.get("form") or ""))


def _read_current(path: str, what: str) -> Optional[dict]:
  """The JSON object at ``path``; None when there is none or it was written
  by another format or jaxfuse version (logged). Raises when it is corrupt."""
  if not os.path.exists(path):
    return None
  with open(path, "r", encoding="utf-8") as f:
    data = json.load(f)
  if data.get("format") != FORMAT_VERSION or data.get("version") != _version():
    logging.info("jaxfuse planner: stale %s %s ignored", what, path)
    return None
  return data


class Entry(NamedTuple):
  """A plan cache entry: the ranked ``plans``, the caller's ``extra`` JSON
  and the ``alternatives`` (``PlanningResult.alternatives``)."""
  plans: list[Plan]
  extra: dict
  alternatives: list[Plan]


def load(key: str, region: ir.Region, cache_dir: Optional[str] = None) -> Optional[Entry]:
  """The ``Entry`` stored under ``key`` or None (miss, corrupt, stale).

  Plans are stored with the region's own loop/value names; the key matches
  regions equal up to names, so an entry written under other names is
  treated as a miss.
  """
  path = cache_path(key, cache_dir)
  try:
    data = _read_current(path, "plan cache entry")
    if data is None or data.get("region_text") != region.to_text(with_header=True):
      return None
    plans = [_plan_from_json(p, region) for p in data["plans"]]
    alternatives = [_plan_from_json(p, region) for p in data.get("alternatives") or ()]
    return Entry(plans, dict(data.get("extra") or {}), alternatives)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: corrupt plan cache entry %s ignored (%s)", path, e)
    return None


def store(key: str, region: ir.Region, plans: Sequence[Plan], extra: Optional[dict] = None,
          cache_dir: Optional[str] = None, alternatives: Sequence[Plan] = ()) -> bool:
  """Writes atomically; returns False (with a log line) when it cannot."""
  data = {"format": FORMAT_VERSION, "version": _version(),
          "region_text": region.to_text(with_header=True),
          "plans": [_plan_to_json(p) for p in plans], "extra": extra or {},
          "alternatives": [_plan_to_json(p) for p in alternatives]}
  return _write_json(cache_path(key, cache_dir), data)


def _write_json(path: str, data: dict) -> bool:
  """``data`` to ``path`` atomically (temporary file + ``os.replace``);
  False with a log line when it cannot."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
      os.replace(tmp, path)
    except BaseException:
      try:
        os.unlink(tmp)
      except OSError:
        pass
      raise
    return True
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: cannot write cache entry %s (%s)", path, e)
    return False


def _entry_path(kind: str, key: str, cache_dir: Optional[str] = None) -> str:
  if not kind.isidentifier():
    raise ValueError(f"kind must be an identifier, got {kind!r}")
  return os.path.join(cache_dir or _cache_dir(), kind, f"{key}.json")


def store_entry(kind: str, key: str, value: dict, cache_dir: Optional[str] = None) -> bool:
  """Stores a JSON-able ``value`` under ``<cache_dir>/<kind>/<key>.json``
  (atomically; False with a log line when it cannot). The caller's ``key``
  must hash everything the value depends on.

  Example::

      store_entry("timings", key, {"fused": [5e-6, 0.01]})
      load_entry("timings", key)      # {"fused": [5e-6, 0.01]}
  """
  return _write_json(_entry_path(kind, key, cache_dir),
                     {"format": FORMAT_VERSION, "version": _version(), "value": value})


def load_entry(kind: str, key: str, cache_dir: Optional[str] = None) -> Optional[dict]:
  """The value ``store_entry`` stored under ``key``, or None (a miss; a
  corrupt or stale entry is logged and ignored)."""
  path = _entry_path(kind, key, cache_dir)
  try:
    data = _read_current(path, "cache entry")
    if data is None:
      return None
    value = data["value"]
    if not isinstance(value, dict):
      raise ValueError("value is not an object")
    return value
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: corrupt cache entry %s ignored (%s)", path, e)
    return None
