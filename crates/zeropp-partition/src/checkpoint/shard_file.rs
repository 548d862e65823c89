//! One saved shard file, read in one verified pass: opened with its size
//! checked ([`open_pass`]), read through a running crc32c ([`CrcReader`]), its
//! safetensors header parsed and checked against the manifest
//! ([`read_header`]), its tensors copied in [`CHUNK_BYTES`] pieces
//! ([`read_chunks`]), and its size and crc32c compared at the end ([`finish`]).
//! The streaming reader (`stream.rs`) and the export build on these.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use super::format::{
    EXTRA_PREFIX, VALUE_TENSORS, check_shard_metadata, compare_extras, read_header_json, tensor_name,
};
use super::manifest::{Manifest, ShardRecord};
use crate::error::{PartitionError, Result};
use crate::plan::PartitionPlan;

/// Size of the read buffer of the streaming paths (bytes): the only
/// per-read allocation besides the state being built.
pub const CHUNK_BYTES: usize = 64 * 1024;

/// A reader that keeps a running crc32c and byte count of what passes through.
pub(super) struct CrcReader<R> {
    inner: R,
    crc: u32,
    /// Bytes read so far (the position in the file).
    pub(super) bytes: u64,
}

impl<R: Read> Read for CrcReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let got = buf.get(..n).unwrap_or_default();
        self.crc = crc32c::crc32c_append(self.crc, got);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A shard file's parsed and checked header.
#[derive(Debug)]
pub(super) struct ShardHeader {
    /// Byte offset of the data section (8 + header length).
    pub(super) data_start: u64,
    /// Every tensor by name.
    pub(super) tensors: HashMap<String, TensorInfo>,
}

impl ShardHeader {
    /// Absolute byte range of `count` elements of `size` bytes from element
    /// `elem` of `tensor`, checked against the tensor's extent.
    pub(super) fn byte_range(
        &self,
        path: &Path,
        tensor: &str,
        elem: usize,
        count: usize,
        size: usize,
    ) -> Result<(u64, usize)> {
        let info = self
            .tensors
            .get(tensor)
            .ok_or_else(|| PartitionError::corrupt(path, format!("tensor {tensor} is missing")))?;
        let (start, end) = info.data_offsets;
        let from = start + elem * size;
        let len = count * size;
        if from + len > end {
            return Err(PartitionError::corrupt(
                path,
                format!(
                    "tensor {tensor} holds {} bytes, {len} wanted from byte {}",
                    end - start,
                    elem * size
                ),
            ));
        }
        Ok((self.data_start + from as u64, len))
    }
}

/// The saved shard file `rec` opened for one verified pass: its size is
/// checked now, its crc32c by [`finish`] at the end.
pub(super) fn open_pass(path: &Path, rec: &ShardRecord) -> Result<CrcReader<BufReader<File>>> {
    let f = File::open(path).map_err(|e| PartitionError::io(path, e))?;
    let size = f.metadata().map_err(|e| PartitionError::io(path, e))?.len();
    if size != rec.size {
        return Err(PartitionError::SizeMismatch {
            path: path.to_path_buf(),
            expected: rec.size,
            actual: size,
        });
    }
    Ok(CrcReader { inner: BufReader::with_capacity(CHUNK_BYTES, f), crc: 0, bytes: 0 })
}

/// Reads the rest of a pass and checks the file's size and crc32c. `outcome`
/// is what the pass found so far: a checksum mismatch takes precedence over
/// it (a corrupted header or tensor is reported as the corruption it is).
pub(super) fn finish<R: Read, T>(
    path: &Path,
    rec: &ShardRecord,
    mut r: CrcReader<R>,
    outcome: Result<T>,
) -> Result<T> {
    let drained = io::copy(&mut r, &mut io::sink());
    if r.crc != rec.crc32c && r.bytes == rec.size {
        return Err(PartitionError::ChecksumMismatch {
            path: path.to_path_buf(),
            expected: rec.crc32c,
            actual: r.crc,
        });
    }
    let value = outcome?;
    drained.map_err(|e| PartitionError::io(path, e))?;
    if r.bytes != rec.size {
        return Err(PartitionError::SizeMismatch {
            path: path.to_path_buf(),
            expected: rec.size,
            actual: r.bytes,
        });
    }
    if r.crc != rec.crc32c {
        return Err(PartitionError::ChecksumMismatch {
            path: path.to_path_buf(),
            expected: rec.crc32c,
            actual: r.crc,
        });
    }
    Ok(value)
}

/// Reads and checks the header of saved shard file `rec` from the start of
/// `r`: safetensors structure, metadata (format, rank, world, step), every
/// bucket's tensors with the saved dtypes and lengths, and exactly the
/// extras the manifest lists for that rank.
pub(super) fn read_header<R: Read>(
    r: &mut R,
    path: &Path,
    rec: &ShardRecord,
    manifest: &Manifest,
    saved: &PartitionPlan,
) -> Result<ShardHeader> {
    let bad = |reason: String| PartitionError::corrupt(path, reason);
    let header = read_header_json(r, path)?;
    let meta: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    let data_start = 8 + header.len() as u64;
    drop(header);
    if data_start + meta.data_len() as u64 != rec.size {
        return Err(bad(format!(
            "the header describes {} data bytes after {data_start} header bytes, the file has {}",
            meta.data_len(),
            rec.size
        )));
    }
    let info = meta.metadata().clone().unwrap_or_default();
    check_shard_metadata(&info, rec.rank, saved.world(), manifest.step).map_err(bad)?;
    let tensors: HashMap<String, TensorInfo> =
        meta.tensors().into_iter().map(|(name, t)| (name, t.clone())).collect();
    for b in 0..saved.num_buckets() {
        let n = saved.shard_len(b)?;
        let wanted = VALUE_TENSORS.iter().map(|w| (*w, Dtype::F32, n)).chain([("step", Dtype::U64, 1)]);
        for (what, dtype, len) in wanted {
            let name = tensor_name(b, what);
            let t = tensors.get(&name).ok_or_else(|| bad(format!("tensor {name} is missing")))?;
            if t.dtype != dtype || t.shape != [len] {
                return Err(bad(format!(
                    "tensor {name} is {:?}{:?}, expected {dtype:?}[{len}]",
                    t.dtype, t.shape
                )));
            }
        }
    }
    let found = tensors
        .iter()
        .filter_map(|(name, t)| {
            name.strip_prefix(EXTRA_PREFIX).map(|n| (n.to_string(), (t.dtype, t.shape.clone())))
        })
        .collect();
    compare_extras(&found, manifest.extras_of(rec.rank)).map_err(bad)?;
    Ok(ShardHeader { data_start, tensors })
}

/// Reads `len` bytes from `r` in [`CHUNK_BYTES`] pieces, handing each to
/// `sink` (every piece but the last a multiple of 8 bytes long).
pub(super) fn read_chunks<R: Read>(
    r: &mut R,
    mut len: usize,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]),
) -> io::Result<()> {
    while len > 0 {
        let k = len.min(buf.len());
        let piece = &mut buf[..k];
        r.read_exact(piece)?;
        sink(piece);
        len -= k;
    }
    Ok(())
}

/// Little-endian f32s of `bytes` into `dst`, from its start.
pub(super) fn put_f32(dst: &mut [f32], bytes: &[u8]) {
    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}
