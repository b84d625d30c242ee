//! Router keys: kvstream's own chained block keys over packed token ids.
//!
//! `key[i] = xxh3_64(uint32-LE ids of router block i ‖ extra bytes of block i, seed=key[i-1])
//! & KEY_MASK`, with `key[-1]` the namespace. The Python layer (`kvstream.routing.keys`)
//! owns the namespace and the multimodal extra bytes; this module does the per-block loop
//! of a whole prompt in one call, and packs token lists into uint32-LE bytes. It is the one
//! router-key implementation: the table's ingest and the query path chain through
//! [`chain_into`] too.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyInt};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{Error, Result};
use crate::hash::{as_tuple, guard};

/// Router keys are ints in `[0, 2**60)`.
pub const KEY_MASK: u64 = (1 << 60) - 1;

/// Chains of at least this many tokens are keyed with the GIL released.
const DETACH_MIN_TOKENS: usize = 1 << 16;

/// The chained keys of `n_blocks` blocks of `block_size` ids packed in `raw`.
///
/// `extras`, when given, has one entry per block (bytes appended to that block's ids).
pub fn chain(
    raw: &[u8],
    n_blocks: usize,
    block_size: usize,
    seed: u64,
    extras: Option<&[Option<Vec<u8>>]>,
) -> Result<Vec<u64>> {
    let step = block_size
        .checked_mul(4)
        .ok_or_else(|| Error::Local(format!("router_block_size {block_size} is too large")))?;
    let needed = n_blocks.checked_mul(step).ok_or_else(|| {
        Error::Local(format!(
            "{n_blocks} router blocks of {block_size} tokens overflow"
        ))
    })?;
    if block_size == 0 {
        return Err(Error::Local(
            "router_block_size must be > 0 (tokens)".into(),
        ));
    }
    if raw.len() < needed {
        return Err(Error::Local(format!(
            "packed tokens hold {} ids, {n_blocks} router blocks of {block_size} need {}; pack at least that many",
            raw.len() / 4,
            n_blocks * block_size
        )));
    }
    if let Some(e) = extras {
        if e.len() < n_blocks {
            return Err(Error::Local(format!(
                "extras has {} entries for {n_blocks} router blocks; give one per block",
                e.len()
            )));
        }
    }
    let mut keys = Vec::with_capacity(n_blocks);
    chain_packed(&raw[..needed], block_size, seed, extras, &mut keys);
    Ok(keys)
}

/// The one router-key loop: the keys of the full blocks of `block_size` ids packed
/// (uint32-LE) in `raw`, chained from `seed`, appended to `out`; a partial tail block is
/// ignored. `extras` (when given, at least one entry per full block) are appended to
/// their block's bytes before it is hashed.
fn chain_packed(
    raw: &[u8],
    block_size: usize,
    seed: u64,
    extras: Option<&[Option<Vec<u8>>]>,
    out: &mut Vec<u64>,
) {
    let step = 4 * block_size;
    let mut k = seed;
    let mut buf = Vec::new();
    for (i, block) in raw.chunks_exact(step).enumerate() {
        let extra = extras
            .and_then(|e| e.get(i))
            .and_then(|x| x.as_deref())
            .filter(|x| !x.is_empty());
        k = match extra {
            None => xxh3_64_with_seed(block, k),
            Some(x) => {
                buf.clear();
                buf.extend_from_slice(block);
                buf.extend_from_slice(x);
                xxh3_64_with_seed(&buf, k)
            }
        } & KEY_MASK;
        out.push(k);
    }
}

/// The chained keys of the full router blocks of `tokens` (`r` tokens each), from `seed`,
/// appended to `out` (no extras: the table's ingest and the query path). A partial tail
/// block is ignored; `r == 0` keys nothing.
pub fn chain_into(tokens: &[u32], r: usize, seed: u64, out: &mut Vec<u64>) {
    if r == 0 {
        return;
    }
    let n = tokens.len() / r * r;
    out.reserve(n / r);
    if cfg!(target_endian = "little") {
        // The ids' own bytes are their uint32-LE packing: no copy.
        chain_packed(bytemuck::cast_slice(&tokens[..n]), r, seed, None, out);
    } else {
        let raw: Vec<u8> = tokens[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
        chain_packed(&raw, r, seed, None, out);
    }
}

/// [`chain_into`] into a new vector.
pub fn chain_tokens(tokens: &[u32], r: usize, seed: u64) -> Vec<u64> {
    let mut out = Vec::new();
    chain_into(tokens, r, seed, &mut out);
    out
}

/// The first `count` ids of a list or tuple as uint32-LE bytes; None when an id is not an
/// exact int in `[0, 2**32)` or the container is neither (the Python layer then decides).
fn pack(tokens: &Bound<'_, PyAny>, count: Option<usize>) -> PyResult<Option<Vec<u8>>> {
    let Some(tuple) = as_tuple(tokens) else {
        return Ok(None);
    };
    let n = count.unwrap_or(tuple.len()).min(tuple.len());
    let mut out = Vec::with_capacity(4 * n);
    for i in 0..n {
        let item = tuple.get_borrowed_item(i)?;
        if !item.is_exact_instance_of::<PyInt>() {
            return Ok(None);
        }
        match item.extract::<u32>() {
            Ok(v) => out.extend_from_slice(&v.to_le_bytes()),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(out))
}

fn extract_extras(extras: &Bound<'_, PyAny>) -> PyResult<Vec<Option<Vec<u8>>>> {
    let mut out = Vec::new();
    for item in extras.try_iter()? {
        let item = item?;
        if item.is_none() {
            out.push(None);
        } else if let Ok(b) = item.cast::<PyBytes>() {
            out.push(Some(b.as_bytes().to_vec()));
        } else if let Ok(b) = item.cast::<PyByteArray>() {
            out.push(Some(b.to_vec()));
        } else {
            return Err(Error::Local(format!(
                "router key extras must be bytes or None per block, got {}",
                item.get_type().name()?
            ))
            .into());
        }
    }
    Ok(out)
}

fn run_chain(
    py: Python<'_>,
    raw: &[u8],
    n_blocks: usize,
    block_size: usize,
    seed: u64,
    extras: Option<Vec<Option<Vec<u8>>>>,
) -> PyResult<Vec<u64>> {
    let work = || guard(|| chain(raw, n_blocks, block_size, seed, extras.as_deref()));
    let keys = if n_blocks.saturating_mul(block_size) >= DETACH_MIN_TOKENS {
        py.detach(work)
    } else {
        work()
    };
    Ok(keys??)
}

/// `chain_keys` of `kvstream.routing.keys`: the keys of `n_blocks` router blocks of `raw`.
#[pyfunction]
#[pyo3(signature = (raw, n_blocks, router_block_size, seed, extras=None))]
pub fn router_chain_keys(
    py: Python<'_>,
    raw: &Bound<'_, PyBytes>,
    n_blocks: usize,
    router_block_size: usize,
    seed: u64,
    extras: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let extras = match extras {
        Some(e) if !e.is_none() => Some(extract_extras(e)?),
        _ => None,
    };
    run_chain(
        py,
        raw.as_bytes(),
        n_blocks,
        router_block_size,
        seed,
        extras,
    )
}

/// The keys of every full router block of a token list or tuple, or None when an id is
/// not an exact int in `[0, 2**32)` (the Python layer then packs it, or says why not).
#[pyfunction]
#[pyo3(signature = (tokens, router_block_size, seed, extras=None))]
pub fn router_prompt_keys(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    router_block_size: usize,
    seed: u64,
    extras: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<u64>>> {
    if router_block_size == 0 {
        return Err(Error::Local("router_block_size must be > 0 (tokens)".into()).into());
    }
    let extras = extras
        .filter(|e| !e.is_none())
        .map(extract_extras)
        .transpose()?;
    if let Ok(b) = tokens.cast_exact::<PyBytes>() {
        // Already packed (uint32-LE): 4 bytes an id.
        let n_blocks = b.as_bytes().len() / 4 / router_block_size;
        return run_chain(py, b.as_bytes(), n_blocks, router_block_size, seed, extras).map(Some);
    }
    let n_blocks = tokens.len()? / router_block_size;
    let Some(raw) = pack(tokens, Some(n_blocks * router_block_size))? else {
        return Ok(None);
    };
    run_chain(py, &raw, n_blocks, router_block_size, seed, extras).map(Some)
}

/// Token ids as uint32-LE bytes, or None when an id is not an exact int in `[0, 2**32)`.
#[pyfunction]
pub fn router_pack_tokens<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    Ok(pack(tokens, None)?.map(|raw| PyBytes::new(py, &raw)))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ROUTER_KEY_MASK", KEY_MASK)?;
    m.add_function(wrap_pyfunction!(router_chain_keys, m)?)?;
    m.add_function(wrap_pyfunction!(router_prompt_keys, m)?)?;
    m.add_function(wrap_pyfunction!(router_pack_tokens, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn each_key_seeds_the_next_and_is_masked() {
        let raw = packed(&[1, 2, 3, 4, 5, 6]);
        let keys = chain(&raw, 3, 2, 7, None).unwrap();
        let k0 = xxh3_64_with_seed(&raw[..8], 7) & KEY_MASK;
        let k1 = xxh3_64_with_seed(&raw[8..16], k0) & KEY_MASK;
        assert_eq!(&keys[..2], &[k0, k1]);
        assert!(keys.iter().all(|&k| k <= KEY_MASK));
    }

    #[test]
    fn extras_are_appended_to_their_block() {
        let raw = packed(&[1, 2, 3, 4]);
        let extras = vec![None, Some(b"mm".to_vec())];
        let keys = chain(&raw, 2, 2, 0, Some(&extras)).unwrap();
        let mut data = raw[8..16].to_vec();
        data.extend_from_slice(b"mm");
        assert_eq!(keys[1], xxh3_64_with_seed(&data, keys[0]) & KEY_MASK);
        assert_eq!(keys[0], chain(&raw, 1, 2, 0, None).unwrap()[0]);
    }

    #[test]
    fn short_input_is_a_local_error() {
        let raw = packed(&[1, 2, 3]);
        assert!(matches!(chain(&raw, 2, 2, 0, None), Err(Error::Local(_))));
        assert!(matches!(chain(&raw, 1, 0, 0, None), Err(Error::Local(_))));
        assert!(matches!(
            chain(&raw, 1, 2, 0, Some(&[])),
            Err(Error::Local(_))
        ));
        assert!(matches!(
            chain(&raw, usize::MAX, 2, 0, None),
            Err(Error::Local(_))
        ));
    }

    #[test]
    fn token_slices_key_like_their_packing_and_a_tail_is_ignored() {
        let toks: Vec<u32> = (0..40).collect();
        let ks = chain_tokens(&toks, 16, 7);
        assert_eq!(ks.len(), 2);
        assert_eq!(ks, chain(&packed(&toks[..32]), 2, 16, 7, None).unwrap());
        assert_eq!(chain_tokens(&toks[16..32], 16, ks[0]), vec![ks[1]]);
        assert!(chain_tokens(&toks, 0, 7).is_empty());
        let big: Vec<u32> = (0..1024).collect();
        assert_eq!(chain_tokens(&big, 512, 1).len(), 2);
    }
}
