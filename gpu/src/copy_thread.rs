//! The CPU engines' "copy engine": a thread that runs copies between host buffers standing in
//! for device memory and the caller's batches, so copies overlap the caller's work as a copy
//! stream's do. Jobs go in as `(buffer, item)`, the item comes back once its copy is done; a
//! copy into or out of a buffer is complete once [`CopyThread::wait`] for it returns.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::{GpuError, BUFFERS};

/// The "device" buffers.
pub(crate) type Buffers = Arc<[Mutex<Vec<u8>>; BUFFERS]>;

pub(crate) struct CopyThread<T> {
    jobs: Option<mpsc::Sender<(usize, T)>>,
    done: mpsc::Receiver<(usize, T)>,
    /// Copies started and not yet seen complete, per buffer.
    pending: [bool; BUFFERS],
    /// Items whose copy is complete, per buffer, until taken.
    back: [Option<T>; BUFFERS],
    bufs: Buffers,
    thread: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> CopyThread<T> {
    /// Starts the thread; `copy(buffer, item)` runs on it for each job.
    pub(crate) fn new(copy: impl Fn(&Mutex<Vec<u8>>, &mut T) + Send + 'static) -> Self {
        let (jobs, rx) = mpsc::channel::<(usize, T)>();
        let (done_tx, done) = mpsc::channel();
        let bufs: Buffers = Arc::new(Default::default());
        let b = bufs.clone();
        let thread = std::thread::spawn(move || {
            for (buf, mut item) in rx {
                copy(&b[buf], &mut item);
                if done_tx.send((buf, item)).is_err() {
                    break;
                }
            }
        });
        CopyThread {
            jobs: Some(jobs),
            done,
            pending: [false; BUFFERS],
            back: [None, None],
            bufs,
            thread: Some(thread),
        }
    }

    /// Buffer `buf`, for the caller's compute (never while a copy of it is pending).
    pub(crate) fn buffer(&self, buf: usize) -> MutexGuard<'_, Vec<u8>> {
        self.bufs[buf].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a copy between buffer `buf` and `item`; on failure the item comes back.
    pub(crate) fn start(&mut self, buf: usize, item: T) -> Result<(), (T, GpuError)> {
        let gone = || GpuError::Shape("the copy thread is gone".into());
        let Some(jobs) = &self.jobs else {
            return Err((item, gone()));
        };
        match jobs.send((buf, item)) {
            Ok(()) => {
                self.pending[buf] = true;
                Ok(())
            }
            Err(mpsc::SendError((_, item))) => Err((item, gone())),
        }
    }

    /// Waits until the copy of buffer `buf`, if one is pending, is complete.
    pub(crate) fn wait(&mut self, buf: usize) -> Result<(), GpuError> {
        while self.pending[buf] {
            let (b, item) = self
                .done
                .recv()
                .map_err(|_| GpuError::Shape("the copy thread is gone".into()))?;
            self.pending[b] = false;
            self.back[b] = Some(item);
        }
        Ok(())
    }

    /// The item of `buf`'s completed copy, once.
    pub(crate) fn take_back(&mut self, buf: usize) -> Option<T> {
        self.back[buf].take()
    }
}

impl<T> Drop for CopyThread<T> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
