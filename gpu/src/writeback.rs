//! Double-buffered write-back, the target's half of the data path, the same on every device:
//! batch `i`'s captured layers are copied from the device into its ring slot while the forward
//! of batch `i+1` runs into the other device buffer; a slot is handed back to be committed only
//! once its copy is complete.
//!
//! [`WriteBack`] is the bookkeeping; a [`CopyOutEngine`] does the copies: [`CpuCopyOut`] with a
//! copy thread (the logic runs and is tested on any machine) and
//! [`crate::cuda_copy::CudaCopyOut`] with a copy stream and events. The rules:
//!
//! - A forward into a buffer starts only after that buffer's last copy-out is complete
//!   (`before_forward`: the host waits on the CPU, the compute stream on the device).
//! - A copy-out starts only after the forward that filled the buffer (the engine orders it).
//! - While its copy is in flight the slot belongs to the engine; it comes back, complete, from
//!   [`WriteBack::next_buffer`] or [`WriteBack::complete_oldest`], oldest first, to be committed.
//!
//! Use, per batch: `next_buffer` (a buffer to run the forward into, and maybe a finished slot
//! to commit), the forward, `copy_out` into the batch's reserved slot; at the end,
//! `complete_oldest` until `None`.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::copy_thread::CopyThread;
use crate::{GpuError, BUFFERS};

/// Copies device buffers out into destinations it holds while the copy is in flight.
pub trait CopyOutEngine<H> {
    /// Makes the forward about to run into `buf` wait for `buf`'s last copy-out.
    fn before_forward(&mut self, buf: usize) -> Result<(), GpuError>;
    /// The forward into `buf` has been issued: begins copying the first `dst.len()` bytes of
    /// `buf` into `dst` after it, without waiting. The engine holds `dst` until
    /// [`CopyOutEngine::complete`]; on an error `dst` comes back, no copy in flight into it.
    fn start_copy_out(&mut self, buf: usize, dst: H) -> Result<(), (H, GpuError)>;
    /// Waits for `buf`'s copy-out and returns its destination, filled.
    fn complete(&mut self, buf: usize) -> Result<H, GpuError>;
}

/// The double buffer of a target: at most [`BUFFERS`] copies in flight, returned in order.
pub struct WriteBack<H, E: CopyOutEngine<H>> {
    /// An asynchronous engine waits for its copies in its `Drop`.
    engine: E,
    /// Buffers with a copy in flight, oldest first.
    in_flight: VecDeque<usize>,
    _h: std::marker::PhantomData<fn(H) -> H>,
}

impl<H, E: CopyOutEngine<H>> WriteBack<H, E> {
    pub fn new(engine: E) -> Self {
        WriteBack {
            engine,
            in_flight: VecDeque::new(),
            _h: std::marker::PhantomData,
        }
    }

    /// A buffer for the next forward, ready to be written (its last copy-out waited for), and
    /// the slot of that copy if one was in flight: commit it. On an error nothing changed.
    pub fn next_buffer(&mut self) -> Result<(usize, Option<H>), GpuError> {
        if let Some(b) = (0..BUFFERS).find(|b| !self.in_flight.contains(b)) {
            self.engine.before_forward(b)?;
            return Ok((b, None));
        }
        let b = *self.in_flight.front().expect("all buffers in flight");
        self.engine.before_forward(b)?;
        let done = self.engine.complete(b)?;
        self.in_flight.pop_front();
        Ok((b, Some(done)))
    }

    /// After the forward into `buf` was issued: copies it out into `dst`, asynchronously. On
    /// an error `dst` comes back.
    pub fn copy_out(&mut self, buf: usize, dst: H) -> Result<(), (H, GpuError)> {
        if buf >= BUFFERS || self.in_flight.contains(&buf) {
            let e = GpuError::Shape(format!(
                "write-back: buffer {buf} is not free for a copy-out"
            ));
            return Err((dst, e));
        }
        self.engine.start_copy_out(buf, dst)?;
        self.in_flight.push_back(buf);
        Ok(())
    }

    /// Waits for the oldest copy in flight and hands back its slot; `None` when none is. On an
    /// error the copy stays in flight.
    pub fn complete_oldest(&mut self) -> Result<Option<H>, GpuError> {
        let Some(&b) = self.in_flight.front() else {
            return Ok(None);
        };
        let done = self.engine.complete(b)?;
        self.in_flight.pop_front();
        Ok(Some(done))
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The engine, to write the device buffer a forward fills (`next_buffer` said which). The
    /// bookkeeping stays here: an engine's own calls made through this are the caller's to
    /// keep in order.
    pub fn engine_mut(&mut self) -> &mut E {
        &mut self.engine
    }
}

/// The CPU "device": buffers are host vectors, and a copy thread copies them out into the
/// destinations (which travel to it and back), overlapping the caller's next forward.
pub struct CpuCopyOut<H> {
    thread: CopyThread<(usize, H)>,
}

impl<H: AsMut<[u8]> + Send + 'static> CpuCopyOut<H> {
    /// Starts the copy thread; `observe(buf, &dst, start)` is called on it just before and
    /// just after each copy.
    pub fn new(observe: impl Fn(usize, &H, bool) + Send + 'static) -> CpuCopyOut<H> {
        let thread = CopyThread::new(move |buf: &Mutex<Vec<u8>>, dst: &mut (usize, H)| {
            observe(dst.0, &dst.1, true);
            {
                let src = buf.lock().unwrap_or_else(|p| p.into_inner());
                let d = dst.1.as_mut();
                // `start_copy_out` checked that the buffer holds d.len() bytes.
                let n = d.len().min(src.len());
                d[..n].copy_from_slice(&src[..n]);
            }
            observe(dst.0, &dst.1, false);
        });
        CpuCopyOut { thread }
    }

    /// Buffer `buf`, for the forward to write into.
    pub fn buffer(&self, buf: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.thread.buffer(buf)
    }
}

impl<H: AsMut<[u8]> + Send + 'static> CopyOutEngine<H> for CpuCopyOut<H> {
    fn before_forward(&mut self, buf: usize) -> Result<(), GpuError> {
        self.thread.wait(buf)
    }

    fn start_copy_out(&mut self, buf: usize, mut dst: H) -> Result<(), (H, GpuError)> {
        let have = self.buffer(buf).len();
        let want = dst.as_mut().len();
        if want > have {
            return Err((dst, GpuError::BufferSize { got: have, want }));
        }
        self.thread
            .start(buf, (buf, dst))
            .map_err(|((_, dst), e)| (dst, e))
    }

    fn complete(&mut self, buf: usize) -> Result<H, GpuError> {
        self.thread.wait(buf)?;
        self.thread
            .take_back(buf)
            .map(|(_, dst)| dst)
            .ok_or_else(|| GpuError::Shape(format!("write-back: no copy-out of buffer {buf}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::Condvar;
    use std::time::Duration;

    #[derive(Default)]
    struct Log {
        events: Mutex<Vec<String>>,
        cv: Condvar,
    }

    impl Log {
        fn note(&self, what: String) {
            self.events.lock().unwrap().push(what);
            self.cv.notify_all();
        }
        fn index(&self, what: &str) -> usize {
            let ev = self.events.lock().unwrap();
            ev.iter()
                .position(|w| w == what)
                .unwrap_or_else(|| panic!("no event {what:?} in {ev:?}"))
        }
        /// Waits (at most 20 s) until `what` is logged; false if it never was.
        fn wait_for(&self, what: &str) -> bool {
            let ev = self.events.lock().unwrap();
            let (_ev, to) = self
                .cv
                .wait_timeout_while(ev, Duration::from_secs(20), |v| {
                    !v.iter().any(|w| w == what)
                })
                .unwrap();
            !to.timed_out()
        }
    }

    /// A reserved slot: its batch id and bytes.
    struct Slot(u64, Vec<u8>);
    impl AsMut<[u8]> for Slot {
        fn as_mut(&mut self) -> &mut [u8] {
            &mut self.1
        }
    }

    /// Reproduces what write-back is for: batch `i`'s copy-out is in flight while the forward
    /// of batch `i+1` runs. Each copy-out waits to finish until the next forward has begun,
    /// and each forward waits to end until the previous copy-out has begun (each wait at most
    /// 20 s), so a loop that copied synchronously, or ran the forward only after the copy,
    /// fails the order checks. Every slot comes back once, in order, with its own batch's
    /// bytes.
    #[test]
    fn a_copy_out_is_in_flight_while_the_next_forward_runs_and_slots_return_in_order() {
        let log = Arc::new(Log::default());
        let l = log.clone();
        let engine = CpuCopyOut::new(move |_buf, s: &Slot, start| {
            let i = s.0;
            l.note(format!("copy {i} {}", if start { "start" } else { "end" }));
            if start {
                l.wait_for(&format!("forward {} start", i + 1));
            }
        });
        let mut wb = WriteBack::new(engine);
        let n = 6u64;
        let mut committed = Vec::new();
        for i in 0..n {
            let (buf, done) = wb.next_buffer().unwrap();
            committed.extend(done);
            log.note(format!("forward {i} start"));
            {
                let mut b = wb.engine().buffer(buf);
                b.clear();
                b.resize(1000 + i as usize, i as u8 + 1);
            }
            if i > 0 {
                assert!(
                    log.wait_for(&format!("copy {} start", i - 1)),
                    "the copy-out of batch {} never began while forward {i} ran",
                    i - 1
                );
            }
            log.note(format!("forward {i} end"));
            if wb
                .copy_out(buf, Slot(i, vec![0; 1000 + i as usize]))
                .is_err()
            {
                panic!("copy-out of batch {i} refused");
            }
        }
        // The last forward has nothing after it to wait for its copy.
        log.note(format!("forward {n} start"));
        while let Some(s) = wb.complete_oldest().unwrap() {
            committed.push(s);
        }
        let ids: Vec<u64> = committed.iter().map(|s| s.0).collect();
        assert_eq!(ids, (0..n).collect::<Vec<_>>(), "every slot once, in order");
        for s in &committed {
            assert!(
                s.1.iter().all(|&x| x == s.0 as u8 + 1),
                "slot {} holds its own batch's bytes",
                s.0
            );
        }
        for i in 0..n - 1 {
            assert!(
                log.index(&format!("copy {i} start"))
                    < log.index(&format!("forward {} end", i + 1))
            );
            assert!(
                log.index(&format!("copy {i} end"))
                    > log.index(&format!("forward {} start", i + 1))
            );
        }
    }

    #[test]
    fn a_busy_buffer_or_a_too_long_slot_is_refused_and_the_slot_handed_back() {
        let mut wb = WriteBack::new(CpuCopyOut::new(|_, _: &Slot, _| {}));
        let (buf, none) = wb.next_buffer().unwrap();
        assert!(none.is_none());
        wb.engine().buffer(buf).resize(4, 9);
        match wb.copy_out(buf, Slot(0, vec![0; 5])) {
            Err((s, GpuError::BufferSize { got: 4, want: 5 })) => assert_eq!(s.0, 0),
            Err((_, e)) => panic!("wrong error {e}"),
            Ok(()) => panic!("a slot longer than the buffer was taken"),
        }
        assert!(wb.copy_out(buf, Slot(0, vec![0; 4])).is_ok());
        match wb.copy_out(buf, Slot(1, vec![0; 4])) {
            Err((s, _)) => assert_eq!(s.0, 1, "the refused slot comes back"),
            Ok(()) => panic!("a buffer with a copy in flight took another"),
        }
        assert!(
            wb.copy_out(7, Slot(2, vec![0; 4])).is_err(),
            "no such buffer"
        );
        let back = wb.complete_oldest().unwrap().unwrap();
        assert_eq!((back.0, back.1.as_slice()), (0, &[9u8; 4][..]));
        assert!(wb.complete_oldest().unwrap().is_none());
    }
}
