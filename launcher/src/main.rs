use std::io::Write;

use clap::Parser;

fn main() {
    // Worker mode: the launcher runs the workers itself when their binaries are not beside it.
    let mut argv: Vec<String> = std::env::args().collect();
    if argv.len() > 1 && (argv[1] == "worker-target" || argv[1] == "worker-drafter") {
        let mode = argv.remove(1);
        let code = if mode == "worker-target" {
            target_worker::run(target_worker::Args::parse_from(&argv))
        } else {
            drafter_worker::run(drafter_worker::Args::parse_from(&argv))
        };
        exit_with(code);
    }
    // `launcher report RUN_DIR`: a picture of a run (see launcher::report).
    if argv.get(1).map(String::as_str) == Some("report") {
        let args = launcher::report::ReportArgs::parse_from(&argv[1..]);
        exit_with(launcher::report::run(args));
    }
    // `launcher prepare INPUT`: prepare data only (see launcher::data).
    if argv.get(1).map(String::as_str) == Some("prepare") {
        let args = launcher::data::PrepareArgs::parse_from(&argv[1..]);
        exit_with(launcher::data::run_prepare(args));
    }
    let args = launcher::Args::parse();
    exit_with(launcher::run(args));
}

fn exit_with(r: anyhow::Result<i32>) -> ! {
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Not eprintln!: it panics if the terminal is gone (the run directory's
            // launcher.log has the message too, once it exists).
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            let usage = e.downcast_ref::<launcher::UsageError>().is_some();
            std::process::exit(if usage {
                launcher::exit::USAGE
            } else {
                launcher::exit::ERROR
            });
        }
    }
}
