//! Appending to a JSON-lines file that a killed writer may have left torn: the ledgers,
//! `set-aside.jsonl`, `lost-steps.jsonl`, `metrics.jsonl`. Each line is written with one
//! `write`, but a write that crosses a page of the file can be cut by a kill (or by a full
//! disk), and leave a last line without its newline. Whoever appends first ends that line, so it
//! stays one unreadable line, which readers skip, instead of swallowing the next writer's first
//! line. Readers read a line at a time, each held to a bound ([`read_line_capped`]): a file
//! ending in a crash's run of NUL bytes, or that is not JSON lines at all, has one line of
//! gigabytes.

use std::fs::File;
use std::io::{BufRead, Read, Seek, SeekFrom, Write};

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

/// Reads one line (through its `\n`, if any) into `line`, keeping at most `max` bytes of it: a
/// longer one is read to its end, and its first `max` bytes kept. Returns the line's whole
/// length in bytes (more than `line.len()` when cut), 0 at the end of the file. `read_line`
/// would hold the line whole, and fail on its first byte that is no UTF-8.
pub fn read_line_capped(
    r: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<u64> {
    line.clear();
    let mut len = 0u64;
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            return Ok(len);
        }
        let (take, end) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let room = max.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..take.min(room)]);
        r.consume(take);
        len += take as u64;
        if end {
            return Ok(len);
        }
    }
}
