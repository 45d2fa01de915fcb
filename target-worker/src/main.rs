use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    worker_runtime::exit_code(target_worker::run(target_worker::Args::parse()))
}
