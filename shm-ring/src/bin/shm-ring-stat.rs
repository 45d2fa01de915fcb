fn main() -> std::process::ExitCode {
    // 0 or 1 (see `stat_cli::main`).
    std::process::ExitCode::from(u8::try_from(shm_ring::stat_cli::main()).unwrap_or(1))
}
