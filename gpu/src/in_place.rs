//! The copy-in that prepares a batch where it lies, on a copy thread, with the caller's
//! function: the drafter's intake parses and checksums it in its ring slot and has the backend
//! stage it (on the CPU, its context made; on a GPU, uploaded on the drafter's copy stream), so
//! that preparing batch `s+1` overlaps step `s`. [`Prefetch::in_place`] builds the double buffer around it; the result of
//! preparing a batch is [`InPlace::result`], once the step on it has begun.

use std::sync::{Mutex, PoisonError};

use crate::copy_thread::CopyThread;
use crate::prefetch::{CopyEngine, Prefetch, StableBytes};
use crate::{GpuError, BUFFERS};

/// The address of a batch that [`Prefetch`] owns while the copy thread reads it.
struct Lent {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a `Lent` reaches the copy thread only through `InPlace::start_copy`, which is called
// only by the `Prefetch` that owns the batch (`InPlace` is built only inside one, by
// `Prefetch::in_place`, and never handed out mutably). `Prefetch` keeps the batch until
// `finish(buf)` returns, `finish` and `before_step` wait for the thread's job on `buf`, and the
// engine (declared first in `Prefetch`) joins its thread before the batches are dropped, which
// `in_place`'s caller promises happens (the `Prefetch` is not leaked); the batch is
// `StableBytes`, so its bytes stay at `ptr` however it is moved meanwhile, and nothing writes
// them while it is held (also `StableBytes`'s promise), so reading them from another thread
// races with nothing.
unsafe impl Send for Lent {}

/// Prepares each batch on the copy thread with a caller's function; see the module.
pub struct InPlace<R> {
    thread: CopyThread<(Lent, Option<R>)>,
    /// The result of each buffer's completed preparation, until taken.
    results: Mutex<[Option<R>; BUFFERS]>,
}

impl<H: AsRef<[u8]> + StableBytes, R: Send + 'static> Prefetch<H, InPlace<R>> {
    /// A double buffer whose copy-in runs `prepare` on each batch's bytes where they lie, on a
    /// copy thread (see the module). `prepare` must not panic (a panic ends the copy thread,
    /// and every later step is an error).
    ///
    /// # Safety
    /// The `Prefetch` must be dropped (not leaked with `mem::forget` or a cycle) before any
    /// batch it holds, or the memory behind one, goes away: its drop waits for the copy thread,
    /// which may be reading a batch until then.
    pub unsafe fn in_place(prepare: impl Fn(&[u8]) -> R + Send + 'static) -> Self {
        let thread = CopyThread::new(move |_buf, job: &mut (Lent, Option<R>)| {
            // SAFETY: see `Lent`: the batch is owned by the `Prefetch` and unmoved in memory
            // until this job is seen complete.
            let bytes = unsafe { std::slice::from_raw_parts(job.0.ptr, job.0.len) };
            job.1 = Some(prepare(bytes));
        });
        Prefetch::new(InPlace {
            thread,
            results: Mutex::new([None, None]),
        })
    }
}

impl<R> InPlace<R> {
    /// The result of preparing the batch in `buf`, once (after [`Prefetch::begin_step`]
    /// returned `buf`; `None` before, or if taken already).
    pub fn result(&self, buf: usize) -> Option<R> {
        let mut r = self.results.lock().unwrap_or_else(PoisonError::into_inner);
        r.get_mut(buf)?.take()
    }
}

impl<R: Send + 'static> InPlace<R> {
    fn wait(&mut self, buf: usize) -> Result<(), GpuError> {
        self.thread.wait(buf)?;
        if let Some((_, r)) = self.thread.take_back(buf) {
            self.results.lock().unwrap_or_else(PoisonError::into_inner)[buf] = r;
        }
        Ok(())
    }
}

impl<H: AsRef<[u8]> + StableBytes, R: Send + 'static> CopyEngine<H> for InPlace<R> {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        let bytes = src.as_ref();
        let lent = Lent {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        };
        (self.results.lock().unwrap_or_else(PoisonError::into_inner))[buf] = None;
        self.thread.start(buf, (lent, None)).map_err(|(_, e)| e)
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
    use std::sync::{Arc, Condvar};
    use std::time::Duration;

    /// Which batches' preparation has begun, and which steps: the witness of the order.
    #[derive(Default)]
    struct Seen {
        prepared: Mutex<Vec<u8>>,
        stepping: Mutex<Vec<u8>>,
        cv: Condvar,
    }

    impl Seen {
        /// Waits (at most 20 s) until `list` holds `id`; false if it never did.
        fn wait_for(&self, list: &Mutex<Vec<u8>>, id: u8) -> bool {
            let g = list.lock().unwrap();
            let (g, to) = (self.cv)
                .wait_timeout_while(g, Duration::from_secs(20), |v| !v.contains(&id))
                .unwrap();
            drop(g);
            !to.timed_out()
        }
    }

    /// What the drafter relies on: batch `s+1` is prepared while step `s` computes (each step
    /// waits to see that preparation begin, and each preparation waits to see the previous
    /// step begin, at most 20 s each: an engine that prepared on the stepping thread, or a loop
    /// that pushed batch `s+1` only after step `s`, fails), every result belongs to its own
    /// batch, and batches come back in order. The order of events is the evidence, no clock.
    #[test]
    fn the_next_batch_is_prepared_while_a_step_computes_and_its_result_is_its_own() {
        let seen = Arc::new(Seen::default());
        let s2 = seen.clone();
        // SAFETY: `pf` is dropped at the end of the test, before the batches it handed back.
        let mut pf = unsafe {
            Prefetch::<Vec<u8>, _>::in_place(move |b: &[u8]| {
                let id = b[0];
                s2.prepared.lock().unwrap().push(id);
                s2.cv.notify_all();
                if id > 0 {
                    assert!(
                        s2.wait_for(&s2.stepping, id - 1),
                        "step {} never began",
                        id - 1
                    );
                }
                // A batch is good when every byte is its id: the stand-in for a checksum.
                b.iter().all(|&x| x == id)
            })
        };
        let n = 5u8;
        let mut bad = vec![3u8; 100];
        bad[57] = 0;
        let batch = |id: u8| if id == 3 { bad.clone() } else { vec![id; 100] };
        pf.push(batch(0)).unwrap();
        let mut results = Vec::new();
        for s in 0..n {
            let buf = pf.begin_step().unwrap().expect("a batch is held");
            if s + 1 < n {
                pf.push(batch(s + 1)).unwrap();
            }
            results.push(pf.engine().result(buf));
            assert_eq!(pf.engine().result(buf), None, "a result is taken once");
            seen.stepping.lock().unwrap().push(s);
            seen.cv.notify_all();
            if s + 1 < n {
                assert!(
                    seen.wait_for(&seen.prepared, s + 1),
                    "batch {} was not prepared while step {s} computed",
                    s + 1
                );
            }
            assert_eq!(
                pf.end_step(buf).unwrap()[0],
                s,
                "batches come back in order"
            );
        }
        let want: Vec<_> = (0..n).map(|s| Some(s != 3)).collect();
        assert_eq!(results, want, "each step sees its own batch's result");
        assert!(pf.is_empty());
    }
}
