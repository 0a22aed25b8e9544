"""Launch a job on N CPU processes (torchrun over gloo) and collect its per-step results."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.parity import REPORT, merge

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       # the custom model families of tests/fixtures are importable by name in every rank
       "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fixtures"), os.environ.get("PYTHONPATH", "")])}

# Token shards of the parity runs' text, kept between sessions (git ignores .pytest_cache; its name changes
# with the text's size and time, the split and the tokenizer).
TOKEN_CACHE = REPO / ".pytest_cache" / "token-shards"

# Causal attention across the documents of a window ([model] attn_mask_type; block_causal by default for Llama).
CAUSAL = ["--model.attn_mask_type", "causal"]
# Block-causal attention document by document (the CPU backend), against a single process that uses it too.
VARLEN = ["--model.attn_backend", "varlen"]

# Shared by every parity run: tiny Llama, fp32, deterministic, global batch of 8 sequences.
# Adam's eps is large (1e-4, above the gradients' float32 noise but below their typical size):
# with the default 1e-8, Adam turns 1e-7 rounding noise in near-zero gradient entries into
# full-size updates, and later steps differ by more than any layout does. The LR floor keeps
# the last step's update nonzero, so parameters after the last step are a real comparison.
PARITY = [
    "--model.overrides.dim", "64", "--model.overrides.n_layers", "2", "--model.overrides.n_heads", "4",
    "--model.overrides.n_kv_heads", "2", "--model.overrides.vocab_size", "512",
    "--training.seq_len", "32", "--training.steps", "3", "--training.global_batch_size", "8",
    "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.min_lr_factor", "0.1", "--optimizer.lr", "3e-3",
    "--optimizer.eps", "1e-4",
    "--metrics.no-enable_tensorboard", "--debug.deterministic", "--training.mixed_precision_param", "float32",
    # Evaluation after every step on one global batch of held-out text (compared like the losses).
    "--validation.enable", "--validation.split", "train[90%:]", "--validation.freq", "1", "--validation.steps", "1",
    # Short documents (paragraphs of the bundled text, ~90 tokens each): a third of the windows of 32 tokens
    # cross an end-of-text, so every case exercises block-causal attention (the default) at document boundaries,
    # in training and in evaluation.
    "--training.dataset_path", str(REPO / "tests" / "fixtures" / "short_documents.txt"),
    "--validation.dataset_path", str(REPO / "tests" / "fixtures" / "short_documents.txt"),  # its last 10%
    # One token cache for every run of the session (and the next): each split of the text is tokenized once,
    # not once per case; runs after the first skip reading the text (and importing datasets).
    "--training.dataloader.cache_folder", str(TOKEN_CACHE),
]
# PARITY without its Llama overrides: the run settings, for other model families.
PARITY_RUN = [a for i, a in enumerate(PARITY)
              if not (a.startswith("--model") or (i and PARITY[i - 1].startswith("--model")))]
P = "--parallelism."


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={nproc}", *args]


def torchrun(nproc: int, args: list[str], tmp_path: Path, timeout: int = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(nproc, args), cwd=REPO, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def failure_report(proc: subprocess.CompletedProcess, tmp_path: Path) -> str:
    """The first traceback of a failed launch (the rank that failed first, not the peers it took
    down) and the end of the output; the whole output is kept in tmp_path/torchrun.log."""
    log = tmp_path / "torchrun.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    first = proc.stderr.find("Traceback")
    head = proc.stderr[first:first + 3000] if first >= 0 else ""
    return f"exit {proc.returncode}; full output in {log}\n{head}\n...\n{proc.stderr[-1500:]}"


def run_layout(nproc: int, overrides: list[str], tmp_path: Path, base: list[str] = PARITY, fault: str = "") -> dict:
    """Per-step results (losses, grad norms, every tensor) of a ``nproc``-rank run of ``base`` (default: the
    tiny Llama) plus ``overrides``; ``fault`` names a deliberate defect of tests/distributed/worker.py.
    ``result["dump"]`` is the run's dump folder."""
    out = tmp_path / f"result_{nproc}_{abs(hash(tuple(overrides)))}.json"
    dump = tmp_path / "dump"
    args = [str(WORKER), str(out), *base, "--job.dump_folder", str(dump), *overrides]
    proc = torchrun(nproc, args, tmp_path, env={"PARITY_FAULT": fault} if fault else None)
    assert proc.returncode == 0, failure_report(proc, tmp_path)
    return load_result(out, nproc, dump)


def load_result(out: Path, nproc: int, dump: Path) -> dict:
    result = json.loads(out.read_text())
    # Every rank's gradients and parameters (tests/parity.py), copies side by side.
    result["tensors"] = merge([torch.load(f"{out}.rank{r}.pt") for r in range(nproc)])
    result["dump"] = dump
    return result


def selected(request, test_name: str) -> list[dict]:
    """The parameters of the tests named ``test_name`` in the requesting module that this session
    runs (after -k and node-id selection), in collection order."""
    return [item.callspec.params for item in request.session.items
            if item.module is request.module and item.originalname == test_name and hasattr(item, "callspec")]


def runs(request, test_name: str) -> bool:
    """Whether this session runs the (unparametrized) test ``test_name`` of the requesting module."""
    return any(item.module is request.module and item.originalname == test_name for item in request.session.items)


class Launches:
    """Parity cases that share torchrun launches: the cases with the same rank count run one after
    another in one launch (worker.py --batch), so torch's import, the rendezvous and the first
    process group are paid once per rank count rather than once per case (most of a tiny case's
    launch). A case that its shared launch did not finish runs again in a launch of its own, so a
    failure is reported against the case that causes it, with that launch's output."""

    def __init__(self, folder: Path, cases: dict[str, tuple[int, list[str]]]):
        """``cases``: name -> (ranks, every argument after the worker's output file, ``base`` included) or (ranks,
        arguments, fault): a deliberate defect of worker.py for that case alone (put such cases last)."""
        self.folder, self.cases = folder, cases
        self.launched: set[int] = set()

    def _paths(self, name: str) -> tuple[Path, Path]:
        index = list(self.cases).index(name)
        return self.folder / f"case{index}.json", self.folder / f"case{index}_dump"

    def dump(self, name: str) -> Path:
        """The dump folder of case ``name`` (a later case of the launch can resume from its checkpoints)."""
        return self._paths(name)[1]

    def _launch(self, nproc: int) -> None:
        self.launched.add(nproc)
        batch = []
        for name, (n, args, *fault) in self.cases.items():
            if n == nproc:
                out, dump = self._paths(name)
                args = [*args, "--job.dump_folder", str(dump)]
                batch.append({"out": str(out), "args": args, "fault": "".join(fault)})
        cases = self.folder / f"batch_{nproc}.json"
        cases.write_text(json.dumps(batch))
        with open(self.folder / f"batch_{nproc}.log", "w") as out:
            proc = subprocess.Popen(torchrun_command(nproc, [str(WORKER), "--batch", str(cases)]), cwd=REPO, env=ENV,
                                    stdout=out, stderr=subprocess.STDOUT)
            try:  # a case it leaves unfinished runs again on its own (result)
                proc.wait(timeout=300 + 120 * len(batch))
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun's agent stops its workers on SIGTERM
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                out.write("\nshared launch timed out\n")

    def result(self, name: str, tmp_path: Path) -> dict:
        nproc, args, *fault = self.cases[name]
        if nproc not in self.launched:
            self._launch(nproc)
        out, dump = self._paths(name)
        if out.exists() and all(Path(f"{out}.rank{r}.pt").exists() for r in range(nproc)):
            return load_result(out, nproc, dump)
        # Said at the end of the run: a case that passes alone but not in sequence points at state
        # that leaks from one case to the next.
        REPORT.append(f"{name:<34} ran in a launch of its own: its shared launch did not finish it "
                      f"(see {self.folder / f'batch_{nproc}.log'})")
        return run_layout(nproc, args, tmp_path, base=[], fault="".join(fault))


def seconds_after_fault(output: str, end: float) -> float:
    """Seconds from the fault that tests/distributed/fault_worker.py injected (its line in ``output``) to ``end``
    (``time.time()`` when the job had ended)."""
    found = re.search(r"fault_worker: fault at ([0-9.]+)", output)
    assert found, output[-3000:]
    return end - float(found[1])
