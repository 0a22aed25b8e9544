"""Run under torchrun: count the meta-model builds and automatic-TP derivations of one job start.

    torchrun --nproc_per_node 4 tests/distributed/count_worker.py OUT.json --parallelism... ...
Each rank writes OUT.json.rank<N> with {"builds": n, "derivations": n, "chunks": n}.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trainer.parallel.auto_tp as auto_tp  # noqa: E402
import trainer.parallel.parallelize as parallelize_mod  # noqa: E402
import trainer.train as train_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.models.decoder.model import Transformer  # noqa: E402

counts = {"builds": 0, "derivations": 0, "chunks": 0}
real_init, real_derive, real_build = Transformer.__init__, auto_tp.derive_tp_plan, train_mod.build_model_parts


def counting_init(self, *args, **kwargs):
    counts["builds"] += 1
    real_init(self, *args, **kwargs)


def counting_derive(*args, **kwargs):
    counts["derivations"] += 1
    return real_derive(*args, **kwargs)


def counting_build(*args, **kwargs):
    parts = real_build(*args, **kwargs)
    counts["chunks"] = len(parts.chunks)
    return parts


if __name__ == "__main__":
    Transformer.__init__ = counting_init
    parallelize_mod.derive_tp_plan = counting_derive
    train_mod.build_model_parts = counting_build
    out, overrides = sys.argv[1], sys.argv[2:]
    train_mod.main(load_config(overrides=overrides))
    Path(f"{out}.rank{os.environ['RANK']}").write_text(json.dumps(counts))
