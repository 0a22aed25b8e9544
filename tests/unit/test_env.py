"""Process set-up: a CPU job's host allocator keeps freed memory for reuse (trainer.env.reuse_freed_host_memory)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.env import ALLOCATOR_ENV

REPO = Path(__file__).resolve().parents[2]
# Buffers of 8, 10, ..., 30 MiB (each above glibc's default mmap threshold of 128 KiB), each filled and freed, as a
# training step's activations are; the page faults of two more such passes after a first one.
PROBE = """
import resource, torch
from trainer.env import reuse_freed_host_memory
print(reuse_freed_host_memory())
def one_pass():
    for mib in range(8, 32, 2):
        torch.empty(mib << 18).fill_(1.0)
one_pass()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_pass()
one_pass()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_OF_ONE_BUFFER = (8 << 20) // 4096  # the smallest buffer, in 4 KiB pages


def probe(env: dict) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="the setting is glibc's (Linux); elsewhere the trainer leaves the"
                                                    " allocator alone")
def test_freed_host_memory_is_reused_unless_the_user_set_the_allocator():
    """With the setting, the later passes reuse the first one's pages: fewer faults than one buffer has pages.
    Left alone (the user's GLIBC_TUNABLES set, which the trainer respects), glibc maps the larger buffers anew and
    every page faults in again: at least one buffer's pages per pass (measured: 43,005 faults for the two)."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV and k != "LD_PRELOAD"}
    applied, faults = probe(env)
    assert applied and faults < PAGES_OF_ONE_BUFFER
    applied, faults = probe({**env, "GLIBC_TUNABLES": "glibc.malloc.perturb=0"})
    assert not applied and faults >= 2 * PAGES_OF_ONE_BUFFER
