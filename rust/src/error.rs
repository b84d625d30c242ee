//! The crate's one error enum, mapped once to kvstream's Python exceptions.
//!
//! `Local` is the caller's fault (kvstream.errors.LocalProtocolError's family), `Remote`
//! is malformed input from a peer or a file (RemoteProtocolError's). The Python layer
//! re-raises them as its own typed errors; nothing else crosses the boundary.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(_native, NativeLocalError, PyValueError, "A bad call into the native core (the caller's fault).");
create_exception!(_native, NativeRemoteError, PyValueError, "Malformed remote input seen by the native core.");

/// What can go wrong in the native core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The caller passed something the call does not take.
    Local(String),
    /// Input from outside (a payload) is malformed.
    Remote(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Local(m) | Error::Remote(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Local(m) => NativeLocalError::new_err(m),
            Error::Remote(m) => NativeRemoteError::new_err(m),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NativeLocalError", m.py().get_type::<NativeLocalError>())?;
    m.add("NativeRemoteError", m.py().get_type::<NativeRemoteError>())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_message() {
        assert_eq!(Error::Remote("bad frame".into()).to_string(), "bad frame");
    }
}
