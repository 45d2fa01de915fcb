//! All integration tests of shm-ring build into this one binary, one module per area.

mod common;
mod ring;
