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
//! The gradient is on the host (the drafter backends hand a host [`collective::Collective`]
//! buffer), so an exchange copies it to the device, all-reduces there and copies the sum back:
//! two copies per step that a device-resident gradient will save. Not yet run on a GPU.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use collective::split::{Board, Exchange, Transport, TransportError, POLL};
use zerocopy::IntoBytes;

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

/// Communicators of one GPU's drafter rank, an epoch at a time.
pub struct NcclTransport {
    nccl: Nccl,
    ctx: Arc<CudaContext>,
    board: Board,
}

impl NcclTransport {
    /// Communicators on `ctx`'s device, each exchanging on a stream of its own (so nothing an
    /// aborted one left queued delays the next); ids of each epoch through `board`.
    pub fn new(nccl: Nccl, ctx: Arc<CudaContext>, board: Board) -> Self {
        NcclTransport { nccl, ctx, board }
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

/// One epoch's communicator, with device buffers for the exchange.
pub struct NcclExchange {
    comm: Comm,
    stream: Arc<CudaStream>,
    /// Send and receive buffers, made for the first exchange's size.
    bufs: Option<(CudaSlice<u8>, CudaSlice<u8>)>,
}

impl Exchange for NcclExchange {
    fn all_reduce(
        &mut self,
        data: &[f32],
        out: &mut [f32],
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let bytes = data.as_bytes();
        if self
            .bufs
            .as_ref()
            .is_none_or(|(s, _)| s.len() != bytes.len())
        {
            let alloc = || {
                self.stream
                    .alloc_zeros::<u8>(bytes.len())
                    .named("cuMemAlloc")
            };
            self.bufs = Some((alloc().map_err(failed)?, alloc().map_err(failed)?));
        }
        let (send, recv) = self.bufs.as_mut().expect("made above");
        let s = &self.stream;
        s.memcpy_htod(bytes, send)
            .named("cuMemcpyHtoDAsync")
            .map_err(failed)?;
        (self.comm)
            .all_reduce_sum_f32(send, recv, data.len(), s)
            .map_err(|e| settle(e, give_up))?;
        let done = s
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
                self.comm.async_error().map_err(|e| settle(e, give_up))?;
                if give_up() {
                    return Err(TransportError::Abandoned);
                }
                asked = Instant::now();
            }
            std::thread::sleep(SPIN);
        }
        s.memcpy_dtoh(recv, out.as_mut_bytes())
            .named("cuMemcpyDtoHAsync")
            .map_err(failed)?;
        s.synchronize().named("cuStreamSynchronize").map_err(failed)
    }

    fn abort(self) -> Result<(), TransportError> {
        self.comm.abort().map_err(failed)
    }
}
