"""``jaxfuse.jit``: a drop-in for ``jax.jit`` that fuses MBCI chains.

``jit(f)`` is ``jax.jit(fuse(f))``: ``jax.jit`` keeps doing what it does
(caching per input signature, pytrees, keyword arguments, static and donated
arguments, methods), and ``fuse`` rewrites the traced program so that each
captured region is one ``jaxfuse_region`` equation (see
``jaxfuse.runtime.primitive``).

Example::

    import jax, jax.numpy as jnp, jaxfuse

    @jaxfuse.jit
    def attention(q, k, v):
      s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
      return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

    out = attention(q, k, v)                          # same result as jax.jit
    print(jaxfuse.fused_jaxpr(attention)(q, k, v))    # shows a jaxfuse_region
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

from jaxfuse.config import config
from jaxfuse.config import on_update
from jaxfuse.runtime import measure_worker
from jaxfuse.runtime import primitive

try:
  from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
except ImportError:  # pragma: no cover - older jax
  from jax.core import ClosedJaxpr, jaxpr_as_fun  # type: ignore

__all__ = ["jit", "fuse", "fused_jaxpr", "rewrite_jaxpr"]

_logged_capture_failures: set[str] = set()
# Measured tuning's child process starts as soon as it will be wanted.
on_update(lambda name: name in ("tune", "tune_isolate") and measure_worker.prestart())


def _log_once(key: str, msg: str, *args: Any) -> None:
  if key in _logged_capture_failures:
    return
  _logged_capture_failures.add(key)
  logging.warning(msg, *args)


def _bind_region(captured: Any, *xs: Any) -> list[Any] | None:
  """The ``bind_region`` callback handed to ``capture.rewrite``."""
  return primitive._bind_captured(captured, *xs)  # pylint: disable=protected-access


def rewrite_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
  """Returns ``closed`` with each captured region as a ``jaxfuse_region``.

  Capture is best effort: any exception inside it is logged once and the
  original jaxpr comes back, so a capture bug never breaks the user's program.
  """
  try:
    from jaxfuse import capture  # pylint: disable=g-import-not-at-top
    return capture.rewrite(closed, _bind_region)
  except Exception as e:  # pylint: disable=broad-except
    _log_once(f"{type(e).__name__}:{e}",
              "jaxfuse: capture failed, the function runs unfused: %s: %s",
              type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
    return closed


def _is_dynamic(x: Any) -> bool:
  """Leaves that are traced; everything else (static args under jax.jit,
  Python objects) is closed over as a constant."""
  # Tracers are jax.Arrays too.
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split_arguments(fun: Callable, args: tuple, kwargs: dict, *,
                    dynamic: Callable[[Any], bool] = _is_dynamic
                    ) -> tuple[Callable, list]:
  """``(flat_fun, leaves)``: ``fun`` as a function of the array leaves of
  ``(args, kwargs)`` only; other leaves (static arguments, ``self``) are
  closed over. Shared by ``fuse`` and ``jaxfuse.inspect``."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dyn_idx = [i for i, x in enumerate(leaves) if dynamic(x)]

  def flat_fun(*dyn_vals):
    full = list(leaves)
    for i, v in zip(dyn_idx, dyn_vals):
      full[i] = v
    a, kw = jax.tree.unflatten(treedef, full)
    return fun(*a, **kw)

  return flat_fun, [leaves[i] for i in dyn_idx]


def fuse(fun: Callable) -> Callable:
  """Wraps ``fun`` so that, when called, its captured regions run fused.

  The wrapper traces ``fun`` with ``jax.make_jaxpr`` on the given arguments
  (concrete arrays or tracers, e.g. inside ``jax.jit``), rewrites the jaxpr
  with ``jaxfuse.capture.rewrite`` and evaluates the result. Arrays in the
  arguments (any pytree, keyword arguments too) are traced; other leaves are
  treated as static. Use it under ``jax.jit`` (that is what ``jaxfuse.jit``
  does); on its own it runs op by op.

  Example::

    f = jax.jit(jaxfuse.fuse(lambda a, b, d: (a @ b) @ d))
  """

  @functools.wraps(fun)
  def fused(*args: Any, **kwargs: Any) -> Any:
    flat_fun, dyn = split_arguments(fun, args, kwargs)

    # make_jaxpr raises jax's own errors for bad inputs (shape mismatch,
    # non-array arguments used as arrays...): they reach the user unchanged.
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    out_tree = jax.tree.structure(out_shape)
    rewritten = rewrite_jaxpr(closed)
    try:
      outs = jaxpr_as_fun(rewritten)(*dyn)
    except Exception as e:  # pylint: disable=broad-except
      if rewritten is closed:
        raise
      # A rewrite that does not evaluate is a jaxfuse bug: run the original.
      _log_once(f"eval:{type(e).__name__}:{e}",
                "jaxfuse: fused program failed to trace, running unfused: "
                "%s: %s", type(e).__name__, str(e).splitlines()[0][:300])
      outs = jaxpr_as_fun(closed)(*dyn)
    return jax.tree.unflatten(out_tree, outs)

  fused.__jaxfuse_fused__ = True  # type: ignore[attr-defined]
  return fused


def jit(fun: Callable | None = None, *,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        **jit_kwargs: Any) -> Any:
  """Drop-in for ``jax.jit`` that runs captured MBCI chains as fused kernels.

  Arguments are those of ``jax.jit`` (other keywords pass through). With
  ``JAXFUSE_DISABLE=1`` or ``jaxfuse.config.disable`` set when decorating,
  the result is exactly ``jax.jit(fun, ...)``. Also usable as
  ``@jaxfuse.jit(static_argnums=1)``.

  Example::

    @jaxfuse.jit
    def chain(a, b, d):
      return (a @ b) @ d
  """
  kw = dict(static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            **jit_kwargs)
  if fun is None:
    return functools.partial(jit, **kw)
  if not callable(fun):
    raise TypeError(f"jaxfuse.jit: fun must be callable, got {type(fun).__name__}")
  if config.disable:
    return jax.jit(fun, **kw)
  measure_worker.prestart()
  return jax.jit(fuse(fun), **kw)


def fused_jaxpr(fun: Callable, **jit_kwargs: Any) -> Callable[..., ClosedJaxpr]:
  """``fused_jaxpr(f, **jit_kwargs)(*args, **kwargs)``: the rewritten jaxpr.

  The jaxpr is the body that ``jaxfuse.jit(f, **jit_kwargs)`` compiles for
  these arguments; each fused region shows as a ``jaxfuse_region`` equation.

  Example::

    print(jaxfuse.fused_jaxpr(attention)(q, k, v))
  """

  def make(*args: Any, **kwargs: Any) -> ClosedJaxpr:
    jitted = jax.jit(fuse(fun), **jit_kwargs)
    if hasattr(jitted, "trace"):
      return jitted.trace(*args, **kwargs).jaxpr
    closed = jax.make_jaxpr(jitted)(*args, **kwargs)  # pragma: no cover
    return closed  # pragma: no cover

  return make
