//! Parameter registry and flat bucket layouts.
//!
//! A [`ParamRegistry`] lists named parameters grouped into buckets (one bucket
//! is the unit of one all-gather: typically one layer). A [`BucketLayout`]
//! places a bucket's parameters back to back in one flat buffer, starting at
//! offset 0, and then pads the buffer with zeros up to `padded_len`, a multiple
//! of `world × align`. The real values occupy `0..numel`; the padding occupies
//! `numel..padded_len` and never overlaps a parameter.

use std::collections::HashSet;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{PartitionError, Result};

/// Element type a parameter is declared with.
///
/// This is the dtype of the model's tensor (used when exporting). The flat
/// working buffers that the engine gathers are 16-bit for every parameter,
/// and the master weights and optimizer states are f32 for every parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE 754 binary16.
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Lower-case name (`"f32"`, `"bf16"`, `"f16"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One named parameter: name, shape and declared dtype.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Unique name across the registry (e.g. `"layers.0.attn.wq"`).
    pub name: String,
    /// Tensor shape; the element count is the product (an empty shape is a scalar).
    pub shape: Vec<usize>,
    /// Declared dtype.
    pub dtype: DType,
}

impl ParamSpec {
    /// Builds a parameter spec.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        Self { name: name.into(), shape: shape.into(), dtype }
    }

    /// Number of elements (product of the shape), `None` on overflow.
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

/// A named group of parameters: the unit of one all-gather.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketSpec {
    /// Unique bucket name (e.g. `"layers.0"`).
    pub name: String,
    /// Parameters in layout order.
    pub params: Vec<ParamSpec>,
}

/// The registry of a model's parameters, grouped into buckets.
///
/// ```
/// use zeropp_partition::{DType, ParamRegistry, ParamSpec};
/// let mut reg = ParamRegistry::new();
/// let b = reg.push_bucket("layer0", vec![
///     ParamSpec::new("layer0.w", [4, 8], DType::BF16),
///     ParamSpec::new("layer0.b", [8], DType::F32),
/// ])?;
/// assert_eq!(b, 0);
/// assert_eq!(reg.numel(), 40);
/// # Ok::<(), zeropp_partition::PartitionError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRegistry {
    buckets: Vec<BucketSpec>,
}

impl ParamRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a bucket and returns its index. Bucket names and parameter names
    /// must be non-empty and unique; shapes must not overflow `usize`.
    pub fn push_bucket(&mut self, name: impl Into<String>, params: Vec<ParamSpec>) -> Result<usize> {
        let name = name.into();
        if name.is_empty() {
            return Err(PartitionError::InvalidRegistry("empty bucket name".into()));
        }
        if self.buckets.iter().any(|b| b.name == name) {
            return Err(PartitionError::InvalidRegistry(format!("duplicate bucket name {name:?}")));
        }
        let mut seen: HashSet<&str> =
            self.buckets.iter().flat_map(|b| b.params.iter().map(|p| p.name.as_str())).collect();
        let mut total = 0usize;
        for p in &params {
            if p.name.is_empty() {
                return Err(PartitionError::InvalidRegistry(format!(
                    "empty parameter name in bucket {name:?}"
                )));
            }
            if !seen.insert(p.name.as_str()) {
                return Err(PartitionError::InvalidRegistry(format!(
                    "duplicate parameter name {:?}",
                    p.name
                )));
            }
            let n = p
                .numel()
                .ok_or_else(|| PartitionError::InvalidRegistry(format!("shape of {:?} overflows", p.name)))?;
            total = total
                .checked_add(n)
                .ok_or_else(|| PartitionError::InvalidRegistry(format!("bucket {name:?} size overflows")))?;
        }
        self.buckets.push(BucketSpec { name, params });
        Ok(self.buckets.len() - 1)
    }

    /// The buckets, in order.
    pub fn buckets(&self) -> &[BucketSpec] {
        &self.buckets
    }

    /// Total number of real (unpadded) parameter elements.
    pub fn numel(&self) -> usize {
        self.buckets.iter().flat_map(|b| b.params.iter()).map(|p| p.numel().unwrap_or(0)).sum()
    }
}

/// Where one parameter lives inside its bucket's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSlot {
    /// Parameter name.
    pub name: String,
    /// Parameter shape.
    pub shape: Vec<usize>,
    /// Declared dtype.
    pub dtype: DType,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub numel: usize,
}

impl ParamSlot {
    /// The element range `offset..offset + numel` in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// Flat layout of one bucket.
///
/// Parameters are packed back to back from offset 0 (`params[i].offset` is
/// the sum of the previous sizes); real values occupy `0..numel` and zero
/// padding occupies `numel..padded_len`, where `padded_len` is the smallest
/// multiple of `world × align` that is `>= numel`. Each of the `world`
/// primary shards is therefore `padded_len / world` elements, a whole number
/// of `align`-element quantization groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketLayout {
    /// Bucket name.
    pub name: String,
    /// Parameters with their offsets.
    pub params: Vec<ParamSlot>,
    /// Number of real elements.
    pub numel: usize,
    /// Length of the flat buffer including padding.
    pub padded_len: usize,
}

impl BucketLayout {
    /// Lays out `spec` for shards of `granule = world × align` elements.
    pub(crate) fn new(spec: &BucketSpec, granule: usize) -> Result<Self> {
        let mut offset = 0usize;
        let mut params = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let numel = p
                .numel()
                .ok_or_else(|| PartitionError::InvalidRegistry(format!("shape of {:?} overflows", p.name)))?;
            params.push(ParamSlot {
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: p.dtype,
                offset,
                numel,
            });
            offset = offset.checked_add(numel).ok_or_else(|| {
                PartitionError::InvalidRegistry(format!("bucket {:?} size overflows", spec.name))
            })?;
        }
        let padded_len = offset.div_ceil(granule).checked_mul(granule).ok_or_else(|| {
            PartitionError::InvalidConfig(format!("padded size of bucket {:?} overflows", spec.name))
        })?;
        Ok(Self { name: spec.name.clone(), params, numel: offset, padded_len })
    }

    /// The bucket's spec (names, shapes, dtypes) without offsets.
    pub fn spec(&self) -> BucketSpec {
        BucketSpec {
            name: self.name.clone(),
            params: self
                .params
                .iter()
                .map(|p| ParamSpec::new(p.name.clone(), p.shape.clone(), p.dtype))
                .collect(),
        }
    }

    /// Number of padding elements (`padded_len - numel`).
    pub fn padding(&self) -> usize {
        self.padded_len - self.numel
    }

    /// Flattens one tensor per parameter (in layout order) into a
    /// `padded_len` buffer, filling the padding with `T::default()`.
    pub fn flatten<T: Copy + Default>(&self, tensors: &[&[T]]) -> Result<Vec<T>> {
        if tensors.len() != self.params.len() {
            return Err(PartitionError::LengthMismatch {
                what: format!("tensors of bucket {:?}", self.name),
                expected: self.params.len(),
                actual: tensors.len(),
            });
        }
        let mut flat = Vec::with_capacity(self.padded_len);
        for (slot, t) in self.params.iter().zip(tensors) {
            if t.len() != slot.numel {
                return Err(PartitionError::LengthMismatch {
                    what: format!("parameter {:?}", slot.name),
                    expected: slot.numel,
                    actual: t.len(),
                });
            }
            flat.extend_from_slice(t);
        }
        flat.resize(self.padded_len, T::default());
        Ok(flat)
    }

    /// Splits a flat buffer (of length `numel` or more, e.g. `padded_len`)
    /// into one tensor per parameter, dropping the padding.
    pub fn unflatten<'a, T>(&self, flat: &'a [T]) -> Result<Vec<&'a [T]>> {
        if flat.len() < self.numel {
            return Err(PartitionError::LengthMismatch {
                what: format!("flat buffer of bucket {:?}", self.name),
                expected: self.numel,
                actual: flat.len(),
            });
        }
        Ok(self.params.iter().map(|p| &flat[p.range()]).collect())
    }
}
