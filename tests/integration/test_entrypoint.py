"""The real entry points (run_train.sh, train.py) as a user runs them."""

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


def tb_run(dump):
    """The run's TensorBoard folder: <dump>/tb/<YYYYmmdd-HHMMSS>, the only one of a fresh dump folder."""
    (run,) = [p for p in (dump / "tb").iterdir() if p.is_dir()]
    return run


def launch(cmd, env=None, **kw):
    return subprocess.run(cmd, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.slow
def test_readme_train_command_trains_the_debug_model(tmp_path):
    """./run_train.sh with the default config: loss falls clearly, TensorBoard has the loss curve."""
    dump = tmp_path / "debug"
    proc = launch(["./run_train.sh", "--job.dump_folder", str(dump), "--training.steps", "20"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = EventAccumulator(str(tb_run(dump)))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    for tag in ("grad_norm", "lr", "tokens_per_second", "step_time_s", "memory_rss_peak_gib"):
        assert tag in events.Tags()["scalars"]
    assert (dump / "config.toml").is_file()
    out = proc.stdout + proc.stderr
    assert "step 20/20  loss" in out and "eta 0:00:00" in out and f"TensorBoard: {tb_run(dump)} (new run)" in out


USER_ERRORS = [
    (["--training.stpes", "5"], "[training] stpes: unknown key"),
    (["--training.dataset_path", "/no/such/file.txt"], "[training] dataset_path: file not found"),
    (["--job.config_file", "/no/such/job.toml"], "[job] config_file: file not found"),
]


@pytest.mark.parametrize("args, message", USER_ERRORS, ids=[a[0] for a, _ in USER_ERRORS])
def test_user_errors_are_one_line_without_traceback(args, message):
    proc = launch([sys.executable, "train.py", *args])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_mistake_of_a_config_file_is_one_line(tmp_path):
    """Two unknown keys in the job file: both reported, one "error:" line each, exit 2, no traceback."""
    job = tmp_path / "job.toml"
    job.write_text('[training]\nstpes = 5\n[optimizer]\nlearning_rate = 1e-3\n')
    proc = launch([sys.executable, "train.py", "--job.config_file", str(job)])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "error"], lines
    assert "[training] stpes: unknown key" in lines[0] and "[optimizer] learning_rate: unknown key" in lines[1]


def test_runtime_user_error_is_one_line(tmp_path):
    """A file that exists but is not a tokenizer fails at start-up with one line naming the key."""
    bad = tmp_path / "tok.model"
    bad.write_text("garbage\n")
    proc = launch([sys.executable, "train.py", "--model.tokenizer_path", str(bad), "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: [model] tokenizer_path:")


def test_malformed_toml_names_file_and_line(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[training]\nsteps = \n")
    proc = launch([sys.executable, "train.py", "--job.config_file", str(cfg)])
    assert proc.returncode == 2 and "job.toml: malformed TOML" in proc.stderr and "line 2" in proc.stderr


def test_run_train_sh_rejects_bad_config_before_launch():
    proc = launch(["./run_train.sh", "--optimizer.name", "sgd"])
    assert proc.returncode == 2
    assert "[optimizer] name: got 'sgd'" in proc.stderr
    assert "torch.distributed" not in proc.stderr and "[rank" not in proc.stdout  # torchrun never started


@pytest.mark.slow
def test_run_train_sh_takes_relative_paths_from_where_it_is_run(tmp_path):
    """A user in their own folder runs the trainer by its full path: CONFIG_FILE, the dataset and the
    dump folder are theirs, relative to that folder; a missing file names the absolute path looked for."""
    user = tmp_path / "me"
    user.mkdir()
    (user / "job.toml").write_text('[job]\ndump_folder = "out"\n[model]\nname = "llama3"\nflavor = "debugmodel"\n'
                                   '[training]\ndataset_path = "notes.txt"\nlocal_batch_size = 2\nseq_len = 32\n')
    (user / "notes.txt").write_text("\n\n".join(f"Note {i}: the trainer reads text files too." * 8 for i in range(40)))
    script = str(REPO / "run_train.sh")

    def run_here(args, config="job.toml"):
        return subprocess.run([script, *args], cwd=user, env={**ENV, "CONFIG_FILE": config}, capture_output=True,
                              text=True, timeout=600)

    proc = run_here(["--training.steps", "2", "--validation.no-enable", "--metrics.no-enable_tensorboard"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (user / "out" / "config.toml").is_file() and not (REPO / "out").exists()
    missing = run_here([], config="nojob.toml")
    assert missing.returncode == 2
    assert f"error: CONFIG_FILE=nojob.toml: file not found (looked for {user}/nojob.toml)" in missing.stderr
    bad_data = run_here(["--training.dataset_path", "nodata.txt"])
    assert bad_data.returncode == 2 and "[rank" not in bad_data.stdout
    assert f"[training] dataset_path: file not found: nodata.txt (looked for {user}/nodata.txt)" in bad_data.stderr
    repo_config = run_here([], config="configs/debug_model.toml")
    assert f"the trainer's folder has one: CONFIG_FILE={REPO}/configs/debug_model.toml" in repo_config.stderr


def test_help_and_print_config():
    help_proc = launch([sys.executable, "train.py", "--help"])
    assert help_proc.returncode == 0 and "--training.steps" in help_proc.stdout
    cfg = launch([sys.executable, "train.py", "--training.steps", "3", "--print-config"])
    assert cfg.returncode == 0 and "steps = 3" in cfg.stdout


@pytest.mark.slow
@pytest.mark.parametrize("schedule, reporter", [("1F1B", 1), ("ZBVZeroBubble", 0)])
def test_pipeline_loss_is_reported_by_the_last_stage_rank(tmp_path, schedule, reporter, launch_tmp):
    """Without LOG_RANK, exactly one rank prints metrics: the one holding the last stage
    (rank 1 for 1F1B's loop placement, rank 0 for ZBV's V placement), and TensorBoard gets the loss."""
    dump = tmp_path / "pp"
    proc = launch(
        ["./run_train.sh", "--job.dump_folder", str(dump), "--training.steps", "3", "--training.local_batch_size", "4",
         "--training.seq_len", "64", "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", schedule, "--profiling.pipeline_timeline_steps", "2",
         "--lr_scheduler.warmup_steps", "5"],
        env={k: v for k, v in {**ENV, "NGPU": "2", **launch_tmp.env}.items() if k != "OMP_NUM_THREADS"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # torchrun's folder of --tee copies (everything was on the console) is gone with the launch
    assert not launch_tmp.left()
    lines = (proc.stdout + proc.stderr).splitlines()
    # A config warning: once per job (not per rank, not by the launcher), labelled; no torchrun OMP banner.
    warned = [line for line in lines if "warmup_steps=5 exceeds [training] steps=3" in line]
    assert len(warned) == 1 and " WARNING trainer.config.validate: " in warned[0], warned
    assert not any("OMP_NUM_THREADS" in line for line in lines)
    step_lines = [line for line in lines if "  loss " in line and "validate step" not in line]
    assert len(step_lines) == 3 and all(line.startswith(f"[rank{reporter}]:") for line in step_lines), step_lines
    # the debug config's [validation] runs after the last step; its line comes from the same rank
    eval_lines = [line for line in lines if "validate step" in line]
    assert len(eval_lines) == 1 and eval_lines[0].startswith(f"[rank{reporter}]:"), eval_lines
    # the measured timeline is merged and announced by the same rank
    timeline = [line for line in lines if "pipeline timeline of step 2" in line]
    assert len(timeline) == 1 and timeline[0].startswith(f"[rank{reporter}]:"), timeline
    assert (dump / "profile_traces" / "pipeline_timeline_step2.svg").is_file()
    events = EventAccumulator(str(tb_run(dump)))
    events.Reload()
    assert len(events.Scalars("loss")) == 3


def test_readme_dry_run_plans_8b_on_64_ranks(tmp_path):
    proc = launch([sys.executable, "train.py", "--job.config_file", "configs/llama3_8b.toml", "--dry-run",
                   "--world-size", "64", "--parallelism.pipeline_parallel_degree", "4", "--training.local_batch_size",
                   "8", "--activation_checkpoint.mode", "full", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert "pp 4 = 64 ranks" in proc.stdout and "1F1B, 4 stages, 1 per rank" in proc.stdout
    # 32 blocks cut into 4 contiguous stages: C(31, 3) splits, few enough to simulate them all
    assert f"exact: all {math.comb(31, 3):,} contiguous splits simulated" in proc.stdout
    # the predicted step's table adds up: every rank is busy or idle for the whole makespan
    lines = proc.stdout.splitlines()
    makespan = float(next(line for line in lines if line.startswith("step (makespan):")).split()[2])
    head = lines.index(next(line for line in lines if line.startswith("pp rank  stages  compute")))
    rows = [line.split() for line in lines[head + 2:head + 6]]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"], rows
    for _, _, compute, idle, bubble in rows:
        assert abs(float(compute) + float(idle) - makespan) < 0.15, (rows, makespan)
        assert abs(float(bubble.rstrip("%")) - 100 * float(idle) / makespan) < 0.1, (rows, makespan)


def test_dry_run_compares_schedules_when_asked(tmp_path):
    args = [sys.executable, "train.py", "--dry-run", "--world-size", "2", "--parallelism.pipeline_parallel_degree",
            "2", "--job.dump_folder", str(tmp_path)]
    proc = launch(args + ["--compare-schedules"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Schedules compared (--compare-schedules)"))
    assert lines[head + 1].split()[:2] == ["schedule", "stages"] and "1F1B (this plan)" in proc.stdout
    # every schedule of the table: a row, or the line saying why not (1F1B's own row is this plan's)
    from trainer.config.schedules import SCHEDULES

    listed = [line.split()[3].rstrip(":") if line.startswith("Cannot run here") else line.split()[0]
              for line in lines[head + 3:] if line.strip()]
    assert sorted(listed) == sorted(SCHEDULES), lines[head:]
    assert "Schedules compared" not in launch(args).stdout  # only when asked: it plans the job once per schedule


def _ctrl_c_default() -> None:
    """In the child: SIGINT handled as in a terminal, even when this suite runs as a background job of a shell
    without job control (which starts it with SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_lone_node_says_it_is_waiting_for_the_others(signum, launch_tmp):
    """NNODES=2 with only one node started: within 15 s it prints that it waits, for how many nodes, where. Then
    stopped while it waits (Ctrl-C to its process group, or a scheduler's SIGTERM to the launcher), it ends at once
    by that signal, with one line and no traceback, and leaves no folder of torchrun's."""
    port = _free_port()
    env = {**ENV, "NNODES": "2", "NGPU": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": "lone", **launch_tmp.env}
    proc = subprocess.Popen(["./run_train.sh", "--training.steps", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=_ctrl_c_default)
    lines = _read_until(proc, lambda line: line.startswith("launcher: waiting for all 2 nodes"), seconds=15)
    if signum == signal.SIGINT:  # Ctrl-C reaches the terminal's whole process group
        os.killpg(proc.pid, signum)
    else:  # a scheduler signals the launcher
        proc.send_signal(signum)
    lines += _rest(proc)
    line = next(x for x in lines if x.startswith("launcher: waiting"))
    assert f"rendezvous at 127.0.0.1:{port} (job id lone)" in line and "start the same command on every node" in line
    assert proc.returncode == -signum, "".join(lines)[-2000:]
    assert lines[-1] == f"launcher: stopped by {signal.Signals(signum).name}\n" and not any(
        "Traceback" in x for x in lines), lines[-20:]
    assert not launch_tmp.left()


BLOCKED_JOIN = """
import sys, types
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from trainer import launch

def join(self):  # a rendezvous stuck inside the store's C++ wait, where Python runs no signal handler
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.wait(["never"], timedelta(seconds=60))

dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous = join
launch.announce_rendezvous(types.SimpleNamespace(nnodes="2", rdzv_endpoint="-", rdzv_id="-", nproc_per_node=1),
                           first=0.5)
try:
    dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous(object())
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_reaches_a_launcher_whose_rendezvous_waits_in_the_store():
    """The lost Ctrl-C: a lone node's rendezvous waits inside a C++ store call, where a Python signal handler
    does not run until the call returns (60 s here; the launcher kept waiting 65 s once). The launcher's main
    thread waits in Python while the join runs in a thread, so the interrupt is taken at once."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_JOIN], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=_ctrl_c_default)
    lines = _read_until(proc, lambda line: line.startswith("launcher: waiting for all 2 nodes"), seconds=30)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    lines += _rest(proc, seconds=20)
    assert "interrupted\n" in lines and time.monotonic() - start < 10, "".join(lines)[-2000:]


@pytest.mark.slow  # two processes
def test_ctrl_c_stops_every_rank_with_one_line_each(tmp_path, launch_tmp):
    """Ctrl-C (SIGINT to the terminal's process group) in a two-rank run: each rank and then the launcher say they
    stopped, in one line each, no traceback, and the launch ends by SIGINT (a shell sees 130), within seconds."""
    start = time.monotonic()
    proc, lines = _interrupted_after_a_step(["./run_train.sh"], tmp_path, {**ENV, "NGPU": "2", **launch_tmp.env})
    assert time.monotonic() - start < 150  # 120 s at most to the first step, then 30 s to stop
    assert proc.returncode == -signal.SIGINT, "".join(lines)[-3000:]
    text = "".join(lines)
    assert "Traceback" not in text, text[-3000:]
    said = [lines.index(f"[rank{rank}]:rank {rank}: interrupted (SIGINT)\n") for rank in (0, 1)]
    assert lines[-1] == "launcher: stopped by SIGINT\n" and max(said) < len(lines) - 1, lines[-10:]
    assert not launch_tmp.left()


def test_ctrl_c_stops_a_run_without_torchrun(tmp_path):
    """``python train.py`` interrupted by Ctrl-C: one line, no traceback, and the process ends by SIGINT (so a
    shell loop of runs stops too)."""
    proc, lines = _interrupted_after_a_step([sys.executable, "train.py"], tmp_path, ENV)
    assert proc.returncode == -signal.SIGINT, "".join(lines)[-3000:]
    assert lines[-1] == "interrupted (SIGINT)\n" and not any("Traceback" in x for x in lines), lines[-10:]


def _interrupted_after_a_step(command: list[str], tmp_path, env: dict) -> tuple[subprocess.Popen, list[str]]:
    """``command`` training the debug model (small windows), Ctrl-C to its process group once a step is logged:
    the ended process and all it printed."""
    proc = subprocess.Popen([*command, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1000",
                             "--training.seq_len", "64", "--training.local_batch_size", "2"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = _read_until(proc, lambda line: " step " in line and "loss" in line, seconds=120)
    os.killpg(proc.pid, signal.SIGINT)
    return proc, lines + _rest(proc, seconds=30)


def _read_until(proc, seen, seconds: float) -> list[str]:
    """The launch's lines up to the first for which ``seen`` holds, read for at most ``seconds``; the launch is
    killed if that line does not come."""
    lines, found = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if seen(line):
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not found.wait(seconds):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        pytest.fail("the line never came:\n" + "".join(lines)[-3000:])
    reader.join(timeout=10)
    return list(lines)


def _rest(proc, seconds: float = 60) -> list[str]:
    """The launch's remaining lines once it ends, within ``seconds`` (else it is killed and the test fails)."""
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the launch did not end within {seconds} s:\n{out[-3000:]}")
    return out.splitlines(keepends=True)


@pytest.mark.slow  # two processes
def test_two_nodes_on_one_machine_reproduce_one_process(tmp_path):
    """Two run_train.sh launches with NNODES=2 (one process each) meet at a localhost c10d
    rendezvous and train FSDP over the two "nodes": the losses are those of one process."""
    from tests.distributed.harness import PARITY
    from trainer.config import load_config
    from trainer.train import main

    dump = tmp_path / "two_nodes"
    args = [*PARITY, "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "--job.dump_folder", str(dump)]
    env = {**ENV, "NNODES": "2", "NGPU": "1", "RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "RDZV_ID": "two-nodes",
           "HF_DATASETS_OFFLINE": "1"}
    nodes = [subprocess.Popen(["./run_train.sh", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(out[-3000:] for out in outputs)
    # one world of two ranks, one in each launch; the reporting rank's launch prints the job line
    assert sum("= 2 ranks" in out for out in outputs) == 1
    # every node's log says which node it is (the non-reporting node's log is not empty)
    assert sorted(next(line for line in out.splitlines() if line.startswith("launcher: node")).split()[2]
                  for out in outputs) == ["0", "1"]
    events = EventAccumulator(str(tb_run(dump)))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]
    one = main(load_config(REPO / "configs" / "debug_model.toml", [*PARITY, "--training.local_batch_size", "8",
                                                                   "--job.dump_folder", str(tmp_path / "one")]))
    assert len(losses) == 3 and losses == pytest.approx(one.losses, rel=1e-5)


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "two"}, "NNODES=two: expected a positive number of nodes"),
    ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=host:port (or MASTER_ADDR and MASTER_PORT)"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "got 'node0'"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "localhost:99999"},
     "RDZV_ENDPOINT=localhost:99999: port 99999 is not a port number"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:0"}, "RDZV_ENDPOINT=127.0.0.1:0: port 0 is not a port number"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "no-such-host.invalid:29500"}, "host 'no-such-host.invalid' cannot be resolved"),
    ({"LOG_RANK": "abc"}, "LOG_RANK=abc: expected comma-separated local ranks"),
    ({"LOG_RANK": "7"}, "LOG_RANK=7: local rank 7 does not exist with NGPU=1 (local ranks 0-0)"),
])
def test_run_train_sh_refuses_bad_launch_variables(env, message):
    clean = {k: v for k, v in ENV.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT")}
    proc = launch(["./run_train.sh"], env={**clean, **env})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {proc.stderr.strip()[7:]}"]
    assert message in proc.stderr
