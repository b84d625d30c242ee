//! `pickle.dumps(obj, protocol=5)` for block hash inputs, byte for byte as CPython's C pickler.
//!
//! What the C pickler writes for the objects a block hash input holds (CPython's
//! `Modules/_pickle.c`, protocol 5 = `pickle.HIGHEST_PROTOCOL` on Python 3.8 and later):
//!
//! * `PROTO 5`, then one `FRAME` holding everything up to and including `STOP`. A frame is
//!   only split once it reaches 64 KiB, so inputs whose frame would reach that size are
//!   refused ([`Unsupported`]) and left to Python.
//! * ints in `[-2**31, 2**31)`: `BININT1` (one byte, 0..255), `BININT2` (two bytes,
//!   256..65535) or `BININT` (four bytes, signed), chosen from the 4-byte little-endian
//!   form; any other int: `LONG1`/`LONG4` with its minimal two's-complement bytes.
//! * `None` `N`, bools `NEWTRUE`/`NEWFALSE`, floats `BINFLOAT` (big-endian double).
//! * bytes `SHORT_BINBYTES`/`BINBYTES`, str `SHORT_BINUNICODE`/`BINUNICODE` (UTF-8), tuples
//!   `EMPTY_TUPLE`, `TUPLE1..3` or `MARK ... TUPLE`, lists `EMPTY_LIST` then `APPEND` or
//!   `MARK ... APPENDS` per 1,000 items. Each of these but the empty tuple is followed by
//!   `MEMOIZE`; a second reference to the same object is `BINGET`/`LONG_BINGET`.

use std::collections::HashMap;

use super::value::{BigInt, Value};
use super::{TokenSlice, Unsupported};

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const TUPLE_N: [u8; 4] = [EMPTY_TUPLE, 0x85, 0x86, 0x87];
const EMPTY_LIST: u8 = b']';
const APPEND: u8 = b'a';
const APPENDS: u8 = b'e';
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINFLOAT: u8 = b'G';
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;

/// The C pickler starts a new frame once the current one reaches this many bytes.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// `PROTO 5` and the `FRAME` opcode with its 8-byte length.
const HEADER_LEN: usize = 2 + 9;
/// The C pickler's batch size for list appends.
const BATCHSIZE: usize = 1000;

/// Pickle's memo: object address -> memo index, in the order objects were first written.
///
/// The table is only built when a block has extra keys (a plain block's memo is fixed).
#[derive(Default)]
pub struct Memo {
    next: u32,
    seen: Option<HashMap<usize, u32>>,
}

impl Memo {
    fn put(&mut self, out: &mut Vec<u8>, id: Option<usize>) {
        if let Some(id) = id {
            self.seen
                .get_or_insert_with(HashMap::new)
                .insert(id, self.next);
        }
        self.next += 1;
        out.push(MEMOIZE);
    }

    fn get(&self, out: &mut Vec<u8>, id: usize) -> bool {
        match self.seen.as_ref().and_then(|m| m.get(&id)) {
            Some(&idx) if idx < 256 => {
                out.push(BINGET);
                out.push(idx as u8);
                true
            }
            Some(&idx) => {
                out.push(LONG_BINGET);
                out.extend_from_slice(&idx.to_le_bytes());
                true
            }
            None => false,
        }
    }
}

/// An int in `[-2**31, 2**31)` as the C pickler writes it from its 4 little-endian bytes.
#[inline]
fn write_int32(out: &mut Vec<u8>, v: i32) {
    let b = v.to_le_bytes();
    if b[2] != 0 || b[3] != 0 {
        out.push(BININT);
        out.extend_from_slice(&b);
    } else if b[1] != 0 {
        out.push(BININT2);
        out.extend_from_slice(&b[..2]);
    } else {
        out.push(BININT1);
        out.push(b[0]);
    }
}

/// Every id of a block, written at fixed offsets into room reserved up front (the hot loop
/// of the pickle algorithms: no capacity check or variable-length copy per id).
fn write_ids(out: &mut Vec<u8>, ids: &[i64]) {
    let start = out.len();
    // BININT is 5 bytes, LONG1 of an i64 at most 10.
    out.resize(start + 10 * ids.len(), 0);
    let buf = &mut out[start..];
    let mut pos = 0;
    for &t in ids {
        match i32::try_from(t) {
            Ok(v) => {
                let b = v.to_le_bytes();
                let (op, len) = if b[2] != 0 || b[3] != 0 {
                    (BININT, 5)
                } else if b[1] != 0 {
                    (BININT2, 3)
                } else {
                    (BININT1, 2)
                };
                // Write all four bytes; the next id overwrites those this one does not use.
                buf[pos] = op;
                buf[pos + 1..pos + 5].copy_from_slice(&b);
                pos += len;
            }
            Err(_) => {
                let mut long = Vec::with_capacity(10);
                write_int(&mut long, t);
                buf[pos..pos + long.len()].copy_from_slice(&long);
                pos += long.len();
            }
        }
    }
    out.truncate(start + pos);
}

/// `LONG1`/`LONG4` with the given little-endian two's-complement bytes, trimmed to minimal.
fn write_long(out: &mut Vec<u8>, mut le: Vec<u8>) {
    while le.len() > 1 {
        let top = le[le.len() - 1];
        let next = le[le.len() - 2];
        if (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
            le.pop();
        } else {
            break;
        }
    }
    if le.len() < 256 {
        out.push(LONG1);
        out.push(le.len() as u8);
    } else {
        out.push(LONG4);
        out.extend_from_slice(&(le.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(&le);
}

/// Any `i64` as the C pickler writes it.
#[inline]
pub fn write_int(out: &mut Vec<u8>, v: i64) {
    match i32::try_from(v) {
        Ok(small) => write_int32(out, small),
        Err(_) => write_long(out, v.to_le_bytes().to_vec()),
    }
}

/// An int outside `i64` (`LONG1`, or `LONG4` past 255 bytes).
pub fn write_big(out: &mut Vec<u8>, n: &BigInt) {
    // Little-endian magnitude with one spare byte for the sign bit.
    let mut le: Vec<u8> = n.magnitude.iter().rev().copied().collect();
    le.push(0);
    if n.negative {
        // Two's complement: invert, add one.
        let mut carry = true;
        for b in le.iter_mut() {
            let (v, c) = (!*b).overflowing_add(u8::from(carry));
            *b = v;
            carry = c;
        }
    }
    write_long(out, le);
}

fn write_bytes(out: &mut Vec<u8>, data: &[u8]) {
    let n = data.len();
    if n <= 0xff {
        out.push(SHORT_BINBYTES);
        out.push(n as u8);
    } else if let Ok(n32) = u32::try_from(n) {
        out.push(BINBYTES);
        out.extend_from_slice(&n32.to_le_bytes());
    } else {
        out.push(BINBYTES8);
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    out.extend_from_slice(data);
}

fn write_str(out: &mut Vec<u8>, data: &[u8]) {
    let n = data.len();
    if n <= 0xff {
        out.push(SHORT_BINUNICODE);
        out.push(n as u8);
    } else if let Ok(n32) = u32::try_from(n) {
        out.push(BINUNICODE);
        out.extend_from_slice(&n32.to_le_bytes());
    } else {
        out.push(BINUNICODE8);
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    out.extend_from_slice(data);
}

/// Append the pickle opcodes of one value (no header, no `STOP`).
pub fn write_value(out: &mut Vec<u8>, v: &Value, memo: &mut Memo) {
    match v {
        Value::None => out.push(NONE),
        Value::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
        Value::Int(i) => write_int(out, *i),
        Value::Big(b) => write_big(out, b),
        Value::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Bytes { id, data } => {
            if !memo.get(out, *id) {
                write_bytes(out, data);
                memo.put(out, Some(*id));
            }
        }
        Value::Str { id, data } => {
            if !memo.get(out, *id) {
                write_str(out, data);
                memo.put(out, Some(*id));
            }
        }
        Value::Tuple { id, items } => {
            if items.is_empty() {
                out.push(EMPTY_TUPLE);
            } else if !memo.get(out, *id) {
                write_tuple_items(out, items.iter(), items.len(), write_value, memo);
                memo.put(out, Some(*id));
            }
        }
        Value::List { id, items } => {
            if !memo.get(out, *id) {
                out.push(EMPTY_LIST);
                memo.put(out, Some(*id));
                if items.len() == 1 {
                    write_value(out, &items[0], memo);
                    out.push(APPEND);
                } else if !items.is_empty() {
                    for batch in items.chunks(BATCHSIZE) {
                        out.push(MARK);
                        for item in batch {
                            write_value(out, item, memo);
                        }
                        out.push(APPENDS);
                    }
                }
            }
        }
    }
}

/// A non-empty tuple's items and closing opcode (`TUPLE1..3`, or `MARK ... TUPLE`).
fn write_tuple_items<T>(
    out: &mut Vec<u8>,
    items: impl Iterator<Item = T>,
    len: usize,
    mut each: impl FnMut(&mut Vec<u8>, T, &mut Memo),
    memo: &mut Memo,
) {
    if len <= 3 {
        for item in items {
            each(out, item, memo);
        }
        out.push(TUPLE_N[len]);
    } else {
        out.push(MARK);
        for item in items {
            each(out, item, memo);
        }
        out.push(TUPLE);
    }
}

/// The whole of `pickle.dumps((parent, tuple(tokens), extra), 5)` into `out` (cleared first).
///
/// `parent_id` is the parent's Python address when it is a caller's object (block 0), so an
/// extra key that is the same object pickles as a memo reference, as in CPython.
pub fn block_input(
    out: &mut Vec<u8>,
    parent: &[u8],
    parent_id: Option<usize>,
    tokens: TokenSlice<'_>,
    extra: Option<&Value>,
) -> Result<(), Unsupported> {
    out.clear();
    out.extend_from_slice(&[PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0]);
    // A plain block has a fixed memo (parent 0, tokens 1, outer tuple 2): no table needed.
    let mut memo = Memo::default();
    write_bytes(out, parent);
    memo.put(out, parent_id.filter(|_| extra.is_some()));
    match tokens {
        TokenSlice::Ints(ids) => {
            if ids.is_empty() {
                out.push(EMPTY_TUPLE);
            } else if ids.len() <= 3 {
                write_ids(out, ids);
                out.push(TUPLE_N[ids.len()]);
                memo.put(out, None);
            } else {
                out.push(MARK);
                write_ids(out, ids);
                out.push(TUPLE);
                memo.put(out, None);
            }
        }
        TokenSlice::Values(ids) => {
            if ids.is_empty() {
                out.push(EMPTY_TUPLE);
            } else {
                write_tuple_items(out, ids.iter(), ids.len(), write_value, &mut memo);
                memo.put(out, None);
            }
        }
    }
    match extra {
        None => out.push(NONE),
        Some(v) => write_value(out, v, &mut memo),
    }
    out.push(TUPLE_N[3]);
    out.push(MEMOIZE);
    out.push(STOP);
    let frame_len = out.len() - HEADER_LEN;
    if frame_len >= FRAME_SIZE_TARGET {
        return Err(Unsupported);
    }
    out[3..HEADER_LEN].copy_from_slice(&(frame_len as u64).to_le_bytes());
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

    fn int(v: i64) -> Vec<u8> {
        let mut out = Vec::new();
        write_int(&mut out, v);
        out
    }

    fn big(negative: bool, magnitude: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_big(
            &mut out,
            &BigInt {
                negative,
                magnitude: magnitude.to_vec(),
            },
        );
        out
    }

    // Expected bytes from CPython 3.12: pickle.dumps(n, 5)[11:-1] (after PROTO + FRAME).
    #[test]
    fn ints_take_the_c_picklers_opcodes() {
        assert_eq!(int(0), b"K\x00");
        assert_eq!(int(255), b"K\xff");
        assert_eq!(int(256), b"M\x00\x01");
        assert_eq!(int(65535), b"M\xff\xff");
        assert_eq!(int(65536), b"J\x00\x00\x01\x00");
        assert_eq!(int(-1), b"J\xff\xff\xff\xff");
        assert_eq!(int(i32::MIN as i64), b"J\x00\x00\x00\x80");
        assert_eq!(int(1 << 31), b"\x8a\x05\x00\x00\x00\x80\x00");
        assert_eq!(int(-(1 << 31) - 1), b"\x8a\x05\xff\xff\xff\x7f\xff");
        assert_eq!(int(1 << 32), b"\x8a\x05\x00\x00\x00\x00\x01");
        assert_eq!(int(i64::MIN), b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80");
        assert_eq!(int(i64::MAX), b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f");
    }

    #[test]
    fn big_ints_are_minimal_twos_complement() {
        // 2**64, -2**64, -2**63 - 1 (needs 9 bytes), -(2**71) (fits 9 bytes exactly).
        assert_eq!(
            big(false, &[1, 0, 0, 0, 0, 0, 0, 0, 0]),
            b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01"
        );
        assert_eq!(
            big(true, &[1, 0, 0, 0, 0, 0, 0, 0, 0]),
            b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xff"
        );
        assert_eq!(
            big(true, &[0x80, 0, 0, 0, 0, 0, 0, 1]),
            b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\xff"
        );
        assert_eq!(
            big(true, &[0x80, 0, 0, 0, 0, 0, 0, 0, 0]),
            b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x80"
        );
        let huge = vec![0xffu8; 300];
        let out = big(false, &huge);
        assert_eq!(&out[..5], &[LONG4, 45, 1, 0, 0]);
        assert_eq!(out.len(), 5 + 301);
    }

    #[test]
    fn a_plain_block_is_framed_and_memoized() {
        // pickle.dumps((b"p", (1, 300), None), 5)
        let mut out = Vec::new();
        block_input(&mut out, b"p", None, TokenSlice::Ints(&[1, 300]), None).unwrap();
        assert_eq!(
            out,
            b"\x80\x05\x95\x0f\x00\x00\x00\x00\x00\x00\x00C\x01p\x94K\x01M,\x01\x86\x94N\x87\x94."
        );
    }

    #[test]
    fn a_second_reference_to_one_object_is_a_memo_get() {
        // s = "mm"; pickle.dumps((b"p", (7,), ((s, 1), (s, 2))), 5)
        let s = Value::Str {
            id: 1,
            data: b"mm".to_vec(),
        };
        let extra = Value::Tuple {
            id: 2,
            items: vec![
                Value::Tuple {
                    id: 3,
                    items: vec![s.clone(), Value::Int(1)],
                },
                Value::Tuple {
                    id: 4,
                    items: vec![s, Value::Int(2)],
                },
            ],
        };
        let mut out = Vec::new();
        block_input(&mut out, b"p", None, TokenSlice::Ints(&[7]), Some(&extra)).unwrap();
        assert_eq!(
            &out[11..],
            b"C\x01p\x94K\x07\x85\x94\x8c\x02mm\x94K\x01\x86\x94h\x02K\x02\x86\x94\x86\x94\x87\x94."
        );
    }

    #[test]
    fn a_frame_of_64_kib_is_left_to_python() {
        let mut out = Vec::new();
        let parent = vec![0u8; FRAME_SIZE_TARGET];
        assert_eq!(
            block_input(&mut out, &parent, None, TokenSlice::Ints(&[1]), None),
            Err(Unsupported)
        );
    }
}
