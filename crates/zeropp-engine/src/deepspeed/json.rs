//! Typed reads of DeepSpeed JSON values, each error naming the key and what
//! it must be; a `null` is "not set" with a warning.

use serde_json::{Map, Value};

use crate::EngineError;

pub(super) fn type_err(key: &str, want: &str, got: &Value) -> EngineError {
    EngineError::InvalidConfig(format!("DeepSpeed config: `{key}` must be {want}, got {got}"))
}

/// Reads `key` of `obj` with `parse`: `None` when it is absent, `null` or
/// `"auto"` (Hugging Face style; reported in `warnings` under the name `shown`
/// with what is used instead, `instead`); an error saying it must be `want`
/// when `parse` refuses the value.
fn read<T>(
    obj: &Map<String, Value>,
    key: &str,
    (shown, instead, want): (&str, &str, &str),
    warnings: &mut Vec<String>,
    parse: impl Fn(&Value) -> Option<T>,
) -> Result<Option<T>, EngineError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => {
            warnings.push(format!("`{shown}`: \"auto\" is not resolved by zeropp; using {instead}"));
            Ok(None)
        }
        Some(v) => parse(v).map(Some).ok_or_else(|| type_err(shown, want, v)),
    }
}

/// Reads a positive integer; `"auto"` is reported and skipped.
pub(super) fn opt_usize(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<usize>, EngineError> {
    let what = (key, "the command-line value", "a positive integer");
    read(obj, key, what, warnings, |v| v.as_u64().filter(|&n| n > 0).map(|n| n as usize))
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
    let what = (full.as_str(), "the default", "a non-negative integer (elements)");
    read(obj, key, what, warnings, |v| match (v.as_u64(), v.as_f64()) {
        (Some(n), _) => Some(n as usize),
        (None, Some(x)) if x >= 0.0 && x.fract() == 0.0 && x < 9.0e15 => Some(x as usize),
        _ => None,
    })
}

/// Reads a finite number; `"auto"` is reported and skipped.
pub(super) fn opt_f32(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<f32>, EngineError> {
    let what = (key, "the default", "a finite number");
    read(obj, key, what, warnings, |v| v.as_f64().filter(|x| x.is_finite()).map(|x| x as f32))
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
