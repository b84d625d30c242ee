//! The objects vLLM hashes, copied out of Python so the encoders run without the GIL.
//!
//! A block's hash input is `(parent bytes, tuple of token ids, extra keys or None)`. The
//! extra keys are small trees of str, int, bytes, None, bools and tuples (and, from callers
//! that build their own, lists and floats). [`Value`] holds exactly those; anything else
//! is refused by the extraction (the caller then takes the Python path, which serializes
//! whatever Python can).
//!
//! Pickle's memo is keyed by object identity, so every value that pickle memoizes (str,
//! bytes, tuple, list) keeps the address of the Python object it came from: two references
//! to one object within one block's input pickle as one object and a `BINGET`.

/// An integer outside `i64`: its sign and its magnitude, big-endian, without leading zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BigInt {
    /// True for a negative number.
    pub negative: bool,
    /// `abs(n)` big-endian, no leading zero bytes (never empty: 0 fits `i64`).
    pub magnitude: Vec<u8>,
}

/// One object of a block hash input.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False` (pickle and CBOR both encode them apart from ints).
    Bool(bool),
    /// An exact `int` that fits `i64`.
    Int(i64),
    /// An exact `int` outside `i64`.
    Big(BigInt),
    /// An exact `float` (pickle only; canonical CBOR floats are left to cbor2).
    Float(f64),
    /// An exact `bytes` object (id: the Python object's address, for pickle's memo).
    Bytes { id: usize, data: Vec<u8> },
    /// An exact `str` as UTF-8 (no lone surrogates: those are left to Python).
    Str { id: usize, data: Vec<u8> },
    /// An exact `tuple`.
    Tuple { id: usize, items: Vec<Value> },
    /// An exact `list`.
    List { id: usize, items: Vec<Value> },
}

impl BigInt {
    /// The magnitude of `n` for an `n` that is known not to fit `i64`, from `i128`.
    pub fn from_i128(n: i128) -> BigInt {
        let magnitude = n.unsigned_abs().to_be_bytes();
        let first = magnitude
            .iter()
            .position(|&b| b != 0)
            .unwrap_or(magnitude.len() - 1);
        BigInt {
            negative: n < 0,
            magnitude: magnitude[first..].to_vec(),
        }
    }
}

/// Strip leading zero bytes of a big-endian number (keeps at least one byte).
pub(crate) fn trim_be(bytes: &[u8]) -> &[u8] {
    let first = bytes
        .iter()
        .position(|&b| b != 0)
        .unwrap_or(bytes.len().saturating_sub(1));
    &bytes[first..]
}

/// `magnitude - 1` for a big-endian magnitude >= 1, leading zeros stripped.
pub(crate) fn decrement_be(magnitude: &[u8]) -> Vec<u8> {
    let mut out = magnitude.to_vec();
    for b in out.iter_mut().rev() {
        if *b == 0 {
            *b = 0xff;
        } else {
            *b -= 1;
            break;
        }
    }
    trim_be(&out).to_vec()
}

/// If a big-endian number fits `u64`, that number.
pub(crate) fn be_to_u64(bytes: &[u8]) -> Option<u64> {
    let bytes = trim_be(bytes);
    if bytes.len() > 8 {
        return None;
    }
    Some(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_ints_from_i128_have_no_leading_zeros() {
        let b = BigInt::from_i128(1 << 64);
        assert_eq!(
            b,
            BigInt {
                negative: false,
                magnitude: vec![1, 0, 0, 0, 0, 0, 0, 0, 0]
            }
        );
        let b = BigInt::from_i128(-(1i128 << 70));
        assert!(b.negative);
        assert_eq!(b.magnitude[0], 0x40);
        assert_eq!(b.magnitude.len(), 9);
    }

    #[test]
    fn decrement_borrows_across_bytes() {
        assert_eq!(decrement_be(&[1, 0, 0]), vec![0xff, 0xff]);
        assert_eq!(decrement_be(&[2]), vec![1]);
        assert_eq!(decrement_be(&[1]), vec![0]);
        assert_eq!(be_to_u64(&[0, 0, 1, 2]), Some(0x102));
        assert_eq!(be_to_u64(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), None);
    }
}
