//! The one name of a worker: its [`Role`] and its index within the role, written `target-3` or
//! `drafter-0` everywhere a person or a file sees it (log and ledger file names, the
//! `[faults.*]` keys of the config, the launcher's messages, the verdict).
//!
//! Producers are the hspipe *targets* and consumers its *drafters*; the ring's own API and its
//! serialised snapshots keep the producer/consumer words.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Producer (a target) or consumer (a drafter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Producer,
    Consumer,
}

impl Role {
    /// The role's name in hspipe: `target` or `drafter`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Producer => "target",
            Role::Consumer => "drafter",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Role {
    type Err = BadWorkerName;
    /// `target` or `drafter`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "target" => Ok(Role::Producer),
            "drafter" => Ok(Role::Consumer),
            _ => Err(BadWorkerName { text: s.into() }),
        }
    }
}

/// A worker's place in the ring: producers are numbered `0..producers`, consumers
/// `0..consumers`. A restarted worker comes back under the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerName {
    pub role: Role,
    pub index: u32,
}

impl WorkerName {
    pub fn producer(index: u32) -> Self {
        WorkerName {
            role: Role::Producer,
            index,
        }
    }
    pub fn consumer(index: u32) -> Self {
        WorkerName {
            role: Role::Consumer,
            index,
        }
    }
}

impl fmt::Display for WorkerName {
    /// `target-3`, `drafter-0`; honours width and alignment (`{name:<9}`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&format!("{}-{}", self.role.name(), self.index))
    }
}

/// Text that is not a worker name (`target-N` or `drafter-N`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a worker name (use target-N or drafter-N)")]
pub struct BadWorkerName {
    pub text: String,
}

impl FromStr for WorkerName {
    type Err = BadWorkerName;
    /// `target-3`, `drafter-0`: the role's name, a dash, a decimal index (no sign).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadWorkerName { text: s.into() };
        let (role, index) = s.split_once('-').ok_or_else(bad)?;
        if !index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(WorkerName {
            role: role.parse().map_err(|_| bad())?,
            index: index.parse().map_err(|_| bad())?,
        })
    }
}

/// Serde for a [`Role`] written by its hspipe name (`"target"`, `"drafter"`), as the monitor's
/// `metrics.jsonl` and the run summary do: `#[serde(with = "shm_ring::role_name")]`.
pub mod role_name {
    use super::Role;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(role: &Role, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(role.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            WorkerName::producer(0),
            WorkerName::producer(3),
            WorkerName::consumer(0),
            WorkerName::consumer(u32::MAX),
        ] {
            let text = name.to_string();
            assert_eq!(text.parse::<WorkerName>(), Ok(name), "{text}");
        }
        assert_eq!(WorkerName::producer(3).to_string(), "target-3");
        assert_eq!(WorkerName::consumer(12).to_string(), "drafter-12");
        assert_eq!(format!("{:<10}|", WorkerName::producer(3)), "target-3  |");
        assert_eq!(format!("{:>8}|", Role::Consumer), " drafter|");
    }

    #[test]
    fn bad_names_are_refused_naming_the_text() {
        for text in [
            "",
            "target",
            "target-",
            "-1",
            "producer-1",
            "Target-1",
            "target-+1",
            "target--1",
            "target-1x",
            "target-4294967296",
            "drafter-1-2",
            " target-1",
        ] {
            let err = text.parse::<WorkerName>().unwrap_err();
            assert_eq!(err.text, text);
            assert!(err.to_string().contains(&format!("{text:?}")), "{err}");
        }
    }

    #[test]
    fn roles_serialise_by_ring_word_or_by_hspipe_name() {
        assert_eq!(
            serde_json::to_string(&Role::Producer).unwrap(),
            "\"producer\""
        );
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct W {
            #[serde(with = "role_name")]
            role: Role,
        }
        let json = serde_json::to_string(&W {
            role: Role::Consumer,
        })
        .unwrap();
        assert_eq!(json, r#"{"role":"drafter"}"#);
        assert_eq!(
            serde_json::from_str::<W>(&json).unwrap().role,
            Role::Consumer
        );
        assert!(serde_json::from_str::<W>(r#"{"role":"consumer"}"#).is_err());
    }
}
