//! Typed reads of DeepSpeed JSON values, each error naming the key (with its
//! dotted path) and what it must be; a `null` is "not set", and `"auto"` is
//! "not set" with a warning.

use serde_json::{Map, Value};

use crate::RunError;

pub(super) fn type_err(key: &str, want: &str, got: &Value) -> RunError {
    RunError::InvalidConfig(format!("DeepSpeed config: `{key}` must be {want}, got {got}"))
}

/// What a key must hold: its description in errors, what is used when it
/// says `"auto"`, and how a value is read.
#[derive(Clone, Copy)]
pub(super) struct Want<T> {
    what: &'static str,
    instead: &'static str,
    parse: fn(&Value) -> Option<T>,
}

/// A positive integer that falls back to the command line (batch sizes, hpZ).
pub(super) const POSITIVE: Want<usize> = Want {
    what: "a positive integer",
    instead: "the command-line value",
    parse: |v| v.as_u64().filter(|&n| n > 0).map(|n| n as usize),
};

/// A non-negative integer.
pub(super) const COUNT: Want<usize> = Want {
    what: "a non-negative integer",
    instead: "the default",
    parse: |v| v.as_u64().map(|n| n as usize),
};

/// A bucket knob: a non-negative integer, or an integral number such as
/// `5e8`, as DeepSpeed configs write them.
pub(super) const ELEMENTS: Want<usize> = Want {
    what: "a non-negative integer (elements)",
    instead: "the default",
    parse: |v| match (v.as_u64(), v.as_f64()) {
        (Some(n), _) => Some(n as usize),
        (None, Some(x)) if x >= 0.0 && x.fract() == 0.0 && x < 9.0e15 => Some(x as usize),
        _ => None,
    },
};

/// A finite number.
pub(super) const FINITE: Want<f32> = Want {
    what: "a finite number",
    instead: "the default",
    parse: |v| v.as_f64().filter(|x| x.is_finite()).map(|x| x as f32),
};

/// One JSON object of the config and its dotted path (empty at the root), so
/// every message names a key as the file spells it.
#[derive(Clone, Copy)]
pub(super) struct Section<'a> {
    obj: &'a Map<String, Value>,
    path: &'a str,
}

impl<'a> Section<'a> {
    /// The config's root object.
    pub(super) fn root(v: &'a Value) -> Result<Self, RunError> {
        Ok(Self { obj: as_object("<root>", v)?, path: "" })
    }

    /// The object `v` at `path`, or an error saying it must be one.
    pub(super) fn at(path: &'a str, v: &'a Value) -> Result<Self, RunError> {
        Ok(Self { obj: as_object(path, v)?, path })
    }

    /// The object's keys and values.
    pub(super) fn entries(&self) -> serde_json::map::Iter<'a> {
        self.obj.iter()
    }

    /// `key` with this section's path in front.
    pub(super) fn shown(&self, key: &str) -> String {
        if self.path.is_empty() { key.to_string() } else { format!("{}.{key}", self.path) }
    }

    /// Reads `key` as `want`: `None` when it is absent, `null` or `"auto"`
    /// (Hugging Face style, reported in `warnings`); an error saying what it
    /// must be when the value does not parse.
    pub(super) fn get<T>(
        &self,
        key: &str,
        want: Want<T>,
        warnings: &mut Vec<String>,
    ) -> Result<Option<T>, RunError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "auto" => {
                let shown = self.shown(key);
                warnings
                    .push(format!("`{shown}`: \"auto\" is not resolved by zeropp; using {}", want.instead));
                Ok(None)
            }
            Some(v) => (want.parse)(v).map(Some).ok_or_else(|| type_err(&self.shown(key), want.what, v)),
        }
    }

    /// Reads `key` as `true` or `false` (`None` when absent or `null`).
    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>, RunError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(type_err(&self.shown(key), "true or false", v)),
        }
    }
}

pub(super) fn as_object<'a>(key: &str, v: &'a Value) -> Result<&'a Map<String, Value>, RunError> {
    v.as_object().ok_or_else(|| type_err(key, "an object", v))
}
