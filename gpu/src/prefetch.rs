//! Double-buffered prefetch, the same on every device: while step `s` computes on one device
//! buffer, batch `s+1` (already taken from the ring and held) is copied into the other, so step
//! `s+1` starts without waiting for a copy.
//!
//! [`Prefetch`] is the bookkeeping: which buffer holds which batch, in which state, and in which
//! order batches are computed. A [`CopyEngine`] does the copies: [`CpuCopy`] with a copy thread
//! (so the logic runs and is tested on any machine), [`crate::cuda_copy::CudaCopy`] with a copy
//! stream and events. The rules, whatever the engine:
//!
//! - A copy into a buffer starts only after the step that last used that buffer has finished
//!   with it (the engine orders it: the CPU engine because `finish` waited; CUDA on the device,
//!   the copy stream waiting for the step's event).
//! - A step on a buffer starts only once that buffer's copy is complete (`before_step`).
//! - A batch comes back to the caller (to be released to the ring) only from [`Prefetch::end_step`],
//!   after its copy is complete: the source bytes are never released while being read. The
//!   caller keeps it longer if its own rule says so (the group's: held until the update that
//!   used it is applied).
//!
//! Use, per step: `begin_step` (oldest batch, its copy complete), `push` the next batch (its
//! copy overlaps this step), compute, `end_step` (the batch back, to release); at a stop,
//! `retire_oldest` until `None`.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::copy_thread::CopyThread;
use crate::{GpuError, BUFFERS};

/// Bytes that stay where they are when their owner moves: a borrowed slice, a heap buffer, a
/// ring slot's payload in shared memory. The bookkeeping moves a batch in after its copy has
/// started, so an engine that copies asynchronously (the CUDA one) needs this of its batches.
///
/// # Safety
/// The address of the bytes (`AsRef`/`AsMut`) must not change while the value lives, however
/// often it is moved, and nothing may write them through a shared reference (`&Self`): an
/// engine reads them on another thread while the caller may hold `&Self`.
pub unsafe trait StableBytes {}
// SAFETY: a borrow's bytes are the borrowed value's, which a move of the borrow leaves alone.
unsafe impl StableBytes for &[u8] {}
// SAFETY: as above.
unsafe impl StableBytes for &mut [u8] {}
// SAFETY: moving a Vec moves its (pointer, length, capacity), not the heap bytes.
unsafe impl StableBytes for Vec<u8> {}

/// Copies batches into device buffers, asynchronously.
pub trait CopyEngine<H> {
    /// Begins copying `src`'s bytes into buffer `buf`, after the last step on `buf` is done
    /// with it; returns without waiting for the copy. `src` stays owned by [`Prefetch`] (and so
    /// valid) until `finish(buf)` has returned.
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError>;
    /// Makes the step about to run on `buf` wait for `buf`'s copy (the host waits, or the
    /// device does).
    fn before_step(&mut self, buf: usize) -> Result<(), GpuError>;
    /// The step on `buf` has been issued: records its end (so the next copy into `buf` waits
    /// for it) and returns once `buf`'s copy is complete on the host side, so the source may be
    /// released.
    fn finish(&mut self, buf: usize) -> Result<(), GpuError>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Copy issued, step not begun.
    Copying,
    /// Step begun on it.
    Computing,
}

/// The double buffer: at most [`BUFFERS`] batches held, computed in the order pushed.
pub struct Prefetch<H, E: CopyEngine<H>> {
    /// Declared first, so dropped first: an asynchronous engine waits for its copies in its
    /// `Drop`, before the batches they read are dropped.
    engine: E,
    bufs: [Option<(H, State)>; BUFFERS],
    /// Buffers in the order their batches were pushed.
    order: VecDeque<usize>,
}

impl<H, E: CopyEngine<H>> Prefetch<H, E> {
    pub fn new(engine: E) -> Self {
        Prefetch {
            engine,
            bufs: [None, None],
            order: VecDeque::new(),
        }
    }

    /// True if a buffer is free for [`Prefetch::push`].
    pub fn has_room(&self) -> bool {
        self.bufs.iter().any(Option::is_none)
    }

    /// Batches held (copying or computing).
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Takes `item` and starts copying it into a free buffer. With no buffer free the item is
    /// handed back in the error's place (nothing is lost).
    pub fn push(&mut self, item: H) -> Result<(), PushError<H>> {
        let Some(buf) = self.bufs.iter().position(Option::is_none) else {
            return Err(PushError::Full(item));
        };
        if let Err(e) = self.engine.start_copy(buf, &item) {
            return Err(PushError::Engine(item, e));
        }
        self.bufs[buf] = Some((item, State::Copying));
        self.order.push_back(buf);
        Ok(())
    }

    /// Begins the step on the oldest batch: its buffer, once its copy is complete (as the
    /// engine orders it). `None` with nothing held, or while a step is already running.
    pub fn begin_step(&mut self) -> Result<Option<usize>, GpuError> {
        let Some(&buf) = self.order.front() else {
            return Ok(None);
        };
        let entry = self.bufs[buf]
            .as_mut()
            .expect("ordered buffers hold a batch");
        if entry.1 == State::Computing {
            return Ok(None);
        }
        self.engine.before_step(buf)?;
        entry.1 = State::Computing;
        Ok(Some(buf))
    }

    /// Ends the step on `buf` (from [`Prefetch::begin_step`]) and returns its batch, whose copy
    /// is complete: the caller may release it.
    pub fn end_step(&mut self, buf: usize) -> Result<H, GpuError> {
        match (self.order.front(), self.bufs.get(buf)) {
            (Some(&b), Some(Some((_, State::Computing)))) if b == buf => {}
            _ => {
                return Err(GpuError::Shape(format!(
                    "prefetch: no step is running on buffer {buf}"
                )))
            }
        }
        self.engine.finish(buf)?;
        self.order.pop_front();
        Ok(self.bufs[buf].take().expect("checked above").0)
    }

    /// Hands back the oldest batch held once its copy is complete (at a stop or after an
    /// error: the caller releases or aborts it); `None` when nothing is held. On an error the
    /// batch stays held.
    pub fn retire_oldest(&mut self) -> Result<Option<H>, GpuError> {
        let Some(&buf) = self.order.front() else {
            return Ok(None);
        };
        self.engine.finish(buf)?;
        self.order.pop_front();
        Ok(Some(
            self.bufs[buf]
                .take()
                .expect("ordered buffers hold a batch")
                .0,
        ))
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The batch in buffer `buf`, if one is held there.
    pub fn held(&self, buf: usize) -> Option<&H> {
        self.bufs.get(buf)?.as_ref().map(|(h, _)| h)
    }
}

/// Why [`Prefetch::push`] did not take an item; the item comes back in either case.
#[derive(Debug)]
pub enum PushError<H> {
    /// Both buffers hold batches.
    Full(H),
    /// The engine could not start the copy.
    Engine(H, GpuError),
}

/// The CPU "device": buffers are host vectors and a copy thread fills them, so copies overlap
/// the caller's compute as a copy stream's do. `H` is a shared handle to the bytes (the copy
/// thread keeps a clone until its copy is done).
pub struct CpuCopy<H> {
    thread: CopyThread<(usize, H)>,
}

impl<H: AsRef<[u8]> + Send + 'static> CpuCopy<H> {
    /// Starts the copy thread. `observe` is called on it just before and just after each copy
    /// (`true` at the start), with the buffer: telemetry, or a test's witness of the order.
    pub fn new(observe: impl Fn(usize, &H, bool) + Send + 'static) -> CpuCopy<H> {
        let thread = CopyThread::new(move |buf: &Mutex<Vec<u8>>, src: &mut (usize, H)| {
            observe(src.0, &src.1, true);
            {
                let mut dst = buf.lock().unwrap_or_else(|p| p.into_inner());
                dst.clear();
                dst.extend_from_slice(src.1.as_ref());
            }
            observe(src.0, &src.1, false);
        });
        CpuCopy { thread }
    }

    /// The bytes in buffer `buf` (for the step computing on it).
    pub fn buffer(&self, buf: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.thread.buffer(buf)
    }

    fn wait(&mut self, buf: usize) -> Result<(), GpuError> {
        self.thread.wait(buf)?;
        // The copy thread's clone of the batch is no longer needed.
        drop(self.thread.take_back(buf));
        Ok(())
    }
}

impl<H: AsRef<[u8]> + Clone + Send + 'static> CopyEngine<H> for CpuCopy<H> {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        // The last step on `buf` ended before `finish` returned, so the buffer is free.
        self.thread
            .start(buf, (buf, src.clone()))
            .map_err(|(_, e)| e)
    }

    fn before_step(&mut self, buf: usize) -> Result<(), GpuError> {
        self.wait(buf)
    }

    fn finish(&mut self, buf: usize) -> Result<(), GpuError> {
        self.wait(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// A witness of the order of things across the copy thread and the stepping thread.
    #[derive(Default)]
    struct Log {
        seq: AtomicU64,
        events: Mutex<Vec<(u64, String)>>,
        copy_started: Mutex<Vec<u64>>,
        steps_started: Mutex<Vec<u64>>,
        cv: std::sync::Condvar,
    }

    impl Log {
        fn note(&self, what: String) -> u64 {
            let n = self.seq.fetch_add(1, Ordering::SeqCst);
            self.events.lock().unwrap().push((n, what));
            n
        }
        fn at(&self, what: &str) -> u64 {
            let ev = self.events.lock().unwrap();
            ev.iter()
                .find(|(_, w)| w == what)
                .unwrap_or_else(|| panic!("no event {what:?} in {ev:?}"))
                .0
        }
    }

    type Batch = Arc<(u64, Vec<u8>)>;

    #[derive(Clone, Debug)]
    struct B(Batch);
    impl AsRef<[u8]> for B {
        fn as_ref(&self) -> &[u8] {
            &self.0 .1
        }
    }

    fn batch(id: u64) -> B {
        B(Arc::new((id, vec![id as u8; 4096 + id as usize])))
    }

    fn engine(log: &Arc<Log>, gated: bool) -> CpuCopy<B> {
        let l = log.clone();
        CpuCopy::new(move |_buf, b: &B, start| {
            let id = b.0 .0;
            l.note(format!("copy {id} {}", if start { "start" } else { "end" }));
            if start {
                l.copy_started.lock().unwrap().push(id);
                l.cv.notify_all();
                // The copy of batch id stays in flight until step id-1 has begun (at most
                // 20 s): an engine that copied on the caller's thread would wait here for a
                // step that cannot begin, and the order checks below would fail.
                if gated && id > 0 {
                    let started = l.steps_started.lock().unwrap();
                    let _ =
                        l.cv.wait_timeout_while(started, Duration::from_secs(20), |v| {
                            !v.contains(&(id - 1))
                        });
                }
            }
        })
    }

    /// Reproduces what prefetching is for: the copy of batch `s+1` is in flight while step `s`
    /// computes. Each step blocks until it sees that copy begin, and each copy until it sees
    /// the previous step begin (each wait at most 20 s), so a loop that copied batch `s+1`
    /// only after step `s`, or an engine that copied synchronously, waits out a timeout and
    /// fails the order checks. No clock is asserted: the order of the logged events is the
    /// evidence.
    #[test]
    fn the_next_batch_is_copied_while_a_step_computes_and_comes_back_intact() {
        let log = Arc::new(Log::default());
        let mut pf = Prefetch::new(engine(&log, true));
        let n = 6u64;
        let mut next = 0u64;
        pf.push(batch(next)).unwrap();
        next += 1;
        let mut released = Vec::new();
        while let Some(buf) = pf.begin_step().unwrap() {
            // The batch being stepped: the oldest held.
            let s = released.len() as u64;
            if next < n {
                pf.push(batch(next)).unwrap();
                next += 1;
            }
            log.note(format!("step {s} start"));
            log.steps_started.lock().unwrap().push(s);
            log.cv.notify_all();
            {
                let data = pf.engine().buffer(buf);
                assert_eq!(data.len(), 4096 + s as usize, "step {s} sees its own batch");
                assert!(data.iter().all(|&x| x == s as u8), "step {s}: bytes intact");
            }
            if s + 1 < n {
                let started = log.copy_started.lock().unwrap();
                let (started, to) = log
                    .cv
                    .wait_timeout_while(started, Duration::from_secs(20), |v| !v.contains(&(s + 1)))
                    .unwrap();
                assert!(
                    !to.timed_out(),
                    "the copy of batch {} never began while step {s} computed",
                    s + 1
                );
                drop(started);
            }
            log.note(format!("step {s} end"));
            let b = pf.end_step(buf).unwrap();
            assert_eq!(b.0 .0, s, "batches come back in the order pushed");
            released.push(b.0 .0);
        }
        assert_eq!(
            released,
            (0..n).collect::<Vec<_>>(),
            "every batch once, in order"
        );
        for s in 0..n - 1 {
            // The copy of batch s+1 was in flight while step s ran: begun before the step
            // ended, ended after the step began.
            assert!(log.at(&format!("copy {} start", s + 1)) < log.at(&format!("step {s} end")));
            assert!(log.at(&format!("copy {} end", s + 1)) > log.at(&format!("step {s} start")));
            // and no step starts before its own copy is complete
            assert!(log.at(&format!("copy {s} end")) < log.at(&format!("step {s} start")));
        }
    }

    /// Two batches at most: a third push hands the item back; ending a step that is not running
    /// is an error, not a lost batch.
    #[test]
    fn a_full_prefetch_hands_the_batch_back_and_misuse_is_an_error() {
        let log = Arc::new(Log::default());
        let mut pf = Prefetch::new(engine(&log, false));
        pf.push(batch(0)).unwrap();
        pf.push(batch(1)).unwrap();
        assert!(!pf.has_room());
        match pf.push(batch(2)) {
            Err(PushError::Full(b)) => assert_eq!(b.0 .0, 2),
            other => panic!("expected Full, got {:?}", other.map(|_| ())),
        }
        assert!(pf.end_step(0).is_err(), "no step running yet");
        let buf = pf.begin_step().unwrap().unwrap();
        assert_eq!(pf.begin_step().unwrap(), None, "one step at a time");
        assert!(
            pf.end_step(1 - buf).is_err(),
            "the other buffer is not stepping"
        );
        assert_eq!(pf.end_step(buf).unwrap().0 .0, 0);
        assert_eq!(pf.retire_oldest().unwrap().map(|b| b.0 .0), Some(1));
        assert!(pf.retire_oldest().unwrap().is_none(), "nothing left");
        assert!(pf.is_empty());
    }
}
