//! The query path: a prompt's keys (or its tokens) to each source's longest held prefix.
//!
//! The walk is `kvstream/routing/_core.py`'s `_gpu_prefix_ends`: one lookup per key in a
//! tier's `key -> source mask` map, stopping when no source is left; the sources that
//! leave at each key are expanded into per-slot ends once, afterwards. From tokens, the
//! keys are chained on the way (`chain`). The work runs with the GIL released.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::chain::chain;
use crate::table::{NativeMap, U64Map};

/// (slot, end) pairs: per source slot, the leading keys it holds.
pub type Ends = Vec<(u32, usize)>;

/// Per source slot, how many leading `keys` the sources in `active` hold in `map`:
/// (slot, end) pairs for every slot of `active`.
pub fn prefix_ends(map: &U64Map, keys: &[u64], mut active: u64) -> Ends {
    let mut drops: Vec<(usize, u64)> = Vec::new();
    for (i, &k) in keys.iter().enumerate() {
        let na = active & map.get(k).unwrap_or(0);
        if na != active {
            drops.push((i, active ^ na));
            active = na;
            if active == 0 {
                break;
            }
        }
    }
    drops.push((keys.len(), active));
    let mut out = Vec::new();
    for (i, mut x) in drops {
        while x != 0 {
            let b = x.trailing_zeros();
            out.push((b, i));
            x &= x - 1;
        }
    }
    out
}

fn core_of(map: &NativeMap, py: Python<'_>) -> Option<Arc<std::sync::RwLock<U64Map>>> {
    // A side dict holds masks wider than 64 sources or keys that are not u64s: the walk
    // must see them, so it is the Python one.
    if map.other(py).is_empty() {
        Some(map.core.clone())
    } else {
        None
    }
}

/// Token ids as u32s: an ``array('I')`` is taken as its bytes; a list, item by item.
/// None when some id is not an int in ``[0, 2**32)`` (the Python path raises for it).
pub(crate) fn tokens_of(tokens: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    if let Ok(list) = tokens.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for t in list.iter() {
            match t.extract::<u32>() {
                Ok(x) => out.push(x),
                Err(_) => return Ok(None),
            }
        }
        return Ok(Some(out));
    }
    let py = tokens.py();
    let array = py.import("array")?.getattr("array")?;
    if tokens.is_instance(&array)? {
        let tc: String = tokens.getattr("typecode")?.extract()?;
        let isz: usize = tokens.getattr("itemsize")?.extract()?;
        if tc == "I" && isz == 4 && cfg!(target_endian = "little") {
            let b = tokens.call_method0("tobytes")?;
            let raw = b.cast::<PyBytes>()?.as_bytes();
            return Ok(Some(
                raw.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ));
        }
    }
    let mut out = Vec::new();
    for t in tokens.try_iter()? {
        match t?.extract::<u32>() {
            Ok(x) => out.push(x),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// ``_gpu_prefix_ends`` over a native map: (slot, end) pairs, or None when the walk must
/// be the Python one (a side dict, a key that is not a u64).
#[pyfunction]
pub fn walk_keys(
    py: Python<'_>,
    map: PyRef<'_, NativeMap>,
    keys: &Bound<'_, PyAny>,
    active: u64,
) -> PyResult<Option<Ends>> {
    let Some(core) = core_of(&map, py) else {
        return Ok(None);
    };
    let mut ks = Vec::new();
    for k in keys.try_iter()? {
        match k?.extract::<u64>() {
            Ok(x) => ks.push(x),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(py.detach(move || {
        let g = core.read().unwrap_or_else(|e| e.into_inner());
        prefix_ends(&g, &ks, active)
    })))
}

/// A prompt's router keys chained from ``seed`` and walked through ``map`` in one call:
/// ``(number of keys, (slot, end) pairs)``, or None for the Python path (a side dict, a
/// token id outside ``[0, 2**32)``).
#[pyfunction]
pub fn walk_tokens(
    py: Python<'_>,
    map: PyRef<'_, NativeMap>,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
    active: u64,
) -> PyResult<Option<(usize, Ends)>> {
    let Some(core) = core_of(&map, py) else {
        return Ok(None);
    };
    if r == 0 {
        return Ok(None);
    }
    let Some(toks) = tokens_of(tokens)? else {
        return Ok(None);
    };
    Ok(Some(py.detach(move || {
        let keys = chain(&toks, r, seed);
        let g = core.read().unwrap_or_else(|e| e.into_inner());
        (keys.len(), prefix_ends(&g, &keys, active))
    })))
}

/// The router keys of a prompt's full blocks of ``r`` tokens, chained from ``seed``
/// (``kvstream.routing.keys.chain_keys`` without extras), or None for a token id outside
/// ``[0, 2**32)`` (the Python path raises for it).
#[pyfunction]
pub fn router_keys(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
) -> PyResult<Option<Vec<u64>>> {
    if r == 0 {
        return Ok(None);
    }
    let Some(toks) = tokens_of(tokens)? else {
        return Ok(None);
    };
    Ok(Some(py.detach(move || chain(&toks, r, seed))))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(walk_keys, m)?)?;
    m.add_function(wrap_pyfunction!(walk_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(router_keys, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_leave_where_their_prefix_ends() {
        let mut m = U64Map::new();
        m.insert(10, 0b111);
        m.insert(11, 0b011);
        m.insert(12, 0b001);
        let mut ends = prefix_ends(&m, &[10, 11, 12, 13], 0b1111);
        ends.sort();
        assert_eq!(ends, vec![(0, 3), (1, 2), (2, 1), (3, 0)]);
        assert_eq!(prefix_ends(&m, &[], 0b1), vec![(0, 0)]);
    }
}
