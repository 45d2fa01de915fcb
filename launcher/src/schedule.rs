//! The length of the drafter's learning-rate schedule (`[drafter] total_steps`): the group step
//! at which its cosine decay reaches the floor.
//!
//! A config that sets it keeps it, at every launch. One that does not has the launcher work it
//! out at each launch, as the step the group starts from plus the steps the batches left take
//! with the drafters of this launch (each group step trains up to one batch per drafter): the
//! schedule ends with the run even when a resume scales the group out or in. It used to be
//! worked out once, at the first launch, and written into the run's `config.toml`, where a
//! resume read it back as if the user had set it: a run started on 2 drafters and resumed on 3
//! ended its last step at 1.3e-4 with the floor at 6e-5.
//!
//! So the value worked out is never written into `config.toml` (the launcher writes that file
//! before it settles the schedule), and a `total_steps` found there is the user's. That is the
//! simplest record that keeps old run directories resumable: their `config.toml` holds the value
//! an earlier build worked out, which cannot be told from a user's, and is kept, as that build
//! did (a note says so when the drafters change, and how to have it worked out instead). The
//! value of the last launch is kept in `<run-dir>/schedule.json`, only so that a resume can say
//! when it changes.
//!
//! The warm-up (`dflash.warmup_ratio` of the total, worked out by the drafter) follows the
//! total, as a share of the run's steps: a resume early in the run on fewer drafters can put
//! the group back in it for a few steps (README says so), which keeping the first launch's
//! warm-up would need another field sent to the drafters for. Nothing else is worked out from
//! the drafters and kept: `checkpoint_every`, `keep_export_every` and `eval_every` count group
//! steps the user set (or their defaults).

use anyhow::Context;
use proto::{PipelineConfig, RunDir};
use serde::{Deserialize, Serialize};

use crate::count;

/// `<run-dir>/schedule.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    total_steps: u64,
}

/// Where a resumed group starts: its checkpoint's step, and the planned batches whose updates
/// that checkpoint holds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resumed {
    pub(crate) step: u64,
    pub(crate) done: u64,
    /// The drafters of the run's last launch (`gpus.json`), when recorded.
    pub(crate) drafters_before: Option<u32>,
}

/// The schedule's total steps for a group that starts at `step` with `left` planned batches to
/// train on `drafters` drafters.
pub(crate) fn total_steps(step: u64, left: u64, drafters: u32) -> u64 {
    step + left.div_ceil(u64::from(drafters.max(1)))
}

/// Sets `cfg.drafter.total_steps` for this launch of a run of `batches` planned batches on
/// `drafters` drafters (`resumed`: where a resume starts), and records it in the run directory
/// when the config set none. Returns a line to say: a resume's schedule that changed, or a
/// total the config sets that no longer ends with the run because the drafters changed.
pub(crate) fn settle(
    cfg: &mut PipelineConfig,
    run_dir: &RunDir,
    resumed: Option<Resumed>,
    batches: u64,
    drafters: u32,
) -> anyhow::Result<Option<String>> {
    let (step, done) = resumed.map_or((0, 0), |r| (r.step, r.done));
    let left = batches.saturating_sub(done);
    let total = total_steps(step, left, drafters);
    let how = format!(
        "step {step} + {} left / {}",
        count(left, "batch", "batches"),
        count(drafters, "drafter", "drafters")
    );
    if let Some(set) = cfg.drafter.total_steps {
        let changed = resumed
            .and_then(|r| r.drafters_before)
            .is_some_and(|was| was != drafters);
        return Ok((changed && set != total).then(|| {
            format!(
                "note: the run's config.toml sets [drafter] total_steps = {set}, which the learning-rate schedule keeps, though the run now ends near step {total} ({how}); a build before this one wrote there the value it worked out: delete that line to have each launch work it out"
            )
        }));
    }
    cfg.drafter.total_steps = Some(total);
    let path = run_dir.schedule();
    // Only said, so a record that cannot be read (removed, damaged) is no reason to refuse a
    // resume: the line then says the schedule without what it was.
    let before = resumed
        .and_then(|_| std::fs::read(&path).ok())
        .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
        .map(|r| r.total_steps);
    let json = serde_json::to_string(&Record { total_steps: total })?;
    atomic_file::replace(&path, format!("{json}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(match (resumed, before) {
        (None, _) => None,
        (Some(_), Some(was)) if was == total => None,
        (Some(_), Some(was)) => Some(format!(
            "the drafter's learning-rate schedule now ends at step {total}, not {was}: {how}"
        )),
        (Some(_), None) => Some(format!(
            "the drafter's learning-rate schedule ends at step {total}: {how}"
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir() -> (tempfile::TempDir, RunDir) {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path());
        (tmp, run)
    }

    /// The run's config.toml as the launcher writes it at the first launch, read back by a
    /// resume.
    fn written(cfg: &PipelineConfig) -> PipelineConfig {
        PipelineConfig::from_toml(&cfg.to_toml(), std::path::Path::new("config.toml")).unwrap()
    }

    /// The reviewer's run: 872 batches on 2 drafters (436 steps), resumed at step 100 with 200
    /// batches trained, on 3 drafters. The schedule ends with the run (100 + 672 / 3), not at
    /// the first launch's 436, and the resume says so; a resume on as many drafters as before
    /// works out the same end and says nothing.
    #[test]
    fn a_resume_on_more_drafters_ends_the_schedule_with_the_run() {
        let (_tmp, run) = run_dir();
        let mut cfg = PipelineConfig::default();
        let config_toml = written(&cfg);
        assert_eq!(settle(&mut cfg, &run, None, 872, 2).unwrap(), None);
        assert_eq!(cfg.drafter.total_steps, Some(436));

        let mut resumed = config_toml.clone();
        let from = Resumed {
            step: 100,
            done: 200,
            drafters_before: Some(2),
        };
        let said = settle(&mut resumed, &run, Some(from), 872, 3).unwrap();
        assert_eq!(resumed.drafter.total_steps, Some(324));
        assert_eq!(
            said.as_deref(),
            Some("the drafter's learning-rate schedule now ends at step 324, not 436: step 100 + 672 batches left / 3 drafters")
        );

        // Stopped again at step 200 (300 more batches), resumed on the same 3 drafters.
        let mut again = config_toml;
        let from = Resumed {
            step: 200,
            done: 500,
            drafters_before: Some(3),
        };
        assert_eq!(settle(&mut again, &run, Some(from), 872, 3).unwrap(), None);
        assert_eq!(again.drafter.total_steps, Some(324));
    }

    /// A total_steps the config sets is the user's: kept at the first launch and at a resume
    /// on other drafters, which says it no longer ends with the run and how to change that.
    #[test]
    fn a_total_steps_the_config_sets_is_kept() {
        let (_tmp, run) = run_dir();
        let mut cfg = PipelineConfig::default();
        cfg.drafter.total_steps = Some(1000);
        assert_eq!(settle(&mut cfg, &run, None, 872, 2).unwrap(), None);
        assert_eq!(cfg.drafter.total_steps, Some(1000));

        let mut resumed = written(&cfg);
        let from = Resumed {
            step: 100,
            done: 200,
            drafters_before: Some(2),
        };
        let said = settle(&mut resumed, &run, Some(from), 872, 3).unwrap();
        assert_eq!(resumed.drafter.total_steps, Some(1000));
        let said = said.unwrap();
        assert!(
            said.contains("total_steps = 1000, which the learning-rate schedule keeps")
                && said.contains("near step 324"),
            "{said}"
        );
        // On the run's own drafters there is nothing to say.
        let from = Resumed {
            drafters_before: Some(3),
            ..from
        };
        assert_eq!(
            settle(&mut resumed, &run, Some(from), 872, 3).unwrap(),
            None
        );
    }
}
