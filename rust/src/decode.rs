//! The raw KV event payload reader: vLLM's `KVEventBatch` msgpack, decoded without Python.
//!
//! The wire format is `kvstream/wire/events.py` (the specification; its `EventDecoder` is
//! the oracle the tests compare against): a batch `[ts, events, data_parallel_rank?]`,
//! each event a map (vLLM >= 0.26, `{"type": "BlockStored", ...}`) or a tagged array
//! (vLLM 0.11, `["BlockStored", block_hashes, ...]`), in any mix.
//!
//! The reader is exact in one direction only: when it returns a batch, `EventDecoder`
//! decodes that payload to the same events (every field typed as its schema says, unknown
//! map keys skipped, missing trailing array slots defaulted, extra ones ignored). Anything
//! it is not sure of (malformed msgpack, a type the schema rejects, an unknown event type,
//! an ext value, duplicate map keys, deep nesting, a payload over the limit) is *deferred*:
//! [`read_batch`] returns `None` and the caller hands the payload to `EventDecoder`, which
//! decodes it or raises its typed `EventDecodeError`. So remote input never meets a second
//! set of error rules, and never a panic: every read is bounds-checked (rmp's `Bytes`).
//!
//! The events are kept in flat columns (one `Vec` of hashes and one of token ids for the
//! whole batch) with the few facts the native ingest rules read per event ([`Ev`]).

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rmp::decode::{read_marker, Bytes, RmpRead};
use rmp::Marker;

/// Why a payload is handed back to the Python decoder (no detail: it has the messages).
#[derive(Debug)]
pub struct Defer;

type R<T> = std::result::Result<T, Defer>;

/// Deepest nesting of a schema-less (`Any`) value the reader walks (deeper: deferred).
const MAX_DEPTH: u32 = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Stored,
    Removed,
    Cleared,
}

/// A parent block hash as the ingest rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent {
    /// nil: the run starts at block 0.
    None,
    /// An int in `[1, 2**64)` (a column key).
    Key(u64),
    /// 0 or a bytes digest: the Python rules.
    Other,
}

/// One decoded event: what the native rules read, and where its columns are.
#[derive(Debug, Clone)]
pub struct Ev {
    pub kind: Kind,
    /// `block_hashes` in `hashes[h0..h1]`, valid when `hashes_ok`.
    pub h0: usize,
    pub h1: usize,
    /// Every hash an int in `[1, 2**64)` (else: bytes or 0, the Python rules).
    pub hashes_ok: bool,
    /// `token_ids` in `tokens[t0..t1]`, valid when `tokens_ok`.
    pub t0: usize,
    pub t1: usize,
    /// Every token id in `[0, 2**32)`.
    pub tokens_ok: bool,
    pub parent: Parent,
    /// `block_size`, when it is in `[0, 2**64)`.
    pub block_size: Option<u64>,
    /// `medium` is nil or "GPU".
    pub gpu: bool,
    /// `group_idx` is nil or 0.
    pub group0: bool,
    /// `lora_id` and `lora_name` are both nil.
    pub base: bool,
    /// `extra_keys` is nil, empty, or one nil per block (checked against the hash count).
    pub extras_len: Option<usize>,
    /// How many entries `block_hashes` lists (a run whose hashes keep no column too).
    pub listed: usize,
    pub extras_all_nil: bool,
    /// `session_id` is set.
    pub session: bool,
}

impl Ev {
    fn new(kind: Kind) -> Self {
        Ev {
            kind,
            h0: 0,
            h1: 0,
            hashes_ok: true,
            t0: 0,
            t1: 0,
            tokens_ok: true,
            parent: Parent::None,
            block_size: Some(0),
            gpu: true,
            group0: true,
            base: true,
            extras_len: None,
            listed: 0,
            extras_all_nil: true,
            session: false,
        }
    }

    /// The block hashes (meaningful when `hashes_ok`).
    pub fn hashes<'a>(&self, b: &'a Batch) -> &'a [u64] {
        &b.hashes[self.h0..self.h1]
    }

    /// The token ids (meaningful when `tokens_ok`).
    pub fn tokens<'a>(&self, b: &'a Batch) -> &'a [u32] {
        &b.tokens[self.t0..self.t1]
    }

    pub fn n_hashes(&self) -> usize {
        self.h1 - self.h0
    }

    /// `extra_keys` adds nothing to the keys: nil, empty, or all nil with one per block.
    pub fn extras_plain(&self) -> bool {
        match self.extras_len {
            None | Some(0) => true,
            Some(n) => n == self.listed && self.extras_all_nil,
        }
    }
}

/// A decoded batch.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    pub ts: f64,
    /// `data_parallel_rank`: absent/nil is None; an int outside i64 is deferred.
    pub rank: Option<i64>,
    pub events: Vec<Ev>,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
    /// Block events (hashes of stored and removed runs).
    pub blocks: usize,
}

/// An int of any msgpack width.
#[derive(Clone, Copy)]
enum Num {
    U(u64),
    I(i64),
}

struct Rd<'a> {
    b: Bytes<'a>,
}

/// Bytes a token id takes on the wire by its first byte, for the markers the token reader
/// takes without rmp: a positive fixint (1), uint8 (2), uint16 (3), uint32 (5); 0 for any
/// other marker.
const TOKEN_WIDTH: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut c = 0;
    while c < 0x80 {
        t[c] = 1;
        c += 1;
    }
    t[0xcc] = 2;
    t[0xcd] = 3;
    t[0xce] = 5;
    t
};

/// The right shift that brings a token id's value to the low bits of the five bytes from
/// its first (read big-endian): a fixint is the first byte itself (32), a uint8, uint16 or
/// uint32 the bytes after its marker (24, 16, 0); [`TOKEN_MASK`] keeps its width.
const TOKEN_SHIFT: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut c = 0;
    while c < 0x80 {
        t[c] = 32;
        c += 1;
    }
    t[0xcc] = 24;
    t[0xcd] = 16;
    t
};

/// The bits of a token id's value after [`TOKEN_SHIFT`]: 8 for a fixint or uint8, 16 for a
/// uint16, 32 for a uint32.
const TOKEN_MASK: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut c = 0;
    while c < 0x80 {
        t[c] = 0xff;
        c += 1;
    }
    t[0xcc] = 0xff;
    t[0xcd] = 0xffff;
    t[0xce] = u32::MAX;
    t
};

fn len_of(m: Marker, rd: &mut Bytes<'_>) -> R<usize> {
    Ok(match m {
        Marker::FixStr(n) | Marker::FixArray(n) | Marker::FixMap(n) => n as usize,
        Marker::Str8 | Marker::Bin8 => rd.read_data_u8().map_err(|_| Defer)? as usize,
        Marker::Str16 | Marker::Bin16 | Marker::Array16 | Marker::Map16 => {
            rd.read_data_u16().map_err(|_| Defer)? as usize
        }
        Marker::Str32 | Marker::Bin32 | Marker::Array32 | Marker::Map32 => {
            rd.read_data_u32().map_err(|_| Defer)? as usize
        }
        _ => return Err(Defer),
    })
}

impl<'a> Rd<'a> {
    fn marker(&mut self) -> R<Marker> {
        read_marker(&mut self.b).map_err(|_| Defer)
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let rest = self.b.remaining_slice();
        if n > rest.len() {
            return Err(Defer);
        }
        self.b = Bytes::new(&rest[n..]);
        Ok(&rest[..n])
    }

    fn left(&self) -> usize {
        self.b.remaining_slice().len()
    }

    /// An int after its marker, or None when the marker is not an int's.
    fn num_of(&mut self, m: Marker) -> R<Option<Num>> {
        let b = &mut self.b;
        let e = |_| Defer;
        Ok(Some(match m {
            Marker::FixPos(x) => Num::U(x as u64),
            Marker::FixNeg(x) => Num::I(x as i64),
            Marker::U8 => Num::U(b.read_data_u8().map_err(e)? as u64),
            Marker::U16 => Num::U(b.read_data_u16().map_err(e)? as u64),
            Marker::U32 => Num::U(b.read_data_u32().map_err(e)? as u64),
            Marker::U64 => Num::U(b.read_data_u64().map_err(e)?),
            Marker::I8 => Num::I(b.read_data_i8().map_err(e)? as i64),
            Marker::I16 => Num::I(b.read_data_i16().map_err(e)? as i64),
            Marker::I32 => Num::I(b.read_data_i32().map_err(e)? as i64),
            Marker::I64 => Num::I(b.read_data_i64().map_err(e)?),
            _ => return Ok(None),
        }))
    }

    fn num(&mut self) -> R<Num> {
        let m = self.marker()?;
        self.num_of(m)?.ok_or(Defer)
    }

    /// A UTF-8 string after its marker (None: not a string).
    fn str_of(&mut self, m: Marker) -> R<Option<&'a str>> {
        match m {
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let n = len_of(m, &mut self.b)?;
                let raw = self.take(n)?;
                Ok(Some(std::str::from_utf8(raw).map_err(|_| Defer)?))
            }
            _ => Ok(None),
        }
    }

    /// A map key's bytes (a string, its UTF-8 not checked yet: a known field name is
    /// ASCII, so a match is valid; the caller checks any other key).
    fn key_of(&mut self, m: Marker) -> R<&'a [u8]> {
        match m {
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let n = len_of(m, &mut self.b)?;
                self.take(n)
            }
            _ => Err(Defer),
        }
    }

    fn array_len(&mut self) -> R<usize> {
        let m = self.marker()?;
        self.array_len_of(m)
    }

    fn array_len_of(&mut self, m: Marker) -> R<usize> {
        match m {
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = len_of(m, &mut self.b)?;
                // Every element is at least one byte: a length beyond the payload is a lie.
                if n > self.left() {
                    return Err(Defer);
                }
                Ok(n)
            }
            _ => Err(Defer),
        }
    }

    /// Skip one value of any type (`Any` in the schema); ext values and deep nesting defer.
    fn skip_any(&mut self, depth: u32) -> R<()> {
        if depth > MAX_DEPTH {
            return Err(Defer);
        }
        let m = self.marker()?;
        if self.num_of(m)?.is_some() {
            return Ok(());
        }
        match m {
            Marker::Null | Marker::True | Marker::False => Ok(()),
            Marker::F32 => self.take(4).map(|_| ()),
            Marker::F64 => self.take(8).map(|_| ()),
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                self.str_of(m).map(|_| ())
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = len_of(m, &mut self.b)?;
                self.take(n).map(|_| ())
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.array_len_of(m)?;
                for _ in 0..n {
                    self.skip_any(depth + 1)?;
                }
                Ok(())
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = len_of(m, &mut self.b)?;
                if n > self.left() {
                    return Err(Defer);
                }
                for _ in 0..n {
                    // Keys must be hashable in Python: strings and ints are; anything
                    // else (arrays, maps, floats' corner cases) is left to msgspec.
                    let k = self.marker()?;
                    if self.num_of(k)?.is_none() && self.str_of(k)?.is_none() {
                        return Err(Defer);
                    }
                    self.skip_any(depth + 1)?;
                }
                Ok(())
            }
            _ => Err(Defer), // ext types, the reserved byte
        }
    }

    /// `float` (msgspec takes an int for a float field).
    fn float(&mut self) -> R<f64> {
        let m = self.marker()?;
        match m {
            Marker::F32 => Ok(self.b.read_data_f32().map_err(|_| Defer)? as f64),
            Marker::F64 => self.b.read_data_f64().map_err(|_| Defer),
            _ => match self.num_of(m)? {
                Some(Num::U(x)) => Ok(x as f64),
                Some(Num::I(x)) => Ok(x as f64),
                None => Err(Defer),
            },
        }
    }

    /// `int | None`: Ok(None) for nil.
    fn opt_int(&mut self) -> R<Option<Num>> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        Ok(Some(self.num_of(m)?.ok_or(Defer)?))
    }

    /// `str | None`.
    fn opt_str(&mut self) -> R<Option<&'a str>> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        self.str_of(m)?.ok_or(Defer).map(Some)
    }

    /// One `ExternalBlockHash` (int >= 0 or bytes): Some(key) for an int in [1, 2**64).
    fn hash_of(&mut self, m: Marker) -> R<Option<u64>> {
        match self.num_of(m)? {
            Some(Num::U(0)) => Ok(None),
            Some(Num::U(x)) => Ok(Some(x)),
            Some(Num::I(x)) if x > 0 => Ok(Some(x as u64)),
            Some(Num::I(0)) => Ok(None),
            Some(Num::I(_)) => Err(Defer), // negative: rejected by the schema
            None => match m {
                Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                    let n = len_of(m, &mut self.b)?;
                    self.take(n)?;
                    Ok(None)
                }
                _ => Err(Defer),
            },
        }
    }

    /// `list[ExternalBlockHash]` into `out`; returns whether all were column keys, and how
    /// many the list held.
    fn hashes(&mut self, out: &mut Vec<u64>) -> R<(bool, usize)> {
        let n = self.array_len()?;
        out.reserve(n);
        let mut ok = true;
        for _ in 0..n {
            let m = self.marker()?;
            match self.hash_of(m)? {
                Some(k) => out.push(k),
                None => ok = false,
            }
        }
        Ok((ok, n))
    }

    /// `list[int]` into `out`; returns whether all fit u32.
    ///
    /// The common case is read straight off the slice: a fixint, u8, u16 or u32 token id
    /// (every read bounds-checked); any other marker goes through rmp. Two loops, chosen by
    /// how often the first 32 ids change width: a branch on the marker, fast while the
    /// widths repeat, or, for ids that mix widths (which that branch mispredicts), the
    /// width and value from tables with no branch on the marker. `bench/bench_codec.py`,
    /// per 4,096 ids, against the branch alone: 12.6 against 22.2 us uniform over 120,000,
    /// 13.4 against 19.1 us for a Zipf vocabulary of 128k, 6.5 against 6.3 us for uint16
    /// ids only.
    fn tokens(&mut self, out: &mut Vec<u32>) -> R<bool> {
        let n = self.array_len()?;
        out.reserve(n);
        let mut ok = true;
        let first = n.min(32);
        let changes = self.token_run::<false>(first, out, &mut ok)?;
        if changes >= 6 {
            self.token_run::<true>(n - first, out, &mut ok)?;
        } else {
            self.token_run::<false>(n - first, out, &mut ok)?;
        }
        Ok(ok)
    }

    /// `count` token ids into `out` (see [`Rd::tokens`]); `TABLES`: the loop without a
    /// branch on the marker. Returns how often the width changed from one id to the next.
    #[inline(always)]
    fn token_run<const TABLES: bool>(
        &mut self,
        count: usize,
        out: &mut Vec<u32>,
        ok: &mut bool,
    ) -> R<u32> {
        let mut rest = self.b.remaining_slice();
        let mut j = 0usize;
        let mut changes = 0u32;
        let mut prev = 0u8;
        for _ in 0..count {
            if TABLES {
                if let Some(w) = rest.get(j..j + 5) {
                    let c = w[0];
                    let width = TOKEN_WIDTH[c as usize];
                    if width != 0 {
                        let five = u64::from_be_bytes([0, 0, 0, w[0], w[1], w[2], w[3], w[4]]);
                        let shift = TOKEN_SHIFT[c as usize];
                        out.push((five >> shift) as u32 & TOKEN_MASK[c as usize]);
                        j += width as usize;
                        continue;
                    }
                }
            }
            let c = *rest.get(j).ok_or(Defer)?;
            if !TABLES {
                let width = TOKEN_WIDTH[c as usize];
                changes += u32::from(width != prev);
                prev = width;
            }
            let x = match c {
                0x00..=0x7f => {
                    j += 1;
                    c as u32
                }
                0xcc => {
                    let v = *rest.get(j + 1).ok_or(Defer)?;
                    j += 2;
                    v as u32
                }
                0xcd => {
                    let v = rest.get(j + 1..j + 3).ok_or(Defer)?;
                    j += 3;
                    u16::from_be_bytes([v[0], v[1]]) as u32
                }
                0xce => {
                    let v = rest.get(j + 1..j + 5).ok_or(Defer)?;
                    j += 5;
                    u32::from_be_bytes([v[0], v[1], v[2], v[3]])
                }
                _ => {
                    self.b = Bytes::new(&rest[j..]);
                    let m = self.marker()?;
                    let x = match self.num_of(m)?.ok_or(Defer)? {
                        Num::U(x) if x <= u32::MAX as u64 => x as u32,
                        Num::I(x) if (0..=u32::MAX as i64).contains(&x) => x as u32,
                        _ => {
                            *ok = false;
                            0
                        }
                    };
                    rest = self.b.remaining_slice();
                    j = 0;
                    x
                }
            };
            out.push(x);
        }
        self.b = Bytes::new(&rest[j..]);
        Ok(changes)
    }

    /// `list[list[int]] | None` (checked, not kept).
    fn opt_token_lists(&mut self) -> R<()> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(());
        }
        let n = self.array_len_of(m)?;
        let mut scratch = Vec::new();
        for _ in 0..n {
            scratch.clear();
            self.tokens(&mut scratch)?;
        }
        Ok(())
    }

    /// `list[tuple[Any, ...] | None] | None`: (length, all nil), or None for nil.
    fn opt_extras(&mut self) -> R<Option<(usize, bool)>> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        let n = self.array_len_of(m)?;
        let mut all_nil = true;
        for _ in 0..n {
            let m = self.marker()?;
            if m == Marker::Null {
                continue;
            }
            all_nil = false;
            let k = self.array_len_of(m)?;
            for _ in 0..k {
                self.skip_any(2)?;
            }
        }
        Ok(Some((n, all_nil)))
    }

    fn parent(&mut self) -> R<Parent> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(Parent::None);
        }
        Ok(match self.hash_of(m)? {
            Some(k) => Parent::Key(k),
            None => Parent::Other,
        })
    }
}

fn block_size_of(n: Num) -> Option<u64> {
    match n {
        Num::U(x) => Some(x),
        Num::I(x) if x >= 0 => Some(x as u64),
        Num::I(_) => None,
    }
}

fn group0_of(g: Option<Num>) -> bool {
    matches!(g, None | Some(Num::U(0)) | Some(Num::I(0)))
}

// The fields of each event in schema order (kvstream/wire/events.py); the array shape's
// slots follow this order after the tag.
const STORED: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
/// Fields of `BlockStored` without a default (always on the map shape's wire).
const STORED_REQUIRED: usize = 7;
const REMOVED: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];
const REMOVED_REQUIRED: usize = 2;

struct Reader<'a> {
    rd: Rd<'a>,
    out: Batch,
}

impl<'a> Reader<'a> {
    /// Read field `f` (schema position) of an event of `kind` into `ev`.
    fn field(&mut self, kind: Kind, f: usize, ev: &mut Ev) -> R<()> {
        let rd = &mut self.rd;
        let name = match kind {
            Kind::Stored => STORED[f],
            Kind::Removed => REMOVED[f],
            Kind::Cleared => return Err(Defer),
        };
        match name {
            "block_hashes" => {
                ev.h0 = self.out.hashes.len();
                let (ok, listed) = rd.hashes(&mut self.out.hashes)?;
                ev.hashes_ok = ok;
                ev.listed = listed;
                // A run with a bytes hash keeps no column: the Python rules read it.
                if !ev.hashes_ok {
                    self.out.hashes.truncate(ev.h0);
                }
                ev.h1 = self.out.hashes.len();
            }
            "parent_block_hash" => ev.parent = rd.parent()?,
            "token_ids" => {
                ev.t0 = self.out.tokens.len();
                ev.tokens_ok = rd.tokens(&mut self.out.tokens)?;
                ev.t1 = self.out.tokens.len();
            }
            "block_size" => ev.block_size = block_size_of(rd.num()?),
            "lora_id" => ev.base &= rd.opt_int()?.is_none(),
            "medium" => ev.gpu = matches!(rd.opt_str()?, None | Some("GPU")),
            "lora_name" => ev.base &= rd.opt_str()?.is_none(),
            "extra_keys" => match rd.opt_extras()? {
                None => ev.extras_len = None,
                Some((n, all_nil)) => {
                    ev.extras_len = Some(n);
                    ev.extras_all_nil = all_nil;
                }
            },
            "group_idx" => ev.group0 = group0_of(rd.opt_int()?),
            "kv_cache_spec_kind" => {
                rd.opt_str()?;
            }
            "kv_cache_spec_sliding_window" => {
                rd.opt_int()?;
            }
            "locality" | "ownership" => rd.skip_any(1)?,
            "session_id" => ev.session = rd.opt_str()?.is_some(),
            "lookahead_token_ids" => rd.opt_token_lists()?,
            _ => return Err(Defer),
        }
        Ok(())
    }

    fn fields_of(kind: Kind) -> (&'static [&'static str], usize) {
        match kind {
            Kind::Stored => (&STORED, STORED_REQUIRED),
            Kind::Removed => (&REMOVED, REMOVED_REQUIRED),
            Kind::Cleared => (&[], 0),
        }
    }

    fn kind_of(tag: &str) -> R<Kind> {
        match tag {
            "BlockStored" => Ok(Kind::Stored),
            "BlockRemoved" => Ok(Kind::Removed),
            "AllBlocksCleared" => Ok(Kind::Cleared),
            _ => Err(Defer), // unknown: the decoder's unknown_events rule
        }
    }

    /// A map-shaped event (the tag may be anywhere among its keys).
    fn map_event(&mut self, n: usize) -> R<Ev> {
        if n > self.rd.left() {
            return Err(Defer);
        }
        // msgspec (so vLLM) writes the tag first: read it in place.
        let save = self.rd.b;
        if n > 0 {
            let m = self.rd.marker()?;
            if self.rd.key_of(m)? == b"type" {
                let m = self.rd.marker()?;
                let kind = Self::kind_of(self.rd.str_of(m)?.ok_or(Defer)?)?;
                return self.map_fields(kind, n - 1, false);
            }
            self.rd.b = save;
        }
        // Elsewhere: find it without decoding (keys are strings; values skipped).
        let mut kind = None;
        for _ in 0..n {
            let m = self.rd.marker()?;
            let k = self.rd.str_of(m)?.ok_or(Defer)?;
            if k == "type" {
                if kind.is_some() {
                    return Err(Defer);
                }
                let m = self.rd.marker()?;
                kind = Some(Self::kind_of(self.rd.str_of(m)?.ok_or(Defer)?)?);
            } else {
                self.rd.skip_any(1)?;
            }
        }
        let kind = kind.ok_or(Defer)?;
        self.rd.b = save;
        self.map_fields(kind, n, true)
    }

    /// The `n` remaining entries of a map-shaped event of `kind`; `tag`: the "type" key
    /// is among them (skipped once; a second one defers).
    fn map_fields(&mut self, kind: Kind, n: usize, mut tag: bool) -> R<Ev> {
        let (fields, required) = Self::fields_of(kind);
        let mut ev = Ev::new(kind);
        let mut seen: u32 = 0;
        for _ in 0..n {
            let m = self.rd.marker()?;
            let k = self.rd.key_of(m)?;
            if k == b"type" {
                if !tag {
                    return Err(Defer);
                }
                tag = false;
                self.rd.skip_any(1)?;
                continue;
            }
            match fields.iter().position(|f| f.as_bytes() == k) {
                Some(f) => {
                    if seen & (1 << f) != 0 {
                        return Err(Defer); // a key given twice
                    }
                    seen |= 1 << f;
                    self.field(kind, f, &mut ev)?;
                }
                None => {
                    // An unknown key: msgspec still requires it to be valid UTF-8.
                    std::str::from_utf8(k).map_err(|_| Defer)?;
                    self.rd.skip_any(1)?
                }
            }
        }
        if seen & ((1u32 << required) - 1) != (1u32 << required) - 1 {
            return Err(Defer); // a required field missing
        }
        Ok(ev)
    }

    /// A tagged-array event: missing trailing slots default, extra ones are ignored.
    fn array_event(&mut self, n: usize) -> R<Ev> {
        if n == 0 {
            return Err(Defer);
        }
        let m = self.rd.marker()?;
        let kind = Self::kind_of(self.rd.str_of(m)?.ok_or(Defer)?)?;
        let (fields, _) = Self::fields_of(kind);
        if kind != Kind::Cleared && n < 2 {
            return Err(Defer); // block_hashes has no default
        }
        let mut ev = Ev::new(kind);
        let mut h = self.out.hashes.len();
        ev.h0 = h;
        ev.h1 = h;
        h = self.out.tokens.len();
        ev.t0 = h;
        ev.t1 = h;
        for f in 0..n - 1 {
            if f < fields.len() {
                self.field(kind, f, &mut ev)?;
            } else {
                self.rd.skip_any(1)?;
            }
        }
        Ok(ev)
    }

    fn event(&mut self) -> R<Ev> {
        let m = self.rd.marker()?;
        let ev = match m {
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = len_of(m, &mut self.rd.b)?;
                self.map_event(n)?
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.rd.array_len_of(m)?;
                self.array_event(n)?
            }
            _ => return Err(Defer),
        };
        if ev.kind != Kind::Cleared {
            self.out.blocks += if ev.hashes_ok { ev.n_hashes() } else { 0 };
        }
        Ok(ev)
    }

    fn batch(mut self) -> R<Batch> {
        let n = self.rd.array_len()?;
        if n < 2 {
            return Err(Defer);
        }
        self.out.ts = self.rd.float()?;
        let k = self.rd.array_len()?;
        self.out.events.reserve(k);
        for _ in 0..k {
            let ev = self.event()?;
            self.out.events.push(ev);
        }
        if n >= 3 {
            self.out.rank = match self.rd.opt_int()? {
                None => None,
                Some(Num::I(x)) => Some(x),
                Some(Num::U(x)) => Some(i64::try_from(x).map_err(|_| Defer)?),
            };
            for _ in 3..n {
                self.rd.skip_any(1)?;
            }
        }
        if self.rd.left() != 0 {
            return Err(Defer); // trailing bytes
        }
        Ok(self.out)
    }
}

/// Decode one payload, or `None` to hand it to the Python decoder (see the module docs).
/// Payloads longer than `max_bytes` are deferred (the Python decoder rejects them).
pub fn read_batch(payload: &[u8], max_bytes: usize) -> Option<Batch> {
    if payload.len() > max_bytes {
        return None;
    }
    let r = Reader {
        rd: Rd {
            b: Bytes::new(payload),
        },
        out: Batch::default(),
    };
    r.batch().ok()
}

// -- the Python face ---------------------------------------------------------------------

/// A payload decoded by the native reader (`kvstream._native.RawBatch`): the batch's
/// `ts` and `data_parallel_rank`, its events in native columns. The index applies it
/// with `apply_tokens` / `apply_engine` as it applies a list of decoded events.
#[pyclass(module = "kvstream._native", frozen)]
pub struct RawBatch {
    pub(crate) batch: Batch,
}

#[pymethods]
impl RawBatch {
    /// The batch's timestamp (seconds since the epoch).
    #[getter]
    fn ts(&self) -> f64 {
        self.batch.ts
    }

    /// The data-parallel rank stamped on the batch (None: not stamped).
    #[getter]
    fn data_parallel_rank(&self) -> Option<i64> {
        self.batch.rank
    }

    /// Block events in the batch (hashes of its stored and removed runs that the native
    /// rules can read).
    #[getter]
    fn blocks(&self) -> usize {
        self.batch.blocks
    }

    fn __len__(&self) -> usize {
        self.batch.events.len()
    }

    /// Bytes this batch holds: the object and its columns' allocations (capacities, not
    /// lengths), what a subscriber's byte bounds count for it while it waits.
    #[getter]
    fn nbytes(&self) -> usize {
        let b = &self.batch;
        std::mem::size_of::<Self>()
            + 2 * std::mem::size_of::<usize>() // the Python object's header
            + b.events.capacity() * std::mem::size_of::<Ev>()
            + b.hashes.capacity() * std::mem::size_of::<u64>()
            + b.tokens.capacity() * std::mem::size_of::<u32>()
    }

    /// The type of event `i`: 0 BlockStored, 1 BlockRemoved, 2 AllBlocksCleared.
    fn kind(&self, i: usize) -> PyResult<u8> {
        match self.batch.events.get(i) {
            Some(ev) => Ok(match ev.kind {
                Kind::Stored => 0,
                Kind::Removed => 1,
                Kind::Cleared => 2,
            }),
            None => Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "event {i} of {}",
                self.batch.events.len()
            ))),
        }
    }

    /// What the reader read of event `i`, for the tests against the Python decoder:
    /// ``(kind, hashes or None, token ids or None, parent, block_size or None, gpu,
    /// group0, base, extras_plain, session)``; ``hashes`` is None when one is bytes or 0,
    /// the token ids when one is outside u32, ``parent`` None, an int, or -1 (bytes or 0).
    #[allow(clippy::type_complexity)]
    fn describe(
        &self,
        i: usize,
    ) -> PyResult<(
        u8,
        Option<Vec<u64>>,
        Option<Vec<u32>>,
        Option<i128>,
        Option<u64>,
        bool,
        bool,
        bool,
        bool,
        bool,
    )> {
        let kind = self.kind(i)?;
        let b = &self.batch;
        let ev = &b.events[i];
        Ok((
            kind,
            ev.hashes_ok.then(|| ev.hashes(b).to_vec()),
            ev.tokens_ok.then(|| ev.tokens(b).to_vec()),
            match ev.parent {
                Parent::None => None,
                Parent::Key(k) => Some(k as i128),
                Parent::Other => Some(-1),
            },
            ev.block_size,
            ev.gpu,
            ev.group0,
            ev.base,
            ev.extras_plain(),
            ev.session,
        ))
    }

    fn __repr__(&self) -> String {
        format!(
            "RawBatch(ts={}, {} events, {} blocks)",
            self.batch.ts,
            self.batch.events.len(),
            self.batch.blocks
        )
    }
}

/// Decode a KV event payload (``bytes``) with the GIL released: a :class:`RawBatch`, or
/// None when the payload is for the Python decoder (malformed, unusual, or over
/// ``max_bytes``); see the module docs.
#[pyfunction]
pub fn read_payload(
    py: Python<'_>,
    payload: &Bound<'_, PyBytes>,
    max_bytes: usize,
) -> Option<RawBatch> {
    let data: &[u8] = payload.as_bytes();
    let batch = if data.len() < 4096 {
        read_batch(data, max_bytes) // too small to be worth a GIL round trip
    } else {
        py.detach(|| read_batch(data, max_bytes))
    };
    batch.map(|batch| RawBatch { batch })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawBatch>()?;
    m.add_function(wrap_pyfunction!(read_payload, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored_map() -> Vec<u8> {
        // [1.5, [{"type": "BlockStored", block_hashes: [7, 8], parent: nil, token_ids:
        // [1, 2, 3, 4], block_size: 2, lora_id: nil, medium: "GPU", lora_name: nil}], 0]
        let mut v = vec![0x93, 0xcb];
        v.extend_from_slice(&1.5f64.to_be_bytes());
        v.push(0x91);
        v.extend_from_slice(&[0xde, 0x00, 0x08]);
        let s = |k: &str, v: &mut Vec<u8>| {
            v.push(0xa0 | k.len() as u8);
            v.extend_from_slice(k.as_bytes());
        };
        s("type", &mut v);
        s("BlockStored", &mut v);
        s("block_hashes", &mut v);
        v.extend_from_slice(&[0x92, 7, 8]);
        s("parent_block_hash", &mut v);
        v.push(0xc0);
        s("token_ids", &mut v);
        v.extend_from_slice(&[0x94, 1, 2, 3, 4]);
        s("block_size", &mut v);
        v.push(2);
        s("lora_id", &mut v);
        v.push(0xc0);
        s("medium", &mut v);
        s("GPU", &mut v);
        s("lora_name", &mut v);
        v.push(0xc0);
        v.push(0);
        v
    }

    #[test]
    fn reads_a_map_shaped_stored_run() {
        let b = read_batch(&stored_map(), 1 << 20).expect("decoded");
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.rank, Some(0));
        let ev = &b.events[0];
        assert_eq!(ev.kind, Kind::Stored);
        assert_eq!(ev.hashes(&b), &[7, 8]);
        assert_eq!(ev.tokens(&b), &[1, 2, 3, 4]);
        assert!(ev.gpu && ev.group0 && ev.base && ev.extras_plain());
        assert_eq!(ev.block_size, Some(2));
    }

    #[test]
    fn every_truncation_defers_and_never_panics() {
        let p = stored_map();
        for n in 0..p.len() {
            assert!(
                read_batch(&p[..n], 1 << 20).is_none(),
                "prefix of {n} bytes"
            );
        }
        assert!(read_batch(&p, p.len() - 1).is_none(), "over the limit");
    }

    #[test]
    fn a_huge_declared_length_defers() {
        let p = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(read_batch(&p, 1 << 20).is_none());
    }
}
