//! A worker's process keeps what it frees: after `keep_freed_memory`, a block far over glibc's
//! mmap threshold comes from the heap (no block mapped on its own), on the main thread and on a
//! thread started after, and freeing it keeps it there for the next; `give_back_freed` (after a
//! model's load) returns it to the kernel. Its own test binary, run on the main thread (no
//! harness): the setting is the whole process's.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    use worker_runtime::malloc::{give_back_freed, keep_freed_memory, Malloc, USER_KNOBS};
    // `hblks`: blocks glibc holds as mappings of their own; `arena`: bytes of heap it holds.
    let held = || {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        let m = unsafe { libc::mallinfo2() };
        (m.hblks, m.arena)
    };
    let block = || std::hint::black_box(vec![1u8; 64 << 20]);
    for k in USER_KNOBS {
        assert!(
            std::env::var_os(k).is_none(),
            "the test needs glibc's defaults: {k} is set"
        );
    }
    let before = held().0;
    let b = block();
    assert!(
        held().0 > before,
        "by default glibc maps a 64 MiB block of its own"
    );
    drop(b);

    assert_eq!(keep_freed_memory(), Malloc::Kept);
    let before = held();
    let b = block();
    assert_eq!(
        held().0,
        before.0,
        "no block of its own once freed memory is kept"
    );
    drop(b);
    let after = held();
    assert!(
        after.1 >= 64 << 20,
        "the freed block stays in the heap: {after:?}"
    );
    let b = block();
    assert_eq!(
        held().1,
        after.1,
        "the next block reuses it: the heap did not grow"
    );
    drop(b);
    let on_thread = std::thread::spawn(move || {
        let b = block();
        let h = held();
        drop(b);
        h
    })
    .join()
    .unwrap();
    assert_eq!(
        on_thread.0, before.0,
        "a later thread's block is the heap's too"
    );
    // Kept memory stays resident until given back.
    let b = block();
    drop(b);
    let given = give_back_freed().expect("glibc on Linux reads its resident size");
    assert!(
        given.bytes() >= 48 << 20,
        "the freed 64 MiB block goes back to the kernel: {given:?}"
    );
    println!("freed memory kept: {after:?} (mapped blocks, heap bytes); {given:?}");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {}
