//! Typed reads of DeepSpeed JSON values, each error naming the key and what
//! it must be; a `null` is "not set" with a warning.

use serde_json::{Map, Value};

use crate::EngineError;

pub(super) fn type_err(key: &str, want: &str, got: &Value) -> EngineError {
    EngineError::InvalidConfig(format!("DeepSpeed config: `{key}` must be {want}, got {got}"))
}

/// The value of `key` in `obj`, or `None` when it is absent, `null` or
/// `"auto"` (Hugging Face style: reported in `warnings` under the name `shown`,
/// with what is used instead, `instead`).
fn set_value<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    shown: &str,
    instead: &str,
    warnings: &mut Vec<String>,
) -> Option<&'a Value> {
    match obj.get(key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "auto" => {
            warnings.push(format!("`{shown}`: \"auto\" is not resolved by zeropp; using {instead}"));
            None
        }
        v => v,
    }
}

/// Reads a positive integer; `"auto"` is reported and skipped.
pub(super) fn opt_usize(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<usize>, EngineError> {
    let Some(v) = set_value(obj, key, key, "the command-line value", warnings) else { return Ok(None) };
    match v.as_u64() {
        Some(n) if n > 0 => Ok(Some(n as usize)),
        _ => Err(type_err(key, "a positive integer", v)),
    }
}

/// Reads a bucket knob of `zero_optimization`: a non-negative integer (an
/// integral number such as `5e8` too, as DeepSpeed configs write them);
/// `"auto"` is reported and skipped.
pub(super) fn opt_elements(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<usize>, EngineError> {
    let full = format!("zero_optimization.{key}");
    let Some(v) = set_value(obj, key, &full, "the default", warnings) else { return Ok(None) };
    match (v.as_u64(), v.as_f64()) {
        (Some(n), _) => Ok(Some(n as usize)),
        (None, Some(x)) if x >= 0.0 && x.fract() == 0.0 && x < 9.0e15 => Ok(Some(x as usize)),
        _ => Err(type_err(&full, "a non-negative integer (elements)", v)),
    }
}

/// Reads a finite number; `"auto"` is reported and skipped.
pub(super) fn opt_f32(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<f32>, EngineError> {
    let Some(v) = set_value(obj, key, key, "the default", warnings) else { return Ok(None) };
    match v.as_f64() {
        Some(x) if x.is_finite() => Ok(Some(x as f32)),
        _ => Err(type_err(key, "a finite number", v)),
    }
}

pub(super) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, EngineError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(type_err(key, "true or false", v)),
    }
}

pub(super) fn as_object<'a>(key: &str, v: &'a Value) -> Result<&'a Map<String, Value>, EngineError> {
    v.as_object().ok_or_else(|| type_err(key, "an object", v))
}
