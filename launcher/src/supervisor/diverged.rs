//! A drafter group that skips every update has diverged (`--stop-after-skipped`).
//!
//! An update is skipped when the group's summed gradient is NaN or infinite: the weights stay
//! as they were. One such update now and then is a loss spike, and training goes on, as it
//! does past a skipped step of torch's GradScaler. A group that skips every one, though, trains
//! nothing more: its weights are finite but a forward on them (or its inputs) gives NaN each
//! time, and every later batch is spent for nothing. So a row of skipped updates stops the run
//! at the limit, and a run whose data ran out inside a long row ends degraded all the same.
//! Either way the row's steps are recorded as lost (`lost-steps.jsonl`): their batches count as
//! untrained, and `--resume` (at a lower learning rate) trains them again.
//!
//! The row is counted by the steps the leader reports, each once: a report of a step already
//! seen (a rank that is not the leader, a leader that changed) is not another step, and any
//! applied step ends the row, whether or not it says how many tokens it trained (a Python
//! leader's `progress(step, loss)` does not).

use proto::control::StepStats;

/// A row shorter than this still running when the data ends is taken for a spike, not a
/// divergence (unless the limit is lower): a run whose data ends within one skip of its end
/// has trained.
const AT_THE_END: u64 = 10;

/// The row of skipped updates the group is in.
#[derive(Debug, Default)]
pub(super) struct Diverged {
    /// The latest step reported.
    seen: Option<u64>,
    /// Steps skipped in a row.
    in_a_row: u64,
    /// The first and the latest step of the row.
    first: u64,
    last: u64,
    /// The row was said: the run is stopping for it.
    said: bool,
    /// A step was applied after the said row: the row ended there, and a skip the drain
    /// reports after it is a spike of its own, not the row's.
    closed: bool,
}

impl Diverged {
    /// Takes in the leader's step `s`; the note that stops the run when the row reaches
    /// `limit` (0: never).
    pub(super) fn step(&mut self, s: &StepStats, limit: u32) -> Option<String> {
        if self.seen.is_some_and(|seen| s.step <= seen) {
            return None;
        }
        self.seen = Some(s.step);
        if !s.skipped {
            // Applied: the row is over (a row already said stays the run's, up to its last
            // skip: the checkpoint the drain writes holds this step's update).
            if self.said {
                self.closed = true;
            } else {
                self.in_a_row = 0;
            }
            return None;
        }
        if self.closed {
            return None;
        }
        if self.in_a_row == 0 {
            self.first = s.step;
        }
        self.in_a_row += 1;
        self.last = s.step;
        if limit == 0 || self.in_a_row < u64::from(limit) || self.said {
            return None;
        }
        self.said = true;
        Some(format!(
            "the drafter group's gradient was NaN or infinite at {} updates in a row (steps {} to {}, --stop-after-skipped {limit}): stopping the run. {}",
            self.in_a_row,
            self.first,
            self.last,
            self.why()
        ))
    }

    /// At the run's end: the note that makes it degraded when it ended inside a row of skipped
    /// updates at least [`AT_THE_END`] long (or `limit`, if lower) that was not said yet.
    pub(super) fn at_the_end(&self, limit: u32) -> Option<String> {
        if self.said || !self.long_at_the_end(limit) {
            return None;
        }
        Some(format!(
            "the drafter group's last {} updates were skipped, its gradient NaN or infinite (steps {} to {}): the data ended before --stop-after-skipped {limit} stopped the run. {}",
            self.in_a_row,
            self.first,
            self.last,
            self.why()
        ))
    }

    fn long_at_the_end(&self, limit: u32) -> bool {
        limit > 0 && self.in_a_row >= AT_THE_END.min(u64::from(limit))
    }

    /// The steps to record as lost at the run's end: the row that stopped the run (with the
    /// skips the drain reported after the stop, up to a step applied), or a long row the data
    /// ended in.
    pub(super) fn lost(&self, limit: u32) -> Option<proto::ledger::LostSteps> {
        (self.said || self.long_at_the_end(limit)).then_some(proto::ledger::LostSteps {
            first: self.first,
            last: self.last,
            rank: None,
            skipped: true,
        })
    }

    fn why(&self) -> String {
        format!(
            "The drafters keep the weights of step {} (each later update was skipped); the row's batches count as untrained (lost-steps.jsonl), so `launcher --resume` trains them again. The drafter diverged (a learning rate too high?) or its inputs are broken: see the drafters' logs",
            self.first.saturating_sub(1)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, tokens: u64, skipped: bool) -> StepStats {
        StepStats {
            step,
            tokens,
            loss: 0.5,
            tau: None,
            lr: None,
            eval_tau: None,
            skipped,
            tokens_unknown: false,
        }
    }

    /// The row counts skipped steps; an applied one ends it; the note comes once, at the
    /// limit, naming the row's steps and the last good weights, and the row, run on past the
    /// stop by the drain, is what is lost.
    #[test]
    fn a_row_of_skipped_updates_stops_the_run_once_at_the_limit() {
        let mut d = Diverged::default();
        let mut said = Vec::new();
        let steps = [
            (1, 10, false),
            (2, 10, true),
            (3, 10, true),
            (4, 10, false), // a spike: the row ends
            (5, 10, true),
            (6, 10, true),
            (7, 10, true),
            (8, 10, true), // drained after the stop: still the row's
            (9, 0, false), // a round with no batch at the end
        ];
        for (s, tokens, skipped) in steps {
            said.extend(d.step(&step(s, tokens, skipped), 3).map(|n| (s, n)));
        }
        assert_eq!(said.len(), 1, "{said:?}");
        let (at, note) = &said[0];
        assert_eq!(*at, 7, "the third skipped in a row");
        assert!(
            note.contains("at 3 updates in a row (steps 5 to 7, --stop-after-skipped 3)")
                && note.contains("the weights of step 4"),
            "{note}"
        );
        assert_eq!(d.at_the_end(3), None, "said once");
        let lost = d.lost(3).unwrap();
        assert_eq!((lost.first, lost.last, lost.skipped), (5, 8, true));
    }

    /// A step the drain applies after the said row ends it: a skip after that step does not
    /// stretch the lost range over it. Before, the range ran from the row's first step to the
    /// later skip, and a resume trained the applied step's batches again on top of their update
    /// in the drain's checkpoint.
    #[test]
    fn a_step_applied_after_the_stop_ends_the_lost_row() {
        let mut d = Diverged::default();
        let notes: Vec<_> = [(1, true), (2, true), (3, true), (4, false), (5, true)]
            .into_iter()
            .filter_map(|(s, skipped)| d.step(&step(s, 10, skipped), 3))
            .collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        let lost = d.lost(3).unwrap();
        assert_eq!((lost.first, lost.last), (1, 3));
    }

    /// Scattered skips never stop a run: a step applied ends the row even when it says no
    /// tokens (a Python leader's `progress(step, loss)`), and a step reported twice (by two
    /// ranks) counts once. Before, both made a row of skips that were not in a row.
    #[test]
    fn scattered_skips_and_repeated_reports_are_no_row() {
        let mut d = Diverged::default();
        for s in 1..=31 {
            // Every third step skipped, each reported by three ranks, none with tokens.
            for _ in 0..3 {
                let note = d.step(&step(s, 0, s % 3 == 0), 3);
                assert_eq!(note, None, "step {s}");
            }
        }
        assert_eq!((d.at_the_end(3), d.lost(3)), (None, None));
        // Three in a row, each reported twice: the third stops the run.
        let notes: Vec<_> = (32..=34)
            .flat_map(|s| [d.step(&step(s, 0, true), 3), d.step(&step(s, 0, true), 3)])
            .flatten()
            .collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("at 3 updates in a row (steps 32 to 34"),
            "{}",
            notes[0]
        );
    }

    /// A run whose data ends inside a long row (short of the limit) ends degraded, the row
    /// lost; one that ends on a short row, or with the rule off, does not.
    #[test]
    fn a_run_that_ends_inside_a_long_row_is_degraded() {
        let row = |n: u64| {
            let mut d = Diverged::default();
            d.step(&step(1, 10, false), 100);
            for s in 2..2 + n {
                assert_eq!(d.step(&step(s, 10, true), 100), None);
            }
            d
        };
        let note = row(10).at_the_end(100).expect("ten skipped at the end");
        assert!(note.contains("last 10 updates were skipped"), "{note}");
        assert!(note.contains("steps 2 to 11"), "{note}");
        let lost = row(10).lost(100).unwrap();
        assert_eq!((lost.first, lost.last), (2, 11));
        assert_eq!((row(9).at_the_end(100), row(9).lost(100)), (None, None));
        assert_eq!(row(10).at_the_end(0), None, "the rule off");
        assert!(row(2).at_the_end(2).is_some(), "a limit below ten counts");
    }
}
