//! The workspace every rank allocates, and the shape the kernels read: pure arithmetic,
//! checked here so that a bad configuration is an error before any GPU work.

use freight_core::{Error, Result};

/// Most ranks and most experts per rank: the kernels keep one shared-memory entry each.
pub const MAX_RANKS: usize = 1024;
pub const MAX_LOCAL_EXPERTS: usize = 1024;
/// Most top-k choices per token: combine gives each choice a lane of a warp.
pub const MAX_TOPK: usize = 32;

/// What a buffer is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub ranks: usize,
    pub rank: usize,
    /// Tokens one rank passes to one dispatch, at most.
    pub max_tokens: usize,
    /// Elements per token (bf16).
    pub hidden: usize,
    pub topk: usize,
    pub local_experts: usize,
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidArgument(msg));
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return bad(format!("ranks must be 1..={MAX_RANKS}, got {}", self.ranks));
        }
        if self.rank >= self.ranks {
            return bad(format!("rank {} is not below the number of ranks {}", self.rank, self.ranks));
        }
        if self.max_tokens == 0 || self.max_tokens > i32::MAX as usize / self.ranks {
            return bad(format!("max_tokens must be at least 1 (and fit 32-bit row numbers), got {}", self.max_tokens));
        }
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return bad(format!(
                "hidden must be a positive multiple of 8 (rows move in 16-byte vectors), got {}",
                self.hidden
            ));
        }
        if self.topk == 0 || self.topk > MAX_TOPK {
            return bad(format!("topk must be 1..={MAX_TOPK}, got {}", self.topk));
        }
        if self.local_experts == 0 || self.local_experts > MAX_LOCAL_EXPERTS {
            return bad(format!("experts per rank must be 1..={MAX_LOCAL_EXPERTS}, got {}", self.local_experts));
        }
        Ok(())
    }

    pub fn num_experts(&self) -> usize {
        self.ranks * self.local_experts
    }

    pub fn row_bytes(&self) -> u64 {
        self.hidden as u64 * 2
    }
}

/// Signal words at the start of each rank's block: four kinds.
const SIGNAL_KINDS: u64 = 4;

/// What the kernels read to find their way around a workspace (the C struct `Shape` of
/// kernels.cu, field for field).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub row_bytes: u64,
    pub meta_bytes: u64,
    /// One rank's block: everything that rank writes into this workspace.
    pub block_bytes: u64,
    /// Offsets within a block (its signal words come first).
    pub off_drows: u64,
    pub off_dmeta: u64,
    pub off_crows: u64,
    pub ranks: i32,
    pub me: i32,
    pub max_tokens: i32,
    pub topk: i32,
    pub local_experts: i32,
    pub pad: i32,
}

fn align(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

impl Shape {
    pub fn of(config: &Config) -> Result<Shape> {
        config.validate()?;
        let rows = config.max_tokens as u64;
        let row_bytes = config.row_bytes();
        // src token, then topk local experts, then topk weights.
        let meta_bytes = align(4 + 8 * config.topk as u64, 16);
        let off_drows = align(SIGNAL_KINDS * 8, 256);
        let off_dmeta = align(off_drows + rows * row_bytes, 256);
        let off_crows = align(off_dmeta + rows * meta_bytes, 256);
        let block_bytes = align(off_crows + rows * row_bytes, 256);
        Ok(Shape {
            row_bytes,
            meta_bytes,
            block_bytes,
            off_drows,
            off_dmeta,
            off_crows,
            ranks: config.ranks as i32,
            me: config.rank as i32,
            max_tokens: config.max_tokens as i32,
            topk: config.topk as i32,
            local_experts: config.local_experts as i32,
            pad: 0,
        })
    }

    /// Bytes of one rank's workspace.
    pub fn workspace_bytes(&self) -> u64 {
        self.ranks as u64 * self.block_bytes
    }

    /// Where rank `src`'s block starts in a workspace.
    pub fn block_offset(&self, src: usize) -> u64 {
        src as u64 * self.block_bytes
    }

    /// Bytes of the signal words at the start of each block (zeroed before first use).
    pub fn signal_bytes(&self) -> u64 {
        SIGNAL_KINDS * 8
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn config() -> Config {
        Config { ranks: 4, rank: 1, max_tokens: 128, hidden: 7168, topk: 8, local_experts: 8 }
    }

    #[test]
    fn regions_follow_each_other_aligned_without_overlap() {
        let s = Shape::of(&config()).unwrap();
        assert_eq!(s.row_bytes, 14336);
        assert_eq!(s.meta_bytes, 80);
        assert!(s.signal_bytes() <= s.off_drows);
        assert_eq!(s.off_dmeta, s.off_drows + 128 * 14336);
        assert!(s.off_crows >= s.off_dmeta + 128 * 80);
        assert!(s.block_bytes >= s.off_crows + 128 * 14336);
        for off in [s.off_drows, s.off_dmeta, s.off_crows, s.block_bytes] {
            assert_eq!(off % 256, 0);
        }
        assert_eq!(s.workspace_bytes(), 4 * s.block_bytes);
        assert_eq!(s.block_offset(3), 3 * s.block_bytes);
        assert_eq!(std::mem::size_of::<Shape>(), 72);
    }

    #[test]
    fn bad_configurations_are_refused_with_the_reason() {
        let cases = [
            (Config { ranks: 0, ..config() }, "ranks"),
            (Config { rank: 4, ..config() }, "rank 4"),
            (Config { hidden: 7170, ..config() }, "multiple of 8"),
            (Config { topk: 0, ..config() }, "topk"),
            (Config { local_experts: 0, ..config() }, "experts per rank"),
            (Config { max_tokens: 0, ..config() }, "max_tokens"),
        ];
        for (c, why) in cases {
            let err = Shape::of(&c).unwrap_err().to_string();
            assert!(err.contains(why), "{err} should mention {why}");
        }
    }
}
