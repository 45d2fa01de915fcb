use clap::Parser;

fn main() {
    let args = drafter_worker::Args::parse();
    match drafter_worker::run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
