//! Host memory a command is about to take, checked first: a host that runs out kills a
//! process without a word (the OOM killer, exit 137) instead of failing an allocation,
//! and fresh memory is only committed when it is touched, long after the options that
//! sized it were read.

use crate::options::{format_size, CliError, CliResult};

/// Host memory the kernel says it can still hand out (`MemAvailable`), if it says.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses, as a usage error, a run whose `needed` bytes the host cannot hold: `what`
/// names the memory, `remedy` the options that shrink it. Where the host does not say
/// what it has, the run goes ahead.
pub fn ensure_room(needed: u64, what: &str, remedy: &str) -> CliResult<()> {
    match available() {
        Some(available) if needed > available => Err(CliError::usage(format!(
            "{what} needs at least {} of host memory and {} is available; {remedy}",
            format_size(needed),
            format_size(available)
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_the_host_has_is_a_usage_error_that_says_what_to_lower() {
        assert!(available().is_some_and(|n| n > 0), "Linux says how much memory is available");
        let err = ensure_room(u64::MAX, "the buffer", "lower --size").unwrap_err();
        assert!(
            matches!(&err, CliError::Usage(m) if m.starts_with("the buffer needs at least") && m.ends_with("lower --size"))
        );
        ensure_room(4096, "a page", "lower nothing").unwrap();
    }
}
