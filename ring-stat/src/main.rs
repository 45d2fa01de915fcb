fn main() -> std::process::ExitCode {
    // 0 or 1 (see `cli::main`; a usage error exits 2 inside it).
    std::process::ExitCode::from(u8::try_from(ring_stat::cli::main()).unwrap_or(1))
}
