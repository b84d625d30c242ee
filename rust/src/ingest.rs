//! Ingest: a run of decoded events applied to the residency table in one call.
//!
//! The index's common cases, exactly as `kvstream/routing/index.py` defines them, run
//! here without a Python call per block:
//!
//! * a `BlockStored` run in the GPU tier, group 0, engine blocks of one router block, no
//!   extra keys, whose blocks are all new (no hash known or unlinked or waited for, no key
//!   held by another hash of the family) and whose parent is known (or None, base
//!   namespace, not a re-announcement candidate): keys chained from the tokens, every
//!   block installed;
//! * a `BlockRemoved` in the GPU tier, group 0, of hashes held once (no copy record).
//!
//! Anything else (and any event that fails one check) is left to the Python rules: the
//! call returns the position of the first event it did not apply, having changed nothing
//! for that event, and the caller applies it and calls again from the next one. So the
//! native path is an exact subset of the Python one; the tests compare both.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyTuple};

use crate::chain::chain_into;
use crate::table::{as_key, NativeMap, U64Map};

/// What one call did: (next event to apply in Python, blocks stored, blocks removed).
type Applied = (usize, usize, usize);

struct Ctx<'a, 'py> {
    py: Python<'py>,
    stored_cls: &'a Bound<'py, PyAny>,
    removed_cls: &'a Bound<'py, PyAny>,
    table: &'a NativeMap,
    gpu: &'a NativeMap,
    others: Vec<PyRef<'py, NativeMap>>,
    slot: u32,
    bit: u64,
    fam: u64,
    r: usize,
    base_ns: u64,
    reannounce: u8,
    stores_ok: bool,
    copies: &'a Bound<'py, PyDict>,
    href: &'a Bound<'py, PyDict>,
    unl: &'a Bound<'py, PyDict>,
    waiting: &'a Bound<'py, PyDict>,
    touched: Option<&'a Bound<'py, PySet>>,
}

/// Whether a run lists some value twice (runs are short: a linear scan beats hashing).
fn has_dups(xs: &[u64]) -> bool {
    if xs.len() <= 32 {
        return xs.iter().enumerate().any(|(j, x)| xs[..j].contains(x));
    }
    let mut seen = hashbrown::HashSet::with_capacity(xs.len());
    !xs.iter().all(|x| seen.insert(*x))
}

fn medium_is_gpu(ev: &Bound<'_, PyAny>) -> PyResult<bool> {
    let m = ev.getattr(intern!(ev.py(), "medium"))?;
    if m.is_none() {
        return Ok(true);
    }
    Ok(m.extract::<&str>().map(|s| s == "GPU").unwrap_or(false))
}

fn group_is_zero(ev: &Bound<'_, PyAny>) -> PyResult<bool> {
    let g = ev.getattr(intern!(ev.py(), "group_idx"))?;
    Ok(g.is_none() || g.extract::<i64>().map(|x| x == 0).unwrap_or(false))
}

fn u64_hashes(hs: &Bound<'_, PyAny>, out: &mut Vec<u64>) -> PyResult<bool> {
    let Ok(list) = hs.cast::<PyList>() else {
        return Ok(false);
    };
    out.clear();
    out.reserve(list.len());
    for h in list.iter() {
        match as_key(&h) {
            Some(k) => out.push(k),
            None => return Ok(false),
        }
    }
    Ok(true)
}

/// The tokens of a run as u32s, or None (not a list of ints in range).
fn u32_tokens(toks: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> bool {
    let Ok(list) = toks.cast::<PyList>() else {
        return false;
    };
    out.clear();
    out.reserve(list.len());
    for t in list.iter() {
        match t.extract::<u32>() {
            Ok(x) => out.push(x),
            Err(_) => return false,
        }
    }
    true
}

/// The mask of `k` in a held map: Some(mask) from the columns (0 when absent), None when
/// the key sits in the side dict (a mask of more than 64 sources: the Python rules).
fn mask_of(core: &U64Map, side: &Bound<'_, PyDict>, k: u64) -> PyResult<Option<u64>> {
    if let Some(m) = core.get(k) {
        return Ok(Some(m));
    }
    if !side.is_empty() && side.contains(k)? {
        return Ok(None);
    }
    Ok(Some(0))
}

impl Ctx<'_, '_> {
    fn run(&self, events: &Bound<'_, PyList>, start: usize) -> PyResult<Applied> {
        let py = self.py;
        let mut stored = 0usize;
        let mut removed = 0usize;
        let mut hashes: Vec<u64> = Vec::new();
        let mut toks: Vec<u32> = Vec::new();
        let mut keys: Vec<u64> = Vec::new();
        let n = events.len();
        let table_side = self.table.other(py);
        let gpu_side = self.gpu.other(py);
        let mut i = start;
        while i < n {
            let ev = events.get_item(i)?;
            let cls = ev.get_type();
            let done = if cls.is(self.removed_cls) {
                self.removed(&ev, &mut hashes, table_side, gpu_side)?
            } else if cls.is(self.stored_cls) {
                self.stored(&ev, &mut hashes, &mut toks, &mut keys, table_side, gpu_side)?
            } else {
                None
            };
            match done {
                Some(k) if cls.is(self.removed_cls) => removed += k,
                Some(k) => stored += k,
                None => return Ok((i, stored, removed)),
            }
            i += 1;
        }
        Ok((n, stored, removed))
    }

    fn removed(
        &self,
        ev: &Bound<'_, PyAny>,
        hashes: &mut Vec<u64>,
        table_side: &Bound<'_, PyDict>,
        gpu_side: &Bound<'_, PyDict>,
    ) -> PyResult<Option<usize>> {
        let py = self.py;
        if !medium_is_gpu(ev)? || !group_is_zero(ev)? {
            return Ok(None);
        }
        if !u64_hashes(&ev.getattr(intern!(py, "block_hashes"))?, hashes)? {
            return Ok(None);
        }
        let mut table = self.table.write();
        let mut gpu = self.gpu.write();
        let _ = table_side;
        // Check every hash first: the event is applied whole or not at all.
        if has_dups(hashes) {
            return Ok(None);
        }
        let mut rks = Vec::with_capacity(hashes.len());
        for &eh in hashes.iter() {
            let Some(rk) = table.get(eh) else {
                return Ok(None);
            };
            if !self.copies.is_empty()
                && self
                    .copies
                    .contains(PyTuple::new(py, [eh, self.slot as u64, 0])?)?
            {
                return Ok(None);
            }
            match mask_of(&gpu, gpu_side, rk)? {
                Some(m) if m & self.bit != 0 => rks.push(rk),
                _ => return Ok(None),
            }
        }
        // Two hashes of one event under one key: the Python rules (they re-read masks).
        if has_dups(&rks) {
            return Ok(None);
        }
        for (&eh, &rk) in hashes.iter().zip(&rks) {
            let m = gpu.get(rk).unwrap_or(0) ^ self.bit;
            if m == 0 {
                gpu.remove(rk);
            } else {
                gpu.insert(rk, m);
            }
            let mut drop = true;
            if !self.href.is_empty() {
                if let Some(c) = self.href.get_item(eh)? {
                    self.href.del_item(eh)?;
                    let c: i64 = c.extract::<i64>()? - 1;
                    if c > 1 {
                        self.href.set_item(eh, c)?;
                    }
                    drop = c <= 0;
                }
            }
            if drop {
                table.remove(eh);
            }
        }
        Ok(Some(hashes.len()))
    }

    fn stored(
        &self,
        ev: &Bound<'_, PyAny>,
        hashes: &mut Vec<u64>,
        toks: &mut Vec<u32>,
        keys: &mut Vec<u64>,
        table_side: &Bound<'_, PyDict>,
        gpu_side: &Bound<'_, PyDict>,
    ) -> PyResult<Option<usize>> {
        let py = self.py;
        if !self.stores_ok || !medium_is_gpu(ev)? || !group_is_zero(ev)? {
            return Ok(None);
        }
        if !u64_hashes(&ev.getattr(intern!(py, "block_hashes"))?, hashes)? {
            return Ok(None);
        }
        let n = hashes.len();
        if n == 0 {
            return Ok(Some(0)); // the Python rules ignore an empty run too
        }
        let bsz = ev.getattr(intern!(py, "block_size"))?;
        if bsz.extract::<usize>().ok() != Some(self.r) {
            return Ok(None);
        }
        let extra = ev.getattr(intern!(py, "extra_keys"))?;
        if !extra.is_none() {
            let Ok(list) = extra.cast::<PyList>() else {
                return Ok(None);
            };
            if !list.is_empty() && (list.len() != n || list.iter().any(|x| !x.is_none())) {
                return Ok(None);
            }
        }
        if !u32_tokens(&ev.getattr(intern!(py, "token_ids"))?, toks) || toks.len() != n * self.r {
            return Ok(None);
        }
        let table = self.table.read();
        let parent = ev.getattr(intern!(py, "parent_block_hash"))?;
        let seed = if parent.is_none() {
            if !ev.getattr(intern!(py, "lora_name"))?.is_none()
                || !ev.getattr(intern!(py, "lora_id"))?.is_none()
            {
                return Ok(None);
            }
            let ra = self.reannounce;
            if ra != 0
                && (ra == 1 || !ev.getattr(intern!(py, "session_id"))?.is_none())
                && (table.contains(hashes[0])
                    || (!table_side.is_empty() && table_side.contains(hashes[0])?))
            {
                return Ok(None); // a re-announcement candidate
            }
            self.base_ns
        } else {
            match as_key(&parent).and_then(|p| table.get(p)) {
                Some(pv) => pv,
                None => return Ok(None), // unknown parent (unlinked), or a tuple of keys
            }
        };
        keys.clear();
        chain_into(toks, self.r, seed, keys);
        let gpu = self.gpu.read();
        let others: Vec<_> = self
            .others
            .iter()
            .map(|o| (o.read(), o.other(py)))
            .filter(|(c, s)| !c.is_empty() || !s.is_empty())
            .collect();
        if has_dups(hashes) || has_dups(keys) {
            return Ok(None);
        }
        let mut masks = Vec::with_capacity(n);
        for j in 0..n {
            let (eh, v) = (hashes[j], keys[j]);
            if table.contains(eh) || (!table_side.is_empty() && table_side.contains(eh)?) {
                return Ok(None); // known already
            }
            let Some(m) = mask_of(&gpu, gpu_side, v)? else {
                return Ok(None);
            };
            if m & self.fam != 0 {
                return Ok(None);
            }
            for (core, side) in &others {
                match mask_of(core, side, v)? {
                    Some(x) if x & self.fam == 0 => {}
                    _ => return Ok(None),
                }
            }
            if (!self.unl.is_empty() && self.unl.contains(eh)?)
                || (!self.waiting.is_empty() && self.waiting.contains(eh)?)
            {
                return Ok(None);
            }
            masks.push(m);
        }
        drop(others);
        drop(gpu);
        drop(table);
        if let Some(t) = self.touched {
            for &eh in hashes.iter() {
                t.add(eh)?;
            }
        }
        let mut table = self.table.write();
        let mut gpu = self.gpu.write();
        table.reserve(n);
        gpu.reserve(n);
        for j in 0..n {
            table.insert(hashes[j], keys[j]);
            gpu.insert(keys[j], masks[j] | self.bit);
        }
        Ok(Some(n))
    }
}

/// Apply ``events[start:]`` of one source (token keying) until the first event the native
/// rules do not cover; returns ``(that event's position or len(events), blocks stored,
/// blocks removed)``. See the module docs; the caller (``KVIndex``) passes its state.
#[pyfunction]
#[pyo3(signature = (events, start, stored_cls, removed_cls, table, held, slot, fam, r, base_ns,
                    reannounce, stores_ok, copies, href, unl, waiting, touched))]
#[allow(clippy::too_many_arguments)]
pub fn apply_tokens<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyList>,
    start: usize,
    stored_cls: &Bound<'py, PyAny>,
    removed_cls: &Bound<'py, PyAny>,
    table: PyRef<'py, NativeMap>,
    held: &Bound<'py, PyList>,
    slot: u32,
    fam: u64,
    r: usize,
    base_ns: u64,
    reannounce: u8,
    stores_ok: bool,
    copies: &Bound<'py, PyDict>,
    href: &Bound<'py, PyDict>,
    unl: &Bound<'py, PyDict>,
    waiting: &Bound<'py, PyDict>,
    touched: Option<Bound<'py, PySet>>,
) -> PyResult<Applied> {
    if slot >= 64 || r == 0 || held.is_empty() {
        return Ok((start, 0, 0));
    }
    let gpu: PyRef<'py, NativeMap> = held.get_item(0)?.extract()?;
    let mut others = Vec::new();
    for h in held.iter().skip(1) {
        others.push(h.extract::<PyRef<'py, NativeMap>>()?);
    }
    let ctx = Ctx {
        py,
        stored_cls,
        removed_cls,
        table: &table,
        gpu: &gpu,
        others,
        slot,
        bit: 1u64 << slot,
        fam,
        r,
        base_ns,
        reannounce,
        stores_ok,
        copies,
        href,
        unl,
        waiting,
        touched: touched.as_ref(),
    };
    ctx.run(events, start)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_tokens, m)?)
}
