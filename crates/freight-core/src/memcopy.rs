//! Copies of memory too large for the caches, with stores that bypass them.
//!
//! A plain `memcpy` of a few MiB writes through the caches: every destination line is
//! first read into them (to be overwritten), and the copy evicts whatever else they
//! held. glibc switches to non-temporal stores only past a threshold tied to the last
//! level cache (about 24 MiB on a 32 MiB L3), so the 64 KiB to 16 MiB pieces of a KV
//! cache load take the cached path. On a 2-CPU VM (AMD EPYC), 512 MiB moved as 16 MiB
//! or 64 KiB copies took 62-67 ms with `memcpy` and 38-49 ms with the stores below,
//! as fast as one 512 MiB `memcpy`.
//!
//! Only large requests stream ([`STREAM_MIN_BYTES`]): the destination of a small one
//! is likely read soon, from the cache that a streaming copy would have bypassed.

/// Requests of at least this many bytes are copied with [`stream`].
pub const STREAM_MIN_BYTES: u64 = 8 << 20;

/// Copies `len` bytes from `src` to `dst` with non-temporal stores where the CPU has
/// them (x86-64: SSE2, which every x86-64 CPU has); elsewhere a plain copy. The stores
/// are fenced before this returns, so whatever is published after it (a completion
/// flag, a notification) is ordered after every byte.
///
/// # Safety
///
/// As for [`std::ptr::copy_nonoverlapping`]: both ranges valid for `len` bytes and not
/// overlapping.
pub unsafe fn stream(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller vouches.
    unsafe {
        stream_x86_64(dst, src, len)
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: as the caller vouches.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_x86_64(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Up to the first 16-byte boundary of the destination: plain (streaming stores need
    // aligned addresses).
    let head = (dst as usize).wrapping_neg() & 15;
    let head = head.min(len);
    // SAFETY (whole block): every access stays inside [0, len) of both ranges, which the
    // caller vouches for; stores after `head` are 16-byte aligned.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut d, mut s, mut left) = (dst.add(head), src.add(head), len - head);
        // Four vectors a round: a whole 64-byte line, so the write-combining buffer
        // goes out full.
        while left >= 64 {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            d = d.add(64);
            s = s.add(64);
            left -= 64;
        }
        std::ptr::copy_nonoverlapping(s, d, left);
        // Streaming stores are weakly ordered: fence them before anything says "done".
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length from 0 to a few lines, at every alignment of either side, and a
    /// large copy: the destination equals the source, and nothing outside it is touched.
    #[test]
    fn streamed_copies_equal_the_source_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        for len in (0..130).chain([255, 1000, 4000]) {
            for s_off in 0..17 {
                for d_off in 0..17 {
                    if s_off + len > src.len() || d_off + len + 32 > 4096 {
                        continue;
                    }
                    let mut dst = vec![0xAAu8; 4096];
                    // SAFETY: both ranges lie in their vectors, which do not overlap.
                    unsafe { stream(dst.as_mut_ptr().add(d_off), src.as_ptr().add(s_off), len) };
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "len {len} at {s_off}/{d_off}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "before, len {len} at {s_off}/{d_off}");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA), "after, len {len} at {s_off}/{d_off}");
                }
            }
        }
        let big: Vec<u8> = (0..(9 << 20) as u32).map(|i| (i % 251) as u8).collect();
        let mut out = vec![0u8; big.len()];
        // SAFETY: two separate vectors of the same length.
        unsafe { stream(out.as_mut_ptr(), big.as_ptr(), big.len()) };
        assert!(out == big);
    }
}
