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
    let mut rest = Vec::with_capacity(64 + others.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum::<usize>());
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
#[pyfunction]
pub fn split_body<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    field: &str,
    width: usize,
) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
    let raw = body.as_bytes();
    let packed = match width {
        4 => py.detach(|| split_ids::<u32>(raw, field).map(|s| (s.rest, le_bytes(&s.ids)))),
        8 => py.detach(|| split_ids::<u64>(raw, field).map(|s| (s.rest, le_bytes(&s.ids)))),
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
            assert!(split_ids::<u32>(body, "token_ids").is_none(), "{:?}", std::str::from_utf8(body));
        }
        let s = split_ids::<u64>(br#"{"seq_hashes": [18446744073709551615]}"#, "seq_hashes").unwrap();
        assert_eq!(s.ids, vec![u64::MAX]);
    }
}
