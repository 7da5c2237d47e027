"""jaxfuse benchmark binaries and their shared harness.

Each binary runs as ``python -m benchmarks.<name>`` or
``python benchmarks/<name>.py`` from the repository root:

* ``gemm_chain``: MCFuser Table II and Chimera Table IV GEMM chains.
* ``attention``: MCFuser Table III (S1-S9), causal variants, large cases.
* ``mlp_chain``: 3-GEMM MLP chains with activations (BERT/ViT shapes).
* ``bert``: a plain-JAX BERT encoder forward pass.
* ``model_fidelity``: the planner's predicted vs measured time of candidates.

``benchmarks.harness`` does timing (slope method and profiler kernel time),
the reference check, the roofline numbers, and JSON/CSV/PNG output for all.

Example::

    python -m benchmarks.attention --cases=S1,S2 --dtype=float16 --plot
"""
