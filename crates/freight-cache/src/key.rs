//! Chunk keys: a rolling hash of the token prefix.
//!
//! A prompt is cut into chunks of `chunk_tokens` tokens (the last one may be shorter).
//! Chunk `i`'s key hashes its own tokens seeded with chunk `i-1`'s key, so it names the
//! whole prefix up to its end: two prompts that share a prefix share the keys of the
//! chunks inside it, and no chunk is reused after the prompts part.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of the first chunk (any constant; it keeps an empty prefix from hashing to 0).
const ROOT: u64 = 0x6672_6569_6768_7421;

/// A chunk's key and the tokens it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    pub hash: u64,
    /// First token of the chunk in its prompt.
    pub start: usize,
    /// Tokens in the chunk (`chunk_tokens`, or fewer for the last).
    pub tokens: usize,
}

impl ChunkKey {
    /// The key as the store names it.
    pub fn name(&self) -> String {
        format!("{:016x}", self.hash)
    }

    pub fn end(&self) -> usize {
        self.start + self.tokens
    }
}

/// The keys of `tokens` cut into chunks of `chunk_tokens` (which must be at least 1).
pub fn chunk_keys(tokens: &[u32], chunk_tokens: usize) -> Vec<ChunkKey> {
    assert!(chunk_tokens > 0, "chunks hold at least one token");
    let mut seed = ROOT;
    tokens
        .chunks(chunk_tokens)
        .enumerate()
        .map(|(i, chunk)| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            seed = xxh3_64_with_seed(&bytes, seed);
            ChunkKey { hash: seed, start: i * chunk_tokens, tokens: chunk.len() }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_keys_and_nothing_after() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[70] = 9999;
        let (ka, kb) = (chunk_keys(&a, 16), chunk_keys(&b, 16));
        assert_eq!(ka.len(), 7);
        assert_eq!(ka.last().unwrap().tokens, 4);
        assert_eq!(ka[..4], kb[..4], "chunks 0..4 end before token 70");
        assert!(ka[4..].iter().zip(&kb[4..]).all(|(x, y)| x.hash != y.hash), "a change reaches every later chunk");
        // A chunk's key depends on what came before it, not only on its own tokens.
        let shifted: Vec<u32> = (16..32).chain(0..16).collect();
        assert_ne!(chunk_keys(&shifted, 16)[1].hash, chunk_keys(&a, 16)[0].hash);
        // A partial last chunk differs from the full chunk that extends it.
        assert_ne!(chunk_keys(&a[..20], 16)[1].hash, chunk_keys(&a[..32], 16)[1].hash);
        assert!(chunk_keys(&[], 16).is_empty());
        assert_eq!(ka[1].name().len(), 16);
    }
}
