//! Kept for the modules that import the router-key chain from here: the implementation
//! is [`crate::keys`] (one router-key loop for the Python API, the ingest and the query
//! path).

pub use crate::keys::{chain_into, chain_tokens as chain, KEY_MASK};
