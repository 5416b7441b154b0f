//! `idemstore`: inspect and maintain a store file (feature `cli`).
//! Everything is in the library's `cli` module; see `idemstore --help`.

fn main() -> std::process::ExitCode {
    idemstore::cli::main()
}
