//! What `/proc/self/maps` says about an address range: whether every page of it is
//! private, writable, anonymous memory of this process (what [`SharedSegment::share_in_place`]
//! may lay shared memory under), parsed by pure functions tested without a process.
//!
//! [`SharedSegment::share_in_place`]: crate::memory::SharedSegment::share_in_place

use freight_proto::error::{invalid, Result};

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapLine {
    pub start: u64,
    pub end: u64,
    /// `rwxp` / `rw-s` ...
    pub perms: String,
    /// The backing path, `[heap]`, `[stack]`..., or empty for anonymous memory.
    pub path: String,
}

impl MapLine {
    /// Private, readable and writable, and not backed by a file (anonymous memory or
    /// the heap): memory only this process sees, whose pages may be replaced.
    pub fn is_private_anonymous(&self) -> bool {
        let p = self.perms.as_bytes();
        let anonymous = self.path.is_empty() || self.path == "[heap]";
        p.len() == 4 && p[0] == b'r' && p[1] == b'w' && p[3] == b'p' && anonymous
    }
}

/// Parses the text of `/proc/<pid>/maps`; lines it cannot read are skipped.
pub fn parse(text: &str) -> Vec<MapLine> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MapLine> {
    // start-end perms offset dev inode [path]
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?.to_string();
    let (_offset, _dev, _inode) = (fields.next()?, fields.next()?, fields.next()?);
    let path = fields.next().unwrap_or("").trim().to_string();
    let (s, e) = range.split_once('-')?;
    let start = u64::from_str_radix(s, 16).ok()?;
    let end = u64::from_str_radix(e, 16).ok()?;
    (start < end).then_some(MapLine { start, end, perms, path })
}

/// Checks that `[start, end)` is covered, without a gap, by private anonymous writable
/// mappings; the error names the first page that is not.
pub fn check_private_anonymous(lines: &[MapLine], start: u64, end: u64) -> Result<()> {
    check_covered(lines, start, end, "private anonymous memory", MapLine::is_private_anonymous)
}

/// Checks that no page of `[start, end)` is the process heap (`[heap]`, the memory
/// `brk` grows): the allocator packs small allocations there side by side, so a page of
/// it holds other allocations and their bookkeeping, written by any thread at any time.
pub fn check_outside_heap(lines: &[MapLine], start: u64, end: u64) -> Result<()> {
    match lines.iter().find(|l| l.end > start && l.start < end && l.path == "[heap]") {
        None => Ok(()),
        Some(l) => Err(invalid(format!(
            "[{start:#x}, {end:#x}) is in the process heap ({:#x}-{:#x} [heap]), whose pages hold other \
             allocations beside it: only memory that owns its pages (an allocation of its own, such as a large \
             one) can be shared in place",
            l.start, l.end
        ))),
    }
}

/// Checks that `[start, end)` is covered, without a gap, by mappings that `ok` accepts
/// (`what` names them in the error, which names the first page that is not).
pub fn check_covered(lines: &[MapLine], start: u64, end: u64, what: &str, ok: impl Fn(&MapLine) -> bool) -> Result<()> {
    let mut at = start;
    let mut sorted: Vec<&MapLine> = lines.iter().filter(|l| l.end > start && l.start < end).collect();
    sorted.sort_by_key(|l| l.start);
    for line in sorted {
        if line.start > at {
            break;
        }
        if !ok(line) {
            return Err(invalid(format!(
                "[{at:#x}, {end:#x}) is not {what}: {:#x}-{:#x} is {} {}",
                line.start,
                line.end,
                line.perms,
                if line.path.is_empty() { "(anonymous)" } else { &line.path }
            )));
        }
        at = at.max(line.end);
        if at >= end {
            return Ok(());
        }
    }
    Err(invalid(format!("[{at:#x}, {end:#x}) is not mapped in this process")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0 
7f0000100000-7f0000200000 rw-p 00000000 00:00 0 
7f0000200000-7f0000300000 rw-s 00000000 00:01 1234                       /memfd:freight-seg-1 (deleted)
7f0000300000-7f0000400000 r--p 00000000 fd:01 99                         /usr/lib/libc.so.6
7f0000500000-7f0000600000 rw-p 00000000 00:00 0 
";

    #[test]
    fn lines_are_parsed_with_and_without_a_path() {
        let lines = parse(MAPS);
        assert_eq!(lines.len(), 6);
        assert_eq!(lines[0].path, "[heap]");
        assert_eq!(lines[1].path, "");
        assert_eq!(lines[3].path, "/memfd:freight-seg-1 (deleted)");
        assert_eq!((lines[1].start, lines[1].end), (0x7f0000000000, 0x7f0000100000));
        assert!(parse("garbage\n\n12-zz rw-p 0 0 0\n").is_empty());
    }

    #[test]
    fn a_range_over_adjacent_anonymous_mappings_passes() {
        let lines = parse(MAPS);
        check_private_anonymous(&lines, 0x7f0000000000, 0x7f0000200000).unwrap();
        check_private_anonymous(&lines, 0x7f0000050000, 0x7f0000150000).unwrap();
        check_private_anonymous(&lines, 0x55d0c0001000, 0x55d0c0002000).unwrap();
    }

    #[test]
    fn a_range_that_touches_the_heap_is_refused_naming_it() {
        let lines = parse(MAPS);
        check_outside_heap(&lines, 0x7f0000000000, 0x7f0000200000).unwrap();
        check_outside_heap(&lines, 0x55d0c0021000, 0x55d0c0022000).unwrap();
        for (start, end) in
            [(0x55d0c0001000, 0x55d0c0002000), (0x55d0bffff000, 0x55d0c0001000), (0x55d0c0020000, 0x7f0000001000)]
        {
            let e = check_outside_heap(&lines, start, end).unwrap_err().to_string();
            assert!(e.contains("[heap]") && e.contains("owns its pages"), "{e}");
        }
    }

    #[test]
    fn shared_file_backed_read_only_and_unmapped_ranges_are_refused_by_name() {
        let lines = parse(MAPS);
        let e = check_private_anonymous(&lines, 0x7f0000100000, 0x7f0000201000).unwrap_err().to_string();
        assert!(e.contains("rw-s") && e.contains("memfd"), "{e}");
        let e = check_private_anonymous(&lines, 0x7f0000300000, 0x7f0000301000).unwrap_err().to_string();
        assert!(e.contains("libc"), "{e}");
        let e = check_private_anonymous(&lines, 0x7f0000400000, 0x7f0000401000).unwrap_err().to_string();
        assert!(e.contains("not mapped"), "{e}");
        // A gap in the middle.
        let e = check_private_anonymous(&lines, 0x7f0000000000, 0x7f0000600000).unwrap_err().to_string();
        assert!(e.contains("rw-s"), "{e}");
        let e = check_private_anonymous(&lines, 0x7f00004ff000, 0x7f0000501000).unwrap_err().to_string();
        assert!(e.contains("not mapped") && e.contains("0x7f00004ff000"), "{e}");
    }
}
