//! `cbor2.dumps(obj, canonical=True)` for block hash inputs, byte for byte.
//!
//! Canonical CBOR differs from plain CBOR only for maps, sets and floats, none of which
//! appear in a block hash input: ints, strings, bytes, None, bools and arrays have one
//! minimal form. Ints outside `[-2**64, 2**64)` are bignums (tag 2 or 3 around the
//! big-endian bytes of `n` or `-1 - n`), as cbor2 writes them. Floats are refused
//! ([`Unsupported`]): cbor2's shortest-float rules stay with cbor2.

use super::value::{be_to_u64, decrement_be, trim_be, BigInt, Value};
use super::{TokenSlice, Unsupported};

/// The initial byte(s) of major type `major` with argument `n`, minimal.
#[inline]
pub fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n < 0x100 {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n < 0x1_0000 {
        out.push(m | 25);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n < 0x1_0000_0000 {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// Any `i64`.
#[inline]
pub fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        head(out, 0, v as u64);
    } else {
        // -1 - v is in [0, 2**63): no overflow for i64::MIN.
        head(out, 1, (-1 - v) as u64);
    }
}

/// Every id of a block, written at fixed offsets into room reserved up front (the hot loop
/// of the CBOR algorithms: no capacity check or variable-length copy per id).
fn write_ids(out: &mut Vec<u8>, ids: &[i64]) {
    let start = out.len();
    // At most a head byte and 8 argument bytes an id.
    out.resize(start + 9 * ids.len(), 0);
    let buf = &mut out[start..];
    let mut pos = 0;
    for &t in ids {
        match u32::try_from(t) {
            Ok(v) if v < 24 => {
                buf[pos] = v as u8;
                pos += 1;
            }
            Ok(v) if v < 0x100 => {
                buf[pos] = 0x18;
                buf[pos + 1] = v as u8;
                pos += 2;
            }
            Ok(v) if v < 0x1_0000 => {
                buf[pos] = 0x19;
                buf[pos + 1..pos + 3].copy_from_slice(&(v as u16).to_be_bytes());
                pos += 3;
            }
            Ok(v) => {
                buf[pos] = 0x1a;
                buf[pos + 1..pos + 5].copy_from_slice(&v.to_be_bytes());
                pos += 5;
            }
            Err(_) => {
                let mut one = Vec::with_capacity(9);
                write_int(&mut one, t);
                buf[pos..pos + one.len()].copy_from_slice(&one);
                pos += one.len();
            }
        }
    }
    out.truncate(start + pos);
}

/// An int outside `i64`: major type 0/1 while it fits 64 bits, a bignum beyond.
pub fn write_big(out: &mut Vec<u8>, n: &BigInt) {
    let (major, tag, arg) = if n.negative {
        (1u8, 0xc3u8, decrement_be(&n.magnitude))
    } else {
        (0u8, 0xc2u8, trim_be(&n.magnitude).to_vec())
    };
    match be_to_u64(&arg) {
        Some(small) => head(out, major, small),
        None => {
            out.push(tag);
            head(out, 2, arg.len() as u64);
            out.extend_from_slice(&arg);
        }
    }
}

/// Append one value's canonical CBOR.
pub fn write_value(out: &mut Vec<u8>, v: &Value) -> Result<(), Unsupported> {
    match v {
        Value::None => out.push(0xf6),
        Value::Bool(b) => out.push(if *b { 0xf5 } else { 0xf4 }),
        Value::Int(i) => write_int(out, *i),
        Value::Big(b) => write_big(out, b),
        Value::Float(_) => return Err(Unsupported),
        Value::Bytes { data, .. } => {
            head(out, 2, data.len() as u64);
            out.extend_from_slice(data);
        }
        Value::Str { data, .. } => {
            head(out, 3, data.len() as u64);
            out.extend_from_slice(data);
        }
        Value::Tuple { items, .. } | Value::List { items, .. } => {
            head(out, 4, items.len() as u64);
            for item in items {
                write_value(out, item)?;
            }
        }
    }
    Ok(())
}

/// The token array of one block.
#[inline]
pub fn write_tokens(out: &mut Vec<u8>, tokens: TokenSlice<'_>) -> Result<(), Unsupported> {
    match tokens {
        TokenSlice::Ints(ids) => {
            head(out, 4, ids.len() as u64);
            write_ids(out, ids);
        }
        TokenSlice::Values(ids) => {
            head(out, 4, ids.len() as u64);
            for t in ids {
                write_value(out, t)?;
            }
        }
    }
    Ok(())
}

/// The whole of `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)` into `out`.
pub fn block_input(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: TokenSlice<'_>,
    extra: Option<&Value>,
) -> Result<(), Unsupported> {
    out.clear();
    out.push(0x83);
    head(out, 2, parent.len() as u64);
    out.extend_from_slice(parent);
    write_tokens(out, tokens)?;
    match extra {
        None => out.push(0xf6),
        Some(v) => write_value(out, v)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_loop_writes_what_the_per_value_writer_writes() {
        let vals = super::super::sample_ids();
        for chunk in vals.chunks(17) {
            let mut fast = vec![0xaa];
            write_ids(&mut fast, chunk);
            let mut slow = vec![0xaa];
            for &v in chunk {
                write_int(&mut slow, v);
            }
            assert_eq!(fast, slow, "{chunk:?}");
        }
    }

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        write_value(&mut out, v).unwrap();
        out
    }

    fn big(negative: bool, magnitude: &[u8]) -> Vec<u8> {
        enc(&Value::Big(BigInt {
            negative,
            magnitude: magnitude.to_vec(),
        }))
    }

    // Expected bytes: cbor2.dumps(x, canonical=True) (cbor2 5.6).
    #[test]
    fn ints_at_every_width_boundary() {
        let cases: [(i64, &[u8]); 10] = [
            (0, b"\x00"),
            (23, b"\x17"),
            (24, b"\x18\x18"),
            (255, b"\x18\xff"),
            (256, b"\x19\x01\x00"),
            (65536, b"\x1a\x00\x01\x00\x00"),
            (1 << 32, b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"),
            (-1, b"\x20"),
            (-25, b"\x38\x18"),
            (i64::MIN, b"\x3b\x7f\xff\xff\xff\xff\xff\xff\xff"),
        ];
        for (v, want) in cases {
            assert_eq!(enc(&Value::Int(v)), want, "{v}");
        }
    }

    #[test]
    fn ints_beyond_64_bits_are_bignums() {
        // 2**64 - 1 is still major type 0; 2**64 is tag 2; -2**64 is major 1; -2**64 - 1 tag 3.
        assert_eq!(
            big(false, &[0xff; 8]),
            b"\x1b\xff\xff\xff\xff\xff\xff\xff\xff"
        );
        assert_eq!(
            big(false, &[1, 0, 0, 0, 0, 0, 0, 0, 0]),
            b"\xc2\x49\x01\x00\x00\x00\x00\x00\x00\x00\x00"
        );
        assert_eq!(
            big(true, &[1, 0, 0, 0, 0, 0, 0, 0, 0]),
            b"\x3b\xff\xff\xff\xff\xff\xff\xff\xff"
        );
        assert_eq!(
            big(true, &[1, 0, 0, 0, 0, 0, 0, 0, 1]),
            b"\xc3\x49\x01\x00\x00\x00\x00\x00\x00\x00\x00"
        );
    }

    #[test]
    fn strings_bytes_and_arrays() {
        let v = Value::Tuple {
            id: 0,
            items: vec![
                Value::Str {
                    id: 1,
                    data: b"mm".to_vec(),
                },
                Value::Bytes {
                    id: 2,
                    data: vec![0; 24],
                },
                Value::None,
                Value::Bool(true),
                Value::List {
                    id: 3,
                    items: vec![],
                },
            ],
        };
        let mut want = vec![0x85, 0x62, b'm', b'm', 0x58, 24];
        want.extend_from_slice(&[0; 24]);
        want.extend_from_slice(&[0xf6, 0xf5, 0x80]);
        assert_eq!(enc(&v), want);
        assert_eq!(
            write_value(&mut Vec::new(), &Value::Float(1.5)),
            Err(Unsupported)
        );
    }

    #[test]
    fn a_plain_block() {
        let mut out = Vec::new();
        block_input(&mut out, b"p", TokenSlice::Ints(&[1, 300]), None).unwrap();
        assert_eq!(out, b"\x83\x41p\x82\x01\x19\x01\x2c\xf6");
    }
}
