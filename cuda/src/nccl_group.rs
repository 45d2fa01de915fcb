//! The drafter group's gradient on NCCL: [`NcclTransport`] is the [`Transport`] of
//! `collective::split`, which makes one communicator per membership epoch and commits each step
//! in the shared-memory group (see there for why that keeps batches exactly once).
//!
//! How a dead peer is survived, NCCL's blocking calls being what they are:
//! - `ncclCommInitRank` waits for every rank and cannot be interrupted, so it runs on a thread
//!   of its own; the caller polls its answer and `give_up`. A thread given up on is left; if its
//!   init ever returns, the communicator it made is aborted (dropped unclaimed). With
//!   `NCCL_RUNTIME_CONNECT=0` (the launcher sets it for drafters) the peers are connected inside
//!   init, so no collective call blocks the host later.
//! - A collective is queued on the exchange's stream and its completion polled (an event),
//!   with `ncclCommGetAsyncError` and `give_up` asked between polls; on giving up the
//!   communicator is aborted (`ncclCommAbort` stops its kernels, which would otherwise spin
//!   waiting for the dead peer).
//! - A peer's failure seen by NCCL first (`ncclRemoteError`, from init or in the background) is
//!   not this rank's: it waits, up to [`PEER_GRACE`], for the launcher to remove the dead peer
//!   (then the exchange is abandoned and the group goes on without it); only past that, or for
//!   an error of its own, does the rank fail.
//!
//! Where the gradient is: a backend that keeps it on the device ([`OnDevice`]: the DFlash
//! drafter on a GPU) has the exchange reduce it there, from the rank's buffer into a sum its
//! update reads, and the round's host words carry none of it: no copy to or from the host. A
//! host gradient (the words of the round) is copied to the device, all-reduced there and copied
//! back. Not yet run on a GPU.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an [`OnDevice`] exchange fails with (the group's transport error).
pub use collective::split::TransportError;
use collective::split::{Board, Exchange, Transport, POLL};

use crate::nccl::{Comm, Nccl, UniqueId};
use crate::{CudaContext, CudaError, CudaSlice, CudaStream, Named};
/// How often an exchange in flight looks at its completion event.
const SPIN: Duration = Duration::from_micros(100);

/// NCCL's `ncclRemoteError`: a peer failed (its process died, or its network did).
const REMOTE_ERROR: i32 = 6;

/// How long a rank whose peer failed waits for the launcher to remove that peer (it notices a
/// dead worker within its supervision tick) before failing itself.
pub const PEER_GRACE: Duration = Duration::from_secs(30);

/// What NCCL's error `e` means for this rank: a peer's failure waits for the membership to move
/// on (`give_up`), then the exchange is abandoned; anything else, or a peer's failure the
/// launcher never acts on, fails this rank.
fn settle(e: CudaError, give_up: &dyn Fn() -> bool) -> TransportError {
    if matches!(
        e,
        CudaError::Nccl {
            code: REMOTE_ERROR,
            ..
        }
    ) {
        let since = Instant::now();
        while since.elapsed() < PEER_GRACE {
            if give_up() {
                return TransportError::Abandoned;
            }
            std::thread::sleep(POLL);
        }
    }
    failed(e)
}

/// A rank's gradient kept on its device between its step and its update, where the exchange
/// reads it and leaves the group's sum. Implemented where the model's tensors are (the `gpu`
/// crate), so this crate needs no tensor library.
pub trait OnDevice: Send + Sync {
    /// Calls `exchange` with the rank's gradient and a buffer of as many f32 for the sum, both
    /// ready for work queued on `stream` (made to wait for the step that wrote the gradient),
    /// and keeps the sum for the update once `exchange` returned Ok (the sum complete by then).
    /// On an error the rank's gradient is kept for another try, and neither buffer is freed
    /// before the next exchange: the failed one's kernels may run until its communicator is
    /// aborted, after the error returns.
    fn exchange(
        &self,
        stream: &CudaStream,
        exchange: &mut Reduce<'_>,
    ) -> Result<(), TransportError>;
}

/// An exchange of a device gradient: from the rank's buffer into the sum's.
pub type Reduce<'a> =
    dyn FnMut(&CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<(), TransportError> + 'a;

/// Where an exchange's gradient is.
#[derive(Clone)]
enum Gradient {
    /// The round's words, on the host.
    Host,
    /// On the device, the round's words carrying none of it.
    Device(Arc<dyn OnDevice>),
}

/// Communicators of one GPU's drafter rank, an epoch at a time.
pub struct NcclTransport {
    nccl: Nccl,
    ctx: Arc<CudaContext>,
    board: Board,
    gradient: Gradient,
}

impl NcclTransport {
    /// Communicators on `ctx`'s device, each exchanging on a stream of its own (so nothing an
    /// aborted one left queued delays the next); ids of each epoch through `board`. The
    /// gradient is the round's words, on the host.
    pub fn new(nccl: Nccl, ctx: Arc<CudaContext>, board: Board) -> Self {
        NcclTransport {
            nccl,
            ctx,
            board,
            gradient: Gradient::Host,
        }
    }

    /// Like [`NcclTransport::new`], the gradient kept on the device by `grad`: the round's words
    /// (the group's `grad_len`) must be none of it.
    pub fn on_device(
        nccl: Nccl,
        ctx: Arc<CudaContext>,
        board: Board,
        grad: Arc<dyn OnDevice>,
    ) -> Self {
        NcclTransport {
            gradient: Gradient::Device(grad),
            ..NcclTransport::new(nccl, ctx, board)
        }
    }
}

fn failed(e: impl std::fmt::Display) -> TransportError {
    TransportError::Failed(e.to_string())
}

impl Transport for NcclTransport {
    type Comm = NcclExchange;

    fn connect(
        &mut self,
        epoch: u16,
        rank: u32,
        ranks: u32,
        give_up: &dyn Fn() -> bool,
    ) -> Result<NcclExchange, TransportError> {
        let id = if rank == 0 {
            let id = self.nccl.unique_id().map_err(failed)?;
            self.board.publish(epoch, &id.0)?;
            id
        } else {
            let bytes = self.board.wait(epoch, give_up)?;
            UniqueId(bytes.try_into().map_err(|b: Vec<u8>| {
                failed(format!(
                    "epoch {epoch}'s NCCL id has {} bytes, not 128",
                    b.len()
                ))
            })?)
        };
        let stream = self
            .ctx
            .new_stream()
            .named("cuStreamCreate")
            .map_err(failed)?;
        let (tx, rx) = mpsc::channel();
        let (nccl, ctx) = (self.nccl, self.ctx.clone());
        std::thread::Builder::new()
            .name(format!("nccl-init-{epoch}"))
            .spawn(move || {
                // Nobody waiting any more: the communicator drops here, aborted.
                let _ = tx.send(nccl.init_rank(&ctx, ranks, &id, rank));
            })
            .map_err(failed)?;
        loop {
            match rx.recv_timeout(POLL) {
                Ok(made) => {
                    return Ok(NcclExchange {
                        comm: made.map_err(|e| settle(e, give_up))?,
                        stream,
                        gradient: self.gradient.clone(),
                        bufs: None,
                    })
                }
                Err(mpsc::RecvTimeoutError::Timeout) if give_up() => {
                    return Err(TransportError::Abandoned)
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(failed("the NCCL init thread ended without an answer"))
                }
            }
        }
    }
}

/// One epoch's communicator, with device buffers for the exchange of a host gradient.
pub struct NcclExchange {
    comm: Comm,
    stream: Arc<CudaStream>,
    gradient: Gradient,
    /// Send and receive buffers of a host gradient, made for the first exchange's size.
    bufs: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl NcclExchange {
    /// Sums `count` floats of `send` over the ranks into `recv` and waits for it, asking NCCL
    /// for a background error and `give_up` between polls of its completion.
    fn reduce(
        comm: &Comm,
        stream: &CudaStream,
        send: &CudaSlice<f32>,
        recv: &mut CudaSlice<f32>,
        count: usize,
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        comm.all_reduce_sum_f32(send, recv, count, stream)
            .map_err(|e| settle(e, give_up))?;
        let done = stream
            .record_event(None)
            .named("cuEventRecord")
            .map_err(failed)?;
        let mut asked = Instant::now();
        while !done
            .try_is_complete()
            .named("cuEventQuery")
            .map_err(failed)?
        {
            if asked.elapsed() >= POLL {
                comm.async_error().map_err(|e| settle(e, give_up))?;
                if give_up() {
                    return Err(TransportError::Abandoned);
                }
                asked = Instant::now();
            }
            std::thread::sleep(SPIN);
        }
        Ok(())
    }
}

impl Exchange for NcclExchange {
    fn all_reduce(
        &mut self,
        data: &[f32],
        out: &mut [f32],
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let (comm, s) = (&self.comm, &self.stream);
        if let Gradient::Device(grad) = &self.gradient {
            if !data.is_empty() {
                return Err(failed(format!(
                    "{} gradient words on the host for an exchange whose gradient is on the \
                     device",
                    data.len()
                )));
            }
            return grad.exchange(s, &mut |mine, sum| {
                Self::reduce(comm, s, mine, sum, mine.len(), give_up)
            });
        }
        if self
            .bufs
            .as_ref()
            .is_none_or(|(b, _)| b.len() != data.len())
        {
            let alloc = || s.alloc_zeros::<f32>(data.len()).named("cuMemAlloc");
            self.bufs = Some((alloc().map_err(failed)?, alloc().map_err(failed)?));
        }
        let (send, recv) = self.bufs.as_mut().expect("made above");
        s.memcpy_htod(data, send)
            .named("cuMemcpyHtoDAsync")
            .map_err(failed)?;
        Self::reduce(comm, s, send, recv, data.len(), give_up)?;
        s.memcpy_dtoh(recv, out)
            .named("cuMemcpyDtoHAsync")
            .map_err(failed)?;
        s.synchronize().named("cuStreamSynchronize").map_err(failed)
    }

    fn abort(self) -> Result<(), TransportError> {
        self.comm.abort().map_err(failed)
    }
}
