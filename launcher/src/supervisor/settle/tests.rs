//! The poison rule's judgements (`Strikes`): which deaths count, and when they set a batch
//! aside.

use super::*;

fn signalled(sig: rustix::process::Signal) -> ExitStatus {
    ExitStatus::from_raw(sig.as_raw())
}

fn exited(code: i32) -> ExitStatus {
    ExitStatus::from_raw(code << 8)
}

#[test]
fn a_workers_own_failure_or_hang_counts_a_signal_from_outside_does_not() {
    use rustix::process::Signal;
    assert!(Strikes::counts(exited(1), false), "an error");
    assert!(
        Strikes::counts(exited(134), false),
        "an abort, through a shell"
    );
    assert!(
        Strikes::counts(signalled(Signal::ABORT), false),
        "a panic's abort"
    );
    assert!(Strikes::counts(signalled(Signal::SEGV), false));
    assert!(
        !Strikes::counts(signalled(Signal::KILL), false),
        "the OOM killer, a person"
    );
    assert!(
        !Strikes::counts(exited(137), false),
        "the same, through a shell"
    );
    assert!(
        Strikes::counts(signalled(Signal::KILL), true),
        "ours, for a hang"
    );
    assert!(
        !Strikes::counts(signalled(Signal::INT), false),
        "Ctrl-C in Python"
    );
    assert!(!Strikes::counts(signalled(Signal::TERM), false));
    assert!(
        !Strikes::counts(exited(130), false),
        "a shell's code for SIGINT"
    );
}

/// A death against batch `batch` by `drafter`, after it trained (since its start) or not,
/// with `trained` batches trained in the run.
fn death(batch: u64, drafter: u32, after_work: bool, trained: u64) -> Struck {
    Struck {
        batch,
        line: format!("drafter-{drafter} died"),
        worker: WorkerName::consumer(drafter),
        after_work,
        finished: trained,
    }
}

#[test]
fn a_batch_is_set_aside_at_the_limit_while_others_train_and_never_at_0() {
    use Verdict::*;
    let mut s = Strikes::new(3);
    assert_eq!(s.strike(death(7, 0, false, 10)), (1, Counting));
    assert_eq!(
        s.strike(death(8, 1, false, 10)),
        (1, Counting),
        "another batch apart"
    );
    assert_eq!(s.strike(death(7, 1, false, 12)), (2, Counting));
    assert_eq!(
        s.strike(death(7, 2, false, 14)),
        (3, SetAside),
        "others trained around it"
    );
    assert_eq!(s.lines(Role::Consumer, 7).len(), 3);
    s.settled(Role::Consumer, 7);
    assert_eq!(
        s.strike(death(7, 0, false, 20)),
        (0, SetAsideAlready),
        "a death before the set-aside, recovered after"
    );
    assert_eq!(
        s.strike(Struck {
            worker: WorkerName::producer(0),
            ..death(7, 0, false, 20)
        }),
        (1, Counting),
        "the other side's batch 7 is another"
    );
    let mut never = Strikes::new(0);
    assert!((0..10).all(|i| never.strike(death(1, i % 3, true, i.into())).1 == Counting));
}

#[test]
fn workers_that_finish_nothing_set_nothing_aside_workers_that_worked_do() {
    use Verdict::*;
    // One drafter dying at its first batch, the same batch each time (FIFO).
    let mut s = Strikes::new(3);
    assert_eq!(s.strike(death(7, 0, false, 0)), (1, Counting));
    assert_eq!(s.strike(death(7, 0, false, 0)), (2, Counting));
    assert_eq!(s.strike(death(7, 0, false, 0)), (3, NoEvidence));
    // Three drafters all failing on every batch: nothing trained between their deaths.
    let mut s = Strikes::new(3);
    for (n, d) in [(1, Counting), (2, Counting), (3, NoEvidence)]
        .into_iter()
        .zip(0..)
    {
        assert_eq!(s.strike(death(7, d, d == 0, 5)), n, "drafter {d}");
    }
    // One target whose GPU broke, re-claiming the same returned batch at each restart while
    // the others publish around it: a crash loop, not the batch's doing.
    let mut s = Strikes::new(3);
    let broken = |published| Struck {
        worker: WorkerName::producer(2),
        ..death(7, 0, false, published)
    };
    assert_eq!(s.strike(broken(0)), (1, Counting));
    assert_eq!(s.strike(broken(5)), (2, Counting));
    assert_eq!(s.strike(broken(9)), (3, NoEvidence));
    // Drafters that trained earlier and broke (each restart dies at once): the deaths of
    // their restarts are no evidence, however much they trained before.
    let mut s = Strikes::new(3);
    assert_eq!(s.strike(death(7, 0, true, 13)), (1, Counting));
    assert_eq!(s.strike(death(7, 1, false, 13)), (2, Counting));
    assert_eq!(s.strike(death(7, 2, false, 13)), (3, NoEvidence));
    // A lone drafter that trained, then dies on it at each restart.
    let mut s = Strikes::new(3);
    assert_eq!(s.strike(death(7, 0, true, 13)), (1, Counting));
    assert_eq!(s.strike(death(7, 0, false, 13)), (2, Counting));
    assert_eq!(s.strike(death(7, 0, false, 13)), (3, SetAside));
    // Targets that each published dying on the batch in turn when nothing else is left to
    // publish (the first restarted, dying on it again).
    let mut s = Strikes::new(3);
    for (t, worked, n) in [
        (0, true, (1, Counting)),
        (1, true, (2, Counting)),
        (0, false, (3, SetAside)),
    ] {
        let d = Struck {
            worker: WorkerName::producer(t),
            ..death(7, 0, worked, 30)
        };
        assert_eq!(s.strike(d), n, "target {t}");
    }
    // The same batch number at the other stage is another batch's count.
    assert_eq!(s.strike(death(7, 0, true, 30)), (1, Counting));
}

/// A worker that dies after some work each time, another batch in hand at each death: the
/// deaths held against batches long trained are forgotten past [`REMEMBERED`] batches (the
/// launcher's memory grew by a KB per such restart, for ever), while a batch that keeps killing
/// is remembered and set aside as before.
#[test]
fn strikes_against_many_batches_are_bounded_and_a_poison_batch_is_still_set_aside() {
    use Verdict::*;
    let mut s = Strikes::new(3);
    for b in 0..2 * REMEMBERED as u64 {
        assert_eq!(s.strike(death(b, 0, true, b)), (1, Counting));
        assert!(
            s.remembered() <= REMEMBERED,
            "{} at batch {b}",
            s.remembered()
        );
    }
    assert_eq!(s.remembered(), REMEMBERED);
    assert!(
        s.lines(Role::Consumer, 0).is_empty(),
        "the oldest forgotten"
    );
    let last = 2 * REMEMBERED as u64 - 1;
    assert_eq!(s.lines(Role::Consumer, last).len(), 1, "the newest kept");
    let poison = 10 * REMEMBERED as u64;
    assert_eq!(s.strike(death(poison, 0, true, 1)), (1, Counting));
    assert_eq!(s.strike(death(poison + 1, 1, true, 2)), (1, Counting));
    assert_eq!(s.strike(death(poison, 1, true, 3)), (2, Counting));
    assert_eq!(s.strike(death(poison, 2, true, 4)), (3, SetAside));
}
