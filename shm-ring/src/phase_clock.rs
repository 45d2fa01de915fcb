//! A worker's phase clock: its time by phase, and the phase it is in now and since when. One
//! writer switches it (the worker, or its supervisor once the worker is dead); any process
//! reads it, without writing. A Python worker whose threads switch phases at once (a
//! `phase()` scope in one, a blocking `take()` in another) breaks that rule: its readings may
//! then be off by a switch, as all were before the seqlock; nothing else depends on them.
//!
//! A reading counts the running phase up to the reader's now, so it needs the totals, the
//! phase now and its start from one instant. A switch writes three words (the phase left gets
//! its time, then the new phase and its start), and a plain reader between two of them counted
//! the phase left twice or not at all: one tick of the monitor off by a whole phase, the next
//! off the other way. The clock is a seqlock: its sequence word is odd while a switch is under
//! way and moves on when it ends, and a reading stands only if the word was even and the same
//! before and after its loads; otherwise the reader tries again.
//!
//! Orderings (no fences, so loom checks them as they are): the switch's data stores are
//! Release and a reader's data loads Acquire. A reader whose data load sees a switch's store
//! therefore sees that switch's odd sequence (stored before it) when it loads the word again,
//! and refuses the reading; one whose first load of the word sees a switch's even end (Release,
//! pairing with that Acquire load) sees all of that switch's data.

use crate::layout::PHASES;
use crate::phase::{Phase, PhaseMap};
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Readings a reader tries before it settles for an unchecked one (a writer stopped in the
/// middle of a switch: SIGSTOPped, or killed and not yet recovered). A switch takes tens of
/// nanoseconds, so one retry is the rule; the yields after the first spins let a preempted
/// writer finish.
#[cfg(not(loom))]
const TRIES: u32 = 200;
/// loom explores the interleavings of a few tries; more would only add states.
#[cfg(loom)]
const TRIES: u32 = 2;

/// The clock's words in a worker record (`WorkerRecord::clock`).
#[cfg_attr(any(test, loom), derive(Default))]
#[repr(C)]
pub(crate) struct PhaseClock {
    /// Odd while a switch is under way; two more for each switch.
    seq: AtomicU64,
    /// Nanoseconds by phase, for the time up to each phase's last end (the running phase's time
    /// since `since` is not in yet); `add` adds time measured elsewhere.
    ns: [AtomicU64; PHASES],
    /// The phase now (+1; 0: the clock is stopped).
    cur: AtomicU32,
    /// When the phase now began (CLOCK_MONOTONIC ns).
    since: AtomicU64,
}

/// What a reader saw: each phase's time up to the reader's now, and the phase now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reading {
    pub ns: PhaseMap<u64>,
    pub cur: Option<Phase>,
}

fn phase_of(word: u32) -> Option<Phase> {
    (word as usize)
        .checked_sub(1)
        .and_then(|i| Phase::ALL.get(i).copied())
}

impl PhaseClock {
    /// Switches the clock to `to` at `now` (None: stops it), adding the time since the last
    /// switch to the phase it leaves, which it returns. Only the clock's one writer calls this.
    pub(crate) fn switch(&self, now: u64, to: Option<Phase>) -> Option<Phase> {
        let odd = self.begin();
        let (prev, elapsed) = self.start(now, to);
        self.credit(prev, elapsed);
        self.end(odd);
        prev
    }

    /// Marks a switch under way; returns the odd sequence it stored.
    fn begin(&self) -> u64 {
        // Relaxed: the one writer reads its own last store (or, after a death, its
        // predecessor's, ordered by that process's exit before its recovery).
        let s = self.seq.load(Ordering::Relaxed);
        // Odd either way: a writer killed in the middle of a switch left the word odd, and the
        // next odd value is two on, so no reader takes it for the word it saw.
        let odd = (s + 1) | 1;
        self.seq.store(odd, Ordering::Relaxed);
        odd
    }

    /// The switch's first data stores (after `begin`): the new phase and its start. Returns
    /// the phase left and its time, for `credit`.
    fn start(&self, now: u64, to: Option<Phase>) -> (Option<Phase>, u64) {
        let word = to.map_or(0, |p| p as u32 + 1);
        // SYNC: these Release stores (and `credit`'s) order `begin`'s odd sequence before them,
        // for a reader's Acquire loads of the same words (see the module's doc).
        let prev = phase_of(self.cur.swap(word, Ordering::Release));
        let since = self.since.swap(now, Ordering::Release);
        (prev, now.saturating_sub(since))
    }

    /// The switch's last data store (before `end`): the phase left gets its time.
    fn credit(&self, prev: Option<Phase>, elapsed: u64) {
        if let Some(p) = prev {
            // SYNC: Release, as in `start`.
            self.ns[p as usize].fetch_add(elapsed, Ordering::Release);
        }
    }

    /// Ends the switch that `begin` returned `odd` for.
    fn end(&self, odd: u64) {
        // SYNC: Release pairs with a reader's Acquire load of the word before its data loads.
        self.seq.store(odd + 1, Ordering::Release);
    }

    /// Adds `ns` to `phase`'s time (time measured elsewhere). One word, which a reading sees
    /// whole or not at all: either is a time the worker had.
    pub(crate) fn add(&self, phase: Phase, ns: u64) {
        self.ns[phase as usize].fetch_add(ns, Ordering::Relaxed);
    }

    /// Each phase's time up to `now` and the phase now. `running`: count the running phase up
    /// to `now` (false for a worker that is gone, whose clock is stopped at its last switch).
    /// A writer stopped in the middle of a switch for all of [`TRIES`] leaves an unchecked
    /// reading, off by at most that one switch.
    pub(crate) fn read(&self, now: u64, running: bool) -> Reading {
        for i in 0..TRIES {
            if let Some(r) = self.try_read(now, running) {
                return r;
            }
            if i < TRIES / 2 {
                std::hint::spin_loop();
            } else {
                yield_now();
            }
        }
        self.load(now, running)
    }

    /// One reading, refused (None) if a switch was under way or ended during it.
    fn try_read(&self, now: u64, running: bool) -> Option<Reading> {
        // SYNC: Acquire pairs with `end`'s Release store.
        let seq = self.seq.load(Ordering::Acquire);
        if seq & 1 == 1 {
            return None;
        }
        let r = self.load(now, running);
        // Relaxed: ordered after the Acquire loads in `load`.
        (self.seq.load(Ordering::Relaxed) == seq).then_some(r)
    }

    /// The words as they are, unchecked.
    fn load(&self, now: u64, running: bool) -> Reading {
        // SYNC: Acquire pairs with `apply`'s Release stores.
        let cur = phase_of(self.cur.load(Ordering::Acquire));
        let since = self.since.load(Ordering::Acquire);
        let mut ns = PhaseMap::from_fn(|p: Phase| self.ns[p as usize].load(Ordering::Acquire));
        if let (Some(p), true) = (cur, running) {
            ns[p] += now.saturating_sub(since);
        }
        Reading { ns, cur }
    }
}

#[cfg(not(loom))]
fn yield_now() {
    std::thread::yield_now();
}

#[cfg(loom)]
fn yield_now() {
    loom::thread::yield_now();
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A clock in `Load` since 0, as a worker's is.
    fn loading() -> PhaseClock {
        let c = PhaseClock::default();
        c.switch(0, Some(Phase::Load));
        c
    }

    #[test]
    fn a_reading_counts_the_running_phase_up_to_now_and_a_switch_moves_it_to_the_total() {
        let c = loading();
        let r = c.read(7, true);
        assert_eq!((r.ns[Phase::Load], r.cur), (7, Some(Phase::Load)));
        assert_eq!(c.switch(10, Some(Phase::Compute)), Some(Phase::Load));
        c.add(Phase::Sync, 3);
        let r = c.read(25, true);
        assert_eq!(r.ns[Phase::Load], 10);
        assert_eq!(r.ns[Phase::Compute], 15);
        assert_eq!(r.ns[Phase::Sync], 3);
        // A worker that is gone counts nothing past its last switch.
        assert_eq!(c.read(25, false).ns[Phase::Compute], 0);
        assert_eq!(c.switch(30, None), Some(Phase::Compute));
        assert_eq!(c.read(99, true).cur, None);
        assert_eq!(c.read(99, true).ns[Phase::Compute], 20);
    }

    /// The interleaving the sequence word is for, step by step: a switch from `Load` to
    /// `Compute` at 10 has swapped the phase and its start but not yet added `Load`'s time, and
    /// a reader reads at 20. Unchecked, it sees 10 ns of the 20 (Load's 10 are nowhere); the
    /// clock refuses that reading, and the one after the switch ends has all 20.
    #[test]
    fn a_reading_in_the_middle_of_a_switch_is_refused_and_the_next_one_is_whole() {
        let c = loading();
        let odd = c.begin();
        let (prev, elapsed) = c.start(10, Some(Phase::Compute));
        let total = |r: Reading| r.ns.values().sum::<u64>();
        assert_eq!(
            total(c.load(20, true)),
            10,
            "the torn reading this prevents"
        );
        assert_eq!(c.try_read(20, true), None);
        c.credit(prev, elapsed);
        assert_eq!(c.try_read(20, true), None, "still under way");
        c.end(odd);
        let r = c.try_read(20, true).expect("the switch ended");
        assert_eq!(
            (total(r), r.ns[Phase::Load], r.cur),
            (20, 10, Some(Phase::Compute))
        );
    }

    /// A writer killed in the middle of a switch leaves the word odd: readers do not hang on
    /// it (they settle for an unchecked reading), and the supervisor's switch that stops the
    /// dead worker's clock makes readings checked again.
    #[test]
    fn a_writer_killed_mid_switch_leaves_readings_bounded_and_the_next_switch_mends_it() {
        let c = loading();
        let _ = c.begin();
        let _ = c.start(10, Some(Phase::Compute));
        assert_eq!(
            c.read(20, true).cur,
            Some(Phase::Compute),
            "unchecked, not hung"
        );
        c.switch(30, None);
        let r = c.try_read(40, true).expect("the supervisor's switch ended");
        // Load's 10 ns, which the dead writer had not yet added, died with it.
        assert_eq!(
            (r.ns[Phase::Load], r.ns[Phase::Compute], r.cur),
            (0, 20, None)
        );
    }
}

/// The loom model of the clock: a switch against a reading, every interleaving.
#[cfg(all(test, loom))]
mod model {
    use super::*;
    use loom::sync::Arc;

    /// A switch from `Load` (since 0) to `Compute` at 10, against a reading at 20: whatever the
    /// interleaving, the reading that stands has all 20 ns (10 and 10, or 20 still in Load).
    #[test]
    fn model_a_reading_never_splits_a_switch() {
        loom::model(|| {
            let c = Arc::new(PhaseClock::default());
            c.switch(0, Some(Phase::Load));
            let writer = {
                let c = Arc::clone(&c);
                loom::thread::spawn(move || c.switch(10, Some(Phase::Compute)))
            };
            if let Some(r) = c.try_read(20, true) {
                let whole = match r.cur {
                    Some(Phase::Load) => r.ns[Phase::Load] == 20 && r.ns[Phase::Compute] == 0,
                    Some(Phase::Compute) => r.ns[Phase::Load] == 10 && r.ns[Phase::Compute] == 10,
                    _ => false,
                };
                assert!(whole, "a torn reading stood: {r:?}");
            }
            writer.join().unwrap();
            let r = c.try_read(20, true).expect("no switch under way");
            assert_eq!((r.ns[Phase::Load], r.ns[Phase::Compute]), (10, 10));
        });
    }
}
