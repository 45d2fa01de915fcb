//! shm-ring-stat's command line on bad or awkward input: flags that cannot go together, output
//! that a reader stops reading, a ring that goes away while watched, run directories that hold
//! no live ring, and `--gc` on a ring whose header was never written. Each is an error naming
//! what is wrong, a clean end or a line saying why, never a hang.

use std::time::Duration;

use clap::Parser;
use ring_stat::cli::{run, Args};
use shm_ring::Ring;
use testkit::watchdog;

use crate::common::{fifo, unique};

/// How long a command that should end is given before the test calls it a hang.
const HANG: Duration = Duration::from_secs(60);

fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(std::iter::once("shm-ring-stat").chain(argv.iter().copied()))
}

/// `--list --gc` removed rings while the user asked for a list; `--gc --json` printed text (or
/// nothing) where JSON was asked for; `--watch`, `--interval` and `--run-dir` were ignored
/// beside `--list` and `--gc`. Each pair is refused, naming both flags.
#[test]
fn flags_that_cannot_go_together_are_refused_naming_both() {
    for argv in [
        &["--list", "--gc"][..],
        &["--list", "--watch", "1"],
        &["--list", "--interval", "2"],
        &["--list", "--run-dir", "runs/x"],
        &["--gc", "--json"],
        &["--gc", "--watch", "1"],
        &["--gc", "--interval", "2"],
        &["--gc", "--run-dir", "runs/x"],
        &["hspipe-x", "--run-dir", "runs/x"],
    ] {
        let err = parse(argv).expect_err(&format!("{argv:?} was accepted"));
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ArgumentConflict,
            "{argv:?}: {err}"
        );
        let text = err.to_string();
        let flags: Vec<&str> = argv
            .iter()
            .copied()
            .filter(|a| a.starts_with("--"))
            .collect();
        assert!(
            flags.iter().all(|f| text.contains(f)) || argv[0] == "hspipe-x",
            "{argv:?}: {text}"
        );
    }
    // What goes together still does.
    for argv in [
        &["--list", "--json"][..],
        &["--gc", "hspipe-x"],
        &["hspipe-x", "--watch", "1", "--json"],
        &["--run-dir", "runs/x", "--interval", "2"],
    ] {
        parse(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    }
}

/// A sink that takes `lines` whole lines, then fails every write as a closed pipe does (the
/// reader, `head` say, has gone); each line it took is sent on `tx`.
struct Pipe {
    got: Vec<u8>,
    lines: usize,
    tx: std::sync::mpsc::Sender<String>,
}

impl std::io::Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.got.iter().filter(|&&b| b == b'\n').count() >= self.lines {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        let before = self.got.len();
        self.got.extend_from_slice(buf);
        let mut start = before
            - self.got[..before]
                .iter()
                .rev()
                .take_while(|&&b| b != b'\n')
                .count();
        for (i, &b) in self.got.iter().enumerate().skip(before) {
            if b == b'\n' {
                let _ = self
                    .tx
                    .send(String::from_utf8_lossy(&self.got[start..i]).into());
                start = i + 1;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `--watch --json` is read as a stream: one JSON document per line (JSON Lines), so a reader
/// can take each as it comes. It printed pretty documents back to back, which no JSON parser
/// reads as one and no line reader as many. And a reader that stops (`| head -1`) ends the
/// watch quietly: it ended with `error: Broken pipe (os error 32)` and exit code 1.
#[test]
fn watched_json_is_one_document_per_line_and_a_closed_pipe_ends_it_quietly() {
    let r = Ring::create(&unique("jsonl"), &fifo(1, 1, 4)).unwrap();
    let args = Args {
        ring: Some(r.name().to_string()),
        json: true,
        watch: Some(0.05),
        ..Args::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let got = watchdog("--watch --json into a closed pipe", HANG, move || {
        let mut pipe = Pipe {
            got: Vec::new(),
            lines: 3,
            tx,
        };
        run(&args, &mut pipe).map_err(|e| format!("{e:#}"))
    });
    assert_eq!(
        got,
        Ok(()),
        "a closed pipe is the reader's choice, not an error"
    );
    let lines: Vec<String> = rx.try_iter().collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not a document: {l:?}"));
        assert_eq!(v["snapshot"]["name"], r.name(), "{l}");
    }
}

/// A ring removed while watched (its run ended: the launcher removes its ring) ends the watch
/// after one last report that says so. It went on for ever, reading the unlinked mapping, and
/// its verdict told the user to remove with `--gc` a ring that was already gone.
#[test]
fn a_ring_removed_while_watched_ends_the_watch_saying_so() {
    for json in [false, true] {
        let ring = Ring::create(&unique("removed"), &fifo(1, 1, 4)).unwrap();
        let args = Args {
            ring: Some(ring.name().to_string()),
            json,
            watch: Some(0.05),
            ..Args::default()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let watching = std::thread::spawn(move || {
            let mut pipe = Pipe {
                got: Vec::new(),
                lines: usize::MAX,
                tx,
            };
            run(&args, &mut pipe).map_err(|e| format!("{e:#}"))
        });
        // The first line is out: the watch is going. The creator's handle removes the ring.
        rx.recv_timeout(HANG).expect("no output from --watch");
        drop(ring);
        let ended = watchdog("--watch on a removed ring", HANG, move || watching.join());
        assert_eq!(ended.unwrap(), Ok(()));
        let out: Vec<String> = rx.try_iter().collect();
        let text = out.join("\n");
        assert!(
            text.contains("is no longer in /dev/shm"),
            "json {json}: no word of the removal:\n{text}"
        );
        assert!(!text.contains("--gc"), "json {json}:\n{text}");
        if json {
            for l in &out {
                serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            }
        }
    }
}

/// The error for `--run-dir dir`.
fn run_dir_error(dir: &std::path::Path) -> String {
    let args = Args {
        run_dir: Some(dir.to_path_buf()),
        interval: 0.05,
        ..Args::default()
    };
    format!("{:#}", run(&args, &mut Vec::new()).unwrap_err())
}

/// `--run-dir` on a run that is not running says what the directory is: missing, not a run,
/// a run that has ended (the launcher removes its ring and writes summary.json), or one whose
/// ring is gone without a summary. A finished run said only `ring "hspipe-..." not found in
/// /dev/shm`, and an empty ring file `attaching to : invalid ring name ""`.
#[test]
fn a_run_dir_without_a_live_ring_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let err = run_dir_error(&missing);
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("does not exist"),
        "{err}"
    );

    let not_a_run = tmp.path().join("not-a-run");
    std::fs::create_dir(&not_a_run).unwrap();
    let err = run_dir_error(&not_a_run);
    assert!(err.contains("not a launcher run directory"), "{err}");

    let empty = tmp.path().join("empty-ring-file");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("ring"), "\n").unwrap();
    let err = run_dir_error(&empty);
    assert!(err.contains("ring") && err.contains("is empty"), "{err}");
    assert!(!err.contains("attaching to :"), "{err}");

    let gone = unique("gone");
    let ended = tmp.path().join("ended run");
    std::fs::create_dir(&ended).unwrap();
    std::fs::write(ended.join("ring"), format!("{gone}\n")).unwrap();
    let err = run_dir_error(&ended);
    // The commands it prints run as printed, the path with its space one word.
    let quoted = format!("'{}'", ended.display());
    assert!(
        err.contains(&gone)
            && err.contains("not running")
            && err.contains(&format!("`launcher --resume {quoted}`")),
        "no summary: {err}"
    );
    std::fs::write(ended.join("summary.json"), "{}").unwrap();
    let err = run_dir_error(&ended);
    assert!(
        err.contains("has ended")
            && err.contains("summary.json")
            && err.contains(&format!("`launcher report {quoted}`")),
        "{err}"
    );
}

/// Unlinks a test's segments when the test ends, passed or failed.
struct Unlink(Vec<String>);

impl Drop for Unlink {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(name));
        }
    }
}

/// A blank 0600 segment `name` (made and sized, never initialised), last changed an hour ago.
fn blank(name: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(std::path::Path::new("/dev/shm").join(name))
        .unwrap();
    f.set_len(16384).unwrap();
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
}

/// The time now (Unix seconds) and a dead pid (a child that has exited and been reaped): what
/// a launcher's ring name holds, for one that is gone.
fn now_and_a_dead_pid() -> (u64, u32) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut c = std::process::Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    (now, c.id())
}

/// `shm-ring-stat --gc RING`'s output; RING is removed only if stale.
fn gc(ring: &str) -> String {
    let args = Args {
        ring: Some(ring.to_string()),
        gc: true,
        ..Args::default()
    };
    let mut out = Vec::new();
    run(&args, &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// A launcher SIGKILLed inside `Ring::create` leaves its ring blank: no header names its
/// creator, and `--gc` said `not removed` for ever. Its name does
/// (`hspipe-<unix secs>-<launcher pid>`): with that launcher gone, `--gc` removes the ring and
/// says why, and the run's drafter group goes with it; while the launcher named in it runs,
/// both stay.
#[test]
fn gc_removes_a_blank_ring_whose_named_launcher_is_gone_with_its_group() {
    let (now, dead) = now_and_a_dead_pid();
    let ring = format!("{}{}-{dead}", shm_ring::NAME_PREFIX, now - 3600);
    let group = proto::group_segment(&ring);
    let _g = Unlink(vec![ring.clone(), group.clone()]);
    blank(&ring);
    blank(&group);
    let out = gc(&ring);
    assert!(
        out.contains(&format!("removed {ring} (never initialised"))
            && out.contains(&format!("pid {dead}"))
            && out.contains(&format!("removed {group}")),
        "{out}"
    );
    for name in [&ring, &group] {
        assert!(
            !std::path::Path::new("/dev/shm").join(name).exists(),
            "{name}"
        );
    }

    // This process's own name for it: the launcher named in it runs.
    let live = format!("{}{now}-{}", shm_ring::NAME_PREFIX, std::process::id());
    let live_group = proto::group_segment(&live);
    let _g = Unlink(vec![live.clone(), live_group.clone()]);
    blank(&live);
    blank(&live_group);
    let out = gc(&live);
    assert!(
        out.starts_with(&format!("not removed: {live}: never initialised"))
            && out.contains("still runs"),
        "{out}"
    );
    for name in [&live, &live_group] {
        assert!(
            std::path::Path::new("/dev/shm").join(name).exists(),
            "{name}"
        );
    }
}

/// A drafter group whose ring is gone (its launcher killed after removing the ring, or the
/// ring removed by hand) was "not removed: ... cannot be judged" for ever. Its ring's name names
/// the launcher that made both: with that launcher gone, `--gc GROUP` removes it, saying why;
/// while it runs, the group stays. (A process that still maps it keeps its mapping.)
#[test]
fn gc_removes_a_drafter_group_whose_ring_and_launcher_are_gone() {
    let (now, dead) = now_and_a_dead_pid();
    let ring = format!("{}{}-{dead}", shm_ring::NAME_PREFIX, now - 3600);
    let group = proto::group_segment(&ring);
    let _g = Unlink(vec![group.clone()]);
    blank(&group);
    let out = gc(&group);
    assert!(
        out.starts_with(&format!(
            "removed {group} (the drafter group of {ring}, which is gone; stale by its name: launcher pid {dead}"
        )),
        "{out}"
    );
    assert!(!std::path::Path::new("/dev/shm").join(&group).exists());

    let live = format!("{}{now}-{}", shm_ring::NAME_PREFIX, std::process::id());
    let live_group = proto::group_segment(&live);
    let _g = Unlink(vec![live_group.clone()]);
    blank(&live_group);
    let out = gc(&live_group);
    assert!(
        out.starts_with(&format!("not removed: {live_group}: it is the drafter group of {live}, which is gone; not judged"))
            && out.contains("still runs"),
        "{out}"
    );
    assert!(std::path::Path::new("/dev/shm").join(&live_group).exists());
}
