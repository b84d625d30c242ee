//! The query routes' request bodies: one JSON object whose long array (`token_ids`,
//! `seq_hashes`) is read straight into integers, its other fields kept as their JSON text.
//!
//! A `/query` body is mostly its 4,096 token ids (~30 KB); the other fields are a few
//! names and numbers. [`split_ids`] parses the body once with `serde_json` (the array as a
//! `Vec<u32>` or `Vec<u64>`, every other value as a borrowed `RawValue`) and returns the
//! ids and a small JSON object of the other fields with the array left empty, which the
//! Python layer decodes with msgspec into its request Struct: so every field's type,
//! bound and error wording stays msgspec's. Anything this reader is not sure about (not
//! an object, a duplicate key, an id that is not an integer in range, trailing bytes) is
//! `None`, and the caller decodes the whole body with msgspec, which words the error.
//!
//! The usual body has no other array, object or bracket: [`split_flat`] then finds the one
//! array with `memchr` and reads its numbers in one pass (strictly by the JSON grammar):
//! a token id and the `, ` after it from one 8-byte word, about 80 instructions per id
//! against 165 for the digit-by-digit loop before it (callgrind, 4,096 ids; times in
//! `bench/bench_serve.py --stages`); msgspec still checks the rest of the body is a JSON
//! object with the array under `field`, so no body is taken that a parser would refuse.
//! The tests hold it to serde_json on generated arrays.

use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// A body split: the other fields as one JSON object (the array field present and empty,
/// last), and the array's items.
pub struct Split<T> {
    pub rest: Vec<u8>,
    pub ids: Vec<T>,
}

struct Body<'f, T> {
    field: &'f str,
    _t: PhantomData<T>,
}

type Fields<'de, T> = (Vec<(String, &'de RawValue)>, Option<Vec<T>>);

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Body<'_, T> {
    type Value = Fields<'de, T>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Body<'_, T> {
    type Value = Fields<'de, T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut others: Vec<(String, &'de RawValue)> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut ids = None;
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(A::Error::custom("duplicate key"));
            }
            if key == self.field {
                ids = Some(map.next_value::<Vec<T>>()?);
            } else {
                others.push((key, map.next_value::<&'de RawValue>()?));
            }
        }
        Ok((others, ids))
    }
}

/// Whitespace in the JSON grammar.
#[inline]
fn ws(c: u8) -> bool {
    c == b' ' || c == b'\n' || c == b'\t' || c == b'\r'
}

#[inline]
fn skip_ws(text: &[u8], mut i: usize) -> usize {
    while i < text.len() && ws(text[i]) {
        i += 1;
    }
    i
}

/// The value of up to 8 decimal digits (as byte values 0-9, the first in the low byte)
/// of a little-endian word whose other bytes are 0: simdjson's parse_eight_digits.
#[inline]
fn eight_digits(d: u64) -> u64 {
    let d = (d & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    let d = (d & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    (d & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32
}

/// One number at `text[i..]` read digit by digit (the general case: near the end, or 8
/// digits and more): its value and the position after it, None when it is not a JSON
/// number of at most 20 digits that fits a u64.
fn number_at(text: &[u8], mut i: usize) -> Option<(u64, usize)> {
    let start = i;
    let mut v: u64 = 0;
    while i < text.len() && i - start < 19 {
        let d = text[i].wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        v = v * 10 + u64::from(d);
        i += 1;
    }
    if i < text.len() && text[i].is_ascii_digit() {
        v = v.checked_mul(10)?.checked_add(u64::from(text[i] - b'0'))?;
        i += 1;
        if i < text.len() && text[i].is_ascii_digit() {
            return None;
        }
    }
    let len = i - start;
    if len == 0 || (len > 1 && text[start] == b'0') {
        return None;
    }
    Some((v, i))
}

/// An id type of the flat route: u32 token ids, u64 block hashes.
trait Id: Copy {
    /// `v`, known to be at most the route's `max` (so it fits).
    fn of(v: u64) -> Self;
}

impl Id for u32 {
    #[inline]
    fn of(v: u64) -> Self {
        v as u32
    }
}

impl Id for u64 {
    #[inline]
    fn of(v: u64) -> Self {
        v
    }
}

/// The JSON text of a flat array of unsigned integers (what is between its brackets) read
/// strictly by the JSON number grammar (no sign, fraction, exponent or leading zero), each
/// at most `max` (which must fit `T`); None for anything else.
///
/// A number of 1-7 digits with 16 bytes of text left (nearly every token id) is read from
/// one 8-byte word: the digit run found and valued at once (SWAR), and the `, ` after it
/// taken from the same word; anything else goes by [`number_at`] and the general
/// separator rules.
fn scan_uints<T: Id>(text: &[u8], max: u64) -> Option<Vec<T>> {
    let n = text.len();
    let mut out = Vec::with_capacity(n / 4 + 1);
    let mut i = skip_ws(text, 0);
    if i == n {
        return Some(out); // []
    }
    loop {
        if let Some(word) = text.get(i..i + 16) {
            let mut w8 = [0u8; 8];
            w8.copy_from_slice(&word[..8]);
            let w = u64::from_le_bytes(w8);
            let x = w.wrapping_sub(0x3030_3030_3030_3030);
            let non_digit = (x | x.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
            if non_digit != 0 {
                let k = (non_digit.trailing_zeros() / 8) as usize; // digits, 0..=7
                if k == 0 {
                    if ws(word[0]) {
                        // More whitespace after a comma (the only place this loop starts
                        // at whitespace): skipped, then the number.
                        i = skip_ws(text, i);
                        continue;
                    }
                    return None;
                }
                if k > 1 && word[0] == b'0' {
                    return None;
                }
                let v = eight_digits(x << (64 - 8 * k));
                if v > max {
                    return None;
                }
                out.push(T::of(v));
                if word[k] == b',' {
                    // The usual separator, `,` or `, `, then the next number.
                    i += k + 1 + usize::from(word[k + 1] == b' ');
                    continue;
                }
                i += k;
            } else {
                let (v, next) = number_at(text, i)?;
                if v > max {
                    return None;
                }
                out.push(T::of(v));
                i = next;
            }
        } else {
            // Near the end: whitespace after a comma, then the number.
            let (v, next) = number_at(text, skip_ws(text, i))?;
            if v > max {
                return None;
            }
            out.push(T::of(v));
            i = next;
        }
        // The general separator: whitespace, then the end or a comma and whitespace.
        i = skip_ws(text, i);
        if i == n {
            return Some(out);
        }
        if text[i] != b',' {
            return None;
        }
        i = skip_ws(text, i + 1);
    }
}

/// The common body, read without a JSON parser's per-number work: exactly one `[` and one
/// `]` in the body, in that order, so the array is the only one and holds no nested
/// value or string. The other fields come back with the array emptied in place (`[]`):
/// msgspec then checks that text is a JSON object whose `field` is that empty array, so
/// the whole body is validated; a body where it is not (the one array under another key)
/// is taken back to [`split_ids`] by the Python layer's fallback.
fn split_flat<T: Id>(body: &[u8], max: u64) -> Option<(Vec<u8>, Vec<T>)> {
    let open = memchr::memchr(b'[', body)?;
    let close = memchr::memrchr(b']', body)?;
    if close < open
        || memchr::memchr(b'[', &body[open + 1..]).is_some()
        || memchr::memchr(b']', &body[..close]).is_some()
    {
        return None;
    }
    let ids = scan_uints(&body[open + 1..close], max)?;
    let mut rest = Vec::with_capacity(open + 1 + body.len() - close);
    rest.extend_from_slice(&body[..=open]);
    rest.extend_from_slice(&body[close..]);
    Some((rest, ids))
}

/// `body` split into its `field` array (items of type `T`) and the rest (see the module
/// docs); None when the body is not exactly an object holding that array.
pub fn split_ids<'de, T: Deserialize<'de>>(body: &'de [u8], field: &str) -> Option<Split<T>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let (others, ids) = Body::<T> {
        field,
        _t: PhantomData,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    let ids = ids?;
    let mut rest = Vec::with_capacity(
        64 + others
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum::<usize>(),
    );
    rest.push(b'{');
    for (k, v) in &others {
        serde_json::to_writer(&mut rest, k).ok()?;
        rest.push(b':');
        rest.extend_from_slice(v.get().as_bytes());
        rest.push(b',');
    }
    serde_json::to_writer(&mut rest, field).ok()?;
    rest.extend_from_slice(b":[]}");
    Some(Split { rest, ids })
}

/// Integers as their little-endian bytes.
fn le_bytes<T: bytemuck::Pod + ToLe>(xs: &[T]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(xs).to_vec()
    } else {
        xs.iter().flat_map(|x| x.le()).collect()
    }
}

/// Little-endian bytes of one integer (for big-endian hosts).
trait ToLe {
    fn le(&self) -> Vec<u8>;
}

impl ToLe for u32 {
    fn le(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

impl ToLe for u64 {
    fn le(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

/// ``(the other fields as a JSON object, the ids packed little-endian)`` of a request
/// body whose ``field`` is an array of unsigned integers of ``width`` bytes (4: uint32
/// token ids, 8: uint64 hashes); None for any other body (decode it with msgspec, which
/// says what is wrong). The parse runs with the GIL released.
///
/// The caller must decode the first element as its request and check that ``field`` is
/// an empty array there: the flat route (one array in the body) does not know whose
/// array it read until then.
#[pyfunction]
pub fn split_body<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    field: &str,
    width: usize,
) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
    let raw = body.as_bytes();
    let packed = match width {
        4 => py.detach(|| match split_flat::<u32>(raw, u64::from(u32::MAX)) {
            Some((rest, ids)) => Some((rest, le_bytes(&ids))),
            None => split_ids::<u32>(raw, field).map(|s| (s.rest, le_bytes(&s.ids))),
        }),
        8 => py.detach(|| match split_flat::<u64>(raw, u64::MAX) {
            Some((rest, ids)) => Some((rest, le_bytes(&ids))),
            None => split_ids::<u64>(raw, field).map(|s| (s.rest, le_bytes(&s.ids))),
        }),
        _ => {
            return Err(crate::error::Error::Local(format!(
                "width must be 4 or 8 (bytes per id), got {width}"
            ))
            .into())
        }
    };
    Ok(packed.map(|(rest, ids)| (PyBytes::new(py, &rest), PyBytes::new(py, &ids))))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(split_body, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_array_is_read_and_the_rest_kept_as_text() {
        let body = br#"{"model": "m\"x", "token_ids": [1, 2, 4294967295], "block_size": 16, "x": {"a": [1]}}"#;
        let s = split_ids::<u32>(body, "token_ids").unwrap();
        assert_eq!(s.ids, vec![1, 2, 4294967295]);
        assert_eq!(
            std::str::from_utf8(&s.rest).unwrap(),
            r#"{"model":"m\"x","block_size":16,"x":{"a": [1]},"token_ids":[]}"#
        );
    }

    #[test]
    fn anything_unsure_is_none() {
        for body in [
            &br#"{"token_ids": [1, 4294967296]}"#[..],
            br#"{"token_ids": [1.0]}"#,
            br#"{"token_ids": [-1]}"#,
            br#"{"token_ids": [1], "token_ids": [2]}"#,
            br#"{"a": 1, "a": 2, "token_ids": []}"#,
            br#"{"token_ids": [1]} x"#,
            br#"{"model": "m"}"#,
            br#"[1, 2]"#,
            br#"{"token_ids": [1,]}"#,
            b"",
        ] {
            assert!(
                split_ids::<u32>(body, "token_ids").is_none(),
                "{:?}",
                std::str::from_utf8(body)
            );
        }
        let s =
            split_ids::<u64>(br#"{"seq_hashes": [18446744073709551615]}"#, "seq_hashes").unwrap();
        assert_eq!(s.ids, vec![u64::MAX]);
    }

    #[test]
    fn the_flat_route_reads_json_numbers_strictly() {
        let (rest, ids) = split_flat::<u64>(
            b"{\"a\": \"x\", \"t\": [ 0, 12 ,\n 4294967295 ] }",
            u64::from(u32::MAX),
        )
        .unwrap();
        assert_eq!(ids, vec![0, 12, 4294967295]);
        assert_eq!(rest, b"{\"a\": \"x\", \"t\": [] }".to_vec());
        assert_eq!(
            split_flat::<u64>(b"{\"t\": []}", 9).unwrap().1,
            Vec::<u64>::new()
        );
        assert_eq!(
            split_flat::<u64>(b"{\"t\": [ ]}", 9).unwrap().1,
            Vec::<u64>::new()
        );
        for bad in [
            &b"{\"t\": [01]}"[..],
            b"{\"t\": [1,]}",
            b"{\"t\": [,1]}",
            b"{\"t\": [1 2]}",
            b"{\"t\": [-1]}",
            b"{\"t\": [1.5]}",
            b"{\"t\": [1e3]}",
            b"{\"t\": [4294967296]}",
            b"{\"t\": [99999999999999999999999]}",
            b"{\"t\": [[1]]}",
            b"{\"t\": [1], \"u\": [2]}",
            b"{\"t\": ]1[}",
            b"{\"t\": 1}",
        ] {
            assert!(
                split_flat::<u32>(bad, u64::from(u32::MAX)).is_none(),
                "{:?}",
                std::str::from_utf8(bad)
            );
        }
        assert_eq!(
            split_flat::<u64>(b"[18446744073709551615]", u64::MAX)
                .unwrap()
                .1,
            vec![u64::MAX]
        );
        assert!(split_flat::<u64>(b"[18446744073709551616]", u64::MAX).is_none());
    }

    /// The flat route against serde_json on generated array texts (valid ones with every
    /// kind of whitespace, digit counts from 1 to 22 and leading zeros; and random strings
    /// over the characters that matter), short ones (the digit-by-digit path near the end)
    /// and long ones (the one-word path): the same ids or the same refusal, for u32 and
    /// u64 bounds.
    #[test]
    fn the_flat_route_agrees_with_serde_json_on_generated_arrays() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let reference = |text: &[u8], max: u64| -> Option<Vec<u64>> {
            let mut doc = b"[".to_vec();
            doc.extend_from_slice(text);
            doc.push(b']');
            let ids: Vec<u64> = serde_json::from_slice(&doc).ok()?;
            ids.iter().all(|&v| v <= max).then_some(ids)
        };
        let noise = b"0123456789, \n\t\r-.e+,,  00x";
        let (mut accepted, mut refused) = (0, 0);
        for round in 0..200_000u64 {
            let mut t: Vec<u8> = Vec::new();
            if round % 3 == 0 {
                for _ in 0..rnd() % 40 {
                    t.push(noise[(rnd() % noise.len() as u64) as usize]);
                }
            } else {
                for j in 0..rnd() % if round % 3 == 1 { 4 } else { 24 } {
                    if j > 0 {
                        for _ in 0..rnd() % 3 {
                            t.push(b" \n\t\r"[(rnd() % 4) as usize]);
                        }
                        t.push(b',');
                    }
                    for _ in 0..rnd() % 3 {
                        t.push(b" \n"[(rnd() % 2) as usize]);
                    }
                    let v = match rnd() % 4 {
                        0 => rnd() % 10,
                        1 => rnd() % 1_000_000,
                        2 => rnd(),
                        _ => rnd() % 100_000_000_000,
                    };
                    let mut sv = v.to_string();
                    if rnd() % 20 == 0 {
                        sv.insert(0, '0');
                    }
                    if rnd() % 30 == 0 {
                        sv.push_str("99");
                    }
                    t.extend_from_slice(sv.as_bytes());
                }
                let pad = (rnd() % 3) as usize;
                t.extend(std::iter::repeat_n(b' ', pad));
                if rnd() % 10 == 0 {
                    t.push(b',');
                }
            }
            for max in [9, 1_000_000, u64::from(u32::MAX), u64::MAX] {
                let want = reference(&t, max);
                assert_eq!(
                    scan_uints::<u64>(&t, max),
                    want,
                    "{:?} max {max}",
                    std::str::from_utf8(&t)
                );
                if max <= u64::from(u32::MAX) {
                    let want32 = want
                        .as_ref()
                        .map(|v| v.iter().map(|&x| x as u32).collect::<Vec<u32>>());
                    assert_eq!(scan_uints::<u32>(&t, max), want32);
                }
                if want.is_some() {
                    accepted += 1;
                } else {
                    refused += 1;
                }
            }
        }
        assert!(
            accepted > 100_000 && refused > 100_000,
            "{accepted} accepted, {refused} refused"
        );
    }
}
