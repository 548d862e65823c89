//! Parameter registry and flat bucket layouts.
//!
//! A [`ParamRegistry`] lists named parameters grouped into buckets (one bucket
//! is the unit of one all-gather: typically one layer). A [`BucketLayout`]
//! places a bucket's parameters in order in one flat buffer, starting at offset
//! 0, each at a multiple of `param_align` (1 = back to back), and then pads the
//! buffer with zeros up to `padded_len`, a multiple of `world × align`. The real
//! values occupy the parameters' ranges (`0..numel` when packed); everything else
//! is zero padding and never overlaps a parameter.

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
/// Parameters are placed in order from offset 0, each at the first multiple of
/// the plan's `param_align` at or after the end of the previous one (with
/// `param_align = 1`, back to back: `params[i].offset` is the sum of the previous
/// sizes and the real values occupy `0..numel`). Zero padding fills the gaps and
/// `end..padded_len`, where `end` is the end of the last parameter and
/// `padded_len` the smallest multiple of `world × align` that is `>= end`. Each
/// of the `world` primary shards is therefore `padded_len / world` elements, a
/// whole number of `align`-element quantization groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketLayout {
    /// Bucket name.
    pub name: String,
    /// Parameters with their offsets.
    pub params: Vec<ParamSlot>,
    /// Number of real elements (the sum of the parameters' sizes).
    pub numel: usize,
    /// Length of the flat buffer including padding.
    pub padded_len: usize,
}

impl BucketLayout {
    /// Lays out `spec` for shards of `granule = world × align` elements, each
    /// parameter starting at a multiple of `param_align`.
    pub(crate) fn new(spec: &BucketSpec, granule: usize, param_align: usize) -> Result<Self> {
        let overflow = || PartitionError::InvalidRegistry(format!("bucket {:?} size overflows", spec.name));
        let mut offset = 0usize;
        let mut numel_sum = 0usize;
        let mut params = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let numel = p
                .numel()
                .ok_or_else(|| PartitionError::InvalidRegistry(format!("shape of {:?} overflows", p.name)))?;
            offset =
                offset.div_ceil(param_align.max(1)).checked_mul(param_align.max(1)).ok_or_else(overflow)?;
            params.push(ParamSlot {
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: p.dtype,
                offset,
                numel,
            });
            offset = offset.checked_add(numel).ok_or_else(overflow)?;
            numel_sum += numel;
        }
        let padded_len = offset.div_ceil(granule).checked_mul(granule).ok_or_else(|| {
            PartitionError::InvalidConfig(format!("padded size of bucket {:?} overflows", spec.name))
        })?;
        Ok(Self { name: spec.name.clone(), params, numel: numel_sum, padded_len })
    }

    /// True when the parameters are back to back from offset 0 (real values in
    /// `0..numel`, padding only at the end).
    pub fn is_packed(&self) -> bool {
        self.params.last().is_none_or(|p| p.offset + p.numel == self.numel)
    }

    /// The parameters of a flat buffer (`padded_len` long, or at least up to the
    /// last parameter's end) back to back: the `numel` values a model holds.
    pub fn compact<T: Copy>(&self, flat: &[T]) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(self.numel);
        for t in self.unflatten(flat)? {
            out.extend_from_slice(t);
        }
        Ok(out)
    }

    /// Each parameter with its range in the compact buffer (the parameters back to
    /// back, see [`BucketLayout::compact`]).
    pub fn compact_ranges(&self) -> Vec<(&ParamSlot, Range<usize>)> {
        let mut at = 0;
        self.params
            .iter()
            .map(|p| {
                let r = at..at + p.numel;
                at += p.numel;
                (p, r)
            })
            .collect()
    }

    /// The inverse of [`BucketLayout::compact`]: places `numel` values (the
    /// parameters back to back) into a `padded_len` flat buffer, padding with
    /// `T::default()`.
    pub fn expand<T: Copy + Default>(&self, compact: &[T]) -> Result<Vec<T>> {
        let mut flat = vec![T::default(); self.padded_len];
        self.expand_into(compact, &mut flat)?;
        Ok(flat)
    }

    /// [`BucketLayout::expand`] into an existing `padded_len` buffer (its padding is
    /// left untouched).
    pub fn expand_into<T: Copy>(&self, compact: &[T], flat: &mut [T]) -> Result<()> {
        if compact.len() != self.numel || flat.len() != self.padded_len {
            return Err(PartitionError::LengthMismatch {
                what: format!("compact/flat buffers of bucket {:?}", self.name),
                expected: self.numel,
                actual: compact.len(),
            });
        }
        let mut at = 0;
        for p in &self.params {
            let (src, dst) = (compact.get(at..at + p.numel), flat.get_mut(p.range()));
            match (src, dst) {
                (Some(s), Some(d)) => d.copy_from_slice(s),
                _ => {
                    return Err(PartitionError::LengthMismatch {
                        what: format!("parameter {:?}", p.name),
                        expected: p.offset + p.numel,
                        actual: flat.len(),
                    });
                }
            }
            at += p.numel;
        }
        Ok(())
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

    /// Number of padding elements (`padded_len - numel`: between parameters and at the end).
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
        let mut flat = vec![T::default(); self.padded_len];
        for (slot, t) in self.params.iter().zip(tensors) {
            match flat.get_mut(slot.range()) {
                Some(d) if t.len() == slot.numel => d.copy_from_slice(t),
                _ => {
                    return Err(PartitionError::LengthMismatch {
                        what: format!("parameter {:?}", slot.name),
                        expected: slot.numel,
                        actual: t.len(),
                    });
                }
            }
        }
        Ok(flat)
    }

    /// Splits a flat buffer (`padded_len` long, or at least up to the last
    /// parameter's end) into one tensor per parameter, dropping the padding.
    pub fn unflatten<'a, T>(&self, flat: &'a [T]) -> Result<Vec<&'a [T]>> {
        self.params
            .iter()
            .map(|p| {
                flat.get(p.range()).ok_or_else(|| PartitionError::LengthMismatch {
                    what: format!("flat buffer of bucket {:?}", self.name),
                    expected: p.offset + p.numel,
                    actual: flat.len(),
                })
            })
            .collect()
    }
}
