//! All integration tests of ring-stat build into this one binary, one module per area.

mod cli;
mod common;
mod screen;
mod stat;
