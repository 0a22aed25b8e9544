"""Run under torchrun: train with the given overrides and have rank 0 write the per-step results.

    torchrun --nproc_per_node 4 tests/distributed/worker.py OUT.json --parallelism.tensor_parallel_degree 2 ...
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.config import load_config  # noqa: E402
from trainer.train import main  # noqa: E402

if __name__ == "__main__":
    out, overrides = sys.argv[1], sys.argv[2:]
    result = main(load_config(overrides=overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"losses": result.losses, "grad_norms": result.grad_norms}))
