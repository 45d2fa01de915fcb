//! The multi-process tests' shared helpers live in `testkit` (shm-ring's own tests use them
//! too); this crate's library only names them for `ring-peer` and the tests.

pub use testkit::{batch_id, fill, payload_len, verify};
