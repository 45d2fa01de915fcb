//! The one `unsafe` of this crate: mapping a file read-only.

use std::fs::File;

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
