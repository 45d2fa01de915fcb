//! A producer or consumer process on an shm-ring, for the multi-process tests. Not a user tool.
//!
//! `ring-peer produce RING INDEX COUNT MAX_LEN [--start S] [--hang-in-write K]`
//! `ring-peer consume RING INDEX [--hang-holding K]`  (prints `got <batch_id> <delivery>` per item)
//! `ring-peer create RING PRODUCERS CONSUMERS SLOTS SLOT_SIZE --leave-stale`

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use shm_ring::{CommitMeta, Ring, RingParams, TakePolicy};
use tests::{batch_id, fill, payload_len, verify};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Produce {
        ring: String,
        index: u32,
        count: u64,
        max_len: usize,
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// Print `writing <seq>` and hang half-way through writing item `seq`.
        #[arg(long)]
        hang_in_write: Option<u64>,
    },
    Consume {
        ring: String,
        index: u32,
        /// Print `holding <batch_id>` and hang holding the K-th item taken (from 0).
        #[arg(long)]
        hang_holding: Option<u64>,
    },
    /// Create a ring and exit without removing it, as a crashed launcher would.
    Create {
        ring: String,
        producers: u32,
        consumers: u32,
        slots: u32,
        slot_size: u64,
    },
}

fn hang() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn main() -> anyhow::Result<()> {
    let out = std::io::stdout();
    match Args::parse().cmd {
        Cmd::Produce {
            ring,
            index,
            count,
            max_len,
            start,
            hang_in_write,
        } => {
            let ring = Ring::attach(&ring).context("attach")?;
            let p = ring.producer(index)?;
            for seq in start..count {
                let id = batch_id(index, seq);
                let len = payload_len(id, max_len);
                let mut w = p.reserve(len)?;
                if hang_in_write == Some(seq) {
                    w.payload_mut()[..len / 2].fill(0xEE);
                    writeln!(out.lock(), "writing {seq}")?;
                    hang();
                }
                fill(w.payload_mut(), id);
                w.commit(CommitMeta {
                    bucket: (seq % u64::from(ring.params().buckets)) as u32,
                    tokens: len as u64,
                    batch_id: id,
                })?;
            }
            p.finish();
        }
        Cmd::Consume {
            ring,
            index,
            hang_holding,
        } => {
            let ring = Ring::attach(&ring).context("attach")?;
            let c = ring.consumer(index)?;
            let mut n = 0u64;
            while let Some(r) = c.take()? {
                let m = *r.meta();
                if !verify(r.payload(), m.batch_id) {
                    bail!("batch {:#x} is corrupt", m.batch_id);
                }
                if hang_holding == Some(n) {
                    writeln!(out.lock(), "holding {}", m.batch_id)?;
                    hang();
                }
                r.release()?;
                // Printed after release: a consumer killed later has finished with this item.
                writeln!(out.lock(), "got {} {}", m.batch_id, m.delivery)?;
                n += 1;
            }
        }
        Cmd::Create {
            ring,
            producers,
            consumers,
            slots,
            slot_size,
        } => {
            let mut r = Ring::create(
                &ring,
                &RingParams {
                    slots,
                    slot_size,
                    producers,
                    consumers,
                    policy: TakePolicy::Fifo,
                    ..RingParams::default()
                },
            )?;
            r.disown();
        }
    }
    Ok(())
}
