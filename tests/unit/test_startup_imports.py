"""Start-up: the launcher's config check (run_train.sh) must not import what only training needs.

DTensor and torch._dynamo (with sympy) cost ~1 s of import each time a job starts (measured in
docs/performance.md#start-up); the check builds the plan on the meta device without them."""

import subprocess
import sys

from tests.distributed.harness import REPO

CHECK = """
import sys
from torch.distributed.run import get_args_parser
from trainer.launch import check_config
args = get_args_parser().parse_args(["--standalone", "--nproc-per-node=2", "train.py", "--job.config_file",
                                     "configs/debug_model.toml", "--parallelism.data_parallel_shard_degree", "2"])
assert check_config(args) == 0
heavy = [m for m in ("torch.distributed.tensor", "torch._dynamo", "torch.distributed.checkpoint", "sympy")
         if m in sys.modules]
print(",".join(heavy) or "none")
"""


def test_the_launchers_config_check_imports_neither_dtensor_nor_dynamo():
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "none"
