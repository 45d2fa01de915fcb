"""Python workers (the hspipe package, issue #28) end to end through the launcher: a numpy
target feeding our drafters, numpy drafters training as one group from our targets, a killed
Python worker restarted alone, a killed run resumed from the step its drafters recorded saved, a
poison batch set aside, a batch dropped after its update trained once, the view-lifetime cases,
batches, slots and claims let go of on other threads, misuse of the API, and bad worker commands.

Run by scripts/test.sh (pytest on the wheel it builds); see conftest.py for the run helpers.
"""

import hashlib
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import hspipe

from conftest import (
    BIN,
    PYTHON,
    WATCHDOG_S,
    config_text,
    every_sample_once,
    kill_one_of,
    losses,
    no_segment_of,
    one_model,
    sample_counts,
    script,
    slower_targets,
)

NUMPY_TARGET = [PYTHON, script("examples/numpy_target.py")]
NUMPY_DRAFTER = [PYTHON, script("examples/numpy_drafter.py")]


def test_bf16_helpers_round_float32_to_nearest_even_and_back_exactly():
    # numpy shows a bf16 section as uint16 bit patterns: float32 written into it was cast to
    # integers (0.3 became 0). The helpers convert, rounding as torch does.
    x = np.array([0.3, 1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, np.inf, -np.inf],
                 dtype=np.float32)
    bits = hspipe.bf16_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    # 0.3 is 0x3E99999A: its dropped half rounds up. 1 + 2**-8 is a tie, to even (1.0); 1 +
    # 3 * 2**-8 a tie to even upwards. Past bf16's largest is infinity.
    assert bits.tolist() == [0x3E9A, 0x3F80, 0xC020, 0x3F80, 0x3F82, 0x7F80, 0x7F80, 0xFF80]
    back = hspipe.bf16_to_f32(bits)
    assert back.dtype == np.float32
    assert abs(back[0] - 0.3) < 0.3 * 2**-8
    assert np.isnan(hspipe.bf16_to_f32(hspipe.bf16_bits(np.float32([np.nan])))).all()
    # Every bf16 value comes back as itself.
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(hspipe.bf16_to_f32(every))
    assert (hspipe.bf16_bits(hspipe.bf16_to_f32(every))[finite] == every[finite]).all()


def test_a_numpy_target_feeds_our_drafters_which_verify_every_batch(run):
    code, out = run.launch(config_text(target=NUMPY_TARGET)).finish()
    assert code == 0, out
    no_segment_of(run.proc.pid)
    every_sample_once(run)
    # Our mock drafters check every hidden state and greedy token against the mock target's
    # function: a wrong byte from Python would be a refused batch (and a degraded run).
    s = run.summary()
    assert "refused" not in str(s["notes"]), s
    # The Python targets' `with w.phase("compute")` reached the ring's telemetry.
    for w in s["workers"]:
        if w["role"] == "target" and w["items"] > 0:
            assert w["busy_frac"] > 0, w
    one_model(run.ledgers())


def test_numpy_drafters_learn_from_our_targets_as_one_group(run):
    code, out = run.launch(config_text(drafter=NUMPY_DRAFTER)).finish()
    assert code == 0, out
    every_sample_once(run)
    lines = run.ledgers()
    steps = one_model(lines)
    assert steps < len(lines), f"ranks shared steps: {steps} steps, {len(lines)} batches"
    # The leader (drafter-0) logs the group's loss: it falls.
    ls = losses(run.log("drafter-0"))
    assert len(ls) >= 6, ls
    first, last = sum(ls[:3]) / 3, sum(ls[-3:]) / 3
    assert last < first * 0.8, (first, last)
    # The leader's progress reached the launcher: the summary has the group's last loss.
    assert run.summary()["drafter"]["loss"] < first
    # The leader saved the model at the end, the file of that step alone kept (the earlier
    # ones went once a later step was recorded), and recorded its step for a resume: the
    # weights the last trained batch's line names.
    saved = sorted(run.run_dir.glob("numpy_drafter-*.npz"))
    assert len(saved) == 1, saved
    with np.load(saved[0]) as f:
        step, weights = int(f["step"]), f["weights"]
    assert saved[0].name == f"numpy_drafter-{step}.npz", saved
    assert recorded_step(run) == step
    last = max(lines, key=lambda l: l["step"])
    assert step >= last["step"], (step, last)
    assert hashlib.sha256(weights.tobytes()).hexdigest()[:16] == last["digest"], last


def recorded_step(run):
    """The step the run's drafter recorded saved (`w.checkpointed`), or None."""
    p = run.run_dir / "checkpoints" / "step.json"
    return json.loads(p.read_text())["step"] if p.exists() else None


def pid_gone(pid):
    """Process `pid` exited (gone, or a zombie no one reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def whole_lines(run):
    """The ledgers' lines a kill left whole (a line it cut short is no line)."""
    lines = []
    for d in range(3):
        p = run.run_dir / "ledger" / f"drafter-{d}.jsonl"
        for text in (p.read_text().splitlines() if p.exists() else []):
            try:
                lines.append(json.loads(text))
            except ValueError:
                pass
    return lines


def test_a_killed_numpy_drafter_run_resumes_from_its_saved_step_training_each_batch_once(run):
    # The leader records each step it saves (`w.checkpointed`). The launcher and its workers are
    # SIGKILLed once a step is recorded and the group trained past it; `launcher --resume` goes
    # on from that step: the batches trained up to it keep their lines and are not trained
    # again, those after it are trained once, and the resumed ranks load the weights of that
    # step (`w.resume_step`). Before, the resume started the group at step 0 from the initial
    # weights and trained every batch again.
    run.launch(config_text(slow=True, drafter=NUMPY_DRAFTER, faults=slower_targets()))
    snap = run.wait_ring(
        "a recorded step and a step trained after it",
        lambda s: (recorded_step(run) or 0) >= 3
        and any(l["step"] > recorded_step(run) for l in run.ledgers(live=True)),
    )
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    pids = [w["pid"] for w in snap["workers"]]
    began = time.monotonic()
    while not all(pid_gone(p) for p in pids):
        assert time.monotonic() - began < WATCHDOG_S, "workers outlived their launcher"
        time.sleep(0.01)
    step = recorded_step(run)
    kept = {l["batch_id"]: l for l in whole_lines(run) if l["step"] <= step}
    assert kept, "the saved weights hold some updates"
    saved = [l["digest"] for l in kept.values() if l["step"] == step]

    resumed = subprocess.run(
        [str(BIN / "launcher"), "--resume", str(run.run_dir)],
        capture_output=True, text=True, timeout=WATCHDOG_S,
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert f"from its checkpoint at step {step} (the step its drafter recorded saved" in out, out
    every_sample_once(run)
    lines = run.ledgers()
    for l in lines:
        if l["batch_id"] in kept:
            assert l == kept[l["batch_id"]], f"batch {l['batch_id']} trained again: {l}"
        else:
            assert l["step"] > step, f"batch {l['batch_id']} after the resume at step {l['step']}"
    one_model(lines)
    # Every resumed rank loaded the weights of that step: those its lines name.
    for d in range(3):
        said = [ln for ln in run.log(f"drafter-{d}").splitlines() if ln.startswith("resumed from")]
        assert said and said[-1].startswith(f"resumed from step {step}, weights "), said
        assert said[-1].split()[-1] in saved, (said, saved)


def test_a_python_leaders_skipped_update_is_counted_and_the_ranks_stay_one_model(run):
    """A group sum with a NaN in its gradient (tests/poisons_a_gradient.py, at step 3): the
    example skips that update on every rank alike, so the ranks stay one model, and the leader's
    `progress(..., skipped=True)` reaches the tick's steps and summary.json."""
    poisoning = [PYTHON, script("tests/poisons_a_gradient.py")]
    code, out = run.launch(config_text(drafter=poisoning)).finish()
    assert code == 0, out
    every_sample_once(run)
    one_model(run.ledgers())
    assert run.summary()["drafter"]["updates_skipped"] == 1, run.summary()
    ticks = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [st for t in ticks for st in json.loads(t).get("steps") or []]
    assert [st["step"] for st in steps if st["skipped"]] == [3], steps


def test_python_ranks_whose_weights_drift_apart_end_the_run_degraded(run):
    # Rank 1 records weights of its own from step 3 on (tests/drifts.py). Every sample was
    # trained once, and the run used to end ok with exit code 0: nothing compared the digests
    # README says are equal on every rank. The launcher compares them at the end now.
    drifting = [PYTHON, script("tests/drifts.py")]
    code, out = run.launch(config_text(drafter=drifting)).finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    counts = sample_counts(run.ledgers())
    assert len(counts) == 400 and all(c == 1 for c in counts.values()), "exactly once"
    # The first step at which rank 1 and another rank both have a line.
    steps = {}
    for d in range(3):
        p = run.run_dir / "ledger" / f"drafter-{d}.jsonl"
        steps[d] = {json.loads(l)["step"] for l in p.read_text().splitlines()}
    first = min(st for st in steps[1] if st >= 3 and (st in steps[0] or st in steps[2]))
    s = run.summary()
    assert s["ok"] is False, s
    said = [n for n in s["notes"] if "the drafters' weights differ" in n]
    assert len(said) == 1 and f"from step {first} on" in said[0] and "drafter-1" in said[0], \
        s["notes"]
    assert said[0] in out, out


def test_a_sigkilled_python_drafter_is_restarted_alone_and_rejoins_the_group(run):
    run.launch(config_text(slow=True, drafter=NUMPY_DRAFTER, faults=slower_targets()))
    kill_one_of(run, "drafter-1", signal.SIGKILL)


def test_ctrl_c_gets_through_a_python_drafters_blocking_calls(run):
    # Ctrl-C reaches a drafter blocked in the ring or the group (the interpreter lock is
    # released in slices of 100 ms): KeyboardInterrupt ends it; it is restarted like a crash.
    run.launch(config_text(slow=True, drafter=NUMPY_DRAFTER, faults=slower_targets()))
    log = kill_one_of(run, "drafter-2", signal.SIGINT)
    assert "KeyboardInterrupt" in log, log


def test_a_sigkilled_python_target_is_restarted_alone_and_its_batches_redone(run):
    run.launch(config_text(slow=True, target=[PYTHON, script("tests/slow_target.py")]))
    kill_one_of(run, "target-2", signal.SIGKILL)


def run_cases(run, name, said):
    """Runs tests/`name` as the only target and the only drafter, with no restarts; returns the
    launcher's exit code and output and the cases that held (<run-dir>/`said`), once no worker
    met a panic (pyo3's PanicException, or its words on an object it leaked)."""
    worker = [PYTHON, script(f"tests/{name}")]
    cfg = config_text(target=worker, drafter=worker)
    code, out = run.launch(cfg, "--targets", "0", "--drafters", "1", "--max-restarts", "0").finish()
    no_segment_of(run.proc.pid)
    p = run.run_dir / said
    cases = p.read_text().splitlines() if p.exists() else []
    for role in ["target", "drafter"]:
        log = run.log(f"{role}-0")
        assert "PanicException" not in log and "is unsendable" not in log, log
    return code, out, cases


def test_python_views_are_zero_copy_and_never_outlive_their_slot(run):
    code, out, cases = run_cases(run, "view_lifetimes.py", "view-cases.txt")
    assert code == 0, out
    for case in [
        "bf16 via dlpack",
        "commit with live views names them",
        "read-only sections",
        "commit waits for views to go",
        "no view after commit",
        "a dropped slot is kept while viewed",
        "and given back after",
        "drafter views are read-only",
        "release with live views names them",
        "no view after release",
        "a dropped batch still viewed: take() says why it cannot",
    ]:
        assert case in cases, f"case {case!r} did not hold: {cases}"
    assert run.summary()["ok"] is True


def test_misusing_the_api_gets_a_clear_answer_never_a_panic(run):
    code, out, cases = run_cases(run, "misuse.py", "misuse-cases.txt")
    for case, times in [
        ("a timeout past any clock waits", 2),
        ("a heartbeat handle beats from another thread", 2),
        ("a forked child cannot use the worker", 2),
        ("a state that cannot be handed over is refused at once", 1),
        ("a take() while a batch is held names the batch and release()", 1),
        ("a round leaving out the batch held is refused, naming it", 1),
        ("a release at a step other than its round's is refused", 1),
        ("a release past the group's last step is refused", 1),
        ("a buffer of another dtype is named", 1),
        ("an argument out of range or of a wrong type is named", 3),
        ("a step saved that was not applied is refused", 1),
    ]:
        assert cases.count(case) == times, f"case {case!r} did not hold: {cases}"
    assert code == 0, out
    every_sample_once(run)
    # The loss given without tokens reaches the launcher as such (the monitor weighs it one).
    ticks = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [st for t in ticks for st in json.loads(t).get("steps") or []]
    assert [st for st in steps if st.get("tokens_unknown")] == [
        dict(steps[0], step=0, tokens=0, loss=0.5, tokens_unknown=True)], steps[:3]


def test_batches_slots_and_claims_let_go_of_on_another_thread_go_back_to_their_worker(run):
    # A pool's thread, a DataLoader's or the garbage collector drops the last reference on a
    # thread other than the worker's: the object goes back to the worker's thread, which gives
    # it back. Before, it was leaked with its slot held (pyo3 cannot drop an `unsendable`
    # object on another thread): the drafter's next take() refused, the target's batch was
    # never published. A call that changes one from another thread is refused by name.
    code, out, cases = run_cases(run, "thread_drops.py", "thread-cases.txt")
    for case in [
        "a slot and a claim dropped on another thread are given back",
        "a slot dropped on another thread while viewed is kept, then given back",
        "another thread reads a slot, and its calls that change it are refused",
        "a batch dropped on another thread is given back",
        "a batch dropped on another thread while viewed is kept, then given back",
        "a batch in a cycle the collector frees on another thread is given back",
        "another thread reads a batch, and its calls that change it are refused",
    ]:
        assert case in cases, f"case {case!r} did not hold: {cases}\n{run.log('target-0')}\n" \
            f"{run.log('drafter-0')}"
    assert code == 0, out
    every_sample_once(run)


def poison_batch(run, role, text):
    """A run whose `role` workers (Python, running `text`'s config) raise on the batch holding
    sample 137: each death is held against it, and the third sets it aside. The run ends
    degraded with no worker given up and every other sample trained once."""
    code, out = run.launch(text).finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    s = run.summary()
    assert "gave up" not in str(s["notes"]), s["notes"]
    assert s["batches_set_aside"] == 1, s
    lines = (run.run_dir / "set-aside.jsonl").read_text().splitlines()
    assert len(lines) == 1, lines
    aside = json.loads(lines[0])
    assert 137 in aside["sample_ids"], aside
    assert all("poisoned by sample 137" in d for d in aside["deaths"]), aside
    # Each death was held against it: three, not more (a dying target keeps its claim until
    # the launcher recovers it, so no other target dies on the batch in between).
    assert sum(w["restarts"] for w in s["workers"] if w["role"] == role) == 3, out
    counts = sample_counts(run.ledgers())
    assert set(counts) == set(range(400)) - set(aside["sample_ids"]), sorted(counts)
    assert all(c == 1 for c in counts.values()), counts
    return aside


def test_a_lone_rank_rejoining_an_empty_group_goes_on_from_its_own_step(run):
    # It dies after step 5; restarted, it joins the empty group with join(step=5). Before,
    # the group went back to step 0: the ledger's steps ran 1..5 twice (a resume, which trusts
    # them, would mistake what was trained).
    rank = [PYTHON, script("tests/checkpointed_rank.py")]
    code, out = run.launch(config_text(drafter=rank), "--targets", "0", "--drafters", "1").finish()
    no_segment_of(run.proc.pid)
    assert code == 0, out
    every_sample_once(run)
    steps = [l["step"] for l in run.ledgers()]
    assert len(steps) > 5 and steps == list(range(1, len(steps) + 1)), steps


def test_a_lone_rank_back_from_an_older_checkpoint_records_the_update_lost(run):
    # It keeps its step every 4 steps and dies after step 5: joined with step 4, the group
    # goes on from step 5 (no step twice), step 5's update is recorded lost, and its batch
    # counts untrained (the run ends degraded; a resume trains it).
    rank = [PYTHON, script("tests/checkpointed_rank.py"), "every4"]
    code, out = run.launch(config_text(drafter=rank), "--targets", "0", "--drafters", "1").finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    lost = [json.loads(l) for l in (run.run_dir / "lost-steps.jsonl").read_text().splitlines()]
    assert lost == [{"first": 5, "last": 5, "rank": 0}], lost
    steps = [l["step"] for l in run.ledgers()]
    assert len(steps) == len(set(steps)), steps
    s = run.summary()
    assert s["batches_lost"] == steps.count(5) == 1, s
    assert "whose updates were lost" in str(s["notes"]), s


@pytest.mark.parametrize("mode,drafters", [("at_end", "1"), ("leader_at_end", "1,2")])
def test_a_rank_back_alone_after_the_last_batch_with_no_checkpoint_records_it_all_lost(
        run, mode, drafters):
    # Every batch is trained and nothing saved (the script saves only at its end round). A
    # lone rank dies at the end round, before it commits; or the leader of two dies once the end
    # round committed, before its save, and the other finishes. Restarted, the rank finds no
    # checkpoint and joins the empty group with none. The drained ring was taken for "the others
    # finished and saved the model": nothing was recorded, and the run ended done with the
    # initial weights saved as its model.
    rank = [PYTHON, script("tests/checkpointed_rank.py"), mode]
    code, out = run.launch(config_text(drafter=rank), "--targets", "0", "--drafters",
                           drafters).finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    steps = [l["step"] for l in run.ledgers()]
    lost = [json.loads(l) for l in (run.run_dir / "lost-steps.jsonl").read_text().splitlines()]
    assert len(lost) == 1 and lost[0]["first"] == 1 and lost[0]["rank"] == 0, lost
    assert lost[0]["last"] >= max(steps), (lost, steps)
    s = run.summary()
    assert s["batches_lost"] == len(steps) and s["batches_trained"] == 0, s


def test_a_batch_that_kills_every_python_drafter_is_set_aside(run):
    # Each rank raises when it takes the batch holding sample 137: an exception on a batch in
    # hand (from take() to release()) is a death held against it; the third sets it aside.
    poison = [PYTHON, script("tests/poisoned.py")]
    aside = poison_batch(run, "drafter", config_text(drafter=poison))
    assert aside["ticket"] is not None, aside


def test_python_ranks_reducing_buffers_of_different_lengths_are_refused_on_every_rank(run):
    # Rank 1 reduces 26 floats, ranks 0 and 2 reduce 18: the sum used to add misaligned parts
    # and every rank went on (exit 0). Now every rank's all_reduce raises, naming the lengths.
    uneven = [PYTHON, script("tests/uneven_reduce.py")]
    code, out = run.launch(config_text(drafter=uneven), "--max-restarts", "0").finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    said = ("HspipeError: all_reduce: the ranks reduced buffers of different lengths (rank 0: "
            "18, rank 1: 26, rank 2: 18 floats)")
    for r in range(3):
        log = run.log(f"drafter-{r}")
        assert said in log, log
    # The round committed and no rank applied it: its step is recorded left out, so its batches
    # count untrained (they counted trained, and a resume never trained them).
    lost = [json.loads(l) for l in (run.run_dir / "lost-steps.jsonl").read_text().splitlines()]
    assert lost and all(l["skipped"] for l in lost), lost
    s = run.summary()
    assert s["batches_lost"] >= 1 and s["batches_trained"] == 0, s


def a_drafter_dropping_an_applied_batch(run, how):
    """A run whose drafters let go of the batch holding sample 137 after its update was applied
    (tests/drops_applied.py, `how`); returns the summary once that batch was trained once, at
    the step that applied it, and every other sample once."""
    dropping = [PYTHON, script("tests/drops_applied.py"), how]
    code, out = run.launch(config_text(drafter=dropping)).finish()
    no_segment_of(run.proc.pid)
    assert code == 0, out
    batch, step = map(int, (run.run_dir / "dropped-applied").read_text().split())
    lines = [l for l in run.ledgers() if l["batch_id"] == batch]
    # Given back, it was delivered again and trained a second time: a line of delivery 1 at a
    # later step.
    assert [(l["step"], l["delivery"]) for l in lines] == [(step, 0)], lines
    every_sample_once(run)
    one_model(run.ledgers())
    return run.summary()


def test_a_python_drafter_dropping_an_applied_batch_records_it_trained(run):
    a_drafter_dropping_an_applied_batch(run, "drop")


def test_a_python_drafter_raising_after_an_update_has_its_batch_trained_once(run):
    s = a_drafter_dropping_an_applied_batch(run, "raise")
    assert sum(w["restarts"] for w in s["workers"]) == 1, s


def test_a_rank_dying_after_a_loss_round_has_its_applied_batch_trained_once(run):
    # A round with no batch (the loss reduced for the log) came between the batch's update
    # and the death: the launcher, told only of that last round, gave the batch back and a
    # live rank trained it a second time.
    s = a_drafter_dropping_an_applied_batch(run, "loss")
    assert sum(w["restarts"] for w in s["workers"]) == 1, s
    assert "whose update the group applied" in run.output(), s


def test_a_batch_dropped_while_viewed_is_settled_when_the_drafter_goes(run):
    # Kept while its view lives, to the end of the process: it used to be freed there as if
    # released, with no ledger line (its samples never trained, the run degraded).
    s = a_drafter_dropping_an_applied_batch(run, "viewed")
    assert sum(w["restarts"] for w in s["workers"]) == 1, s


def interrupted_round(run, how):
    """A run where rank 1 is interrupted (SIGINT) in a round it contributed its batch to, and
    rank 0 arrives only then, so the round commits with it (tests/interrupted_round.py,
    `how`). Checks the batch was trained once, at that round's step, as one model; returns
    that step, what rank 1 wrote after the batch and the step, and the summary."""
    interrupted = [PYTHON, script("tests/interrupted_round.py"), how]
    code, out = run.launch(config_text(drafter=interrupted)).finish()
    no_segment_of(run.proc.pid)
    assert code == 0, out
    batch, target, said = (run.run_dir / "interrupted").read_text().split(" ", 2)
    lines = [l for l in run.ledgers() if l["batch_id"] == int(batch)]
    assert [(l["step"], l["delivery"]) for l in lines] == [(int(target), 0)], lines
    every_sample_once(run)
    one_model(run.ledgers())
    return int(target), said.strip(), run.summary()


def test_a_batch_whose_round_ctrl_c_interrupted_is_trained_once(run):
    # The batch, dropped, stays held while the round is undecided (it used to go back to the
    # ring at once, for a live rank to train again), then gets its ledger line.
    _, said, _ = interrupted_round(run, "drop")
    assert said.split() == ["1", "1"], "kept while undecided, then counted trained"
    assert "KeyboardInterrupt" in run.log("drafter-1")


def test_an_all_reduce_after_ctrl_c_finishes_the_round_left_open(run):
    # Called again with the same data, it finishes that very round, with its sum.
    target, said, s = interrupted_round(run, "retry")
    assert sum(w["restarts"] for w in s["workers"]) == 0, s
    assert said == str(target), f"the call finished the round of step {said}, not {target}"


def test_an_all_reduce_after_the_round_left_was_committed_is_an_error(run):
    # The round committed without this rank getting its sum: going on would train with
    # weights behind the group's (and, before, apply the batch a second time).
    _, said, s = interrupted_round(run, "late")
    assert "weights are behind the group's" in said, said
    assert sum(w["restarts"] for w in s["workers"]) == 1, s


def test_a_batch_that_kills_every_python_target_is_set_aside(run):
    # Each target raises when it claims the batch holding sample 137: a claim is in hand until
    # its commit, so the death is held against it and the third sets it aside, never published.
    poison = [PYTHON, script("tests/poisoned.py")]
    aside = poison_batch(run, "target", config_text(target=poison))
    assert aside["ticket"] is None, aside
    # The first claim was fresh; each later one says a target died with the batch.
    claims = (run.run_dir / "poison-claims").read_text().split()
    assert claims == ["False", "True", "True"], claims


def test_a_python_target_that_raises_is_restarted_and_claims_work_again(run):
    # The only target raises once, in its forward of its second batch. Before, leaving `with`
    # on the exception finished the target for good: its restart claimed nothing, the ring
    # closed and the run ended with most of its data untrained.
    raising = [PYTHON, script("tests/raise_once_target.py")]
    text = config_text(target=raising)
    code, out = run.launch(text, "--targets", "0", "--drafters", "1").finish()
    no_segment_of(run.proc.pid)
    assert code == 0, out
    assert "raised once" in run.log("target-0"), out
    assert run.summary()["workers"][0]["restarts"] == 1, out
    every_sample_once(run)


def test_a_python_target_that_never_commits_fails_loudly_instead_of_spinning(run):
    # Its slots, dropped without commit(), went back to the work table and the target claimed
    # the same batches again for ever (about 1,800 claims in 8 s), with no message: the run
    # never ended, and its heartbeats kept the hang check quiet. Now the drop is a WARN naming
    # the batch, and the next claim raises: the worker dies with the reason, and the restart
    # limit ends the run.
    forgets = [PYTHON, script("tests/forgets_commit.py")]
    code, out = run.launch(config_text(target=forgets), "--targets", "0", "--drafters", "1",
                           "--max-restarts", "0").finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    log = run.log("target-0")
    assert "WARN" in log and "the slot of batch" in log, log
    assert "HspipeError: the slot of batch" in log, log
    assert "dropped without commit() or abort()" in log, log
    assert "target-0 gave up after 0 restart(s)" in str(run.summary()["notes"]), out


def a_target_exiting(run, how):
    """A run whose only target ends with sys.exit(0) (`how`: inside `with`, or with no `with`
    and no close()); returns the launcher's exit code and notes once every sample was trained
    once."""
    target = [PYTHON, script("tests/exits_cleanly.py"), how]
    text = config_text(target=target)
    code, out = run.launch(text, "--targets", "0", "--drafters", "1").finish()
    no_segment_of(run.proc.pid)
    counts = sample_counts(run.ledgers())
    assert sorted(counts) == list(range(400)), out
    assert all(c == 1 for c in counts.values()), counts
    return code, str(run.summary()["notes"])


def test_a_python_target_leaving_with_by_sys_exit_0_finishes(run):
    # SystemExit(0) is a clean exit: leaving `with` by it finishes the target (treated as a
    # failure, it left the ring open and the run hung).
    assert a_target_exiting(run, "with") == (0, "[]")


def test_a_python_target_that_never_closes_is_retired_so_the_ring_closes(run):
    # With no close(), the target never counted itself finished: the ring stayed open and
    # the drafters waited for ever. The launcher now retires a target that exits so, and says
    # so (a note: the run is degraded, though everything was trained).
    code, notes = a_target_exiting(run, "bare")
    assert code == 3, notes
    assert "target-0 exited (exit status: 0) without finishing" in notes


def bad_drafter_command(run, argv, log_says):
    """A drafter command that fails is restarted up to the limit, then given up; every drafter
    runs it, so the run ends degraded (exit 3) with nothing left behind."""
    code, out = run.launch(config_text(drafter=argv), "--max-restarts", "1").finish()
    no_segment_of(run.proc.pid)
    assert code == 3, out
    s = run.summary()
    assert s["ok"] is False
    assert "drafter-1 gave up after 1 restart(s)" in str(s["notes"]), s["notes"]
    log = run.log("drafter-1")
    assert log_says in log, log
    assert log.count("--- launcher: starting") == 2, log


def test_a_missing_worker_script_is_restarted_to_the_limit_then_given_up(run):
    bad_drafter_command(run, [PYTHON, "/nonexistent/worker.py"], "No such file")


def test_a_worker_that_exits_at_once_is_restarted_to_the_limit_then_given_up(run):
    bad_drafter_command(run, [PYTHON, "-c", "import sys; sys.exit(5)"], "starting")


def test_a_worker_that_claims_another_name_is_refused_in_the_handshake(run):
    lie = "import os, hspipe; os.environ['HSPIPE_WORKER'] = 'target-7'; hspipe.connect()"
    bad_drafter_command(run, [PYTHON, "-c", lie], "expected drafter-1 speaking protocol")


def test_a_worker_program_that_does_not_exist_is_an_error_before_the_run(run):
    code, out = run.launch(config_text(drafter=["no-such-program-hspipe"])).finish()
    no_segment_of(run.proc.pid)
    assert code == 1, out
    assert '[drafter] command: no program "no-such-program-hspipe" on PATH' in out, out


def test_a_python_worker_resumed_from_another_directory_runs_in_the_run_and_its_directory(tmp_path):
    # A command runs in the directory the run started from (`command_dir`), whatever directory
    # a resume runs in, and is told the run directory as an absolute path: given relative, it
    # would name another place from there (and a Python drafter writes its ledger there).
    record = tmp_path / "seen.txt"
    body = (
        "import os, sys, hspipe; w = hspipe.connect(); "
        f"open({str(record)!r}, 'a').write(os.getcwd() + ' ' + str(w.run_dir) + '\\n'); sys.exit(1)"
    )
    (tmp_path / "test.toml").write_text(config_text(target=[PYTHON, "-c", body]))

    def launch(cwd, *args):
        got = subprocess.run(
            [str(BIN / "launcher"), *args, "--max-restarts", "0"],
            cwd=cwd, capture_output=True, text=True, timeout=WATCHDOG_S,
        )
        return got.returncode, got.stdout + got.stderr

    code, out = launch(tmp_path, "--config", "test.toml", "--run-dir", "run",
                       "--targets", "0", "--drafters", "1")
    assert code == 3, out
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out = launch(elsewhere, "--resume", "../run")
    assert code == 3, out
    seen = [line.split(" ") for line in record.read_text().splitlines()]
    assert len(seen) == 2, seen
    for cwd, run_dir in seen:
        assert os.path.samefile(cwd, tmp_path), seen
        assert os.path.isabs(run_dir) and os.path.samefile(run_dir, tmp_path / "run"), seen


def test_a_failed_handshake_may_be_tried_again_and_ctrl_c_ends_one_that_waits():
    """A handshake that failed registered nothing: a second connect() tries again (it said
    "connected already"). A launcher that never answers: Ctrl-C ends the wait at once (it
    waited out the handshake's 30 s first)."""
    import socket

    env = dict(os.environ, HSPIPE_WORKER="drafter-0")
    env["HSPIPE_CONTROL"] = f"hspipe-test-nobody-{os.getpid()}"
    twice = (
        "import hspipe\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        hspipe.connect()\n"
        "    except hspipe.HspipeError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run([PYTHON, "-c", twice], env=env, capture_output=True, text=True,
                         timeout=WATCHDOG_S)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("handshake with the launcher" in l for l in lines), out

    name = f"hspipe-test-silent-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind("\0" + name)
        srv.listen(1)
        srv.settimeout(WATCHDOG_S)
        waits = (
            "import hspipe\n"
            "try:\n"
            "    hspipe.connect()\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n"
        )
        p = subprocess.Popen([PYTHON, "-c", waits], env=dict(env, HSPIPE_CONTROL=name),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = srv.accept()  # connected: the handshake waits for the launcher's answer
            with conn:
                conn.recv(1)  # its hello has begun: it is waiting
                p.send_signal(signal.SIGINT)
                # A hang check below the handshake's own 30 s timeout, not a speed figure.
                out, err = p.communicate(timeout=20)
        finally:
            p.kill()
            p.wait()
    assert out.strip() == "interrupted", (out, err)
