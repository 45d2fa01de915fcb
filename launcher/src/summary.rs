//! `summary.json`: what the run did, from the drafters' ledgers (what was trained) and the
//! ring's telemetry (what moved, and where each worker's time went).
//!
//! `drafter` is the group's training where it ended: its last step, with the last loss, tau and
//! learning rate the leader reported (`StepStats`, through the monitor).
//!
//! The verdict (`ok`, and the degraded exit code) comes from the ledgers alone: every sample
//! trained exactly once in every epoch of the plan (each ledger line's batch is in the epoch its
//! plan index says), and no batch trained more than once. The ring's counters (`published`,
//! `redelivered`) are reported, never judged: a worker killed between a CAS and its counter
//! update skews them.
//!
//! Length: past 500 lines with its tests: each field of the summary, how it is built from the
//! ledgers and the ring, and the end's lines that print it, read together.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use proto::plan::Epochs;
use proto::RunDir;
use serde::Serialize;
use shm_ring::{Snapshot, WorkerName};

#[derive(Debug, Serialize)]
pub struct WorkerSummary {
    pub role: &'static str,
    pub index: u32,
    pub gpu: Option<u32>,
    pub restarts: u32,
    pub items: u64,
    pub tokens: u64,
    /// Fraction of the run's wall time spent in compute (the GPU doing model work).
    pub busy_frac: f64,
}

/// The drafter group's training at its last step, as the leader reported it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct DrafterSummary {
    /// The group's last applied step.
    pub step: u64,
    /// The mean loss per loss token of the last step that had loss tokens (the last steps may
    /// only see the end); null if none had.
    pub loss: Option<f64>,
    /// The acceptance length of the last step that reported one; null for a drafter that
    /// reports none (the mock drafts no blocks).
    pub tau: Option<f64>,
    /// The learning rate of the last step that reported one (a backend with a schedule).
    pub lr: Option<f64>,
    /// The leader's last speculative-decoding evaluation (mean tokens per target forward on
    /// held-out prompts), if it made one.
    pub eval_tau: Option<f64>,
    /// This launch's updates left out because the group's gradient was NaN or infinite (the
    /// weights left as they were; their batches count as trained).
    pub updates_skipped: u64,
}

impl DrafterSummary {
    /// Takes in one applied step: the step always, its loss, tau and lr where it has them.
    pub fn update(last: &mut Option<DrafterSummary>, s: &proto::control::StepStats) {
        let d = last.get_or_insert_with(DrafterSummary::default);
        d.step = s.step;
        let trained = s.tokens > 0 || s.tokens_unknown;
        if s.loss_weight() > 0 {
            d.loss = Some(f64::from(s.loss));
        }
        if let Some(tau) = s.tau.filter(|t| trained && t.is_finite()) {
            d.tau = Some(f64::from(tau));
        }
        if let Some(lr) = s.lr {
            d.lr = Some(f64::from(lr));
        }
        if let Some(e) = s.eval_tau {
            d.eval_tau = Some(f64::from(e));
        }
        d.updates_skipped += u64::from(s.skipped);
    }
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub ok: bool,
    pub exit_code: i32,
    /// Samples in the data: each epoch trains every one of them once.
    pub samples_total: u64,
    /// Distinct samples in the drafters' ledgers, of any epoch.
    pub samples_trained: u64,
    /// Passes over the data in the plan (`data.epochs`).
    pub epochs: u32,
    /// Distinct samples trained in each epoch, epoch 0 first: each is `samples_total` in a
    /// complete run.
    pub samples_trained_per_epoch: Vec<u64>,
    /// Batches whose training the ledgers record more than once by live drafters (published
    /// twice, or one delivery trained twice); `ok` is false unless 0.
    pub duplicated: u64,
    /// Samples trained more than once within one epoch (once per epoch it happened in); `ok`
    /// is false unless 0. Once in each of several epochs is not more than once.
    pub samples_not_once: u64,
    pub batches_total: u64,
    /// This launch's, from the ring's counter (a resume's ring starts at 0).
    pub batches_published: u64,
    /// Ledger lines, the whole run's: batches trained, a redelivered one counted each time it
    /// was trained.
    pub batches_trained: u64,
    /// This launch's, from the ring's counter: telemetry, not judged.
    pub redelivered: u64,
    /// Batches set aside untrained after killing the targets that computed them or the drafters
    /// that took them (`--set-aside-after`; each in `set-aside.jsonl` and the notes).
    pub batches_set_aside: u64,
    /// Batches trained in steps whose updates were lost when every drafter died, or skipped
    /// when the group diverged (`lost-steps.jsonl`): not in `batches_trained`, their samples
    /// untrained.
    pub batches_lost: u64,
    /// From the ledgers: the whole run's, a resumed run's earlier launches included.
    pub tokens_trained: u64,
    /// Ledger lines that could not be read (a drafter killed mid-line).
    pub torn_ledger_lines: u64,
    /// Ledger lines that could not be read and were not cut short by a kill (changed, or
    /// damaged on disk), as `file:line`: their batches are not counted, and a resume refuses
    /// them.
    pub damaged_ledger_lines: Vec<String>,
    /// This launch's wall time (a resumed run's earlier launches are not in it).
    pub wall_s: f64,
    /// The tokens the drafters trained in this launch (the ring's telemetry, which starts with
    /// the launch) per second of `wall_s`. Not `tokens_trained` over it: a resumed run's
    /// ledgers hold the earlier launches' tokens too.
    pub tokens_per_s: f64,
    pub backend: String,
    pub ring: String,
    pub notes: Vec<String>,
    pub workers: Vec<WorkerSummary>,
    /// The group's training where it ended; null when the group reported no step.
    pub drafter: Option<DrafterSummary>,
    /// The steps whose exports are kept, each in `drafter-steps/step-<S>/`
    /// (`[drafter] keep_export_every`), ascending: the whole run's, earlier launches' included.
    /// Empty when none is.
    pub kept_exports: Vec<u64>,
}

/// What the supervisor knows at the end of a run, for [`build`].
pub struct Facts<'a> {
    pub run_dir: &'a RunDir,
    /// The ring's name.
    pub ring: &'a str,
    /// The backend's description.
    pub backend: &'a str,
    /// The ring's telemetry at the end.
    pub snap: &'a Snapshot,
    pub samples_total: u64,
    /// The plan's epochs, which say each ledger line's epoch from its batch.
    pub epochs: &'a Epochs,
    pub wall: Duration,
    /// Restarts by worker name (`target-0`).
    pub restarts: &'a HashMap<WorkerName, u32>,
    /// The group's last step, as the monitor saw it.
    pub drafter: Option<DrafterSummary>,
}

/// The summary from the ledgers and the ring's telemetry; `ok`, the exit code and the notes
/// are set by [`finalise`].
pub fn build(f: &Facts) -> anyhow::Result<Summary> {
    let Facts {
        run_dir,
        ring,
        backend,
        snap,
        samples_total,
        epochs,
        wall,
        restarts,
        drafter,
    } = *f;
    let ledgers = proto::ledger::read_all(run_dir)?;
    let (lines, torn) = (&ledgers.lines, ledgers.torn);
    let acct = proto::ledger::account(lines, epochs);
    let batches = lines.len() as u64;
    let tokens: u64 = lines.iter().map(|l| l.tokens).sum();
    let wall_s = wall.as_secs_f64();
    // This launch's: the ring was created by it.
    let launch_tokens: u64 = (snap.workers.iter())
        .filter(|w| w.role == shm_ring::Role::Consumer)
        .map(|w| w.tokens)
        .sum();
    let workers = snap
        .workers
        .iter()
        .map(|w| WorkerSummary {
            role: w.role.name(),
            index: w.index,
            gpu: w.gpu,
            restarts: restarts.get(&w.name()).copied().unwrap_or(0),
            items: w.items,
            tokens: w.tokens,
            busy_frac: if wall_s > 0.0 {
                (w.busy_ns() as f64 / 1e9 / wall_s).min(1.0)
            } else {
                0.0
            },
        })
        .collect();
    Ok(Summary {
        ok: false,
        exit_code: 0,
        samples_total,
        samples_trained: acct.samples_trained,
        epochs: epochs.count(),
        samples_trained_per_epoch: acct.samples_trained_per_epoch,
        duplicated: acct.duplicated,
        samples_not_once: acct.samples_not_once,
        batches_total: snap.work.total,
        batches_published: snap.counters.published,
        batches_trained: batches,
        redelivered: snap.counters.redelivered,
        batches_set_aside: snap.counters.set_aside,
        batches_lost: ledgers.lost.len() as u64,
        tokens_trained: tokens,
        torn_ledger_lines: torn,
        damaged_ledger_lines: ledgers.damaged,
        wall_s,
        tokens_per_s: if wall_s > 0.0 {
            launch_tokens as f64 / wall_s
        } else {
            0.0
        },
        backend: backend.to_string(),
        ring: ring.to_string(),
        notes: Vec::new(),
        workers,
        drafter,
        kept_exports: run_dir.kept_export_steps(),
    })
}

impl Summary {
    /// Every sample trained exactly once in every epoch, by the ledgers.
    pub fn exactly_once(&self) -> bool {
        self.duplicated == 0
            && self.samples_not_once == 0
            && (self.samples_trained_per_epoch.iter()).all(|&n| n >= self.samples_total)
    }

    /// A note for each epoch that left samples untrained.
    pub fn untrained(&self) -> Vec<String> {
        let total = self.samples_total;
        (self.samples_trained_per_epoch.iter().enumerate())
            .filter(|&(_, &n)| n < total)
            .map(|(e, &n)| match self.epochs {
                1 => format!("{} of {total} samples were not trained", total - n),
                // Counted from 1, as the monitor's `(epoch 2/3)` and metrics.jsonl's `epoch`.
                _ => format!(
                    "epoch {}: {} of {total} samples were not trained",
                    e + 1,
                    total - n
                ),
            })
            .collect()
    }
}

/// Sets the verdict: `ok` for exit code 0 with no sample trained twice in an epoch (the exit code
/// is degraded when a sample of some epoch went untrained).
pub fn finalise(mut s: Summary, exit_code: i32, mut notes: Vec<String>) -> Summary {
    if s.duplicated > 0 {
        notes.push(format!(
            "{} batch(es) were trained more than once (see the ledgers)",
            s.duplicated
        ));
    } else if s.samples_not_once > 0 {
        // No batch twice, yet a sample in two batches of one epoch: the ledgers name batches
        // of another plan.
        notes.push(format!(
            "{} sample(s) were trained more than once within an epoch (see the ledgers)",
            s.samples_not_once
        ));
    }
    if s.batches_lost > 0 {
        notes.push(format!(
            "{} batch(es) were trained in steps whose updates were lost (every drafter died, or \
             the drafters diverged: see lost-steps.jsonl): their samples count as untrained, and \
             `launcher --resume` trains them",
            s.batches_lost
        ));
    }
    if s.torn_ledger_lines > 0 {
        notes.push(format!(
            "{} torn ledger line(s) ignored: a drafter was killed while writing",
            s.torn_ledger_lines
        ));
    }
    let damaged = &s.damaged_ledger_lines;
    if !damaged.is_empty() {
        notes.push(format!(
            "{} ledger line(s) neither whole nor cut short by a kill ({}{}): changed, or \
             damaged on disk; their batches are not counted, and `launcher --resume` refuses \
             them until they are restored",
            damaged.len(),
            damaged[..damaged.len().min(3)].join(", "),
            if damaged.len() > 3 { ", ..." } else { "" }
        ));
    }
    s.exit_code = exit_code;
    s.ok = exit_code == 0 && s.duplicated == 0 && s.samples_not_once == 0;
    s.notes = notes;
    s
}

/// Writes summary.json atomically.
pub fn write(run_dir: &RunDir, s: &Summary) -> anyhow::Result<()> {
    let path = run_dir.summary();
    atomic_file::replace(&path, (serde_json::to_string_pretty(s)? + "\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// The run's end lines: the totals, the group's last step, where the kept exports are, the
/// workers, the notes and how to train what is left (if `resumable`: not for a run directory
/// gone); the exit code's line is [`print_exit_code`], once the code is final.
pub fn print(s: &Summary, run_dir: &RunDir, resumable: bool) {
    println!();
    let trained = match s.epochs {
        1 => format!("{}/{} samples trained", s.samples_trained, s.samples_total),
        n => format!(
            "{n} epochs of {} samples, {:?} trained per epoch",
            s.samples_total, s.samples_trained_per_epoch
        ),
    };
    println!(
        "{} in {:.1}s: {trained}, {} batches ({} redelivered, {} duplicated), {:.0} tokens/s",
        if s.ok { "done" } else { "ended" },
        s.wall_s,
        s.batches_trained,
        s.redelivered,
        s.duplicated,
        s.tokens_per_s
    );
    if let Some(d) = &s.drafter {
        let mut line = format!("drafter group: step {}", d.step);
        if let Some(loss) = d.loss {
            line += &format!(" loss {loss:.4}");
        }
        if let Some(tau) = d.tau {
            line += &format!(" tau {tau:.2}");
        }
        if let Some(e) = d.eval_tau {
            line += &format!(" (eval: {e:.2} tokens per target forward)");
        }
        if d.updates_skipped > 0 {
            line += &format!(
                "; {} update(s) skipped: the gradient was NaN or infinite (the weights left as they were; see the drafters' logs)",
                d.updates_skipped
            );
        }
        println!("{line}");
    }
    if let Some(line) = kept_line(&s.kept_exports, run_dir) {
        println!("{line}");
    }
    println!(
        "{:<8} {:>3} {:>4} {:>8} {:>7} {:>10} {:>6}",
        "role", "idx", "gpu", "restarts", "items", "tokens", "busy"
    );
    for w in &s.workers {
        println!(
            "{:<8} {:>3} {:>4} {:>8} {:>7} {:>10} {:>5.0}%",
            w.role,
            w.index,
            w.gpu.map(|g| g.to_string()).unwrap_or("-".into()),
            w.restarts,
            w.items,
            w.tokens,
            w.busy_frac * 100.0
        );
    }
    for n in &s.notes {
        println!("note: {n}");
    }
    if let Some(line) = resume_line(s, run_dir).filter(|_| resumable) {
        println!("{line}");
    }
}

/// The end's last line: the code the launcher exits with (the run's, or 1 where its
/// summary.json could not be written: `Supervisor::finish`).
pub fn print_exit_code(code: i32) {
    println!("exit code {code}");
}

/// How to train what is left, for a run that ended with samples untrained (stopped by a
/// signal, workers given up, batches lost or set aside): the end lines showed the count, and a
/// second launch of the same command is refused (the directory holds a run) without it.
fn resume_line(s: &Summary, run_dir: &RunDir) -> Option<String> {
    let left = (s.samples_trained_per_epoch.iter()).any(|&n| n < s.samples_total);
    left.then(|| {
        format!(
            "to train the rest: {}",
            crate::resume::command(run_dir.path())
        )
    })
}

/// Where the kept exports are, in one line however many there are: `kept exports: 3 in
/// DIR/drafter-steps (step-4, step-8, step-12)`, the middle of a long list elided (summary.json
/// lists every step).
fn kept_line(steps: &[u64], run_dir: &RunDir) -> Option<String> {
    let name = |s: &u64| format!("step-{s}");
    let listed: Vec<String> = match steps.len() {
        0 => return None,
        1..=5 => steps.iter().map(name).collect(),
        n => (steps[..2].iter().map(name))
            .chain(["...".to_string()])
            .chain(steps[n - 2..].iter().map(name))
            .collect(),
    };
    Some(format!(
        "kept exports: {} in {} ({})",
        steps.len(),
        run_dir.kept_exports_dir().display(),
        listed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::control::StepStats;
    use proto::LedgerLine;
    use shm_ring::{Ring, RingParams, TakePolicy};

    /// The end's line about kept exports: none without any; the folder, the count and the
    /// steps, a long list cut in the middle, with one.
    #[test]
    fn the_kept_exports_line_names_the_folder_and_the_steps() {
        let run = RunDir::new("runs/x");
        assert_eq!(kept_line(&[], &run), None);
        assert_eq!(
            kept_line(&[4, 8], &run).unwrap(),
            "kept exports: 2 in runs/x/drafter-steps (step-4, step-8)"
        );
        let many: Vec<u64> = (1..=9).map(|s| s * 100).collect();
        assert_eq!(
            kept_line(&many, &run).unwrap(),
            "kept exports: 9 in runs/x/drafter-steps (step-100, step-200, ..., step-800, step-900)"
        );
    }

    /// A summary over a ring of two batches, from ledger lines `(drafter, batch, ticket)`
    /// (each batch two samples, of four), with the group as the monitor saw it.
    fn built(tag: &str, lines: &[(u32, u64, u64)], drafter: Option<DrafterSummary>) -> Summary {
        let dir = std::env::temp_dir().join(format!("hspipe-summary-{tag}-{}", std::process::id()));
        let dir = RunDir::new(dir);
        std::fs::create_dir_all(dir.ledger_dir()).unwrap();
        for &(d, batch_id, ticket) in lines {
            let l = LedgerLine {
                batch_id,
                sample_ids: vec![batch_id * 10, batch_id * 10 + 1],
                tokens: 2,
                delivery: 0,
                ticket,
                step: 1,
                digest: String::new(),
                epoch: 1,
            };
            let path = dir.ledger(d);
            let mut text = std::fs::read_to_string(&path).unwrap_or_default();
            text += &(serde_json::to_string(&l).unwrap() + "\n");
            std::fs::write(path, text).unwrap();
        }
        let ring = Ring::create(
            &format!("hspipe-u-{}-summary-{tag}", std::process::id()),
            &RingParams {
                slots: 2,
                slot_size: 64,
                buckets: 1,
                producers: 1,
                consumers: 2,
                held_per_consumer: 1,
                policy: TakePolicy::Fifo,
                seed: 1,
                work_items: 2,
            },
        )
        .unwrap();
        let s = build(&Facts {
            run_dir: &dir,
            ring: ring.name(),
            backend: "mock",
            snap: &ring.snapshot(),
            samples_total: 4,
            epochs: &Epochs::one(),
            wall: Duration::from_secs(1),
            restarts: &HashMap::new(),
            drafter,
        });
        std::fs::remove_dir_all(dir.path()).unwrap();
        finalise(s.unwrap(), 0, Vec::new())
    }

    /// Issue #9, item 8: a batch trained twice by live drafters (published twice: two tickets)
    /// makes `duplicated` 1 and `ok` false, although every sample appears and the distinct
    /// sample count looks perfect. Before, samples were counted in a set and the run was ok.
    #[test]
    fn a_batch_trained_twice_is_counted_in_duplicated_and_the_run_is_not_ok() {
        let s = built("dup", &[(0, 0, 0), (0, 1, 1), (1, 1, 2)], None);
        assert_eq!((s.samples_trained, s.samples_total), (4, 4));
        assert_eq!(s.duplicated, 1);
        assert!(!s.ok);
        assert!(
            s.notes[0].contains("trained more than once"),
            "{:?}",
            s.notes
        );
    }

    /// A damaged ledger line (neither whole nor the start of one) is named in the notes with
    /// what a resume will do, apart from lines a kill tore: the summary called it a kill, and
    /// the next `--resume` refused it as damaged.
    #[test]
    fn a_damaged_ledger_line_is_named_apart_from_torn_ones() {
        let mut s = built("damaged", &[(0, 0, 0), (1, 1, 1)], None);
        s.damaged_ledger_lines = vec!["run/ledger/drafter-0.jsonl:7".into()];
        let s = finalise(s, 0, Vec::new());
        let note = (s.notes.iter()).find(|n| n.contains("drafter-0.jsonl:7"));
        assert!(
            note.is_some_and(|n| n.contains("--resume` refuses") && !n.contains("killed")),
            "{:?}",
            s.notes
        );
    }

    /// A run that ended with samples untrained says how to train them (a second launch of the
    /// same command is refused: the directory holds a run), and the epoch a note names is
    /// counted from 1, as the monitor counts it; a run that trained every sample says neither.
    #[test]
    fn a_run_with_samples_left_says_how_to_resume_and_counts_epochs_from_one() {
        let run = RunDir::new("runs/my run");
        let done = built("resumeline", &[(0, 0, 0), (1, 1, 1)], None);
        assert_eq!(
            (resume_line(&done, &run), done.untrained().len()),
            (None, 0)
        );
        let mut s = built("resumeline2", &[(0, 0, 0)], None);
        assert_eq!(
            resume_line(&s, &run).as_deref(),
            Some("to train the rest: launcher --resume 'runs/my run'")
        );
        s.epochs = 2;
        s.samples_trained_per_epoch = vec![4, 1];
        assert_eq!(s.untrained(), ["epoch 2: 3 of 4 samples were not trained"]);
    }

    /// `drafter` in summary.json: the group's last step, the loss of the last step that had
    /// loss tokens (the end's steps have none), tau and lr null while no step reports them (the
    /// mock), the last reported once one does, and the updates skipped for a gradient that was
    /// not finite counted; null when the group reported no step.
    #[test]
    fn the_summary_has_the_groups_last_step_loss_and_tau() {
        let step = |step, tokens, loss, tau, lr| StepStats {
            step,
            tokens,
            loss,
            tau,
            lr,
            eval_tau: (step == 4).then_some(2.5),
            skipped: step == 3,
            tokens_unknown: false,
        };
        let mut group = None;
        DrafterSummary::update(&mut group, &step(1, 10, 0.75, None, None));
        DrafterSummary::update(&mut group, &step(2, 12, 0.5, None, None));
        DrafterSummary::update(&mut group, &step(3, 0, f32::NAN, None, None));
        let s = serde_json::to_value(built("group", &[(0, 0, 0), (1, 1, 1)], group)).unwrap();
        assert_eq!(
            s["drafter"],
            serde_json::json!({"step": 3, "loss": 0.5, "tau": null, "lr": null, "eval_tau": null, "updates_skipped": 1})
        );
        DrafterSummary::update(&mut group, &step(4, 8, 0.25, Some(3.5), Some(1e-3)));
        DrafterSummary::update(&mut group, &step(5, 0, 0.0, None, None));
        let d = group.unwrap();
        assert_eq!((d.step, d.loss, d.tau), (5, Some(0.25), Some(3.5)));
        assert_eq!(d.lr, Some(f64::from(1e-3_f32)));
        assert_eq!(d.eval_tau, Some(2.5), "the last evaluation stays");
        assert_eq!(d.updates_skipped, 1, "step 3's skipped update counted once");
        let none = serde_json::to_value(built("nogroup", &[(0, 0, 0), (1, 1, 1)], None)).unwrap();
        assert!(none["drafter"].is_null(), "{none}");
    }

    /// A Python leader's `progress(step, loss)` without `tokens=`: its loss is the group's last
    /// (it was left out as if the step had trained nothing), and weighs one in a mean.
    #[test]
    fn a_loss_reported_without_its_tokens_is_still_the_last_loss() {
        let unsaid = |step, loss| StepStats {
            step,
            loss,
            tokens_unknown: true,
            ..StepStats::default()
        };
        let mut group = None;
        DrafterSummary::update(&mut group, &unsaid(1, 0.75));
        assert_eq!(group.unwrap().loss, Some(0.75));
        DrafterSummary::update(&mut group, &unsaid(2, f32::NAN));
        assert_eq!(
            group.unwrap().loss,
            Some(0.75),
            "a NaN loss is not the last one"
        );
        let weights: Vec<u64> = [unsaid(3, 0.5), unsaid(4, f32::INFINITY)]
            .iter()
            .map(StepStats::loss_weight)
            .collect();
        assert_eq!(weights, [1, 0]);
    }
}
