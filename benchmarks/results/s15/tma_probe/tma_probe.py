"""Probe: the generated large-attention kernel with tensor-descriptor (TMA) loads, vs its
pointer form and cuDNN (torch SDPA), same process, do_bench, float32 torch reference."""
import os, sys, json, itertools, importlib.util, tempfile, re
import torch, triton, triton.language as tl
from jaxfuse.planner import examples, plan_region
from jaxfuse import codegen
OUT = os.environ.get("OUT", "/tmp")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

def variant(src, kind, ws):
  """kind: ptr | d2 (2-D descriptors over [B*G*T, D]) | d4 (4-D descriptors) | d2kv."""
  if kind == "ptr":
    s = src
  else:
    lines = src.split("\n")
    out = []
    for ln in lines:
      m = re.match(r"(\s*)(\w+) = tl.load\((\w)_ptr \+ i_b \* (\d+) \+ i_g \* (\d+) \+ offs_(\w)\[:, None\] \* (\d+) \+ offs_(\w)\[None, :\]\)", ln)
      st = re.match(r"(\s*)tl.store\(out_ptr \+ i_b \* (\d+) \+ i_g \* (\d+) \+ offs_m\[:, None\] \* (\d+) \+ offs_e\[None, :\], (.*)\)$", ln)
      if m and (kind != "d2kv" or m.group(3) in "kv"):
        ind, var, t, sb, sg, r, sr, c = m.groups()
        blk = {"m": "BLOCK_M", "n": "BLOCK_N"}[r]; cb = {"d": "BLOCK_D", "e": "BLOCK_E"}[c]
        start = {"m": "pid_m * BLOCK_M", "n": "start_n"}[r]
        if kind.startswith("d2"):
          out.append(f"{ind}{var} = {t}_desc.load([(i_b * G + i_g) * {r.upper()} + {start}, 0])")
        else:
          out.append(f"{ind}{var} = {t}_desc.load([i_b, i_g, {start}, 0]).reshape({blk}, {cb})")
      elif st and kind != "d2kv":
        ind = st.group(1); val = st.group(5)
        if kind.startswith("d2"):
          out.append(f"{ind}out_desc.store([(i_b * G + i_g) * M + pid_m * BLOCK_M, 0], {val})")
        else:
          out.append(f"{ind}out_desc.store([i_b, i_g, pid_m * BLOCK_M, 0], ({val}).reshape(1, 1, BLOCK_M, BLOCK_E))")
      else:
        out.append(ln)
      if ln.strip().startswith("pid_b = tl.program_id(2)"):
        for t, r, c in (("q", "M", "D"), ("k", "N", "D"), ("v", "N", "E"), ("out", "M", "E")):
          if kind == "d2kv" and t not in "kv": continue
          blk = {"M": "BLOCK_M", "N": "BLOCK_N"}[r]; cb = "BLOCK_" + c
          if kind.startswith("d2"):
            out.append(f"  {t}_desc = tl.make_tensor_descriptor({t}_ptr, [B * G * {r}, {c}], [{c}, 1], [{blk}, {cb}])")
          else:
            out.append(f"  {t}_desc = tl.make_tensor_descriptor({t}_ptr, [B, G, {r}, {c}], [G * {r} * {c}, {r} * {c}, {c}, 1], [1, 1, {blk}, {cb}])")
    s = "\n".join(out)
  if ws:
    s = s.replace("for start_n in range(0, N, BLOCK_N):", "for start_n in tl.range(0, N, BLOCK_N, warp_specialize=True):")
  return s

rows = []
cases = [(8, 16, 2048, 128), (8, 16, 2048, 64), (8, 16, 4096, 128)]
if len(sys.argv) > 1: cases = cases[:int(sys.argv[1])]
for B, G, T, D in cases:
  r = examples.attention(B, G, T, T, D)
  res = plan_region(r, 'h100', use_cache=False)
  p = res.ranked[0]
  kern = codegen.generate(r, p, interpret=False)
  q, k, v = (torch.randn(B, G, T, D, device="cuda", dtype=torch.float16) for _ in range(3))
  ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
  flops = 4 * B * G * T * T * D
  from torch.nn.attention import sdpa_kernel, SDPBackend
  def cud():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): return torch.nn.functional.scaled_dot_product_attention(q, k, v)
  ms = triton.testing.do_bench(cud, warmup=25, rep=200)
  print(f"T{T} d{D} cudnn {ms*1e3:.1f} us {flops/ms/1e9:.0f} TFLOP/s", flush=True)
  rows.append(dict(T=T, D=D, cfg="cudnn", us=ms * 1e3))
  base = dict(kern.constexprs)
  pick = (base["BLOCK_M"], base["BLOCK_N"], kern.num_warps, kern.num_stages)
  cfgs = [pick, (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 8, 3), (256, 64, 8, 4), (256, 128, 8, 2), (128, 128, 4, 3), (128, 64, 4, 4)]
  cfgs = list(dict.fromkeys(cfgs))
  for kind in ("ptr", "d2", "d4", "d2kv"):
    for ws in (False, True):
      if kind != "d2" and ws: continue
      src = variant(kern.source, kind, ws)
      d = tempfile.mkdtemp(); path = os.path.join(d, f"fa_{T}_{D}_{kind}_{ws}.py"); open(path, "w").write(src)
      if (T, D) == (2048, 128): os.system(f"cp {path} {OUT}/")
      spec = importlib.util.spec_from_file_location(f"fa_{T}_{D}_{kind}_{ws}", path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
      for bm, bn, w, s in cfgs:
        if kind in ("ptr", "d4") and (bm, bn, w, s) not in cfgs[:5]: continue
        if kind == "d2kv" and (bm, bn, w, s) not in cfgs[:3]: continue
        c = dict(base, BLOCK_M=bm, BLOCK_N=bn)
        grid = (T // bm, G, B)
        out = torch.empty_like(q)
        fn = lambda: m.fused_kernel[grid](q, k, v, out, num_warps=w, num_stages=s, **c)
        tag = f"T{T} d{D} {kind}{'+ws' if ws else ''} m{bm} n{bn} w{w} s{s}"
        try:
          fn(); torch.cuda.synchronize()
          err = ((out.float() - ref).norm() / ref.norm()).item()
          ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        except Exception as e:
          print(f"{tag} failed: {str(e)[:100]!r}", flush=True); continue
        print(f"{tag} {ms*1e3:7.1f} us {flops/ms/1e9:4.0f} TFLOP/s err {err:.1e}{'  <- model pick' if (bm,bn,w,s)==pick else ''}", flush=True)
        rows.append(dict(T=T, D=D, kind=kind, ws=ws, cfg=f"m{bm} n{bn} w{w} s{s}", us=ms * 1e3, err=err))
json.dump(rows, open(os.path.join(OUT, "tma_probe.json"), "w"), indent=1)
