//! The group with its gradient on a device transport ([`SplitGroup`]), on an in-process
//! transport that behaves as NCCL does at its worst: connecting waits for every member, an
//! exchange waits for every member's part, and nothing tells a peer that a rank died. What the
//! CPU can show of the NCCL path: the same sum on every rank, exactly one commit per step, and
//! no rank hangs when another dies inside a connection or an exchange.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use collective::split::{Board, Exchange, SplitGroup, Transport, TransportError, POLL};
use collective::{Collective, GroupError, GroupParams, Reduced, ShmGroup, NO_BATCH};

/// Gradient words per round, and the words committed in the group.
const GRAD: usize = 1000;
const REST: usize = 2;

fn name(tag: &str) -> String {
    format!("hspipe-test-split-{tag}-{}", std::process::id())
}

/// One exchange's parts, by rank, and how many ranks read the sum.
type Parts = (Vec<Option<Vec<f32>>>, u32);
/// What a rank's thread sends for each step: rank, step, and the round's outcome and sum.
type Outcome = (u32, u32, Result<(Reduced, Vec<f32>), GroupError>);

/// Every communicator of the test: connections and exchange parts by communicator id.
#[derive(Default)]
struct World {
    st: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Ranks connected, per communicator.
    connected: HashMap<u64, u32>,
    /// Parts of each exchange (communicator, sequence), and how many ranks read the sum.
    parts: HashMap<(u64, u64), Parts>,
    aborted: HashSet<u64>,
    /// Aborts, counted per rank.
    aborts: u32,
    /// Communicators made, for the test's assertions.
    made: u32,
    /// Exchanges that began, per (communicator, sequence).
    arrived: HashMap<(u64, u64), u32>,
    /// Group ranks whose exchanges fail (a device error of theirs), from their n-th exchange on
    /// a communicator.
    failing: HashMap<u32, u64>,
}

impl World {
    /// Waits (at most 60 s: a watchdog, not a clock under test) until `f` holds.
    fn wait_until(&self, what: &str, f: impl Fn(&State) -> bool) {
        let g = self.st.lock().unwrap();
        let (g, to) = (self.cv)
            .wait_timeout_while(g, Duration::from_secs(60), |s| !f(s))
            .unwrap();
        drop(g);
        assert!(!to.timed_out(), "never: {what}");
    }
}

struct Local {
    world: Arc<World>,
    board: Board,
    /// This rank's number in the group (not its position in an epoch).
    group_rank: u32,
}

struct LocalComm {
    world: Arc<World>,
    id: u64,
    rank: u32,
    ranks: u32,
    seq: u64,
    group_rank: u32,
}

impl Transport for Local {
    type Comm = LocalComm;
    fn connect(
        &mut self,
        epoch: u16,
        rank: u32,
        ranks: u32,
        give_up: &dyn Fn() -> bool,
    ) -> Result<LocalComm, TransportError> {
        let id = if rank == 0 {
            let id = {
                let mut s = self.world.st.lock().unwrap();
                s.next_id += 1;
                s.next_id
            };
            self.board.publish(epoch, &id.to_le_bytes())?;
            id
        } else {
            let b = self.board.wait(epoch, give_up)?;
            u64::from_le_bytes(b.try_into().expect("8 bytes"))
        };
        let mut s = self.world.st.lock().unwrap();
        *s.connected.entry(id).or_default() += 1;
        self.world.cv.notify_all();
        while s.connected[&id] < ranks {
            if give_up() {
                return Err(TransportError::Abandoned);
            }
            s = self.world.cv.wait_timeout(s, POLL).unwrap().0;
        }
        s.made += 1;
        Ok(LocalComm {
            world: self.world.clone(),
            id,
            rank,
            ranks,
            seq: 0,
            group_rank: self.group_rank,
        })
    }
}

impl Exchange for LocalComm {
    fn all_reduce(
        &mut self,
        data: &[f32],
        out: &mut [f32],
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        self.seq += 1;
        let key = (self.id, self.seq);
        let mut s = self.world.st.lock().unwrap();
        if s.failing
            .get(&self.group_rank)
            .is_some_and(|&from| self.seq >= from)
        {
            return Err(TransportError::Failed("an illegal memory access".into()));
        }
        let n = self.ranks as usize;
        s.parts.entry(key).or_insert_with(|| (vec![None; n], 0)).0[self.rank as usize] =
            Some(data.to_vec());
        *s.arrived.entry(key).or_default() += 1;
        self.world.cv.notify_all();
        loop {
            let (parts, read) = s.parts.get_mut(&key).expect("removed only once all read");
            if parts.iter().all(Option::is_some) {
                // In rank order, so every rank gets the same bits.
                out.fill(0.0);
                for p in parts.iter().flatten() {
                    for (o, x) in out.iter_mut().zip(p) {
                        *o += x;
                    }
                }
                *read += 1;
                if *read == self.ranks {
                    s.parts.remove(&key);
                }
                return Ok(());
            }
            if give_up() {
                return Err(TransportError::Abandoned);
            }
            s = self.world.cv.wait_timeout(s, POLL).unwrap().0;
        }
    }

    fn abort(self) -> Result<(), TransportError> {
        let mut s = self.world.st.lock().unwrap();
        s.aborted.insert(self.id);
        s.aborts += 1;
        drop(s);
        self.world.cv.notify_all();
        Ok(())
    }
}

struct Fixture {
    name: String,
    launcher: ShmGroup,
    world: Arc<World>,
    board: tempfile::TempDir,
}

fn fixture(tag: &str, ranks: u32) -> Fixture {
    let name = name(tag);
    let launcher = ShmGroup::create(
        &name,
        &GroupParams {
            ranks,
            buf_len: REST as u64,
            state_len: 1,
            initial_step: 0,
        },
    )
    .unwrap();
    Fixture {
        name,
        launcher,
        world: Arc::default(),
        board: tempfile::tempdir().unwrap(),
    }
}

impl Fixture {
    fn rank(&self, r: u32) -> SplitGroup<Local> {
        self.rank_with(r, GRAD)
    }

    /// Rank `r` whose rounds have `grad` words through the transport.
    fn rank_with(&self, r: u32, grad: usize) -> SplitGroup<Local> {
        let commit = ShmGroup::attach(&self.name, r).unwrap();
        let t = Local {
            world: self.world.clone(),
            board: Board::new(self.board.path()).unwrap(),
            group_rank: r,
        };
        SplitGroup::new(Box::new(commit), grad, t)
    }
}

/// Rank `r`'s words for a step: its gradient `r + 1` everywhere (step-scaled), then a token
/// count of 1 and the step.
fn words(r: u32, step: u32) -> Vec<f32> {
    let mut v = vec![(r + 1) as f32 * step as f32; GRAD];
    v.extend([1.0, step as f32]);
    v
}

/// Runs `steps` rounds as rank `r`, sending each result on `tx`; `stop_after` ends the thread
/// before that step's round (a rank that dies between its steps).
fn spawn_rank(
    f: &Fixture,
    r: u32,
    steps: std::ops::RangeInclusive<u32>,
    tx: &mpsc::Sender<Outcome>,
) -> std::thread::JoinHandle<()> {
    let g = f.rank(r);
    let tx = tx.clone();
    std::thread::spawn(move || {
        for step in steps {
            let data = words(r, step);
            let mut out = vec![0.0; GRAD + REST];
            let got = g.all_reduce(&data, u64::from(r), &mut out, &|| false);
            let ok = got.is_ok();
            let _ = tx.send((r, step, got.map(|red| (red, out))));
            if !ok {
                return;
            }
        }
    })
}

/// The next result, or a failed test if none comes within a minute (a hang).
fn next<T>(rx: &mpsc::Receiver<T>) -> T {
    rx.recv_timeout(Duration::from_secs(60))
        .expect("a rank hung: no result within 60 s")
}

#[test]
fn every_rank_gets_the_same_sum_and_each_step_commits_once() {
    let f = fixture("sum", 3);
    let (tx, rx) = mpsc::channel();
    let hs: Vec<_> = (0..3).map(|r| spawn_rank(&f, r, 1..=4, &tx)).collect();
    let mut by_step: HashMap<u32, Vec<Vec<f32>>> = HashMap::new();
    for _ in 0..12 {
        let (_, step, got) = next(&rx);
        let (red, out) = got.unwrap();
        assert_eq!(red.step, step, "one commit per step, in order");
        by_step.entry(step).or_default().push(out);
    }
    for (step, outs) in by_step {
        // (1 + 2 + 3) * step in every gradient word; the tokens summed by the commit round.
        assert!(outs[0][..GRAD].iter().all(|&x| x == 6.0 * step as f32));
        assert_eq!(outs[0][GRAD..], [3.0, 3.0 * step as f32]);
        assert!(
            outs.iter().all(|o| o == &outs[0]),
            "the same bits everywhere"
        );
    }
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(
        f.world.st.lock().unwrap().made,
        3,
        "one communicator per rank"
    );
    assert_eq!(f.launcher.membership().step, 4);
}

/// Rank 2 dies after step 1 while ranks 0 and 1 are inside step 2's exchange (they have sent
/// their parts and wait for its, as NCCL's kernels would): once the launcher removes it, both
/// abandon the communicator, connect again at the new epoch, and commit step 2 with the sum of
/// the two, which holds nothing of rank 2's.
#[test]
fn ranks_waiting_in_an_exchange_for_a_dead_rank_go_on_without_it() {
    let f = fixture("dead", 3);
    let (tx, rx) = mpsc::channel();
    let survivors: Vec<_> = (0..2).map(|r| spawn_rank(&f, r, 1..=3, &tx)).collect();
    let victim = spawn_rank(&f, 2, 1..=1, &tx);
    for _ in 0..3 {
        assert_eq!(next(&rx).2.unwrap().0.step, 1);
    }
    victim.join().unwrap();
    // Both survivors are inside step 2's exchange on the first communicator: its 2nd round.
    f.world
        .wait_until("both survivors in step 2's exchange", |s| {
            s.arrived.iter().any(|(&(_, seq), &n)| seq == 2 && n == 2)
        });
    let gone = f.launcher.remove(2).unwrap();
    assert!(gone.was_member);
    // Its last part in a commit is step 1's (batch 2), which it had trained and released;
    // step 2's went nowhere.
    let committed = gone.committed.map(|c| (c.batch, c.step));
    assert_eq!(committed, Some((2, 1)));
    for _ in 0..4 {
        let (_, step, got) = next(&rx);
        let (red, out) = got.unwrap();
        assert_eq!((red.step, red.membership.members), (step, 0b011));
        assert!(
            out[..GRAD].iter().all(|&x| x == 3.0 * step as f32),
            "ranks 0 and 1 only"
        );
        assert_eq!(out[GRAD], 2.0, "two ranks' tokens");
    }
    for h in survivors {
        h.join().unwrap();
    }
    let s = f.world.st.lock().unwrap();
    assert_eq!(s.aborts, 2, "each survivor aborted its communicator");
    assert_eq!(s.aborted.len(), 1, "the first one");
    assert_eq!(s.made, 3 + 2, "and made one at the new epoch");
}

/// A gradient kept on the device (NCCL's exchange reduces it there; no round words of it): the
/// transport is still called in every round, a redone one included, so every rank's exchange
/// leaves it a sum. Rank 1 dies before step 2; rank 0, waiting in step 2's exchange, redoes the
/// step alone on a new communicator, and that redo exchanges too.
#[test]
fn a_gradient_off_the_round_is_exchanged_in_every_round_and_every_redo() {
    let f = fixture("resident", 2);
    let (tx, rx) = mpsc::channel();
    let (g0, g1) = (f.rank_with(0, 0), f.rank_with(1, 0));
    let round = |g: SplitGroup<Local>, steps: u32, tx: mpsc::Sender<Outcome>| {
        std::thread::spawn(move || {
            for step in 1..=steps {
                let mut out = vec![0.0; REST];
                let got = g.all_reduce(&[1.0, step as f32], 0, &mut out, &|| false);
                let _ = tx.send((g.rank(), step, got.map(|red| (red, out))));
            }
        })
    };
    let (h0, h1) = (round(g0, 2, tx.clone()), round(g1, 1, tx));
    for _ in 0..2 {
        let (_, step, got) = next(&rx);
        assert_eq!((step, got.unwrap().1), (1, vec![2.0, 2.0]));
    }
    h1.join().unwrap();
    f.world.wait_until("rank 0 in step 2's exchange", |s| {
        s.arrived.iter().any(|(&(_, seq), _)| seq == 2)
    });
    f.launcher.remove(1).unwrap();
    let (r, step, got) = next(&rx);
    let (red, out) = got.unwrap();
    assert_eq!(
        (r, step, red.membership.members, out),
        (0, 2, 0b01, vec![1.0, 2.0])
    );
    h0.join().unwrap();
    let s = f.world.st.lock().unwrap();
    let began: u32 = s.arrived.values().sum();
    assert_eq!(
        began,
        2 + 1 + 1,
        "both in step 1, rank 0 in step 2 and in its redo"
    );
    assert_eq!(s.made, 2 + 1, "the redo on a communicator of the new epoch");
}

/// A member that never connects (dead before its first exchange): the others wait in the
/// connection, not forever: the launcher's removal lets them connect without it.
#[test]
fn a_member_that_never_connects_is_left_behind_once_removed() {
    let f = fixture("noshow", 3);
    let (tx, rx) = mpsc::channel();
    let hs: Vec<_> = (0..2).map(|r| spawn_rank(&f, r, 1..=2, &tx)).collect();
    f.world.wait_until("two ranks connecting", |s| {
        s.connected.values().any(|&n| n == 2)
    });
    f.launcher.remove(2).unwrap();
    for _ in 0..4 {
        let (_, step, got) = next(&rx);
        let (red, _) = got.unwrap();
        assert_eq!((red.step, red.membership.len()), (step, 2));
    }
    for h in hs {
        h.join().unwrap();
    }
}

/// Rank 1's exchange of step 2 fails (an error of its own device) while ranks 0 and 2 are
/// inside it: rank 1's round ends at once with the error (its worker exits; it cannot retry
/// alone: nobody else would connect again in this epoch); once the launcher removes it, the
/// other two go on without it. Nothing hangs, and step 2 commits once, without rank 1.
#[test]
fn a_rank_whose_exchange_fails_errs_at_once_and_the_others_go_on() {
    let f = fixture("fails", 3);
    let (tx, rx) = mpsc::channel();
    // Rank 1 fails at its second exchange, before its part is in: step 2 cannot complete.
    f.world.st.lock().unwrap().failing.insert(1, 2);
    let hs: Vec<_> = (0..3).map(|r| spawn_rank(&f, r, 1..=2, &tx)).collect();
    let mut failed = false;
    let mut committed = 0;
    while !failed || committed < 2 {
        let (r, step, got) = next(&rx);
        match got {
            Err(e) => {
                assert_eq!((r, step), (1, 2), "only rank 1 fails: {e}");
                assert!(
                    matches!(&e, GroupError::Transport(m) if m.contains("illegal memory access")),
                    "{e}"
                );
                failed = true;
                // The launcher's part, once the worker exited.
                f.launcher.remove(1).unwrap();
            }
            Ok((red, _)) if step == 1 => assert_eq!((red.step, red.membership.len()), (1, 3)),
            Ok((red, out)) => {
                assert_eq!((step, red.step, red.membership.members), (2, 2, 0b101));
                assert!(
                    out[..GRAD].iter().all(|&x| x == (1.0 + 3.0) * 2.0),
                    "ranks 0 and 2"
                );
                committed += 1;
            }
        }
    }
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(f.launcher.membership().step, 2);
}

/// A single rank's failed exchange is an error naming the failure, not a retry loop, and the
/// group stays failed (a retry would connect alone within the epoch); a stop request ends a
/// wait (for a member that never comes) as Stopped; a buffer of the wrong size is named.
#[test]
fn a_failed_exchange_is_an_error_and_a_stop_is_stopped() {
    let f = fixture("failing", 1);
    let g = f.rank(0);
    let mut out = vec![0.0; GRAD + REST];
    // A buffer of the wrong size is named, not a panic.
    let e = (g.all_reduce(&[0.0; 3], NO_BATCH, &mut [0.0; 3], &|| false)).unwrap_err();
    assert!(matches!(e, GroupError::Size { .. }), "{e}");
    f.world.st.lock().unwrap().failing.insert(0, 1);
    let e = (g.all_reduce(&words(0, 1), NO_BATCH, &mut out, &|| false)).unwrap_err();
    assert!(
        matches!(&e, GroupError::Transport(m) if m.contains("illegal memory access")),
        "{e}"
    );
    assert_eq!(f.launcher.membership().step, 0, "nothing committed");
    f.world.st.lock().unwrap().failing.clear();
    let again = (g.all_reduce(&words(0, 1), NO_BATCH, &mut out, &|| false)).unwrap_err();
    assert_eq!(again, e, "failed for good");
    // Rank 1 of two never comes: rank 0 waits to connect until its stop says so.
    let f = fixture("stopped", 2);
    let g = f.rank(0);
    let e = (g.all_reduce(&words(0, 1), NO_BATCH, &mut out, &|| true)).unwrap_err();
    assert_eq!(e, GroupError::Stopped);
}
