//! The `unsafe` of this crate: mapping a file read-only, and dropping its resident pages; and the
//! map as an Arrow buffer (safe: `bytes` owns an `Arc` of it).

use std::fs::File;
use std::sync::Arc;

use arrow_buffer::Buffer;
use memmap2::Mmap;

/// Maps `file` read-only, whole.
///
/// A map is only sound while nobody changes the file under it. hspipe writes a prepared file
/// once, under a temporary name, and renames it into place; it never writes it again, and
/// readers only read. What remains is another program truncating or rewriting the file while
/// a run maps it: that is outside what this crate can guard against (the kernel then sends
/// SIGBUS on a read past the new end), as it is for every program that maps files, HF
/// `datasets` included.
pub fn map_read_only(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the map is read-only (no aliasing `&mut`), and the file is not modified while
    // mapped, as the function's doc explains; `Mmap` keeps the mapping alive as long as any
    // slice borrowed from it.
    unsafe { Mmap::map(file) }
}

/// Drops this process's page-table entries for the whole map: its resident size falls back to
/// nothing, while the file's pages stay in the page cache for the next read (and for every
/// other process). Only a hint: an error leaves the map as it was.
pub fn unmap_resident(map: &Mmap) {
    // SAFETY: `Mmap::map` makes a MAP_SHARED, PROT_READ mapping of a file that is not modified
    // while mapped (see `map_read_only`). MADV_DONTNEED on a shared file mapping only removes
    // this process's page-table entries; the next access faults the same pages back from the
    // page cache, so every slice borrowed from the map reads the same bytes before and after.
    let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
}

/// The map shared by an Arrow buffer and its owner (`Mapped`, which also advises the kernel
/// about it).
struct SharedMap(Arc<Mmap>);

impl AsRef<[u8]> for SharedMap {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// An Arrow buffer over the whole map, without a copy: arrays decoded from it are slices of the
/// map, and keep it mapped while they live.
pub fn buffer_of(map: &Arc<Mmap>) -> Buffer {
    Buffer::from(bytes::Bytes::from_owner(SharedMap(map.clone())))
}
