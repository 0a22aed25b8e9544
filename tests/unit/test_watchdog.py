"""The watchdog ends a rank that makes no progress, with one line naming the key, and not one that does."""

import subprocess
import sys
import time

from tests.distributed.harness import REPO

SCRIPT = """
import sys, time
from trainer.watchdog import Watchdog
dog = Watchdog(60, rank=3)
dog.arm(float(sys.argv[1]), "[comm] init_timeout_seconds")
beats = int(sys.argv[2])
for _ in range(beats):  # progress every 0.1 s: alive past the timeout
    time.sleep(0.1)
    dog.beat()
if beats:
    dog.stop()
    print("finished")
else:
    time.sleep(30)  # a stuck rank: only the watchdog ends it
"""


def run(timeout: float, beats: int) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(timeout), str(beats)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    return proc, time.monotonic() - start


def test_a_rank_without_progress_ends_at_the_timeout_with_one_line_naming_the_key():
    proc, elapsed = run(0.5, 0)
    assert proc.returncode == 1 and elapsed < 20  # not the 30 s sleep: the watchdog ended it
    assert proc.stderr.strip() == ("error: rank 3: no training progress for 0.5 s (a peer rank is probably stuck or"
                                   " dead); raise [comm] init_timeout_seconds if a step legitimately takes longer")


def test_progress_keeps_the_rank_alive_past_the_timeout():
    proc, _ = run(0.5, 12)  # 1.2 s of beats every 0.1 s
    assert proc.returncode == 0 and proc.stdout.strip() == "finished", proc.stderr


PAUSED = """
import time
from trainer.watchdog import Watchdog
dog = Watchdog(60, rank=0)
dog.arm(0.5)
with dog.paused():  # a checkpoint save: three timeouts long, without progress
    time.sleep(1.5)
time.sleep(0.2)  # armed again, with the clock restarted at the end of the pause
dog.stop()
print("finished")
"""


def test_a_pause_holds_the_watchdog_and_restarts_its_clock():
    proc = subprocess.run([sys.executable, "-c", PAUSED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "finished", proc.stderr
