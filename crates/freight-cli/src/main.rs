//! The `freight` binary: everything lives in the library, shared with the Python wheel.

/// As in the Python module (crates/freight-py): requests' large bookkeeping reuses
/// freed memory instead of faulting in fresh pages each time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
    // The target process is this same executable; argv[0] is the fallback when the
    // path cannot be read (it then has to be on PATH).
    let exe = std::env::current_exe().map(|p| p.to_string_lossy().into_owned()).unwrap_or_else(|_| args[0].clone());
    std::process::exit(freight_cli::run(args, vec![exe]));
}
