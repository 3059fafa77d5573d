//! Chunk keys: a rolling hash of the token prefix.
//!
//! A prompt is cut into chunks of `chunk_tokens` tokens (the last one may be shorter).
//! Chunk `i`'s key hashes chunk `i-1`'s key and its own tokens, so it names the whole
//! prefix up to its end: two prompts that share a prefix share the keys of the chunks
//! inside it, and no chunk is reused after the prompts part.
//!
//! The chain starts from a root ([`root`]) that hashes what else the chunk's bytes
//! depend on: the KV shape, the chunk size and a caller's namespace (model, adapter,
//! TP rank, dtype...). Engines that differ in any of them never share a key, also when
//! they put into one store. Keys are 128 bits, so that a collision, which would hand
//! one prompt another's KV, is not a risk a cache of any size runs.

use xxhash_rust::xxh3::xxh3_128;

use crate::layout::KvShape;

/// Marks the key scheme: a later scheme changes it, so that its keys never meet these.
const SCHEME: &[u8] = b"freight-cache chunk key v2\0";

/// A chunk's key and the tokens it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    pub hash: u128,
    /// First token of the chunk in its prompt.
    pub start: usize,
    /// Tokens in the chunk (`chunk_tokens`, or fewer for the last).
    pub tokens: usize,
}

impl ChunkKey {
    /// The key as the store names it.
    pub fn name(&self) -> String {
        format!("{:032x}", self.hash)
    }

    pub fn end(&self) -> usize {
        self.start + self.tokens
    }

    /// What a chunk put to a remote store carries beside its bytes: its token count
    /// and its whole key, so that the reader can tell an object that is not this
    /// chunk (one put under its name by someone else) from the chunk.
    pub fn meta(&self) -> Vec<u8> {
        let mut meta = Vec::with_capacity(24);
        meta.extend((self.tokens as u64).to_le_bytes());
        meta.extend(self.hash.to_le_bytes());
        meta
    }
}

/// The key a prompt's chunk chain starts from, for chunks of `chunk_tokens` tokens of
/// `shape` in `namespace`.
pub fn root(namespace: &[u8], shape: &KvShape, chunk_tokens: u64) -> u128 {
    let mut bytes = SCHEME.to_vec();
    for n in [shape.layers, shape.heads, shape.head_dim, shape.elem_bytes, chunk_tokens] {
        bytes.extend(n.to_le_bytes());
    }
    // Last, after fields of fixed length: no two namespaces give the same bytes.
    bytes.extend(namespace);
    xxh3_128(&bytes)
}

/// The keys of `tokens` cut into chunks of `chunk_tokens` (which must be at least 1),
/// chained from `root`.
pub fn chunk_keys(root: u128, tokens: &[u32], chunk_tokens: usize) -> Vec<ChunkKey> {
    assert!(chunk_tokens > 0, "chunks hold at least one token");
    let mut prev = root;
    let mut bytes = Vec::with_capacity(16 + 4 * chunk_tokens.min(tokens.len()));
    tokens
        .chunks(chunk_tokens)
        .enumerate()
        .map(|(i, chunk)| {
            bytes.clear();
            bytes.extend(prev.to_le_bytes());
            bytes.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            prev = xxh3_128(&bytes);
            ChunkKey { hash: prev, start: i * chunk_tokens, tokens: chunk.len() }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape { layers: 2, heads: 2, head_dim: 4, elem_bytes: 2 };

    #[test]
    fn shared_prefixes_share_keys_and_nothing_after() {
        let r = root(b"", &SHAPE, 16);
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[70] = 9999;
        let (ka, kb) = (chunk_keys(r, &a, 16), chunk_keys(r, &b, 16));
        assert_eq!(ka.len(), 7);
        assert_eq!(ka.last().unwrap().tokens, 4);
        assert_eq!(ka[..4], kb[..4], "chunks 0..4 end before token 70");
        assert!(ka[4..].iter().zip(&kb[4..]).all(|(x, y)| x.hash != y.hash), "a change reaches every later chunk");
        // A chunk's key depends on what came before it, not only on its own tokens.
        let shifted: Vec<u32> = (16..32).chain(0..16).collect();
        assert_ne!(chunk_keys(r, &shifted, 16)[1].hash, chunk_keys(r, &a, 16)[0].hash);
        // A partial last chunk differs from the full chunk that extends it.
        assert_ne!(chunk_keys(r, &a[..20], 16)[1].hash, chunk_keys(r, &a[..32], 16)[1].hash);
        assert!(chunk_keys(r, &[], 16).is_empty());
        assert_eq!(ka[1].name().len(), 32);
    }

    #[test]
    fn the_namespace_the_shape_and_the_chunk_size_part_every_key() {
        let tokens: Vec<u32> = (0..40).collect();
        let keys = |r: u128, chunk: usize| chunk_keys(r, &tokens, chunk);
        let base = keys(root(b"", &SHAPE, 16), 16);
        let others = [
            keys(root(b"rank1", &SHAPE, 16), 16),
            keys(root(b"rank2", &SHAPE, 16), 16),
            keys(root(b"", &KvShape { elem_bytes: 1, ..SHAPE }, 16), 16),
            keys(root(b"", &KvShape { heads: 1, head_dim: 8, ..SHAPE }, 16), 16),
            keys(root(b"", &SHAPE, 8), 16),
        ];
        for other in &others {
            assert!(base.iter().zip(other).all(|(x, y)| x.hash != y.hash));
        }
        assert_ne!(others[0][0].hash, others[1][0].hash);
        assert_eq!(base, keys(root(b"", &SHAPE, 16), 16), "the same inputs, the same keys");
        let meta = base[2].meta();
        assert_eq!(meta.len(), 24);
        assert_eq!(meta[..8], 8u64.to_le_bytes(), "the last chunk holds 8 tokens");
        assert_ne!(meta, base[1].meta());
    }
}
