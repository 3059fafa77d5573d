//! The bytes the demo and the benchmark move, and how they are checked.
//!
//! Byte `o` of a buffer is a function of `(seed, o)`, so either side can fill or check
//! any range without being sent the data, and each round uses a fresh seed so that
//! bytes left over from an earlier round can never pass for the new ones.

use std::sync::Arc;

use freight_core::SharedSegment;

/// Fills target memory before a WRITE so that a transfer that did not happen shows.
pub const POISON: u8 = 0xA5;

#[inline]
fn word(seed: u64, index: u64) -> u64 {
    let z = (index ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^ (z >> 29)
}

/// Writes the pattern of `seed` over `buf` (which starts at pattern offset 0).
pub fn fill(buf: &mut [u8], seed: u64) {
    let words = (buf.len() / 8) as u64;
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let last = word(seed, words).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The first byte that differs from the pattern, described for a person.
pub fn check(buf: &[u8], seed: u64) -> Result<(), String> {
    let chunks = buf.chunks_exact(8);
    let tail = chunks.remainder();
    let mut bad = None;
    for (i, c) in chunks.enumerate() {
        if u64::from_le_bytes(c.try_into().expect("8 bytes")) != word(seed, i as u64) {
            bad = Some(i * 8);
            break;
        }
    }
    let start = bad.unwrap_or(buf.len() - tail.len());
    for o in start..buf.len() {
        let expected = word(seed, (o / 8) as u64).to_le_bytes()[o % 8];
        if buf[o] != expected {
            let hint = if buf[o] == POISON { " (poison: the transfer did not reach this byte)" } else { "" };
            return Err(format!(
                "byte {o} of {} differs: expected {expected:#04x}, found {:#04x}{hint}",
                buf.len(),
                buf[o]
            ));
        }
    }
    Ok(())
}

/// The first `len` bytes of a segment we own, as a slice.
///
/// Callers touch a segment only between transfers (the protocol orders every fill and
/// check with the transfers through notifications), so no copy races with the slice.
// The slice aliases memory the engine also reaches; see above for why that is sound here.
#[allow(clippy::mut_from_ref)]
pub fn bytes_mut(seg: &Arc<SharedSegment>, len: u64) -> &mut [u8] {
    assert!(len as usize <= seg.len(), "range beyond the segment");
    // SAFETY: the segment is a live mapping of at least `len` bytes, kept alive by `seg`;
    // see above for why nothing else touches it while the slice lives.
    unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), len as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_find_the_first_difference() {
        for len in [0usize, 1, 7, 8, 9, 4096, 4101] {
            let mut b = vec![0u8; len];
            fill(&mut b, 42);
            assert_eq!(check(&b, 42), Ok(()), "len {len}");
            if len > 0 {
                assert!(check(&b, 43).is_err(), "another seed must not pass (len {len})");
                b[len - 1] ^= 1;
                assert!(check(&b, 42).unwrap_err().starts_with(&format!("byte {}", len - 1)));
            }
        }
        let mut b = vec![POISON; 64];
        fill(&mut b[..16], 1);
        let mut full = vec![0u8; 64];
        fill(&mut full, 1);
        assert_eq!(&b[..16], &full[..16], "a prefix fill is a prefix of the full pattern");
        assert!(check(&b, 1).unwrap_err().contains("poison"));
    }
}
