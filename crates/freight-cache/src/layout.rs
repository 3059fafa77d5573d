//! Where a token's keys and values lie, in the caller's KV memory and in a chunk.
//!
//! - A **chunk** of `n` tokens is laid out `[layers][K, V][n][heads x head_dim]`.
//! - **Contiguous** KV memory is the same with room for `tokens` tokens:
//!   `[layers][K, V][tokens][heads x head_dim]`.
//! - **Paged** KV memory, as vLLM-style engines keep it, is
//!   `[layers][K, V][num_blocks][block_size][heads x head_dim]`, and a request's block
//!   table says which block holds its tokens `i * block_size ..`.
//!
//! [`runs`] lists the contiguous byte runs that move a chunk between the two: pure
//! arithmetic, checked against the layout's bounds, and merged where runs touch.

use std::collections::HashSet;

use freight_core::{Error, Result};

/// The model's KV geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: u64,
    pub heads: u64,
    pub head_dim: u64,
    /// Bytes per element (2 for fp16/bf16).
    pub elem_bytes: u64,
}

impl KvShape {
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 || self.heads == 0 || self.head_dim == 0 || self.elem_bytes == 0 {
            return Err(Error::InvalidArgument(format!("every KV dimension must be at least 1, got {self:?}")));
        }
        Ok(())
    }

    /// Bytes of one token's keys (or values) in one layer.
    pub fn row_bytes(&self) -> u64 {
        self.heads * self.head_dim * self.elem_bytes
    }

    /// Bytes of a chunk of `tokens` tokens: every layer's keys and values.
    pub fn chunk_bytes(&self, tokens: u64) -> u64 {
        self.layers * 2 * tokens * self.row_bytes()
    }

    /// [`KvShape::chunk_bytes`], or an error where it does not fit 64 bits.
    pub fn checked_chunk_bytes(&self, tokens: u64) -> Result<u64> {
        [self.heads, self.head_dim, self.elem_bytes, self.layers, 2, tokens]
            .into_iter()
            .try_fold(1u64, |acc, n| acc.checked_mul(n))
            .ok_or_else(|| Error::InvalidArgument(format!("{tokens} tokens of this KV shape exceed 2^64 bytes")))
    }
}

/// How the caller's KV memory is laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvLayout {
    /// `[layers][K, V][tokens][heads x head_dim]`.
    Contiguous { tokens: u64 },
    /// `[layers][K, V][num_blocks][block_size][heads x head_dim]`, and the request's
    /// blocks in token order.
    Paged { block_size: u64, num_blocks: u64, block_table: Vec<u64> },
}

impl KvLayout {
    /// Bytes the whole KV memory takes.
    pub fn bytes(&self, shape: &KvShape) -> u64 {
        match self {
            KvLayout::Contiguous { tokens } => shape.chunk_bytes(*tokens),
            KvLayout::Paged { block_size, num_blocks, .. } => shape.chunk_bytes(block_size * num_blocks),
        }
    }

    /// [`KvLayout::bytes`], or an error where the layout's sizes overflow (every offset
    /// in the memory is then representable too).
    pub fn checked_bytes(&self, shape: &KvShape) -> Result<u64> {
        let tokens = match self {
            KvLayout::Contiguous { tokens } => Some(*tokens),
            KvLayout::Paged { block_size, num_blocks, block_table } => block_size
                .checked_mul(*num_blocks)
                .filter(|_| block_size.checked_mul(block_table.len() as u64).is_some()),
        };
        let tokens = tokens.ok_or_else(|| Error::InvalidArgument("the paged layout's sizes exceed 2^64".into()))?;
        shape.checked_chunk_bytes(tokens)
    }

    /// Tokens of the request the memory can hold, or an error where they overflow.
    pub fn capacity(&self) -> Result<u64> {
        match self {
            KvLayout::Contiguous { tokens } => Ok(*tokens),
            KvLayout::Paged { block_size, block_table, .. } => block_size
                .checked_mul(block_table.len() as u64)
                .ok_or_else(|| Error::InvalidArgument("the paged layout's sizes exceed 2^64".into())),
        }
    }

    /// Refuses, for the first `tokens` tokens, a paged layout whose block size is 0, or
    /// whose block table names a block that is not there or one block twice (two token
    /// ranges in one block: a retrieve would write both into it at once). Entries past
    /// the blocks those tokens fill are never used, and not looked at: engines pad their
    /// block tables (with block 0, say) to a common width.
    pub fn validate(&self, tokens: u64) -> Result<()> {
        if let KvLayout::Paged { block_size, num_blocks, block_table } = self {
            if *block_size == 0 {
                return Err(Error::InvalidArgument("the block size must be at least 1 token".into()));
            }
            let used = usize::try_from(tokens.div_ceil(*block_size)).unwrap_or(usize::MAX).min(block_table.len());
            let mut seen = HashSet::with_capacity(used);
            for (i, &b) in block_table[..used].iter().enumerate() {
                if b >= *num_blocks {
                    return Err(Error::InvalidArgument(format!(
                        "the block table names block {b}, but the KV memory has {num_blocks} blocks"
                    )));
                }
                if !seen.insert(b) {
                    return Err(Error::InvalidArgument(format!(
                        "the block table names block {b} twice (entry {i} and an earlier one)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Byte offset of token `t`'s row in layer `layer`, `kv` 0 for keys and 1 for values;
    /// `None` where it does not fit 64 bits or `t` is past the block table.
    fn offset(&self, shape: &KvShape, layer: u64, kv: u64, t: u64) -> Option<u64> {
        let plane = layer.checked_mul(2)?.checked_add(kv)?;
        let row = match self {
            KvLayout::Contiguous { tokens } => plane.checked_mul(*tokens)?.checked_add(t)?,
            KvLayout::Paged { block_size, num_blocks, block_table } => {
                let block = *block_table.get(usize::try_from(t / block_size).ok()?)?;
                plane
                    .checked_mul(*num_blocks)?
                    .checked_add(block)?
                    .checked_mul(*block_size)?
                    .checked_add(t % block_size)?
            }
        };
        row.checked_mul(shape.row_bytes())
    }

    /// Tokens from `t` on that lie next to each other in memory (to the end of `t`'s block).
    fn run_tokens(&self, t: u64, end: u64) -> u64 {
        match self {
            KvLayout::Contiguous { .. } => end - t,
            KvLayout::Paged { block_size, .. } => (block_size - t % block_size).min(end - t),
        }
    }
}

/// One contiguous piece: `len` bytes at `kv` in the KV memory and at `chunk` in the chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub kv: u64,
    pub chunk: u64,
    pub len: u64,
}

/// The runs that hold tokens `start .. start + tokens` of a request in `layout`, in the
/// chunk's byte order.
pub fn runs(shape: &KvShape, layout: &KvLayout, start: u64, tokens: u64) -> Result<Vec<Run>> {
    shape.validate()?;
    layout.validate(start.saturating_add(tokens))?;
    layout.checked_bytes(shape)?;
    runs_of_valid(shape, layout, start, tokens)
}

/// [`runs`] for a shape and layout checked already ([`KvShape::validate`],
/// [`KvLayout::validate`] and [`KvLayout::checked_bytes`]): the engine checks them once
/// per call, not once per chunk (a block table holds thousands of blocks).
pub(crate) fn runs_of_valid(shape: &KvShape, layout: &KvLayout, start: u64, tokens: u64) -> Result<Vec<Run>> {
    let capacity = layout.capacity()?;
    let end = start.checked_add(tokens).filter(|&e| e <= capacity).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "tokens {start}..{} do not fit KV memory that holds {capacity} tokens",
            start.saturating_add(tokens),
        ))
    })?;
    let row = shape.row_bytes();
    let mut out: Vec<Run> = Vec::new();
    let mut chunk = 0;
    for layer in 0..shape.layers {
        for kv in 0..2 {
            let mut t = start;
            while t < end {
                let n = layout.run_tokens(t, end);
                let at = layout.offset(shape, layer, kv, t).ok_or_else(|| {
                    Error::InvalidArgument(format!("token {t} of layer {layer} lies past 2^64 bytes of KV memory"))
                })?;
                let run = Run { kv: at, chunk, len: n * row };
                match out.last_mut() {
                    Some(last) if last.kv + last.len == run.kv && last.chunk + last.len == run.chunk => {
                        last.len += run.len
                    }
                    _ => out.push(run),
                }
                chunk += run.len;
                t += n;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SHAPE: KvShape = KvShape { layers: 2, heads: 2, head_dim: 4, elem_bytes: 2 };

    #[test]
    fn a_contiguous_chunk_is_one_run_per_layer_and_kv() {
        let layout = KvLayout::Contiguous { tokens: 10 };
        let r = runs(&SHAPE, &layout, 4, 3).unwrap();
        let row = SHAPE.row_bytes();
        assert_eq!(r.len(), 4);
        assert_eq!(r[0], Run { kv: 4 * row, chunk: 0, len: 3 * row });
        assert_eq!(r[1], Run { kv: (10 + 4) * row, chunk: 3 * row, len: 3 * row });
        assert_eq!(r[3].chunk + r[3].len, SHAPE.chunk_bytes(3));
        // The whole memory is one run.
        assert_eq!(runs(&SHAPE, &layout, 0, 10).unwrap().len(), 1);
    }

    #[test]
    fn paged_runs_follow_the_block_table() {
        let layout = KvLayout::Paged { block_size: 4, num_blocks: 8, block_table: vec![5, 2, 3] };
        let r = runs(&SHAPE, &layout, 2, 8).unwrap();
        let row = SHAPE.row_bytes();
        // Layer 0 keys: tokens 2..4 in block 5, 4..8 in block 2 and 8..10 in block 3,
        // which follows block 2 in memory: two runs.
        assert_eq!(r[0], Run { kv: (5 * 4 + 2) * row, chunk: 0, len: 2 * row });
        assert_eq!(r[1], Run { kv: (2 * 4) * row, chunk: 2 * row, len: 6 * row });
        // Layer 0 values are in the next plane of 8 blocks.
        assert_eq!(r[2].kv, (8 * 4 + 5 * 4 + 2) * row);
        assert!(runs(&SHAPE, &layout, 2, 11).unwrap_err().to_string().contains("do not fit"));
        let bad = KvLayout::Paged { block_size: 4, num_blocks: 2, block_table: vec![2] };
        assert!(runs(&SHAPE, &bad, 0, 1).unwrap_err().to_string().contains("names block 2"));
        assert!(runs(&KvShape { heads: 0, ..SHAPE }, &layout, 0, 1).is_err());
    }

    #[test]
    fn a_block_named_twice_is_refused() {
        let twice = KvLayout::Paged { block_size: 4, num_blocks: 8, block_table: vec![5, 2, 5] };
        let e = twice.validate(12).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("block 5 twice"), "{e}");
        assert!(runs(&SHAPE, &twice, 8, 4).is_err(), "also where the chunk does not reach the first one");
    }

    #[test]
    fn padding_past_the_blocks_the_tokens_fill_is_not_looked_at() {
        // A row of an engine's block table, padded with block 0 (and junk) to its width.
        let padded = KvLayout::Paged { block_size: 4, num_blocks: 8, block_table: vec![7, 3, 0, 0, 99] };
        padded.validate(8).unwrap();
        assert_eq!(
            runs(&SHAPE, &padded, 0, 8).unwrap(),
            runs(&SHAPE, &KvLayout::Paged { block_size: 4, num_blocks: 8, block_table: vec![7, 3] }, 0, 8).unwrap()
        );
        // Tokens that reach the padding see it checked.
        assert!(padded.validate(13).unwrap_err().to_string().contains("block 0 twice"));
        assert!(padded.validate(17).is_err());
    }

    #[test]
    fn sizes_past_64_bits_are_errors_not_wrapped_offsets() {
        let wide = KvLayout::Paged { block_size: 1 << 62, num_blocks: 8, block_table: vec![0, 1, 2, 3, 4] };
        assert!(matches!(wide.capacity(), Err(Error::InvalidArgument(_))));
        // Capacity fits, bytes do not: every run of the memory would be past 2^64.
        let deep = KvLayout::Paged { block_size: 1 << 40, num_blocks: 1 << 20, block_table: vec![(1 << 20) - 1] };
        assert_eq!(deep.capacity().unwrap(), 1 << 40);
        let e = runs(&SHAPE, &deep, (1 << 40) - 1, 1).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("2^64"), "{e}");
        assert_eq!(deep.offset(&SHAPE, 1, 1, (1 << 40) - 1), None);
    }

    proptest! {
        /// Every byte of the chunk comes from the byte the layout's own formula names,
        /// and no two runs overlap in the KV memory.
        #[test]
        fn runs_cover_the_chunk_exactly(
            block_size in 1u64..6,
            blocks in Just((0u64..12).collect::<Vec<_>>()).prop_shuffle(),
            used in 1usize..8, a in 0u64..1000, b in 0u64..1000,
        ) {
            let block_table = blocks[..used].to_vec();
            let layout = KvLayout::Paged { block_size, num_blocks: 12, block_table };
            let shape = KvShape { layers: 2, heads: 1, head_dim: 1, elem_bytes: 1 };
            let capacity = layout.capacity().unwrap();
            let start = a % capacity;
            let tokens = 1 + b % (capacity - start);
            let r = runs(&shape, &layout, start, tokens).unwrap();
            let mut covered = 0;
            let mut kv_bytes = std::collections::BTreeSet::new();
            for run in &r {
                prop_assert_eq!(run.chunk, covered);
                covered += run.len;
                for i in 0..run.len {
                    prop_assert!(kv_bytes.insert(run.kv + i));
                }
            }
            prop_assert_eq!(covered, shape.chunk_bytes(tokens));
            // Chunk byte c is (plane, token) = (c / tokens, start + c % tokens).
            for run in &r {
                for i in 0..run.len {
                    let c = run.chunk + i;
                    let (plane, t) = (c / tokens, start + c % tokens);
                    let want = layout.offset(&shape, plane / 2, plane % 2, t);
                    prop_assert_eq!(Some(run.kv + i), want);
                }
            }
        }
    }
}
