"""Planning time for every case of MCFuser Tables II/III and Chimera Table IV.

Builds each region directly with the Chain IR (jaxfuse.planner.examples),
plans it with the model alone (no cache) and prints one row per case: time,
chosen plan, predicted time, programs. Run:

    python benchmarks/plan_time.py --device=h100 --repeat=3
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top

from jaxfuse.devices import get_device
from jaxfuse.planner import examples, plan_region

_DEVICE = flags.DEFINE_string("device", "h100", "device model to plan for")
_REPEAT = flags.DEFINE_integer("repeat", 3, "plans per case; the median is reported")
_DTYPE = flags.DEFINE_string("dtype", "float16", "input dtype of the regions")
_FILTER = flags.DEFINE_string("filter", "", "only cases whose name contains this")


def main(argv):
  del argv
  dev = get_device(_DEVICE.value)
  # Import cost once, outside the timed region (first-use imports).
  plan_region(examples.gemm_chain(1, 64, 64, 64, 64), dev, use_cache=False)
  rows = []
  out = sys.stdout
  out.write(f"# planning time, device model {dev.name}, model only, no cache, "
            f"median of {_REPEAT.value}\n")
  out.write("| case | shape | plan time (ms) | evaluated | best plan | predicted (us) | programs |\n")
  out.write("| --- | --- | --- | --- | --- | --- | --- |\n")
  for name, region in examples.paper_cases(_DTYPE.value):
    if _FILTER.value and _FILTER.value not in name:
      continue
    times = []
    res = None
    for _ in range(max(1, _REPEAT.value)):
      t0 = time.perf_counter()
      res = plan_region(region, dev, use_cache=False)
      times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rows.append(med)
    shape = ",".join(f"{l.name}={l.extent}" for l in region.loops)
    best = res.best
    if best is None:
      out.write(f"| {name} | {shape} | {med * 1e3:.1f} | {res.space.get('evaluated')} | "
                f"none: {res.why_not} | - | - |\n")
      continue
    out.write(f"| {name} | {shape} | {med * 1e3:.1f} | {res.space.get('evaluated')} | "
              f"`{best}` | {best.predicted.time_s * 1e6:.2f} | {best.predicted.programs} |\n")
  if rows:
    out.write(f"\nmax {max(rows) * 1e3:.1f} ms, median {statistics.median(rows) * 1e3:.1f} ms "
              f"over {len(rows)} cases\n")


if __name__ == "__main__":
  app.run(main)
