//! Helpers shared by the test modules.

use std::sync::atomic::{AtomicU32, Ordering};

/// A ring name unique to this test process and call; rings are unlinked by their creating
/// handle's drop, so a failing test leaves nothing behind.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "hspipe-t-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
