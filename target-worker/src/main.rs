use clap::Parser;

fn main() {
    let args = target_worker::Args::parse();
    match target_worker::run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
