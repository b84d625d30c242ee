//! Ingest: a run of decoded events applied to the residency table in one call.
//!
//! The index's common cases, exactly as `kvstream/routing/index.py` defines them, run
//! here without a Python call per block:
//!
//! * a `BlockStored` run in the GPU tier, group 0, engine blocks of one router block, no
//!   extra keys, whose blocks are each new (no hash known or unlinked or waited for; a key
//!   held by another hash of the family is a family conflict: the block goes under its
//!   alias key, as the Python rules' `_perturb` makes it) or known under the very key
//!   chained from the tokens (a prefix other engines cached first: one more holder; one
//!   this source holds already: one more copy in its copy record), and whose parent is
//!   known (or None, base namespace, not a re-announcement candidate): keys chained from
//!   the tokens, every block installed. The copy records are read live, so an event
//!   after a further copy in the same call sees it (the stream fault campaign's seed 8
//!   found a removal that did not, when the records were read once per call);
//! * a `BlockRemoved` in the GPU tier, group 0, from a source of one-router-block blocks,
//!   of hashes held once (no copy record).
//!
//! An event naming a hash the index holds under two block sizes (its `_xbs`), as a block
//! or as a parent, is always left to the Python rules, which translate it.
//!
//! Anything else (and any event that fails one check) is left to the Python rules: the
//! call returns the position of the first event it did not apply, having changed nothing
//! for that event, and the caller applies it and calls again from the next one. So the
//! native path is an exact subset of the Python one; the tests compare both.

use std::cell::Cell;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyTuple};
use xxhash_rust::xxh3::xxh3_64;

use crate::decode::{Batch, Ev, Kind, Parent, RawBatch};
use crate::keys::{chain_into, KEY_MASK};
use crate::table::{as_key, NativeMap, U64Map};

/// What one call did: (next event to apply in Python, blocks stored, blocks removed).
type Applied = (usize, usize, usize);

/// One call's view of the index. The maps are locked once for the call: nothing it calls
/// back into (dicts, sets of ints) can reach them.
struct Ctx<'a, 'py> {
    py: Python<'py>,
    stored_cls: &'a Bound<'py, PyAny>,
    removed_cls: &'a Bound<'py, PyAny>,
    /// The side dicts of the table and the GPU map are empty (they cannot fill during a
    /// call: only u64 entries are written here).
    table_plain: bool,
    gpu_plain: bool,
    slot: u32,
    bit: u64,
    fam: u64,
    r: usize,
    base_ns: u64,
    reannounce: u8,
    stores_ok: bool,
    /// The copy records, read live: a stored run here adds to them (further copies), so a
    /// later event of the same call must see what an earlier one wrote.
    copies: &'a Bound<'py, PyDict>,
    /// Stored blocks that were further copies of blocks the source held already (they
    /// count in `stats.stored_blocks`, not in the source's holdings).
    copied: Cell<usize>,
    href: &'a Bound<'py, PyDict>,
    unl: Option<&'a Bound<'py, PyDict>>,
    waiting: Option<&'a Bound<'py, PyDict>>,
    /// Engine hashes held under two block sizes (the index's ``_xbs``): the Python rules
    /// translate their events to each size's own id.
    sized: Option<&'a Bound<'py, PyDict>>,
    touched: Option<&'a Bound<'py, PySet>>,
    /// Blocks stored under an alias key (``stats.family_conflicts``).
    conflicts: Cell<usize>,
}

/// The alias key of a block whose key another hash of its family holds: the Python
/// rules' ``_perturb`` (xxh3_64 of the key, a tag and the engine hash, masked to a router
/// key), which no token prompt produces.
fn alias_key(v: u64, eh: u64) -> u64 {
    let mut buf = [0u8; 31];
    buf[..8].copy_from_slice(&v.to_le_bytes());
    buf[8..23].copy_from_slice(b"\xffkvstream-alias");
    buf[23..].copy_from_slice(&eh.to_le_bytes());
    xxh3_64(&buf) & KEY_MASK
}

/// What a stored run does to one of its blocks.
#[derive(Clone, Copy)]
enum Block {
    /// A hash the table does not know: installed under its key.
    New,
    /// Known, held by other sources: this source becomes one more holder.
    Shared,
    /// Held by this source already: one more copy of it.
    Again,
}

/// How a stored run starts: at block 0 (`base`: no LoRA; `session`: a session id, read
/// only under the "session" re-announcement rule), or after a parent column key.
#[derive(Clone, Copy)]
enum Head {
    Root { base: bool, session: bool },
    Parent(u64),
}

/// The maps one call works on, locked.
struct Maps<'g> {
    table: &'g mut U64Map,
    gpu: &'g mut U64Map,
    /// The other media's maps that hold anything, with their side dicts.
    others: Vec<(&'g U64Map, Bound<'g, PyDict>)>,
    table_side: Bound<'g, PyDict>,
}

fn none_if_empty<'a, 'py>(d: &'a Bound<'py, PyDict>) -> Option<&'a Bound<'py, PyDict>> {
    if d.is_empty() {
        None
    } else {
        Some(d)
    }
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
#[inline]
fn mask_of(core: &U64Map, plain: bool, side: &Bound<'_, PyDict>, k: u64) -> PyResult<Option<u64>> {
    if let Some(m) = core.get(k) {
        return Ok(Some(m));
    }
    if !plain && side.contains(k)? {
        return Ok(None);
    }
    Ok(Some(0))
}

impl Ctx<'_, '_> {
    /// The (hash, source, GPU tier) copy record's key.
    fn record_key(&self, eh: u64) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(self.py, [eh, self.slot as u64, 0])
    }

    /// Whether this source keeps a copy record of `eh` in the GPU tier (more than one copy,
    /// or copies in other groups).
    fn has_copy_record(&self, eh: u64) -> PyResult<bool> {
        Ok(!self.copies.is_empty() && self.copies.contains(self.record_key(eh)?)?)
    }

    /// The Python rules' `_add_copy_record` of a block this source holds already, group 0:
    /// its record counts one more copy (`{0: 2}` when it had none: one copy, now two).
    fn add_copy(&self, eh: u64) -> PyResult<()> {
        let key = self.record_key(eh)?;
        match self.copies.get_item(&key)? {
            Some(cp) => {
                let cp = cp.cast_into::<PyDict>()?;
                let c: i64 = match cp.get_item(0)? {
                    Some(c) => c.extract()?,
                    None => 0,
                };
                cp.set_item(0, c + 1)?;
            }
            None => {
                let cp = PyDict::new(self.py);
                cp.set_item(0, 2)?;
                self.copies.set_item(key, cp)?;
            }
        }
        self.copied.set(self.copied.get() + 1);
        Ok(())
    }

    /// Any of ``hashes`` is held under two block sizes (the Python rules translate it).
    fn sized_any(&self, hashes: &[u64]) -> PyResult<bool> {
        let Some(d) = self.sized else {
            return Ok(false);
        };
        for &h in hashes {
            if d.contains(h)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn run(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        events: &Bound<'_, PyList>,
        start: usize,
    ) -> PyResult<Applied> {
        let mut stored = 0usize;
        let mut removed = 0usize;
        let mut hashes: Vec<u64> = Vec::new();
        let mut toks: Vec<u32> = Vec::new();
        let mut keys: Vec<u64> = Vec::new();
        let mut masks: Vec<u64> = Vec::new();
        let n = events.len();
        let mut i = start;
        while i < n {
            let ev = events.get_item(i)?;
            let cls = ev.get_type();
            let done = if cls.is(self.removed_cls) {
                self.removed(maps, gpu_side, &ev, &mut hashes, &mut keys)?
                    .map(|k| removed += k)
            } else if cls.is(self.stored_cls) {
                self.stored(
                    maps,
                    gpu_side,
                    &ev,
                    &mut hashes,
                    &mut toks,
                    &mut keys,
                    &mut masks,
                )?
                .map(|k| stored += k)
            } else {
                None
            };
            if done.is_none() {
                return Ok((i, stored, removed));
            }
            i += 1;
        }
        Ok((n, stored, removed))
    }

    /// [`Ctx::run`] over a decoded raw payload: the same rules, the fields read from the
    /// reader's columns instead of Python objects.
    fn run_raw(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        b: &Batch,
        start: usize,
    ) -> PyResult<Applied> {
        let mut stored = 0usize;
        let mut removed = 0usize;
        let mut keys: Vec<u64> = Vec::new();
        let mut masks: Vec<u64> = Vec::new();
        let n = b.events.len();
        for i in start..n {
            let ev = &b.events[i];
            let done = match ev.kind {
                _ if !ev.gpu || !ev.group0 || !ev.hashes_ok => None,
                Kind::Removed => self
                    .removed_run(maps, gpu_side, ev.hashes(b), &mut keys)?
                    .map(|k| removed += k),
                Kind::Stored => self
                    .stored_raw(maps, gpu_side, b, ev, &mut keys, &mut masks)?
                    .map(|k| stored += k),
                Kind::Cleared => None,
            };
            if done.is_none() {
                return Ok((i, stored, removed));
            }
        }
        Ok((n, stored, removed))
    }

    /// The checks of [`Ctx::stored`] on a decoded event, then [`Ctx::stored_run`].
    fn stored_raw(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        b: &Batch,
        ev: &Ev,
        keys: &mut Vec<u64>,
        masks: &mut Vec<u64>,
    ) -> PyResult<Option<usize>> {
        if !self.stores_ok {
            return Ok(None);
        }
        let hashes = ev.hashes(b);
        let n = hashes.len();
        if n == 0 {
            return Ok(Some(0)); // the Python rules ignore an empty run too
        }
        if ev.block_size != Some(self.r as u64) || !ev.extras_plain() || !ev.tokens_ok {
            return Ok(None);
        }
        let toks = ev.tokens(b);
        if toks.len() != n * self.r {
            return Ok(None);
        }
        let head = match ev.parent {
            Parent::None => Head::Root {
                base: ev.base,
                session: ev.session,
            },
            Parent::Key(p) => Head::Parent(p),
            Parent::Other => return Ok(None),
        };
        self.stored_run(maps, gpu_side, hashes, toks, head, keys, masks)
    }

    fn removed(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        ev: &Bound<'_, PyAny>,
        hashes: &mut Vec<u64>,
        rks: &mut Vec<u64>,
    ) -> PyResult<Option<usize>> {
        let py = self.py;
        if !medium_is_gpu(ev)? || !group_is_zero(ev)? {
            return Ok(None);
        }
        if !u64_hashes(&ev.getattr(intern!(py, "block_hashes"))?, hashes)? {
            return Ok(None);
        }
        self.removed_run(maps, gpu_side, hashes, rks)
    }

    /// A GPU, group-0 `BlockRemoved` of column-key hashes (from either front end).
    fn removed_run(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        hashes: &[u64],
        rks: &mut Vec<u64>,
    ) -> PyResult<Option<usize>> {
        // Check every hash first: the event is applied whole or not at all. A source of
        // larger (or not yet known) blocks holds keys of several router blocks: the
        // Python rules, which also translate a hash another block size holds.
        if !self.stores_ok || has_dups(hashes) || self.sized_any(hashes)? {
            return Ok(None);
        }
        rks.clear();
        for &eh in hashes.iter() {
            let Some(rk) = maps.table.get(eh) else {
                return Ok(None);
            };
            if self.has_copy_record(eh)? {
                return Ok(None);
            }
            match mask_of(maps.gpu, self.gpu_plain, gpu_side, rk)? {
                Some(m) if m & self.bit != 0 => rks.push(rk),
                _ => return Ok(None),
            }
        }
        // Two hashes of one event under one key: the Python rules (they re-read masks).
        if has_dups(rks) {
            return Ok(None);
        }
        for (&eh, &rk) in hashes.iter().zip(rks.iter()) {
            let m = maps.gpu.get(rk).unwrap_or(0) ^ self.bit;
            if m == 0 {
                maps.gpu.remove(rk);
            } else {
                maps.gpu.insert(rk, m);
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
                maps.table.remove(eh);
            }
        }
        Ok(Some(hashes.len()))
    }

    #[allow(clippy::too_many_arguments)]
    fn stored(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        ev: &Bound<'_, PyAny>,
        hashes: &mut Vec<u64>,
        toks: &mut Vec<u32>,
        keys: &mut Vec<u64>,
        masks: &mut Vec<u64>,
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
        let parent = ev.getattr(intern!(py, "parent_block_hash"))?;
        let head = if parent.is_none() {
            let base = ev.getattr(intern!(py, "lora_name"))?.is_none()
                && ev.getattr(intern!(py, "lora_id"))?.is_none();
            let session = self.reannounce == 2 && !ev.getattr(intern!(py, "session_id"))?.is_none();
            Head::Root { base, session }
        } else {
            match as_key(&parent) {
                Some(p) => Head::Parent(p),
                None => return Ok(None), // bytes, 0, or a tuple of keys
            }
        };
        self.stored_run(maps, gpu_side, hashes, toks, head, keys, masks)
    }

    /// A GPU, group-0 `BlockStored` of `r`-token blocks, its tokens checked (from either
    /// front end): the parent and every block checked, then every block installed.
    #[allow(clippy::too_many_arguments)]
    fn stored_run(
        &self,
        maps: &mut Maps<'_>,
        gpu_side: &Bound<'_, PyDict>,
        hashes: &[u64],
        toks: &[u32],
        head: Head,
        keys: &mut Vec<u64>,
        masks: &mut Vec<u64>,
    ) -> PyResult<Option<usize>> {
        let n = hashes.len();
        let known = |m: &Maps<'_>, h: u64| -> PyResult<bool> {
            Ok(m.table.contains(h) || (!self.table_plain && m.table_side.contains(h)?))
        };
        let seed = match head {
            Head::Root { base, session } => {
                if !base {
                    return Ok(None);
                }
                let ra = self.reannounce;
                if ra != 0 && (ra == 1 || session) && known(maps, hashes[0])? {
                    return Ok(None); // a re-announcement candidate
                }
                self.base_ns
            }
            Head::Parent(p) => match maps.table.get(p) {
                Some(_) if self.sized_any(&[p])? => return Ok(None),
                Some(pv) => pv,
                None => return Ok(None), // unknown parent (unlinked), or a tuple of keys
            },
        };
        if self.sized_any(hashes)? {
            return Ok(None); // a hash another block size holds: the Python rules
        }
        keys.clear();
        chain_into(toks, self.r, seed, keys);
        if has_dups(hashes) || has_dups(keys) {
            return Ok(None);
        }
        masks.clear();
        // Per block: new, known (a new holder of a block other sources hold), or held by
        // this source already (one more copy).
        let mut shared: Vec<Block> = Vec::with_capacity(n);
        let mut aliased = 0usize;
        for j in 0..n {
            let (eh, v) = (hashes[j], keys[j]);
            let Some(m) = mask_of(maps.gpu, self.gpu_plain, gpu_side, v)? else {
                return Ok(None);
            };
            if let Some(cur) = maps.table.get(eh) {
                // Known already, under the very key chained from the tokens (else: the
                // Python rules' key conflict). Not held by this source yet (a prefix other
                // engines cached first): the Python rules add one more holder, with no copy
                // record. Held by it already (the same blocks stored again; a run that may
                // be a re-announcement went to the Python rules above): one more copy, in
                // its copy record. With a TTL (generations of the table: `touched`), the
                // Python rules.
                if cur != v || m == 0 || self.touched.is_some() {
                    return Ok(None);
                }
                let again = m & self.bit != 0;
                if !again && self.has_copy_record(eh)? {
                    return Ok(None);
                }
                if self.unl.is_some_and(|d| d.contains(eh).unwrap_or(true))
                    || self.waiting.is_some_and(|d| d.contains(eh).unwrap_or(true))
                {
                    return Ok(None);
                }
                masks.push(m);
                shared.push(if again { Block::Again } else { Block::Shared });
                continue;
            }
            if !self.table_plain && maps.table_side.contains(eh)? {
                return Ok(None); // known, under keys of several router blocks
            }
            let mut any = m;
            for (core, side) in &maps.others {
                match mask_of(core, side.is_empty(), side, v)? {
                    Some(x) => any |= x,
                    None => return Ok(None),
                }
            }
            if self.unl.is_some_and(|d| d.contains(eh).unwrap_or(true))
                || self.waiting.is_some_and(|d| d.contains(eh).unwrap_or(true))
            {
                return Ok(None);
            }
            if any & self.fam != 0 {
                // Another hash of this block-size family holds this key (the same tokens
                // under another engine's hashes): the Python rules' family conflict, this
                // hash under its own alias key, held by this source alone. A held alias
                // (never in practice): the Python rules.
                let alias = alias_key(v, eh);
                if mask_of(maps.gpu, self.gpu_plain, gpu_side, alias)? != Some(0) {
                    return Ok(None);
                }
                keys[j] = alias;
                aliased += 1;
                masks.push(0);
            } else {
                masks.push(m);
            }
            shared.push(Block::New);
        }
        // An alias equal to another block's key of this event: the Python rules (which see
        // the earlier block's install).
        if aliased > 0 && has_dups(keys) {
            return Ok(None);
        }
        self.conflicts.set(self.conflicts.get() + aliased);
        if let Some(t) = self.touched {
            for &eh in hashes.iter() {
                t.add(eh)?;
            }
        }
        maps.table.reserve(n);
        maps.gpu.reserve(n);
        let mut again = 0usize;
        for j in 0..n {
            let m = masks[j];
            match shared[j] {
                Block::Again => {
                    self.add_copy(hashes[j])?;
                    again += 1;
                }
                Block::Shared => {
                    // One more holder of a known hash (the Python rules' `_hold`, not fresh).
                    maps.gpu.insert(keys[j], m | self.bit);
                    let eh = hashes[j];
                    let c: i64 = match self.href.get_item(eh)? {
                        Some(c) => c.extract()?,
                        None => 1,
                    };
                    self.href.set_item(eh, c + 1)?;
                }
                Block::New => {
                    maps.table.insert(hashes[j], keys[j]);
                    maps.gpu.insert(keys[j], m | self.bit);
                }
            }
        }
        Ok(Some(n - again))
    }
}

/// Apply ``events[start:]`` of one source (token keying) until the first event the native
/// rules do not cover; returns ``(that event's position or len(events), blocks stored,
/// blocks removed, blocks stored under an alias key: family conflicts)``. See the module
/// docs; the caller (``KVIndex``) passes its state.
#[pyfunction]
#[pyo3(signature = (events, start, stored_cls, removed_cls, table, held, slot, fam, r, base_ns,
                    reannounce, stores_ok, copies, href, unl, waiting, sized, touched))]
#[allow(clippy::too_many_arguments)]
pub fn apply_tokens<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
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
    sized: &Bound<'py, PyDict>,
    touched: Option<Bound<'py, PySet>>,
) -> PyResult<(usize, usize, usize, usize, usize)> {
    if slot >= 64 || r == 0 || held.is_empty() {
        return Ok((start, 0, 0, 0, 0));
    }
    let gpu: PyRef<'py, NativeMap> = held.get_item(0)?.extract()?;
    let mut others = Vec::new();
    for h in held.iter().skip(1) {
        others.push(h.extract::<PyRef<'py, NativeMap>>()?);
    }
    let gpu_side = gpu.other(py).clone();
    let table_side = table.other(py).clone();
    let ctx = Ctx {
        py,
        stored_cls,
        removed_cls,
        table_plain: table_side.is_empty(),
        gpu_plain: gpu_side.is_empty(),
        slot,
        bit: 1u64 << slot,
        fam,
        r,
        base_ns,
        reannounce,
        stores_ok,
        copies,
        copied: Cell::new(0),
        href,
        unl: none_if_empty(unl),
        waiting: none_if_empty(waiting),
        sized: none_if_empty(sized),
        touched: touched.as_ref(),
        conflicts: Cell::new(0),
    };
    let same = |a: &NativeMap, b: &NativeMap| std::ptr::eq(a, b);
    if same(&table, &gpu) || others.iter().any(|o| same(o, &table) || same(o, &gpu)) {
        return Ok((start, 0, 0, 0, 0)); // one map in two roles (never the index's layout): locked twice
    }
    let mut table_g = table.write();
    let mut gpu_g = gpu.write();
    let other_g: Vec<_> = others
        .iter()
        .map(|o| (o.read(), o.other(py).clone()))
        .collect();
    let mut maps = Maps {
        table: &mut table_g,
        gpu: &mut gpu_g,
        others: other_g
            .iter()
            .filter(|(c, s)| !c.is_empty() || !s.is_empty())
            .map(|(c, s)| (&**c, s.clone()))
            .collect(),
        table_side,
    };
    let (next, stored, removed) = if let Ok(raw) = events.cast::<RawBatch>() {
        ctx.run_raw(&mut maps, &gpu_side, &raw.get().batch, start)?
    } else {
        ctx.run(&mut maps, &gpu_side, events.cast::<PyList>()?, start)?
    };
    Ok((next, stored, removed, ctx.conflicts.get(), ctx.copied.get()))
}

/// Engine keying's common cases (``_apply_engine``): a GPU, group-0 ``BlockStored`` of
/// ``b``-token blocks whose int hashes this source holds none of (and not a
/// re-announcement candidate) sets the source's bit per hash; a GPU, group-0
/// ``BlockRemoved`` of hashes it holds once (no copy record) clears it. Returns like
/// :func:`apply_tokens`.
#[pyfunction]
#[pyo3(signature = (events, start, stored_cls, removed_cls, gpu, slot, b, reannounce, stores_ok,
                    copies, touched))]
#[allow(clippy::too_many_arguments)]
pub fn apply_engine<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    start: usize,
    stored_cls: &Bound<'py, PyAny>,
    removed_cls: &Bound<'py, PyAny>,
    gpu: PyRef<'py, NativeMap>,
    slot: u32,
    b: usize,
    reannounce: u8,
    stores_ok: bool,
    copies: &Bound<'py, PyDict>,
    touched: Option<Bound<'py, PySet>>,
) -> PyResult<Applied> {
    if slot >= 64 || !gpu.other(py).is_empty() {
        return Ok((start, 0, 0));
    }
    let bit = 1u64 << slot;
    let copies = none_if_empty(copies);
    let mut g = gpu.write();
    if let Ok(raw) = events.cast::<RawBatch>() {
        let touch = |hs: &[u64]| -> PyResult<()> {
            if let Some(t) = touched.as_ref() {
                for &eh in hs {
                    t.add(eh)?;
                }
            }
            Ok(())
        };
        return engine_raw(
            py,
            &mut g,
            &raw.get().batch,
            start,
            slot,
            b,
            reannounce,
            stores_ok,
            copies,
            touch,
        );
    }
    let events = events.cast::<PyList>()?;
    let mut hashes: Vec<u64> = Vec::new();
    let (mut stored, mut removed) = (0usize, 0usize);
    let n = events.len();
    for i in start..n {
        let ev = events.get_item(i)?;
        let cls = ev.get_type();
        let is_removed = cls.is(removed_cls);
        if !(is_removed || (stores_ok && cls.is(stored_cls)))
            || !medium_is_gpu(&ev)?
            || !group_is_zero(&ev)?
            || !u64_hashes(&ev.getattr(intern!(py, "block_hashes"))?, &mut hashes)?
            || has_dups(&hashes)
        {
            return Ok((i, stored, removed));
        }
        if is_removed {
            for &eh in &hashes {
                if g.get(eh).unwrap_or(0) & bit == 0 {
                    return Ok((i, stored, removed));
                }
                if let Some(c) = copies {
                    if c.contains(PyTuple::new(py, [eh, slot as u64, 0])?)? {
                        return Ok((i, stored, removed));
                    }
                }
            }
            for &eh in &hashes {
                let m = g.get(eh).unwrap_or(0) ^ bit;
                if m == 0 {
                    g.remove(eh);
                } else {
                    g.insert(eh, m);
                }
            }
            removed += hashes.len();
            continue;
        }
        if hashes.is_empty() {
            continue; // the Python rules skip an empty run
        }
        let bsz = ev.getattr(intern!(py, "block_size"))?;
        if bsz.extract::<usize>().ok() != Some(b) {
            return Ok((i, stored, removed));
        }
        if reannounce != 0
            && ev.getattr(intern!(py, "parent_block_hash"))?.is_none()
            && (reannounce == 1 || !ev.getattr(intern!(py, "session_id"))?.is_none())
            && g.get(hashes[0]).unwrap_or(0) & bit != 0
        {
            return Ok((i, stored, removed)); // a re-announcement candidate
        }
        if hashes.iter().any(|&eh| g.get(eh).unwrap_or(0) & bit != 0) {
            return Ok((i, stored, removed)); // another copy of a held hash
        }
        if let Some(t) = touched.as_ref() {
            for &eh in &hashes {
                t.add(eh)?;
            }
        }
        g.reserve(hashes.len());
        for &eh in &hashes {
            let m = g.get(eh).unwrap_or(0);
            g.insert(eh, m | bit);
        }
        stored += hashes.len();
    }
    Ok((n, stored, removed))
}

/// [`apply_engine`]'s rules over a decoded raw payload.
#[allow(clippy::too_many_arguments)]
fn engine_raw(
    py: Python<'_>,
    g: &mut U64Map,
    batch: &Batch,
    start: usize,
    slot: u32,
    b: usize,
    reannounce: u8,
    stores_ok: bool,
    copies: Option<&Bound<'_, PyDict>>,
    touch: impl Fn(&[u64]) -> PyResult<()>,
) -> PyResult<Applied> {
    let bit = 1u64 << slot;
    let (mut stored, mut removed) = (0usize, 0usize);
    let n = batch.events.len();
    for i in start..n {
        let ev = &batch.events[i];
        let is_removed = ev.kind == Kind::Removed;
        let hashes = ev.hashes(batch);
        if !(is_removed || (stores_ok && ev.kind == Kind::Stored))
            || !ev.gpu
            || !ev.group0
            || !ev.hashes_ok
            || has_dups(hashes)
        {
            return Ok((i, stored, removed));
        }
        if is_removed {
            for &eh in hashes {
                if g.get(eh).unwrap_or(0) & bit == 0 {
                    return Ok((i, stored, removed));
                }
                if let Some(c) = copies {
                    if c.contains(PyTuple::new(py, [eh, slot as u64, 0])?)? {
                        return Ok((i, stored, removed));
                    }
                }
            }
            for &eh in hashes {
                let m = g.get(eh).unwrap_or(0) ^ bit;
                if m == 0 {
                    g.remove(eh);
                } else {
                    g.insert(eh, m);
                }
            }
            removed += hashes.len();
            continue;
        }
        if hashes.is_empty() {
            continue; // the Python rules skip an empty run
        }
        if ev.block_size != Some(b as u64) {
            return Ok((i, stored, removed));
        }
        if reannounce != 0
            && ev.parent == Parent::None
            && (reannounce == 1 || ev.session)
            && g.get(hashes[0]).unwrap_or(0) & bit != 0
        {
            return Ok((i, stored, removed)); // a re-announcement candidate
        }
        if hashes.iter().any(|&eh| g.get(eh).unwrap_or(0) & bit != 0) {
            return Ok((i, stored, removed)); // another copy of a held hash
        }
        touch(hashes)?;
        g.reserve(hashes.len());
        for &eh in hashes {
            let m = g.get(eh).unwrap_or(0);
            g.insert(eh, m | bit);
        }
        stored += hashes.len();
    }
    Ok((n, stored, removed))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(apply_engine, m)?)
}
