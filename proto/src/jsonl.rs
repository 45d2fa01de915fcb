//! Appending to a JSON-lines file that a killed writer may have left torn: the ledgers,
//! `set-aside.jsonl`, `lost-steps.jsonl`, `metrics.jsonl`. Each line is written with one
//! `write`, but a write that crosses a page of the file can be cut by a kill (or by a full
//! disk), and leave a last line without its newline. Whoever appends first ends that line, so it
//! stays one unreadable line, which readers skip, instead of swallowing the next writer's first
//! line.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};

/// Ends `file`'s last line with a newline if it has none; returns the file's length after.
/// `file` is open for reading and appending.
pub fn end_torn_line(file: &mut File) -> std::io::Result<u64> {
    let len = file.seek(SeekFrom::End(0))?;
    if len == 0 {
        return Ok(0);
    }
    file.seek(SeekFrom::End(-1))?;
    let mut last = [0u8];
    file.read_exact(&mut last)?;
    if last[0] == b'\n' {
        return Ok(len);
    }
    file.write_all(b"\n")?;
    Ok(len + 1)
}
