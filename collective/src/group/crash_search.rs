//! A seeded random search for crash bugs in the group protocol: ranks reduce, die at any wait
//! of a round or in the middle of a contribution, are removed by the launcher, and rejoin, in
//! an order drawn from the seed; every history is checked against what the launcher and the
//! drafters rely on:
//!
//! - every committed round is seen identically by every rank that returns it (same membership,
//!   same bits), and holds exactly its members' contributions of that round (no other rank's,
//!   no stale one);
//! - every batch is in at most one committed round, and a batch whose `all_reduce` returned is
//!   in the round it returned;
//! - `remove` says "retire" (`committed: Some(b)`) only for the dead rank's last batch (the
//!   last it named: a rank sometimes contributes to a round with none, as a Python rank
//!   reducing its loss does), and exactly when that batch is in a committed round, the one
//!   `remove` names; "redeliver" (None) leaves the batch out of every round for good; and the
//!   launcher is shown that batch to settle before the removal, while the rank is a member;
//! - a joiner receives the state of the step it is admitted at.
//!
//! The ranks run the real `all_reduce` and `join`, each on its own thread, but only one thread
//! runs at a time: a rank gives the baton back at every `stop()` question (the only place it
//! would wait), and the scheduler resumes a waiting rank only once the group's futex word has
//! moved (a resumed rank's futex wait then returns at once). So each seed replays exactly, and a
//! kill at a wait is `stop()` answering yes, which leaves the group as a SIGKILL there would.
//!
//! Length: past 500 lines because the scheduler, the ranks, the launcher's part and the checks
//! of one history must see the same state; split, each would pass the whole simulation around.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use super::{tag, HeapMem, Membership, Memory, Protocol, Reduced, Removed, NO_BATCH};
use crate::GroupError;
use shmem::sync::Ordering;

/// Seeds the suite runs; each spawns a thread per call, so fewer than the ring's search.
const SUITE_SEEDS: u64 = 1_500;

/// A history longer than this means some rank can never progress.
const MAX_STEPS: usize = 5_000;

/// What a rank's thread reports to the scheduler.
enum Event {
    /// At a `stop()` question, with the futex word's value it would wait on.
    Waiting(u32),
    Reduced(Result<Reduced, GroupError>, Vec<f32>),
    Joined(Result<(Membership, Option<u64>), GroupError>, Vec<u32>),
}

/// A blocking call in progress on its own thread.
struct Call {
    resume: Sender<bool>,
    events: Receiver<Event>,
    thread: JoinHandle<()>,
    /// The futex word's value at the rank's last wait.
    seen: u32,
    /// The batch it contributes (for a reduction; [`NO_BATCH`] for none).
    batch: u64,
}

enum Rank {
    /// A member between rounds; `step` is the last step it applied (its state's step).
    Idle {
        step: u32,
    },
    Reducing(Call),
    Joining(Call),
    /// Killed (its thread, if any, has returned); the launcher has not removed it yet. `last`
    /// is the batch of its last contribution, if any.
    Dead,
    /// Removed and not restarted.
    Gone,
}

/// What the launcher was told when it removed a dead rank, with what the rank had done.
struct Verdict {
    rank: u32,
    /// The last batch it contributed, if any.
    last: Option<u64>,
    /// The (epoch, step) of the round it contributed that batch to.
    arrival: (u16, u32),
    removed: Removed,
}

struct Sim {
    g: Arc<Protocol<HeapMem>>,
    rng: Xoshiro256PlusPlus,
    ranks: Vec<Rank>,
    /// The last batch each rank contributed (written before its arrival), if any.
    last: Vec<Option<u64>>,
    incarnations: Vec<u32>,
    target: u32,
    kills_left: u32,
    next_batch: u64,
    /// Committed rounds as some rank returned them: (epoch, step) → (membership, sums). The
    /// epoch is part of the key because a group that emptied restarts from its joiner's own
    /// step (its checkpoint), so a step number can come again under a later epoch.
    rounds: std::collections::BTreeMap<(u16, u32), (Membership, Vec<f32>)>,
    verdicts: Vec<Verdict>,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let n = rng.random_range(2..=4u32);
        let target = rng.random_range(1..=5u32);
        let kills_left = rng.random_range(0..=4u32);
        let all = ((1u32 << n) - 1) as u16;
        let g = Arc::new(Protocol {
            mem: HeapMem::new(
                n,
                n as usize,
                1,
                Membership {
                    epoch: 1,
                    step: 0,
                    members: all,
                },
            ),
        });
        let log = vec![format!(
            "seed {seed}: {n} ranks, {target} steps, {kills_left} kills"
        )];
        Sim {
            g,
            rng,
            ranks: (0..n).map(|_| Rank::Idle { step: 0 }).collect(),
            last: vec![None; n as usize],
            incarnations: vec![0; n as usize],
            target,
            kills_left,
            // Batch ids from 1: a rank contributing none writes 0.
            next_batch: 1,
            rounds: Default::default(),
            verdicts: Vec::new(),
            log,
        }
    }

    fn fail(&self, what: &str) -> ! {
        panic!("{what}\nhistory:\n  {}", self.log.join("\n  "));
    }

    fn check(&self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fail(&what());
        }
    }

    fn seq(&self) -> u32 {
        self.g.mem.control().seq.load(Ordering::Acquire)
    }

    /// Waits for the running call's next event (the baton comes back with it).
    fn next_event(call: &Call) -> Event {
        call.events
            .recv()
            .expect("a rank's thread reports before it ends")
    }

    fn spawn_reduce(&mut self, r: u32) -> Call {
        let batch = if self.rng.random_bool(0.25) {
            NO_BATCH
        } else {
            self.next_batch += 1;
            self.next_batch - 1
        };
        let n = self.ranks.len();
        let mut data = vec![0.0f32; n];
        // Each rank writes its batch id in its own element: a sum shows who contributed what.
        data[r as usize] = value(batch);
        let (resume, resume_rx) = channel::<bool>();
        let (tx, events) = channel();
        let g = self.g.clone();
        let thread = std::thread::spawn(move || {
            let stop = || {
                let seen = g.mem.control().seq.load(Ordering::Acquire);
                let _ = tx.send(Event::Waiting(seen));
                resume_rx.recv().unwrap_or(true)
            };
            let mut out = vec![0.0f32; n];
            let res = g.all_reduce(r, &data, batch, &mut out, &stop);
            let _ = tx.send(Event::Reduced(res, out));
        });
        if batch != NO_BATCH {
            self.last[r as usize] = Some(batch);
            self.log.push(format!("rank {r} reduces batch {batch}"));
        } else {
            self.log.push(format!("rank {r} reduces with no batch"));
        }
        Call {
            resume,
            events,
            thread,
            seen: 0,
            batch,
        }
    }

    fn spawn_join(&mut self, r: u32) -> Call {
        let (resume, resume_rx) = channel::<bool>();
        let (tx, events) = channel();
        let g = self.g.clone();
        let own = self.g.membership().step;
        let thread = std::thread::spawn(move || {
            let stop = || {
                let seen = g.mem.control().seq.load(Ordering::Acquire);
                let _ = tx.send(Event::Waiting(seen));
                resume_rx.recv().unwrap_or(true)
            };
            let mut state = vec![0u32; 1];
            let res = g.join(r, &mut state, own, &stop);
            let _ = tx.send(Event::Joined(res, state));
        });
        self.last[r as usize] = None;
        self.log.push(format!("rank {r} asks to join"));
        Call {
            resume,
            events,
            thread,
            seen: 0,
            batch: NO_BATCH,
        }
    }

    /// Handles the event a call just sent: it waits (keep it), or it returned (settle it).
    fn settle(&mut self, r: u32, call: Call, ev: Event, joining: bool) {
        match ev {
            Event::Waiting(seen) => {
                let call = Call { seen, ..call };
                self.ranks[r as usize] = if joining {
                    Rank::Joining(call)
                } else {
                    Rank::Reducing(call)
                };
            }
            Event::Reduced(res, out) => {
                call.thread.join().unwrap();
                match res {
                    Ok(red) => {
                        self.log.push(format!("rank {r} applies {red:?}: {out:?}"));
                        self.record_round(r, call.batch, red, out);
                        self.ranks[r as usize] = Rank::Idle { step: red.step };
                    }
                    Err(GroupError::Stopped) => {
                        self.log
                            .push(format!("rank {r} killed waiting in its round"));
                        self.ranks[r as usize] = Rank::Dead;
                    }
                    Err(e) => self.fail(&format!("rank {r}'s reduction: {e}")),
                }
            }
            Event::Joined(res, state) => {
                call.thread.join().unwrap();
                match res {
                    Ok((m, from)) => {
                        self.log
                            .push(format!("rank {r} joined {m:?} with the state of {from:?}"));
                        self.check(m.contains(r), || {
                            format!("rank {r} joined {m:?} without it")
                        });
                        if let Some(step) = from {
                            self.check(step == u64::from(m.step) && state[0] == m.step, || {
                                format!("rank {r} joined at {m:?} with state {state:?} of {step}")
                            });
                        }
                        self.ranks[r as usize] = Rank::Idle { step: m.step };
                    }
                    Err(GroupError::Stopped) => {
                        self.log.push(format!("rank {r} killed waiting to join"));
                        self.ranks[r as usize] = Rank::Dead;
                    }
                    Err(e) => self.fail(&format!("rank {r}'s join: {e}")),
                }
            }
        }
    }

    /// A round rank `r` returned: the same as every other rank's return of that step, holding
    /// `r`'s batch and nothing from a non-member.
    fn record_round(&mut self, r: u32, batch: u64, red: Reduced, out: Vec<f32>) {
        self.check(red.membership.contains(r), || {
            format!("rank {r} applied a round without itself")
        });
        self.check(out[r as usize] == value(batch), || {
            format!("rank {r}'s batch {batch} is not in its round: {out:?}")
        });
        for (q, &x) in out.iter().enumerate() {
            if !red.membership.contains(q as u32) {
                self.check(x == 0.0, || format!("non-member {q} contributed {x}"));
            }
        }
        let key = (red.membership.epoch, red.step);
        if let Some((m, o)) = self.rounds.get(&key) {
            self.check(*m == red.membership && *o == out, || {
                format!(
                    "step {} applied as {m:?} {o:?} by one rank, {:?} {out:?} by rank {r}",
                    red.step, red.membership
                )
            });
        } else {
            self.rounds.insert(key, (red.membership, out));
        }
    }

    fn runnable(&self, call: &Call) -> bool {
        self.seq() != call.seen
    }

    fn actions(&self) -> Vec<(u32, u8)> {
        let mut v = Vec::new();
        let step = self.g.membership().step;
        for (i, rank) in self.ranks.iter().enumerate() {
            let r = i as u32;
            let kill = self.kills_left > 0;
            match rank {
                Rank::Idle { step: mine } => {
                    if *mine < self.target && step < self.target {
                        v.push((r, 0)); // start a round
                    }
                    if self.g.joiners_waiting() && self.g.membership().leader() == Some(r) {
                        v.push((r, 1)); // admit joiners
                    }
                    if kill {
                        v.push((r, 2)); // killed between rounds
                        if *mine < self.target && step < self.target {
                            v.push((r, 3)); // killed inside a contribution
                        }
                    }
                }
                Rank::Reducing(c) | Rank::Joining(c) => {
                    if self.runnable(c) {
                        v.push((r, 4)); // resume
                    }
                    if kill {
                        v.push((r, 5)); // killed at its wait
                    }
                }
                Rank::Dead => v.push((r, 6)), // the launcher removes it
                Rank::Gone => {}
            }
        }
        v
    }

    fn run(&mut self) {
        for _ in 0..MAX_STEPS {
            let actions = self.actions();
            if actions.is_empty() {
                return self.check_end();
            }
            let (r, a) = loop {
                let a = actions[self.rng.random_range(0..actions.len())];
                if !matches!(a.1, 2 | 3 | 5) || self.rng.random_bool(0.15) {
                    break a;
                }
            };
            self.step(r, a);
        }
        self.fail(&format!("no end after {MAX_STEPS} steps"));
    }

    fn step(&mut self, r: u32, a: u8) {
        let i = r as usize;
        match a {
            0 => {
                let call = self.spawn_reduce(r);
                let ev = Self::next_event(&call);
                self.settle(r, call, ev, false);
            }
            1 => {
                let Rank::Idle { step } = self.ranks[i] else {
                    unreachable!()
                };
                let admitted = self.g.admit_joiners(r, step, &[step]).unwrap();
                self.log
                    .push(format!("leader {r} at step {step} admits {admitted:#b}"));
            }
            2 => {
                self.kills_left -= 1;
                self.log.push(format!("rank {r} killed between rounds"));
                self.ranks[i] = Rank::Dead;
            }
            3 => {
                self.kills_left -= 1;
                self.contribute_half(r);
                self.ranks[i] = Rank::Dead;
            }
            4 | 5 => {
                let (call, joining) = match std::mem::replace(&mut self.ranks[i], Rank::Dead) {
                    Rank::Reducing(c) => (c, false),
                    Rank::Joining(c) => (c, true),
                    _ => unreachable!(),
                };
                if a == 5 {
                    self.kills_left -= 1;
                }
                // `stop()` answers: yes for a kill, no to go on.
                call.resume.send(a == 5).unwrap();
                let ev = Self::next_event(&call);
                self.settle(r, call, ev, joining);
            }
            6 => self.remove(r),
            _ => unreachable!(),
        }
    }

    /// Rank `r` starts a round and is killed inside `contribute`, after its buffer and any of
    /// the stores that name its batch and publish its arrival (in `contribute`'s order), but
    /// never the wake-up after them.
    fn contribute_half(&mut self, r: u32) {
        let w = self.g.membership();
        let batch = self.next_batch;
        self.next_batch += 1;
        let s = w.step.wrapping_add(1);
        let buf = self.g.mem.buf(r, s % 2);
        buf[r as usize].store((batch as f32).to_bits(), Ordering::Relaxed);
        let stores = self.rng.random_range(0..=4u32);
        let rec = self.g.mem.rank(r);
        if stores >= 1 {
            // From here the rank holds the new batch, and no longer the last (released).
            rec.batch_tag.store(0, Ordering::Relaxed);
            self.last[r as usize] = Some(batch);
        }
        if stores >= 2 {
            rec.batch.store(batch, Ordering::Release);
        }
        if stores >= 3 {
            rec.batch_tag.store(tag(w.epoch, s), Ordering::Release);
        }
        if stores >= 4 {
            rec.arrived.store(tag(w.epoch, s), Ordering::Release);
        }
        self.log.push(format!(
            "rank {r} killed contributing batch {batch} to step {s} after {stores} of its 4 stores"
        ));
    }

    /// The launcher removes dead rank `r`, then restarts it (a join) or gives it up.
    fn remove(&mut self, r: u32) {
        // The round the dead rank's last batch was contributed to.
        let t = self.g.mem.rank(r).batch_tag.load(Ordering::Acquire);
        let arrival = ((t >> 32) as u16, t as u32);
        // What `remove` shows the launcher to settle, and whether the rank was still a member
        // then (no later round could commit, so no checkpoint held the update yet).
        let mut shown = Vec::new();
        let g = &self.g;
        let removed = (g.remove_settling(r, &mut |c| {
            shown.push((c, g.membership().contains(r)));
        }))
        .unwrap();
        self.log
            .push(format!("launcher removes rank {r}: {removed:?}"));
        self.check(shown.iter().all(|&(_, member)| member), || {
            format!("settling shown after rank {r} was removed: {shown:?}")
        });
        self.check(
            shown.iter().all(|&(c, _)| Some(c) == removed.committed)
                && removed.committed.is_none_or(|_| !shown.is_empty()),
            || {
                format!(
                    "settling shown {shown:?}, but the removal said {:?}",
                    removed.committed
                )
            },
        );
        self.check(!removed.membership.contains(r), || {
            format!("rank {r} still a member after its removal")
        });
        let last = self.last[r as usize];
        if let Some(b) = removed.committed.map(|c| c.batch) {
            self.check(Some(b) == last, || {
                format!("retire {b}, but rank {r}'s last batch is {last:?}")
            });
        }
        self.verdicts.push(Verdict {
            rank: r,
            last,
            arrival,
            removed,
        });
        let i = r as usize;
        self.incarnations[i] += 1;
        if self.incarnations[i] < 3 && self.rng.random_bool(0.7) {
            if self.kills_left > 0 && self.rng.random_bool(0.2) {
                // Killed in `join`, its request made: the launcher must clear it.
                let rec = self.g.mem.rank(r);
                rec.arrived.store(0, Ordering::Relaxed);
                rec.batch.store(NO_BATCH, Ordering::Relaxed);
                rec.batch_tag.store(0, Ordering::Relaxed);
                rec.join.store(1, Ordering::Release);
                self.kills_left -= 1;
                self.last[i] = None;
                self.log
                    .push(format!("rank {r} restarts and is killed asking to join"));
                self.ranks[i] = Rank::Dead;
                return;
            }
            let call = self.spawn_join(r);
            let ev = Self::next_event(&call);
            self.settle(r, call, ev, true);
        } else {
            self.log.push(format!("rank {r} given up"));
            self.ranks[i] = Rank::Gone;
        }
    }

    fn check_end(&mut self) {
        self.log.push("end".into());
        for (r, rank) in self.ranks.iter().enumerate() {
            self.check(
                !matches!(rank, Rank::Reducing(_) | Rank::Joining(_)),
                || format!("rank {r} waits for a wake-up that never comes"),
            );
        }
        // Every batch is in at most one round.
        let mut seen = std::collections::BTreeSet::new();
        for (step, (m, out)) in &self.rounds {
            for q in m.ranks().filter(|&q| out[q as usize] != 0.0) {
                let b = out[q as usize] as u64;
                self.check(seen.insert(b), || {
                    format!("batch {b} applied twice (round {step:?})")
                });
            }
        }
        // The launcher's verdicts match the rounds.
        for v in &self.verdicts {
            let (r, last, arrival, removed) = (&v.rank, &v.last, &v.arrival, &v.removed);
            let Some(b) = last else { continue };
            let applied_in = self
                .rounds
                .iter()
                .find(|(_, (m, out))| m.contains(*r) && out[*r as usize] == *b as f32)
                .map(|(&s, _)| s);
            match removed.committed {
                Some(c) => {
                    // Its round may have no surviving witness; if one returned it, it holds b.
                    let committed = c.step == arrival.1 && c.step <= removed.membership.step;
                    self.check(committed, || {
                        format!("rank {r} retired {b} from {arrival:?}, group at {removed:?}")
                    });
                    if let Some((m, out)) = self.rounds.get(arrival) {
                        self.check(m.contains(*r) && out[*r as usize] == *b as f32, || {
                            format!("rank {r}'s batch {b} retired but not in round {arrival:?}")
                        });
                    }
                }
                None => self.check(applied_in.is_none(), || {
                    format!("rank {r}'s batch {b} redelivered, but applied in {applied_in:?}")
                }),
            }
        }
    }
}

/// What a rank contributing `batch` writes in its element of the sum: the id, 0 for none.
fn value(batch: u64) -> f32 {
    if batch == NO_BATCH {
        0.0
    } else {
        batch as f32
    }
}

std::thread_local! {
    /// Rounds committed, retire and redeliver verdicts, and rounds contributed again, over the
    /// seeds this thread ran: the summary line shows the search reaches each case.
    static TOTALS: std::cell::Cell<[u64; 4]> = const { std::cell::Cell::new([0; 4]) };
}

/// Runs one seed's history and checks it.
fn replay(seed: u64) {
    let mut sim = Sim::new(seed);
    sim.run();
    let retire = sim
        .verdicts
        .iter()
        .filter(|v| v.removed.committed.is_some())
        .count();
    let redeliver = sim
        .verdicts
        .iter()
        .filter(|v| v.last.is_some() && v.removed.committed.is_none())
        .count();
    let retried = sim.log.iter().filter(|l| l.contains("retries: 1")).count();
    TOTALS.with(|t| {
        let mut v = t.get();
        for (x, d) in v
            .iter_mut()
            .zip([sim.rounds.len(), retire, redeliver, retried])
        {
            *x += d as u64;
        }
        t.set(v);
    });
    if std::env::var("GROUP_SEARCH_LOG").ok() == Some(seed.to_string()) {
        eprintln!("{}", sim.log.join("\n"));
    }
}

/// The suite's search: `SUITE_SEEDS` seeds, or `GROUP_SEARCH_SEEDS` from the environment (and
/// `GROUP_SEARCH_FROM` for the first seed).
#[test]
fn random_crash_histories_keep_the_group_consistent() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let seeds = env("GROUP_SEARCH_SEEDS").unwrap_or(SUITE_SEEDS);
    let from = env("GROUP_SEARCH_FROM").unwrap_or(0);
    for seed in from..from + seeds {
        replay(seed);
    }
    let [rounds, retire, redeliver, retried] = TOTALS.with(|t| t.get());
    eprintln!(
        "group crash search: {seeds} seeds from {from}, {rounds} rounds, {retire} retired and \
         {redeliver} redelivered batches, {retried} rounds contributed again"
    );
}
