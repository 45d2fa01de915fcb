//! The synthetic dataset costs a process its lengths, not its tokens: every target worker and
//! the launcher load it, and a sample is made when it is read. The bytes allocated and not
//! freed are counted by this binary's allocator; its own test binary, without a harness, so
//! nothing else allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

use dataset::{Dataset, Synthetic};

/// The system's allocator, counting the bytes it holds for the program.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        // SAFETY: the caller's contract for `l` is GlobalAlloc's, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        // SAFETY: `p` came from this allocator, which is the system's, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn main() {
    let n = 100_000u64;
    let before = LIVE.load(Relaxed);
    let data = Dataset::synthetic(&Synthetic {
        samples: n,
        min_len: 32,
        max_len: 4096,
        seed: 1,
        vocab: 32_000,
        language: false,
    });
    let held = LIVE.load(Relaxed) - before;
    let tokens: u64 = data.lengths().iter().map(|&l| u64::from(l)).sum();
    // Its lengths (4 bytes a sample) and its name; the tokens alone would be 4 bytes each.
    assert!(
        held <= 4 * n as isize + 4096,
        "{n} synthetic samples ({tokens} tokens) hold {held} bytes: more than their lengths"
    );
    // A sample read is made whole, and freed with it.
    let s = data.sample(n - 1).expect("the last sample");
    assert_eq!(s.input_ids.len(), data.lengths()[n as usize - 1] as usize);
    assert_eq!(
        s.loss_mask.as_ref().map(|m| m.len()),
        Some(s.input_ids.len())
    );
    drop(s);
    assert_eq!(
        LIVE.load(Relaxed) - before,
        held,
        "a sample read is not kept"
    );
    assert!(data.sample(n).is_none(), "no sample past the end");
    println!("synthetic_memory: {n} samples ({tokens} tokens) hold {held} bytes");
}
