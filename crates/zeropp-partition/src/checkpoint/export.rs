//! Exporting the consolidated master weights as one safetensors file.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use super::format::f32_bytes;
use super::fs::atomic_write;
use super::load::Checkpoint;
use crate::error::{PartitionError, Result};
use crate::layout::DType;

impl Checkpoint {
    /// Writes the master weights as one consolidated safetensors file:
    /// one tensor per parameter, named by parameter name, with its shape and
    /// declared dtype (f32 masters rounded to nearest for bf16/f16), padding
    /// stripped. Written atomically. Returns the file size in bytes.
    pub fn export_safetensors(&self, out: &Path) -> Result<u64> {
        let mut data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (layout, full) in self.manifest.buckets.iter().zip(&self.buckets) {
            for (p, range) in layout.compact_ranges() {
                let vals = full.master.get(range).ok_or_else(|| {
                    PartitionError::LayoutMismatch(format!("parameter {:?} out of bounds", p.name))
                })?;
                let (dtype, bytes): (Dtype, Vec<u8>) = match p.dtype {
                    DType::F32 => (Dtype::F32, f32_bytes(vals)),
                    DType::BF16 => (
                        Dtype::BF16,
                        vals.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
                    ),
                    DType::F16 => (
                        Dtype::F16,
                        vals.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
                    ),
                };
                data.push((p.name.clone(), dtype, p.shape.clone(), bytes));
            }
        }
        let views = data
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| PartitionError::corrupt(out, format!("tensor {name}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata: HashMap<String, String> = [
            ("format".to_string(), "pt".to_string()),
            ("producer".to_string(), "zeropp".to_string()),
            ("step".to_string(), self.step().to_string()),
        ]
        .into_iter()
        .collect();
        let bytes = safetensors::serialize(views, Some(metadata))
            .map_err(|e| PartitionError::corrupt(out, format!("cannot serialize: {e}")))?;
        atomic_write(out, &bytes)?;
        Ok(bytes.len() as u64)
    }
}
