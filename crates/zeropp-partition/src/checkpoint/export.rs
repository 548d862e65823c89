//! Exporting the master weights as one safetensors file: from a consolidated
//! [`Checkpoint`], or streamed from the shard files by a [`CheckpointReader`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use safetensors::tensor::{Dtype, TensorInfo, TensorView};

use super::CHUNK_BYTES;
use super::format::{MAX_HEADER_BYTES, tensor_name};
use super::fs::{atomic_write, atomic_write_with};
use super::load::Checkpoint;
use super::stream::CheckpointReader;
use crate::error::{PartitionError, Result};
use crate::layout::DType;

impl Checkpoint {
    /// Writes the master weights as one consolidated safetensors file:
    /// one tensor per parameter, named by parameter name, with its shape and
    /// declared dtype (f32 masters rounded to nearest for bf16/f16), padding
    /// stripped. Written atomically. Returns the file size in bytes.
    pub fn export_safetensors(&self, out: &Path) -> Result<u64> {
        let mut data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (layout, full) in self.reader.manifest().buckets.iter().zip(&self.buckets) {
            for (p, range) in layout.compact_ranges() {
                let vals = full.master.get(range).ok_or_else(|| {
                    PartitionError::LayoutMismatch(format!("parameter {:?} out of bounds", p.name))
                })?;
                let dtype = export_dtype(p.dtype);
                let mut bytes = Vec::with_capacity(vals.len() * dtype.bitsize() / 8);
                encode_as(dtype, vals.iter().copied(), &mut bytes);
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
            ("step".to_string(), self.reader.step().to_string()),
        ]
        .into_iter()
        .collect();
        let bytes = safetensors::serialize(views, Some(metadata))
            .map_err(|e| PartitionError::corrupt(out, format!("cannot serialize: {e}")))?;
        atomic_write(out, &bytes)?;
        Ok(bytes.len() as u64)
    }
}

impl CheckpointReader {
    /// Writes the master weights as one consolidated safetensors file, like
    /// [`Checkpoint::export_safetensors`] (same tensors, names, dtypes,
    /// shapes, bytes and metadata; the metadata keys in sorted order), but
    /// streamed: every shard file is first verified in one streaming pass
    /// (as [`CheckpointReader::verify`]), then the header is written, then
    /// each tensor's values are read from the shard files that hold them
    /// ([`CHUNK_BYTES`] at a time), converted and appended. Peak memory is a
    /// few such buffers and the headers, not the model. Written atomically.
    /// Returns the file size in bytes.
    pub fn export_safetensors(&self, out: &Path) -> Result<u64> {
        let headers = self.verify_all()?;
        let saved = self.saved_plan();
        // (name, dtype, shape, bucket, parameter) in the order of
        // `safetensors::serialize`: by descending dtype, then by name.
        let mut tensors: Vec<(&str, Dtype, &[usize], usize, usize)> = Vec::new();
        for (b, layout) in saved.buckets().iter().enumerate() {
            for (i, p) in layout.params.iter().enumerate() {
                tensors.push((&p.name, export_dtype(p.dtype), &p.shape, b, i));
            }
        }
        tensors.sort_by(|l, r| r.1.cmp(&l.1).then(l.0.cmp(r.0)));
        let header = export_header(out, self.step(), &tensors)?;
        let mut files: Vec<Option<File>> = (0..saved.world()).map(|_| None).collect();
        let mut total = 0u64;
        atomic_write_with(out, |w| {
            let write_err = |e: std::io::Error| PartitionError::io(out, e);
            w.write_all(&(header.len() as u64).to_le_bytes()).map_err(write_err)?;
            w.write_all(&header).map_err(write_err)?;
            total = 8 + header.len() as u64;
            let mut buf = vec![0u8; CHUNK_BYTES];
            let mut conv = Vec::with_capacity(CHUNK_BYTES);
            for &(_, dtype, _, b, i) in &tensors {
                let layout = saved.bucket(b)?;
                let p = layout.params.get(i).ok_or_else(|| {
                    PartitionError::LayoutMismatch(format!("bucket {b} has no parameter {i}"))
                })?;
                let len_s = saved.shard_len(b)?;
                let (mut x, end) = (p.offset, p.offset + p.numel);
                while x < end && len_s > 0 {
                    let s = x / len_s;
                    let stop = end.min((s + 1) * len_s);
                    let rec = self.manifest().shards.get(s).ok_or_else(|| {
                        PartitionError::LayoutMismatch(format!(
                            "element {x} of bucket {b} is past the saved shards"
                        ))
                    })?;
                    let path = self.dir().join(&rec.file);
                    let header = headers.get(s).ok_or_else(|| PartitionError::corrupt(&path, "no header"))?;
                    let (from, mut len) =
                        header.byte_range(&path, &tensor_name(b, "master"), x - s * len_s, stop - x, 4)?;
                    let slot = files.get_mut(s).ok_or_else(|| PartitionError::corrupt(&path, "no file"))?;
                    let f = match slot {
                        Some(f) => f,
                        None => slot.insert(File::open(&path).map_err(|e| PartitionError::io(&path, e))?),
                    };
                    let read_err = |e: std::io::Error| PartitionError::io(&path, e);
                    f.seek(SeekFrom::Start(from)).map_err(read_err)?;
                    while len > 0 {
                        let k = len.min(buf.len());
                        let piece = buf.get_mut(..k).unwrap_or_default();
                        f.read_exact(piece).map_err(read_err)?;
                        let bytes: &[u8] = if dtype == Dtype::F32 {
                            piece
                        } else {
                            conv.clear();
                            let vals =
                                piece.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                            encode_as(dtype, vals, &mut conv);
                            &conv
                        };
                        w.write_all(bytes).map_err(write_err)?;
                        total += bytes.len() as u64;
                        len -= k;
                    }
                    x = stop;
                }
            }
            Ok(())
        })?;
        Ok(total)
    }
}

/// The safetensors dtype a parameter is exported in.
fn export_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// Appends `vals` to `out` in export dtype `dtype`: little-endian f32, or
/// rounded to nearest bf16 or f16 (the only dtypes [`export_dtype`] gives).
fn encode_as(dtype: Dtype, vals: impl Iterator<Item = f32>, out: &mut Vec<u8>) {
    match dtype {
        Dtype::BF16 => out.extend(vals.flat_map(|x| half::bf16::from_f32(x).to_le_bytes())),
        Dtype::F16 => out.extend(vals.flat_map(|x| half::f16::from_f32(x).to_le_bytes())),
        _ => out.extend(vals.flat_map(f32::to_le_bytes)),
    }
}

/// The export's safetensors header, as `safetensors::serialize` writes it
/// (JSON: `__metadata__` first, then the tensors in order, padded with
/// spaces to a multiple of 8 bytes), the metadata keys sorted.
fn export_header(
    out: &Path,
    step: u64,
    tensors: &[(&str, Dtype, &[usize], usize, usize)],
) -> Result<Vec<u8>> {
    let json =
        |e: serde_json::Error| PartitionError::corrupt(out, format!("cannot serialize the header: {e}"));
    let metadata: BTreeMap<&str, String> =
        [("format", "pt".to_string()), ("producer", "zeropp".to_string()), ("step", step.to_string())]
            .into_iter()
            .collect();
    let mut h = format!("{{\"__metadata__\":{}", serde_json::to_string(&metadata).map_err(json)?);
    let mut offset = 0usize;
    for &(name, dtype, shape, _, _) in tensors {
        let numel: usize = shape.iter().product();
        let n = numel * dtype.bitsize() / 8;
        let info = TensorInfo { dtype, shape: shape.to_vec(), data_offsets: (offset, offset + n) };
        offset += n;
        h.push(',');
        h.push_str(&serde_json::to_string(name).map_err(json)?);
        h.push(':');
        h.push_str(&serde_json::to_string(&info).map_err(json)?);
    }
    h.push('}');
    let mut bytes = h.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    if bytes.len() > MAX_HEADER_BYTES {
        return Err(PartitionError::corrupt(out, "safetensors header too large"));
    }
    Ok(bytes)
}
