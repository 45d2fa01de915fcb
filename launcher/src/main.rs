use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use launcher::{exit, Cli, Command};
use shm_ring::Role;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that exit 0.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    match (cli.command, cli.run) {
        // How the launcher starts its workers (spawn.rs): itself, through a hidden subcommand.
        (Some(Command::TargetWorker(args)), _) => {
            launcher::name_process(Role::Producer);
            worker_runtime::exit_code(target_worker::run(args))
        }
        (Some(Command::DrafterWorker(args)), _) => {
            launcher::name_process(Role::Consumer);
            worker_runtime::exit_code(drafter_worker::run(args))
        }
        (Some(Command::Report(args)), _) => exit_code(launcher::report::run(args)),
        (Some(Command::Prepare(args)), _) => exit_code(launcher::data::run_prepare(args)),
        (Some(Command::MakeModel(args)), _) => exit_code(launcher::model::run_make_model(args)),
        (Some(Command::Capture(args)), _) => exit_code(launcher::model::run_capture(args)),
        (Some(Command::Eval(args)), _) => exit_code(launcher::eval::run_eval(args)),
        (None, Some(args)) => exit_code(launcher::run(args)),
        // Not reached: without a subcommand clap requires the run's options.
        (None, None) => {
            let _ = Cli::command().print_help();
            ExitCode::from(exit::USAGE as u8)
        }
    }
}

fn exit_code(r: anyhow::Result<i32>) -> ExitCode {
    match r {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(exit::ERROR as u8)),
        Err(e) => {
            let usage = e.downcast_ref::<launcher::UsageError>().is_some();
            let stopped = e.downcast_ref::<launcher::Interrupted>().is_some();
            // Not eprintln!: it panics if the terminal is gone (the run directory's
            // launcher.log has the message too, once it exists). A stop asked for is no error.
            let what = if stopped { "" } else { "error: " };
            let _ = writeln!(std::io::stderr(), "{what}{e:#}");
            ExitCode::from(if usage {
                exit::USAGE
            } else if stopped {
                exit::INTERRUPTED
            } else {
                exit::ERROR
            } as u8)
        }
    }
}
