//! The launcher is not built yet; this placeholder says so instead of pretending to run.

fn main() {
    eprintln!("error: the launcher is not built yet (see `issues`: launcher); shm-ring is ready");
    std::process::exit(2);
}
