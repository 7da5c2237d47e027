"""Test-session settings: CPU only, Triton's interpreter, a private cache."""

import os
import tempfile

# Before jax or triton are imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("JAXFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="jaxfuse-test-cache-"))
