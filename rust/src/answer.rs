//! A `/query` answer of one index written as JSON text straight from its walk.
//!
//! `kvstream/service/mooncake.py` answers `/query` with, per instance holding a prefix,
//! `"instance":{"longest_matched":T,"GPU":G,"CPU":C,"DISK":D,"DP":{"rank":T}}`. Built in
//! Python from the walk's rows that is a tuple and a dict per row, then the text (about
//! 16 us for 21 rows of 64 sources, `bench/bench_serve.py --stages`); here it is the walk
//! and the text in one call, the GIL released.
//!
//! What the text says stays the service's: it hands over, per source slot, the JSON
//! label of its instance and DP rank ([`RowLabels`], made again only when an engine or a
//! slot changes) and which answer column each tier's medium is. The crate only does the
//! per-row arithmetic the Python path does (a source's blocks rounded down to whole
//! engine blocks, times the block size) and writes the digits.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::Error;
use crate::keys::chain_tokens as chain;
use crate::query::{cores_of, packed_or_tokens, u64_keys, walk_cores, TierRow};
use crate::table::NativeMap;

/// The answer's medium columns, in the order written: `"GPU"`, `"CPU"`, `"DISK"`.
pub const COLUMNS: usize = 3;
const NAMES: [&[u8]; COLUMNS] = [b",\"GPU\":", b",\"CPU\":", b",\"DISK\":"];

/// One slot's labels in an answer.
pub struct Label {
    /// `"instance id":{"longest_matched":` (JSON-escaped by the caller).
    head: Vec<u8>,
    /// `"rank"`: the DP rank as a JSON string.
    rank: Vec<u8>,
    /// The instance, as a number shared by the slots of its DP ranks.
    instance: u32,
}

/// One slot's labels as Python gives them: ``(instance head, rank, instance number)``.
type SlotLabel = (Vec<u8>, Vec<u8>, u32);

/// Per source slot, the labels of its row in an answer, or None for a slot whose rows
/// are left out (no source, or no engine followed under its name).
#[pyclass(frozen, module = "kvstream._native")]
pub struct RowLabels {
    slots: Vec<Option<Label>>,
}

#[pymethods]
impl RowLabels {
    /// ``slots``: per slot, ``(instance head, rank, instance number)`` or None.
    #[new]
    fn new(slots: Vec<Option<SlotLabel>>) -> Self {
        RowLabels {
            slots: slots
                .into_iter()
                .map(|s| {
                    s.map(|(head, rank, instance)| Label {
                        head,
                        rank,
                        instance,
                    })
                })
                .collect(),
        }
    }

    fn __len__(&self) -> usize {
        self.slots.len()
    }
}

/// How many blocks a source of slot `slot` counts: its blocks rounded down to a multiple
/// of its engine block (`pers`: (blocks per engine block, slot mask) pairs, only those
/// above 1).
fn per_of(pers: &[(u32, u64)], slot: u32) -> u32 {
    pers.iter()
        .find(|(_, m)| m >> slot & 1 == 1)
        .map_or(1, |&(p, _)| p)
}

/// One instance of the answer: the longest match of its rows (tokens), per medium, and
/// per DP rank (in the order its rows came).
struct Entry<'a> {
    head: &'a [u8],
    tokens: u64,
    media: [u64; COLUMNS],
    ranks: Vec<(&'a [u8], u64)>,
}

fn num(out: &mut Vec<u8>, buf: &mut itoa::Buffer, v: u64) {
    out.extend_from_slice(buf.format(v).as_bytes());
}

/// The rows (from [`walk_cores`]) written into `out` as the answer's instances, comma
/// separated, in the order of their first row (slot order): what `MooncakeAPI`'s merge of
/// the same rows and its encoder write. The rows of one instance (its DP ranks) are
/// merged: the longest match of any, per medium the longest, and one entry per rank.
/// `cols[j]`: the answer column of tier `j`'s medium. Returns the longest match in tokens.
pub fn write_rows(
    out: &mut Vec<u8>,
    rows: &[TierRow],
    labels: &[Option<Label>],
    cols: &[u8],
    pers: &[(u32, u64)],
    block: u64,
) -> u64 {
    let mut entries: Vec<Entry<'_>> = Vec::with_capacity(rows.len());
    // instance number -> its entry; rows are at most 64, so a short list is the map
    let mut at: Vec<(u32, usize)> = Vec::new();
    let mut best = 0;
    for (slot, b, ends) in rows {
        let Some(Some(label)) = labels.get(*slot as usize) else {
            continue;
        };
        let per = per_of(pers, *slot);
        let b = b - b % per;
        if b == 0 {
            continue;
        }
        let mut media = [0u64; COLUMNS];
        for (&x, &c) in ends.iter().zip(cols) {
            media[usize::from(c)] = u64::from(x - x % per).saturating_mul(block);
        }
        let t = u64::from(b).saturating_mul(block);
        best = best.max(t);
        match at.iter().find(|(i, _)| *i == label.instance) {
            None => {
                at.push((label.instance, entries.len()));
                entries.push(Entry {
                    head: &label.head,
                    tokens: t,
                    media,
                    ranks: vec![(&label.rank, t)],
                });
            }
            Some(&(_, k)) => {
                let e = &mut entries[k];
                e.tokens = e.tokens.max(t);
                for (m, v) in e.media.iter_mut().zip(media) {
                    *m = (*m).max(v);
                }
                match e
                    .ranks
                    .iter_mut()
                    .find(|(r, _)| *r == label.rank.as_slice())
                {
                    Some((_, v)) => *v = (*v).max(t),
                    None => e.ranks.push((&label.rank, t)),
                }
            }
        }
    }
    let mut buf = itoa::Buffer::new();
    for (k, e) in entries.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(e.head);
        num(out, &mut buf, e.tokens);
        for (name, v) in NAMES.iter().zip(e.media) {
            out.extend_from_slice(name);
            num(out, &mut buf, v);
        }
        out.extend_from_slice(b",\"DP\":{");
        for (j, (rank, v)) in e.ranks.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            out.extend_from_slice(rank);
            out.push(b':');
            num(out, &mut buf, *v);
        }
        out.extend_from_slice(b"}}");
    }
    best
}

type Answer = Option<(usize, Py<PyBytes>, u64)>;

fn check(maps: usize, cols: &[u8], pers: &[(u32, u64)]) -> crate::error::Result<()> {
    if cols.len() != maps || cols.iter().any(|&c| usize::from(c) >= COLUMNS) {
        return Err(Error::Local(format!(
            "one answer column (0-{}) per tier is needed: {} tiers, columns {cols:?}",
            COLUMNS - 1,
            maps
        )));
    }
    if pers.iter().any(|&(p, _)| p == 0) {
        return Err(Error::Local(
            "blocks per engine block are at least 1".into(),
        ));
    }
    Ok(())
}

/// `head` (the answer up to its instances), the rows of `keys` walked through `maps`
/// written after it, then `}}`.
#[allow(clippy::too_many_arguments)]
fn answer(
    py: Python<'_>,
    maps: &[PyRef<'_, NativeMap>],
    make_keys: impl FnOnce() -> Vec<u64> + Send,
    active: u64,
    cols: &[u8],
    labels: &RowLabels,
    pers: &[(u32, u64)],
    block: u64,
    head: &[u8],
) -> PyResult<Answer> {
    check(maps.len(), cols, pers)?;
    let Some(cores) = cores_of(py, maps) else {
        return Ok(None);
    };
    let (n, text, best) = py.detach(move || {
        let keys = make_keys();
        let rows = walk_cores(&cores, &keys, active);
        let mut out = Vec::with_capacity(head.len() + 2 + rows.len() * 96);
        out.extend_from_slice(head);
        let best = write_rows(&mut out, &rows, &labels.slots, cols, pers, block);
        out.extend_from_slice(b"}}");
        (keys.len(), out, best)
    });
    Ok(Some((n, PyBytes::new(py, &text).unbind(), best)))
}

/// A prompt's router keys chained from ``seed``, walked through every tier's map, and the
/// answer written: ``(number of keys, head + the instances' JSON + "}}", longest match in
/// tokens)``, or None for the Python path (as ``walk_tiers_tokens``). ``cols``: per tier,
/// its answer column (0 GPU, 1 CPU, 2 DISK); ``pers``: ``(blocks per engine block, slot
/// mask)`` for the sources whose engine block is several keys; ``block``: tokens per
/// counted block.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn answer_tiers_tokens(
    py: Python<'_>,
    maps: Vec<PyRef<'_, NativeMap>>,
    tokens: &Bound<'_, PyAny>,
    r: usize,
    seed: u64,
    active: u64,
    cols: Vec<u8>,
    labels: PyRef<'_, RowLabels>,
    pers: Vec<(u32, u64)>,
    block: u64,
    head: &[u8],
) -> PyResult<Answer> {
    if r == 0 {
        return Ok(None);
    }
    let Some(toks) = packed_or_tokens(tokens)? else {
        return Ok(None);
    };
    answer(
        py,
        &maps,
        move || chain(&toks, r, seed),
        active,
        &cols,
        &labels,
        &pers,
        block,
        head,
    )
}

/// [`answer_tiers_tokens`] for keys already made (engine hashes, a prompt's router keys):
/// ``keys`` packed (8 bytes each, little-endian) or a sequence of ints.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn answer_tiers_keys(
    py: Python<'_>,
    maps: Vec<PyRef<'_, NativeMap>>,
    keys: &Bound<'_, PyAny>,
    active: u64,
    cols: Vec<u8>,
    labels: PyRef<'_, RowLabels>,
    pers: Vec<(u32, u64)>,
    block: u64,
    head: &[u8],
) -> PyResult<Answer> {
    let Some(ks) = u64_keys(keys)? else {
        return Ok(None);
    };
    answer(
        py,
        &maps,
        move || ks,
        active,
        &cols,
        &labels,
        &pers,
        block,
        head,
    )
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RowLabels>()?;
    m.add_function(wrap_pyfunction!(answer_tiers_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(answer_tiers_keys, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label(inst: &str, rank: &str) -> Option<Label> {
        Some(Label {
            head: format!("\"{inst}\":{{\"longest_matched\":").into_bytes(),
            rank: format!("\"{rank}\"").into_bytes(),
            instance: u32::from(inst.as_bytes()[0]),
        })
    }

    #[test]
    fn rows_are_written_per_instance_in_slot_order() {
        let labels = vec![label("a", "0"), None, label("c", "1")];
        // slot 0: 3 blocks, all GPU; slot 1: no label; slot 2: 2 blocks, 1 GPU and 2 CPU
        let rows: Vec<TierRow> = vec![(0, 3, vec![3, 0]), (1, 5, vec![5, 5]), (2, 2, vec![1, 2])];
        let mut out = Vec::new();
        let best = write_rows(&mut out, &rows, &labels, &[0, 1], &[], 16);
        assert_eq!(best, 48);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\":{\"longest_matched\":48,\"GPU\":48,\"CPU\":0,\"DISK\":0,\"DP\":{\"0\":48}},\
             \"c\":{\"longest_matched\":32,\"GPU\":16,\"CPU\":32,\"DISK\":0,\"DP\":{\"1\":32}}"
        );
    }

    #[test]
    fn blocks_round_down_to_whole_engine_blocks() {
        let labels = vec![label("a", "0"), label("b", "0")];
        // slot 0 counts 4 keys per engine block: 7 -> 4, its DISK 3 -> 0; slot 1: 3 -> 0, left out
        let rows: Vec<TierRow> = vec![(0, 7, vec![7, 3]), (1, 3, vec![3, 0])];
        let mut out = Vec::new();
        let best = write_rows(&mut out, &rows, &labels, &[0, 2], &[(4, 0b11)], 1);
        assert_eq!(best, 4);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\":{\"longest_matched\":4,\"GPU\":4,\"CPU\":0,\"DISK\":0,\"DP\":{\"0\":4}}"
        );
    }

    #[test]
    fn the_rows_of_one_instance_merge() {
        // slots 0 and 2: ranks 0 and 1 of "a"; slot 1: "b"; slot 3: rank 1 of "a" again
        let labels = vec![
            label("a", "0"),
            label("b", "0"),
            label("a", "1"),
            label("a", "1"),
        ];
        let rows: Vec<TierRow> = vec![
            (0, 2, vec![2, 0]),
            (1, 1, vec![1, 0]),
            (2, 4, vec![1, 4]),
            (3, 3, vec![3, 0]),
        ];
        let mut out = Vec::new();
        let best = write_rows(&mut out, &rows, &labels, &[0, 1], &[], 10);
        assert_eq!(best, 40);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\":{\"longest_matched\":40,\"GPU\":30,\"CPU\":40,\"DISK\":0,\"DP\":{\"0\":20,\"1\":40}},\
             \"b\":{\"longest_matched\":10,\"GPU\":10,\"CPU\":0,\"DISK\":0,\"DP\":{\"0\":10}}"
        );
    }

    #[test]
    fn columns_and_pers_are_checked() {
        assert!(check(2, &[0, 1], &[(2, 1)]).is_ok());
        assert!(check(2, &[0], &[]).is_err());
        assert!(check(1, &[3], &[]).is_err());
        assert!(check(1, &[0], &[(0, 1)]).is_err());
    }
}
