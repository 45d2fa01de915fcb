//! Inputs far larger than what is kept of them cost a bounded amount of memory: a summary.json
//! and a ledger of GBs through `launcher report`. Each runs the launcher under a data-size
//! limit (`prlimit --data`) that the old whole reads passed, and died of (`memory allocation
//! failed`, SIGABRT).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use crate::support::{spawn, workspace_bin, TestDir};

/// The launcher's data limit: far above what it needs, far below what a whole read needs.
const DATA_LIMIT: &str = "--data=536870912";

/// `launcher ARGS` under [`DATA_LIMIT`]: its exit status and what it printed.
fn launcher_limited(args: &[&str]) -> (std::process::ExitStatus, String) {
    let launcher = workspace_bin("launcher");
    let mut all = vec![DATA_LIMIT, "--", &launcher];
    all.extend(args);
    let (status, out, p) = spawn("prlimit", &all).finish_status();
    std::thread::sleep(std::time::Duration::from_millis(100));
    (status, format!("{out}{}", p.stderr()))
}

/// `launcher report` of a run whose summary.json is 2 GiB and whose ledger holds a line of
/// 1 GiB between two batches (sparse files, NUL bytes: a crash's leftovers, or a file that is
/// no run's) draws the run: the summary said to be too large, the long line an unreadable one,
/// the two batches counted. Before, both files were read whole.
#[test]
fn report_reads_a_huge_summary_and_ledger_within_bounds() {
    let dir = TestDir::new("bigreport");
    let run = dir.path("run");
    std::fs::create_dir_all(run.join("ledger")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"t_s\":1}\n{\"t_s\":2}\n").unwrap();
    let sparse = |path: &Path, before: &str, len: u64, after: &str| {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(before.as_bytes()).unwrap();
        f.set_len(len).unwrap();
        f.seek(SeekFrom::End(0)).unwrap();
        f.write_all(after.as_bytes()).unwrap();
    };
    sparse(&run.join("summary.json"), "{", 2 << 30, "}");
    let line = |batch: u64| {
        format!(
            "{{\"batch_id\":{batch},\"sample_ids\":[{batch}],\"tokens\":10,\"delivery\":0,\"step\":{batch},\"epoch\":1}}\n"
        )
    };
    sparse(
        &run.join("ledger").join("drafter-0.jsonl"),
        &line(0),
        1 << 30,
        &format!("\n{}", line(1)),
    );
    let svg = dir.path("report.svg");
    let (status, said) =
        launcher_limited(&["report", run.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(status.success(), "{status}: {said}");
    assert!(
        said.contains("summary.json is unreadable (it is 2147483649 bytes, more than any summary"),
        "{said}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.contains("the ledgers hold 2 trained batches"),
        "{said}"
    );
}
