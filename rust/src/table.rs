//! The residency table's storage: `u64 -> u64` maps laid out as one column of pairs and an
//! index of 4-byte slots sized to its load.
//!
//! [`U64Map`] keeps (key, value) pairs in one `Vec<[u64; 2]>` column (insertion order; a
//! position freed by a removal is reused by the next insert; grown by an eighth at a time,
//! so at most 1/8 of it is spare room) and an index of column positions over it. Up to
//! [`SWISS_MAX`] entries the index is a SwissTable (`hashbrown::HashTable<u32>`: 5 bytes a
//! bucket, power-of-two sized, 44-88 % full; its 16-wide tag groups probe fastest while
//! the map sits in the CPU cache). Past that it is an open-addressing array of 4-byte
//! slots, each a column position plus a tag of the key's hash (ruling out almost every
//! other key without reading the column), probed linearly from a start that a multiply
//! maps onto any slot count. Because the slot count need not be a power of two, the slots
//! are sized to their load: 55-75 % in use (live or deleted marks), 5.3-7.3 bytes per
//! entry. A big entry costs 16-18 bytes of column plus that (22.6 at 10**6 entries, where
//! the SwissTable cost 27.3 and a CPython dict with an int object per key ~80). The hash
//! is a random `foldhash` state, so crafted keys cannot pile up in one probe run. Key 0
//! marks a free column position, so 0 is not a column key.
//!
//! A removal leaves a deleted mark unless the next slot is empty (then it and the marks
//! before it become empty); when live entries and marks reach 75 % of the
//! slots the index is rebuilt from the column (a sequential read), the same size if the
//! live entries are under 65 % of the slots, else grown to 55 %: a rebuild pays for at
//! least a tenth of the slots' worth of inserts.
//!
//! [`NativeMap`] is the Python face (`kvstream._native.NativeMap`): a mapping with a
//! dict's behaviour for any key and value. Entries whose key is an int in `[1, 2**64)` and
//! whose value is an int in `[0, 2**64)` live in the column; anything else (bytes hashes,
//! tuples of router keys, masks of more than 64 sources) in a plain dict beside it, so the
//! index above needs no second code path. Every byte the column, the free list and the
//! slots allocate is counted ([`U64Map::bytes`]): the index's memory bound holds on what
//! the table really holds.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::{DefaultHashBuilder, HashTable};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyTuple};
use std::hash::BuildHasher;

/// An empty slot.
const EMPTY: u32 = 0;
/// A slot whose entry was removed (probe runs continue past it). Never a live slot: the
/// position field of a live slot is at most `max_used + 1 < 2**shift - 1`.
const DELETED: u32 = u32::MAX;

/// Up to this many entries a map's index is a SwissTable (`hashbrown::HashTable<u32>` of
/// column positions: 5 bytes a bucket at 44-88 % load, and its 16-wide tag groups probe
/// fastest while the map is in the CPU cache); past it, the slots (4 bytes at 55-75 %
/// load; where cache misses set the pace they are no slower). A map goes back to the
/// SwissTable only when shrunk or emptied.
pub const SWISS_MAX: usize = 1 << 17;

/// An insertion-ordered `u64 -> u64` map (keys non-zero); see the module docs.
#[derive(Default)]
pub struct U64Map {
    /// (key, value) pairs; key 0 marks a free position.
    cols: Vec<[u64; 2]>,
    free: Vec<u32>,
    /// The index while the map is small (`slots` empty): see [`SWISS_MAX`].
    swiss: HashTable<u32>,
    /// Column position + 1 in the low `shift` bits, the hash's tag above them.
    slots: Vec<u32>,
    /// Bits of a slot holding the position (the rest hold the tag).
    pos_mask: u32,
    /// Slots live or deleted, and the most allowed before a rebuild (75 % of the slots).
    used: usize,
    max_used: usize,
    hasher: DefaultHashBuilder,
    live: usize,
}

/// Where a probe for a key ended.
enum Probe {
    /// The key's slot.
    Found(usize),
    /// Absent; where an insert goes (the first deleted mark on the way, else the empty
    /// slot that ended the run) and whether that slot is empty.
    Absent(usize, bool),
}

impl U64Map {
    pub fn new() -> Self {
        Self::default()
    }

    #[inline]
    fn hash(&self, k: u64) -> u64 {
        self.hasher.hash_one(k)
    }

    /// The first slot of `h`'s probe run: `h` scaled onto `[0, slots)` by a multiply.
    #[inline]
    fn home(&self, h: u64) -> usize {
        ((h as u128 * self.slots.len() as u128) >> 64) as usize
    }

    #[inline]
    fn tag(&self, h: u64) -> u32 {
        (h as u32) & !self.pos_mask
    }

    /// Entries held.
    #[inline]
    pub fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    #[inline]
    fn probe(&self, k: u64, h: u64) -> Probe {
        let n = self.slots.len();
        let tag = self.tag(h);
        let mut i = self.home(h);
        let mut mark = usize::MAX;
        loop {
            // Ends: at most 75 % of the slots are used, so an empty slot comes.
            let s = self.slots[i];
            if s == EMPTY {
                return if mark == usize::MAX {
                    Probe::Absent(i, true)
                } else {
                    Probe::Absent(mark, false)
                };
            }
            if s == DELETED {
                if mark == usize::MAX {
                    mark = i;
                }
            } else if s & !self.pos_mask == tag
                && self.cols[((s & self.pos_mask) - 1) as usize][0] == k
            {
                return Probe::Found(i);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    #[inline]
    fn pos(&self, slot: usize) -> usize {
        ((self.slots[slot] & self.pos_mask) - 1) as usize
    }

    /// The value of `k` (None for absent keys and for 0).
    #[inline]
    pub fn get(&self, k: u64) -> Option<u64> {
        if k == 0 || self.live == 0 {
            return None;
        }
        let h = self.hash(k);
        if self.slots.is_empty() {
            let cols = &self.cols;
            return self
                .swiss
                .find(h, |&j| cols[j as usize][0] == k)
                .map(|&j| cols[j as usize][1]);
        }
        match self.probe(k, h) {
            Probe::Found(i) => Some(self.cols[self.pos(i)][1]),
            Probe::Absent(..) => None,
        }
    }

    #[inline]
    pub fn contains(&self, k: u64) -> bool {
        self.get(k).is_some()
    }

    /// Rebuild the index from the column with room for `entries` live entries: the same
    /// slot count when that stays under 65 % of it (only the deleted marks go), else
    /// enough slots for 55 % load.
    fn rebuild(&mut self, entries: usize) {
        let n = self.slots.len();
        let want = entries.max(self.cols.len());
        let m = if n >= 16 && want * 20 <= n * 13 {
            n
        } else {
            (want * 20 / 11 + 1).max(16)
        };
        self.rebuild_to(m);
    }

    fn rebuild_to(&mut self, m: usize) {
        self.rebuild_to_empty(m);
        for j in 0..self.cols.len() {
            let k = self.cols[j][0];
            if k == 0 {
                continue;
            }
            let h = self.hash(k);
            let mut i = self.home(h);
            while self.slots[i] != EMPTY {
                i += 1;
                if i == m {
                    i = 0;
                }
            }
            self.slots[i] = self.tag(h) | (j as u32 + 1);
            self.used += 1;
        }
    }

    /// `m` empty slots (the column untouched): [`Self::rebuild_to`]'s first half.
    fn rebuild_to_empty(&mut self, m: usize) {
        let max_used = m * 3 / 4;
        // Positions + 1 run to max_used; a live slot's position field is never all ones.
        let bits = (64 - (max_used as u64 + 1).leading_zeros()).min(32);
        self.pos_mask = if bits >= 32 {
            u32::MAX
        } else {
            (1u32 << bits) - 1
        };
        self.max_used = max_used;
        self.slots = Vec::new(); // the old slots go before the new are allocated
        self.slots.reserve_exact(m);
        self.slots.resize(m, EMPTY);
        self.used = 0;
    }

    /// Fill an empty map with `ks[i] -> vs[i]` (keys non-zero, columns of one length) in
    /// one pass: the pairs go into the column in order, then every slot value (tag and
    /// position) into the slots in the order of its home slot (a radix sort of the
    /// homes), so the probes walk the slots front to back instead of missing the cache
    /// once a key. Returns the first key found twice (the map emptied again).
    pub fn load_fresh(&mut self, ks: &[u64], vs: &[u64]) -> Result<(), u64> {
        debug_assert!(self.is_empty() && ks.len() == vs.len());
        let n = ks.len();
        if n <= SWISS_MAX {
            self.reserve(n);
            for (&k, &v) in ks.iter().zip(vs) {
                if self.insert(k, v).is_some() {
                    self.clear();
                    return Err(k);
                }
            }
            return Ok(());
        }
        self.clear();
        self.cols = ks.iter().zip(vs).map(|(&k, &v)| [k, v]).collect();
        self.rebuild_to_empty((n * 20 / 11 + 1).max(16));
        // home << 32 | slot value, sorted by home: LSD radix, a byte a pass.
        let m = self.slots.len();
        let mut order: Vec<u64> = ks
            .iter()
            .enumerate()
            .map(|(j, &k)| {
                let h = self.hash(k);
                (self.home(h) as u64) << 32 | (self.tag(h) | (j as u32 + 1)) as u64
            })
            .collect();
        let bits = 64 - (m as u64).leading_zeros();
        let mut tmp = vec![0u64; n];
        let mut shift = 32;
        while shift < 32 + bits {
            let mut count = [0usize; 257];
            for &x in &order {
                count[((x >> shift) & 0xff) as usize + 1] += 1;
            }
            for b in 1..257 {
                count[b] += count[b - 1];
            }
            for &x in &order {
                let d = ((x >> shift) & 0xff) as usize;
                tmp[count[d]] = x;
                count[d] += 1;
            }
            std::mem::swap(&mut order, &mut tmp);
            shift += 8;
        }
        drop(tmp);
        let pm = self.pos_mask;
        for &x in &order {
            let sv = x as u32;
            let mut i = (x >> 32) as usize;
            loop {
                let s = self.slots[i];
                if s == EMPTY {
                    break;
                }
                // The same tag: compare the keys (a repeated key has the same home, so it
                // passes the first one's slot).
                if s & !pm == sv & !pm {
                    let k = self.cols[((sv & pm) - 1) as usize][0];
                    if self.cols[((s & pm) - 1) as usize][0] == k {
                        self.clear();
                        return Err(k);
                    }
                }
                i += 1;
                if i == m {
                    i = 0;
                }
            }
            self.slots[i] = sv;
        }
        self.used = n;
        self.live = n;
        Ok(())
    }

    /// Room in the column for `more` new positions, growing it by at least an eighth.
    fn grow_cols(&mut self, more: usize) {
        let spare = self.cols.capacity() - self.cols.len();
        if spare < more {
            let len = self.cols.len();
            let to = (len + more).max(len + len / 8).max(16);
            self.cols.reserve_exact(to - len);
        }
    }

    /// Set `k` (non-zero) to `v`; returns the previous value.
    pub fn insert(&mut self, k: u64, v: u64) -> Option<u64> {
        debug_assert!(k != 0);
        if self.slots.is_empty() {
            if self.live < SWISS_MAX {
                return self.insert_swiss(k, v);
            }
            if self.get(k).is_none() {
                self.rebuild_slots(self.live + 1);
            }
        }
        if self.used >= self.max_used {
            self.rebuild(self.live + 1);
        }
        let h = self.hash(k);
        let (i, empty) = match self.probe(k, h) {
            Probe::Found(i) => {
                let j = self.pos(i);
                let old = self.cols[j][1];
                self.cols[j][1] = v;
                return Some(old);
            }
            Probe::Absent(i, empty) => (i, empty),
        };
        let j = match self.free.pop() {
            Some(j) => {
                self.cols[j as usize] = [k, v];
                j
            }
            None => {
                self.grow_cols(1);
                self.cols.push([k, v]);
                (self.cols.len() - 1) as u32
            }
        };
        self.slots[i] = self.tag(h) | (j + 1);
        if empty {
            self.used += 1;
        }
        self.live += 1;
        None
    }

    fn insert_swiss(&mut self, k: u64, v: u64) -> Option<u64> {
        let h = self.hash(k);
        let cols = &self.cols;
        if let Some(&j) = self.swiss.find(h, |&j| cols[j as usize][0] == k) {
            let old = self.cols[j as usize][1];
            self.cols[j as usize][1] = v;
            return Some(old);
        }
        let j = match self.free.pop() {
            Some(j) => {
                self.cols[j as usize] = [k, v];
                j
            }
            None => {
                self.grow_cols(1);
                self.cols.push([k, v]);
                (self.cols.len() - 1) as u32
            }
        };
        let (cols, hasher) = (&self.cols, &self.hasher);
        self.swiss
            .insert_unique(h, j, |&x| hasher.hash_one(cols[x as usize][0]));
        self.live += 1;
        None
    }

    /// From the SwissTable to slots with room for `entries`.
    fn rebuild_slots(&mut self, entries: usize) {
        self.swiss = HashTable::new();
        self.rebuild_to((entries.max(self.cols.len()) * 20 / 11 + 1).max(16));
    }

    /// Remove `k`; returns its value.
    pub fn remove(&mut self, k: u64) -> Option<u64> {
        if k == 0 || self.live == 0 {
            return None;
        }
        if self.slots.is_empty() {
            let h = self.hash(k);
            let cols = &self.cols;
            let entry = self
                .swiss
                .find_entry(h, |&j| cols[j as usize][0] == k)
                .ok()?;
            let (j, _) = entry.remove();
            let v = self.cols[j as usize][1];
            self.cols[j as usize][0] = 0;
            self.free.push(j);
            self.live -= 1;
            if self.live == 0 {
                self.cols.clear();
                self.free.clear();
            }
            return Some(v);
        }
        let Probe::Found(i) = self.probe(k, self.hash(k)) else {
            return None;
        };
        let j = self.pos(i);
        let v = self.cols[j][1];
        self.cols[j][0] = 0;
        self.free.push(j as u32);
        self.live -= 1;
        let n = self.slots.len();
        if self.slots[if i + 1 == n { 0 } else { i + 1 }] == EMPTY {
            // The end of a run: this slot and the deleted marks before it become empty.
            let mut x = i;
            loop {
                self.slots[x] = EMPTY;
                self.used -= 1;
                x = if x == 0 { n - 1 } else { x - 1 };
                if self.slots[x] != DELETED {
                    break;
                }
            }
        } else {
            self.slots[i] = DELETED;
        }
        if self.live == 0 {
            // Nothing left: start the column over (no free list to walk), small again.
            self.cols.clear();
            self.free.clear();
            self.slots = Vec::new();
            self.used = 0;
            self.max_used = 0;
        }
        Some(v)
    }

    /// Make room for `extra` more entries without growing inside a loop.
    pub fn reserve(&mut self, extra: usize) {
        if self.slots.is_empty() {
            if self.live + extra <= SWISS_MAX {
                let (cols, hasher) = (&self.cols, &self.hasher);
                self.swiss
                    .reserve(extra, |&x| hasher.hash_one(cols[x as usize][0]));
            } else {
                self.rebuild_slots(self.live + extra);
            }
        } else if self.used + extra > self.max_used {
            self.rebuild(self.live + extra);
        }
        let more = extra.saturating_sub(self.free.len());
        self.grow_cols(more);
    }

    pub fn clear(&mut self) {
        *self = Self {
            hasher: self.hasher.clone(),
            ..Self::default()
        };
    }

    /// (key, value) pairs in column order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.cols
            .iter()
            .filter(|kv| kv[0] != 0)
            .map(|kv| (kv[0], kv[1]))
    }

    /// Heap bytes allocated (bytes): the column, the free list and the slots, at capacity.
    pub fn bytes(&self) -> usize {
        self.cols.capacity() * 16
            + self.free.capacity() * 4
            + self.slots.capacity() * 4
            + self.swiss.allocation_size()
    }

    /// Drop free positions and fit every allocation to the live entries, when at most half
    /// of what is allocated is in use (after eviction).
    pub fn shrink(&mut self) {
        let cap = self
            .max_used
            .max(self.cols.capacity())
            .max(self.swiss.capacity());
        if 2 * self.live >= cap && self.free.is_empty() {
            return;
        }
        let pairs: Vec<[u64; 2]> = self.cols.iter().filter(|kv| kv[0] != 0).copied().collect();
        let hasher = self.hasher.clone();
        *self = Self {
            hasher,
            ..Self::default()
        };
        if pairs.is_empty() {
            return;
        }
        self.cols = pairs;
        self.cols.shrink_to_fit();
        self.live = self.cols.len();
        if self.live <= SWISS_MAX {
            let (cols, hasher) = (&self.cols, &self.hasher);
            let mut t = HashTable::with_capacity(cols.len());
            for (j, kv) in cols.iter().enumerate() {
                t.insert_unique(hasher.hash_one(kv[0]), j as u32, |&x| {
                    hasher.hash_one(cols[x as usize][0])
                });
            }
            self.swiss = t;
        } else {
            self.rebuild_to((self.live * 20 / 11 + 1).max(16));
        }
    }
}

// -- the Python face ---------------------------------------------------------------------

/// A key or value as the columns hold it: an exact int in range.
#[inline]
pub(crate) fn as_key(k: &Bound<'_, PyAny>) -> Option<u64> {
    if !k.is_exact_instance_of::<PyInt>() {
        // A dict takes `True` for the key 1 (equal, same hash): so must the columns.
        // (`False` is 0, which lives in the dict part like every key outside the columns.)
        return match k.cast::<PyBool>() {
            Ok(b) if b.is_true() => Some(1),
            _ => None,
        };
    }
    match k.extract::<u64>() {
        Ok(0) | Err(_) => None,
        Ok(x) => Some(x),
    }
}

#[inline]
pub(crate) fn as_value(v: &Bound<'_, PyAny>) -> Option<u64> {
    if !v.is_exact_instance_of::<PyInt>() {
        return None;
    }
    v.extract::<u64>().ok()
}

/// A mapping with a dict's behaviour over [`U64Map`] columns plus a dict for the rest.
///
/// The block table of :class:`kvstream.routing.index.KVIndex` (``engine hash -> router
/// key``) and each medium's ``key -> source mask`` map. Iteration is in insertion order,
/// columns first (a position freed by a removal is reused), then the dict's entries.
#[pyclass(module = "kvstream._native", frozen)]
pub struct NativeMap {
    pub(crate) core: Arc<RwLock<U64Map>>,
    pub(crate) other: Py<PyDict>,
}

impl NativeMap {
    #[inline]
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, U64Map> {
        self.core.read().unwrap_or_else(|e| e.into_inner())
    }

    #[inline]
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, U64Map> {
        self.core.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn other<'py>(&self, py: Python<'py>) -> &Bound<'py, PyDict> {
        self.other.bind(py)
    }

    fn lookup<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = key.py();
        if let Some(k) = as_key(key) {
            if let Some(v) = self.read().get(k) {
                return Ok(Some(v.into_pyobject(py)?.into_any()));
            }
        }
        let other = self.other(py);
        if other.is_empty() {
            return Ok(None);
        }
        other.get_item(key)
    }

    fn set(&self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let other = self.other(key.py());
        match (as_key(key), as_value(value)) {
            (Some(k), Some(v)) => {
                if !other.is_empty() && other.contains(key)? {
                    other.del_item(key)?;
                }
                self.write().insert(k, v);
            }
            (k, _) => {
                if let Some(k) = k {
                    self.write().remove(k);
                }
                other.set_item(key, value)?;
            }
        }
        Ok(())
    }

    fn take<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = key.py();
        if let Some(k) = as_key(key) {
            if let Some(v) = self.write().remove(k) {
                return Ok(Some(v.into_pyobject(py)?.into_any()));
            }
        }
        let other = self.other(py);
        if other.is_empty() {
            return Ok(None);
        }
        match other.get_item(key)? {
            Some(v) => {
                other.del_item(key)?;
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }

    fn snapshot_items<'py>(&self, py: Python<'py>, what: u8) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        {
            let core = self.read();
            for (k, v) in core.iter() {
                match what {
                    0 => out.append(k)?,
                    1 => out.append(v)?,
                    _ => out.append((k, v))?,
                }
            }
        }
        for (k, v) in self.other(py).iter() {
            match what {
                0 => out.append(k)?,
                1 => out.append(v)?,
                _ => out.append(PyTuple::new(py, [k, v])?)?,
            }
        }
        Ok(out)
    }
}

fn u64_array<'py>(py: Python<'py>, xs: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    let mut raw = Vec::with_capacity(xs.len() * 8);
    for x in xs {
        raw.extend_from_slice(&x.to_le_bytes());
    }
    let a = py.import("array")?.getattr("array")?.call1(("Q",))?;
    a.call_method1("frombytes", (PyBytes::new(py, &raw),))?;
    Ok(a)
}

pub(crate) fn u64s_of(a: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let b = a.call_method0("tobytes")?;
    let b = b.cast::<PyBytes>()?;
    let raw = b.as_bytes();
    if raw.len() % 8 != 0 {
        return Err(PyValueError::new_err(
            "u64 columns must be array('Q') values",
        ));
    }
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

#[pymethods]
impl NativeMap {
    #[new]
    fn py_new(py: Python<'_>) -> Self {
        NativeMap {
            core: Arc::new(RwLock::new(U64Map::new())),
            other: PyDict::new(py).unbind(),
        }
    }

    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.lookup(key)?.or(default))
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.lookup(key)?.is_some())
    }

    fn __getitem__<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.lookup(key)?
            .ok_or_else(|| PyKeyError::new_err(key.clone().unbind()))
    }

    fn __setitem__(&self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.set(key, value)
    }

    fn __delitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        match self.take(key)? {
            Some(_) => Ok(()),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    /// ``dict.pop``: the value of ``key``, removed; ``default`` (or KeyError) when absent.
    #[pyo3(signature = (key, *default))]
    fn pop<'py>(
        &self,
        key: &Bound<'py, PyAny>,
        default: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.take(key)? {
            Some(v) => Ok(v),
            None if !default.is_empty() => default.get_item(0),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.read().len() + self.other(py).len()
    }

    fn __bool__(&self, py: Python<'_>) -> bool {
        !self.read().is_empty() || !self.other(py).is_empty()
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.snapshot_items(py, 0)?.as_any().try_iter()?.into_any())
    }

    /// The keys, a list (a snapshot: the map may change while it is walked).
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.snapshot_items(py, 0)
    }

    /// The values, a list.
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.snapshot_items(py, 1)
    }

    /// The (key, value) pairs, a list.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.snapshot_items(py, 2)
    }

    /// ``dict.update`` from a mapping or an iterable of pairs.
    fn update(&self, other: &Bound<'_, PyAny>) -> PyResult<()> {
        let pairs = if other.hasattr("items")? {
            other.call_method0("items")?
        } else {
            other.clone()
        };
        for kv in pairs.try_iter()? {
            let kv = kv?;
            let k = kv.get_item(0)?;
            let v = kv.get_item(1)?;
            self.set(&k, &v)?;
        }
        Ok(())
    }

    fn clear(&self, py: Python<'_>) {
        self.write().clear();
        self.other(py).clear();
    }

    /// Heap bytes held (bytes): the columns and index as allocated (counted in Rust) plus
    /// the side dict and its objects (estimated at 136 bytes per entry beyond the dict: a
    /// bytes hash of up to 64 bytes and an int or tuple value).
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        let other = self.other(py);
        let side = if other.is_empty() {
            0
        } else {
            py.import("sys")?
                .getattr("getsizeof")?
                .call1((other,))?
                .extract::<usize>()?
                + 136 * other.len()
        };
        Ok(self.native_bytes() + side)
    }

    /// Bytes the columns and the index allocate (counted in Rust; tracemalloc cannot see them).
    fn native_bytes(&self) -> usize {
        self.read().bytes()
    }

    fn __sizeof__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(64 + self.nbytes(py)?)
    }

    /// Release memory left by removals (after eviction).
    fn shrink(&self, py: Python<'_>) -> PyResult<()> {
        self.write().shrink();
        let other = self.other(py);
        if other.is_empty() {
            // A dict keeps its table until cleared.
            other.clear();
        }
        Ok(())
    }

    /// Every entry in bulk: the column entries as two ``array('Q')`` (keys, values) and the
    /// rest as a dict.
    fn export_u64<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyDict>)> {
        let (ks, vs): (Vec<u64>, Vec<u64>) = self.read().iter().unzip();
        Ok((
            u64_array(py, &ks)?,
            u64_array(py, &vs)?,
            self.other(py).copy()?,
        ))
    }

    /// Add entries in bulk (keys absent, distinct, non-zero); ``ValueError`` for a
    /// duplicate or zero key, with the map unchanged.
    #[pyo3(signature = (keys, values, other=None))]
    fn load_u64(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        other: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ks = u64s_of(keys)?;
        let vs = u64s_of(values)?;
        if ks.len() != vs.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} values",
                ks.len(),
                vs.len()
            )));
        }
        if ks.contains(&0) {
            return Err(PyValueError::new_err("key 0 in the u64 columns"));
        }
        {
            let mut core = self.write();
            if core.is_empty() {
                // The common case (a snapshot's tier into a fresh map): a repeated key is
                // found by the insert itself, and the map is emptied again before the error,
                // so a refused load leaves it as it was.
                if let Err(k) = core.load_fresh(&ks, &vs) {
                    return Err(PyValueError::new_err(format!(
                        "duplicate key {k} in the u64 columns"
                    )));
                }
                drop(core);
                return self.load_other(other);
            }
            let mut seen = hashbrown::HashSet::with_capacity(ks.len());
            for &k in &ks {
                if !seen.insert(k) || core.contains(k) {
                    return Err(PyValueError::new_err(format!(
                        "duplicate key {k} in the u64 columns"
                    )));
                }
            }
            drop(seen);
            core.reserve(ks.len());
            for (k, v) in ks.into_iter().zip(vs) {
                core.insert(k, v);
            }
        }
        let _ = py;
        self.load_other(other)
    }

    /// `load_u64`'s other pairs (keys that are not u64s), each refused if already present.
    fn load_other(&self, other: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        if let Some(other) = other {
            for kv in other.try_iter()? {
                let kv = kv?;
                let (k, v) = (kv.get_item(0)?, kv.get_item(1)?);
                if self.lookup(&k)?.is_some() {
                    return Err(PyValueError::new_err(format!(
                        "duplicate key {:.40}",
                        k.repr()?.to_string()
                    )));
                }
                self.set(&k, &v)?;
            }
        }
        Ok(())
    }

    /// The values of ``keys`` (an ``array('Q')``), ``None`` where absent: a dump's masks
    /// in one call.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let ks = u64s_of(keys)?;
        let other = self.other(py);
        let out = PyList::empty(py);
        let core = self.read();
        for k in ks {
            match core.get(k) {
                Some(v) => out.append(v)?,
                None if other.is_empty() => out.append(py.None())?,
                None => out.append(other.get_item(k)?)?,
            }
        }
        Ok(out)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "NativeMap({} entries, {} in the side dict)",
            self.__len__(py),
            self.other(py).len()
        )
    }
}

/// A snapshot's tier into an empty index in one call (``KVIndex._load_prepared``'s bulk
/// path): ``held.load_u64(keys, masks)``, then under token keying (``table`` given)
/// ``table.load_u64(hashes, keys)`` and ``href[hash] = holders`` for every hash of two or
/// more holders. Returns the number of hashes each mask bit (source slot) holds, or None
/// with ``held`` left empty when a key repeats in ``keys`` (two hashes of one key: the
/// caller merges pair by pair). Raises ``ValueError`` (both maps left empty) for a hash
/// listed twice or 0, or columns of other lengths.
#[pyfunction]
#[pyo3(signature = (table, held, hashes, keys, masks, href))]
pub fn load_tier<'py>(
    py: Python<'py>,
    table: Option<PyRef<'py, NativeMap>>,
    held: PyRef<'py, NativeMap>,
    hashes: &Bound<'py, PyAny>,
    keys: &Bound<'py, PyAny>,
    masks: &Bound<'py, PyAny>,
    href: &Bound<'py, PyDict>,
) -> PyResult<Option<Vec<u64>>> {
    let ms = u64s_of(masks)?;
    if ms.contains(&0) {
        return Err(PyValueError::new_err("mask 0 in the u64 columns"));
    }
    let held_keys = if table.is_some() { keys } else { hashes };
    if held.__len__(py) != 0 || table.as_ref().is_some_and(|t| t.__len__(py) != 0) {
        return Err(PyValueError::new_err("load_tier loads into empty maps"));
    }
    let hk = u64s_of(held_keys)?;
    if hk.len() != ms.len() || hk.contains(&0) {
        return Err(PyValueError::new_err(format!(
            "{} keys for {} masks, or key 0, in the u64 columns",
            hk.len(),
            ms.len()
        )));
    }
    drop(hk);
    if held.load_u64(py, held_keys, masks, None).is_err() {
        // The one error left: a repeated key (the insert found it and emptied the map).
        return Ok(None);
    }
    let mut counts = vec![0u64; 64];
    for &m in &ms {
        let mut x = m;
        while x != 0 {
            counts[x.trailing_zeros() as usize] += 1;
            x &= x - 1;
        }
    }
    if let Some(table) = table {
        if let Err(e) = table.load_u64(py, hashes, keys, None) {
            held.write().clear();
            return Err(e);
        }
        if ms.iter().any(|m| m & (m - 1) != 0) {
            let hs = u64s_of(hashes)?;
            for (&eh, &m) in hs.iter().zip(&ms) {
                if m & (m - 1) != 0 {
                    href.set_item(eh, m.count_ones())?;
                }
            }
        }
    }
    Ok(Some(counts))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeMap>()?;
    m.add_function(wrap_pyfunction!(load_tier, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn xorshift_keys(n: usize) -> Vec<u64> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x | 1
            })
            .collect()
    }

    #[test]
    #[ignore] // timing: cargo test --release time_bulk_load -- --ignored --nocapture
    fn time_bulk_load() {
        let n = 1_000_000usize;
        let ks = xorshift_keys(n);
        let vs: Vec<u64> = (0..n as u64).collect();
        for _ in 0..4 {
            let t = std::time::Instant::now();
            let mut m = U64Map::new();
            m.load_fresh(&ks, &vs).unwrap();
            let a = t.elapsed();
            let t = std::time::Instant::now();
            let mut m2 = U64Map::new();
            m2.reserve(n);
            for (&k, &v) in ks.iter().zip(&vs) {
                m2.insert(k, v);
            }
            eprintln!("load_fresh {a:?}, one insert a key {:?}", t.elapsed());
        }
    }

    #[test]
    fn a_bulk_load_holds_what_inserts_would_and_finds_a_repeated_key() {
        for n in [1000usize, SWISS_MAX + 1, 300_000] {
            let ks = xorshift_keys(n);
            let vs: Vec<u64> = (0..n as u64).collect();
            let mut m = U64Map::new();
            m.load_fresh(&ks, &vs).unwrap();
            assert_eq!(m.len(), n);
            assert!(
                m.iter().map(|(k, _)| k).eq(ks.iter().copied()),
                "column order is the load order"
            );
            for (&k, &v) in ks.iter().zip(&vs) {
                assert_eq!(m.get(k), Some(v));
            }
            assert_eq!(m.get(2), None);
            // Goes on as a map: removals, and inserts past the loaded load factor.
            for &k in ks.iter().step_by(3) {
                assert!(m.remove(k).is_some());
            }
            for k in 0..(n as u64 / 2) {
                m.insert((k << 1) | (1 << 62), k);
            }
            for (i, &k) in ks.iter().enumerate() {
                assert_eq!(m.get(k), if i % 3 == 0 { None } else { Some(vs[i]) });
            }
            let mut dup = ks.clone();
            dup[n / 2] = ks[n / 3];
            let mut d = U64Map::new();
            assert_eq!(d.load_fresh(&dup, &vs), Err(ks[n / 3]));
            assert!(d.is_empty() && d.get(ks[0]).is_none());
        }
    }

    #[test]
    fn behaves_like_a_hashmap_through_churn() {
        let mut m = U64Map::new();
        let mut d: HashMap<u64, u64> = HashMap::new();
        let mut x: u64 = 0x1234_5678;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = 1 + x % 5000;
            if x.is_multiple_of(3) {
                assert_eq!(m.remove(k), d.remove(&k));
            } else {
                assert_eq!(m.insert(k, step), d.insert(k, step));
            }
            assert_eq!(m.len(), d.len());
        }
        for (k, v) in &d {
            assert_eq!(m.get(*k), Some(*v));
        }
        assert_eq!(m.iter().count(), d.len());
        let before = m.bytes();
        m.shrink();
        assert!(m.bytes() <= before);
        for (k, v) in &d {
            assert_eq!(m.get(*k), Some(*v));
        }
    }

    #[test]
    fn freed_positions_are_reused_and_an_empty_map_starts_over() {
        let mut m = U64Map::new();
        for k in 1..=100 {
            m.insert(k, k);
        }
        for k in 1..=50 {
            m.remove(k);
        }
        for k in 101..=150 {
            m.insert(k, k);
        }
        assert_eq!(m.cols.len(), 100);
        for k in 51..=150 {
            m.remove(k);
        }
        assert!(m.is_empty() && m.cols.is_empty());
        assert_eq!(m.get(0), None);
    }

    #[test]
    fn bytes_per_entry_at_a_million() {
        let mut m = U64Map::new();
        for k in 1..=1_000_000u64 {
            m.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, k);
        }
        let per = m.bytes() as f64 / 1e6;
        assert!(per < 24.0, "{per} bytes per entry");
    }

    #[test]
    fn every_size_costs_at_most_the_column_and_the_slots_load_allows() {
        // 16 bytes of column with at most an eighth spare, 4-byte slots at >= 55 % load
        // (a SwissTable of 5-byte buckets at >= 43.75 % up to SWISS_MAX entries).
        let mut m = U64Map::new();
        for k in 1..=400_000u64 {
            m.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, k);
            if k >= 1000 && k % 997 == 0 {
                let per = m.bytes() as f64 / k as f64;
                let index = if k as usize > SWISS_MAX {
                    4.0 / 0.55
                } else {
                    5.0 / 0.4375
                };
                assert!(
                    per <= 16.0 * 1.125 + index + 0.1,
                    "{per} bytes per entry at {k}"
                );
            }
        }
    }

    #[test]
    fn fifo_churn_keeps_its_size_and_every_entry() {
        // Eviction's pattern: insert new keys, remove the oldest. In slots, deleted marks
        // must be cleared by rebuilds at the same size, never by growing.
        fifo_churn(50_000, 1); // the SwissTable (may double once under churn)
        fifo_churn(150_000, 4); // slots
    }

    fn fifo_churn(live: u64, slack: usize) {
        let mut m = U64Map::new();
        for k in 1..=live {
            m.insert(k * 7919, k);
        }
        let settled = m.bytes();
        for k in live + 1..=live * 20 {
            m.insert(k * 7919, k);
            assert_eq!(m.remove((k - live) * 7919), Some(k - live));
            if k % 10_007 == 0 {
                assert_eq!(m.len() as u64, live);
                for x in (k - live + 1..=k).step_by(97) {
                    assert_eq!(m.get(x * 7919), Some(x));
                }
                assert_eq!(m.get((k - live) * 7919), None);
            }
        }
        assert!(
            m.bytes() <= settled + settled / slack,
            "{} > {settled}",
            m.bytes()
        );
        assert_eq!(m.iter().count() as u64, live);
    }

    #[test]
    fn reserve_then_inserts_do_not_rebuild_and_shrink_fits_the_rest() {
        let mut m = U64Map::new();
        m.reserve(1000);
        let slots = m.slots.len();
        for k in 1..=1000u64 {
            m.insert(k, k);
        }
        assert_eq!(m.slots.len(), slots);
        for k in 1..=990u64 {
            assert_eq!(m.remove(k), Some(k));
        }
        let before = m.bytes();
        m.shrink();
        assert!(m.bytes() < before / 10);
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            (991..=1000).map(|k| (k, k)).collect::<Vec<_>>()
        );
        for k in 991..=1000u64 {
            assert_eq!(m.get(k), Some(k));
        }
        m.insert(5, 5);
        assert_eq!(m.get(5), Some(5));
    }
}
