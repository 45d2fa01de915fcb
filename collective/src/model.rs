//! Models of the group protocol on heap memory: under `--cfg loom` every interleaving of the
//! ranks and the launcher is explored (`RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2
//! cargo test -p collective --release --lib model`); without it the same models run once as
//! plain threaded tests.
//!
//! What they check: a membership change during a reduction never splits the outcome (the
//! launcher's verdict on the dead rank's batch matches what the survivor applied), a joiner
//! receives the leader's state before it contributes, and a rank joining a group emptied after
//! its end round reads that the round applied nothing. Checked by hand when they were written:
//! treating a commit seen after an epoch change as an abort (`now.epoch == w.epoch &&` in the
//! commit test) fails the first model, and a Relaxed `arrived` store/load pair fails the first
//! and the third (a sum or a state read without the stores it needs).

use crate::group::{Ended, HeapMem, Membership, Memory, Protocol, NO_BATCH};
use crate::GroupError;

#[cfg(loom)]
use loom::{sync::Arc, thread};
#[cfg(not(loom))]
use std::{sync::Arc, thread};

#[cfg(loom)]
fn model(f: impl Fn() + Sync + Send + 'static) {
    loom::model(f);
}
#[cfg(not(loom))]
fn model(f: impl Fn() + Sync + Send + 'static) {
    // Without loom, repeat to see a few interleavings at least.
    for _ in 0..200 {
        f();
    }
}

fn group(ranks: u32, members: u16, state_len: usize) -> Arc<Protocol<HeapMem>> {
    Arc::new(Protocol {
        mem: HeapMem::new(
            ranks,
            1,
            state_len,
            Membership {
                epoch: 1,
                step: 0,
                members,
            },
        ),
    })
}

/// Rank 1 contributes its batch and dies at any point after (its `stop` says yes at its first
/// wait); the launcher removes it once it is gone; rank 0 reduces. Whatever the order: if the
/// launcher is told rank 1's batch is in an applied update, rank 0's update included it, and if
/// not, rank 0's update is its own alone — never both, never neither; and it is shown that
/// batch before the removal lets rank 0 go on. Fails if the commit check and the epoch check are
/// not one word (as in a design with a separate commit flag).
#[test]
fn a_rank_dying_in_the_reduction_gives_one_outcome_that_the_launcher_knows() {
    model(|| {
        let g = group(2, 0b11, 0);
        let g1 = g.clone();
        let dead = thread::spawn(move || {
            let mut out = [0.0];
            let _ = g1.all_reduce(1, &[2.0], 11, &mut out, &|| true);
        });
        let g0 = g.clone();
        let survivor = thread::spawn(move || {
            let mut out = [0.0];
            let r = g0.all_reduce(0, &[1.0], 10, &mut out, &|| false).unwrap();
            (out[0], r.membership.members)
        });
        dead.join().unwrap();
        // The launcher is shown the applied batch while rank 1 is still a member: before the
        // survivor can go on past that round (and checkpoint it).
        let mut shown = Vec::new();
        let removed = (g.remove_settling(1, &mut |c| {
            shown.push((c.batch, g.membership().contains(1)));
        }))
        .unwrap();
        let (sum, members) = survivor.join().unwrap();
        assert!(removed.was_member);
        assert!(shown.iter().all(|&(_, member)| member), "{shown:?}");
        let batches: Vec<u64> = shown.iter().map(|s| s.0).collect();
        assert!(batches
            .iter()
            .all(|&b| Some(b) == removed.committed.map(|c| c.batch)));
        assert_eq!(batches.is_empty(), removed.committed.is_none(), "{shown:?}");
        match removed.committed.map(|c| c.batch) {
            Some(b) => {
                assert_eq!(b, 11);
                assert_eq!((sum, members), (3.0, 0b11), "applied with rank 1");
            }
            None => assert_eq!((sum, members), (1.0, 0b01), "applied without rank 1"),
        }
        assert_eq!(g.membership().step, 1, "exactly one step applied");
    });
}

/// The torch.distributed path: both ranks exchanged their gradients among epoch 1's members
/// elsewhere and commit the step within epoch 1; rank 1 dies after arriving and the launcher
/// removes it. Either the step committed with both (the launcher retires rank 1's batch, and
/// the exchanged sum, which holds rank 1's gradient, is the update), or rank 0 is told the
/// epoch changed and nothing committed (rank 1's batch goes back; rank 0 exchanges again among
/// the survivors). Never a commit without rank 1 while rank 0 holds a sum with it: fails if
/// `commit_within` contributes again after the epoch change, as `all_reduce` does.
#[test]
fn a_commit_within_an_epoch_never_commits_without_a_member_of_that_epoch() {
    model(|| {
        let g = group(2, 0b11, 0);
        let g1 = g.clone();
        let dead = thread::spawn(move || {
            let mut out = [0.0];
            let _ = g1.commit_within(1, 1, &[0.0], 11, &mut out, &|| true);
        });
        let g0 = g.clone();
        let survivor = thread::spawn(move || {
            let mut out = [0.0];
            g0.commit_within(0, 1, &[0.0], 10, &mut out, &|| false)
        });
        dead.join().unwrap();
        let removed = g.remove(1).unwrap();
        match (survivor.join().unwrap(), removed.committed.map(|c| c.batch)) {
            (Ok(r), Some(11)) => {
                assert_eq!((r.membership.members, r.step), (0b11, 1));
                assert_eq!(g.membership().step, 1);
            }
            (
                Err(GroupError::EpochChanged {
                    expected: 1,
                    now: 2,
                }),
                None,
            ) => {
                assert_eq!(g.membership().step, 0, "nothing committed");
            }
            other => panic!("split outcome: {other:?}"),
        }
    });
}

/// A rank that never arrived is removed with no committed batch, and the survivor finishes
/// alone (progress does not depend on a timeout: loom's futex model waits without one).
#[test]
fn a_rank_dead_before_arriving_leaves_the_survivor_to_finish_alone() {
    model(|| {
        let g = group(2, 0b11, 0);
        let g0 = g.clone();
        let survivor = thread::spawn(move || {
            let mut out = [0.0];
            g0.all_reduce(0, &[1.0], 10, &mut out, &|| false).unwrap();
            out[0]
        });
        let removed = g.remove(1).unwrap();
        assert_eq!(removed.committed.map(|c| c.batch), None);
        assert_eq!(survivor.join().unwrap(), 1.0);
        assert!(!g.remove(1).unwrap().was_member);
    });
}

/// A joiner asks while the leader is between steps; the leader admits it with its state; both
/// then reduce step 1 together. The joiner must see the whole state (the Relaxed state stores
/// are ordered by the admission CAS), and both get the same sum.
#[test]
fn a_joiner_gets_the_leaders_state_then_reduces_with_it() {
    model(|| {
        let g = group(2, 0b01, 2);
        let gj = g.clone();
        let joiner = thread::spawn(move || {
            let mut state = [0u32; 2];
            let (m, step) = gj.join(1, &mut state, 0, &|| false).unwrap();
            assert_eq!((state, step, m.members), ([7, 9], Some(0), 0b11));
            let mut out = [0.0];
            gj.all_reduce(1, &[2.0], 21, &mut out, &|| false).unwrap();
            out[0]
        });
        loop {
            if g.admit_joiners(0, 0, &[7, 9]).unwrap() != 0 {
                break;
            }
            thread::yield_now();
        }
        let mut out = [0.0];
        let r = g.all_reduce(0, &[1.0], 20, &mut out, &|| false).unwrap();
        assert_eq!((out[0], r.step), (3.0, 1));
        assert_eq!(joiner.join().unwrap(), 3.0);
    });
}

/// A joiner dies right after asking (its flag stays set, as a SIGKILL leaves it); the leader
/// may be admitting it while the launcher removes it. Whatever the order, the dead rank must not
/// end up a member: a dead member stalls every reduction until someone removes it again. Fails
/// if removing a non-member leaves the word alone (the leader's admission CAS then succeeds).
#[test]
fn a_joiner_that_died_asking_is_never_admitted_after_its_removal() {
    model(|| {
        let g = group(2, 0b01, 1);
        g.mem.rank(1).join.store(1, shmem::sync::Ordering::Release);
        let gl = g.clone();
        let leader = thread::spawn(move || {
            gl.admit_joiners(0, 0, &[5]).unwrap();
        });
        let removed = g.remove(1).unwrap();
        leader.join().unwrap();
        assert!(!g.membership().contains(1), "{removed:?}");
    });
}

/// The group's end round (every member saw the ring's end: it applied no update, the state
/// stays of step 5) commits as step 6. Rank 1 dies right after the commit, before its mark;
/// rank 0 marks it and exits; the launcher removes each once it is gone, and rank 1, restarted
/// meanwhile with its checkpoint of step 5, joins the emptied group. Whatever the order, it
/// must read that the group's last round applied nothing: the group's state is of step 5, no
/// update was lost, and its state is not moved to step 6.
#[test]
fn a_rank_joining_an_emptied_group_after_its_end_round_reads_that_it_applied_nothing() {
    model(|| {
        let g = Arc::new(Protocol {
            mem: HeapMem::new(
                2,
                1,
                1,
                Membership {
                    epoch: 1,
                    step: 5,
                    members: 0b11,
                },
            ),
        });
        let g1 = g.clone();
        let dead = thread::spawn(move || {
            let mut out = [0.0];
            g1.all_reduce(1, &[1.0], NO_BATCH, &mut out, &|| false)
                .unwrap();
        });
        let g0 = g.clone();
        let survivor = thread::spawn(move || {
            let mut out = [0.0];
            let r = (g0.all_reduce(0, &[1.0], NO_BATCH, &mut out, &|| false)).unwrap();
            g0.mark_ended(r.step, 5);
        });
        dead.join().unwrap();
        g.remove(1).unwrap();
        let gj = g.clone();
        let joiner = thread::spawn(move || {
            let mut state = [0u32];
            let (m, handed) = gj.join(1, &mut state, 5, &|| false).unwrap();
            (m, handed, gj.ended())
        });
        survivor.join().unwrap();
        g.remove(0).unwrap();
        let (m, handed, ended) = joiner.join().unwrap();
        assert_eq!((m.step, m.members, handed), (6, 0b10, None));
        assert_eq!(
            ended,
            Some(Ended {
                round: 6,
                applied: 5
            })
        );
        assert_eq!(m.state_step(ended), 5);
    });
}

#[cfg(not(loom))]
mod plain {
    use super::*;

    /// Three ranks, many steps, different data: every rank gets the same bits every step, and
    /// those bits are the rank-order sum (not "whatever arrived first").
    #[test]
    fn every_rank_gets_the_same_bits_summed_in_rank_order() {
        let g = Arc::new(Protocol {
            mem: HeapMem::new(
                3,
                4,
                0,
                Membership {
                    epoch: 1,
                    step: 0,
                    members: 0b111,
                },
            ),
        });
        let data = |r: u32, s: u32| -> Vec<f32> {
            (0..4)
                .map(|i| 1.0 / (1.0 + (r * 7 + s * 3 + i) as f32) * 1e3)
                .collect()
        };
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let g = g.clone();
                thread::spawn(move || {
                    let mut got = Vec::new();
                    for s in 1..=50 {
                        let mut out = [0.0; 4];
                        let red = g.all_reduce(r, &data(r, s), u64::from(s), &mut out, &|| false);
                        assert_eq!(red.unwrap().step, s);
                        got.push(out.map(f32::to_bits));
                    }
                    got
                })
            })
            .collect();
        let got: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            got.iter().all(|g| *g == got[0]),
            "bitwise equal on every rank"
        );
        for s in 1..=50u32 {
            let want: Vec<u32> = (0..4)
                .map(|i| {
                    let v = (0..3).fold(0.0f32, |a, r| a + data(r, s)[i]);
                    v.to_bits()
                })
                .collect();
            assert_eq!(got[0][s as usize - 1].to_vec(), want, "step {s}");
        }
    }

    #[test]
    fn wrong_sizes_ranks_and_a_stop_are_errors_not_hangs() {
        let g = group(2, 0b11, 1);
        let mut out = [0.0; 2];
        assert_eq!(
            g.all_reduce(0, &[1.0, 2.0], 1, &mut out, &|| false),
            Err(GroupError::Size { want: 1, got: 2 })
        );
        let mut out = [0.0];
        assert!(matches!(
            g.all_reduce(5, &[1.0], 1, &mut out, &|| false),
            Err(GroupError::Rank { rank: 5, .. })
        ));
        // Rank 1 never comes: a stop request ends the wait.
        assert_eq!(
            g.all_reduce(0, &[1.0], 1, &mut out, &|| true),
            Err(GroupError::Stopped)
        );
        g.remove(0).unwrap();
        assert!(matches!(
            g.all_reduce(0, &[1.0], NO_BATCH, &mut out, &|| false),
            Err(GroupError::NotMember { rank: 0, .. })
        ));
        // A commit within an epoch that is over: refused at once, nothing contributed.
        let epoch = g.membership().epoch;
        assert_eq!(
            g.commit_within(1, epoch - 1, &[1.0], 1, &mut out, &|| false),
            Err(GroupError::EpochChanged {
                expected: epoch - 1,
                now: epoch
            })
        );
        assert_eq!(
            g.mem.rank(1).arrived.load(shmem::sync::Ordering::Acquire),
            0
        );
        // Every rank gone: a joiner admits itself, with no state handed over.
        g.remove(1).unwrap();
        let mut state = [0u32];
        let (m, step) = g.join(1, &mut state, 0, &|| false).unwrap();
        assert_eq!(
            (m.members, m.step, step),
            (0b10, 0, None),
            "back to its own step"
        );
        assert!(!g.joiners_waiting());
        g.all_reduce(1, &[5.0], 3, &mut out, &|| false).unwrap();
        assert_eq!(out[0], 5.0);
        assert!(matches!(
            g.all_reduce(0, &[1.0], NO_BATCH, &mut out, &|| false),
            Err(GroupError::NotMember { rank: 0, .. })
        ));
    }

    /// Both ranks reduce step 1 with a batch (10, 11), then step 2 with none (a Python rank
    /// reducing its loss before it releases its batch); rank 1 dies there, still holding batch
    /// 11. Its update was applied at step 1, so the launcher must retire it. Told only of the
    /// last contribution (none), it redelivered the batch and a live rank trained it twice.
    #[test]
    fn a_batch_applied_before_rounds_with_none_is_still_the_dead_ranks_committed_batch() {
        let g = group(2, 0b11, 0);
        let ranks: Vec<_> = [(0, 10), (1, 11)]
            .into_iter()
            .map(|(r, batch)| {
                let g = g.clone();
                thread::spawn(move || {
                    let mut out = [0.0];
                    g.all_reduce(r, &[1.0], batch, &mut out, &|| false).unwrap();
                    g.all_reduce(r, &[1.0], NO_BATCH, &mut out, &|| false)
                        .unwrap()
                })
            })
            .collect();
        for r in ranks {
            assert_eq!(r.join().unwrap().step, 2);
        }
        let gone = g.remove(1).unwrap();
        let committed = gone.committed.map(|c| (c.batch, c.step));
        assert_eq!(committed, Some((11, 1)), "batch 11, applied at step 1");
    }

    /// Rank 1 contributes batch 11 to step 1 within epoch 1; rank 2 dies first, so the epoch
    /// moves on and nothing commits. Rank 1 contributes to step 1 again with no batch (it gave
    /// the batch back), the step commits without batch 11, and rank 1 dies. The launcher must
    /// not retire batch 11: its samples would be lost.
    #[test]
    fn a_batch_whose_round_was_contributed_again_without_it_is_not_committed() {
        let g = group(3, 0b111, 0);
        let g1 = g.clone();
        let within = thread::spawn(move || {
            let mut out = [0.0];
            g1.commit_within(1, 1, &[1.0], 11, &mut out, &|| false)
        });
        while g.mem.rank(1).arrived.load(shmem::sync::Ordering::Acquire) == 0 {
            thread::yield_now();
        }
        g.remove(2).unwrap();
        let changed = within.join().unwrap();
        assert_eq!(
            changed,
            Err(GroupError::EpochChanged {
                expected: 1,
                now: 2
            })
        );
        let ranks: Vec<_> = [(0, 10), (1, NO_BATCH)]
            .into_iter()
            .map(|(r, batch)| {
                let g = g.clone();
                thread::spawn(move || {
                    let mut out = [0.0];
                    g.all_reduce(r, &[1.0], batch, &mut out, &|| false).unwrap()
                })
            })
            .collect();
        for r in ranks {
            assert_eq!(r.join().unwrap().step, 1);
        }
        assert_eq!(g.remove(1).unwrap().committed, None);
    }

    /// Only the last committed round's mark counts: a round after an end round (a rank that
    /// joined the emptied group, alone) is the group's state's step until it is marked too, and
    /// marks only grow, so a member's late mark of an earlier end round changes nothing.
    #[test]
    fn an_end_round_counts_only_while_it_is_the_last_committed_round() {
        let g = group(1, 0b1, 1);
        assert_eq!((g.ended(), g.membership().state_step(None)), (None, 0));
        let mut out = [0.0];
        let r = g
            .all_reduce(0, &[0.0], NO_BATCH, &mut out, &|| false)
            .unwrap();
        g.mark_ended(r.step, 0);
        assert_eq!(g.membership().state_step(g.ended()), 0);
        let r = g
            .all_reduce(0, &[0.0], NO_BATCH, &mut out, &|| false)
            .unwrap();
        assert_eq!(r.step, 2);
        assert_eq!(
            g.membership().state_step(g.ended()),
            2,
            "round 2 applied its update"
        );
        g.mark_ended(2, 1);
        g.mark_ended(1, 0);
        assert_eq!(
            g.ended(),
            Some(Ended {
                round: 2,
                applied: 1
            })
        );
        assert_eq!(g.membership().state_step(g.ended()), 1);
    }
}
