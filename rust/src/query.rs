//! The query path: a prompt's keys (or its tokens) to each source's longest held prefix.
//!
//! The walk is `kvstream/routing/_core.py`'s `_gpu_prefix_ends`: one lookup per key in a
//! tier's `key -> source mask` map, stopping when no source is left; the sources that
//! leave at each key are expanded into per-slot ends once, afterwards. From tokens, the
//! keys are chained on the way (`keys::chain_into`). The work runs with the GIL released.
//!
//! [`tier_ends`] is the walk of several tiers at once (`_IndexCore._walk` without
//! speculative entries): per source, the longest prefix held in any tier and the longest
//! in each tier, returned only for the sources that hold something (a `/query` answer
//! lists only those), so the caller builds no object for the others.
//!
//! [`slot_ends`] is the GPU-only walk as one column indexed by source slot: what
//! `KVIndex.score` values every source from (the policy itself stays Python).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::keys::chain_tokens as chain;
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

/// A tuple's items as u32s, or None when one is not an int in ``[0, 2**32)``.
fn u32s_of_tuple(tuple: &Bound<'_, PyTuple>) -> Option<Vec<u32>> {
    let mut out = Vec::with_capacity(tuple.len());
    for t in tuple.iter_borrowed() {
        out.push(t.extract::<u32>().ok()?);
    }
    Some(out)
}

static ARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// An ``array('I')``'s ids, read as its bytes (None for another typecode or item size).
fn u32s_of_array(a: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let tc: String = a.getattr("typecode")?.extract()?;
    let isz: usize = a.getattr("itemsize")?.extract()?;
    if tc != "I" || isz != 4 || !cfg!(target_endian = "little") {
        return Ok(None);
    }
    let b = a.call_method0("tobytes")?;
    let raw = b.cast::<PyBytes>()?.as_bytes();
    Ok(Some(
        raw.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// Token ids as u32s: an ``array('I')`` is taken as its bytes; a list is made one first
/// (CPython's own loop over the items), a tuple read item by item.
/// None when some id is not an int in ``[0, 2**32)`` (the Python path raises for it).
pub(crate) fn tokens_of(tokens: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let py = tokens.py();
    let array = ARRAY.import(py, "array", "array")?;
    if let Ok(list) = tokens.cast::<PyList>() {
        // Item by item from the list, the limited API costs two calls and a reference
        // count pair per id; array('I', list) runs that loop in C, about 20 % less for a
        // 4,096-id prompt (bench_index.py's score rows).
        return match array.call1(("I", list)) {
            Ok(a) => match u32s_of_array(&a)? {
                Some(v) => Ok(Some(v)),
                None => Ok(u32s_of_tuple(&list.to_tuple())),
            },
            Err(e)
                if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py)
                    || e.is_instance_of::<pyo3::exceptions::PyTypeError>(py)
                    || e.is_instance_of::<pyo3::exceptions::PyValueError>(py) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        };
    }
    if let Ok(tuple) = tokens.cast::<PyTuple>() {
        return Ok(u32s_of_tuple(tuple));
    }
    if tokens.is_instance(array)? {
        if let Some(v) = u32s_of_array(tokens)? {
            return Ok(Some(v));
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
    walk_chained(py, &map, tokens, r, seed, move |g, keys| {
        prefix_ends(g, keys, active)
    })
}

/// The preamble of the single-map token walks: ``tokens`` chained from ``seed`` into
/// router keys of ``r`` tokens and given to ``walk`` with ``map``'s core, the GIL
/// released; ``(number of keys, what walk made)``, or None for the Python path (a side
/// dict, a token id outside ``[0, 2**32)``, ``r`` 0).
fn walk_chained<T: Send>(
    py: Python<'_>,
    map: &NativeMap,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
    walk: impl FnOnce(&U64Map, &[u64]) -> T + Send,
) -> PyResult<Option<(usize, T)>> {
    let Some(core) = core_of(map, py) else {
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
        (keys.len(), walk(&g, &keys))
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

/// One source's prefix of a prompt across tiers: (slot, blocks held in any tier, blocks
/// held in each tier, in the order of the maps given).
pub type TierRow = (u32, u32, Vec<u32>);

/// Per source slot of `active`, how many leading `keys` it holds in any of `maps` (one
/// `key -> source mask` map per tier) and in each one; rows only for the slots holding at
/// least the first key, in slot order.
pub fn tier_ends(maps: &[&U64Map], keys: &[u64], active: u64) -> Vec<TierRow> {
    let t = maps.len();
    let n = keys.len() as u32;
    let mut any_end = [n; 64];
    let mut ends = vec![[n; 64]; t];
    let mut any_active = active;
    let mut t_active = vec![active; t];
    let mut masks = vec![0u64; t];
    for (i, &k) in keys.iter().enumerate() {
        let mut anym = 0;
        for (j, m) in maps.iter().enumerate() {
            let x = m.get(k).unwrap_or(0);
            masks[j] = x;
            anym |= x;
        }
        for j in 0..t {
            let ta = t_active[j] & masks[j];
            let mut gone = t_active[j] ^ ta;
            while gone != 0 {
                ends[j][gone.trailing_zeros() as usize] = i as u32;
                gone &= gone - 1;
            }
            t_active[j] = ta;
        }
        let na = any_active & anym;
        if na != any_active {
            let mut gone = any_active ^ na;
            while gone != 0 {
                any_end[gone.trailing_zeros() as usize] = i as u32;
                gone &= gone - 1;
            }
            any_active = na;
            if na == 0 {
                break;
            }
        }
    }
    let mut rows = Vec::new();
    let mut x = active;
    while x != 0 {
        let b = x.trailing_zeros() as usize;
        x &= x - 1;
        if any_end[b] > 0 {
            rows.push((b as u32, any_end[b], ends.iter().map(|e| e[b]).collect()));
        }
    }
    rows
}

/// The cores of `maps`, or None when one has a side dict (wide masks, keys that are not
/// u64s: the walk must be the Python one).
pub(crate) fn cores_of(
    py: Python<'_>,
    maps: &[PyRef<'_, NativeMap>],
) -> Option<Vec<Arc<std::sync::RwLock<U64Map>>>> {
    maps.iter().map(|m| core_of(m, py)).collect()
}

pub(crate) fn walk_cores(
    cores: &[Arc<std::sync::RwLock<U64Map>>],
    keys: &[u64],
    active: u64,
) -> Vec<TierRow> {
    let guards: Vec<_> = cores
        .iter()
        .map(|c| c.read().unwrap_or_else(|e| e.into_inner()))
        .collect();
    let refs: Vec<&U64Map> = guards.iter().map(|g| &**g).collect();
    tier_ends(&refs, keys, active)
}

/// u64 keys from packed little-endian bytes, or from a sequence of ints (None: an item
/// that is not an int in ``[0, 2**64)``).
pub(crate) fn u64_keys(keys: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u64>>> {
    if let Ok(b) = keys.cast_exact::<PyBytes>() {
        let raw = b.as_bytes();
        if raw.len() % 8 != 0 {
            return Err(crate::error::Error::Local(format!(
                "packed keys are 8 bytes each, got {} bytes",
                raw.len()
            ))
            .into());
        }
        return Ok(Some(
            raw.chunks_exact(8)
                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ));
    }
    let mut ks = Vec::new();
    for k in keys.try_iter()? {
        match k?.extract::<u64>() {
            Ok(x) => ks.push(x),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(ks))
}

/// Token ids packed as uint32-LE bytes, or any form [`tokens_of`] takes (None: as there).
pub(crate) fn packed_or_tokens(tokens: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    match tokens.cast_exact::<PyBytes>() {
        Ok(b) => Ok(Some(
            b.as_bytes()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )),
        Err(_) => tokens_of(tokens),
    }
}

/// A prompt's router keys chained from ``seed`` and walked through every tier's map in one
/// call, the GIL released: ``(number of keys, [(slot, blocks in any tier, (blocks per
/// tier, ...)), ...])`` for the slots of ``active`` holding at least one block, or None for
/// the Python walk (a side dict, a token id outside ``[0, 2**32)``, ``r`` 0).
#[pyfunction]
pub fn walk_tiers_tokens(
    py: Python<'_>,
    maps: Vec<PyRef<'_, NativeMap>>,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
    active: u64,
) -> PyResult<Option<(usize, Vec<TierRow>)>> {
    let Some(cores) = cores_of(py, &maps) else {
        return Ok(None);
    };
    if r == 0 {
        return Ok(None);
    }
    let Some(toks) = packed_or_tokens(tokens)? else {
        return Ok(None);
    };
    Ok(Some(py.detach(move || {
        let keys = chain(&toks, r, seed);
        (keys.len(), walk_cores(&cores, &keys, active))
    })))
}

/// [`walk_tiers_tokens`] for keys already made (engine hashes, a prompt's router keys):
/// ``keys`` packed (8 bytes each, little-endian) or a sequence of ints.
#[pyfunction]
pub fn walk_tiers_keys(
    py: Python<'_>,
    maps: Vec<PyRef<'_, NativeMap>>,
    keys: &Bound<'_, PyAny>,
    active: u64,
) -> PyResult<Option<(usize, Vec<TierRow>)>> {
    let Some(cores) = cores_of(py, &maps) else {
        return Ok(None);
    };
    let Some(ks) = u64_keys(keys)? else {
        return Ok(None);
    };
    Ok(Some(py.detach(move || {
        (ks.len(), walk_cores(&cores, &ks, active))
    })))
}

/// Per slot ``0..n_slots``, the leading `keys` each source of `active` holds in `map`
/// (0 for the slots outside `active`): the GPU-only prefix walk as one flat column.
pub fn slot_ends(map: &U64Map, keys: &[u64], active: u64, n_slots: usize) -> Vec<u32> {
    let mut out = vec![0u32; n_slots];
    for (slot, end) in prefix_ends(map, keys, active) {
        if let Some(x) = out.get_mut(slot as usize) {
            *x = end as u32;
        }
    }
    out
}

/// [`walk_tokens`] with the ends as one list indexed by source slot (``n_slots`` long,
/// 0 for slots outside ``active``): ``(number of keys, ends)``, or None for the Python
/// path. What ``KVIndex.score`` values every source from without a dict per call.
#[pyfunction]
pub fn slot_ends_tokens(
    py: Python<'_>,
    map: PyRef<'_, NativeMap>,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
    active: u64,
    n_slots: usize,
) -> PyResult<Option<(usize, Vec<u32>)>> {
    walk_chained(py, &map, tokens, r, seed, move |g, keys| {
        slot_ends(g, keys, active, n_slots)
    })
}

/// [`slot_ends_tokens`] for keys already made (a prompt's router keys, engine hashes):
/// ``keys`` packed (8 bytes each, little-endian) or a sequence of ints; None for the
/// Python path (a side dict, a key that is not an int in ``[0, 2**64)``).
#[pyfunction]
pub fn slot_ends_keys(
    py: Python<'_>,
    map: PyRef<'_, NativeMap>,
    keys: &Bound<'_, PyAny>,
    active: u64,
    n_slots: usize,
) -> PyResult<Option<(usize, Vec<u32>)>> {
    let Some(core) = core_of(&map, py) else {
        return Ok(None);
    };
    let ks = if let Ok(list) = keys.cast::<PyList>() {
        u64s_of_tuple(&list.to_tuple())
    } else {
        u64_keys(keys)?
    };
    let Some(ks) = ks else {
        return Ok(None);
    };
    Ok(Some(py.detach(move || {
        let g = core.read().unwrap_or_else(|e| e.into_inner());
        (ks.len(), slot_ends(&g, &ks, active, n_slots))
    })))
}

/// A tuple's items as u64s, or None when one is not an int in ``[0, 2**64)``.
fn u64s_of_tuple(tuple: &Bound<'_, PyTuple>) -> Option<Vec<u64>> {
    let mut out = Vec::with_capacity(tuple.len());
    for t in tuple.iter_borrowed() {
        out.push(t.extract::<u64>().ok()?);
    }
    Some(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(walk_keys, m)?)?;
    m.add_function(wrap_pyfunction!(walk_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(walk_tiers_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(walk_tiers_keys, m)?)?;
    m.add_function(wrap_pyfunction!(slot_ends_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(slot_ends_keys, m)?)?;
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

    #[test]
    fn tiers_end_apart_and_any_tier_carries_the_prefix() {
        let mut gpu = U64Map::new();
        let mut cpu = U64Map::new();
        // slot 0: GPU 1,2; slot 1: GPU 1, CPU 2,3; slot 2: CPU 1 only; slot 3: nothing
        gpu.insert(1, 0b011);
        gpu.insert(2, 0b001);
        cpu.insert(1, 0b100);
        cpu.insert(2, 0b010);
        cpu.insert(3, 0b010);
        let rows = tier_ends(&[&gpu, &cpu], &[1, 2, 3, 4], 0b1111);
        assert_eq!(
            rows,
            vec![(0, 2, vec![2, 0]), (1, 3, vec![1, 0]), (2, 1, vec![0, 1])]
        );
        assert_eq!(tier_ends(&[&gpu], &[1, 2], 0b1), vec![(0, 2, vec![2])]);
        assert!(tier_ends(&[&gpu], &[9], 0b1).is_empty());
        assert!(tier_ends(&[], &[1], 0b1).is_empty());
    }

    #[test]
    fn slot_ends_are_one_column_with_zeros_outside_active() {
        let mut m = U64Map::new();
        m.insert(10, 0b1011);
        m.insert(11, 0b0001);
        // slot 2 is not active; slot 3 holds the first key only; slot 5 beyond n_slots
        assert_eq!(slot_ends(&m, &[10, 11, 12], 0b101011, 4), vec![2, 1, 0, 1]);
        assert_eq!(slot_ends(&m, &[], 0b1, 2), vec![0, 0]);
    }
}
