//! Block hashing: vLLM's four chained block-hash algorithms and kvstream's `native` one.
//!
//! `block_hash[i] = H(serialize((block_hash[i-1], tuple(block i), extra_keys[i])))`, with
//! `serialize` pickle (protocol 5) or canonical CBOR and `H` SHA-256 or xxh3_128; `native`
//! is `xxh3_128(parent ‖ uint32-LE tokens [‖ CBOR of the extra keys])`. One call hashes a
//! whole chain of blocks (a prompt, or the blocks a decode step completed).
//!
//! The Python layer (`kvstream.hashing.blocks`) owns the API, the seeds and the extra-key
//! rules; it calls [`hash_chain`] with the token list and, per block, the extra-key tuple.
//! Inputs the encoders do not reproduce exactly (an int subclass, numpy ints, a str with
//! lone surrogates, CBOR floats, a pickle frame of 64 KiB or more...) make the call return
//! `None`, and the Python layer hashes them with `pickle`/`cbor2` itself, as vLLM does.

pub mod cbor;
pub mod pickle;
pub mod value;

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::error::{Error, Result};
use value::{BigInt, Value};

/// An input the exact encoders do not cover; the Python layer serializes it instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsupported;

/// The block hash algorithms, by the codes the Python layer passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// `sha256`: SHA-256 of the pickle.
    Sha256,
    /// `sha256_cbor`: SHA-256 of the canonical CBOR.
    Sha256Cbor,
    /// `xxhash`: xxh3_128 of the pickle.
    Xxhash,
    /// `xxhash_cbor`: xxh3_128 of the canonical CBOR.
    XxhashCbor,
    /// `native`: xxh3_128 of parent ‖ uint32-LE tokens (kvstream only).
    Native,
}

impl Algorithm {
    /// The algorithm with code `code` (0..=4, in the order of the variants).
    pub fn from_code(code: u8) -> Result<Algorithm> {
        Ok(match code {
            0 => Algorithm::Sha256,
            1 => Algorithm::Sha256Cbor,
            2 => Algorithm::Xxhash,
            3 => Algorithm::XxhashCbor,
            4 => Algorithm::Native,
            _ => {
                return Err(Error::Local(format!(
                    "unknown block hash algorithm code {code}; use 0..=4"
                )))
            }
        })
    }

    /// Bytes per digest.
    pub fn digest_size(self) -> usize {
        match self {
            Algorithm::Sha256 | Algorithm::Sha256Cbor => 32,
            _ => 16,
        }
    }

    /// The digest of `data` in the first [`Algorithm::digest_size`] bytes.
    #[inline]
    fn digest(self, data: &[u8]) -> [u8; 32] {
        let mut d = [0u8; 32];
        match self {
            Algorithm::Sha256 | Algorithm::Sha256Cbor => d.copy_from_slice(&Sha256::digest(data)),
            _ => d[..16].copy_from_slice(&xxh3_128(data).to_be_bytes()),
        }
        d
    }
}

/// Token ids copied out of Python: plain ints (the usual case), or any supported values.
#[derive(Debug, Clone, PartialEq)]
pub enum Tokens {
    /// Every id an exact int that fits `i64`.
    Ints(Vec<i64>),
    /// Some id a bool, a bigger int or another supported value.
    Values(Vec<Value>),
}

/// One block's ids.
#[derive(Debug, Clone, Copy)]
pub enum TokenSlice<'a> {
    /// Plain ints.
    Ints(&'a [i64]),
    /// Any supported values.
    Values(&'a [Value]),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Ints(v) => v.len(),
            Tokens::Values(v) => v.len(),
        }
    }

    fn block(&self, start: usize, end: usize) -> TokenSlice<'_> {
        match self {
            Tokens::Ints(v) => TokenSlice::Ints(&v[start..end]),
            Tokens::Values(v) => TokenSlice::Values(&v[start..end]),
        }
    }
}

/// The chained digests of `n_blocks` blocks of `block_size` tokens, back to back.
///
/// `parent` is the hash before block 0 (the root, or the previous block's digest), with
/// `parent_id` its Python address (pickle's memo). `extras`, when given, has one entry per
/// block. Returns `n_blocks * digest_size` bytes.
pub fn chain(
    algorithm: Algorithm,
    block_size: usize,
    parent: &[u8],
    parent_id: Option<usize>,
    tokens: &Tokens,
    n_blocks: usize,
    extras: Option<&[Option<Value>]>,
) -> std::result::Result<Vec<u8>, Unsupported> {
    let dsize = algorithm.digest_size();
    let needed = n_blocks.checked_mul(block_size).ok_or(Unsupported)?;
    if block_size == 0 || tokens.len() < needed || extras.is_some_and(|e| e.len() != n_blocks) {
        return Err(Unsupported);
    }
    let mut out = Vec::with_capacity(n_blocks * dsize);
    let mut buf = Vec::with_capacity(64 + parent.len() + 9 * block_size);
    for i in 0..n_blocks {
        let prev: &[u8] = if i == 0 {
            parent
        } else {
            &out[(i - 1) * dsize..i * dsize]
        };
        let block = tokens.block(i * block_size, (i + 1) * block_size);
        let extra = extras.and_then(|e| e[i].as_ref());
        match algorithm {
            Algorithm::Sha256 | Algorithm::Xxhash => pickle::block_input(
                &mut buf,
                prev,
                if i == 0 { parent_id } else { None },
                block,
                extra,
            )?,
            Algorithm::Sha256Cbor | Algorithm::XxhashCbor => {
                cbor::block_input(&mut buf, prev, block, extra)?
            }
            Algorithm::Native => native_input(&mut buf, prev, block, extra)?,
        }
        // `prev` borrows `out`; the digest is appended after the borrow ends.
        let digest = algorithm.digest(&buf);
        out.extend_from_slice(&digest[..dsize]);
    }
    Ok(out)
}

/// `parent ‖ uint32-LE tokens [‖ canonical CBOR of the extra keys]`.
fn native_input(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: TokenSlice<'_>,
    extra: Option<&Value>,
) -> std::result::Result<(), Unsupported> {
    let TokenSlice::Ints(ids) = tokens else {
        return Err(Unsupported);
    };
    out.clear();
    out.extend_from_slice(parent);
    for &t in ids {
        out.extend_from_slice(&u32::try_from(t).map_err(|_| Unsupported)?.to_le_bytes());
    }
    if let Some(v) = extra {
        cbor::write_value(out, v)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Copying inputs out of Python.

/// Deeper extra keys than this are left to Python (which has its own recursion limit).
const MAX_DEPTH: u32 = 64;

/// Chains of at least this many tokens are hashed with the GIL released.
const DETACH_MIN_TOKENS: usize = 2048;

/// An exact int: `Int` when it fits `i64`, `Big` otherwise.
fn extract_int(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    if let Ok(v) = obj.extract::<i64>() {
        return Ok(Value::Int(v));
    }
    if let Ok(v) = obj.extract::<i128>() {
        return Ok(Value::Big(BigInt::from_i128(v)));
    }
    let negative = obj.lt(0)?;
    let magnitude = obj.call_method0("__abs__")?;
    let bits: usize = magnitude.call_method0("bit_length")?.extract()?;
    let raw = magnitude.call_method1("to_bytes", (bits.div_ceil(8), "big"))?;
    let raw = raw.cast::<PyBytes>().map_err(PyErr::from)?;
    Ok(Value::Big(BigInt {
        negative,
        magnitude: raw.as_bytes().to_vec(),
    }))
}

/// A supported value, or None when pickle/cbor2 must handle it in Python.
fn extract_value(obj: &Bound<'_, PyAny>, depth: u32) -> PyResult<Option<Value>> {
    if depth > MAX_DEPTH {
        return Ok(None);
    }
    if obj.is_none() {
        return Ok(Some(Value::None));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return extract_int(obj).map(Some);
    }
    if let Ok(b) = obj.cast_exact::<PyBool>() {
        return Ok(Some(Value::Bool(b.is_true())));
    }
    let id = obj.as_ptr() as usize;
    if let Ok(s) = obj.cast_exact::<PyString>() {
        // A str with lone surrogates has no UTF-8 form; pickle writes it with surrogatepass.
        return Ok(s.to_str().ok().map(|t| Value::Str {
            id,
            data: t.as_bytes().to_vec(),
        }));
    }
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return Ok(Some(Value::Bytes {
            id,
            data: b.as_bytes().to_vec(),
        }));
    }
    if let Ok(f) = obj.cast_exact::<PyFloat>() {
        return Ok(Some(Value::Float(f.value())));
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        let mut items = Vec::with_capacity(t.len());
        for item in t.iter() {
            match extract_value(&item, depth + 1)? {
                Some(v) => items.push(v),
                None => return Ok(None),
            }
        }
        return Ok(Some(Value::Tuple { id, items }));
    }
    if let Ok(l) = obj.cast_exact::<PyList>() {
        let mut items = Vec::with_capacity(l.len());
        for item in l.iter() {
            match extract_value(&item, depth + 1)? {
                Some(v) => items.push(v),
                None => return Ok(None),
            }
        }
        return Ok(Some(Value::List { id, items }));
    }
    Ok(None)
}

/// A list's or tuple's items as a tuple (a list is copied: one C call), None for others.
///
/// Items of a tuple are read borrowed (no reference counting per item), which is most of
/// the cost of reading a prompt's ids out of Python.
pub(crate) fn as_tuple<'py>(seq: &Bound<'py, PyAny>) -> Option<Bound<'py, PyTuple>> {
    if let Ok(t) = seq.cast_exact::<PyTuple>() {
        return Some(t.clone());
    }
    seq.cast_exact::<PyList>().ok().map(|l| l.to_tuple())
}

/// The first `count` token ids of a list or tuple: plain ints while they last, values
/// after; None for any other container or an id only Python can serialize.
fn extract_tokens(tokens: &Bound<'_, PyAny>, count: usize) -> PyResult<Option<Tokens>> {
    let Some(tuple) = as_tuple(tokens) else {
        return Ok(None);
    };
    if tuple.len() < count {
        return Err(Error::Local(format!(
            "{count} token ids to hash but the sequence holds {}; pass n_blocks * block_size ids or more",
            tuple.len()
        ))
        .into());
    }
    let mut ints = Vec::with_capacity(count);
    let mut i = 0;
    while i < count {
        let item = tuple.get_borrowed_item(i)?;
        if !item.is_exact_instance_of::<PyInt>() {
            break;
        }
        match item.extract::<i64>() {
            Ok(v) => ints.push(v),
            Err(_) => break,
        }
        i += 1;
    }
    if i == count {
        return Ok(Some(Tokens::Ints(ints)));
    }
    let mut values: Vec<Value> = ints.into_iter().map(Value::Int).collect();
    values.reserve(count - i);
    for j in i..count {
        match extract_value(&tuple.get_borrowed_item(j)?.to_owned(), 1)? {
            Some(v) => values.push(v),
            None => return Ok(None),
        }
    }
    Ok(Some(Tokens::Values(values)))
}

/// Per-block extra keys: each entry None or a supported value; None if any is not.
fn extract_extras(
    extras: &Bound<'_, PyAny>,
    n_blocks: usize,
) -> PyResult<Option<Vec<Option<Value>>>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = extras.cast_exact::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = extras.cast_exact::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(
            Error::Local("extras must be a list or tuple with one entry per block".into()).into(),
        );
    };
    if items.len() != n_blocks {
        return Err(Error::Local(format!(
            "extras has {} entries for {n_blocks} blocks",
            items.len()
        ))
        .into());
    }
    let mut out = Vec::with_capacity(n_blocks);
    for item in &items {
        if item.is_none() {
            out.push(None);
            continue;
        }
        match extract_value(item, 1)? {
            Some(v) => out.push(Some(v)),
            None => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// Run `f`, turning a Rust panic into the crate's typed error (never a PanicException).
pub(crate) fn guard<T>(f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Error::Local(format!(
            "internal error in kvstream's native core ({what}); please report it"
        ))
    })
}

/// Hash a chain of blocks: `list[bytes]` (one digest per block), or None when an input
/// needs Python's own serializer.
///
/// `algorithm`: 0 `sha256`, 1 `sha256_cbor`, 2 `xxhash`, 3 `xxhash_cbor`, 4 `native`.
/// `tokens`: a list or tuple holding at least `n_blocks * block_size` ids (only those are
/// read). `parent`: the hash before the first block. `extras`: None, or one entry (None or
/// a tuple) per block.
#[pyfunction]
#[pyo3(signature = (algorithm, block_size, parent, tokens, n_blocks, extras=None))]
pub fn hash_chain<'py>(
    py: Python<'py>,
    algorithm: u8,
    block_size: usize,
    parent: &Bound<'py, PyBytes>,
    tokens: &Bound<'py, PyAny>,
    n_blocks: usize,
    extras: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let algorithm = Algorithm::from_code(algorithm)?;
    if block_size == 0 {
        return Err(Error::Local("block_size must be > 0 (tokens per block)".into()).into());
    }
    let count = n_blocks.checked_mul(block_size).ok_or_else(|| {
        Error::Local(format!("{n_blocks} blocks of {block_size} tokens overflow"))
    })?;
    let Some(ids) = extract_tokens(tokens, count)? else {
        return Ok(None);
    };
    let extras = match extras {
        None => None,
        Some(e) if e.is_none() => None,
        Some(e) => match extract_extras(e, n_blocks)? {
            Some(v) => Some(v),
            None => return Ok(None),
        },
    };
    let parent_bytes = parent.as_bytes();
    let parent_id = Some(parent.as_ptr() as usize);
    let work = || {
        guard(|| {
            chain(
                algorithm,
                block_size,
                parent_bytes,
                parent_id,
                &ids,
                n_blocks,
                extras.as_deref(),
            )
        })
    };
    let result = if count >= DETACH_MIN_TOKENS {
        py.detach(work)
    } else {
        work()
    };
    let Ok(digests) = result? else {
        return Ok(None);
    };
    let dsize = algorithm.digest_size();
    PyList::new(py, digests.chunks_exact(dsize).map(|d| PyBytes::new(py, d))).map(Some)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_chain, m)?)?;
    Ok(())
}

/// Token ids for the encoders' tests: every width boundary of both formats, then 2,000
/// seeded values of every magnitude.
#[cfg(test)]
pub(crate) fn sample_ids() -> Vec<i64> {
    let mut vals: Vec<i64> = vec![
        0, 1, 23, 24, 255, 256, 65535, 65536, -1, -24, -25, -256, -257,
    ];
    vals.extend([
        i32::MAX as i64,
        i32::MIN as i64,
        1 << 31,
        -(1 << 31) - 1,
        1 << 32,
        i64::MAX,
        i64::MIN,
    ]);
    let mut x: u64 = 7;
    for _ in 0..2000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        vals.push((x as i64) >> (x % 64));
    }
    vals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_cbor_matches_the_golden_readme_vector() {
        // ../shared/golden/vllm-0.33.0: NONE_HASH for seed "vllm-none-hash", block 0 of
        // tokens 1..=16 -> int64 8866452693264111234 (last 8 digest bytes, big-endian).
        let root = {
            let mut seed = Vec::new();
            cbor::write_value(
                &mut seed,
                &Value::Str {
                    id: 0,
                    data: b"vllm-none-hash".to_vec(),
                },
            )
            .unwrap();
            Sha256::digest(&seed).to_vec()
        };
        assert_eq!(
            hex(&root),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        let tokens = Tokens::Ints((1..=16).collect());
        let d = chain(Algorithm::Sha256Cbor, 16, &root, None, &tokens, 1, None).unwrap();
        assert_eq!(
            u64::from_be_bytes(d[24..32].try_into().unwrap()),
            8866452693264111234
        );
    }

    #[test]
    fn blocks_chain_on_the_previous_digest() {
        let tokens = Tokens::Ints((0..8).collect());
        for algorithm in [
            Algorithm::Sha256,
            Algorithm::Sha256Cbor,
            Algorithm::Xxhash,
            Algorithm::XxhashCbor,
            Algorithm::Native,
        ] {
            let both = chain(algorithm, 4, b"root", None, &tokens, 2, None).unwrap();
            let d = algorithm.digest_size();
            let first = chain(
                algorithm,
                4,
                b"root",
                None,
                &Tokens::Ints((0..4).collect()),
                1,
                None,
            )
            .unwrap();
            let second = chain(
                algorithm,
                4,
                &first,
                None,
                &Tokens::Ints((4..8).collect()),
                1,
                None,
            )
            .unwrap();
            assert_eq!(both.len(), 2 * d);
            assert_eq!(&both[..d], &first[..]);
            assert_eq!(&both[d..], &second[..]);
        }
    }

    #[test]
    fn native_refuses_ids_outside_uint32() {
        let tokens = Tokens::Ints(vec![1, 1 << 32]);
        assert_eq!(
            chain(Algorithm::Native, 2, b"r", None, &tokens, 1, None),
            Err(Unsupported)
        );
        let tokens = Tokens::Ints(vec![1, -1]);
        assert_eq!(
            chain(Algorithm::Native, 2, b"r", None, &tokens, 1, None),
            Err(Unsupported)
        );
    }

    #[test]
    fn short_token_lists_and_bad_extras_are_refused_not_panics() {
        let tokens = Tokens::Ints(vec![1, 2, 3]);
        assert_eq!(
            chain(Algorithm::Sha256, 2, b"r", None, &tokens, 2, None),
            Err(Unsupported)
        );
        assert_eq!(
            chain(Algorithm::Sha256, 0, b"r", None, &tokens, 1, None),
            Err(Unsupported)
        );
        assert_eq!(
            chain(Algorithm::Sha256, 1, b"r", None, &tokens, 2, Some(&[None])),
            Err(Unsupported)
        );
        assert_eq!(
            chain(Algorithm::Sha256, usize::MAX, b"r", None, &tokens, 2, None),
            Err(Unsupported)
        );
    }

    #[test]
    fn a_panic_becomes_a_local_error() {
        let e = guard(|| -> u8 { panic!("boom") }).unwrap_err();
        assert!(matches!(e, Error::Local(m) if m.contains("boom")));
    }
}
