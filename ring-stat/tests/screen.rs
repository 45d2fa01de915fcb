//! shm-ring-stat's screen laid out for terminals of several sizes: nothing wider than the
//! terminal, and the verdict and every worker row on it whatever else has to go.

use std::time::Duration;

use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::widgets::Widget;
use ring_stat::screen::{buffer_lines, print_once, Trends, View};
use ring_stat::Report;
use shm_ring::{CommitMeta, Phase, Ring, WorkerName};

use crate::common::{fifo, unique};

const NAMES: [&str; 8] = [
    "target-0",
    "target-1",
    "target-2",
    "target-3",
    "target-4",
    "drafter-0",
    "drafter-1",
    "drafter-2",
];

/// A 5x3 ring over one (made-up) second: targets waiting on a full ring, drafters computing,
/// one drafter dead and recovered (a warning), one target slow (a straggler).
fn five_by_three() -> (Ring, Report) {
    let r = Ring::create(&unique("screen"), &fifo(5, 3, 32)).unwrap();
    let ps: Vec<_> = (0..5).map(|i| r.producer(i).unwrap()).collect();
    let cs: Vec<_> = (0..3).map(|i| r.consumer(i).unwrap()).collect();
    for (i, p) in ps.iter().enumerate() {
        p.set_gpu(Some(i as u32));
    }
    for (i, c) in cs.iter().enumerate() {
        c.set_gpu(Some(5 + i as u32));
    }
    // Mid-run: the drafters have taken before.
    let meta = CommitMeta {
        tokens: 100,
        ..CommitMeta::default()
    };
    ps[0].reserve(8).unwrap().commit(meta).unwrap();
    cs[1].take().unwrap().unwrap().release().unwrap();
    let a = r.snapshot();
    for (i, p) in ps.iter().enumerate() {
        // Target 4 is slow: it loads for half the second where the others wait.
        let (load, wait) = if i == 4 { (500, 50) } else { (30, 550) };
        p.add_phase(Phase::Compute, Duration::from_millis(400));
        p.add_phase(Phase::WaitFull, Duration::from_millis(wait));
        p.add_phase(Phase::Load, Duration::from_millis(load));
        for _ in 0..5 {
            p.reserve(8).unwrap().commit(meta).unwrap();
        }
    }
    for c in &cs {
        c.add_phase(Phase::Compute, Duration::from_millis(900));
        c.add_phase(Phase::Checkpoint, Duration::from_millis(60));
    }
    // Drafter 1's GPU sat idle once for 330 ms (the gap column).
    cs[1].add_gap(Duration::from_millis(330));
    cs[0].take().unwrap().unwrap().release().unwrap();
    // Left registered and alive (a dropped handle would be done), but drafter 2 crashed.
    std::mem::forget(ps);
    std::mem::forget(cs);
    // SAFETY: every handle of consumer 2 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(2)) }.unwrap();
    let mut b = r.snapshot();
    b.taken_at_ns = a.taken_at_ns + 1_000_000_000;
    let occupancy = vec![r.slot_counts(); 10];
    let rep = Report::between(&a, b, &occupancy);
    (r, rep)
}

fn trends() -> Trends {
    let mut t = Trends::default();
    for i in 0..90 {
        t.push(f64::from(i % 24), 1000.0 * f64::from(i));
    }
    t
}

fn render(rep: &Report, trends: &Trends, w: u16, h: u16) -> Vec<String> {
    let view = View {
        report: rep,
        trends,
        period: Some(Duration::from_secs(2)),
    };
    let mut buf = Buffer::empty(Rect::new(0, 0, w, h));
    (&view).render(buf.area, &mut buf);
    buffer_lines(&buf)
}

fn has(screen: &[String], prefix: &str) -> bool {
    screen.iter().any(|l| l.starts_with(prefix))
}

fn check(screen: &[String], w: u16, h: u16) {
    let text = screen.join("\n");
    assert!(screen.len() <= h as usize, "{text}");
    for l in screen {
        assert!(l.chars().count() <= w as usize, "{l}\n{text}");
    }
    assert!(
        has(screen, "verdict: drafters are the bottleneck"),
        "{text}"
    );
    for n in NAMES {
        assert!(has(screen, n), "no row for {n}:\n{text}");
    }
}

#[test]
fn at_80x24_everything_is_on_screen_with_phases_as_a_stacked_bar() {
    let (_r, rep) = five_by_three();
    let s = render(&rep, &trends(), 80, 24);
    check(&s, 80, 24);
    let text = s.join("\n");
    for want in [
        "slots [",
        "ready  ",
        "tok/s  ",
        "bucket ",
        "phases: ",
        "warning: drafter 2 died",
        "straggler: target 4",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
    // The trend keeps the last points that fit (at most a minute's).
    let ready = s.iter().find(|l| l.starts_with("ready  ")).unwrap();
    assert!(ready.contains("(60s)"), "{ready}");
    // A stacked bar of the phases: the drafters mostly compute (c), then checkpoint (k).
    let d0 = s.iter().find(|l| l.starts_with("drafter-0")).unwrap();
    assert!(d0.contains("ccccccccccccccc") && d0.contains('k'), "{d0}");
    assert!(s
        .iter()
        .find(|l| l.starts_with("drafter-2"))
        .unwrap()
        .contains("dead"));
}

#[test]
fn at_120x40_each_phase_has_its_column_and_the_pid_shows() {
    let (_r, rep) = five_by_three();
    let s = render(&rep, &trends(), 120, 40);
    check(&s, 120, 40);
    let head = s.iter().find(|l| l.starts_with("worker")).unwrap();
    for col in ["pid", "gap", "wfull", "comp", "ckpt", "other"] {
        assert!(head.contains(col), "{head}");
    }
    // Each worker's longest idle gap of the interval: drafter 1's, none for the others.
    let row = |n: &str| s.iter().find(|l| l.starts_with(n)).unwrap().clone();
    assert!(row("drafter-1").contains(" 330ms "), "{}", row("drafter-1"));
    assert!(!row("drafter-0").contains("ms "), "{}", row("drafter-0"));
    assert!(!has(&s, "phases: "), "no legend needed with columns");
    // Wider still: the stacked bar comes back beside the columns.
    let s = render(&rep, &trends(), 180, 40);
    check(&s, 180, 40);
    assert!(has(&s, "phases: "), "{}", s.join("\n"));
}

#[test]
fn a_short_terminal_keeps_the_verdict_and_the_workers_and_drops_the_rest() {
    let (_r, rep) = five_by_three();
    // Header, verdict (2 lines at 70), table header and 8 rows: 12 lines.
    let s = render(&rep, &trends(), 70, 12);
    check(&s, 70, 12);
    assert!(
        !has(&s, "tok/s  ") && !has(&s, "bucket "),
        "{}",
        s.join("\n")
    );
    // Shorter still: the last rows give way to a line saying how many are hidden.
    let s = render(&rep, &trends(), 70, 8);
    assert!(has(&s, "verdict: "), "{}", s.join("\n"));
    assert!(
        s.iter().any(|l| l.contains("more workers")),
        "{}",
        s.join("\n")
    );
}

/// On a narrow terminal the verdict wraps to more lines than its three: they get the rows the
/// rest leaves, and where none are left its last line shown ends with "…". Before, it stopped
/// at three lines mid-sentence with rows empty below.
#[test]
fn a_long_verdict_on_a_narrow_terminal_takes_the_rows_left_or_says_it_is_cut() {
    let (_r, rep) = five_by_three();
    let words = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    let verdict = words(&format!("verdict: {}", rep.verdict.line));
    let fits = |s: &[String], h: usize| s.len() <= h && s.iter().all(|l| l.chars().count() <= 30);
    let s = render(&rep, &trends(), 30, 60);
    assert!(fits(&s, 60), "{}", s.join("\n"));
    assert!(words(&s.join(" ")).contains(&verdict), "{}", s.join("\n"));
    let s = render(&rep, &trends(), 30, 12);
    assert!(fits(&s, 12), "{}", s.join("\n"));
    assert!(!words(&s.join(" ")).contains(&verdict));
    assert!(
        s.iter().any(|l| l.trim_end().ends_with('…')),
        "{}",
        s.join("\n")
    );
}

#[test]
fn printed_once_it_is_as_wide_as_asked_and_has_no_trends() {
    let (_r, rep) = five_by_three();
    let mut out = Vec::new();
    print_once(&rep, 90, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<String> = text.lines().map(String::from).collect();
    check(&lines, 90, 100);
    assert!(
        !has(&lines, "tok/s ") && !has(&lines, "ready ") && !text.contains("refresh"),
        "{text}"
    );
    assert!(has(&lines, "phases: "), "{text}");
}

#[test]
fn any_terminal_size_is_drawn_without_a_panic() {
    let (_r, rep) = five_by_three();
    let trends = trends();
    for w in (1..=30).chain([45, 79, 99, 100, 109, 110, 111, 140, 250]) {
        for h in [1, 2, 3, 5, 9, 13, 24] {
            let s = render(&rep, &trends, w, h);
            assert!(s.len() <= h as usize);
        }
    }
}
