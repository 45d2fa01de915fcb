//! What a person sees: `shm-ring-stat --watch` and the launcher's progress line in a real
//! terminal (tmux, on a private server), and `launcher report`'s picture of a run.

use rustix::process::{Pid, Signal};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use shm_ring::WorkerName;

use crate::launcher::{config, kill, kill_everything_mid_run, no_segment_of, Backend, Run};
use crate::support::{spawn, workspace_bin, WATCHDOG};

/// A tmux server of this test alone (its own socket), killed with everything in it on drop.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new() -> Tmux {
        static N: AtomicU32 = AtomicU32::new(0);
        let socket = format!(
            "hspipe-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        Tmux { socket }
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running tmux (scripts/test.sh installs it): {e}"))
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A session running `command` (exec'd, so the pane's process is the command) in a
    /// terminal of `w` x `h`.
    fn start(&self, session: &str, w: u16, h: u16, command: &str) {
        self.ok(&[
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            &w.to_string(),
            "-y",
            &h.to_string(),
            &format!("exec {command}"),
        ]);
    }

    /// The screen as the terminal shows it, lines the terminal wrapped joined again (`-J`), so
    /// a line wider than the terminal shows as one long line.
    fn screen(&self, session: &str) -> Vec<String> {
        self.ok(&["capture-pane", "-p", "-J", "-t", session])
            .lines()
            .map(|l| l.trim_end().to_string())
            .collect()
    }

    fn alive(&self, session: &str) -> bool {
        self.run(&["has-session", "-t", session]).status.success()
    }

    fn pid(&self, session: &str) -> u32 {
        self.ok(&["display-message", "-p", "-t", session, "#{pane_pid}"])
            .trim()
            .parse()
            .unwrap()
    }

    /// Captures `session` until `done` holds for the screen; panics with the last screen after
    /// the watchdog.
    fn wait_for(&self, session: &str, what: &str, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            let screen = self.screen(session);
            if done(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the screen:\n{}",
                screen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_gone(&self, session: &str) {
        let deadline = Instant::now() + WATCHDOG;
        while self.alive(session) {
            assert!(Instant::now() < deadline, "{session} did not end");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// The workers of a 5-target, 3-drafter run, by the names of their logs.
fn workers() -> Vec<String> {
    let targets = (0..5).map(WorkerName::producer);
    targets
        .chain((0..3).map(WorkerName::consumer))
        .map(|w| w.to_string())
        .collect()
}

/// The stat screen is complete: the verdict and one row per worker.
fn complete(screen: &[String]) -> bool {
    screen.iter().any(|l| l.starts_with("verdict: "))
        && workers()
            .iter()
            .all(|w| screen.iter().any(|l| l.starts_with(w.as_str())))
}

fn assert_fits(screen: &[String], w: usize, h: usize) {
    let text = screen.join("\n");
    assert!(
        screen.len() <= h,
        "{} lines on a {h}-line terminal:\n{text}",
        screen.len()
    );
    for l in screen {
        assert!(
            l.chars().count() <= w,
            "a line of {} columns on a {w}-column terminal:\n{l}\n--- the screen:\n{text}",
            l.chars().count()
        );
    }
}

#[test]
fn the_watch_screen_and_the_progress_line_fit_80x24_and_120x40() {
    let run = Run::new("tmux");
    // Slow workers and far more data than the test needs: the run lives until it is stopped.
    let cfg = config(&run.dir, true, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("synthetic_samples = 400", "synthetic_samples = 20000");
    std::fs::write(&cfg, text).unwrap();
    let run_dir = run.run_dir();
    let tmux = Tmux::new();
    // The launcher itself on a terminal: its progress bar.
    tmux.start(
        "run",
        80,
        24,
        &format!(
            "{} --targets 0-4 --drafters 5-7 --monitor 0.2 --config {} --run-dir {}",
            workspace_bin("launcher"),
            cfg.display(),
            run_dir.display()
        ),
    );
    let launcher_pid = tmux.pid("run");
    let progress = tmux.wait_for("run", "the launcher's progress line", |s| {
        s.iter().any(|l| l.contains("tok/s  ring"))
    });
    let bar = progress.iter().find(|l| l.contains("tok/s  ring")).unwrap();
    assert!(
        bar.chars().count() <= 80,
        "the progress line is wider than the terminal:\n{}",
        progress.join("\n")
    );

    let watch = format!(
        "{} --run-dir {} --watch 0.3",
        workspace_bin("shm-ring-stat"),
        run_dir.display()
    );
    tmux.start("stat", 80, 24, &watch);
    let small = tmux.wait_for("stat", "verdict and 8 worker rows at 80x24", complete);
    assert_fits(&small, 80, 24);
    // Narrow: the phases are a stacked bar with its legend.
    assert!(
        small.iter().any(|l| l.starts_with("phases: ")),
        "{}",
        small.join("\n")
    );

    // A resize is seen at once: the wider layout has a pid column and one per phase.
    tmux.ok(&["resize-window", "-t", "stat", "-x", "120", "-y", "40"]);
    let wide = tmux.wait_for("stat", "the 120x40 layout with a trend", |s| {
        complete(s)
            && s.iter()
                .any(|l| l.starts_with("worker") && l.contains(" pid "))
            && !s
                .iter()
                .any(|l| l.starts_with("ready ") && l.contains("(0s)"))
    });
    assert_fits(&wide, 120, 40);
    assert!(
        wide.iter()
            .any(|l| l.contains("comp") && l.contains("ckpt")),
        "{}",
        wide.join("\n")
    );
    assert!(
        wide.iter().any(|l| l.starts_with("ready ")),
        "the READY trend: {}",
        wide.join("\n")
    );
    assert!(
        wide.iter().any(|l| l.starts_with("tok/s ")),
        "the tokens/s trend: {}",
        wide.join("\n")
    );

    // A terminal that goes away (here its tmux server, as when a window closes or an SSH
    // session drops) ends the screen: before, crossterm spun on the dead terminal for good.
    let gone = Tmux::new();
    gone.start("stat", 80, 24, &watch);
    gone.wait_for("stat", "a second screen", complete);
    let orphan = gone.pid("stat");
    drop(gone);
    let deadline = Instant::now() + WATCHDOG;
    while std::fs::read_to_string(format!("/proc/{orphan}/stat")).is_ok_and(|s| !s.contains(") Z "))
    {
        assert!(
            Instant::now() < deadline,
            "shm-ring-stat --watch still runs after its terminal went away"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // q leaves the screen; the run goes on until stopped.
    tmux.ok(&["send-keys", "-t", "stat", "q"]);
    tmux.wait_gone("stat");
    kill(launcher_pid, Signal::INT);
    tmux.wait_gone("run");
    no_segment_of(launcher_pid);
    assert_eq!(run.summary()["exit_code"], 130);
}

/// The progress bar of a resumed run that has trained nothing yet (its drafters now crash at
/// every start) says `ETA ?`: before, indicatif took the checkpoint's batches for progress made
/// in the resume's first moment and said `ETA 0s`, then a few seconds, for a run that stood.
#[test]
fn a_resumed_run_that_has_trained_nothing_yet_shows_no_eta() {
    let run = Run::new("etaresume");
    let (_, kept, _) = kill_everything_mid_run(Backend::Mock, &run, 400, 1, 12);
    let run_dir = run.run_dir();
    let rd = proto::RunDir::new(&run_dir);
    let mut cfg = std::fs::read_to_string(rd.config()).unwrap();
    for d in 0..3 {
        cfg += &format!("\n[faults.drafter-{d}]\ncrash_at_start = true\n");
    }
    std::fs::write(rd.config(), cfg).unwrap();
    let ticks = || {
        std::fs::read_to_string(rd.metrics())
            .unwrap()
            .lines()
            .count()
    };
    let before = ticks();
    let tmux = Tmux::new();
    tmux.start(
        "run",
        160,
        24,
        &format!(
            "{} --resume {} --monitor 0.1 --max-restarts 1000",
            workspace_bin("launcher"),
            run_dir.display()
        ),
    );
    let pid = tmux.pid("run");
    // Ten ticks: indicatif had taken in the checkpoint's batches by then.
    let deadline = Instant::now() + WATCHDOG;
    while ticks() < before + 10 {
        assert!(Instant::now() < deadline, "the resume wrote no ten ticks");
        std::thread::sleep(Duration::from_millis(50));
    }
    let screen = tmux.wait_for("run", "the resume's progress bar", |s| {
        s.iter().any(|l| l.contains("tok/s  ring"))
    });
    let bar = screen.iter().find(|l| l.contains("tok/s  ring")).unwrap();
    let at = format!(" {}/", kept.len());
    assert!(bar.contains(&at), "the bar is not at {at}: {bar}");
    assert!(bar.contains("ETA ?  "), "{bar}");
    // Its drafters never drain the ring: the stop ends once none is left to restart, or a
    // second signal, past the first's second, ends it (gone already: nothing to signal).
    kill(pid, Signal::INT);
    std::thread::sleep(Duration::from_millis(1500));
    if let Err(e) = rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::INT) {
        assert_eq!(e, rustix::io::Errno::SRCH, "kill {pid}: {e}");
    }
    tmux.wait_gone("run");
    no_segment_of(pid);
}

/// `launcher report` with `args`: (exit code, stderr).
fn report(args: &[&str]) -> (i32, String) {
    let p = spawn(&workspace_bin("launcher"), &[&["report"], args].concat());
    let (status, err) = p.wait_status_keep();
    assert!(!err.contains("panicked"), "{err}");
    (status.code().unwrap(), err)
}

/// The `width` and `height` attributes of an SVG document's root element.
fn svg_size(svg: &str) -> (u32, u32) {
    let root = &svg[svg.find("<svg").expect("an <svg> element")..];
    let root = &root[..root.find('>').unwrap()];
    let attr = |name: &str| -> u32 {
        let at = root.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        root[at..].split('"').next().unwrap().parse().unwrap()
    };
    (attr("width"), attr("height"))
}

#[test]
fn the_report_draws_a_run_with_a_death_and_a_restart_and_refuses_bad_input_clearly() {
    let run = Run::new("report");
    // Dies in its first batch, is restarted once, dies again (no batch finished between: a
    // crash loop) and is given up: a death and a restart early in the run, and no restart
    // racing the end of the run.
    let cfg = config(&run.dir, false, "[faults.drafter-1]\ncrash_after = 1\n");
    // Ticks every 50 ms: the run lasts half a second on a quiet machine, and the picture of a
    // killed launcher below needs a metrics file long enough to cut in half.
    let (status, err) = run
        .launch(&cfg, &["--max-restarts", "1", "--monitor", "0.05"])
        .wait_status_keep();
    assert!(matches!(status.code(), Some(0 | 3)), "{status}: {err}");
    let dir = run.run_dir();
    let dir_s = dir.to_str().unwrap();

    // Finished: the stated size, the death and the restart marked.
    let svg_path = run.dir.join("run.svg");
    let (code, err) = report(&[
        dir_s,
        "-o",
        svg_path.to_str().unwrap(),
        "--width",
        "900",
        "--height",
        "1000",
    ]);
    assert_eq!(code, 0, "{err}");
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.len() > 1000, "an empty picture:\n{svg}");
    assert_eq!(svg_size(&svg), (900, 1000));
    for want in [
        "drafter-1 died",
        "drafter-1 restarted",
        "capacity 24",
        "tokens/s",
        "(exit code ",
        "longest idle gap of the drafters",
    ] {
        assert!(svg.contains(want), "the picture lacks {want:?}");
    }
    for w in workers() {
        assert!(svg.contains(&format!("{w} (GPU")), "no band for {w}");
    }

    // The default: <run-dir>/report.svg, at the size it says.
    let p = spawn(&workspace_bin("launcher"), &["report", dir_s]);
    let said = p.finish();
    let svg = std::fs::read_to_string(dir.join("report.svg")).unwrap();
    let (w, h) = svg_size(&svg);
    assert!(said.contains(&format!("({w}x{h} px)")), "{said}");
    let count = |what: &str| -> u32 {
        let before = said.split(&format!(" {what}")).next().unwrap();
        before.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(count("deaths") >= 1 && count("restarts") >= 1, "{said}");

    // Killed launcher: no summary, the metrics stop mid-run. Drawn, and said so.
    let cut = run.dir.join("cut");
    std::fs::create_dir_all(&cut).unwrap();
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<&str> = metrics.lines().collect();
    assert!(
        lines.len() >= 4,
        "a run this short cannot be cut: {metrics}"
    );
    let half: String = lines[..lines.len() / 2]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(cut.join("metrics.jsonl"), &half).unwrap();
    let cut_svg = run.dir.join("cut.svg");
    let (code, err) = report(&[cut.to_str().unwrap(), "-o", cut_svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let svg = std::fs::read_to_string(&cut_svg).unwrap();
    assert!(
        svg.contains("no summary.json"),
        "the picture should say the run did not finish"
    );

    // Resumed: `--resume` appends a second session whose clock starts at 0 again.
    std::fs::write(cut.join("metrics.jsonl"), format!("{half}{half}")).unwrap();
    let (code, err) = report(&[cut.to_str().unwrap(), "-o", cut_svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let svg = std::fs::read_to_string(&cut_svg).unwrap();
    // Once in the legend, once at the mark.
    assert_eq!(
        svg.matches("\nresumed\n").count(),
        2,
        "the take-over is not marked"
    );

    // The drafter's loss and acceptance length, once the metrics carry them: a panel each.
    let with_loss: String = lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let mut t: serde_json::Value = serde_json::from_str(l).unwrap();
            t["drafter_loss"] = (3.0 / (1.0 + i as f64)).into();
            t["acceptance_length"] = (1.0 + 0.1 * i as f64).into();
            format!("{t}\n")
        })
        .collect();
    std::fs::write(cut.join("metrics.jsonl"), with_loss).unwrap();
    let (code, err) = report(&[cut.to_str().unwrap(), "-o", cut_svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let svg = std::fs::read_to_string(&cut_svg).unwrap();
    assert!(svg.contains("\ndrafter loss\n") && svg.contains("\nacceptance length (tau)\n"));

    // Metrics made by hand, in run directories of their own.
    let bad = |name: &str, metrics: Option<&str>| -> String {
        let d = run.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        if let Some(m) = metrics {
            std::fs::write(d.join("metrics.jsonl"), m).unwrap();
        }
        d.to_str().unwrap().to_string()
    };
    // A line torn by a kill, cut short or edited is skipped and counted; the rest is drawn.
    let truncated = format!("{}{}", half, &lines[lines.len() / 2][..20]);
    let garbage = format!("{}not json\n{}", half, lines[lines.len() / 2]);
    for (name, metrics, why) in [
        ("truncated", &truncated, "cut short"),
        ("garbage", &garbage, "not a monitor tick"),
    ] {
        let dir = bad(name, Some(metrics));
        let (code, err) = report(&[&dir]);
        let n = lines.len() / 2 + 1;
        let want = format!("1 line of metrics.jsonl is no tick, skipped (line {n}: {why}");
        assert!(
            code == 0 && err.starts_with("warning: ") && err.contains(&want),
            "{err}"
        );
        let svg = std::fs::read_to_string(Path::new(&dir).join("report.svg")).unwrap();
        assert!(svg.contains(&want), "the picture should say {want:?}");
    }
    // Bad input: exit 1, `error: ` and what is wrong, where.
    let cases = [
        (
            format!("{}/nonexistent", run.dir.display()),
            "does not exist".to_string(),
        ),
        (bad("nometrics", None), "has no metrics.jsonl".to_string()),
        (bad("empty", Some("")), "metrics.jsonl is empty".to_string()),
        (
            bad("blank", Some("\n\n")),
            "metrics.jsonl is empty".to_string(),
        ),
        (
            bad("notticks", Some("not json\n{\"t_s\": \"x\"}\n")),
            "metrics.jsonl:1: not a monitor tick".to_string(),
        ),
    ];
    for (dir, want) in &cases {
        let (code, err) = report(&[dir]);
        assert_eq!(code, 1, "{dir}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(want.as_str()),
            "{err:?} should say {want:?}"
        );
    }
    let (code, err) = report(&[dir_s, "-o", run.dir.join("x.png").to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("SVG"), "{err}");
    let (code, err) = report(&[dir_s, "--height", "100"]);
    assert_eq!(code, 2, "a flag out of range: {err}");
    assert!(err.contains("too short"), "{err}");
    assert!(!Path::new(&cases[0].0).exists());
}
