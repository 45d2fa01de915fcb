//! The drafters' ledgers, the record of what was trained: one contract between the drafter that
//! writes its ledger, the launcher that writes a line for a rank that died (a retired batch),
//! rewrites the ledgers on resume and accounts for them in `summary.json`, `launcher report`
//! and the tests. Every reading and writing of a ledger is here, and of its counterpart, the
//! record of batches set aside untrained (`RunDir::set_aside`, [`record_set_aside`]).
//!
//! A ledger (`RunDir::ledger`) is one JSON [`LedgerLine`] per trained batch. Each line is
//! written with one `write` before the batch's slot is released, so a crash never loses the line
//! of a batch whose slot was freed. A line cut short (the start of a line, or a crash's NUL
//! bytes) was torn by a drafter killed in the middle of writing it: its batch was not released,
//! so the ring delivered it again and another line records it. Whoever appends to a ledger first
//! ends such a torn line, so it stays one unreadable line instead of swallowing the next one. A
//! line that is neither a ledger line nor the start of one was changed or damaged ([`damaged`]),
//! and a resume refuses it, since which batch it recorded cannot be told. A disk full for a
//! while (ENOSPC, EDQUOT: [`LedgerError::Full`]) is waited out ([`Ledger::append_waiting`]):
//! the write it cut short is completed once space is back, so the line is in the file once,
//! whole, and the writer (a drafter, or the launcher for a dead one) lives through it. So are
//! the lines of the lost ranges ([`record_lost`]) and of the batches set aside.
//!
//! Length: past 500 lines because the ledger, the lost ranges and the set-aside record are one
//! contract (what counts as trained, torn or damaged), read and written only here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::jsonl::read_line_capped;
use crate::plan::{Epochs, PlannedBatch};
use crate::{BatchError, BatchView, RunDir};

mod lost;
mod writer;
pub use lost::{read_lost, record_lost, LostSteps};
pub use writer::{Ledger, FULL_RETRY};

/// One line of a drafter's ledger: a batch it trained on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerLine {
    pub batch_id: u64,
    pub sample_ids: Vec<u64>,
    pub tokens: u64,
    /// Earlier deliveries of this batch to drafters that died holding it.
    pub delivery: u32,
    /// The ring's publish ticket of the batch: one per publication, kept across redeliveries.
    /// Two tickets for one batch id mean it was published twice.
    #[serde(default)]
    pub ticket: u64,
    /// The group step whose update used it.
    pub step: u64,
    /// Digest of the weights after that update (hex): equal on every rank for one step. Empty
    /// in a line the launcher wrote for a rank that died before it could ([`record_retired`]).
    #[serde(default)]
    pub digest: String,
    /// The drafter's registration epoch (1 for the first run; restarts add one).
    pub epoch: u64,
}

/// What can go wrong with a ledger, naming the file or the batch.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{what} {path}: {cause}")]
    Io {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// The disk, or the user's quota, is full (ENOSPC, EDQUOT): unlike any other error of a
    /// file, it may pass (a file deleted, a log rotated), so a writer may wait for space
    /// ([`Ledger::append_waiting`]).
    #[error("{what} {path}: {cause}")]
    Full {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("reading settled batch {batch_id}: {cause}")]
    Batch { batch_id: u64, cause: BatchError },
    #[error("{}:{line}: not a line of this file, nor the start of one a kill cut short ({why}): it was changed, or damaged on disk; restore it from a copy ({then})", path.display())]
    Damaged {
        path: PathBuf,
        line: usize,
        why: String,
        /// What deleting the line would do, which the file decides.
        then: &'static str,
    },
    #[error("encoding a ledger line: {0}")]
    Encode(#[from] serde_json::Error),
}

impl LedgerError {
    /// Whether this is the disk, or the user's quota, full ([`LedgerError::Full`]).
    pub fn is_full(&self) -> bool {
        matches!(self, LedgerError::Full { .. })
    }
}

/// The error of `what` on the file `path`: [`LedgerError::Full`] for a full disk or quota,
/// else [`LedgerError::Io`].
fn io<'p>(what: &'static str, path: &'p Path) -> impl Fn(std::io::Error) -> LedgerError + 'p {
    move |cause| {
        let path = path.to_path_buf();
        if writer::is_full(&cause) {
            LedgerError::Full { what, path, cause }
        } else {
            LedgerError::Io { what, path, cause }
        }
    }
}

/// One line of a ledger as it is in the file: its text, and what it parses to (None: torn).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub text: String,
    pub line: Option<LedgerLine>,
}

/// The longest ledger line read: a line names its batch's samples (up to 21 bytes each), so
/// this is a batch of millions of them. A longer line (a file ending in a crash's run of NUL
/// bytes, edited, not a ledger) is unreadable, as a torn one is, and never held whole.
pub const MAX_LINE: usize = 64 << 20;

/// The drafters that have a ledger, in order ([`RunDir::ledger_indices`]).
pub fn indices(run_dir: &RunDir) -> Result<Vec<u32>, LedgerError> {
    (run_dir.ledger_indices()).map_err(io("listing", &run_dir.ledger_dir()))
}

/// Drafter `index`'s ledger, line by line; None if the drafter has none (it never trained).
pub fn read(run_dir: &RunDir, index: u32) -> Result<Option<Vec<Entry>>, LedgerError> {
    let mut entries = Vec::new();
    let found = scan(run_dir, index, |e| entries.push(e))?;
    Ok(found.then_some(entries))
}

/// Drafter `index`'s ledger, each line handed to `each` in order as it is read, so a ledger
/// of any size costs a line of memory (at most [`MAX_LINE`]; a longer one, or one that is not
/// UTF-8, is an unreadable entry, its text cut); false if the drafter has none.
pub fn scan(
    run_dir: &RunDir,
    index: u32,
    mut each: impl FnMut(Entry),
) -> Result<bool, LedgerError> {
    let path = run_dir.ledger(index);
    // Refused unless a regular file: a FIFO would wait for a writer for ever.
    match std::fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io("reading", &path)(e)),
        Ok(meta) => {
            if let Some(what) = atomic_file::not_regular(&meta) {
                return Err(io("reading", &path)(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("it is {what}, not a regular file"),
                )));
            }
        }
    }
    let file = match File::open(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        r => r.map_err(io("reading", &path))?,
    };
    let mut r = BufReader::with_capacity(1 << 16, file);
    let mut bytes = Vec::new();
    loop {
        let len = read_line_capped(&mut r, &mut bytes, MAX_LINE).map_err(io("reading", &path))?;
        if len == 0 {
            return Ok(true);
        }
        let whole = len == bytes.len() as u64;
        let text = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let entry = match std::str::from_utf8(text) {
            Ok(t) => Entry {
                text: t.to_string(),
                line: whole.then(|| serde_json::from_str(t).ok()).flatten(),
            },
            Err(_) => Entry {
                text: String::from_utf8_lossy(text).into_owned(),
                line: None,
            },
        };
        each(entry);
    }
}

/// Why the unreadable ledger line `text` cannot have been torn by a kill; None when it can. A
/// kill in the middle of a write leaves the start of a line (JSON cut short, maybe nothing), and
/// a machine that crashed may leave NUL bytes where the line's bytes never reached the disk;
/// a writer that appends next ends it, so such a line may be followed by others. Anything else
/// (a line that is whole JSON but no ledger line, bytes that no JSON starts with) was changed
/// by hand or damaged on disk: which batch it recorded cannot be told.
pub fn damaged(text: &str) -> Option<String> {
    parse_line::<LedgerLine>(text).err()
}

/// One line of a JSON-lines file of this module: `Some` a record, `None` a line a kill tore
/// (the start of one, a crash's NUL bytes, nothing), and an error saying why for a damaged one
/// ([`damaged`]). The one rule of torn against damaged for all three files.
fn parse_line<T: serde::de::DeserializeOwned>(text: &str) -> Result<Option<T>, String> {
    if text.contains('\0') {
        return Ok(None);
    }
    match serde_json::from_str(text) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_eof() => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// What the ledgers of a run hold: see [`read_all`].
#[derive(Clone, Debug, Default)]
pub struct Ledgers {
    /// The lines of batches trained: their updates are in the weights.
    pub lines: Vec<LedgerLine>,
    /// Lines that could not be read and are the start of a line (torn by a kill).
    pub torn: u64,
    /// Lines that could not be read and are not the start of one (changed, or damaged on
    /// disk: [`damaged`]), as `file:line`; a resume refuses them.
    pub damaged: Vec<String>,
    /// Lines whose updates were lost ([`LostSteps`]): their batches are untrained.
    pub lost: Vec<LedgerLine>,
    /// The lost ranges.
    pub lost_steps: Vec<LostSteps>,
}

/// Every ledger's lines ([`RunDir::ledger_indices`]: whatever drafters the run had, and gaps
/// between them), those in lost steps apart.
pub fn read_all(run_dir: &RunDir) -> Result<Ledgers, LedgerError> {
    let mut out = Ledgers {
        lost_steps: read_lost(run_dir)?,
        ..Ledgers::default()
    };
    for d in indices(run_dir)? {
        let mut n = 0;
        scan(run_dir, d, |entry| {
            n += 1;
            match entry.line {
                Some(l) if LostSteps::any_has(&out.lost_steps, &l) => out.lost.push(l),
                Some(l) => out.lines.push(l),
                None if damaged(&entry.text).is_some() => {
                    (out.damaged).push(format!("{}:{n}", run_dir.ledger(d).display()))
                }
                None => out.torn += 1,
            }
        })?;
    }
    Ok(out)
}

/// What the ledgers say about exactly-once training: every sample once in every epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Distinct samples in any line, of any epoch.
    pub samples_trained: u64,
    /// Distinct samples trained in each epoch of the plan, epoch 0 first.
    pub samples_trained_per_epoch: Vec<u64>,
    /// Batches whose training is recorded more than once by live drafters: published more than
    /// once (several tickets), or one delivery of a publication recorded twice. A line of an
    /// earlier delivery does not count: its drafter died holding the batch, which the ring
    /// delivered again (at-least-once delivery across a crash).
    pub duplicated: u64,
    /// Samples trained more than once within one epoch (in two batches of that epoch, or in a
    /// duplicated batch), counted once for each epoch in which it happened. A sample trained
    /// once in each of two epochs is not among them.
    pub samples_not_once: u64,
}

/// Accounts for `lines`, each batch in its epoch of the plan (see [`Accounting`]).
pub fn account(lines: &[LedgerLine], epochs: &Epochs) -> Accounting {
    // batch id -> ticket -> deliveries recorded
    let mut batches: HashMap<u64, BTreeMap<u64, Vec<u32>>> = HashMap::new();
    // (epoch, sample) -> the publications that trained it
    let mut samples: HashMap<(u32, u64), HashSet<(u64, u64)>> = HashMap::new();
    for l in lines {
        batches
            .entry(l.batch_id)
            .or_default()
            .entry(l.ticket)
            .or_default()
            .push(l.delivery);
        let epoch = epochs.of_batch(l.batch_id);
        for &s in &l.sample_ids {
            samples
                .entry((epoch, s))
                .or_default()
                .insert((l.batch_id, l.ticket));
        }
    }
    let twice = |deliveries: &Vec<u32>| {
        let mut d = deliveries.clone();
        d.sort_unstable();
        d.windows(2).any(|w| w[0] == w[1])
    };
    let duplicated: HashSet<u64> = batches
        .iter()
        .filter(|(_, tickets)| tickets.len() > 1 || tickets.values().any(twice))
        .map(|(&b, _)| b)
        .collect();
    let mut per_epoch = vec![0; epochs.count() as usize];
    for &(e, _) in samples.keys() {
        per_epoch[e as usize] += 1;
    }
    let distinct: HashSet<u64> = samples.keys().map(|&(_, s)| s).collect();
    Accounting {
        samples_trained: distinct.len() as u64,
        samples_trained_per_epoch: per_epoch,
        duplicated: duplicated.len() as u64,
        samples_not_once: samples
            .values()
            .filter(|pubs| pubs.len() != 1 || pubs.iter().any(|(b, _)| duplicated.contains(b)))
            .count() as u64,
    }
}

/// For the launcher, before it removes dead drafter `index` from the group: makes the lines it
/// wrote durable (they may be in the page cache only), since the group goes on, and its next
/// checkpoint may hold their updates, once the rank is removed. None written: nothing to do.
pub fn sync_dead(run_dir: &RunDir, index: u32) -> Result<(), LedgerError> {
    let path = run_dir.ledger(index);
    match File::open(&path) {
        Ok(f) => f.sync_data().map_err(io("syncing the ledger", &path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("opening ledger", &path)(e)),
    }
}

/// For the launcher: drafter `index` died holding a batch whose update the group applied in
/// `step` (so its slot is retired, not redelivered). Appends the ledger line it could not write,
/// unless its ledger already ends with it (it died between the write and the release). The
/// line has no digest: the launcher does not hold the weights. A full disk is waited out as the
/// drafter waits it out (`waiting`: [`Ledger::append_waiting`]). Returns true if a line was
/// added.
pub fn record_retired(
    run_dir: &RunDir,
    index: u32,
    meta: &shm_ring::ItemMeta,
    payload: &[u8],
    step: u64,
    waiting: &mut dyn FnMut(&LedgerError) -> bool,
) -> Result<bool, LedgerError> {
    // The last line alone: the group waits for this (see below), and a week's ledger is tens
    // of MB.
    let last = last_line(&run_dir.ledger(index));
    if last.is_some_and(|l| l.batch_id == meta.batch_id && l.ticket == meta.ticket) {
        return Ok(false);
    }
    let (sample_ids, tokens) = samples_of(meta, payload)?;
    let line = LedgerLine {
        batch_id: meta.batch_id,
        sample_ids,
        tokens,
        delivery: meta.delivery,
        ticket: meta.ticket,
        step,
        digest: String::new(),
        epoch: 0,
    };
    let mut ledger = Ledger::open(&run_dir.ledger(index))?;
    ledger.append_waiting(&line, waiting)?;
    // Durable before the group goes on (the launcher writes it before the removal takes
    // effect): the leader's next checkpoint may hold this batch's update.
    ledger.sync()?;
    Ok(true)
}

/// The last line of the ledger at `path`, read from the file's end (a window doubled until it
/// holds a whole line, at most [`MAX_LINE`]); None if there is none, or it is torn or
/// unreadable, or the file is missing or not a regular file.
fn last_line(path: &Path) -> Option<LedgerLine> {
    use std::io::{Read, Seek, SeekFrom};
    let meta = std::fs::metadata(path).ok()?;
    if atomic_file::not_regular(&meta).is_some() {
        return None;
    }
    let mut file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut window: u64 = 1 << 16;
    loop {
        let start = len.saturating_sub(window);
        file.seek(SeekFrom::Start(start)).ok()?;
        let mut tail = Vec::with_capacity((len - start) as usize);
        (&mut file).take(len - start).read_to_end(&mut tail).ok()?;
        // A whole last line ends with its newline; one without is torn.
        let body = tail.strip_suffix(b"\n")?;
        match body.iter().rposition(|&b| b == b'\n') {
            Some(at) => return serde_json::from_slice(&body[at + 1..]).ok(),
            None if start == 0 => return serde_json::from_slice(body).ok(),
            None if window > MAX_LINE as u64 => return None,
            None => window *= 2,
        }
    }
}

/// The sample ids and tokens of the batch a dead drafter's slot holds (`payload`, its `meta`).
fn samples_of(meta: &shm_ring::ItemMeta, payload: &[u8]) -> Result<(Vec<u64>, u64), LedgerError> {
    let view = BatchView::parse(payload).map_err(|cause| LedgerError::Batch {
        batch_id: meta.batch_id,
        cause,
    })?;
    let spec = &view.header().spec;
    Ok((spec.sample_ids.clone(), spec.tokens()))
}

/// A batch the launcher set aside (`RunDir::set_aside`, one JSON line each): it was in hand
/// at every death it names, so it is not delivered (or, a target's, computed) again and its
/// samples stay untrained in this run (`--resume` tries them again).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAsideLine {
    pub batch_id: u64,
    pub sample_ids: Vec<u64>,
    pub tokens: u64,
    /// The ring's publish ticket of the batch; null for one set aside before it was published
    /// (the targets died computing it).
    pub ticket: Option<u64>,
    /// The deaths held against it, as the launcher said them (`drafter-1 (pid 7) died: signal:
    /// 6 (SIGABRT), saying "..."`).
    pub deaths: Vec<String>,
}

impl SetAsideLine {
    /// The line of a published batch, read from the slot a dead drafter held (`payload`, its
    /// `meta`) before the slot is freed.
    pub fn of_slot(
        meta: &shm_ring::ItemMeta,
        payload: &[u8],
        deaths: &[String],
    ) -> Result<SetAsideLine, LedgerError> {
        let (sample_ids, tokens) = samples_of(meta, payload)?;
        Ok(SetAsideLine {
            batch_id: meta.batch_id,
            sample_ids,
            tokens,
            ticket: Some(meta.ticket),
            deaths: deaths.to_vec(),
        })
    }

    /// The line of planned batch `batch_id` (`planned`), which the targets died computing.
    pub fn of_plan(batch_id: u64, planned: &PlannedBatch, deaths: &[String]) -> SetAsideLine {
        SetAsideLine {
            batch_id,
            sample_ids: planned.sample_ids.clone(),
            tokens: planned.tokens,
            ticket: None,
            deaths: deaths.to_vec(),
        }
    }
}

/// For the launcher: appends the line of a batch it set aside, waiting out a full disk as a
/// ledger line does (`waiting`: [`Ledger::append_waiting`]).
pub fn record_set_aside(
    run_dir: &RunDir,
    line: &SetAsideLine,
    waiting: &mut dyn FnMut(&LedgerError) -> bool,
) -> Result<(), LedgerError> {
    write_set_aside(Ledger::open(&run_dir.set_aside())?, line, waiting)
}

/// [`record_set_aside`] to `file`, open on `set-aside.jsonl` (a test injects a full disk there).
fn write_set_aside(
    mut file: Ledger,
    line: &SetAsideLine,
    waiting: &mut dyn FnMut(&LedgerError) -> bool,
) -> Result<(), LedgerError> {
    file.append_waiting(line, waiting)?;
    Ok(())
}

/// The batches set aside in the run so far (none if the file is missing); a line a kill tore is
/// skipped, and a damaged one is an error naming its line.
pub fn read_set_aside(run_dir: &RunDir) -> Result<Vec<SetAsideLine>, LedgerError> {
    read_lines(
        &run_dir.set_aside(),
        "deleting it gives its batch back to be trained",
    )
}

/// The lines of the JSON-lines file `path` (none if it is missing); a line a kill tore (the
/// start of a line, or a crash's NUL bytes) is skipped. A line that is neither (edited, damaged
/// on disk) is an error naming the file and line: skipped, a lost range's batches would count
/// as trained, and a resume would not train them again.
fn read_lines<T: serde::de::DeserializeOwned>(
    path: &Path,
    then: &'static str,
) -> Result<Vec<T>, LedgerError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io("reading", path)(e)),
    };
    let mut out = Vec::new();
    for (n, l) in bytes.split(|&b| b == b'\n').enumerate() {
        let why = match std::str::from_utf8(l).map_err(|e| e.to_string()) {
            Ok(text) => match parse_line(text) {
                Ok(v) => {
                    out.extend(v);
                    continue;
                }
                Err(why) => why,
            },
            // Not UTF-8: torn only if a crash's NUL bytes are in it.
            Err(_) if l.contains(&0) => continue,
            Err(why) => why,
        };
        return Err(LedgerError::Damaged {
            path: path.to_path_buf(),
            line: n + 1,
            why,
            then,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
