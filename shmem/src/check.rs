//! What an attacher checks before it trusts a segment, the same for the ring and the drafter
//! group: the file's owner and mode and its size (before mapping it), then the magic number and
//! the layout version at the start of its header (after the Acquire load of the magic that
//! pairs with the creator's Release store, which each caller makes on its own header).
//!
//! Each caller words a [`Refusal`] in its own error type, naming the segment.

use crate::FileInfo;

/// Why a segment is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Owned by another user, and this process would write it.
    #[error("it is owned by uid {owner}, not by this user (uid {me})")]
    ForeignOwner { owner: u32, me: u32 },
    /// Group or other users may open it (permission bits `mode & 0o777`).
    #[error("its mode {mode:03o} lets group or other users open it")]
    InsecureMode { mode: u32 },
    /// Smaller than the header the caller needs to read.
    #[error("it is {size} bytes, smaller than a header of {min}")]
    TooSmall { size: u64, min: u64 },
    /// The magic is zero: its creator died while creating it, or is creating it now.
    #[error("it was never initialised")]
    Uninitialised,
    /// The magic is not the caller's: another kind of segment, or garbage.
    #[error("its magic {found:#018x} is not the expected one")]
    BadMagic { found: u64 },
    /// Another layout version of the same kind of segment.
    #[error("its layout version is {found}, this program reads {expected}")]
    Version { found: u32, expected: u32 },
}

/// Checks a segment's file before it is mapped, in this order: the owner (only for a writer:
/// the kernel already let a reader open it, and reading is harmless), the mode (0600 only,
/// for readers too, since a segment others may open cannot be trusted), then the size.
pub fn check_file(info: &FileInfo, writable: bool, min_size: u64) -> Result<(), Refusal> {
    let me = crate::euid();
    if writable && info.uid != me {
        return Err(Refusal::ForeignOwner {
            owner: info.uid,
            me,
        });
    }
    if info.mode & 0o077 != 0 {
        return Err(Refusal::InsecureMode {
            mode: info.mode & 0o777,
        });
    }
    if info.size < min_size {
        return Err(Refusal::TooSmall {
            size: info.size,
            min: min_size,
        });
    }
    Ok(())
}

/// The first words of a kind of segment's header: its magic number and its layout version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub magic: u64,
    pub version: u32,
}

impl Stamp {
    /// Checks the magic and the version read from a header against this stamp.
    pub fn check(&self, magic: u64, version: u32) -> Result<(), Refusal> {
        if magic == 0 {
            return Err(Refusal::Uninitialised);
        }
        if magic != self.magic {
            return Err(Refusal::BadMagic { found: magic });
        }
        if version != self.version {
            return Err(Refusal::Version {
                found: version,
                expected: self.version,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_refused_for_their_owner_mode_and_size_in_that_order() {
        let me = crate::euid();
        let ok = FileInfo {
            size: 4096,
            uid: me,
            mode: 0o600,
        };
        assert_eq!(check_file(&ok, true, 4096), Ok(()));
        let theirs = FileInfo {
            uid: me.wrapping_add(1),
            mode: 0o644,
            size: 1,
        };
        assert_eq!(
            check_file(&theirs, true, 4096),
            Err(Refusal::ForeignOwner {
                owner: me.wrapping_add(1),
                me
            })
        );
        assert_eq!(
            check_file(&theirs, false, 4096),
            Err(Refusal::InsecureMode { mode: 0o644 }),
            "a reader may look at another user's segment, not at an open one"
        );
        let small = FileInfo { size: 100, ..ok };
        assert_eq!(
            check_file(&small, false, 4096),
            Err(Refusal::TooSmall {
                size: 100,
                min: 4096
            })
        );
    }

    #[test]
    fn a_stamp_tells_an_uninitialised_a_foreign_and_an_older_segment_apart() {
        let s = Stamp {
            magic: 7,
            version: 2,
        };
        assert_eq!(s.check(7, 2), Ok(()));
        assert_eq!(s.check(0, 2), Err(Refusal::Uninitialised));
        assert_eq!(s.check(8, 2), Err(Refusal::BadMagic { found: 8 }));
        assert_eq!(
            s.check(7, 1),
            Err(Refusal::Version {
                found: 1,
                expected: 2
            })
        );
    }
}
