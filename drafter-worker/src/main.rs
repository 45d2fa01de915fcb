use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    worker_runtime::exit_code(drafter_worker::run(drafter_worker::Args::parse()))
}
