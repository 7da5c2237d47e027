"""Device table, overrides, ridge point and MBCI classification."""

from __future__ import annotations

import pytest

from jaxfuse import devices
from jaxfuse.planner import examples


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
