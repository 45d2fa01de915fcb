//! A synthetic `metrics.jsonl`, line for line in the shape a launcher writes (copied from a
//! real run of the mock pipeline), for measuring and testing `launcher report` on runs far
//! longer than a test can wait for: a week at one tick a second is 604,800 lines.
//!
//! The figures are plausible, not a simulation: shares that add up to about one, a ring that
//! swings, a loss that falls, two group steps a tick. What a test checks is planted at known
//! ticks (a spike, a death and a restart, a second launch).

use std::io::Write;

/// What to write.
#[derive(Clone, Debug)]
pub struct Run {
    pub targets: u32,
    pub drafters: u32,
    /// Ticks of each launch: a second entry is a `--resume` appending to the file, its clock
    /// starting at 0 again and its `launch_unix_ms` another.
    pub launches: Vec<u64>,
    /// Seconds between ticks (the `--monitor` period).
    pub period_s: f64,
    /// Group steps applied per tick, each listed in the tick's `steps`.
    pub steps_per_tick: u64,
    /// At this tick (counted over the whole file) the run stalls for one tick: tokens/s 0 and
    /// drafter-0's longest idle gap [`Run::SPIKE_GAP_S`], where every other tick's is under 1 s.
    pub spike_at: Option<u64>,
    /// At this tick drafter-0 dies, and at the next it is restarted (the launcher's words).
    pub death_at: Option<u64>,
}

impl Run {
    /// The planted gap, seconds.
    pub const SPIKE_GAP_S: f64 = 600.0;

    /// A week at one tick a second: 5 targets and 3 drafters, stopped after 3 days and resumed.
    pub fn week() -> Run {
        Run {
            targets: 5,
            drafters: 3,
            launches: vec![3 * 86_400, 4 * 86_400],
            period_s: 1.0,
            steps_per_tick: 2,
            spike_at: Some(5 * 86_400 + 1234),
            death_at: Some(86_400 + 77),
        }
    }

    /// Writes the file to `out`; returns the number of lines.
    pub fn write(&self, out: &mut impl Write) -> std::io::Result<u64> {
        let mut rng = Rng(0x5eed_1234_abcd_ef01);
        let mut line = String::with_capacity(8192);
        let (mut n, mut step, mut trained) = (0u64, 0u64, 0u64);
        let total: u64 = self.launches.iter().sum();
        let batches_total = total * self.steps_per_tick * u64::from(self.drafters) + 1000;
        let mut restarts = 0u32;
        for (launch, &ticks) in self.launches.iter().enumerate() {
            let launch_ms = 1_796_000_000_000 + launch as u64 * 400_000_000;
            for i in 1..=ticks {
                line.clear();
                // The monitor writes its clock and rates unrounded (`{}` of an f64).
                let t_s = i as f64 * self.period_s + 0.000_1 + 0.01 * rng.unit();
                let spike = self.spike_at == Some(n);
                let frac = n as f64 / total.max(1) as f64;
                let rate = if spike {
                    0.0
                } else {
                    31_000.0 + 4_000.0 * rng.unit()
                };
                trained += self.steps_per_tick * u64::from(self.drafters);
                let slots = 60u32;
                let ready = (40.0 + 20.0 * rng.unit()) as u32;
                let loss = 2.5 * (-3.0 * frac).exp() + 0.4 + 0.05 * rng.unit();
                let tau = 1.5 + 2.0 * frac + 0.1 * rng.unit();
                let lr = 3e-4 * (1.0 - frac).max(0.0);
                let mut events = Vec::new();
                if self.death_at == Some(n) {
                    events.push(format!(
                        "drafter-0 (pid {}) died: signal: 9 (SIGKILL)",
                        1000 + n % 1000
                    ));
                }
                if self.death_at.is_some_and(|d| d + 1 == n) {
                    restarts += 1;
                    events.push(format!(
                        "drafter-0 restarted (restart {restarts}; 1 in a row of at most 3), pid {}",
                        2000 + n % 1000
                    ));
                }
                line.push_str(&format!(
                    "{{\"t_s\":{t_s},\"launch_unix_ms\":{launch_ms},\"tokens_per_s\":{rate},\"batches_trained\":{trained},\"batches_total\":{batches_total},\"ring_ready\":{ready},\"ring_in_use\":{},\"ring_slots\":{slots},\"ready_per_bucket\":[{},{},{},{},{},{}],",
                    (ready + 6).min(slots),
                    ready / 6, ready / 6, ready / 6, ready / 6, ready / 6, ready - 5 * (ready / 6)
                ));
                let tw = 0.45 + 0.1 * rng.unit();
                line.push_str(&format!(
                    "\"targets_busy\":{},\"drafters_busy\":{},\"targets_waiting\":{tw},\"drafters_waiting\":0.0,\"restarts\":{restarts},\"closed\":false,\"verdict\":\"drafters are the bottleneck: ring full 96% of the time, targets waited {:.0}% (drafters waited 0%); drafters wait 16% in sync\",\"bottleneck\":\"drafters\",\"workers\":[",
                    1.0 - tw - 0.02,
                    0.79 + 0.01 * rng.unit(),
                    tw * 100.0
                ));
                for w in 0..self.targets + self.drafters {
                    let drafter = w >= self.targets;
                    let (role, index) = if drafter {
                        ("drafter", w - self.targets)
                    } else {
                        ("target", w)
                    };
                    let compute = 0.5 + 0.3 * rng.unit();
                    let gap = if spike && drafter && index == 0 {
                        Run::SPIKE_GAP_S
                    } else {
                        0.05 + 0.5 * rng.unit()
                    };
                    let phases = if drafter {
                        let sync = 0.8 * (1.0 - compute);
                        format!(
                            "\"compute\":{compute:.3},\"copy_in\":0.004,\"sync\":{sync:.3},\"other\":{:.3}",
                            1.0 - compute - sync - 0.004
                        )
                    } else {
                        format!(
                            "\"compute\":{compute:.3},\"wait_full\":{:.3},\"load\":0.012,\"other\":0.008",
                            1.0 - compute - 0.02
                        )
                    };
                    line.push_str(&format!(
                        "{}{{\"name\":\"{role}-{index}\",\"gpu\":{w},\"state\":\"alive\",\"alive\":true,\"restarts\":{},\"items\":{},\"tokens_per_s\":{:.1},\"busy\":{compute:.3},\"waiting\":{:.3},\"phases\":{{{phases}}},\"largest_gap_s\":{gap:.3}}}",
                        if w == 0 { "" } else { "," },
                        if drafter && index == 0 { restarts } else { 0 },
                        trained / u64::from(self.targets + self.drafters),
                        (rate / f64::from(self.drafters)).round(),
                        if drafter { 0.0 } else { 1.0 - compute - 0.02 },
                    ));
                }
                line.push(']');
                if !events.is_empty() {
                    line.push_str(",\"events\":[");
                    for (k, e) in events.iter().enumerate() {
                        let sep = if k == 0 { "" } else { "," };
                        line.push_str(&format!("{sep}{{\"t_s\":{t_s},\"text\":\"{e}\"}}"));
                    }
                    line.push(']');
                }
                line.push_str(&format!(
                    ",\"drafter_loss\":{loss},\"group_step\":{},\"acceptance_length\":{tau},\"lr\":{},\"steps\":[",
                    step + self.steps_per_tick,
                    lr as f32
                ));
                for k in 0..self.steps_per_tick {
                    step += 1;
                    let sep = if k == 0 { "" } else { "," };
                    line.push_str(&format!(
                        "{sep}{{\"step\":{step},\"tokens\":{},\"loss\":{},\"tau\":{},\"lr\":{},\"eval_tau\":null,\"skipped\":false}}",
                        49_152 + (rng.next() % 4096),
                        (loss + 0.01 * rng.unit()) as f32,
                        (tau + 0.1 * rng.unit()) as f32,
                        lr as f32
                    ));
                }
                line.push_str("]}\n");
                out.write_all(line.as_bytes())?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// xorshift64: the same file every time.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Writes drafter `drafter`'s ledger of a run of `drafters` that trained `batches` batches in
/// all (every `drafters`-th is its own), 32 samples a batch, in the shape a drafter writes;
/// returns the lines written.
pub fn ledger(
    out: &mut impl Write,
    drafter: u32,
    drafters: u32,
    batches: u64,
) -> std::io::Result<u64> {
    let mut line = String::with_capacity(1024);
    let mut n = 0;
    for batch in (u64::from(drafter)..batches).step_by(drafters.max(1) as usize) {
        line.clear();
        line.push_str(&format!("{{\"batch_id\":{batch},\"sample_ids\":["));
        for s in 0..32 {
            let sep = if s == 0 { "" } else { "," };
            line.push_str(&format!("{sep}{}", batch * 32 + s));
        }
        line.push_str(&format!(
            "],\"tokens\":{},\"delivery\":0,\"ticket\":{batch},\"step\":{},\"digest\":\"{:016x}\",\"epoch\":1}}\n",
            16_384 + batch % 4096,
            batch / u64::from(drafters.max(1)) + 1,
            batch.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ));
        out.write_all(line.as_bytes())?;
        n += 1;
    }
    Ok(n)
}
