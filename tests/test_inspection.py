"""Tests for jaxfuse.inspection.inspect: fields, exact costs, graceful degradation."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import api, inspection


def attention(q, k, v):
  s = jnp.einsum("bqd,bkd->bqk", q, k) * jnp.float16(0.125)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def gemm_chain(a, b, d):
  return (a @ b) @ d


def _s2():
  # MCFuser/Chimera S2: batch*heads=12, M=N=512, d=64, fp16 (traced only).
  sd = jax.ShapeDtypeStruct((12, 512, 64), jnp.float16)
  return sd, sd, sd


def _g1():
  # G1 (1, 512, 256, 64, 64): a[512,64] @ b[64,256] @ d[256,64], fp16.
  return (jax.ShapeDtypeStruct((1, 512, 64), jnp.float16),
          jax.ShapeDtypeStruct((1, 64, 256), jnp.float16),
          jax.ShapeDtypeStruct((1, 256, 64), jnp.float16))


def test_attention_report_costs_exact_and_mbci_on_h100():
  rep = inspection.inspect(attention, *_s2(), device="h100")
  assert len(rep.regions) == 1
  r = rep.regions[0]
  flops = 2 * (2 * 12 * 512 * 512 * 64)           # QK^T and PV
  min_bytes = 4 * 12 * 512 * 64 * 2               # q, k, v in, o out, fp16
  assert r.flops == flops
  assert r.min_bytes == min_bytes
  assert r.intensity == flops / min_bytes == 256.0
  assert r.device == "h100" and rep.device == "h100"
  assert r.ridge == pytest.approx(790e12 / 3.0e12, rel=0.05)
  assert r.mbci is True
  assert r.dtype == "float16"
  assert sorted(r.loops.values()) == sorted([12, 512, 512, 64, 64]) or \
      sorted(r.loops.values()) == sorted([12, 512, 512, 64])
  assert r.einsum.count("->") == 2
  assert "test_inspection.py" in r.source
  assert r.path == ""
  assert r.floor_time_s == pytest.approx(
      max(flops / 790e12, min_bytes / 3.0e12), rel=0.05)
  text = str(rep)
  for section in ("region 1/1", "IR:", "einsum:", "loops:", "FLOPs:", "min bytes:",
                  "intensity:", "MBCI:          yes", "plan:", "predicted:", "floor:",
                  "why not fused:"):
    assert section in text, section
  json.dumps(rep.to_dict())


def test_gemm_chain_report_costs_exact():
  rep = inspection.inspect(gemm_chain, *_g1(), device="h100")
  assert len(rep.regions) == 1
  r = rep.regions[0]
  m, n, k, h = 512, 256, 64, 64
  assert r.flops == 2 * m * n * k + 2 * m * n * h
  assert r.min_bytes == 2 * (m * k + k * n + n * h + m * h)
  assert r.intensity == r.flops / r.min_bytes
  assert r.mbci is True  # ~50 FLOP/B, far below the ridge
  assert r.einsum.count("->") == 2
  assert rep.to_dict()["regions"][0]["flops"] == r.flops


def test_device_choice_changes_ridge():
  h100 = inspection.inspect(attention, *_s2(), device="h100").regions[0]
  h200 = inspection.inspect(attention, *_s2(), device="h200").regions[0]
  assert h200.ridge < h100.ridge      # same FLOP/s, more bandwidth
  assert h200.intensity == h100.intensity


def test_float32_precision_sets_the_reported_ridge_and_floor():
  from jaxfuse import devices  # pylint: disable=g-import-not-at-top
  g1 = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in _g1()]
  exact = lambda a, b, d: jnp.matmul(jnp.matmul(a, b, precision="highest"), d,
                                     precision="highest")
  fast = inspection.inspect(gemm_chain, *g1, device="h100").regions[0]
  slow = inspection.inspect(exact, *g1, device="h100").regions[0]
  h100 = devices.get_device("h100")
  bw = h100.mem_bandwidth_Bps
  assert fast.ridge == pytest.approx(h100.peak("float32") / bw)     # TF32
  assert slow.ridge == pytest.approx(h100.vector_flops / bw)        # fp32 FMAs
  assert slow.floor_time_s > fast.floor_time_s
  assert "precision=ieee" in slow.ir_text and "precision=" not in fast.ir_text


def test_plan_fields_when_planner_present_or_note_when_not():
  rep = inspection.inspect(attention, *_s2(), device="h100")
  r = rep.regions[0]
  try:
    from jaxfuse.planner import plan_region  # noqa: F401
  except ImportError:
    assert r.plan is None and any("planner" in n for n in rep.notes)
    return
  if r.plan is None:
    assert r.why_not or any("planner" in n for n in r.notes + rep.notes)
    return
  assert r.predicted_time_s is not None and r.predicted_time_s > 0
  assert r.predicted_time_s >= r.floor_time_s * 0.5
  assert len(r.alternatives) <= 5
  for alt in r.alternatives:
    assert alt.predicted_time_s is None or alt.predicted_time_s >= r.predicted_time_s * 0.999
  assert str(r.plan) in str(rep)
  # The model's time for XLA's separate ops, which keep-or-drop weighs the
  # plan against, is reported and printed.
  from jaxfuse import capture
  from jaxfuse.devices import get_device
  from jaxfuse.planner import cost_model
  [captured] = capture.find_regions(jax.make_jaxpr(attention)(*_s2()))
  assert r.unfused_time_s == pytest.approx(cost_model.unfused_time(captured.region, get_device("h100")))
  assert f"XLA ops (model): {r.unfused_time_s * 1e6:.3f} us" in str(rep)


def test_degrades_when_planner_raises(monkeypatch):
  import jaxfuse.planner as planner

  def boom(*a, **k):
    raise RuntimeError("planner exploded")

  monkeypatch.setattr(planner, "plan_region", boom, raising=False)
  rep = inspection.inspect(gemm_chain, *_g1(), device="h100")
  r = rep.regions[0]
  assert r.plan is None and r.predicted_time_s is None
  assert any("planner exploded" in n for n in r.notes)
  assert r.flops > 0 and r.mbci is True
  assert "planner exploded" in str(rep)


def test_degrades_when_devices_missing(monkeypatch):
  monkeypatch.setitem(sys.modules, "jaxfuse.devices", None)
  monkeypatch.delattr("jaxfuse.devices", raising=False)
  rep = inspection.inspect(gemm_chain, *_g1(), device="h100")
  r = rep.regions[0]
  assert r.ridge is None and r.mbci is None and r.floor_time_s is None
  assert any("device" in n for n in rep.notes)
  assert "ridge unknown" in str(rep)


def test_real_arrays_kwargs_and_jaxfuse_jit_function():
  keys = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(keys[0], (16, 8))
  b = jax.random.normal(keys[1], (8, 12))
  d = jax.random.normal(keys[2], (12, 4))
  rep = inspection.inspect(api.jit(gemm_chain), a, b, d=d, device="a100")
  assert len(rep.regions) == 1 and rep.function == "gemm_chain"
  assert rep.regions[0].flops == 2 * 16 * 12 * 8 + 2 * 16 * 12 * 4
  assert rep.regions[0].dtype == "float32"


def test_no_regions():
  x = jnp.ones((8, 8))
  rep = inspection.inspect(lambda x: jnp.tanh(x @ x.T), x)
  assert rep.regions == []
  assert "no chain" in str(rep)


def test_nested_region_path():
  xs = jax.ShapeDtypeStruct((3, 64, 32), jnp.float32)
  b = jax.ShapeDtypeStruct((32, 48), jnp.float32)
  d = jax.ShapeDtypeStruct((48, 16), jnp.float32)

  def f(xs, b, d):
    return jax.lax.scan(lambda c, x: (c, gemm_chain(x, b, d)), 0.0, xs)[1]

  rep = inspection.inspect(f, xs, b, d, device="h100")
  assert len(rep.regions) == 1
  assert rep.regions[0].path  # found inside the scan body
  np.testing.assert_equal(rep.regions[0].flops, 2 * 64 * 48 * 32 + 2 * 64 * 48 * 16)


def test_capture_failure_is_a_note(monkeypatch):
  from jaxfuse import capture

  def boom(*a, **k):
    raise RuntimeError("capture exploded")

  monkeypatch.setattr(capture, "find_regions", boom)
  rep = inspection.inspect(gemm_chain, *_g1())
  assert rep.regions == [] and any("capture exploded" in n for n in rep.notes)


def test_bad_input_gets_jax_error():
  a, b, d = _g1()
  with pytest.raises(TypeError):
    inspection.inspect(gemm_chain, a, d, b)


def test_inspect_reports_how_a_compile_lowered_each_region(monkeypatch):
  """Before a compile the report says so; after one it says what ran: the
  kernel's plan, or why XLA's ops run."""
  from jaxfuse.config import config
  from jaxfuse.runtime import launch
  keys = jax.random.split(jax.random.key(3), 3)
  a = jax.random.normal(keys[0], (1, 56, 16))   # a shape no other test compiles
  b = jax.random.normal(keys[1], (1, 16, 40))
  d = jax.random.normal(keys[2], (1, 40, 24))
  (r,) = inspection.inspect(gemm_chain, a, b, d).regions
  assert r.lowered is None and "lowered:       - (no lowering to a kernel recorded" in str(r)
  with config.override(backend="interpret"):
    out = api.jit(gemm_chain)(a, b, d)
  ref = np.asarray((a @ b) @ d)   # the kernel's float32 dots are TF32, as XLA's on a GPU
  assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < 2e-3
  (r,) = inspection.inspect(gemm_chain, a, b, d).regions
  assert r.lowered.startswith("fused: grid(")
  assert json.loads(json.dumps(r.to_dict()))["lowered"] == r.lowered
  # A region left to XLA says why.
  a2, b2, d2 = a[:, :32], b[:, :, :32], d[:, :32]
  monkeypatch.setattr(launch, "_candidate_plans", lambda *x, **k: (_ for _ in ()).throw(
      launch.LeftToXLA("measured slower than XLA: fused 9.0 us vs XLA 7.0 us")))
  with config.override(backend="interpret"):
    api.jit(gemm_chain)(a2, b2, d2)
  (r,) = inspection.inspect(gemm_chain, a2, b2, d2).regions
  assert r.lowered == "XLA's ops: measured slower than XLA: fused 9.0 us vs XLA 7.0 us"


def test_chain_left_to_xla_reports_its_parts():
  """BERT-Base's FFN at batch 1: the chain is left to XLA on the model's
  word; its GEMM-GELU part is reported as a region of its own, fused, with
  XLA's separate GELU kernel in its unfused time."""
  def ffn(x, w1, b1, w2, b2):
    return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)
  rep = inspection.inspect(ffn, sd(1, 512, 768), sd(768, 3072), sd(3072), sd(3072, 768),
                           sd(768), device="h100")
  [r] = rep.regions
  assert r.einsum == "mk,kn->mn ; mn,nh->mh" and r.why_not
  [p] = r.parts
  assert p.einsum == "mk,kn->mn" and p.why_not is None and p.plan is not None
  assert p.predicted_time_s < p.unfused_time_s
  assert "parts:         1 region(s)" in str(rep)
  d = json.loads(json.dumps(rep.to_dict()))
  assert d["regions"][0]["parts"][0]["einsum"] == "mk,kn->mn"
  # A fused chain has no parts.
  assert inspection.inspect(attention, *_s2(), device="h100").regions[0].parts == []


def test_report_says_where_tune_auto_times_the_kernel():
  """The model's verdict is the report's; where tune='auto' (the default)
  does not take it on the model's word, the report says so."""
  def chain(a, b, d):
    return (a @ b) @ d
  sd = lambda dt, *s: jax.ShapeDtypeStruct(s, dt)
  # MCFuser G6 at float16: predicted a little slower, near the bound.
  [g6] = inspection.inspect(chain, sd(jnp.float16, 512, 1024), sd(jnp.float16, 1024, 512),
                            sd(jnp.float16, 512, 256), device="h100").regions
  assert "left to XLA under tune='model'" in g6.why_not
  assert "tune='auto' times it on the GPU against the ops that would run instead first" in g6.why_not
  # MCFuser G1 at float32: predicted a win, but float32 dots are timed.
  [g1] = inspection.inspect(chain, sd(jnp.float32, 512, 64), sd(jnp.float32, 64, 256),
                            sd(jnp.float32, 256, 64), device="h100").regions
  assert g1.why_not is None
  assert any("tune='auto' times this kernel" in n and "float32 dots" in n for n in g1.notes)
  # MCFuser G1 at float16: the model's word stands.
  [h1] = inspection.inspect(chain, sd(jnp.float16, 512, 64), sd(jnp.float16, 64, 256),
                            sd(jnp.float16, 256, 64), device="h100").regions
  assert h1.why_not is None and not any("tune='auto'" in n for n in h1.notes)


def test_report_names_the_tied_plan_tune_auto_times_beside_a_split_pick():
  """One sequence's grouped decoding step in [B, heads, T, D] order (32
  query heads over 8, 16384 keys): no unsplit plan within reach, and the
  model ties its 16-way split pick with an 8-way split plan (both 36.7 us;
  they ran 35.6 and 29.6 us on an H100, seventieth session), which the
  report names as timed beside the pick."""
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)

  def step(q, k, v):   # q [1, 8, 4, 1, 128]; k, v [1, 8, 16384, 128]
    s = jnp.einsum("bkgqd,bksd->bkgqs", q, k) * 128 ** -0.5
    return jnp.einsum("bkgqs,bksd->bkgqd", jax.nn.softmax(s, axis=-1), v)
  [r] = inspection.inspect(step, sd(1, 8, 4, 1, 128), sd(1, 8, 16384, 128),
                           sd(1, 8, 16384, 128), device="h100").regions
  assert r.plan.split is not None and "tune='auto' times it on the GPU" in r.why_not
  assert "the model's best unsplit plan" not in r.why_not
  tied = r.why_not.split("a plan the model predicts as fast is timed beside it, predicted ")[1]
  predicted = float(tied.split(" us")[0]) * 1e-6
  assert r.predicted_time_s <= predicted <= 1.02 * r.predicted_time_s
  assert f"split={r.plan.split[0]}x{r.plan.split[1]})" not in tied


def test_report_names_the_unsplit_plan_tune_auto_times_beside_a_split_pick():
  """One grouped decoding step at batch 8 (32 query heads over 8, 4096
  keys): the pick splits the key loop, and the report names the unsplit
  plan that tune='auto' times beside it (launch.rival_plan)."""
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)
  step = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
  [r] = inspection.inspect(step, sd(8, 1, 32, 128), sd(8, 4096, 8, 128), sd(8, 4096, 8, 128),
                           device="h100").regions
  # Its best plans of other structures are listed apart, the unsplit one among them.
  assert r.other_structures and len(r.other_structures) <= 3
  assert "other structures:" in str(r)
  assert any("split=" not in a.plan for a in r.other_structures)
  assert all(a.predicted_time_s >= r.predicted_time_s * 0.999 for a in r.other_structures)
  assert r.to_dict()["other_structures"][0]["plan"] == r.other_structures[0].plan
  # Predicted faster than XLA's ops (its copies of the key/value cache
  # priced, ir.xla_gemm_copies): fused under tune='model', and a note says
  # tune='auto' times it all the same, with the unsplit plan beside it.
  assert r.why_not is None and r.plan.split is not None
  [note] = [n for n in r.notes if "tune='auto' times this kernel on the GPU" in n]
  assert "flash-decoding" in note
  rival = note.split("the model's best unsplit plan is timed beside it, predicted ")[1]
  predicted = float(rival.split(" us")[0]) * 1e-6
  assert r.predicted_time_s <= predicted <= 1.6 * r.predicted_time_s and "split=" not in rival


def test_a_training_steps_attention_is_reported_left_to_xla_for_its_intermediates():
  """The forward attention of a training step (softmax in float32), where
  the backward reads its probabilities (``config.recompute`` off), writes
  float32 copies of its scores for the backward; the report says so, and
  that it runs XLA's ops under 'model' and 'auto'
  (``cost_model.writes_its_intermediates``)."""
  def attention_loss(q, k, v, g):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(jnp.float32) * g)

  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  x = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.float16)
  step = jax.value_and_grad(attention_loss, argnums=(0, 1, 2))
  with config.override(recompute=False):
    rep = inspection.inspect(step, x, x, x, x, device="h100")
  [fwd] = [r for r in rep.regions if r.einsum == "bmgk,bngk->bgmn ; bgmn,bngh->bghm"]
  assert "wider copies" in fwd.why_not
  assert "tune='model' and 'auto'" in fwd.why_not
  # By default the backward recomputes the probabilities it reads: the
  # forward writes none and is fused.
  rep = inspection.inspect(step, x, x, x, x, device="h100")
  [fwd] = [r for r in rep.regions if r.einsum.startswith("bmgk,bngk->bgmn ; bgmn,bng")]
  assert fwd.why_not is None
  only = inspection.inspect(lambda q, k, v: jax.nn.softmax(
      jnp.einsum("bqhd,bkhd->bhqk", q, k)), x, x, x, device="h100")
  assert all("wider copies" not in (r.why_not or "") for r in only.regions)
