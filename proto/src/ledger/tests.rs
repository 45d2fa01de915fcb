//! The ledgers' reading, writing and accounting.

use std::fs::OpenOptions;
use std::io::Write;

use crate::jsonl::end_torn_line;

use super::*;

fn line(batch_id: u64, ticket: u64, delivery: u32, samples: &[u64]) -> LedgerLine {
    LedgerLine {
        batch_id,
        sample_ids: samples.to_vec(),
        tokens: 1,
        delivery,
        ticket,
        step: 0,
        digest: String::new(),
        epoch: 1,
    }
}

#[test]
fn a_redelivery_after_a_crash_is_not_a_duplicate_but_a_second_training_is() {
    // Batch 1 trained by a drafter that died before releasing it, then again on its
    // redelivery: at-least-once across a crash, not a duplicate.
    let redelivered = [line(1, 5, 0, &[10, 11]), line(1, 5, 1, &[10, 11])];
    assert_eq!(
        account(&redelivered, &Epochs::one()),
        Accounting {
            samples_trained: 2,
            samples_trained_per_epoch: vec![2],
            duplicated: 0,
            samples_not_once: 0
        }
    );
    // Published twice (two tickets), or one delivery trained twice: duplicated, and the
    // distinct-sample count alone would not show it.
    for twice in [
        [line(1, 5, 0, &[10, 11]), line(1, 6, 0, &[10, 11])],
        [line(1, 5, 0, &[10, 11]), line(1, 5, 0, &[10, 11])],
    ] {
        let a = account(&twice, &Epochs::one());
        assert_eq!((a.samples_trained, a.duplicated), (2, 1), "{twice:?}");
        assert_eq!(a.samples_not_once, 2);
    }
}

/// Two epochs: batches 0 and 1 are epoch 0, batches 2 and 3 epoch 1, each epoch holding
/// samples 10..14 once. A sample once in each epoch is exactly once; a sample in two batches
/// of one epoch is not, though no batch was trained twice.
#[test]
fn every_sample_once_in_every_epoch_and_twice_in_one_epoch_is_caught() {
    let plan: Vec<crate::plan::PlannedBatch> = [0, 0, 1, 1]
        .into_iter()
        .map(|epoch| crate::plan::PlannedBatch {
            sample_ids: Vec::new(),
            bucket: 0,
            tokens: 0,
            epoch,
        })
        .collect();
    let epochs = Epochs::of(&plan);
    let once_each = [
        line(0, 1, 0, &[10, 11]),
        line(1, 2, 0, &[12, 13]),
        line(2, 3, 0, &[13, 10]),
        line(3, 4, 0, &[11, 12]),
    ];
    assert_eq!(
        account(&once_each, &epochs),
        Accounting {
            samples_trained: 4,
            samples_trained_per_epoch: vec![4, 4],
            duplicated: 0,
            samples_not_once: 0
        }
    );
    // With one epoch the same lines train every sample twice.
    assert_eq!(account(&once_each, &Epochs::one()).samples_not_once, 4);
    // Sample 13 in both batches of epoch 1 (and 11 in none): epoch 1 still counts 4
    // samples trained, but one of them twice.
    let twice_in_one = [
        line(0, 1, 0, &[10, 11]),
        line(1, 2, 0, &[12, 13]),
        line(2, 3, 0, &[13, 10]),
        line(3, 4, 0, &[13, 12]),
    ];
    let a = account(&twice_in_one, &epochs);
    assert_eq!(a.samples_trained_per_epoch, vec![4, 3]);
    assert_eq!((a.duplicated, a.samples_not_once), (0, 1));
    // Epoch 1's batch trained twice (two tickets): a duplicate in that epoch only.
    let mut again = once_each.to_vec();
    again.push(line(3, 5, 0, &[11, 12]));
    let a = account(&again, &epochs);
    assert_eq!(a.samples_trained_per_epoch, vec![4, 4]);
    assert_eq!((a.duplicated, a.samples_not_once), (1, 2));
}

#[test]
fn a_torn_ledger_line_is_ended_so_the_next_line_stays_readable() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = RunDir::new(tmp.path());
    std::fs::create_dir_all(dir.ledger_dir()).unwrap();
    let path = dir.ledger(0);
    let whole = serde_json::to_string(&line(1, 1, 0, &[1])).unwrap();
    std::fs::write(&path, format!("{whole}\n{}", &whole[..10])).unwrap();
    let mut f = OpenOptions::new()
        .append(true)
        .read(true)
        .open(&path)
        .unwrap();
    end_torn_line(&mut f).unwrap();
    f.write_all(format!("{whole}\n").as_bytes()).unwrap();
    let read = read_all(&dir).unwrap();
    assert_eq!((read.lines.len(), read.torn), (2, 1));
}

/// A ledger whose own write was cut short (a full disk: the error returned, the process going
/// on, as a Python drafter that catches it may) ends that line before its next one, which then
/// reads back; and a line that is neither whole nor the start of one is counted apart from the
/// torn ones, named by file and line. Before, the next line was glued to the fragment and both
/// were lost, counted as one torn line.
#[test]
fn a_ledger_ends_a_line_its_own_failed_write_tore_and_damaged_lines_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = RunDir::new(tmp.path());
    std::fs::create_dir_all(dir.ledger_dir()).unwrap();
    let path = dir.ledger(0);
    let mut ledger = Ledger::open(&path).unwrap();
    let first = line(1, 1, 0, &[1]);
    ledger.append(&first).unwrap();
    // What a write cut short leaves: the start of a line, through this very handle's file.
    let cut = &serde_json::to_string(&line(2, 2, 0, &[2])).unwrap()[..12];
    OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(cut.as_bytes())
        .unwrap();
    ledger.append(&line(3, 3, 0, &[3])).unwrap();
    let read = read_all(&dir).unwrap();
    assert_eq!((read.lines.len(), read.torn), (2, 1), "{read:?}");
    assert!(read.damaged.is_empty(), "{read:?}");
    OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"garbage\n")
        .unwrap();
    let read = read_all(&dir).unwrap();
    assert_eq!((read.lines.len(), read.torn), (2, 1), "{read:?}");
    assert_eq!(read.damaged, [format!("{}:4", path.display())]);
}

/// A disk full for a while (injected: the first try writes half the line, as a write the disk
/// cut short does, and the next two find no space) is waited out: `waiting` hears each failed
/// try, and the line is in the file once and whole, the rest of it written after the half that
/// got in. Before, the error ended the drafter, and the half line stayed torn.
#[test]
fn a_full_disk_is_waited_out_and_the_line_is_written_once_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = RunDir::new(tmp.path());
    std::fs::create_dir_all(dir.ledger_dir()).unwrap();
    let mut ledger = Ledger::open(&dir.ledger(0)).unwrap();
    ledger.append(&line(1, 1, 0, &[1])).unwrap();
    ledger.inject_full(3);
    let mut heard = Vec::new();
    let failed = ledger
        .append_waiting(&line(2, 2, 0, &[2, 3]), &mut |e| {
            heard.push(e.to_string());
            assert!(e.is_full(), "{e:?}");
            true
        })
        .unwrap();
    assert_eq!(failed, 3);
    assert_eq!(heard.len(), 3);
    assert!(heard[0].starts_with("appending to "), "{heard:?}");
    assert!(heard[0].contains("drafter-0.jsonl"), "{heard:?}");
    ledger.append(&line(3, 3, 0, &[4])).unwrap();
    let read = read_all(&dir).unwrap();
    assert_eq!((read.torn, read.damaged.len()), (0, 0), "{read:?}");
    let ids: Vec<u64> = read.lines.iter().map(|l| l.batch_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(read.lines[1], line(2, 2, 0, &[2, 3]));
}

/// A writer that gives up waiting (a stop) gets the full disk's error, and leaves the start of
/// its line, torn, which the next append ends: no line is glued to it. A plain `append` does
/// not wait.
#[test]
fn a_wait_for_space_given_up_leaves_a_torn_line_that_the_next_append_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = RunDir::new(tmp.path());
    std::fs::create_dir_all(dir.ledger_dir()).unwrap();
    let mut ledger = Ledger::open(&dir.ledger(0)).unwrap();
    ledger.inject_full(1);
    let mut tries = 0;
    let e = (ledger.append_waiting(&line(1, 1, 0, &[1]), &mut |_| {
        tries += 1;
        false
    }))
    .unwrap_err();
    assert!(e.is_full() && tries == 1, "{e:?}");
    ledger.append(&line(2, 2, 0, &[2])).unwrap();
    let read = read_all(&dir).unwrap();
    assert_eq!((read.lines.len(), read.torn), (1, 1), "{read:?}");
    assert_eq!(read.lines[0].batch_id, 2);
    ledger.inject_full(1);
    let e = ledger.append(&line(3, 3, 0, &[3])).unwrap_err();
    assert!(e.to_string().contains("No space left on device"), "{e}");
}

/// Only a full disk or quota is waited for: any other error of the file is not.
#[test]
fn only_enospc_and_edquot_are_a_full_disk() {
    use rustix::io::Errno;
    let path = Path::new("/x");
    for (errno, full) in [
        (Errno::NOSPC, true),
        (Errno::DQUOT, true),
        (Errno::ACCESS, false),
        (Errno::ROFS, false),
        (Errno::IO, false),
    ] {
        let e = io("appending to", path)(errno.into());
        assert_eq!(e.is_full(), full, "{e}");
    }
}

/// A lost range whose line a kill tore is recorded again by the rank's restart (`lost.rs`): the
/// new line follows the torn one instead of being glued to it, so the range reads back and its
/// steps count as untrained. Before, both lines were lost, and so was the range. Set-aside lines
/// are appended the same way.
#[test]
fn a_line_recorded_after_a_torn_one_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, lost, _) = torn_lost_steps(tmp.path());
    record_lost(&run, &lost, &mut |_| false).unwrap();
    assert_eq!(read_lost(&run).unwrap(), vec![lost]);
}

/// A run laid out in `dir` whose `lost-steps.jsonl` ends with the start of a lost range's line,
/// torn by a kill; the range, and its line whole.
fn torn_lost_steps(dir: &Path) -> (RunDir, LostSteps, String) {
    let run = RunDir::new(dir);
    run.lay_out().unwrap();
    let lost = LostSteps::between(0, 1, 4).unwrap();
    let whole = serde_json::to_string(&lost).unwrap();
    std::fs::write(run.lost_steps(), &whole[..10]).unwrap();
    (run, lost, whole)
}

/// A line of lost-steps.jsonl changed by hand or damaged on disk, between whole lines, is an
/// error naming the file and line; skipped as a torn one is, its range's batches counted as
/// trained and a resume did not train them again. A torn line and a crash's NUL bytes are
/// still skipped.
#[test]
fn a_damaged_lost_steps_line_is_an_error_and_a_torn_one_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path());
    run.lay_out().unwrap();
    let a = LostSteps::between(0, 1, 4).unwrap();
    let b = LostSteps::between(1, 9, 12).unwrap();
    let (ta, tb) = (
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap(),
    );
    std::fs::write(
        run.lost_steps(),
        format!("{ta}\n{}\n\0\0\n{tb}\n", &tb[..7]),
    )
    .unwrap();
    assert_eq!(read_lost(&run).unwrap(), vec![a, b.clone()]);
    for bad in [&b"garbage"[..], b"\xff\xfe", br#"{"first":3}"#] {
        let mut text = format!("{ta}\n").into_bytes();
        text.extend_from_slice(bad);
        text.extend_from_slice(format!("\n{tb}\n").as_bytes());
        std::fs::write(run.lost_steps(), text).unwrap();
        let err = read_lost(&run).unwrap_err().to_string();
        assert!(err.contains("lost-steps.jsonl:2: not a line"), "{err}");
    }
}

#[test]
fn the_ledgers_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path());
    run.lay_out().unwrap();
    let line = LedgerLine {
        batch_id: 7,
        sample_ids: vec![1, 2],
        tokens: 9,
        delivery: 0,
        ticket: 3,
        step: 1,
        digest: "ab".into(),
        epoch: 1,
    };
    let text = format!(
        "{}\n{{\"batch_id\": 8, \"sam",
        serde_json::to_string(&line).unwrap()
    );
    std::fs::write(run.ledger(1), text).unwrap();
    // Drafter 0 has no ledger yet; drafter 1's last line was torn by a kill.
    let read = read_all(&run).unwrap();
    assert_eq!((read.lines, read.torn), (vec![line.clone()], 1));
    assert!(read.lost.is_empty() && read.lost_steps.is_empty());
    // Steps 2..=4 lost: drafter 0's line of step 3 is set apart, its step-1 line is not.
    let lost = LostSteps::between(0, 1, 4).unwrap();
    record_lost(&run, &lost, &mut |_| false).unwrap();
    let in_lost = LedgerLine {
        step: 3,
        ..line.clone()
    };
    let mut ledger = Ledger::open(&run.ledger(0)).unwrap();
    ledger.append(&line).unwrap();
    ledger.append(&in_lost).unwrap();
    let read = read_all(&run).unwrap();
    assert_eq!(read.lines, [line.clone(), line]);
    assert_eq!((read.lost, read.lost_steps), (vec![in_lost], vec![lost]));
    assert_eq!(
        LostSteps::between(0, 4, 4),
        None,
        "none lost at the group's step"
    );
}

/// The launcher's check that a dead rank's ledger already ends with its applied batch reads the
/// file's last line from its end, whatever the ledger's length: the last whole line, one longer
/// than the first window read, none when the last is torn or the ledger missing or a FIFO.
#[test]
fn the_last_line_is_read_from_the_ledgers_end() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("l.jsonl");
    assert_eq!(last_line(&path), None, "missing");
    let text = |l: &LedgerLine| format!("{}\n", serde_json::to_string(l).unwrap());
    let (a, b) = (line(1, 1, 0, &[1, 2]), line(2, 5, 1, &[3]));
    std::fs::write(&path, text(&a)).unwrap();
    assert_eq!(last_line(&path), Some(a.clone()), "a lone line");
    // Many lines before, and a last one of ~300 KB (past the first 64 KiB window).
    let mut all: String = (0..5000).map(|i| text(&line(i, i, 0, &[i]))).collect();
    let long = line(9, 9, 0, &(0..50_000).collect::<Vec<_>>());
    all.push_str(&text(&b));
    all.push_str(&text(&long));
    std::fs::write(&path, &all).unwrap();
    assert_eq!(last_line(&path), Some(long));
    all.push_str(&text(&a)[..10]);
    std::fs::write(&path, &all).unwrap();
    assert_eq!(last_line(&path), None, "torn");
    std::fs::remove_file(&path).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    assert_eq!(last_line(&path), None, "a FIFO, not waited on");
}

/// A lost range and a set-aside batch are written through a disk full for a while as a ledger
/// line is (injected: the first try writes half the line, the next ones find no space): the
/// writer hears each failed try, and the line is in the file once and whole, after the repair
/// of a line a kill tore. Before, the first ENOSPC was the error: a rank that found the group
/// empty died recording the range, and so did each restart; the launcher wrote no set-aside
/// line, and a resume trained the batch that had killed the run's drafters again.
#[test]
fn a_lost_range_and_a_set_aside_line_wait_out_a_full_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, lost, whole) = torn_lost_steps(tmp.path());
    let mut file = Ledger::open(&run.lost_steps()).unwrap();
    file.inject_full(3);
    let mut heard = Vec::new();
    let mut waiting = |e: &LedgerError| {
        assert!(e.is_full(), "{e:?}");
        heard.push(e.to_string());
        true
    };
    lost::write_lost(file, &run, &lost, &mut waiting).unwrap();
    assert_eq!(heard.len(), 3, "{heard:?}");
    assert!(heard[0].contains("lost-steps.jsonl"), "{heard:?}");
    assert_eq!(read_lost(&run).unwrap(), vec![lost.clone()]);
    let text = std::fs::read_to_string(run.lost_steps()).unwrap();
    assert_eq!(
        text,
        format!("{}\n{whole}\n", &whole[..10]),
        "torn, then once whole"
    );

    let aside = SetAsideLine {
        batch_id: 7,
        sample_ids: vec![70, 71],
        tokens: 12,
        ticket: Some(9),
        deaths: vec!["drafter-1 (pid 7) died: signal: 6 (SIGABRT)".into()],
    };
    let mut file = Ledger::open(&run.set_aside()).unwrap();
    file.inject_full(2);
    let mut tries = 0;
    write_set_aside(file, &aside, &mut |e| {
        assert!(
            e.is_full() && e.to_string().contains("set-aside.jsonl"),
            "{e}"
        );
        tries += 1;
        true
    })
    .unwrap();
    assert_eq!(tries, 2);
    record_set_aside(&run, &aside, &mut |_| false).unwrap();
    assert_eq!(read_set_aside(&run).unwrap(), vec![aside.clone(), aside]);

    // A writer that gives up (a stop) gets the full disk's error.
    let mut file = Ledger::open(&run.lost_steps()).unwrap();
    file.inject_full(1);
    let e = lost::write_lost(file, &run, &lost, &mut |_| false).unwrap_err();
    assert!(e.is_full(), "{e:?}");
}
