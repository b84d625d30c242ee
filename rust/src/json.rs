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
//! array with `memchr` and reads its numbers in one pass (strictly by the JSON grammar),
//! about 5x faster than serde_json's number parsing on 4,096 ids (measured in
//! `bench/bench_serve.py --stages`); msgspec still checks the rest of the body is a JSON
//! object with the array under `field`, so no body is taken that a parser would refuse.

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

/// The JSON text of a flat array of unsigned integers (what is between its brackets) read
/// strictly by the JSON number grammar (no sign, fraction, exponent or leading zero), each
/// at most `max`; None for anything else.
fn scan_uints(text: &[u8], max: u64) -> Option<Vec<u64>> {
    let ws = |c: u8| c == b' ' || c == b'\n' || c == b'\t' || c == b'\r';
    let mut out = Vec::with_capacity(text.len() / 4);
    let n = text.len();
    let mut i = 0;
    while i < n && ws(text[i]) {
        i += 1;
    }
    if i == n {
        return Some(out); // []
    }
    loop {
        let start = i;
        let mut v: u64 = 0;
        // Up to 8 digits at once (token ids have 1-6): the digit run in a little-endian
        // word, then the classic three multiply-shift steps (simdjson's
        // parse_eight_digits). Longer numbers go on digit by digit; up to 19 digits fit a
        // u64 unchecked, a 20th is checked below.
        if i + 8 <= n {
            let w = u64::from_le_bytes([
                text[i],
                text[i + 1],
                text[i + 2],
                text[i + 3],
                text[i + 4],
                text[i + 5],
                text[i + 6],
                text[i + 7],
            ]);
            let x = w.wrapping_sub(0x3030_3030_3030_3030);
            let non_digit = (x | x.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
            let k = (non_digit.trailing_zeros() / 8) as usize; // leading digits, 0..=8
            if k > 0 {
                let mut d = if k == 8 { x } else { x << (8 * (8 - k)) };
                d = (d & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
                d = (d & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
                v = (d & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32;
                i += k;
            }
        }
        while i < n && i - start < 19 {
            let d = text[i].wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            v = v * 10 + u64::from(d);
            i += 1;
        }
        if i < n && text[i].is_ascii_digit() {
            v = v.checked_mul(10)?.checked_add(u64::from(text[i] - b'0'))?;
            i += 1;
            if i < n && text[i].is_ascii_digit() {
                return None;
            }
        }
        let len = i - start;
        if len == 0 || (len > 1 && text[start] == b'0') || v > max {
            return None;
        }
        out.push(v);
        while i < n && ws(text[i]) {
            i += 1;
        }
        if i == n {
            return Some(out);
        }
        if text[i] != b',' {
            return None;
        }
        i += 1;
        while i < n && ws(text[i]) {
            i += 1;
        }
    }
}

/// The common body, read without a JSON parser's per-number work: exactly one `[` and one
/// `]` in the body, in that order, so the array is the only one and holds no nested
/// value or string. The other fields come back with the array emptied in place (`[]`):
/// msgspec then checks that text is a JSON object whose `field` is that empty array, so
/// the whole body is validated; a body where it is not (the one array under another key)
/// is taken back to [`split_ids`] by the Python layer's fallback.
fn split_flat(body: &[u8], max: u64) -> Option<(Vec<u8>, Vec<u64>)> {
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
        4 => py.detach(|| match split_flat(raw, u64::from(u32::MAX)) {
            Some((rest, ids)) => Some((
                rest,
                le_bytes(&ids.iter().map(|&x| x as u32).collect::<Vec<u32>>()),
            )),
            None => split_ids::<u32>(raw, field).map(|s| (s.rest, le_bytes(&s.ids))),
        }),
        8 => py.detach(|| match split_flat(raw, u64::MAX) {
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
        let (rest, ids) = split_flat(
            b"{\"a\": \"x\", \"t\": [ 0, 12 ,\n 4294967295 ] }",
            u64::from(u32::MAX),
        )
        .unwrap();
        assert_eq!(ids, vec![0, 12, 4294967295]);
        assert_eq!(rest, b"{\"a\": \"x\", \"t\": [] }".to_vec());
        assert_eq!(split_flat(b"{\"t\": []}", 9).unwrap().1, Vec::<u64>::new());
        assert_eq!(split_flat(b"{\"t\": [ ]}", 9).unwrap().1, Vec::<u64>::new());
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
                split_flat(bad, u64::from(u32::MAX)).is_none(),
                "{:?}",
                std::str::from_utf8(bad)
            );
        }
        assert_eq!(
            split_flat(b"[18446744073709551615]", u64::MAX).unwrap().1,
            vec![u64::MAX]
        );
        assert!(split_flat(b"[18446744073709551616]", u64::MAX).is_none());
    }
}
