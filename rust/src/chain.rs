//! Router key chains, for the table's ingest and the query path.
//!
//! The spec is `kvstream/routing/keys.py` (its docstring; the Python functions are the
//! oracle the tests compare against): `key[i] = xxh3_64(uint32-LE tokens of router block i,
//! seed = key[i-1]) & KEY_MASK`, the chain rooted at a namespace. Only the plain form lives
//! here (no multimodal or digest extras): runs with extras take the Python path.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Router keys are 60-bit.
pub const KEY_MASK: u64 = (1 << 60) - 1;

/// Largest router block this module keys in one stack buffer (tokens).
const STACK_TOKENS: usize = 256;

/// The chained keys of the full router blocks of `tokens` (`r` tokens each), from `seed`,
/// appended to `out`. A partial tail block is ignored.
pub fn chain_into(tokens: &[u32], r: usize, seed: u64, out: &mut Vec<u64>) {
    if r == 0 {
        return;
    }
    let mut k = seed;
    let mut heap = Vec::new();
    let mut stack = [0u8; 4 * STACK_TOKENS];
    for block in tokens.chunks_exact(r) {
        let buf: &mut [u8] = if r <= STACK_TOKENS {
            &mut stack[..4 * r]
        } else {
            heap.resize(4 * r, 0);
            &mut heap[..]
        };
        for (dst, t) in buf.chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        k = xxh3_64_with_seed(buf, k) & KEY_MASK;
        out.push(k);
    }
}

/// [`chain_into`] into a new vector.
pub fn chain(tokens: &[u32], r: usize, seed: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / r.max(1));
    chain_into(tokens, r, seed, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_seeds_the_next_and_a_tail_is_ignored() {
        let toks: Vec<u32> = (0..40).collect();
        let ks = chain(&toks, 16, 7);
        assert_eq!(ks.len(), 2);
        let again = chain(&toks[16..32], 16, ks[0]);
        assert_eq!(again, vec![ks[1]]);
        assert!(ks.iter().all(|k| *k <= KEY_MASK));
    }

    #[test]
    fn large_router_blocks_use_the_heap_buffer() {
        let toks: Vec<u32> = (0..1024).collect();
        assert_eq!(chain(&toks, 512, 1).len(), 2);
    }
}
