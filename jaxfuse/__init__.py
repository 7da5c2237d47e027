"""jaxfuse: planned Triton kernels for memory-bound chains of compute-intensive ops.

Example::

    import jax, jax.numpy as jnp, jaxfuse

    @jaxfuse.jit                      # drop-in for jax.jit
    def attention(q, k, v):
      s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
      return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

    print(jaxfuse.inspect(attention, q, k, v))   # what was fused, the plan, its cost
"""

from jaxfuse.config import config  # noqa: F401
from jaxfuse.api import fuse, fused_jaxpr, jit  # noqa: F401
from jaxfuse.inspection import Report, RegionReport, inspect  # noqa: F401
from jaxfuse import ir  # noqa: F401

__version__ = "0.1.0"

__all__ = ["jit", "fuse", "fused_jaxpr", "inspect", "Report", "RegionReport",
           "config", "ir", "__version__"]
