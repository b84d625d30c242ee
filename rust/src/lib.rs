//! kvstream's native core, imported from Python as `kvstream._native`.
//!
//! The crate owns data layouts and per-item loops; Python owns the API, configuration,
//! I/O and policy. Every entry point is a coarse call (a whole prompt, a whole batch).
#![forbid(unsafe_code)]

use pyo3::prelude::*;

pub mod answer;
pub mod decode;
pub mod error;
pub mod hash;
pub mod ingest;
pub mod json;
pub mod keys;
pub mod query;
pub mod table;

/// The Python module `kvstream._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    error::register(m)?;
    hash::register(m)?;
    keys::register(m)?;
    table::register(m)?;
    ingest::register(m)?;
    query::register(m)?;
    answer::register(m)?;
    json::register(m)?;
    decode::register(m)?;
    Ok(())
}
