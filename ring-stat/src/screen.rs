//! The screen of `shm-ring-stat` on a terminal: the ring's state, the verdict, trends and one
//! row per worker, laid out to fit the terminal it runs in.
//!
//! [`View`] is a ratatui widget, so the same code draws the live full-screen view of `--watch`
//! ([`watch`]: alternate screen, redrawn every period and at once on a resize) and the one-shot
//! table on a terminal ([`print_once`]: rendered into a buffer as wide as the terminal, printed
//! as plain lines). Nothing here writes an escape code by hand; crossterm does, through ratatui.
//!
//! Fitting: every line is clipped to the width (ratatui never writes past a cell row), and lines
//! are given out by priority when the height is short: the verdict first, then one row per
//! worker, the header, the slot bar, warnings, trends, buckets, rates, the legend. Phases are a
//! stacked bar per worker on narrow terminals, one column each from about 110 columns, and both
//! on very wide ones.
//!
//! Length: one file past 500 lines on purpose: the sections are drawn from one fitting decision (which
//! lines and columns the size allows), so split by section they would pass that state around;
//! the verdict and the figures it draws are `analysis`'s.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Sparkline, Widget};

use shm_ring::{Phase, Ring, SlotCounts, TakePolicy, WorkerState};

use crate::analysis::{self, Bottleneck, WorkerRates};
use crate::numbers::pct;
use crate::report::{Presence, Report};

/// How far back the trends reach, in one-second bins.
pub const TREND_BINS: usize = 60;

/// The last minute of the ring: READY slots and tokens/s, one point per second.
#[derive(Clone, Debug, Default)]
pub struct Trends {
    /// Mean READY slots over each second.
    pub ready: VecDeque<f64>,
    /// Tokens trained per second, each second.
    pub tokens_per_s: VecDeque<f64>,
}

impl Trends {
    pub fn push(&mut self, ready: f64, tokens_per_s: f64) {
        for (q, v) in [
            (&mut self.ready, ready),
            (&mut self.tokens_per_s, tokens_per_s),
        ] {
            q.push_back(v);
            if q.len() > TREND_BINS {
                q.pop_front();
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }
}

/// What the screen shows: the last report, the trends, and (live only) a footer.
pub struct View<'a> {
    pub report: &'a Report,
    pub trends: &'a Trends,
    /// The refresh period, for the footer of the live screen; `None` for a one-shot print.
    pub period: Option<Duration>,
}

/// Phase glyphs and colours for the stacked bar and its legend, in drawing order.
const PHASE_KEYS: [(Phase, char, &str, Color); 8] = [
    (Phase::Compute, 'c', "compute", Color::Green),
    (Phase::WaitFull, 'f', "full", Color::Red),
    (Phase::WaitEmpty, 'e', "empty", Color::Yellow),
    (Phase::Load, 'l', "load", Color::Blue),
    (Phase::CopyIn, 'i', "copy", Color::Cyan),
    (Phase::Sync, 's', "sync", Color::Magenta),
    (Phase::Checkpoint, 'k', "ckpt", Color::LightBlue),
    (Phase::Other, 'o', "other", Color::Gray),
];

/// Short column titles for the phases when each has its own column.
fn phase_title(p: Phase) -> &'static str {
    match p {
        Phase::WaitFull => "wfull",
        Phase::WaitEmpty => "wempt",
        Phase::Load => "load",
        Phase::CopyIn => "copy",
        Phase::Compute => "comp",
        Phase::Sync => "sync",
        Phase::Checkpoint => "ckpt",
        Phase::Other => "other",
    }
}

/// A gap in five columns at most: `-` for none, `330ms`, `4.2s`, `37s`.
pub fn short_duration(secs: f64) -> String {
    if secs <= 0.0 {
        "-".into()
    } else if secs < 0.9995 {
        format!("{:.0}ms", secs * 1e3)
    } else if secs < 9.95 {
        format!("{secs:.1}s")
    } else {
        format!("{:.0}s", secs.min(99_999.0))
    }
}

/// 185, 18.5k, 1.85M.
pub fn human_rate(x: f64) -> String {
    if x >= 999_500.0 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 9_995.0 {
        format!("{:.0}k", x / 1e3)
    } else if x >= 999.5 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The parts that fit in `width` columns, in order, each after two spaces; the first part
/// that does not fit ends the line.
fn fit(parts: &[String], width: usize) -> String {
    let mut s = String::new();
    for p in parts {
        if s.chars().count() + 2 + p.chars().count() > width {
            break;
        }
        s.push_str("  ");
        s.push_str(p);
    }
    s
}

/// Greedy word wrap to `width` columns; words longer than a line are cut.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    let mut cur = String::new();
    for word in text.split(' ') {
        let mut word = word.to_string();
        loop {
            let need = if cur.is_empty() {
                word.chars().count()
            } else {
                cur.chars().count() + 1 + word.chars().count()
            };
            if need <= width {
                if !cur.is_empty() {
                    cur.push(' ');
                }
                cur.push_str(&word);
                break;
            }
            if !cur.is_empty() {
                lines.push(std::mem::take(&mut cur));
                continue;
            }
            // A word longer than the line: cut it.
            let head: String = word.chars().take(width).collect();
            word = word.chars().skip(width).collect();
            lines.push(head);
            if word.is_empty() {
                break;
            }
        }
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

/// A horizontal bar of `cells` cells, `frac` of it filled in eighths.
fn share_bar(frac: f64, cells: usize) -> String {
    let eighths = (frac.clamp(0.0, 1.0) * (cells * 8) as f64).round() as usize;
    let parts = [
        "",
        symbols::block::ONE_EIGHTH,
        symbols::block::ONE_QUARTER,
        symbols::block::THREE_EIGHTHS,
        symbols::block::HALF,
        symbols::block::FIVE_EIGHTHS,
        symbols::block::THREE_QUARTERS,
        symbols::block::SEVEN_EIGHTHS,
    ];
    let mut s = symbols::block::FULL.repeat(eighths / 8);
    s.push_str(parts[eighths % 8]);
    let used = eighths / 8 + usize::from(!eighths.is_multiple_of(8));
    s.push_str(&" ".repeat(cells.saturating_sub(used)));
    s
}

/// Cells per phase for a stacked bar of `cells` cells (largest remainder, so the cells add up
/// to the rounded total share).
fn stack(w: &WorkerRates, cells: usize) -> Vec<(usize, char, Color)> {
    let shares: Vec<f64> = PHASE_KEYS
        .iter()
        .map(|&(p, ..)| w.phases[p].max(0.0))
        .collect();
    let total: f64 = shares.iter().sum::<f64>().min(1.0);
    let want = (total * cells as f64).round() as usize;
    let exact: Vec<f64> = shares.iter().map(|s| s * cells as f64).collect();
    let mut n: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut order: Vec<usize> = (0..n.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    let have: usize = n.iter().sum();
    for i in order.into_iter().take(want.saturating_sub(have)) {
        n[i] += 1;
    }
    PHASE_KEYS
        .iter()
        .zip(n)
        .filter(|(_, k)| *k > 0)
        .map(|((_, ch, _, color), k)| (k, *ch, *color))
        .collect()
}

fn state_word(w: &WorkerRates) -> (&'static str, Color) {
    match w.state {
        WorkerState::Alive if w.alive => ("up", Color::Green),
        WorkerState::Alive => ("gone", Color::Red),
        WorkerState::Done => ("done", Color::Gray),
        WorkerState::Dead => ("dead", Color::Red),
        WorkerState::Retired => ("retd", Color::Red),
        WorkerState::Vacant => ("-", Color::DarkGray),
    }
}

fn verdict_style(b: Bottleneck) -> Style {
    let color = match b {
        Bottleneck::Drafters | Bottleneck::Targets => Color::Yellow,
        Bottleneck::Balanced => Color::Green,
        Bottleneck::Neither => Color::Magenta,
        Bottleneck::Idle | Bottleneck::Draining | Bottleneck::Starting => Color::Gray,
        Bottleneck::Stalled => Color::Red,
    };
    Style::new().fg(color).add_modifier(Modifier::BOLD)
}

/// Where the next line goes, and how wide lines are.
struct Cursor<'b> {
    buf: &'b mut Buffer,
    area: Rect,
    y: u16,
}

impl Cursor<'_> {
    fn line(&mut self, line: Line<'_>) {
        if self.y < self.area.bottom() {
            self.buf
                .set_line(self.area.x, self.y, &line, self.area.width);
            self.y += 1;
        }
    }

    /// `label`, a sparkline of `data` (its last points, as many as fit) scaled to `max`, then
    /// `suffix`.
    fn spark(&mut self, label: &str, data: &[u64], max: u64, suffix: &str, color: Color) {
        if self.y >= self.area.bottom() {
            return;
        }
        let w = self.area.width;
        let lw = (label.chars().count() as u16).min(w);
        let sw = (suffix.chars().count() as u16).min(w - lw);
        let room = w - lw - sw;
        let n = (data.len() as u16).min(room);
        let y = self.y;
        self.buf.set_string(
            self.area.x,
            y,
            label,
            Style::new().add_modifier(Modifier::BOLD),
        );
        let data = &data[data.len() - n as usize..];
        Sparkline::default()
            .data(data)
            .max(max.max(1))
            .style(Style::new().fg(color))
            .render(Rect::new(self.area.x + lw, y, n, 1), self.buf);
        // The suffix goes right after the points: with a short history it follows them.
        self.buf
            .set_stringn(self.area.x + lw + n, y, suffix, sw as usize, Style::new());
        self.y += 1;
    }
}

/// The worker table's layout for a width.
struct Columns {
    pid: bool,
    /// One numeric column per phase (wide), or else a stacked bar of this many cells.
    phase_columns: bool,
    stack_cells: usize,
    busy_cells: usize,
}

impl Columns {
    /// Name 9, gpu 3, state 4, restarts 3, items 6, tok/s 6, busy bar + 4, wait 4, gap 5,
    /// spaces.
    const BASE: usize = 9 + 1 + 3 + 1 + 4 + 1 + 3 + 1 + 6 + 1 + 6 + 1 + 4 + 1 + 4 + 1 + 5 + 1;
    const PID: usize = 8;
    const PHASE_COL: usize = 6;

    fn for_width(width: u16) -> Columns {
        let width = width as usize;
        let pid = width >= 100;
        let busy_cells = if width >= 100 { 10 } else { 6 };
        let used = Self::BASE + busy_cells + 1 + if pid { Self::PID } else { 0 };
        let left = width.saturating_sub(used);
        let phase_columns = left >= Phase::ALL.len() * Self::PHASE_COL;
        // What the columns leave goes to the stacked bar, if enough for one to mean something.
        let left = if phase_columns {
            left - Phase::ALL.len() * Self::PHASE_COL
        } else {
            left
        };
        let stack_cells = if phase_columns && left < 12 {
            0
        } else {
            left.saturating_sub(1).min(40)
        };
        Columns {
            pid,
            phase_columns,
            stack_cells,
            busy_cells,
        }
    }

    fn header(&self) -> Line<'static> {
        let mut s = format!("{:<9} {:>3} ", "worker", "gpu");
        if self.pid {
            s.push_str(&format!("{:>7} ", "pid"));
        }
        s.push_str(&format!(
            "{:<4} {:>3} {:>6} {:>6} {:<bw$} {:>4} {:>5} ",
            "run",
            "rst",
            "items",
            "tok/s",
            "busy",
            "wait",
            "gap",
            bw = self.busy_cells + 5
        ));
        if self.phase_columns {
            for p in Phase::ALL {
                s.push_str(&format!("{:>5} ", phase_title(p)));
            }
        }
        if self.stack_cells > 0 {
            s.push_str("phases");
        }
        Line::styled(
            s,
            Style::new().add_modifier(Modifier::BOLD | Modifier::UNDERLINED),
        )
    }

    fn row(&self, w: &WorkerRates) -> Line<'static> {
        let mut spans = Vec::new();
        let name = w.name();
        let gpu = w.gpu.map(|g| g.to_string()).unwrap_or_else(|| "-".into());
        spans.push(Span::raw(format!("{name:<9} {gpu:>3} ")));
        if self.pid {
            spans.push(Span::raw(format!("{:>7} ", w.pid)));
        }
        let (state, color) = state_word(w);
        spans.push(Span::styled(format!("{state:<4} "), Style::new().fg(color)));
        let rst = Style::new().fg(if w.restarts > 0 {
            Color::Yellow
        } else {
            Color::Reset
        });
        spans.push(Span::styled(format!("{:>3} ", w.restarts), rst));
        spans.push(Span::raw(format!(
            "{:>6} {:>6} ",
            w.items,
            human_rate(w.tokens_per_s)
        )));
        spans.push(Span::styled(
            share_bar(w.busy, self.busy_cells),
            Style::new().fg(Color::Green).bg(Color::DarkGray),
        ));
        spans.push(Span::raw(format!(
            " {:>4} {:>4} {:>5} ",
            pct(w.busy),
            pct(w.waiting),
            short_duration(w.largest_gap_s)
        )));
        if self.phase_columns {
            for p in Phase::ALL {
                let v = w.phases[p];
                spans.push(Span::raw(format!("{:>5} ", pct(v))));
            }
        }
        if self.stack_cells > 0 {
            let mut used = 0;
            for (k, ch, color) in stack(w, self.stack_cells) {
                used += k;
                spans.push(Span::styled(
                    ch.to_string().repeat(k),
                    Style::new().fg(Color::Black).bg(color),
                ));
            }
            spans.push(Span::styled(
                ".".repeat(self.stack_cells.saturating_sub(used)),
                Style::new().fg(Color::DarkGray),
            ));
        }
        Line::from(spans)
    }

    fn legend(&self) -> Option<Line<'static>> {
        if self.stack_cells == 0 {
            return None;
        }
        let mut spans = vec![Span::raw("phases: ")];
        for (_, ch, name, color) in PHASE_KEYS {
            spans.push(Span::styled(
                ch.to_string(),
                Style::new().fg(Color::Black).bg(color),
            ));
            spans.push(Span::raw(format!(" {name}  ")));
        }
        Some(Line::from(spans))
    }
}

impl Widget for &View<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let rep = self.report;
        let (s, iv, v) = (&rep.snapshot, &rep.interval, &rep.verdict);
        let width = area.width as usize;
        let cols = Columns::for_width(area.width);

        // What there is to show, then who gets the rows.
        let verdict = wrap(&format!("verdict: {}", v.line), width);
        let notes: Vec<(String, Color)> = v
            .stragglers
            .iter()
            .map(|x| (format!("straggler: {x}"), Color::Yellow))
            .chain(
                v.warnings
                    .iter()
                    .map(|x| (format!("warning: {x}"), Color::Red)),
            )
            .collect();
        // Live, the trend rows are there from the start (they fill in); printed once, never.
        let trends = self.period.is_some() || !self.trends.is_empty();
        let legend = cols.legend();
        let mut left = area.height;
        let mut take = |want: usize| -> usize {
            let t = want.min(left as usize);
            left -= t as u16;
            t
        };
        let verdict_h = take(verdict.len().min(3));
        let rows_h = take(iv.workers.len());
        let header_h = take(1);
        let thead_h = take(usize::from(!iv.workers.is_empty()));
        let slots_h = take(1);
        let notes_h = take(notes.len());
        let ready_h = take(usize::from(trends));
        let tok_h = take(usize::from(trends));
        let buckets_h = take(1);
        let rates_h = take(1);
        let legend_h = take(usize::from(legend.is_some()));
        let footer_h = take(usize::from(self.period.is_some()));
        // The verdict's lines past its first three get the rows nothing else took.
        let verdict_h = verdict_h + take(verdict.len() - verdict_h);
        // Cut short even so: its last line shown says so.
        let mut verdict = verdict;
        if verdict_h < verdict.len() && verdict_h > 0 {
            let last = &mut verdict[verdict_h - 1];
            if last.chars().count() >= width && width > 0 {
                last.pop();
            }
            last.push('…');
        }

        let mut c = Cursor {
            buf,
            area,
            y: area.y,
        };

        if header_h > 0 {
            let p = &s.params;
            let policy = match p.policy {
                TakePolicy::Fifo => "fifo".to_string(),
                TakePolicy::Bucketed { min_ready, pick } => {
                    format!("bucketed min {min_ready} {pick:?}").to_lowercase()
                }
            };
            let state = if s.closed { "closed" } else { "open" };
            let rest = fit(
                &[
                    state.to_string(),
                    format!(
                        "producers {}/{} done",
                        s.producers_done, s.producers_expected
                    ),
                    format!("work {}/{}", s.work.done, s.work.total),
                    format!("{} slots x {} KiB", p.slots, p.slot_size / 1024),
                    policy,
                    format!(
                        "creator pid {} {}",
                        s.creator.pid,
                        if s.creator_alive { "live" } else { "stale" }
                    ),
                ],
                width.saturating_sub(s.name.chars().count()),
            );
            c.line(Line::from(vec![
                Span::styled(s.name.clone(), Style::new().add_modifier(Modifier::BOLD)),
                Span::raw(rest),
            ]));
        }
        for line in verdict.into_iter().take(verdict_h) {
            c.line(Line::styled(line, verdict_style(v.bottleneck)));
        }
        let hidden = notes.len() - notes_h;
        for (i, (text, color)) in notes.iter().take(notes_h).enumerate() {
            let text = if hidden > 0 && i + 1 == notes_h {
                format!("... and {} more warnings", hidden + 1)
            } else {
                text.clone()
            };
            c.line(Line::styled(text, Style::new().fg(*color)));
        }
        if slots_h > 0 {
            c.line(slot_line(s.params.slots, s.slots, width));
        }
        let slots = u64::from(s.params.slots);
        if ready_h > 0 {
            let data: Vec<u64> = self.trends.ready.iter().map(|x| x.round() as u64).collect();
            let max = self.trends.ready.iter().copied().fold(0.0, f64::max);
            c.spark(
                "ready  ",
                &data,
                slots,
                &format!(
                    " now {}/{}, max {:.0} ({}s)",
                    s.slots.ready,
                    s.params.slots,
                    max,
                    data.len()
                ),
                Color::Green,
            );
        }
        if tok_h > 0 {
            let data: Vec<u64> = self
                .trends
                .tokens_per_s
                .iter()
                .map(|x| x.round() as u64)
                .collect();
            let max = data.iter().copied().max().unwrap_or(0);
            let mean = self.trends.tokens_per_s.iter().sum::<f64>()
                / self.trends.tokens_per_s.len().max(1) as f64;
            c.spark(
                "tok/s  ",
                &data,
                max,
                &format!(
                    " now {}, mean {} ({}s)",
                    human_rate(iv.tokens_per_s),
                    human_rate(mean),
                    data.len()
                ),
                Color::Cyan,
            );
        }
        if buckets_h > 0 {
            let data: Vec<u64> = s.ready_per_bucket.iter().map(|&n| u64::from(n)).collect();
            let max = data.iter().copied().max().unwrap_or(0);
            let counts: Vec<String> = data.iter().map(u64::to_string).collect();
            c.spark(
                "bucket ",
                &data,
                max,
                &format!(
                    " ready per length class, short to long: {}",
                    counts.join(" ")
                ),
                Color::Green,
            );
        }
        if rates_h > 0 {
            let k = &s.counters;
            c.line(Line::raw(
                fit(
                    &[
                        format!(
                            "over {:.1}s: published {:.1}/s  trained {:.1}/s",
                            iv.seconds, iv.published_per_s, iv.released_per_s
                        ),
                        format!("{} tok/s", human_rate(iv.tokens_per_s)),
                        format!(
                            "ring full {} empty {}",
                            pct(iv.full_frac),
                            pct(iv.empty_frac)
                        ),
                        format!(
                            "| totals: published {} taken {} released {} redelivered {} set aside {} refused {}",
                            k.published, k.taken, k.released, k.redelivered, k.set_aside, k.refused
                        ),
                    ],
                    width + 2,
                )
                .trim_start()
                .to_string(),
            ));
        }
        if thead_h > 0 {
            c.line(cols.header());
        }
        let more = iv.workers.len() - rows_h;
        for (i, w) in iv.workers.iter().take(rows_h).enumerate() {
            if more > 0 && i + 1 == rows_h {
                c.line(Line::styled(
                    format!(
                        "... {} more workers: a taller terminal shows them",
                        more + 1
                    ),
                    Style::new().fg(Color::Yellow),
                ));
            } else {
                c.line(cols.row(w));
            }
        }
        if legend_h > 0 {
            if let Some(l) = legend {
                c.line(l);
            }
        }
        if footer_h > 0 {
            let period = self.period.unwrap_or_default().as_secs_f64();
            c.line(Line::styled(
                format!("refresh {period:.1}s, trends one point a second  |  q quits"),
                Style::new().fg(Color::DarkGray),
            ));
        }
    }
}

/// `slots [rrRRRRWW......] ready 4 reading 2 writing 2 free 6`, as wide as `width` allows.
fn slot_line(total: u32, n: SlotCounts, width: usize) -> Line<'static> {
    let counts = if width >= 100 {
        format!(
            " ready {} reading {} writing {} free {}",
            n.ready, n.reading, n.writing, n.free
        )
    } else {
        format!(" R{} r{} W{} .{}", n.ready, n.reading, n.writing, n.free)
    };
    let cells = width
        .saturating_sub("slots []".len() + counts.len())
        .min(total as usize * 2)
        .max(1);
    let part = |k: u32| ((f64::from(k) / f64::from(total.max(1))) * cells as f64).round() as usize;
    let mut rest = cells;
    let mut spans = vec![
        Span::styled("slots ", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw("["),
    ];
    for (k, ch, color) in [
        (n.reading, 'r', Color::Cyan),
        (n.ready, 'R', Color::Green),
        (n.writing, 'W', Color::Yellow),
    ] {
        let k = part(k).min(rest);
        rest -= k;
        spans.push(Span::styled(
            ch.to_string().repeat(k),
            Style::new().fg(Color::Black).bg(color),
        ));
    }
    spans.push(Span::styled(
        ".".repeat(rest),
        Style::new().fg(Color::DarkGray),
    ));
    spans.push(Span::raw("]"));
    spans.push(Span::raw(counts));
    Line::from(spans)
}

/// The text of a buffer, one line per row, trailing blanks trimmed and empty rows at the end
/// dropped.
pub fn buffer_lines(buf: &Buffer) -> Vec<String> {
    let area = buf.area;
    let mut lines: Vec<String> = (area.top()..area.bottom())
        .map(|y| {
            let mut s = String::new();
            for x in area.left()..area.right() {
                s.push_str(buf[(x, y)].symbol());
            }
            s.trim_end().to_string()
        })
        .collect();
    while lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    lines
}

/// Prints one report as the screen would show it, `width` columns wide, as plain text.
pub fn print_once(rep: &Report, width: u16, out: &mut impl Write) -> std::io::Result<()> {
    let trends = Trends::default();
    let view = View {
        report: rep,
        trends: &trends,
        period: None,
    };
    // Tall enough for everything; the empty rows at the end are dropped.
    let rows = 16 + rep.interval.workers.len() + rep.verdict.warnings.len() * 2;
    let mut buf = Buffer::empty(Rect::new(0, 0, width.max(20), rows as u16));
    (&view).render(buf.area, &mut buf);
    for line in buffer_lines(&buf) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// What the terminal's input says within a wait.
enum Input {
    None,
    Ready,
    /// The terminal is gone: reading it would only ever fail.
    HungUp,
    /// stdin is not the terminal (crossterm reads /dev/tty then): crossterm's own wait.
    Unknown,
}

fn wait_input(timeout: Duration) -> Input {
    use rustix::event::{poll, PollFd, PollFlags};
    let stdin = std::io::stdin();
    if !rustix::termios::isatty(&stdin) {
        return Input::Unknown;
    }
    let mut fds = [PollFd::new(&stdin, PollFlags::IN)];
    let timeout = rustix::event::Timespec::try_from(timeout).unwrap_or(rustix::event::Timespec {
        tv_sec: i64::MAX,
        tv_nsec: 0,
    });
    match poll(&mut fds, Some(&timeout)) {
        Ok(0) => Input::None,
        Ok(_) => {
            let got = fds[0].revents();
            if got.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL) {
                Input::HungUp
            } else {
                Input::Ready
            }
        }
        // EINTR (a signal: the loop looks at the stop flag next) and the like.
        Err(_) => Input::None,
    }
}

/// Puts the terminal back however `watch` ends (an error, a panic, or q).
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// The live screen: measures `ring` every `period` and redraws, until q, Esc, Ctrl-C or a stop
/// signal. Trends get a point every second whatever the period.
pub fn watch(ring: &Ring, period: Duration) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGQUIT,
    ] {
        signal_hook::flag::register(sig, stop.clone()).context("installing a signal handler")?;
    }
    let mut terminal = ratatui::try_init().context("setting up the terminal")?;
    let _restore = Restore;
    let presence = Presence::of(ring);

    let mut trends = Trends::default();
    let mut report: Option<Report> = None;
    let mut judge = analysis::Judge::new();
    let mut occupancy: Vec<SlotCounts> = Vec::new();
    let (mut start, mut start_at) = (ring.snapshot(), Instant::now());
    // One-second bins for the trends: the snapshot at the bin's start, READY samples in it.
    let (mut bin, mut bin_at, mut bin_ready) = (start.clone(), start_at, Vec::<u32>::new());
    // The first report comes quickly; then one every period.
    let first = period.min(Duration::from_millis(500));
    let mut redraw = true;
    while !stop.load(Ordering::Relaxed) {
        let counts = ring.slot_counts();
        occupancy.push(counts);
        bin_ready.push(counts.ready);
        // Waiting for input is the 10 ms pause between samples. A terminal that hung up (its
        // window closed, the SSH session or the tmux server gone) leaves stdin readable with
        // nothing to read, and crossterm's poll then spins inside itself for good: so wait on
        // stdin here, leave on a hang-up, and let crossterm read only what is there.
        let input = match wait_input(Duration::from_millis(10)) {
            Input::HungUp => break,
            Input::Ready => event::poll(Duration::ZERO)?,
            Input::None => false,
            Input::Unknown => event::poll(Duration::from_millis(10))?,
        };
        if input {
            match event::read()? {
                Event::Key(k) if k.kind != KeyEventKind::Release => {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) {
                        break;
                    }
                }
                Event::Resize(..) => redraw = true,
                _ => {}
            }
        }
        let now = Instant::now();
        if now.duration_since(bin_at) >= Duration::from_secs(1) {
            let end = ring.snapshot();
            let iv = analysis::interval(&bin, &end, &[]);
            let ready = bin_ready.iter().map(|&r| f64::from(r)).sum::<f64>()
                / bin_ready.len().max(1) as f64;
            trends.push(ready, iv.tokens_per_s);
            (bin, bin_at) = (end, now);
            bin_ready.clear();
        }
        let due = if report.is_some() { period } else { first };
        if now.duration_since(start_at) >= due {
            let end = ring.snapshot();
            let mut rep = Report::judged(&mut judge, &start, end.clone(), &occupancy);
            // Its last state stays on the screen, saying so, until the user leaves.
            if presence.removed() {
                rep.mark_removed();
            }
            report = Some(rep);
            (start, start_at) = (end, now);
            occupancy.clear();
            redraw = true;
        }
        if redraw {
            terminal.draw(|f| match &report {
                Some(rep) => f.render_widget(
                    &View {
                        report: rep,
                        trends: &trends,
                        period: Some(period),
                    },
                    f.area(),
                ),
                None => f.render_widget(
                    Line::raw(format!("measuring {} ...  (q quits)", ring.name())),
                    f.area(),
                ),
            })?;
            redraw = false;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_keeps_words_whole_and_cuts_only_overlong_ones() {
        assert_eq!(wrap("ab cd ef", 5), vec!["ab cd", "ef"]);
        assert_eq!(wrap("abcdefg h", 3), vec!["abc", "def", "g h"]);
        assert_eq!(wrap("", 4), Vec::<String>::new());
    }

    #[test]
    fn share_bars_fill_in_eighths_and_keep_their_width() {
        assert_eq!(share_bar(1.0, 4), "████");
        assert_eq!(share_bar(0.0, 4), "    ");
        assert_eq!(share_bar(0.5 + 1.0 / 16.0, 2), "█▏");
        for f in [0.0, 0.13, 0.5, 0.99, 1.0, 7.0] {
            assert_eq!(share_bar(f, 6).chars().count(), 6);
        }
    }

    #[test]
    fn rates_read_at_a_glance() {
        assert_eq!(human_rate(185.2), "185");
        assert_eq!(human_rate(1_234.0), "1.2k");
        assert_eq!(human_rate(185_300.0), "185k");
        assert_eq!(human_rate(2_500_000.0), "2.50M");
    }
}
