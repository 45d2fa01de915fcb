//! All integration tests of the `tests` crate build into this one binary, one module per area.

mod big_inputs;
mod chaos;
mod chat;
mod data;
mod gpu;
mod gpu_dflash;
mod gpu_py;
mod launcher;
mod long_records;
mod model;
mod ring_processes;
mod screen;
mod support;
mod tensorboard;
mod tidy;
mod verdict;
mod workers;
