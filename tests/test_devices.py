"""Device table, overrides, ridge point and MBCI classification."""

from __future__ import annotations

import dataclasses

import pytest

from jaxfuse import devices, ir
from jaxfuse.codegen import testing as T
from jaxfuse.planner import cost_model, examples, plan_region


def test_table_and_overrides():
  for name in ("h100", "h200", "a100", "rtx3080"):
    d = devices.get_device(name)
    assert d.sm_count > 0 and d.smem_per_block_bytes > 0 and d.mem_bandwidth_Bps > 0
    assert d.peak("float16") > d.peak("float32")
  assert devices.get_device("h100").sm_count == 132
  assert devices.get_device("a100").sm_count == 108
  assert devices.get_device("h100", sm_count=66).sm_count == 66
  assert devices.get_device("H100").name == "h100"
  assert devices.get_device(None).name in devices.known_devices() or devices.get_device(None).live
  with pytest.raises(ValueError, match="unknown device"):
    devices.get_device("tpu")
  with pytest.raises(ValueError, match="field"):
    devices.get_device("h100", sms=1)
  devices.register_device(devices.get_device("h100").replace(name="h100-half", sm_count=66))
  assert devices.get_device("h100-half").sm_count == 66


def test_ridge_and_mbci():
  h100 = devices.get_device("h100")
  assert devices.ridge_point(h100, "float16") == pytest.approx(790e12 / 3.0e12)
  g1 = examples.gemm_chain(1, 512, 256, 64, 64)      # MCFuser G1: phi ~ 171
  ok, phi, ridge = devices.is_mbci(g1, h100)
  assert ok and phi < ridge
  big = examples.gemm_chain(1, 8192, 8192, 8192, 8192)
  assert not devices.is_mbci(big, h100)[0]


def test_float32_precision_sets_the_dot_rate_the_model_uses():
  h100 = devices.get_device("h100")
  assert h100.dot_peak("float32") == h100.peak("float32")          # TF32 tensor cores
  assert h100.dot_peak("float32", "tf32x3") == pytest.approx(h100.peak("float32") / 3)
  assert h100.dot_peak("float32", "ieee") == h100.vector_flops     # fp32 FMAs
  assert h100.dot_peak("float16", "ieee") == h100.peak("float16")  # exact products anyway
  g = examples.gemm_chain(1, 512, 256, 64, 64, dtype="float32")
  fast, exact = g, T.with_precision(g, "ieee")
  assert devices.region_peak(fast, h100) == pytest.approx(h100.peak("float32"))
  assert devices.region_peak(exact, h100) == pytest.approx(h100.vector_flops)
  # One exact contraction of two: the FLOP-weighted rate lies between.
  ops = (dataclasses.replace(g.ops[0], precision="ieee"), g.ops[1])
  mixed = ir.Region(g.loops, g.values, g.inputs, g.outputs, ops)
  assert h100.vector_flops < devices.region_peak(mixed, h100) < h100.peak("float32")
  # The ridge falls with the rate: the same chain at HIGHEST is compute-bound.
  assert devices.is_mbci(fast, h100)[0]
  assert devices.is_mbci(exact, h100)[2] < devices.is_mbci(fast, h100)[2]
  assert not devices.is_mbci(exact, h100)[0]
  # The plan's predicted time and the roofline floor follow.
  assert cost_model.floor_time(exact, h100) > cost_model.floor_time(fast, h100)
  p_fast = plan_region(fast, h100, use_cache=False).best.predicted
  p_exact = plan_region(exact, h100, use_cache=False).best.predicted
  assert p_exact.time_s > p_fast.time_s
  # Dot time per FLOP at the FMA rate against the TF32 rate (6.6x apart),
  # on plans of wgmma rows (fewer rows run TF32 dots at a fraction of it).
  def wide(region):
    return next(p.predicted for p in plan_region(region, h100, use_cache=False, top=50).ranked
                if p.tile_map["m"] >= h100.mma_rows)
  w_fast, w_exact = wide(fast), wide(exact)
  assert w_exact.t_dot_s / w_exact.flops > 5 * w_fast.t_dot_s / w_fast.flops

