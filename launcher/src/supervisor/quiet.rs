//! How many of one worker's deaths after work the console is shown. A worker that dies after
//! some work each time is restarted for as long as the run goes on (its restarts in a row start
//! again), and a review saw one print 1,254 death and restart lines in 14 minutes, the console
//! nothing else. So a worker's first [`SAID_PER_MINUTE`] such deaths of a minute are said; the
//! rest of that minute's, and their restarts, go to `launcher.log` and `metrics.jsonl` only, and
//! one line says how many once the minute is over (or at the run's end). (A crash loop in a row
//! ends at `--max-restarts`: each of its deaths is said.) A minute with deaths held back is
//! followed by minutes that say only their first death (with its reason) and that line, until a
//! whole minute passes without a death: a loop costs the console three lines a minute, and a
//! worker that dies less than once a minute has each death said.

use std::time::{Duration, Instant};

/// Deaths of one worker said on the console in a minute before the rest are held back.
pub(super) const SAID_PER_MINUTE: u32 = 5;
/// The same in a minute after one that held deaths back.
const SAID_IN_A_LOOP: u32 = 1;
const MINUTE: Duration = Duration::from_secs(60);

/// One worker's deaths in the current minute (see the module doc).
#[derive(Debug, Default)]
pub(super) struct DeathLines {
    /// When the current minute began (a death); None between minutes.
    since: Option<Instant>,
    /// When the last minute ended.
    ended: Option<Instant>,
    /// Deaths the current minute may say.
    budget: u32,
    said: u32,
    held: u32,
}

impl DeathLines {
    /// A death at `now`: the line for the deaths held back in a minute now over, if any, and
    /// whether to say this one on the console (false: in the log only).
    pub(super) fn death(&mut self, name: &str, now: Instant) -> (Option<String>, bool) {
        let over = self.roll(name, now, false);
        if self.since.is_none() {
            // A new minute: a whole minute without a death (or the first death) says again.
            if self.ended.is_none_or(|e| now.duration_since(e) >= MINUTE) {
                self.budget = SAID_PER_MINUTE;
            }
            self.since = Some(now);
        }
        if self.said < self.budget {
            self.said += 1;
            (over, true)
        } else {
            self.held += 1;
            (over, false)
        }
    }

    /// The line for the deaths held back in a minute now over (`end`: or at the run's end).
    pub(super) fn held_back(&mut self, name: &str, now: Instant, end: bool) -> Option<String> {
        self.roll(name, now, end)
    }

    /// Ends the current minute if it is over (or `end`), returning its line if it held deaths
    /// back; the next minute says [`SAID_IN_A_LOOP`] if this one held any back, else up to
    /// [`SAID_PER_MINUTE`].
    fn roll(&mut self, name: &str, now: Instant, end: bool) -> Option<String> {
        let since = self.since?;
        let took = now.duration_since(since);
        if took < MINUTE && !end {
            return None;
        }
        let held = std::mem::take(&mut self.held);
        self.budget = if held > 0 {
            SAID_IN_A_LOOP
        } else {
            SAID_PER_MINUTE
        };
        (self.said, self.since, self.ended) = (0, None, Some(now));
        (held > 0).then(|| {
            format!(
                "{name} died {held} more time(s) after work in the last {} s, each restarted: said in launcher.log only, to keep this readable",
                took.as_secs().max(1)
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deaths at `secs` after `t0`; for each, whether it was said and the line said before it.
    fn deaths(d: &mut DeathLines, t0: Instant, secs: &[u64]) -> Vec<(bool, Option<String>)> {
        (secs.iter())
            .map(|&s| {
                let (over, said) = d.death("target-1", t0 + Duration::from_secs(s));
                (said, over)
            })
            .collect()
    }

    /// A loop of deaths: the first minute says five, then each minute its first and a line for
    /// the rest; a minute without a death says the next ones again, and the run's end says
    /// what is held.
    #[test]
    fn a_crash_loop_says_five_deaths_then_a_line_a_minute_until_it_calms_down() {
        let t0 = Instant::now();
        let mut d = DeathLines::default();
        let first = deaths(&mut d, t0, &[0, 1, 2, 3, 4, 5, 6, 7]);
        let said: Vec<bool> = first.iter().map(|(s, _)| *s).collect();
        assert_eq!(said, [true, true, true, true, true, false, false, false]);
        assert!(first.iter().all(|(_, over)| over.is_none()));
        assert_eq!(
            d.held_back("target-1", t0 + Duration::from_secs(30), false),
            None
        );
        let line = d.held_back("target-1", t0 + Duration::from_secs(60), false);
        let line = line.expect("the minute's line");
        assert!(
            line.starts_with("target-1 died 3 more time(s) after work in the last 60 s"),
            "{line}"
        );
        // The loop goes on: the next minute says its first death only, then its line.
        let next = deaths(&mut d, t0, &[61, 62, 63, 64, 65, 66]);
        let said: Vec<bool> = next.iter().map(|(s, _)| *s).collect();
        assert_eq!(said, [true, false, false, false, false, false]);
        let (over, said) = d.death("target-1", t0 + Duration::from_secs(125));
        assert!(said, "the first of the next minute");
        assert!(over.unwrap().contains("died 5 more time(s)"));
        let (_, said) = d.death("target-1", t0 + Duration::from_secs(126));
        assert!(!said);
        // The run ends: what is held is said.
        let end = d.held_back("target-1", t0 + Duration::from_secs(130), true);
        assert!(end
            .unwrap()
            .contains("died 1 more time(s) after work in the last 5 s"));
        // A whole minute without a death: the next ones are said again.
        let calm = deaths(&mut d, t0, &[200, 201]);
        assert!(calm.iter().all(|(said, over)| *said && over.is_none()));
        assert_eq!(
            d.held_back("target-1", t0 + Duration::from_secs(300), true),
            None
        );
    }
}
