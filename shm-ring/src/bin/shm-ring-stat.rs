fn main() {
    std::process::exit(shm_ring::stat_cli::main());
}
