"""Parallelism: degrees and meshes, and one module per SPMD/pipeline technique."""
