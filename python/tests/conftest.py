"""What the hspipe package's tests share: a run of the real launcher with Python workers, its
files (ledgers, summary, logs), the ring's live state through `shm-ring-stat --json`, and the
checks every run must pass (every sample once, one model across the ranks).

The launcher and shm-ring-stat are the workspace's debug builds (`HSPIPE_BIN_DIR` to use
others); the workers run this interpreter, which has the built wheel (scripts/test.sh installs
it with scripts/py/build-wheel.sh). Every wait has a watchdog: a hang fails the test, never CI.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("HSPIPE_BIN_DIR", ROOT / "target" / "debug"))
PYTHON = sys.executable
# A run's watchdog: far above a run's few seconds to a minute on a loaded 2-core machine.
WATCHDOG_S = 600


def script(rel):
    """A path under python/ (examples/..., tests/...)."""
    return str(ROOT / "python" / rel)


def command(argv):
    return "command = [" + ", ".join(json.dumps(a) for a in argv) + "]"


def config_text(slow=False, target=None, drafter=None, extra_drafter="", faults=""):
    """The launcher tests' config: 400 samples (~35 batches of 2 layers x 16), mock targets
    and drafters unless `target`/`drafter` (argv lists) say otherwise. `slow`: the targets
    run at 8,000 tokens/s, so a test can act mid-run."""
    speed = 8_000.0 if slow else 2_000_000.0
    return f"""
[ring]
slots = 24
min_ready = 4
[model]
layers = 2
hidden = 16
[data]
synthetic_samples = 400
min_len = 16
max_len = 512
[target]
token_budget = 2048
tokens_per_s = {speed:.1f}
{command(target) if target else ""}
[drafter]
tokens_per_s = {speed:.1f}
checkpoint_every = 3
params = 64
{command(drafter) if drafter else ""}
{extra_drafter}
{faults}
"""


def slower_targets():
    """Faults making every target four times slower still: a restarted Python rank
    (interpreter and numpy start-up, on a loaded machine) comes back while batches remain."""
    return "".join(f"[faults.target-{i}]\nslow = 4.0\n" for i in range(5))


class Run:
    """One launcher run in a test's own directory."""

    def __init__(self, dir):
        self.dir = Path(dir)
        self.run_dir = self.dir / "run"
        self.proc = None
        self.out = None

    def launch(self, config, *args):
        cfg = self.dir / "test.toml"
        cfg.write_text(config)
        self.out = open(self.dir / "launcher.out", "w+")
        argv = [str(BIN / "launcher"), "--config", str(cfg), "--run-dir", str(self.run_dir)]
        if not any(a.startswith("--targets") for a in args):
            argv += ["--targets", "0-4", "--drafters", "5-7"]
        argv += list(args)
        self.proc = subprocess.Popen(
            argv, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def finish(self):
        """Waits for the launcher (watchdog: kills its whole session and fails); returns
        (exit code, everything it printed)."""
        try:
            code = self.proc.wait(timeout=WATCHDOG_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"watchdog: the launcher ran past {WATCHDOG_S} s:\n{self.output()}")
        return code, self.output()

    def output(self):
        self.out.flush()
        return (self.dir / "launcher.out").read_text()

    def summary(self):
        return json.loads((self.run_dir / "summary.json").read_text())

    def log(self, worker):
        return (self.run_dir / "logs" / f"{worker}.log").read_text()

    def ledgers(self, live=False):
        """Every drafter's ledger lines. `live`: read while the run writes them, so a line
        being written (no newline yet) is left out."""
        lines = []
        for d in range(3):
            p = self.run_dir / "ledger" / f"drafter-{d}.jsonl"
            if p.exists():
                text = p.read_text()
                if live:
                    text = text[: text.rfind("\n") + 1]
                lines += [json.loads(l) for l in text.splitlines() if l.strip()]
        return lines

    def ring(self):
        """The ring's live state (`shm-ring-stat --json`), or None before it exists."""
        got = subprocess.run(
            [str(BIN / "shm-ring-stat"), "--run-dir", str(self.run_dir), "--json",
             "--interval", "0.05"],
            capture_output=True, text=True, timeout=60,
        )
        if got.returncode != 0:
            return None
        return json.loads(got.stdout)["snapshot"]

    def wait_ring(self, what, pred):
        began = time.monotonic()
        while time.monotonic() - began < WATCHDOG_S:
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher ended before {what}:\n{self.output()}")
            snap = self.ring()
            if snap is not None and pred(snap):
                return snap
            time.sleep(0.1)
        os.killpg(self.proc.pid, signal.SIGKILL)
        pytest.fail(f"watchdog: no {what} in {WATCHDOG_S} s")


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    if r.proc is not None and r.proc.poll() is None:
        os.killpg(r.proc.pid, signal.SIGKILL)
        r.proc.wait()
    if r.out is not None:
        r.out.close()


def worker_name(w):
    """`target-3`, `drafter-1`: from a summary's worker or a ring snapshot's (producer/consumer)."""
    role = {"producer": "target", "consumer": "drafter"}.get(w["role"], w["role"])
    return f"{role}-{w['index']}"


def sample_counts(lines):
    return collections.Counter(i for l in lines for i in l["sample_ids"])


def every_sample_once(run):
    s = run.summary()
    assert s["ok"] is True, s
    counts = sample_counts(run.ledgers())
    assert len(counts) == 400, "every sample trained"
    assert all(c == 1 for c in counts.values()), "a sample trained twice"


def one_model(lines):
    """Every rank recorded the same weights digest at every group step; returns the steps."""
    by_step = collections.defaultdict(list)
    for l in lines:
        by_step[l["step"]].append(l)
    for step, ls in by_step.items():
        digests = {l["digest"] for l in ls if l["digest"]}
        assert len(digests) == 1, f"step {step}: digests differ or none: {ls}"
    return len(by_step)


def losses(log):
    """The leader's logged losses (`step N loss X ...` lines)."""
    out = []
    for line in log.splitlines():
        if line.startswith("step ") and " loss " in line:
            out.append(float(line.split(" loss ")[1].split()[0]))
    return out


def kill_one_of(run, victim, sig, trained=0):
    """Sends `sig` to worker `victim` once every worker is live, 3 batches are published and
    `trained` batches are in the ledgers (the group is stepping); checks that only it was
    restarted and the run still trained every sample once as one model. Returns the victim's
    log."""
    before = run.wait_ring(
        f"8 live workers, 3 batches published and {trained} trained",
        lambda s: all(w["alive"] for w in s["workers"])
        and s["counters"]["published"] >= 3
        and len(run.ledgers(live=True)) >= trained,
    )
    pids = {worker_name(w): w["pid"] for w in before["workers"]}
    os.kill(pids[victim], sig)
    code, out = run.finish()
    assert code == 0, out
    s = run.summary()
    assert s["ok"] is True, s
    for w in s["workers"]:
        want = 1 if worker_name(w) == victim else 0
        assert w["restarts"] == want, (worker_name(w), s)
    counts = sample_counts(run.ledgers())
    assert len(counts) == 400 and all(c == 1 for c in counts.values()), "exactly once"
    one_model(run.ledgers())
    log = run.log(victim)
    if victim.startswith("drafter"):
        assert "joined the group" in log, log
    return log


def no_segment_of(pid):
    """The launcher `pid` left nothing in /dev/shm (its ring and group end in `-<pid>`)."""
    left = [n for n in os.listdir("/dev/shm") if n.startswith("hspipe-") and n.endswith(f"-{pid}")]
    assert not left, f"segments left behind: {left}"
