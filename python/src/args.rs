//! The package's arguments checked as the user wrote them: each error names the method, the
//! parameter and what it takes (pyo3's own conversions said only "must be real number, not
//! str" or "can't convert negative int to unsigned", naming neither), and values a method used
//! to take silently (a negative wait, a bucket the ring lacks, a NaN loss) are refused alike
//! everywhere.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The type's name of `v`, for an error (`str`, `NoneType`).
fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Seconds to wait (`timeout=`, `wait=`): None, or an int or float, finite and 0 or more (one
/// past what a clock counts waits as None does).
pub fn seconds(method: &str, name: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<f64>> {
    let Some(v) = v else { return Ok(None) };
    let what = || format!("{method}: {name} must be a number of seconds (0 or more) or None");
    let t: f64 = v
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("{}, got {}", what(), type_name(v))))?;
    if !(t.is_finite() && t >= 0.0) {
        return Err(PyValueError::new_err(format!("{}, got {t}", what())));
    }
    Ok(Some(t))
}

/// An int of 0 or more (a step, a count), at most `max`; `allowed` says what it is for the
/// error (`a group step`).
pub fn unsigned(
    method: &str,
    name: &str,
    allowed: &str,
    max: u64,
    v: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let what = || format!("{method}: {name} must be {allowed}, an int from 0 to {max}");
    if v.is_instance_of::<pyo3::types::PyFloat>() {
        return Err(PyTypeError::new_err(format!("{}, got float {v}", what())));
    }
    match v.extract::<u64>() {
        Ok(n) if n <= max => Ok(n),
        Ok(n) => Err(PyValueError::new_err(format!("{}, got {n}", what()))),
        // An int below 0 or past 2^64 (Python's own error says only "can't convert").
        Err(_) if v.extract::<i64>().is_ok() || v.is_instance_of::<pyo3::types::PyInt>() => {
            Err(PyValueError::new_err(format!("{}, got {v}", what())))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{}, got {}",
            what(),
            type_name(v)
        ))),
    }
}

/// `unsigned`, None allowed.
pub fn maybe_unsigned(
    method: &str,
    name: &str,
    allowed: &str,
    max: u64,
    v: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<u64>> {
    v.map(|v| unsigned(method, name, allowed, max, v))
        .transpose()
}

/// A finite float (a loss, a learning rate).
pub fn finite(method: &str, name: &str, v: &Bound<'_, PyAny>) -> PyResult<f32> {
    let what = || format!("{method}: {name} must be a finite number");
    let x: f64 = v
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("{}, got {}", what(), type_name(v))))?;
    if !x.is_finite() || !(x as f32).is_finite() {
        return Err(PyValueError::new_err(format!("{}, got {x}", what())));
    }
    Ok(x as f32)
}

/// `finite`, None allowed.
pub fn maybe_finite(
    method: &str,
    name: &str,
    v: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<f32>> {
    v.map(|v| finite(method, name, v)).transpose()
}
